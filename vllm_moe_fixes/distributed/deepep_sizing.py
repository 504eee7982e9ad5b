"""DeepEP v1.2.1's buffer sizing, the configurations it can serve, and what a buffer costs, in pure
Python (no torch).

The sizing functions reproduce DeepEP v1.2.1's own arithmetic (``csrc/config.hpp``) and its
tuned ``Config`` tables (``deep_ep/buffer.py``) so that a planner can size buffers without a GPU
or DeepEP; ``check_deepep_config`` refuses, with the numbers, every configuration v1.2.1 refuses
at construction or first call (its host assertions and the rank counts / hidden sizes its kernels
are compiled for);
``deepep_buffer_footprint_bytes`` models the device memory a ``deep_ep.Buffer`` really takes.
``tests/test_deepep_sizing.py`` pins known values and, where DeepEP imports, compares with DeepEP's
own hints.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_moe_fixes._validate import check_experts_per_rank, check_positive_int
from vllm_moe_fixes.sizes import align_up

MiB = 2**20
# Ranks one NVLink domain holds; more ranks are split into RDMA "nodes" of 8.
NUM_MAX_NVL_PEERS = 8
# Every DeepEP buffer size is a multiple of this many bytes.
BUFFER_ALIGNMENT = 128
# Most local experts per rank in high-throughput dispatch (the mapped per-expert counters).
NUM_MAX_LOCAL_EXPERTS = 1024
# Intranode notify_dispatch runs one 128-thread block: at most 128 local experts per rank.
INTRANODE_MAX_LOCAL_EXPERTS = 128
# Internode kernels address both buffers with 32-bit ints: each must stay below INT_MAX.
INT32_MAX = 2**31 - 1
# Rank counts with high-throughput kernels (intranode: the ranks; internode: 8 * RDMA nodes of
# 2, 4, 8, 16, 18, 20), every one of which also has a tuned Config.
HT_INTRANODE_RANKS = (2, 4, 8)
HT_INTERNODE_RANKS = (16, 32, 64, 128, 144, 160)
HT_RANKS = HT_INTRANODE_RANKS + HT_INTERNODE_RANKS
# Hidden sizes the low-latency kernels are compiled for.
LL_SUPPORTED_HIDDEN = (2048, 2560, 4096, 5120, 6144, 7168, 8192)
# Largest top-k the low-latency kernels accept.
LL_MAX_TOPK = 11
# Buffer.num_sms's default: SMs used by the normal-mode kernels (two per channel).
DEFAULT_NUM_SMS = 20


@dataclass(frozen=True)
class Config:
    """Mirror of DeepEP's ``Config``: SMs and the per-channel chunk sizes of normal mode.

    As DeepEP does, the RDMA receive chunk is rounded up to a multiple of the send chunk, and a
    config whose chunks cannot work is refused (ValueError).
    """

    num_sms: int
    num_max_nvl_chunked_send_tokens: int
    num_max_nvl_chunked_recv_tokens: int
    num_max_rdma_chunked_send_tokens: int
    num_max_rdma_chunked_recv_tokens: int

    def __post_init__(self) -> None:
        rdma_send = self.num_max_rdma_chunked_send_tokens
        rdma_recv = align_up(self.num_max_rdma_chunked_recv_tokens, rdma_send)
        object.__setattr__(self, "num_max_rdma_chunked_recv_tokens", rdma_recv)
        nvl_send = self.num_max_nvl_chunked_send_tokens
        nvl_recv = self.num_max_nvl_chunked_recv_tokens
        if self.num_sms < 0 or not 0 < nvl_send < nvl_recv or not 0 < rdma_send <= rdma_recv // 2:
            # The last rule keeps room for a sender while the receiver's head update lags.
            raise ValueError(f"{self}: DeepEP needs num_sms >= 0, 0 < nvl send < nvl recv chunk "
                             "and 0 < rdma send chunk <= half the (rounded) rdma recv chunk")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """NVLink buffer bytes DeepEP wants for rows of ``hidden_bytes`` over ``num_ranks``."""
        check_rank_count(num_ranks)
        if num_ranks > NUM_MAX_NVL_PEERS and self.num_sms % 2:
            raise ValueError(f"num_sms={self.num_sms} must be even above {NUM_MAX_NVL_PEERS} ranks")
        rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        slots = (self.num_sms // 2) * nvl_ranks  # channels x peers
        tokens = slots * self.num_max_nvl_chunked_recv_tokens
        # Per slot: (2 * rdma ranks + 3) int counters. Per queued token: the row, an 8-byte source
        # meta, 128 top-k ids (int64) and weights (float32), 128 float32 scales.
        total = (slots * (2 * rdma_ranks + 3) * 4
                 + tokens * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4))
        return align_up(total, BUFFER_ALIGNMENT)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """RDMA buffer bytes of normal mode: 0 within one NVLink domain (<= 8 ranks)."""
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        check_rank_count(num_ranks)
        if self.num_sms % 2:
            raise ValueError(f"num_sms={self.num_sms} must be even above {NUM_MAX_NVL_PEERS} ranks")
        slots = (self.num_sms // 2) * (num_ranks // NUM_MAX_NVL_PEERS)  # channels x RDMA ranks
        tokens = slots * self.num_max_rdma_chunked_recv_tokens
        # Everything is doubled (send and receive halves): (2 * 8 + 2) int counters per slot; per
        # token the row, source meta, 128 ids, 128 weights, 128 scales and one 16-byte control word.
        total = (slots * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
                 + tokens * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4 + 16) * 2)
        return align_up(total, BUFFER_ALIGNMENT)


# DeepEP v1.2.1's tuned chunk sizes: ranks -> (nvl send, nvl recv, rdma send, rdma recv).
_DISPATCH_CHUNKS = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128),
                    16: (36, 288, 20, 128), 24: (8, 288, 32, 128), 32: (32, 288, 32, 128),
                    64: (20, 288, 28, 128), 128: (20, 560, 32, 128), 144: (32, 720, 12, 128),
                    160: (28, 720, 12, 128)}
_COMBINE_CHUNKS = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128),
                   16: (4, 288, 12, 128), 24: (1, 288, 8, 128), 32: (1, 288, 8, 128),
                   64: (1, 288, 20, 128), 128: (1, 560, 12, 128), 144: (2, 720, 8, 128),
                   160: (2, 720, 8, 128)}
# Rank counts DeepEP v1.2.1 has a tuned Config for (24 has one but no kernels).
CONFIG_RANKS = tuple(sorted(_DISPATCH_CHUNKS))


def _config(table: dict, num_ranks: int, num_sms: int) -> Config:
    if num_ranks not in table:
        raise ValueError(f"num_ranks={num_ranks} has no tuned DeepEP v1.2.1 config; supported: "
                         f"{', '.join(map(str, sorted(table)))}")
    return Config(num_sms, *table[num_ranks])


def get_dispatch_config(num_ranks: int, num_sms: int = DEFAULT_NUM_SMS) -> Config:
    """DeepEP's recommended normal-mode dispatch ``Config`` for ``num_ranks`` ranks."""
    return _config(_DISPATCH_CHUNKS, num_ranks, num_sms)


def get_combine_config(num_ranks: int, num_sms: int = DEFAULT_NUM_SMS) -> Config:
    """DeepEP's recommended normal-mode combine ``Config`` for ``num_ranks`` ranks."""
    return _config(_COMBINE_CHUNKS, num_ranks, num_sms)


def _configs(num_ranks: int, num_sms: int) -> tuple[Config, Config]:
    return get_dispatch_config(num_ranks, num_sms), get_combine_config(num_ranks, num_sms)


def check_rank_count(num_ranks: int) -> None:
    """Every DeepEP buffer: fewer than 8 ranks or a multiple of 8 (one NVLink domain is 8)."""
    check_positive_int("num_ranks", num_ranks)
    if num_ranks >= NUM_MAX_NVL_PEERS and num_ranks % NUM_MAX_NVL_PEERS:
        raise ValueError(f"num_ranks={num_ranks}: DeepEP needs fewer than {NUM_MAX_NVL_PEERS} "
                         f"ranks or a multiple of {NUM_MAX_NVL_PEERS}")


def deepep_nvl_bytes(hidden: int, num_ranks: int, *, elem_bytes: int = 2,
                     num_sms: int = DEFAULT_NUM_SMS) -> int:
    """NVLink bytes a normal-mode buffer needs: the larger of the dispatch and combine hints.

    Arguments:
        hidden: hidden size H of a token.
        num_ranks: ranks in the expert-parallel group (one with a tuned config, else ValueError).
        elem_bytes: bytes per element of the widest row sent (2 for bf16).
        num_sms: ``Buffer.num_sms`` (DeepEP's default 20).
    """
    return max(cfg.get_nvl_buffer_size_hint(hidden * elem_bytes, num_ranks)
               for cfg in _configs(num_ranks, num_sms))


def deepep_rdma_bytes(hidden: int, num_ranks: int, *, elem_bytes: int = 2,
                      num_sms: int = DEFAULT_NUM_SMS) -> int:
    """RDMA bytes a normal-mode buffer needs (0 up to 8 ranks); arguments as deepep_nvl_bytes."""
    return max(cfg.get_rdma_buffer_size_hint(hidden * elem_bytes, num_ranks)
               for cfg in _configs(num_ranks, num_sms))


def deepep_ll_rdma_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                         num_experts: int) -> int:
    """DeepEP's ``Buffer.get_low_latency_rdma_size_hint(N, H, R, E)`` (R does not enter it).

    The buffer holds two (odd/even) copies of a send area, a receive area and a signal area:
      dispatch message = 16 + max(2H, H + 4H/128)      (control word; bf16 row, or fp8 row + scales)
      combine message  = 4H/128 + 2H                   (bf16 row + per-128 min/max)
      send   = max(N * dispatch, E * N * combine);  recv = max(E * N * dispatch, E * N * combine)
      signal = align(4E, 128)
      hint   = ((2 * (send + recv + signal) + 128) // 128) * 128   (always adds 128)
    """
    n, h, e = num_max_dispatch_tokens_per_rank, hidden, num_experts
    scales = h // 128
    dispatch_msg = 16 + max(2 * h, h + 4 * scales)
    combine_msg = 4 * scales + 2 * h
    send = max(n * dispatch_msg, e * n * combine_msg)
    recv = max(e * n * dispatch_msg, e * n * combine_msg)
    signal = align_up(4 * e, BUFFER_ALIGNMENT)
    total = 2 * (send + recv + signal)
    return (total + BUFFER_ALIGNMENT) // BUFFER_ALIGNMENT * BUFFER_ALIGNMENT


def check_low_latency_config(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                             num_experts: int) -> int:
    """Raise ``ValueError`` (numbers included) where DeepEP's low-latency mode cannot serve this
    configuration; otherwise return the RDMA bytes it needs (its hint)."""
    n, h, r, e = num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts
    for name, value in (("max_tokens_per_rank", n), ("num_ranks", r), ("num_experts", e)):
        check_positive_int(name, value)
    check_rank_count(r)
    if h not in LL_SUPPORTED_HIDDEN:
        raise ValueError(f"hidden={h} is not supported by DeepEP's low-latency kernels; "
                         f"allowed: {', '.join(map(str, LL_SUPPORTED_HIDDEN))}")
    check_experts_per_rank(e, r)
    if (r * n) % 4:
        raise ValueError(f"num_ranks * max_tokens_per_rank = {r} * {n} = {r * n} must be a "
                         "multiple of 4 (DeepEP's TMA loads of the received scales)")
    return deepep_ll_rdma_bytes(n, h, r, e)


def check_high_throughput_config(hidden: int, num_ranks: int, num_experts: int,
                                 nvl_bytes: int) -> int:
    """Raise ``ValueError`` (numbers included) where DeepEP's high-throughput mode cannot serve
    ``num_ranks`` ranks with rows of ``hidden`` (sent FP8 by dispatch, bf16 by combine), experts
    split over the ranks, and an NVLink buffer of ``nvl_bytes``; otherwise return the RDMA bytes
    it needs (0 up to 8 ranks)."""
    for name, value in (("hidden", hidden), ("num_ranks", num_ranks), ("num_experts", num_experts),
                        ("nvl_bytes", nvl_bytes)):
        check_positive_int(name, value)
    get_dispatch_config(num_ranks)  # a rank count without a tuned config names the supported ones
    if num_ranks not in HT_RANKS:
        raise ValueError(
            f"num_ranks={num_ranks}: DeepEP v1.2.1 has high-throughput kernels for "
            f"{', '.join(map(str, HT_INTRANODE_RANKS))} ranks (intranode) and "
            f"{', '.join(map(str, HT_INTERNODE_RANKS))} (internode) only")
    if hidden % 16:
        raise ValueError(f"hidden={hidden}: DeepEP needs rows of a multiple of 16 bytes "
                         "(FP8 dispatch rows of hidden bytes: hidden % 16 == 0)")
    local = check_experts_per_rank(num_experts, num_ranks)
    most = INTRANODE_MAX_LOCAL_EXPERTS if num_ranks <= NUM_MAX_NVL_PEERS else NUM_MAX_LOCAL_EXPERTS
    if local > most:
        raise ValueError(f"num_experts / num_ranks = {num_experts} / {num_ranks} = {local} local "
                         f"experts; DeepEP's high-throughput dispatch takes at most {most} on "
                         f"{num_ranks} ranks")
    if nvl_bytes % BUFFER_ALIGNMENT:
        raise ValueError(f"nvl_bytes={nvl_bytes} must be a multiple of {BUFFER_ALIGNMENT}")
    need = deepep_nvl_bytes(hidden, num_ranks)
    if nvl_bytes < need:
        raise ValueError(f"VLLM_DEEPEP_BUFFER_SIZE_MB={nvl_bytes / MiB:g} gives {nvl_bytes} NVLink "
                         f"bytes; DeepEP needs {need} for hidden={hidden} on {num_ranks} ranks")
    rdma = deepep_rdma_bytes(hidden, num_ranks)
    if rdma and nvl_bytes >= INT32_MAX:
        raise ValueError(f"VLLM_DEEPEP_BUFFER_SIZE_MB={nvl_bytes / MiB:g} gives {nvl_bytes} NVLink "
                         f"bytes: internode ({num_ranks} ranks) needs fewer than 2**31 - 1 "
                         "(< 2048 MiB), DeepEP's internode kernels address the buffer with 32-bit "
                         "ints")
    if rdma >= INT32_MAX:
        raise ValueError(f"the RDMA buffer for hidden={hidden} on {num_ranks} ranks needs {rdma} "
                         "bytes, at or past DeepEP's internode limit 2**31 - 1")
    return rdma


def check_deepep_config(backend: str, *, num_ranks: int, max_tokens_per_rank: int, hidden: int,
                        num_experts: int, nvl_bytes: int) -> dict:
    """The ``deep_ep.Buffer`` byte counts for ``backend`` on ``num_ranks`` ranks, or ValueError.

    What ``make_all2all_buffer`` builds and what the planner counts, from one set of checks.

    Arguments:
        backend: ``"deepep_high_throughput"`` or ``"deepep_low_latency"``.
        num_ranks: ranks of the expert-parallel group.
        max_tokens_per_rank: most tokens one rank dispatches per call (low latency's N).
        hidden: hidden size H; num_experts: global expert count E.
        nvl_bytes: high-throughput NVLink buffer bytes (VLLM_DEEPEP_BUFFER_SIZE_MB MiB).

    Returns ``{"num_nvl_bytes": int, "num_rdma_bytes": int}``.
    """
    if backend == "deepep_high_throughput":
        rdma = check_high_throughput_config(hidden, num_ranks, num_experts, nvl_bytes)
        return {"num_nvl_bytes": nvl_bytes, "num_rdma_bytes": rdma}
    if backend == "deepep_low_latency":
        rdma = check_low_latency_config(max_tokens_per_rank, hidden, num_ranks, num_experts)
        return {"num_nvl_bytes": 0, "num_rdma_bytes": rdma}
    raise ValueError(f"backend={backend!r} is not a DeepEP backend; allowed: "
                     "deepep_high_throughput, deepep_low_latency")


# --------------------------------------------------------------------------- device footprint
# What creating a deep_ep.Buffer takes from the device beyond num_nvl_bytes / num_rdma_bytes:
# - a 32 MiB workspace (cudaMalloc) per buffer, always;
# - the NVLink buffer plus 8 barrier ints and 16 pointers, one cudaMalloc (2 MiB pages);
# - where num_rdma_bytes > 0 (low-latency, or internode high-throughput), NVSHMEM: DeepEP sets
#   NVSHMEM_CUMEM_GRANULARITY = 2**29, so NVSHMEM's symmetric heap is mapped in 512 MiB steps.
#   Its initialisation maps the first step, where NVSHMEM keeps some buffers of its own, and
#   takes a fixed amount per process beside the heap (device state, transports). An RDMA buffer
#   that fits beside NVSHMEM's own share lives in that first step; a larger one gets a mapping of
#   its own, rounded up to whole steps, and the first step stays.
# The constants below come from eleven low-latency buffers measured on one H200 (DeepEP v1.2.1,
# nvidia-nvshmem-cu13, world size 1, torch.cuda.mem_get_info before and after; the rows are in
# benchmarks/results/deepep_footprint.json, and tests/test_deepep_sizing.py replays them):
# 32 (workspace) + 2338 (fixed) + 512 (first step) [+ the hint rounded up to 512 MiB steps
# when it exceeds the first step's free part, which lies between 512 - 497.7 and 512 - 455 MiB
# of NVSHMEM's own use: NVSHMEM_HEAP_RESERVED_BYTES is taken in that interval].
DEEPEP_WORKSPACE_BYTES = 32 * MiB
CUDA_MALLOC_GRANULE = 2 * MiB
NVSHMEM_HEAP_GRANULARITY = 2**29
NVSHMEM_FIXED_BYTES = 2338 * MiB
NVSHMEM_HEAP_RESERVED_BYTES = 32 * MiB
# Barrier signals (8 ints), buffer and barrier-signal pointers (8 each) after the NVLink buffer.
_NVL_METADATA_BYTES = NUM_MAX_NVL_PEERS * (4 + 8 + 8)


def deepep_buffer_footprint_bytes(num_nvl_bytes: int, num_rdma_bytes: int) -> int:
    """Device bytes that creating ``deep_ep.Buffer(num_nvl_bytes=, num_rdma_bytes=)`` takes on
    each rank (the model above; the first DeepEP buffer of a process, which pays NVSHMEM's fixed
    cost). Both arguments are byte counts >= 0."""
    total = DEEPEP_WORKSPACE_BYTES
    if num_nvl_bytes > 0:
        total += align_up(num_nvl_bytes + _NVL_METADATA_BYTES, CUDA_MALLOC_GRANULE)
    if num_rdma_bytes > 0:
        total += NVSHMEM_FIXED_BYTES + NVSHMEM_HEAP_GRANULARITY
        if NVSHMEM_HEAP_RESERVED_BYTES + num_rdma_bytes > NVSHMEM_HEAP_GRANULARITY:
            total += align_up(num_rdma_bytes, NVSHMEM_HEAP_GRANULARITY)
    return total
