"""Buffer sizes of the MoE layer, in plain Python (no torch import: the planner uses these), and
the integer roundings every module shares (`cdiv`, `align_up`; Triton kernels use tl.cdiv).

All shapes are in bf16 ELEMENTS. I is the intermediate size (w1 [E_l, 2I, K], w2 [E_l, K, I]),
K the hidden size, E_l the number of local experts (local_num_experts).

Contiguous layout (TritonExperts / DeepGemmExperts, see ops/permute.py): M tokens routed to topk
experts each give M*topk slots; every local expert's segment starts at a multiple of ROW_ALIGNMENT
rows, so M_sum = round_up(M*topk + E_l*(ROW_ALIGNMENT-1), ROW_ALIGNMENT) rows hold them all. The
layout's int32 index vectors (m_indices and src_row [M_sum], dest [M*topk], per-chunk expert
counts of at most M_sum entries) take at most 4*M_sum int32 = LAYOUT_INDEX_COLUMNS bf16 elements
per row. The contiguous experts take what a rank received in passes of at most experts_pass_tokens
tokens (VLLM_FUSED_MOE_CHUNK_SIZE), so M_sum is that of one pass, whatever the routing.

Batched layout (BatchedTritonExperts / BatchedDeepGemmExperts, see fused_moe/batched_experts.py):
T rows per local expert slice: the dispatch's capacity (ranks x tokens per rank), so these shapes
are bounded whatever the routing.
"""

from __future__ import annotations

# Every expert's segment of the contiguous layout starts at a multiple of this many rows
# (DeepGEMM's M alignment of that layout: no GEMM tile spans two experts). It only happens to equal
# SCALE_BLOCK.
ROW_ALIGNMENT = 128
# Channels per FP8 activation scale group and side of a weight scale block. Defined here, in plain
# Python, for the planner; the kernels import it as vllm_moe_fixes.ops.fp8.SCALE_BLOCK.
SCALE_BLOCK = 128
LAYOUT_INDEX_COLUMNS = 8  # bf16 elements per M_sum row holding the layout's int32 index vectors


def cdiv(a: int, b: int) -> int:
    """Ceil division of integers (b > 0). Plain Python on purpose: triton.cdiv is a
    ConstexprFunction in triton 3.6 and 3.9 and costs ~2 us per host call."""
    return -(-a // b)


def align_up(n: int, alignment: int) -> int:
    """The smallest multiple of `alignment` that is >= n (elementwise for an integer tensor n)."""
    return -(-n // alignment) * alignment


def contiguous_num_rows(num_slots: int, local_num_experts: int) -> int:
    """M_sum = round_up(num_slots + local_num_experts * 127, 128): rows of the contiguous layout."""
    return align_up(num_slots + local_num_experts * (ROW_ALIGNMENT - 1), ROW_ALIGNMENT)


def _fp8_with_scales_columns(cols: int) -> int:
    """bf16 elements per row holding `cols` fp8 bytes and their cols/128 float32 scales."""
    return cdiv(cols + cols // SCALE_BLOCK * 4, 2)


def contiguous_workspace_shapes(M: int, I: int, K: int, topk: int, local_num_experts: int,
                                experts_pass_tokens: int | None = None):
    """(ws13, ws2, out) element shapes of the contiguous experts for M tokens (the rows of a1q:
    what the rank received), taken in passes of at most `experts_pass_tokens` tokens (None: one
    pass).

    One pass (M <= experts_pass_tokens): ws13 [M_sum, .] holds the permuted input A (K fp8 bytes +
    K/32 scale bytes per row), then the requantised SiLU output G' (I + I/32 bytes per row), then
    the reduced output [M, K] when it is not the layer's own output (so its columns also cover
    M*K / M_sum). ws2 [M_sum, max(2I, K) + LAYOUT_INDEX_COLUMNS] holds GEMM1's output H
    [M_sum, 2I], then GEMM2's output [M_sum, K], followed by the layout's index vectors.

    Several passes: M_sum is that of one pass (experts_pass_tokens tokens), and ws13 holds the
    reduced output [M, K] first (M*K elements, where the modular kernel puts the experts' output)
    and one pass's A / G' after it; ws2 is one pass's. Only the [M, K] output grows with M.

    out is the reduced [M, K].
    """
    passes = experts_pass_tokens is not None and M > experts_pass_tokens
    m_sum = contiguous_num_rows((experts_pass_tokens if passes else M) * topk, local_num_experts)
    scratch = max(_fp8_with_scales_columns(K), _fp8_with_scales_columns(I))
    out_cols = cdiv(M * K, m_sum)
    cols13 = scratch + out_cols if passes else max(scratch, out_cols)
    return (m_sum, cols13), (m_sum, max(2 * I, K) + LAYOUT_INDEX_COLUMNS), (M, K)


def batched_workspace_shapes(T: int, I: int, K: int, local_num_experts: int):
    """(ws13, ws2, out) element shapes of the batched experts for T rows per expert slice.

    ws13 holds H [E_l, T, 2N] (GEMM1's output), later the output Y [E_l, T, K] at its start. ws2
    holds the requantised SiLU output G' (I fp8 bytes = I/2 bf16 elements per row) followed by its
    float32 scales (I/128 per row = I/64 bf16 elements). I and K are multiples of 128 for any
    runnable layer.
    """
    e = local_num_experts
    return (e, T, max(2 * I, K)), (e, T, _fp8_with_scales_columns(I)), (e, T, K)


def layer_declared_bytes(M: int, I: int, K: int, topk: int, local_num_experts: int) -> int:
    """Bytes one contiguous-layout layer call (NoEP + TritonExperts / DeepGemmExperts) of M tokens
    in one pass allocates on top of inputs and weights: the two bf16 workspaces (index vectors
    included), the returned bf16 output [M, K], and prepare's quantised input (fp8 [M, K]) and its
    float32 scales [M, K/128]."""
    ws13, ws2, _ = contiguous_workspace_shapes(M, I, K, topk, local_num_experts)
    workspaces = 2 * (ws13[0] * ws13[1] + ws2[0] * ws2[1])
    return workspaces + 2 * M * K + M * K + 4 * M * (K // SCALE_BLOCK)


def expected_rows_per_expert(max_tokens_per_rank: int | None, num_dispatchers: int, topk: int,
                             num_experts: int, rows_per_expert: int) -> int:
    """Rows a local expert receives on average when every rank dispatches its full capacity:
    max_tokens_per_rank * num_dispatchers * topk / num_experts, bounded to [1, rows_per_expert]
    (T, the slice's capacity; also the answer when max_tokens_per_rank is None). The batched
    experts pass it to DeepGEMM's masked GEMM as its tiling hint (expected_m)."""
    if max_tokens_per_rank is None:
        return max(1, rows_per_expert)
    rows = max_tokens_per_rank * num_dispatchers * topk // num_experts
    return max(1, min(rows_per_expert, rows))
