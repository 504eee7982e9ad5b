"""The device-side steps of TorchAll2AllBuffer's low-latency exchange: fixed-size messages, no
host synchronisation (every size is known on the host before the call; every position is computed
on the device).

    pack           x bf16 [T, H], ids int64 [T, k] -> this rank's message, uint8 [N, row]:
                   per token (ids | fp8 scales | data), rows T..N-1 carry ids -1; with fp8 one
                   Triton program per (row, 8 groups) casts as DeepEP does
    (all-gather)   -> [R, N, row]
    route          gathered ids [R*N, k] -> per (source, token, slot) pair: served here, local
                   expert, row in that expert's [R*N] slice (numbered by a cumulative sum, in
                   source, token, slot order); received rows per local expert; one Triton
                   program walks the pairs. A pair past its expert's R*N rows (only a top-k that
                   repeats an expert gets there) is dropped and marked recv_row -1
    scatter_rows   each served pair's row -> recv_x [E_l, R*N, H] (and its scales -> the
                   column-major [E_l, R*N, H/128], same launch); one Triton program per
                   (pairs, columns) tile
    partial_sums   rows [P, H] and a row per (token, slot) [T, k] -> per token the weighted sum
                   over its slots, added in slot order in float32 (NaN where a slot was
                   dropped), rounded once into a bf16 out; one Triton program per (row, columns)
                   tile reads only the rows it sums. The combine runs it twice: with unit
                   weights on the serving rank (each served pair's expert output row, unweighted,
                   as DeepEP sends it back), then on the source rank over the k rows that came
                   back, so a token's output does not depend on which rank served a slot
    slot_source_rows  this rank's dispatched ids [T, k] -> each (token, slot)'s row in the
                   received [R, N, k] blocks (the block of the rank owning its expert)

DeepEP's low-latency receive buffer holds N rows per (local expert, source rank), one per
(token, slot): a top-k that repeats an expert sends one copy per slot, so a rank sending more than
N copies to one expert overruns it. ``check_expert_capacity`` refuses that where values are read;
where they are not, a dropped slot makes its token's output NaN rather than silently short.

``pack`` (fp8), ``route``, ``scatter_rows`` and ``partial_sums`` run Triton on CUDA tensors
(int64 offsets) and their torch references (``*_ref``) on CPU tensors; the tests compare the two.
``LLWorkspace`` holds every tensor of one dispatch + combine, allocated once per size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, FP8_MAX, SCALE_BLOCK, empty_mn_major_scales
from vllm_moe_fixes.ops.triton_utils import (
    INTERPRETING,
    launch,
    next_power_of_2,
    round_to_bf16_grid,
    round_to_e4m3_grid,
)
from vllm_moe_fixes.sizes import align_up, cdiv

# DeepEP's low-latency cast floors amax at this margin, so an all-zero group gets a finite scale.
LL_AMAX_FLOOR = 1e-4
_AMAX_FLOOR = tl.constexpr(LL_AMAX_FLOOR)
_FP8_MAX = tl.constexpr(FP8_MAX)
_INV_FP8_MAX = tl.constexpr(1.0 / FP8_MAX)
_SCALE_BLOCK = tl.constexpr(SCALE_BLOCK)
# Byte alignment of a slab row (its int64 ids and float32 scales need 8 and 4).
ROW_ALIGN = 16


# ----------------------------------------------------------------- the message
def ll_quant(rows: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's low-latency FP8 cast of bf16 rows [P, H] (torch): per 1x128 group, amax floored at
    1e-4, scale = 448 / amax, q = saturate(x * scale) rounded to nearest even, scale_inv =
    amax * (1/448); round_scale: scale_inv = 2**ceil(log2(amax * (1/448))) taken on the bits (a
    non-zero mantissa carries into the exponent) and scale = 1 / scale_inv.
    Returns (float8_e4m3fn [P, H], float32 scale_inv [P, H/128])."""
    p, h = rows.shape
    g = rows.float().view(p, h // SCALE_BLOCK, SCALE_BLOCK)
    amax = g.abs().amax(-1).clamp(min=LL_AMAX_FLOOR)
    scale_inv = amax * (1.0 / FP8_MAX)
    if round_scale:
        scale_inv = ((scale_inv.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)
        scale = 1.0 / scale_inv
    else:
        scale = torch.full_like(amax, FP8_MAX) / amax  # one correctly rounded division, as DeepEP
    q = (g * scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(p, h), scale_inv


@triton.jit
def _pack_fp8_kernel(x_ptr, ids_ptr, slab_ids_ptr, slab_s_ptr, slab_q_ptr, num_tokens, num_groups,
                     x_stride, ids_stride, slab_ids_stride, slab_s_stride, slab_q_stride,
                     TOPK: tl.constexpr, TOPK_POW2: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                     ROUND_SCALE: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # slab row; rows >= num_tokens are padding
    is_token = r < num_tokens
    if tl.program_id(1) == 0:  # the row's ids, -1 on padding rows
        j = tl.arange(0, TOPK_POW2)
        ids = tl.load(ids_ptr + r * ids_stride + j, mask=j < tl.where(is_token, TOPK, 0), other=-1)
        tl.store(slab_ids_ptr + r * slab_ids_stride + j, ids, mask=j < TOPK)
    if is_token:
        groups = tl.program_id(1).to(tl.int64) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
        valid = groups < num_groups
        cols = groups[:, None] * _SCALE_BLOCK + tl.arange(0, _SCALE_BLOCK)[None, :]
        x = tl.load(x_ptr + r * x_stride + cols, mask=valid[:, None], other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), _AMAX_FLOOR)
        scale_inv = amax * _INV_FP8_MAX
        if ROUND_SCALE:  # 2**ceil(log2(.)) on the bits, as ll_quant
            scale_inv = ((scale_inv.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(
                tl.float32, bitcast=True)
            scale = tl.math.div_rn(tl.zeros_like(amax) + 1.0, scale_inv)
        else:
            scale = tl.math.div_rn(tl.zeros_like(amax) + _FP8_MAX, amax)
        q = tl.minimum(tl.maximum(x * scale[:, None], -_FP8_MAX), _FP8_MAX)
        if ROUND_IN_FP32:  # interpreter only: its e4m3 cast rounds wrongly at some carries
            q = round_to_e4m3_grid(q)
        tl.store(slab_q_ptr + r * slab_q_stride + cols, q.to(slab_q_ptr.dtype.element_ty),
                 mask=valid[:, None])
        tl.store(slab_s_ptr + r * slab_s_stride + groups, scale_inv, mask=valid)


def pack_fp8_triton(x: torch.Tensor, topk_idx: torch.Tensor, slab_ids: torch.Tensor,
                    slab_scales: torch.Tensor, slab_q: torch.Tensor, round_scale: bool) -> None:
    """Launch the kernel on validated tensors (CUDA, or CPU under TRITON_INTERPRET=1): x bf16
    [T, H] and topk_idx int64 [T, k] (unit column strides); the slab's fields int64 [N, k],
    float32 [N, H/128] and float8_e4m3fn [N, H] (unit column strides), all written."""
    n, num_groups = slab_scales.shape
    groups_per_prog = min(8, next_power_of_2(num_groups))
    topk = topk_idx.shape[1]
    grid = (n, cdiv(num_groups, groups_per_prog))
    launch(_pack_fp8_kernel, grid, (
        x, topk_idx, slab_ids, slab_scales, slab_q, x.shape[0], num_groups, x.stride(0),
        topk_idx.stride(0), slab_ids.stride(0), slab_scales.stride(0), slab_q.stride(0), topk,
        next_power_of_2(topk), groups_per_prog, round_scale, INTERPRETING), num_warps=4)


def pack_fp8_ref(x: torch.Tensor, topk_idx: torch.Tensor, slab_ids: torch.Tensor,
                 slab_scales: torch.Tensor, slab_q: torch.Tensor, round_scale: bool) -> None:
    """torch reference of ``pack_fp8_triton`` (same arguments, same result)."""
    t = x.shape[0]
    slab_ids[:t] = topk_idx
    slab_ids[t:] = -1
    slab_q[:t], slab_scales[:t] = ll_quant(x, round_scale)


def row_layout(k: int, h: int, use_fp8: bool) -> tuple[int, int, int]:
    """Byte offsets in a slab row: (scales start, data start, row size); the ids start at 0."""
    scales_at = 8 * k
    data_at = scales_at + (4 * (h // SCALE_BLOCK) if use_fp8 else 0)
    return scales_at, data_at, align_up(data_at + h * (1 if use_fp8 else 2), ROW_ALIGN)


def slab_fields(rows: torch.Tensor, k: int, h: int, use_fp8: bool):
    """Views of slab rows uint8 [P, row]: ids int64 [P, k], scales float32 [P, H/128] (None
    without fp8) and data bytes uint8 [P, H (fp8) or 2H (bf16)]."""
    scales_at, data_at, _ = row_layout(k, h, use_fp8)
    scales = rows[:, scales_at:data_at].view(torch.float32) if use_fp8 else None
    return rows[:, :scales_at].view(torch.int64), scales, rows[:, data_at:data_at + h * (
        1 if use_fp8 else 2)]


def pack(x: torch.Tensor, topk_idx: torch.Tensor, ids: torch.Tensor, scales: torch.Tensor | None,
         data: torch.Tensor, round_scale: bool) -> None:
    """Write this rank's message into the ``slab_fields`` of its [N, row] slab: per token its ids,
    scales (fp8 only: ``scales`` not None) and data; rows T..N-1 get ids -1 and nothing else.
    With fp8, one Triton kernel on CUDA (the torch reference on the CPU) quantises and packs."""
    if scales is not None:
        launch = pack_fp8_triton if x.is_cuda else pack_fp8_ref
        launch(x, topk_idx, ids, scales, data.view(FP8_DTYPE), round_scale)
        return
    t = topk_idx.shape[0]
    ids[:t] = topk_idx
    ids[t:] = -1
    data[:t] = x.view(torch.uint8)


class LLWorkspace:
    """The tensors of one low-latency dispatch + combine at fixed sizes, allocated once and
    rewritten by every call that uses them (no allocation per call), with their views.

    Arguments: n (N, tokens per rank), num_ranks (R), k (top-k), h (hidden), local_num_experts
    (experts per rank), use_fp8, device. Attributes (P = R*N):
        slab: uint8 [N, row], this rank's message; send_fields: its ``slab_fields``.
        gathered: uint8 [P, row], every rank's message (the slab itself when R == 1);
            recv_fields: its ``slab_fields``.
        served (bool), local, pos, recv_row (int64): [P, k], ``route``'s outputs;
            recv_count: int32 [E_l].
        recv: [E_l, P, H] float8_e4m3fn (fp8) or bf16; recv_bytes: its uint8 view;
            recv_scales: float32 [E_l, P, H/128] column-major in the last two dims (fp8
            only, else None).
        slot_rows and back: bf16 [P, k, H], each received (source, token, slot) pair's expert
            output row (sent) and each of this rank's (token, slot) rows from rank s in block s
            (received); unit_weights: float32 [P*k, 1], ones once the combine fills it (all
            None when R == 1: nothing is exchanged, the combine sums into its output).
    """

    def __init__(self, n: int, num_ranks: int, k: int, h: int, local_num_experts: int,
                 use_fp8: bool, device: torch.device) -> None:
        rows, row = num_ranks * n, row_layout(k, h, use_fp8)[2]
        self.slab = torch.empty(n, row, dtype=torch.uint8, device=device)
        self.send_fields = slab_fields(self.slab, k, h, use_fp8)
        alone = num_ranks == 1
        self.gathered = self.slab if alone else torch.empty(rows, row, dtype=torch.uint8,
                                                            device=device)
        self.recv_fields = slab_fields(self.gathered, k, h, use_fp8)
        self.served = torch.empty(rows, k, dtype=torch.bool, device=device)
        self.local, self.pos, self.recv_row = (
            torch.empty(rows, k, dtype=torch.int64, device=device) for _ in range(3))
        self.recv_count = torch.empty(local_num_experts, dtype=torch.int32, device=device)
        self.recv = torch.empty(local_num_experts, rows, h,
                                dtype=FP8_DTYPE if use_fp8 else torch.bfloat16, device=device)
        self.recv_bytes = self.recv.view(torch.uint8)
        self.recv_scales = empty_mn_major_scales(
            (local_num_experts, rows, h // SCALE_BLOCK), device,
            tma_aligned=False) if use_fp8 else None
        self.slot_rows, self.back = (None, None) if alone else (
            torch.empty(rows, k, h, dtype=torch.bfloat16, device=device) for _ in range(2))
        self.unit_weights = None if alone else torch.empty(rows * k, 1, dtype=torch.float32,
                                                           device=device)


# ----------------------------------------------------------------- capacity
def busiest_expert(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [2] on topk_idx's device: (the most (token, slot) pairs of topk_idx int64 [T, k]
    (ids in [-1, num_experts)) that select one expert, that expert). No host read."""
    counts = torch.bincount(topk_idx.reshape(-1) + 1, minlength=num_experts + 1)[1:]
    most, expert = counts.max(0)
    return torch.stack([most, expert])


def check_expert_capacity(busiest: list[list[int]], n: int) -> None:
    """ValueError naming every source rank whose ``busiest_expert`` row [count, expert] (row r:
    rank r's) exceeds n = num_max_dispatch_tokens_per_rank: DeepEP's low-latency receive buffer
    holds n rows per (expert, source rank), so the excess would overrun it."""
    over = [(rank, count, expert) for rank, (count, expert) in enumerate(busiest) if count > n]
    if over:
        sends = "; ".join(f"rank {rank} sends {count} to expert {expert}"
                          for rank, count, expert in over)
        raise ValueError(
            f"low-latency dispatch: more (token, slot) pairs for one expert than "
            f"num_max_dispatch_tokens_per_rank={n} ({sends}): a token's top-k repeats an expert, "
            f"one copy per slot, and DeepEP's receive buffer holds N rows per expert and source "
            f"rank")


# ----------------------------------------------------------------- routing
@triton.jit
def _route_kernel(ids_ptr, served_ptr, local_ptr, pos_ptr, row_ptr, count_ptr, num_pairs,
                  ids_stride_row, first_expert, local_num_experts, rows_per_expert,
                  TOPK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    # One program walks the pairs in order, BLOCK_P at a time, carrying each expert's count.
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        pairs = p0 + tl.arange(0, BLOCK_P).to(tl.int64)
        in_range = pairs < num_pairs
        ids = tl.load(ids_ptr + (pairs // TOPK) * ids_stride_row + pairs % TOPK, mask=in_range,
                      other=-1)
        local = ids - first_expert
        served = in_range & (local >= 0) & (local < local_num_experts)
        hits = (local[:, None] == e[None, :]) & served[:, None]
        running = tl.cumsum(hits.to(tl.int32), axis=0) + counts[None, :]
        pos = (tl.sum(tl.where(hits, running, 0), axis=1) - 1).to(tl.int64)
        dropped = served & (pos >= rows_per_expert)  # only a top-k repeating an expert gets here
        served = served & ~dropped
        local = tl.where(served, local, 0)
        pos = tl.where(served, pos, 0)
        tl.store(served_ptr + pairs, served.to(tl.uint8), mask=in_range)
        tl.store(local_ptr + pairs, local, mask=in_range)
        tl.store(pos_ptr + pairs, pos, mask=in_range)
        tl.store(row_ptr + pairs, tl.where(dropped, -1, local * rows_per_expert + pos),
                 mask=in_range)
        counts += tl.sum(hits.to(tl.int32), axis=0)
    tl.store(count_ptr + e, tl.minimum(counts, rows_per_expert), mask=e < local_num_experts)


def route_triton(ids: torch.Tensor, rank: int, local_num_experts: int, served: torch.Tensor,
                 local: torch.Tensor, pos: torch.Tensor, recv_row: torch.Tensor,
                 recv_count: torch.Tensor) -> None:
    """Launch the kernel on validated tensors (CUDA, or CPU under TRITON_INTERPRET=1): ids int64
    [R*N, k] with unit column stride; the outputs as ``route`` returns them, contiguous."""
    rows, topk = ids.shape
    block_e = next_power_of_2(local_num_experts)
    block_p = max(16, 4096 // block_e)
    launch(_route_kernel, (1,), (
        ids, served.view(torch.uint8), local, pos, recv_row, recv_count, rows * topk,
        ids.stride(0), rank * local_num_experts, local_num_experts, rows, topk, block_p, block_e),
        num_warps=4)


def route_ref(ids: torch.Tensor, rank: int, local_num_experts: int, served: torch.Tensor,
              local: torch.Tensor, pos: torch.Tensor, recv_row: torch.Tensor,
              recv_count: torch.Tensor) -> None:
    """torch reference of ``route_triton`` (same arguments, same results)."""
    rows = ids.shape[0]
    first = ids - rank * local_num_experts
    here = (first >= 0) & (first < local_num_experts)
    expert = first.clamp(0, local_num_experts - 1)
    experts = torch.arange(local_num_experts, device=ids.device)
    hits = (expert.view(-1, 1) == experts) & here.view(-1, 1)
    running = hits.cumsum(0, dtype=torch.int32)                            # [R*N*k, E_l]
    rank_in_expert = running.gather(1, expert.view(-1, 1)).view(ids.shape).long() - 1
    served.copy_(here & (rank_in_expert < rows))
    local.copy_(torch.where(served, expert, 0))
    pos.copy_(torch.where(served, rank_in_expert, 0))
    recv_row.copy_(torch.where(here & ~served, -1, local * rows + pos))
    recv_count.copy_(running[-1].clamp(max=rows))


def route(ids: torch.Tensor, rank: int, local_num_experts: int, out: tuple | None = None):
    """Where each received (source, token, slot) pair goes, from the gathered ids [R*N, k].

    Returns, each [R*N, k] and contiguous: served (bool: the pair's expert lives on ``rank``),
    local (int64: its local expert), pos (int64: its row in that expert's [R*N] slice; pairs are
    numbered in (source, token, slot) order), recv_row (int64: local * R*N + pos), all 0 where not
    served, except recv_row -1 for a pair dropped past its expert's R*N rows (a top-k repeating
    an expert); and recv_count (int32 [E_l], rows per local expert, at most R*N). ``out``: those
    five tensors,
    written and returned (None: allocated). No host sync on CUDA (one Triton program), the torch
    reference on the CPU."""
    if out is None:
        dev = ids.device
        out = (torch.empty(ids.shape, dtype=torch.bool, device=dev),
               *(torch.empty(ids.shape, dtype=torch.int64, device=dev) for _ in range(3)),
               torch.empty(local_num_experts, dtype=torch.int32, device=dev))
    launch = route_triton if ids.is_cuda else route_ref
    launch(ids, rank, local_num_experts, *out)
    return out


# ----------------------------------------------------------------- scatter into the masked layout
@triton.jit
def _copy_served_rows(src_ptr, dst_ptr, pairs, served, local, pos, tile, width, src_stride_row,
                      src_stride_col, dst_stride_expert, dst_stride_row, dst_stride_col,
                      TOPK: tl.constexpr, BLOCK_W: tl.constexpr):
    cols = tile * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = served[:, None] & (cols < width)[None, :]
    # Pair p carries source row p // TOPK; pairs served elsewhere neither read nor write.
    src = src_ptr + (pairs // TOPK)[:, None] * src_stride_row + cols[None, :] * src_stride_col
    dst_rows = local * dst_stride_expert + pos * dst_stride_row
    dst = dst_ptr + dst_rows[:, None] + cols[None, :] * dst_stride_col
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


@triton.jit
def _scatter_rows_kernel(src_ptr, dst_ptr, src2_ptr, dst2_ptr, served_ptr, local_ptr, pos_ptr,
                         num_pairs, width, width2, tiles, src_stride_row, src_stride_col,
                         dst_stride_expert, dst_stride_row, dst_stride_col, src2_stride_row,
                         src2_stride_col, dst2_stride_expert, dst2_stride_row, dst2_stride_col,
                         TOPK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr):
    # Column tiles 0..tiles-1 copy the first plane (src -> dst), the rest the second plane.
    pairs = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    served = tl.load(served_ptr + pairs, mask=pairs < num_pairs, other=0) != 0
    local = tl.load(local_ptr + pairs, mask=served, other=0)
    pos = tl.load(pos_ptr + pairs, mask=served, other=0)
    tile = tl.program_id(1).to(tl.int64)
    if tile < tiles:
        _copy_served_rows(src_ptr, dst_ptr, pairs, served, local, pos, tile, width,
                          src_stride_row, src_stride_col, dst_stride_expert, dst_stride_row,
                          dst_stride_col, TOPK, BLOCK_W)
    else:
        _copy_served_rows(src2_ptr, dst2_ptr, pairs, served, local, pos, tile - tiles, width2,
                          src2_stride_row, src2_stride_col, dst2_stride_expert, dst2_stride_row,
                          dst2_stride_col, TOPK, BLOCK_W)


def scatter_rows_triton(src: torch.Tensor, dst: torch.Tensor, served: torch.Tensor,
                        local: torch.Tensor, pos: torch.Tensor, src2: torch.Tensor | None = None,
                        dst2: torch.Tensor | None = None) -> None:
    """Launch the kernel on validated tensors (CUDA, or CPU under TRITON_INTERPRET=1).

    src [R*N, W] (any strides); dst [E_l, R*N, W] of src's dtype (any strides; row (e, pos) of each
    served pair written); served bool, local and pos int64, all [R*N, k] contiguous. src2/dst2:
    an optional second plane ([R*N, W2] -> [E_l, R*N, W2], same rules) copied by the same launch
    (one launch fewer on the host)."""
    pairs, topk = served.shape
    width = src.shape[1]
    width2 = 0 if src2 is None else src2.shape[1]
    if src2 is None:  # the second plane's arguments are never used
        src2, dst2 = src, dst
    if pairs == 0 or width + width2 == 0:
        return
    block_w = min(next_power_of_2(max(width, width2)), 1024)
    block_p = max(1, min(64, 2048 // block_w))
    tiles = cdiv(width, block_w)
    grid = (cdiv(pairs * topk, block_p), tiles + cdiv(width2, block_w))
    launch(_scatter_rows_kernel, grid, (
        src, dst, src2, dst2, served.view(torch.uint8), local, pos, pairs * topk, width, width2,
        tiles, *src.stride(), *dst.stride(), *src2.stride(), *dst2.stride(), topk, block_p,
        block_w), num_warps=4)


def scatter_rows_ref(src: torch.Tensor, dst: torch.Tensor, served: torch.Tensor,
                     local: torch.Tensor, pos: torch.Tensor, src2: torch.Tensor | None = None,
                     dst2: torch.Tensor | None = None) -> None:
    """torch reference of ``scatter_rows_triton`` (same arguments, same result)."""
    p, j = served.nonzero(as_tuple=True)
    for s, d in ((src, dst), (src2, dst2)):
        if s is not None:
            d[local[p, j], pos[p, j]] = s[p]


def scatter_rows(src: torch.Tensor, dst: torch.Tensor, served: torch.Tensor, local: torch.Tensor,
                 pos: torch.Tensor, src2: torch.Tensor | None = None,
                 dst2: torch.Tensor | None = None) -> None:
    """Copy row p of src [R*N, W] to dst[local[p, j], pos[p, j]] for every served pair (p, j)
    of the [R*N, k] routing (and of src2 to dst2, when given, in the same launch); no host sync
    on CUDA (Triton), the torch reference on the CPU."""
    launch = scatter_rows_triton if src.is_cuda else scatter_rows_ref
    launch(src, dst, served, local, pos, src2, dst2)


# ----------------------------------------------------------------- weighted partial sums
@triton.jit
def _partial_sums_kernel(x_ptr, row_ptr, served_ptr, w_ptr, out_ptr, hidden, x_stride_row,
                         out_stride_row, TOPK: tl.constexpr, BLOCK_H: tl.constexpr,
                         ROUND_BF16: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        served = tl.load(served_ptr + r * TOPK + j) != 0
        row = tl.load(row_ptr + r * TOPK + j)
        w = tl.where(served, tl.load(w_ptr + r * TOPK + j), 0.0)
        # A slot served elsewhere is not read (no column is in range): it adds exactly 0 even
        # over NaN rows. A dropped slot (row -1) adds NaN: its token lost a contribution.
        in_range = cols < tl.where(served, hidden, 0)
        v = tl.load(x_ptr + row * x_stride_row + cols, mask=in_range, other=0.0).to(tl.float32)
        acc = tl.where(row < 0, float("nan"), acc + v * w)
    if ROUND_BF16:  # interpreter only: its bfloat16 cast truncates
        acc = round_to_bf16_grid(acc)
    tl.store(out_ptr + r * out_stride_row + cols, acc, mask=cols < hidden)


def partial_sums_triton(x_rows: torch.Tensor, recv_row: torch.Tensor, served: torch.Tensor,
                        weights: torch.Tensor, out: torch.Tensor) -> None:
    """Launch the kernel on validated tensors (CUDA, or CPU under TRITON_INTERPRET=1).

    x_rows bf16 [E_l*R*N, H] (unit column stride); recv_row int64 (-1: dropped), served bool,
    weights float32, all [R*N, k] contiguous; out float32 or bf16 [R*N, H] (unit column stride),
    written (a bf16 out gets the float32 sums rounded to nearest even)."""
    rows, topk = served.shape
    hidden = x_rows.shape[1]
    if rows == 0 or hidden == 0:
        return
    block_h = min(next_power_of_2(hidden), 2048)
    launch(_partial_sums_kernel, (rows, cdiv(hidden, block_h)), (
        x_rows, recv_row, served.view(torch.uint8), weights, out, hidden, x_rows.stride(0),
        out.stride(0), topk, block_h, INTERPRETING and out.dtype == torch.bfloat16),
        num_warps=4, enable_fp_fusion=False)


def partial_sums_ref(x_rows: torch.Tensor, recv_row: torch.Tensor, served: torch.Tensor,
                     weights: torch.Tensor, out: torch.Tensor) -> None:
    """torch reference of ``partial_sums_triton``: the same float32 products, added in slot
    order (then rounded once into a bf16 out)."""
    sums = out if out.dtype == torch.float32 else torch.empty(out.shape, device=out.device)
    sums.zero_()
    for j in range(served.shape[1]):
        got = x_rows.index_select(0, recv_row[:, j].clamp(min=0)).float() * weights[:, j:j + 1]
        sums += torch.where(served[:, j:j + 1], got, 0.0)
        sums[recv_row[:, j] < 0] = float("nan")
    out.copy_(sums)


def partial_sums(x_rows: torch.Tensor, recv_row: torch.Tensor, served: torch.Tensor,
                 weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per received (source, token) row r: sum over slots j served here of weights[r, j] *
    x_rows[recv_row[r, j]], float32 [R*N, H] (``out``, float32 or bf16, written and returned;
    None: allocated float32).
    Slots served elsewhere contribute exact zeros whatever their rows hold (a zero weight alone
    would not cancel NaN garbage); a dropped slot (recv_row -1) makes its row NaN."""
    if out is None:
        out = torch.empty(served.shape[0], x_rows.shape[1], dtype=torch.float32,
                          device=x_rows.device)
    launch = partial_sums_triton if x_rows.is_cuda else partial_sums_ref
    launch(x_rows, recv_row, served, weights, out)
    return out


def slot_source_rows(ids: torch.Tensor, n: int, local_num_experts: int) -> torch.Tensor:
    """Where each (token, slot) of this rank's dispatched ids int64 [T, k] (-1: no slot) came
    back in the combine's received bf16 [R, N, k, H] viewed as [R*N*k, H]: the block of the
    rank that owns the slot's expert, row (token, slot) in it; int64 [T, k], 0 where the id is
    -1 (not read). No host sync."""
    t, k = ids.shape
    own = torch.arange(t * k, device=ids.device).view(t, k)
    return torch.where(ids >= 0, ids.div(local_num_experts, rounding_mode="floor") * (n * k)
                       + own, 0)
