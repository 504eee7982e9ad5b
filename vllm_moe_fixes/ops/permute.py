"""Expert-contiguous row layout for the grouped GEMMs: build it, gather into it, reduce out of it.

The contiguous grouped GEMM (DeepGEMM's `m_grouped_fp8_gemm_nt_contiguous`, or our Triton one)
wants the rows of each local expert next to each other, every expert's segment starting at a
multiple of ROW_ALIGNMENT = 128 rows (vllm_moe_fixes.sizes), and an int32 `m_indices` naming the
expert of every row (-1 for padding). With M tokens routed to k experts each there are M*k
slots; slot s = m*k + j is token m's j-th choice. A slot whose expert is not on this rank (id -1,
expert_map gives -1, or an id out of range) gets no row: it contributes nothing to its token
(DeepEP's contract for id -1).

Sizes. Expert e with c_e slots takes round_up(c_e, 128) <= c_e + 127 rows, so all segments fit in

    M_sum = round_up(M*k + E_l*127, 128)        (E_l = number of LOCAL experts)

rows, a bound known on the host without reading the routing; rows past the last segment are
padding too. Within an expert, slots keep token order, so the layout is deterministic.

Three steps, each one Triton launch on CUDA (torch references on CPU and in the tests):

    build_contiguous_layout   topk_ids [M, k] -> m_indices, src_row, dest, expert_ends (two
                              kernels, no sort, no host synchronisation: safe under CUDA graphs)
    permute_rows              a1q [M, K] fp8 + scales -> [M_sum, K] fp8 + MN-major scales
    unpermute_reduce          GEMM2's out [M_sum, K] -> [M, K]: each token's k rows, weighted,
                              summed in float32 in slot order (the [M, k, K] tensor is never built)

Layout kernels. Slots are cut into chunks of CHUNK. Kernel 1 counts each chunk's slots per local
expert into counts [n_chunks, E_l] (sums of a one-hot [CHUNK, BLOCK_E] matrix). Kernel 2, one
program per chunk, sums the counts over all chunks (segment sizes, hence 128-aligned segment
starts by a cumulative sum) and over the earlier chunks (its slots' offset inside each segment),
ranks its slots within the chunk by a cumulative sum of the one-hot matrix, and writes dest,
src_row and m_indices of its slots' rows. Up to SINGLE_PROGRAM_SLOTS slots (decode) there is one
chunk, whose program counts its own slots: kernel 1 is not launched. Padding rows are written by
one program each: the up to 127 rows closing expert e's segment by program e % n_chunks (which
also writes expert_ends[e]), the tail after the last segment in a grid-strided loop. Every row
is written exactly once. Each program loads n_chunks * E_l counts; CHUNK grows with the slot
count so that n_chunks stays near 256 or below.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_moe_fixes._validate import check as _check
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, SCALE_BLOCK
from vllm_moe_fixes.ops.moe_sum import moe_sum_ref
from vllm_moe_fixes.ops.triton_utils import INTERPRETING, next_power_of_2, round_to_bf16_grid
from vllm_moe_fixes.sizes import ROW_ALIGNMENT, align_up, cdiv, contiguous_num_rows

_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass
class ContiguousLayout:
    """Where every slot went (all int32, so they can live in a bf16 workspace's bytes).

    m_indices: [M_sum], local expert of each row, -1 on padding rows.
    src_row: [M_sum], token whose activations each row holds, -1 on padding rows.
    dest: [M*k], row of each slot, -1 for slots that have no row (not local).
    expert_ends: [E_l], first row after expert e's slots (its segment start + its slot count):
        DeepGEMM's "psum" grouped layout, where expert e's rows are [align128(expert_ends[e-1]),
        expert_ends[e]) and no row past the last expert's slots exists for the GEMM. None in
        layouts built by hand for the permute alone.
    """

    m_indices: torch.Tensor
    src_row: torch.Tensor
    dest: torch.Tensor
    expert_ends: torch.Tensor | None = None


SINGLE_PROGRAM_SLOTS = 2048  # up to this many slots, one program builds the whole layout


def layout_chunk(num_slots: int, local_num_experts: int) -> int:
    """Slots per program of the layout kernels: a power of two >= max(128, E_l) and large enough
    that there are at most ~256 chunks (so counts [n_chunks, E_l] has at most M_sum entries);
    all of them when there are at most SINGLE_PROGRAM_SLOTS."""
    if num_slots <= SINGLE_PROGRAM_SLOTS:
        return max(128, next_power_of_2(max(local_num_experts, num_slots)))
    return max(128, next_power_of_2(max(local_num_experts, cdiv(num_slots, 256))))


def layout_num_chunks(num_slots: int, local_num_experts: int) -> int:
    """Programs of the layout kernels (at least one: it writes the padding rows)."""
    return max(1, cdiv(num_slots, layout_chunk(num_slots, local_num_experts)))


def layout_index_numel(num_slots: int, local_num_experts: int) -> int:
    """int32 elements of a layout's index vectors: m_indices + src_row + dest + expert_ends +
    counts (at most 4 * M_sum: M*k + E_l <= M_sum, and counts hold at most M*k + E_l)."""
    m_sum = contiguous_num_rows(num_slots, local_num_experts)
    return 2 * m_sum + num_slots + local_num_experts + \
        layout_num_chunks(num_slots, local_num_experts) * local_num_experts


def carve_layout(buf: torch.Tensor, num_slots: int,
                 local_num_experts: int) -> tuple[ContiguousLayout, torch.Tensor]:
    """(layout, counts) as views of the int32 vector `buf` (>= layout_index_numel elements)."""
    m_sum = contiguous_num_rows(num_slots, local_num_experts)
    n_counts = layout_num_chunks(num_slots, local_num_experts) * local_num_experts
    sizes = [m_sum, m_sum, num_slots, local_num_experts, n_counts]
    parts = buf[:sum(sizes)].split(sizes)
    return ContiguousLayout(m_indices=parts[0], src_row=parts[1], dest=parts[2],
                            expert_ends=parts[3]), parts[4]


# ----------------------------------------------------------------------------------------------
# build_contiguous_layout: two Triton kernels on CUDA, a stable sort in torch as the reference
# ----------------------------------------------------------------------------------------------
@triton.jit
def _local_ids(ids_ptr, map_ptr, slots, num_slots, k, stride_m, stride_k, E,
               local_num_experts, HAS_MAP: tl.constexpr):
    """Local expert of each slot, -1 when it has none (id -1, mapped to -1, or out of range)."""
    ok = slots < num_slots
    ids = tl.load(ids_ptr + (slots // k).to(tl.int64) * stride_m + (slots % k) * stride_k,
                  mask=ok, other=-1)
    if HAS_MAP:
        known = (ids >= 0) & (ids < E)
        ids = tl.load(map_ptr + tl.where(known, ids, 0), mask=ok & known, other=-1)
    ids = ids.to(tl.int32)
    return tl.where((ids >= 0) & (ids < local_num_experts), ids, -1)


@triton.jit
def _layout_count_kernel(ids_ptr, map_ptr, counts_ptr, num_slots, k, stride_m, stride_k, E,
                         local_num_experts, HAS_MAP: tl.constexpr, CHUNK: tl.constexpr,
                         BLOCK_E: tl.constexpr):
    """counts[c, e] = slots of chunk c whose local expert is e."""
    c = tl.program_id(0)
    loc = _local_ids(ids_ptr, map_ptr, c * CHUNK + tl.arange(0, CHUNK), num_slots, k, stride_m,
                     stride_k, E, local_num_experts, HAS_MAP)
    for e0 in range(0, local_num_experts, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        hits = (loc[:, None] == e[None, :]).to(tl.int32)
        tl.store(counts_ptr + c * local_num_experts + e, tl.sum(hits, axis=0),
                 mask=e < local_num_experts)


@triton.jit
def _layout_scatter_kernel(ids_ptr, map_ptr, counts_ptr, m_idx_ptr, src_ptr, dest_ptr, ends_ptr,
                           num_slots, k, stride_m, stride_k, E, local_num_experts, n_chunks, M_sum,
                           HAS_MAP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr,
                           BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                           COUNT_HERE: tl.constexpr, ROW_ALIGNMENT: tl.constexpr):
    """Rows of chunk c's slots, and the padding rows this program owns (module docstring).
    COUNT_HERE: the only program counts its own slots (no counts from the first kernel)."""
    c = tl.program_id(0)
    slots = c * CHUNK + tl.arange(0, CHUNK)
    loc = _local_ids(ids_ptr, map_ptr, slots, num_slots, k, stride_m, stride_k, E,
                     local_num_experts, HAS_MAP)
    dest = tl.full([CHUNK], -1, tl.int32)
    seg_end = c * 0  # first row after the segments of the expert blocks done so far
    pad = tl.arange(0, ROW_ALIGNMENT)
    for e0 in range(0, local_num_experts, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        hits = loc[:, None] == e[None, :]
        rank = tl.cumsum(hits.to(tl.int32), axis=0)  # 1-based rank within this chunk
        before = tl.zeros([BLOCK_E], tl.int32)  # slots of expert e in chunks < c
        if COUNT_HERE:
            total = tl.sum(hits.to(tl.int32), axis=0)
        else:
            total = tl.zeros([BLOCK_E], tl.int32)
            for c0 in range(0, n_chunks, BLOCK_C):
                cc = c0 + tl.arange(0, BLOCK_C)
                cnt = tl.load(counts_ptr + cc[:, None] * local_num_experts + e[None, :],
                              mask=(cc < n_chunks)[:, None] & (e < local_num_experts)[None, :],
                              other=0)
                total += tl.sum(cnt, axis=0)
                before += tl.sum(tl.where((cc < c)[:, None], cnt, 0), axis=0)
        padded = tl.cdiv(total, ROW_ALIGNMENT) * ROW_ALIGNMENT
        start = seg_end + tl.cumsum(padded, axis=0) - padded
        seg_end += tl.sum(padded, axis=0)
        # dest = segment start + earlier chunks' slots + rank within this chunk - 1.
        dest += tl.sum(tl.where(hits, (start + before)[None, :] + rank, 0), axis=1)
        # The padding closing each segment: rows [start + total, start + padded) of the experts
        # this program owns (e % n_chunks == c), and their segments' ends.
        rows = (start + total)[:, None] + pad[None, :]
        owned = (e % n_chunks == c) & (e < local_num_experts)
        tl.store(ends_ptr + e, start + total, mask=owned)
        mine = owned[:, None] & (pad[None, :] < (padded - total)[:, None])
        tl.store(m_idx_ptr + rows, tl.full([BLOCK_E, ROW_ALIGNMENT], -1, tl.int32), mask=mine)
        tl.store(src_ptr + rows, tl.full([BLOCK_E, ROW_ALIGNMENT], -1, tl.int32), mask=mine)
    used = loc >= 0
    in_chunk = slots < num_slots
    tl.store(dest_ptr + slots, dest, mask=in_chunk)
    tl.store(m_idx_ptr + dest, loc, mask=used)
    tl.store(src_ptr + dest, slots // k, mask=used)
    # The tail after the last segment, grid-strided over the programs.
    for r0 in range(seg_end + c * BLOCK_R, M_sum, n_chunks * BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        tl.store(m_idx_ptr + r, tl.full([BLOCK_R], -1, tl.int32), mask=r < M_sum)
        tl.store(src_ptr + r, tl.full([BLOCK_R], -1, tl.int32), mask=r < M_sum)


@functools.lru_cache(maxsize=256)
def _layout_launch_sizes(num_slots: int, local_num_experts: int) -> tuple[int, int, int, int]:
    """(CHUNK, n_chunks, BLOCK_E, BLOCK_C) of the layout kernels for this many slots and local
    experts (plain ints, cached: they cost several microseconds of host time per call)."""
    chunk = layout_chunk(num_slots, local_num_experts)
    n_chunks = layout_num_chunks(num_slots, local_num_experts)
    block_e = min(next_power_of_2(local_num_experts), max(1, 8192 // chunk))
    return chunk, n_chunks, block_e, min(64, next_power_of_2(n_chunks))


def build_contiguous_layout_triton(topk_ids: torch.Tensor, local_num_experts: int,
                                   expert_map: torch.Tensor | None, layout: ContiguousLayout,
                                   counts: torch.Tensor, *, num_warps: int = 4) -> None:
    """Launch the two layout kernels on validated tensors (CUDA, or CPU under TRITON_INTERPRET=1).

    layout / counts: int32 outputs of the sizes `carve_layout` gives (any contents on entry).
    """
    M, k = topk_ids.shape
    num_slots = M * k
    chunk, n_chunks, block_e, block_c = _layout_launch_sizes(num_slots, local_num_experts)
    has_map = expert_map is not None
    emap = expert_map if has_map else counts
    E = expert_map.shape[0] if has_map else local_num_experts
    common = (topk_ids, emap, counts)
    args = (num_slots, k, topk_ids.stride(0), topk_ids.stride(1), E, local_num_experts)
    if n_chunks > 1:
        _layout_count_kernel[(n_chunks,)](*common, *args, HAS_MAP=has_map, CHUNK=chunk,
                                          BLOCK_E=block_e, num_warps=num_warps)
    _layout_scatter_kernel[(n_chunks,)](
        *common, layout.m_indices, layout.src_row, layout.dest, layout.expert_ends, *args, n_chunks,
        layout.m_indices.shape[0], HAS_MAP=has_map, CHUNK=chunk, BLOCK_E=block_e,
        BLOCK_C=block_c, BLOCK_R=1024, COUNT_HERE=n_chunks == 1, ROW_ALIGNMENT=ROW_ALIGNMENT,
        num_warps=num_warps)


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
                     local_num_experts: int) -> torch.Tensor:
    """topk_ids int32/int64 [M, k] global ids -> int64 [M*k] local ids, -1 = no local expert.

    expert_map: int32 [E] global -> local id or -1; None means global ids are local ids. Ids or
    map entries outside their range count as -1, as in the kernels.
    """
    ids = topk_ids.reshape(-1).to(torch.int64)
    if expert_map is not None:
        known = (ids >= 0) & (ids < expert_map.shape[0])
        ids = torch.where(known, expert_map.to(torch.int64)[ids.clamp(0, expert_map.shape[0] - 1)],
                          -1)
    return torch.where((ids >= 0) & (ids < local_num_experts), ids, -1)


def build_contiguous_layout_ref(topk_ids: torch.Tensor, local_num_experts: int,
                                expert_map: torch.Tensor | None) -> ContiguousLayout:
    """Torch reference of the layout kernels (same arguments, new int32 tensors): a stable sort
    by local expert puts each expert's slots together in slot order."""
    M, k = topk_ids.shape
    num_slots = M * k
    m_sum = contiguous_num_rows(num_slots, local_num_experts)
    dev = topk_ids.device
    local = local_expert_ids(topk_ids, expert_map, local_num_experts)
    counts = torch.zeros(local_num_experts + 1, dtype=torch.int64, device=dev)
    counts.index_add_(0, local + 1, torch.ones_like(local))  # bin 0: slots with no row
    num_nonlocal, counts = counts[:1], counts[1:]
    padded = align_up(counts, ROW_ALIGNMENT)
    seg_start = torch.cumsum(padded, 0) - padded
    first_sorted = num_nonlocal + torch.cumsum(counts, 0) - counts
    sorted_local, order = torch.sort(local, stable=True)
    e = sorted_local.clamp(min=0)
    rank_in_expert = torch.arange(num_slots, device=dev) - first_sorted[e]
    dest_sorted = torch.where(sorted_local >= 0, seg_start[e] + rank_in_expert, -1)
    dest = torch.empty_like(dest_sorted).index_copy_(0, order, dest_sorted)
    used = dest >= 0
    m_indices = torch.full((m_sum,), -1, dtype=torch.int32, device=dev)
    m_indices[dest[used]] = local[used].to(torch.int32)
    src_row = torch.full((m_sum,), -1, dtype=torch.int32, device=dev)
    src_row[dest[used]] = (torch.arange(num_slots, device=dev)[used] // k).to(torch.int32)
    return ContiguousLayout(m_indices=m_indices, src_row=src_row, dest=dest.to(torch.int32),
                            expert_ends=(seg_start + counts).to(torch.int32))


def check_routing_ranges(topk_ids: torch.Tensor, num_experts: int,
                         expert_map: torch.Tensor | None, local_num_experts: int) -> None:
    """ValueError naming the first offending entry unless topk_ids are in [-1, num_experts) and
    expert_map entries in [-1, local_num_experts). Reads the values: one host synchronisation on
    CUDA tensors."""
    bad_ids = (topk_ids < -1) | (topk_ids >= num_experts)
    bad_map = None if expert_map is None else \
        (expert_map < -1) | (expert_map >= local_num_experts)
    any_bad = bad_ids.any() if bad_map is None else bad_ids.any() | bad_map.any()
    if not bool(any_bad):
        return
    if bad_ids.any():
        where = tuple(int(i) for i in bad_ids.nonzero()[0])
        raise ValueError(f"topk_ids must hold expert ids in [-1, {num_experts}) (-1: no expert); "
                         f"topk_ids{list(where)} = {int(topk_ids[where])}")
    i = int(bad_map.nonzero()[0, 0])
    raise ValueError(f"expert_map must hold local ids in [-1, {local_num_experts}) (-1: not on "
                     f"this rank); expert_map[{i}] = {int(expert_map[i])}")


def build_contiguous_layout_into(topk_ids: torch.Tensor, local_num_experts: int,
                                 expert_map: torch.Tensor | None, layout: ContiguousLayout,
                                 counts: torch.Tensor) -> None:
    """Fill `layout` (views from `carve_layout`) on validated arguments: the two kernels on CUDA,
    the reference (after its range check) on CPU."""
    if topk_ids.is_cuda:
        build_contiguous_layout_triton(topk_ids, local_num_experts, expert_map, layout, counts)
        return
    E = local_num_experts if expert_map is None else expert_map.shape[0]
    check_routing_ranges(topk_ids, E, expert_map, local_num_experts)
    ref = build_contiguous_layout_ref(topk_ids, local_num_experts, expert_map)
    for name in ("m_indices", "src_row", "dest", "expert_ends"):
        getattr(layout, name).copy_(getattr(ref, name))


def build_contiguous_layout(topk_ids: torch.Tensor, local_num_experts: int,
                            expert_map: torch.Tensor | None = None, *,
                            out: torch.Tensor | None = None) -> ContiguousLayout:
    """Assign every slot a row of the 128-aligned expert-contiguous layout (module docstring).

    Args:
        topk_ids: int32 or int64 [M, k] global expert ids in [-1, E), any strides; -1: no
            expert (the slot contributes nothing).
        local_num_experts: E_l, experts whose weights this rank holds.
        expert_map: int32 [E] global -> local id in [-1, E_l), or None (global ids are local).
        out: optional int32 vector of >= layout_index_numel(M*k, E_l) elements on topk_ids'
            device; the layout's tensors are views of it (no allocation). Contents undefined on
            entry.

    Returns a ContiguousLayout for M_sum = contiguous_num_rows(M*k, E_l): dest int32 [M*k],
    m_indices and src_row int32 [M_sum], expert_ends int32 [E_l]. CUDA tensors run the two layout
    kernels without a host synchronisation (ids are not range-checked there: out-of-range ids get
    no row); CPU tensors run the torch reference after a range check (ValueError naming the
    entry).
    """
    _check(isinstance(topk_ids, torch.Tensor) and topk_ids.dtype in _INDEX_DTYPES
           and topk_ids.dim() == 2, f"topk_ids must be an int32/int64 [M, k] tensor, got "
           f"{getattr(topk_ids, 'dtype', type(topk_ids))} {tuple(getattr(topk_ids, 'shape', ()))}")
    _check(isinstance(local_num_experts, int) and local_num_experts >= 1,
           f"local_num_experts must be an int >= 1, got {local_num_experts!r}")
    if expert_map is not None:
        _check(isinstance(expert_map, torch.Tensor) and expert_map.dtype == torch.int32
               and expert_map.dim() == 1 and expert_map.device == topk_ids.device,
               f"expert_map must be int32 [E] on {topk_ids.device}")
    num_slots = topk_ids.numel()
    need = layout_index_numel(num_slots, local_num_experts)
    if out is None:
        out = torch.empty(need, dtype=torch.int32, device=topk_ids.device)
    _check(isinstance(out, torch.Tensor) and out.dtype == torch.int32 and out.dim() == 1
           and out.numel() >= need and out.device == topk_ids.device and out.is_contiguous(),
           f"out must be a contiguous int32 vector of >= {need} elements on {topk_ids.device}")
    layout, counts = carve_layout(out, num_slots, local_num_experts)
    build_contiguous_layout_into(topk_ids, local_num_experts, expert_map, layout, counts)
    return layout


# ----------------------------------------------------------------------------------------------
# permute_rows: one Triton gather on CUDA, torch (index_select + masked_fill) as the reference
# ----------------------------------------------------------------------------------------------
@triton.jit
def _permute_rows_kernel(a_ptr, a_s_ptr, src_ptr, out_ptr, out_s_ptr, M_sum, K, G,
                         stride_am, stride_asm, stride_asg, stride_om, stride_osm, stride_osg,
                         BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
    """Program (i, j) writes bytes [j, j+1) * BLOCK_K of out rows [i, i+1) * BLOCK_R.

    The fp8 rows are moved as raw bytes (uint8): out[r] = a[src[r]] where src[r] >= 0, zeros on
    padding rows (src -1: the load is masked off, nothing is read). K and the row strides are
    multiples of 16, which Triton sees, so each thread moves 16-byte vectors; a [BLOCK_R, BLOCK_K]
    tile keeps BLOCK_R * BLOCK_K bytes in flight per program. Programs of the first column (j == 0)
    also write the G = K/128 scales of their rows: a_s[src[r]], zeros on padding rows. Row
    offsets are int64.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < M_sum
    src = tl.load(src_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    used = (src >= 0)[:, None]
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = (cols < K)[None, :]
    x = tl.load(a_ptr + src[:, None] * stride_am + cols[None, :], mask=used & col_ok, other=0)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], x,
             mask=in_range[:, None] & col_ok)
    if tl.program_id(1) == 0:
        g = tl.arange(0, BLOCK_G).to(tl.int64)
        g_ok = (g < G)[None, :]
        s = tl.load(a_s_ptr + src[:, None] * stride_asm + g[None, :] * stride_asg,
                    mask=used & g_ok, other=0.0)
        tl.store(out_s_ptr + rows[:, None] * stride_osm + g[None, :] * stride_osg, s,
                 mask=in_range[:, None] & g_ok)


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
    block_k = min(block_k, next_power_of_2(K))
    grid = (cdiv(m_sum, block_rows), cdiv(K, block_k))
    _permute_rows_kernel[grid](
        a_q.view(torch.uint8), a_s, layout.src_row, out_q.view(torch.uint8), out_s, m_sum, K, G,
        a_q.stride(0), a_s.stride(0), a_s.stride(1), out_q.stride(0), out_s.stride(0),
        out_s.stride(1), BLOCK_R=block_rows, BLOCK_K=block_k, BLOCK_G=next_power_of_2(G),
        num_warps=num_warps)


def permute_rows_ref(a_q: torch.Tensor, a_s: torch.Tensor, layout: ContiguousLayout,
                     out_q: torch.Tensor, out_s: torch.Tensor) -> None:
    """Torch reference of `permute_rows` (same arguments): gather, then zero the padding rows."""
    if a_q.shape[0] == 0:  # nothing to gather: every row is padding
        out_q.view(torch.uint8).zero_()
        out_s.zero_()
        return
    src = layout.src_row.long().clamp(min=0)
    padding = (layout.src_row < 0).unsqueeze(1)
    out_u8 = out_q.view(torch.uint8)
    torch.index_select(a_q.view(torch.uint8), 0, src, out=out_u8)
    out_u8.masked_fill_(padding, 0)
    out_s.copy_(a_s.index_select(0, src).masked_fill_(padding, 0.0))


def check_permuted_outputs(out_q: torch.Tensor, out_s: torch.Tensor, m_sum: int,
                           K: int) -> None:
    """The permuted FP8 rows and their scales a permute writes: out_q float8_e4m3fn [M_sum, K]
    with contiguous rows, out_s float32 [M_sum, K/128] (any strides). ValueError otherwise."""
    _check(out_q.dtype == FP8_DTYPE and tuple(out_q.shape) == (m_sum, K)
           and out_q.stride(1) == 1, f"out_q must be float8_e4m3fn {(m_sum, K)} with contiguous "
           f"rows, got {out_q.dtype} {tuple(out_q.shape)} strides {out_q.stride()}")
    _check(out_s.dtype == torch.float32 and tuple(out_s.shape) == (m_sum, K // SCALE_BLOCK),
           f"out_s must be float32 {(m_sum, K // SCALE_BLOCK)}, got {out_s.dtype} "
           f"{tuple(out_s.shape)}")


def permute_rows(a_q: torch.Tensor, a_s: torch.Tensor, layout: ContiguousLayout,
                 out_q: torch.Tensor, out_s: torch.Tensor) -> None:
    """Gather the quantised activations into the contiguous layout, padding rows zeroed.

    Args:
        a_q: float8_e4m3fn [M, K], rows contiguous (stride(1) == 1); K a multiple of 128.
        a_s: float32 [M, K/128], any strides.
        layout: from build_contiguous_layout (src_row int32 [M_sum], -1 on padding rows).
        out_q: float8_e4m3fn [M_sum, K], rows contiguous (written: padding rows are exact zeros,
            so a GEMM that computes them produces zeros).
        out_s: float32 [M_sum, K/128], any strides; the experts pass strides (1, M_sum) (MN-major,
            what DeepGEMM's SM90 kernels take without a conversion). Written; padding rows 0.

    One Triton kernel on CUDA (`permute_rows_triton`), the torch reference elsewhere.
    """
    _check(a_q.dtype == FP8_DTYPE and a_q.dim() == 2 and a_q.stride(1) == 1,
           f"a_q must be float8_e4m3fn [M, K] with contiguous rows, got {a_q.dtype} "
           f"{tuple(a_q.shape)} strides {a_q.stride()}")
    M, K = a_q.shape
    m_sum = layout.src_row.shape[0]
    _check(K % SCALE_BLOCK == 0, f"a_q: K must be a multiple of {SCALE_BLOCK}, got {K}")
    _check(a_s.dtype == torch.float32 and tuple(a_s.shape) == (M, K // SCALE_BLOCK),
           f"a_s must be float32 {(M, K // SCALE_BLOCK)}, got {a_s.dtype} {tuple(a_s.shape)}")
    check_permuted_outputs(out_q, out_s, m_sum, K)
    devices = {t.device for t in (a_q, a_s, out_q, out_s, layout.src_row)}
    _check(len(devices) == 1, f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if a_q.is_cuda:
        permute_rows_triton(a_q, a_s, layout, out_q, out_s)
    else:
        permute_rows_ref(a_q, a_s, layout, out_q, out_s)


# ----------------------------------------------------------------------------------------------
# unpermute_reduce: one Triton kernel on CUDA; gather + moe_sum_ref as the reference
# ----------------------------------------------------------------------------------------------
@triton.jit
def _unpermute_reduce_kernel(y_ptr, dest_ptr, w_ptr, out_ptr, M, K, stride_ym, w_stride_m,
                             w_stride_k, out_stride_m, TOPK: tl.constexpr, WEIGHTED: tl.constexpr,
                             BLOCK_K: tl.constexpr, ROUND_BF16: tl.constexpr):
    """Program (m, j) writes out[m, j*BLOCK_K : (j+1)*BLOCK_K].

    The TOPK rows of token m are read through dest (all loads issued before the first add: the
    loop is unrolled) and summed in float32 in slot order, as moe_sum_ref sums them: a slot with
    dest -1 (no row) or weight 0 adds an exact 0 without being read; otherwise it adds y * w
    (products rounded before the add: fp fusion is off). Row offsets are int64.
    """
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    for j in tl.static_range(TOPK):
        row = tl.load(dest_ptr + m * TOPK + j).to(tl.int64)
        # Columns to read: none for a slot without a row or with weight 0, else [0, K). (A
        # column limit instead of `col_ok & scalar`: the interpreter mistypes that mask.)
        limit = tl.where(row >= 0, K, 0)
        if WEIGHTED:
            w = tl.load(w_ptr + m * w_stride_m + j * w_stride_k)
            limit = tl.where(w != 0, limit, 0)
        v = tl.load(y_ptr + row * stride_ym + cols, mask=cols < limit, other=0.0).to(tl.float32)
        if WEIGHTED:
            v = tl.where(w != 0, v * w, 0.0)
        acc = v if j == 0 else acc + v
    if ROUND_BF16:  # interpreter only: its bfloat16 cast truncates
        acc = round_to_bf16_grid(acc)
    tl.store(out_ptr + m * out_stride_m + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < K)


def unpermute_reduce_triton(y: torch.Tensor, dest: torch.Tensor,
                            topk_weights: torch.Tensor | None, out: torch.Tensor, *,
                            block_k: int | None = None, num_warps: int = 4) -> None:
    """Launch `_unpermute_reduce_kernel` on validated tensors (same arguments as
    `unpermute_reduce`). block_k: channels per program, default 2048 below 1024 tokens and 4096
    from there (the moe_sum sweep's tiles: enough programs for small M, long rows for large)."""
    M, K = out.shape
    if M == 0:
        return
    topk = dest.shape[0] // M
    if block_k is None:
        block_k = 4096 if M >= 1024 else 2048
    block_k = min(block_k, next_power_of_2(K))
    weighted = topk_weights is not None
    w, w_strides = (topk_weights, topk_weights.stride()) if weighted else (dest, (0, 0))
    _unpermute_reduce_kernel[(M, cdiv(K, block_k))](
        y, dest, w, out, M, K, y.stride(0), *w_strides, out.stride(0), TOPK=topk,
        WEIGHTED=weighted, BLOCK_K=block_k,
        ROUND_BF16=INTERPRETING and out.dtype == torch.bfloat16, num_warps=num_warps,
        enable_fp_fusion=False)


def unpermute_reduce_ref(y: torch.Tensor, dest: torch.Tensor, topk_weights: torch.Tensor | None,
                         out: torch.Tensor) -> None:
    """Torch reference of `unpermute_reduce`: gather [M, k, K] (zeros where dest is -1), then
    moe_sum_ref."""
    M, K = out.shape
    rows = y.index_select(0, dest.long().clamp(min=0))
    rows.masked_fill_((dest < 0).unsqueeze(1), 0)
    out.copy_(moe_sum_ref(rows.view(M, -1, K), topk_weights))


def unpermute_reduce(y: torch.Tensor, dest: torch.Tensor, topk_weights: torch.Tensor | None,
                     out: torch.Tensor) -> None:
    """Un-permute GEMM2's rows and reduce each token's top-k, in one pass.

    Args:
        y: bfloat16 [M_sum, K] with contiguous rows (stride(1) == 1), the grouped GEMM's output.
        dest: int32 [M*k] contiguous, row of each slot in y, -1 for a slot with no row.
        topk_weights: float32 [M, k], any strides, or None (plain sum: the weights went on the
            input).
        out: bfloat16 [M, K] with contiguous rows (written).

    Result: out[m] = sum over j = 0..k-1 in float32, in that order, of y[dest[m*k + j]] *
    topk_weights[m, j]; a slot with dest -1 or weight 0 adds an exact 0 and is not read. The same
    bits as gathering [M, k, K] and calling ops.moe_sum on it. CUDA tensors run one Triton kernel
    (int64 row offsets), CPU tensors the reference.
    """
    _check(y.dtype == torch.bfloat16 and y.dim() == 2 and y.stride(1) == 1,
           f"y must be bfloat16 [M_sum, K] with contiguous rows, got {y.dtype} {tuple(y.shape)}")
    _check(out.dtype == torch.bfloat16 and out.dim() == 2 and out.shape[1] == y.shape[1]
           and out.stride(1) == 1, f"out must be bfloat16 [M, K={y.shape[1]}] with contiguous "
           f"rows, got {out.dtype} {tuple(out.shape)}")
    M = out.shape[0]
    _check(dest.dtype == torch.int32 and dest.dim() == 1 and dest.is_contiguous()
           and (dest.numel() % M == 0 if M else dest.numel() == 0),
           f"dest must be a contiguous int32 [M*k] vector for M={M}, got {dest.dtype} "
           f"{tuple(dest.shape)}")
    if topk_weights is not None:
        _check(topk_weights.dtype == torch.float32 and topk_weights.dim() == 2
               and topk_weights.shape[0] == M and topk_weights.numel() == dest.numel(),
               f"topk_weights must be float32 [M={M}, k], got {topk_weights.dtype} "
               f"{tuple(topk_weights.shape)}")
    if y.is_cuda:
        unpermute_reduce_triton(y, dest, topk_weights, out)
    else:
        unpermute_reduce_ref(y, dest, topk_weights, out)
