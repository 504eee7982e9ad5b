"""DeepEP buffer sizing and the configurations DeepEP can serve, in pure Python (no torch).

The sizing functions reproduce DeepEP v1.2.1's own arithmetic (``csrc/config.hpp`` and the tuned
``Config`` tables of ``deep_ep/buffer.py``) so that a planner can size buffers without a GPU or
DeepEP; ``tests/test_deepep_sizing.py`` pins known values and, where DeepEP imports, compares with
DeepEP's hints.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_moe_fixes._validate import check_experts_per_rank, check_positive_int

# Ranks one NVLink domain holds in DeepEP's normal mode; more ranks are split into RDMA "nodes".
NUM_MAX_NVL_PEERS = 8
# Every DeepEP buffer size is rounded to this many bytes.
BUFFER_ALIGNMENT = 128
# Hidden sizes DeepEP's low-latency kernels are compiled for.
LL_SUPPORTED_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
# Largest top-k the low-latency kernels accept.
LL_MAX_TOPK = 11
# Low-latency buffer offsets are 32-bit counts of 16-byte units.
LL_MAX_RDMA_BYTES = (2**31 - 1) * 16
# Buffer.num_sms's default: SMs used by the normal-mode kernels (two per channel).
DEFAULT_NUM_SMS = 20


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class Config:
    """Mirror of DeepEP's ``Config``: SMs and the per-channel chunk sizes of normal mode.

    As DeepEP does, the RDMA receive chunk is rounded up to a multiple of the send chunk.
    """

    num_sms: int
    num_max_nvl_chunked_send_tokens: int
    num_max_nvl_chunked_recv_tokens: int
    num_max_rdma_chunked_send_tokens: int
    num_max_rdma_chunked_recv_tokens: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_max_rdma_chunked_recv_tokens",
                           _align(self.num_max_rdma_chunked_recv_tokens, self.num_max_rdma_chunked_send_tokens))

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """NVLink buffer bytes DeepEP wants for rows of ``hidden_bytes`` over ``num_ranks`` ranks."""
        check_normal_ranks(num_ranks)
        rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        slots = (self.num_sms // 2) * nvl_ranks  # channels x peers
        tokens = slots * self.num_max_nvl_chunked_recv_tokens
        # Per slot: (2 * rdma ranks + 3) int counters. Per queued token: the row, an 8-byte source
        # meta, 128 top-k ids (int64) and weights (float32), 128 float32 scales.
        total = (slots * (2 * rdma_ranks + 3) * 4
                 + tokens * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4))
        return _align(total, BUFFER_ALIGNMENT)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """RDMA buffer bytes of normal mode: 0 within one NVLink domain (<= 8 ranks)."""
        check_normal_ranks(num_ranks)
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        slots = (self.num_sms // 2) * (num_ranks // NUM_MAX_NVL_PEERS)  # channels x RDMA ranks
        tokens = slots * self.num_max_rdma_chunked_recv_tokens
        # Everything is doubled (send and receive halves): (2 * 8 + 2) int counters per slot; per
        # token the row, source meta, 128 ids, 128 weights, 128 scales and one 16-byte control word.
        total = (slots * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
                 + tokens * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4 + 16) * 2)
        return _align(total, BUFFER_ALIGNMENT)


# DeepEP v1.2.1's tuned chunk sizes: ranks -> (nvl send, nvl recv, rdma send, rdma recv).
_DISPATCH_CHUNKS = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128),
                    16: (36, 288, 20, 128), 24: (32, 288, 8, 128), 32: (32, 288, 8, 128),
                    48: (32, 288, 8, 128), 64: (32, 288, 8, 128), 96: (20, 480, 12, 128),
                    128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
_COMBINE_CHUNKS = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128),
                   16: (4, 288, 12, 128), 24: (1, 288, 8, 128), 32: (1, 288, 8, 128),
                   48: (1, 288, 8, 128), 64: (1, 288, 8, 128), 96: (1, 480, 8, 128),
                   128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


def _config(table: dict, num_ranks: int, num_sms: int) -> Config:
    if num_ranks not in table:
        raise ValueError(f"num_ranks={num_ranks} has no tuned DeepEP config; allowed: {sorted(table)}")
    return Config(num_sms, *table[num_ranks])


def get_dispatch_config(num_ranks: int, num_sms: int = DEFAULT_NUM_SMS) -> Config:
    """DeepEP's recommended normal-mode dispatch ``Config`` for ``num_ranks`` ranks."""
    return _config(_DISPATCH_CHUNKS, num_ranks, num_sms)


def get_combine_config(num_ranks: int, num_sms: int = DEFAULT_NUM_SMS) -> Config:
    """DeepEP's recommended normal-mode combine ``Config`` for ``num_ranks`` ranks."""
    return _config(_COMBINE_CHUNKS, num_ranks, num_sms)


def check_normal_ranks(num_ranks: int) -> None:
    if num_ranks < 1 or (num_ranks > NUM_MAX_NVL_PEERS and num_ranks % NUM_MAX_NVL_PEERS):
        raise ValueError(f"num_ranks={num_ranks}: DeepEP needs fewer than {NUM_MAX_NVL_PEERS} ranks "
                         f"or a multiple of {NUM_MAX_NVL_PEERS}")


def deepep_nvl_bytes(hidden: int, num_ranks: int, *, elem_bytes: int = 2,
                     num_sms: int = DEFAULT_NUM_SMS) -> int:
    """NVLink bytes a normal-mode buffer needs: the larger of the dispatch and combine hints.

    Arguments:
        hidden: hidden size H of a token.
        num_ranks: ranks in the expert-parallel group.
        elem_bytes: bytes per element of the widest row sent (2 for bf16).
        num_sms: ``Buffer.num_sms`` (DeepEP's default 20).
    """
    return max(cfg.get_nvl_buffer_size_hint(hidden * elem_bytes, num_ranks)
               for cfg in (get_dispatch_config(num_ranks, num_sms), get_combine_config(num_ranks, num_sms)))


def deepep_rdma_bytes(hidden: int, num_ranks: int, *, elem_bytes: int = 2,
                      num_sms: int = DEFAULT_NUM_SMS) -> int:
    """RDMA bytes a normal-mode buffer needs (0 up to 8 ranks); arguments as ``deepep_nvl_bytes``."""
    return max(cfg.get_rdma_buffer_size_hint(hidden * elem_bytes, num_ranks)
               for cfg in (get_dispatch_config(num_ranks, num_sms), get_combine_config(num_ranks, num_sms)))


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
    signal = _align(4 * e, BUFFER_ALIGNMENT)
    total = 2 * (send + recv + signal)
    return (total + BUFFER_ALIGNMENT) // BUFFER_ALIGNMENT * BUFFER_ALIGNMENT


def check_low_latency_config(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                             num_experts: int) -> int:
    """Raise ``ValueError`` (numbers included) where DeepEP's low-latency mode cannot serve this
    configuration; otherwise return the RDMA bytes it needs."""
    n, h, r, e = num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts
    for name, value in (("max_tokens_per_rank", n), ("num_ranks", r), ("num_experts", e)):
        check_positive_int(name, value)
    if h not in LL_SUPPORTED_HIDDEN:
        raise ValueError(f"hidden={h} is not supported by DeepEP's low-latency kernels; "
                         f"allowed: {', '.join(map(str, LL_SUPPORTED_HIDDEN))}")
    check_experts_per_rank(e, r)
    if (r * n) % 4:
        raise ValueError(f"num_ranks * max_tokens_per_rank = {r} * {n} = {r * n} must be a multiple of 4")
    need = deepep_ll_rdma_bytes(n, h, r, e)
    if need > LL_MAX_RDMA_BYTES:
        raise ValueError(
            f"the low-latency buffer for max_tokens_per_rank={n}, hidden={h}, num_experts={e} needs "
            f"{need} bytes ({need / 2**30:.1f} GiB); DeepEP addresses it in 32-bit units of 16 bytes, "
            f"so at most {LL_MAX_RDMA_BYTES} bytes (hint/16 = {need // 16} >= 2**31): lower "
            "VLLM_MOE_DP_CHUNK_SIZE or the expert count per group")
    return need
