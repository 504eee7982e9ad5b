"""Expert-contiguous row layout for the grouped GEMMs, and its inverse.

The contiguous grouped GEMM (DeepGEMM's `m_grouped_fp8_gemm_nt_contiguous`, or our Triton one)
wants the rows of each local expert next to each other, every expert's segment starting at a
multiple of ALIGNMENT = 128 rows, and an int32 `m_indices` naming the expert of every row (-1 for
padding). With M tokens routed to k experts each there are M*k slots; slot s = m*k + j is token m's
j-th choice. Slots whose expert is not on this rank (expert_map gives -1, or the id is already -1)
get no row at all: their experts' rows are never computed.

Sizes. Expert e with c_e slots takes round_up(c_e, 128) <= c_e + 127 rows, so all segments fit in

    M_sum = round_up(M*k + E_l*127, 128)        (E_l = number of LOCAL experts)

rows; the rows past the last segment are padding too. Everything is computed on the device with
no host synchronisation (no .item(), no boolean indexing), so it is safe under CUDA graphs.

The dump row. Non-local slots must read back exact zeros. They all point at row M_sum - 1, which
is always padding when a non-local slot exists: then at most M*k - 1 slots are local, the segments
use at most (M*k - 1) + E_l*127 < M_sum rows, and since that total is a multiple of 128 it is at
most M_sum - 128. `unpermute` zeroes that row of the GEMM output before gathering, so the zeros do
not depend on what a GEMM writes into -1 rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGNMENT = 128


def contiguous_num_rows(num_slots: int, local_num_experts: int) -> int:
    """M_sum = round_up(num_slots + local_num_experts * 127, 128): rows of the contiguous layout."""
    rows = num_slots + local_num_experts * (ALIGNMENT - 1)
    return (rows + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass
class ContiguousLayout:
    """Where every slot went.

    m_indices: int32 [M_sum], local expert of each permuted row, -1 on padding rows.
    src_token: int64 [M_sum], token whose activations each permuted row holds (0 on padding rows,
        which are zeroed after the gather).
    dest: int64 [M*k], permuted row of each slot; M_sum - 1 (a padding row) for non-local slots.
    """

    m_indices: torch.Tensor
    src_token: torch.Tensor
    dest: torch.Tensor


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """topk_ids int64 [M, k] global ids (-1 allowed) -> int64 [M*k] local ids, -1 = not local.

    expert_map: int32 [E] global -> local id or -1; None means global ids are local ids.
    """
    ids = topk_ids.reshape(-1).to(torch.int64)
    if expert_map is None:
        return ids
    local = expert_map.to(torch.int64)[ids.clamp(min=0)]
    return torch.where(ids >= 0, local, torch.full_like(local, -1))


def build_contiguous_layout(topk_ids: torch.Tensor, local_num_experts: int,
                            expert_map: torch.Tensor | None = None) -> ContiguousLayout:
    """Assign every slot a row of the 128-aligned expert-contiguous layout (see module docstring).

    Args:
        topk_ids: int64 [M, k] global expert ids, -1 = not on this rank.
        local_num_experts: E_l, experts whose weights this rank holds.
        expert_map: int32 [E] global -> local id or -1, or None (all experts local, E == E_l).

    Returns a ContiguousLayout for M_sum = contiguous_num_rows(M*k, E_l). Within an expert, slots
    keep their original order (stable sort), so the layout is deterministic.
    """
    M, k = topk_ids.shape
    num_slots = M * k
    m_sum = contiguous_num_rows(num_slots, local_num_experts)
    dev = topk_ids.device
    local = local_expert_ids(topk_ids, expert_map)

    # Slots per local expert; bin 0 collects the non-local slots (local id -1).
    counts = torch.zeros(local_num_experts + 1, dtype=torch.int64, device=dev)
    counts.index_add_(0, local + 1, torch.ones_like(local))
    num_nonlocal, counts = counts[:1], counts[1:]
    padded = (counts + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    seg_start = torch.cumsum(padded, 0) - padded  # first row of each expert's segment
    # After a stable sort by local id, the -1 slots come first, then expert 0's, expert 1's, ...
    first_sorted = num_nonlocal + torch.cumsum(counts, 0) - counts
    sorted_local, order = torch.sort(local, stable=True)
    e = sorted_local.clamp(min=0)
    rank_in_expert = torch.arange(num_slots, device=dev) - first_sorted[e]
    dest_sorted = torch.where(sorted_local >= 0, seg_start[e] + rank_in_expert,
                              torch.full_like(e, m_sum - 1))
    dest = torch.empty_like(dest_sorted).index_copy_(0, order, dest_sorted)

    # Non-local slots all write -1 into the dump row, which no local slot uses (module docstring).
    m_indices = torch.full((m_sum,), -1, dtype=torch.int32, device=dev)
    m_indices.scatter_(0, dest, local.to(torch.int32))
    slot_token = torch.arange(num_slots, device=dev) // k
    src_token = torch.zeros(m_sum, dtype=torch.int64, device=dev).scatter_(0, dest, slot_token)
    return ContiguousLayout(m_indices=m_indices, src_token=src_token, dest=dest)


def permute_rows(a_q: torch.Tensor, a_s: torch.Tensor, layout: ContiguousLayout,
                 out_q: torch.Tensor, out_s: torch.Tensor) -> None:
    """Gather the quantised activations into the contiguous layout, padding rows zeroed.

    Args:
        a_q: float8_e4m3fn [M, K] contiguous; a_s: float32 [M, K/128], any strides.
        layout: from build_contiguous_layout.
        out_q: float8_e4m3fn [M_sum, K] contiguous (written: padding rows are exact zeros, so a GEMM
            that computes them produces zeros).
        out_s: float32 [M_sum, K/128] with strides (1, M_sum) (MN-major, what DeepGEMM's SM90
            kernels take without a conversion; written, padding rows hold token 0's finite scales).
    """
    out_u8 = out_q.view(torch.uint8)
    torch.index_select(a_q.view(torch.uint8), 0, layout.src_token, out=out_u8)
    out_u8.masked_fill_((layout.m_indices < 0).unsqueeze(1), 0)
    torch.index_select(a_s.t(), 1, layout.src_token, out=out_s.t())


def unpermute_rows(gemm_out: torch.Tensor, layout: ContiguousLayout, out: torch.Tensor) -> None:
    """Scatter GEMM output rows back to slots: out[s] = gemm_out[dest[s]], no new tensor.

    Args:
        gemm_out: [M_sum, K] contiguous; its last row (the dump row) is set to zero here.
        layout: from build_contiguous_layout.
        out: [M, k, K] contiguous, gemm_out's dtype (written; non-local slots get exact zeros).
    """
    gemm_out[-1].zero_()
    torch.index_select(gemm_out, 0, layout.dest, out=out.view(-1, out.shape[-1]))
