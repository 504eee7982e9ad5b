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

Gather kernels. `permute_rows` is one Triton kernel on CUDA: it writes every permuted fp8 row
(zeros on padding rows, without reading anything for them) and the MN-major scales in one pass; the
torch reference (`permute_rows_ref`: index_select, masked_fill, index_select) runs on CPU and in
the tests. `unpermute_rows` stays a torch index_select: in an H200 profile of the layer at M=2048
the two index_selects (the old permute's and this one) moved their ~0.7 GB together at ~4 TB/s,
copy speed, so a kernel would save only the one-row zero_ launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_moe_fixes.sizes import ALIGNMENT, contiguous_num_rows



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
    return torch.where(ids >= 0, local, -1)


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
    dest_sorted = torch.where(sorted_local >= 0, seg_start[e] + rank_in_expert, m_sum - 1)
    dest = torch.empty_like(dest_sorted).index_copy_(0, order, dest_sorted)

    # Non-local slots all write -1 into the dump row, which no local slot uses (module docstring).
    m_indices = torch.full((m_sum,), -1, dtype=torch.int32, device=dev)
    m_indices.scatter_(0, dest, local.to(torch.int32))
    slot_token = torch.arange(num_slots, device=dev) // k
    src_token = torch.zeros(m_sum, dtype=torch.int64, device=dev).scatter_(0, dest, slot_token)
    return ContiguousLayout(m_indices=m_indices, src_token=src_token, dest=dest)


# ----------------------------------------------------------------------------------------------
# permute_rows: one Triton gather on CUDA, torch (index_select + masked_fill) as the reference
# ----------------------------------------------------------------------------------------------
@triton.jit
def _permute_rows_kernel(a_ptr, a_s_ptr, src_ptr, m_idx_ptr, out_ptr, out_s_ptr, M_sum, K, G,
                         stride_am, stride_asm, stride_asg, stride_om, stride_osm, stride_osg,
                         BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
    """Program (i, j) writes bytes [j, j+1) * BLOCK_K of out rows [i, i+1) * BLOCK_R.

    The fp8 rows are moved as raw bytes (uint8): out[r] = a[src[r]] where m_idx[r] >= 0, zeros
    elsewhere (the load is masked off, so padding rows read nothing). K and the row strides are
    multiples of 16, which Triton sees, so each thread moves 16-byte vectors; a [BLOCK_R, BLOCK_K]
    tile keeps BLOCK_R * BLOCK_K bytes in flight per program. Programs of the first column (j == 0)
    also copy the G = K/128 scales of their rows: out_s[r, g] = a_s[src[r], g] (every row: padding
    rows hold their src row's finite scales, like the reference). Row offsets are int64.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < M_sum
    src = tl.load(src_ptr + rows, mask=in_range, other=0).to(tl.int64)
    used = tl.load(m_idx_ptr + rows, mask=in_range, other=-1) >= 0
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = (cols < K)[None, :]
    x = tl.load(a_ptr + src[:, None] * stride_am + cols[None, :], mask=used[:, None] & col_ok,
                other=0)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], x,
             mask=in_range[:, None] & col_ok)
    if tl.program_id(1) == 0:
        g = tl.arange(0, BLOCK_G).to(tl.int64)
        mask = in_range[:, None] & (g < G)[None, :]
        s = tl.load(a_s_ptr + src[:, None] * stride_asm + g[None, :] * stride_asg, mask=mask)
        tl.store(out_s_ptr + rows[:, None] * stride_osm + g[None, :] * stride_osg, s, mask=mask)


def permute_rows_triton(a_q: torch.Tensor, a_s: torch.Tensor, layout: ContiguousLayout,
                        out_q: torch.Tensor, out_s: torch.Tensor, *, block_rows: int = 8,
                        block_k: int = 1024, num_warps: int = 4) -> None:
    """Launch `_permute_rows_kernel` on validated tensors (CUDA, or CPU under TRITON_INTERPRET=1).

    Same arguments as `permute_rows`. block_rows, block_k (powers of two; block_k is capped at
    K's next power of two) and num_warps set the tile: the default 8 x 1024 bytes with 4 warps is
    64 bytes (four 16-byte vectors) per thread and divides K = 7168 evenly.
    """
    m_sum, K = out_q.shape
    if m_sum == 0:
        return
    G = a_s.shape[1]
    block_k = min(block_k, triton.next_power_of_2(K))
    grid = (triton.cdiv(m_sum, block_rows), triton.cdiv(K, block_k))
    _permute_rows_kernel[grid](
        a_q.view(torch.uint8), a_s, layout.src_token, layout.m_indices, out_q.view(torch.uint8),
        out_s, m_sum, K, G, a_q.stride(0), a_s.stride(0), a_s.stride(1), out_q.stride(0),
        out_s.stride(0), out_s.stride(1), BLOCK_R=block_rows, BLOCK_K=block_k,
        BLOCK_G=triton.next_power_of_2(G), num_warps=num_warps)


def permute_rows_ref(a_q: torch.Tensor, a_s: torch.Tensor, layout: ContiguousLayout,
                     out_q: torch.Tensor, out_s: torch.Tensor) -> None:
    """Torch reference of `permute_rows` (same arguments): gather, then zero the padding rows."""
    out_u8 = out_q.view(torch.uint8)
    torch.index_select(a_q.view(torch.uint8), 0, layout.src_token, out=out_u8)
    out_u8.masked_fill_((layout.m_indices < 0).unsqueeze(1), 0)
    torch.index_select(a_s.t(), 1, layout.src_token, out=out_s.t())


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def permute_rows(a_q: torch.Tensor, a_s: torch.Tensor, layout: ContiguousLayout,
                 out_q: torch.Tensor, out_s: torch.Tensor) -> None:
    """Gather the quantised activations into the contiguous layout, padding rows zeroed.

    Args:
        a_q: float8_e4m3fn [M, K], rows contiguous (stride(1) == 1); K a multiple of 128.
        a_s: float32 [M, K/128], any strides.
        layout: from build_contiguous_layout (src_token int64 [M_sum], m_indices int32 [M_sum]).
        out_q: float8_e4m3fn [M_sum, K], rows contiguous (written: padding rows are exact zeros,
            so a GEMM that computes them produces zeros).
        out_s: float32 [M_sum, K/128], any strides; the experts pass strides (1, M_sum) (MN-major,
            what DeepGEMM's SM90 kernels take without a conversion). Written; padding rows hold
            the finite scales of the row their src_token names.

    One Triton kernel on CUDA (`permute_rows_triton`), the torch reference elsewhere.
    """
    _check(a_q.dtype == torch.float8_e4m3fn and a_q.dim() == 2 and a_q.stride(1) == 1,
           f"a_q must be float8_e4m3fn [M, K] with contiguous rows, got {a_q.dtype} "
           f"{tuple(a_q.shape)} strides {a_q.stride()}")
    M, K = a_q.shape
    m_sum = layout.m_indices.shape[0]
    _check(K % ALIGNMENT == 0, f"a_q: K must be a multiple of {ALIGNMENT}, got {K}")
    _check(a_s.dtype == torch.float32 and tuple(a_s.shape) == (M, K // ALIGNMENT),
           f"a_s must be float32 {(M, K // ALIGNMENT)}, got {a_s.dtype} {tuple(a_s.shape)}")
    _check(out_q.dtype == torch.float8_e4m3fn and tuple(out_q.shape) == (m_sum, K)
           and out_q.stride(1) == 1, f"out_q must be float8_e4m3fn {(m_sum, K)} with contiguous "
           f"rows, got {out_q.dtype} {tuple(out_q.shape)} strides {out_q.stride()}")
    _check(out_s.dtype == torch.float32 and tuple(out_s.shape) == (m_sum, K // ALIGNMENT),
           f"out_s must be float32 {(m_sum, K // ALIGNMENT)}, got {out_s.dtype} "
           f"{tuple(out_s.shape)}")
    _check(M > 0 or not m_sum, "a_q has no rows to gather from (M == 0 with M_sum > 0)")
    devices = {t.device for t in (a_q, a_s, out_q, out_s, layout.src_token, layout.m_indices)}
    _check(len(devices) == 1, f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if a_q.is_cuda:
        permute_rows_triton(a_q, a_s, layout, out_q, out_s)
    else:
        permute_rows_ref(a_q, a_s, layout, out_q, out_s)


def unpermute_rows(gemm_out: torch.Tensor, layout: ContiguousLayout, out: torch.Tensor) -> None:
    """Scatter GEMM output rows back to slots: out[s] = gemm_out[dest[s]], no new tensor.

    Args:
        gemm_out: [M_sum, K] contiguous; its last row (the dump row) is set to zero here.
        layout: from build_contiguous_layout.
        out: [M, k, K] contiguous, gemm_out's dtype (written; non-local slots get exact zeros).
    """
    gemm_out[-1].zero_()
    torch.index_select(gemm_out, 0, layout.dest, out=out.view(-1, out.shape[-1]))
