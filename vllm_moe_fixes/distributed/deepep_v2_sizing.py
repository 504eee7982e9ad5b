"""DeepEP V2's ``ElasticBuffer`` sizing and limits, in pure Python (no torch).

Read from DeepEP's main branch at commit dd758caf (``deep_ep.__version__ == "2.1.0"``):

- ``ElasticBuffer.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk=0,
  use_fp8_dispatch=False, allow_hybrid_mode=True, allow_multiple_reduction=True)``
  (``deep_ep/buffers/elastic.py``) calls ``calculate_elastic_buffer_size`` =
  ``ElasticBuffer::calculate_buffer_size`` (``csrc/elastic/buffer.hpp``): the larger of the
  dispatch and combine buffer layouts (``get_dispatch_buffer_size``,
  ``get_combine_buffer_size``), rounded up to 2 MiB (``symmetric::kNumAlignmentBytes``).
  ``num_topk == 0`` sizes for 32, the kernels' largest top-k.
- The layouts depend on the group's topology, which V2 reads from NCCL: the ranks one NVLink
  domain holds (NCCL's LSA team, ``nccl::get_physical_domain_size``), and
  ``nccl::get_logical_domain_size``: hybrid mode splits the ranks into scale-out (RDMA) x
  scale-up (NVLink) domains, otherwise all ranks are one scale-up domain.
- One token's slot (``layout::TokenLayout``, no mbarrier in the buffers): the row
  (hidden x element bytes), the scale packs (4 bytes each; the hint counts ceil(hidden / 32) of
  them for FP8) and the metadata (dispatch: top-k int32 ids, float32 weights, the source token
  index and k linked-list slots; combine: ids and weights), each part rounded up to 32 bytes.
- Every dispatch and combine asserts that the buffer holds its layout for the call's N, hidden,
  top-k and scale packs: a buffer sized for smaller values fails there, as v1.2.1's low-latency
  ``layout.total_bytes <= num_rdma_bytes`` did.
- Limits (host asserts and kernel static asserts): ranks <= 1024, experts <= 2048 and a multiple
  of the ranks, local experts <= 256 (``layout::WorkspaceLayout``), top-k <= 32 (``kNumTopk <=
  32`` in the dispatch / combine kernels), rows of a multiple of 32 bytes (``TokenLayout``: bf16
  hidden % 16, FP8 hidden % 32), tokens per call <= N, ranks a multiple of the NVLink domain.
- Beside ``num_bytes`` the buffer maps a workspace (``WorkspaceLayout::get_num_bytes()`` rounded
  up to 2 MiB) in the same NCCL symmetric window, and pins as much host memory again.

``tests/test_deepep_v2_sizing.py`` pins values worked by hand from these formulas and, where
DeepEP V2 and a GPU group are present, compares with DeepEP's own hint.
"""

from __future__ import annotations

from vllm_moe_fixes._validate import check_experts_per_rank, check_positive_int
from vllm_moe_fixes.sizes import align_up, cdiv

MiB = 2**20
# Every ElasticBuffer size (and its workspace) is a multiple of this
# (symmetric::kNumAlignmentBytes).
ELASTIC_ALIGNMENT = 2 * MiB
# Each part of a token's slot is rounded up to this many bytes (ptx::kNumTMAAlignBytes).
TMA_ALIGNMENT = 32
# A scale pack: one float32 scale or four UE8M0 exponents (sf_pack_t).
SF_PACK_BYTES = 4
# Largest top-k of the kernels; also what the hint sizes for when num_topk is 0.
MAX_TOPK = 32
# layout::WorkspaceLayout's fixed maxima.
MAX_RANKS = 1024
MAX_EXPERTS = 2048
MAX_EXPERTS_PER_RANK = 256
MAX_INFLIGHT_AGRS = 32
# Channel slack of the hybrid (scale-out) buffers: ElasticBuffer's kNumMaxChannels = 8 x 160 SMs.
HYBRID_MAX_CHANNELS = 8 * 160
# The workspace's channel count (deep_ep::kNumMaxChannels, used by WorkspaceLayout).
WORKSPACE_MAX_CHANNELS = 1024
# Ranks one NVLink domain holds when the caller does not say (one 8-GPU node).
DEFAULT_NVL_RANKS = 8


def workspace_bytes() -> int:
    """``WorkspaceLayout::get_num_bytes()``: barrier signals, per-rank / per-expert counters,
    per-channel tails and AGRS signals (int64 = 8, int32 = 4 bytes)."""
    r, e, c = MAX_RANKS, MAX_EXPERTS, WORKSPACE_MAX_CHANNELS
    return (16 + (r + e) * 8 + r * 8 * 2 + e * 8 * 2 + r * 4 + r * 4 * 2 + e * 4 * 2
            + r * c * 8 + r * c * 4 + 2 * 2 * 8 + (MAX_INFLIGHT_AGRS + 1) * r * 4)


def token_bytes(hidden_bytes: int, sf_bytes: int, num_topk: int, with_metadata: bool) -> int:
    """One token's slot in a buffer (``TokenLayout::get_num_bytes<false>``)."""
    if hidden_bytes % TMA_ALIGNMENT:
        raise ValueError(f"a row of {hidden_bytes} bytes: DeepEP V2 needs rows of a multiple of "
                         f"{TMA_ALIGNMENT} bytes (bf16 hidden % 16, FP8 hidden % 32)")
    meta = num_topk * 8 + ((1 + num_topk) * 4 if with_metadata else 0)
    return sum(align_up(b, TMA_ALIGNMENT) for b in (hidden_bytes, sf_bytes, meta))


def domains(num_ranks: int, num_nvl_ranks: int | None = None,
            allow_hybrid_mode: bool = True) -> tuple[int, int, bool]:
    """(scale-out ranks, scale-up ranks, whether scale-up is the NVLink domain) of a group.

    Arguments:
        num_ranks: ranks of the group.
        num_nvl_ranks: ranks of one NVLink domain (None: all of them up to 8 ranks, else 8).
        allow_hybrid_mode: ElasticBuffer's flag: hybrid mode splits scale-out x scale-up.
    """
    check_positive_int("num_ranks", num_ranks)
    if num_nvl_ranks is None:
        num_nvl_ranks = min(num_ranks, DEFAULT_NVL_RANKS)
    check_positive_int("num_nvl_ranks", num_nvl_ranks)
    if num_ranks % num_nvl_ranks:
        raise ValueError(f"num_ranks={num_ranks} must be a multiple of the NVLink domain "
                         f"num_nvl_ranks={num_nvl_ranks} (DeepEP V2's physical domains)")
    rdma = num_ranks // num_nvl_ranks
    scaleout, scaleup = (rdma, num_nvl_ranks) if allow_hybrid_mode else (1, num_ranks)
    return scaleout, scaleup, scaleup == num_nvl_ranks


def dispatch_buffer_bytes(n: int, hidden: int, *, elem_bytes: int, num_sf_packs: int,
                          num_topk: int, scaleout: int, scaleup: int, nvlink: bool) -> int:
    """``get_dispatch_buffer_size``: direct (one scale-out rank) or hybrid send/recv areas."""
    tok = token_bytes(hidden * elem_bytes, num_sf_packs * SF_PACK_BYTES, num_topk, True)
    if scaleout == 1:
        return tok * n * ((0 if nvlink else 1) + scaleup)
    return tok * (scaleup * scaleout * n + n + scaleout * (n + HYBRID_MAX_CHANNELS))


def combine_buffer_bytes(n: int, hidden: int, *, num_topk: int, scaleout: int, scaleup: int,
                         nvlink: bool, allow_multiple_reduction: bool = True) -> int:
    """``get_combine_buffer_size`` (bf16 rows): direct or hybrid send/recv areas."""
    tok = token_bytes(hidden * 2, 0, num_topk, False)
    multi = allow_multiple_reduction
    if scaleout == 1:
        ranks = scaleup
        send_ranks = 0 if nvlink else ranks
        send = tok * send_ranks * n * (1 if multi else num_topk)
        recv = tok * (min(ranks, num_topk) if multi else num_topk) * n
        return send + recv
    up = min(scaleup, num_topk) if multi else num_topk
    out = min(scaleout, num_topk) if multi else num_topk
    return tok * (up * scaleout * n + out * n
                  + (1 if multi else num_topk) * scaleout * (n + HYBRID_MAX_CHANNELS))


def elastic_buffer_size_hint(num_max_tokens_per_rank: int, hidden: int, *, num_ranks: int,
                             num_nvl_ranks: int | None = None, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
    """DeepEP V2's ``ElasticBuffer.get_buffer_size_hint`` in bytes (a multiple of 2 MiB).

    Arguments:
        num_max_tokens_per_rank: N, most tokens one rank dispatches per call.
        hidden: hidden size H.
        num_ranks: ranks of the group; num_nvl_ranks: ranks per NVLink domain (see ``domains``).
        num_topk: k (0: size for 32, as DeepEP does).
        use_fp8_dispatch: dispatch FP8 rows with ceil(H/32) scale packs (else bf16 rows).
        allow_hybrid_mode, allow_multiple_reduction: ElasticBuffer's flags.
    """
    check_positive_int("num_max_tokens_per_rank", num_max_tokens_per_rank)
    check_positive_int("hidden", hidden)
    if isinstance(num_topk, bool) or not isinstance(num_topk, int) or not 0 <= num_topk <= MAX_TOPK:
        raise ValueError(f"num_topk={num_topk!r} must be an int in [0, {MAX_TOPK}]")
    k = num_topk or MAX_TOPK
    scaleout, scaleup, nvlink = domains(num_ranks, num_nvl_ranks, allow_hybrid_mode)
    topo = dict(scaleout=scaleout, scaleup=scaleup, nvlink=nvlink)
    n = num_max_tokens_per_rank
    dispatch = dispatch_buffer_bytes(
        n, hidden, elem_bytes=1 if use_fp8_dispatch else 2,
        num_sf_packs=cdiv(hidden, 32) if use_fp8_dispatch else 0, num_topk=k, **topo)
    combine = combine_buffer_bytes(n, hidden, num_topk=k,
                                   allow_multiple_reduction=allow_multiple_reduction, **topo)
    return align_up(max(dispatch, combine), ELASTIC_ALIGNMENT)


def check_elastic_config(*, num_ranks: int, max_tokens_per_rank: int, hidden: int,
                         num_experts: int, num_topk: int = 0, use_fp8_dispatch: bool = True,
                         num_nvl_ranks: int | None = None) -> int:
    """Raise ``ValueError`` (numbers included) where DeepEP V2 refuses this configuration;
    otherwise return the ``ElasticBuffer`` bytes its hint gives (default flags).

    Arguments: as ``elastic_buffer_size_hint``; num_experts: global expert count E.
    """
    check_positive_int("num_ranks", num_ranks)
    if num_ranks > MAX_RANKS:
        raise ValueError(f"num_ranks={num_ranks}: DeepEP V2 takes at most {MAX_RANKS} ranks")
    local_num_experts = check_experts_per_rank(num_experts, num_ranks)
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts={num_experts}: DeepEP V2 takes at most {MAX_EXPERTS}")
    if local_num_experts > MAX_EXPERTS_PER_RANK:
        raise ValueError(f"num_experts / num_ranks = {num_experts} / {num_ranks} = "
                         f"{local_num_experts} local experts; DeepEP V2 takes at most "
                         f"{MAX_EXPERTS_PER_RANK} per rank")
    if hidden % (32 if use_fp8_dispatch else 16):
        raise ValueError(f"hidden={hidden}: DeepEP V2 needs rows of a multiple of 32 bytes "
                         f"(hidden % {32 if use_fp8_dispatch else 16} == 0 for "
                         f"{'FP8' if use_fp8_dispatch else 'bf16'} dispatch, hidden % 16 for the "
                         "bf16 combine)")
    return elastic_buffer_size_hint(max_tokens_per_rank, hidden, num_ranks=num_ranks,
                                    num_nvl_ranks=num_nvl_ranks, num_topk=num_topk,
                                    use_fp8_dispatch=use_fp8_dispatch)


def elastic_buffer_footprint_bytes(num_bytes: int) -> int:
    """Device bytes an ``ElasticBuffer(num_bytes=...)`` maps at least: the buffer plus its
    workspace, both in 2 MiB steps. NCCL's own device state (communicator, GIN queues) comes on
    top and has not been measured here."""
    return align_up(num_bytes, ELASTIC_ALIGNMENT) + align_up(workspace_bytes(), ELASTIC_ALIGNMENT)
