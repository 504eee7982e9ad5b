"""Quantise activations straight into the expert-contiguous layout: one kernel where the contiguous
experts otherwise run two (per_token_group_quant_fp8 into [M, K], then permute_rows into
[M_sum, K]).

Each token row is read once, quantised per 1x128 group by the quant kernel's own arithmetic
(fp8_quant.quantize_groups: the same float32 steps, hence the same bits; exact scales, or with
use_ue8m0 scales rounded up to powers of two, as the quant's option), and its FP8 bytes and
scales are stored at every row its k slots were given (layout.dest; a slot with dest -1 has no
row). Rows no slot fills (layout.src_row -1: each segment's padding and the tail after the last
one) are written as zeros, values and scales, as permute_rows writes them. So the result is
bit for bit that of quantising and then permuting.

Grid, one dimension of cdiv(M, BLOCK_M) * G_BLOCKS token programs, then cdiv(M_sum, PAD_ROWS)
padding programs:
    token program    a tile of BLOCK_M tokens x GROUPS_PER_PROG groups (the quant kernel's tile:
                     one group per row of a [BLOCK_M * GROUPS_PER_PROG, 128] block), quantised
                     once, stored k times
    padding program  PAD_ROWS rows of the layout; the padding ones among them get zero bytes
                     (PAD_COLS at a time) and zero scales; a program with no padding row stores
                     nothing
Byte and row offsets are int64, so the permuted output may exceed 2**31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_moe_fixes._validate import check as _check
from vllm_moe_fixes._validate import check_bool
from vllm_moe_fixes.ops.fp8 import SCALE_BLOCK
from vllm_moe_fixes.ops.fp8_quant import (
    QUANT_BLOCK_M,
    QUANT_EPS,
    QUANT_GROUPS_PER_PROG,
    QUANT_NUM_WARPS,
    QUANT_SMALL_M_BLOCK_M,
    QUANT_SMALL_M_NUM_WARPS,
    per_token_group_quant_fp8_ref,
    quantize_groups,
)
from vllm_moe_fixes.ops.permute import (
    ContiguousLayout,
    check_permuted_outputs,
    permute_rows_ref,
)
from vllm_moe_fixes.ops.triton_utils import INTERPRETING, KernelLauncher, next_power_of_2
from vllm_moe_fixes.sizes import cdiv

PAD_ROWS, PAD_COLS = 16, 1024  # a padding program's rows, and the bytes of a row it stores at once


@triton.jit
def _quant_permute_kernel(x_ptr, dest_ptr, src_ptr, q_ptr, s_ptr, M, num_groups, M_sum,
                          x_row_stride, q_row_stride, s_row_stride, s_group_stride, eps,
                          n_token_programs, G_BLOCKS, TOPK: tl.constexpr, GROUP: tl.constexpr,
                          BLOCK_M: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                          BLOCK_G: tl.constexpr, PAD_ROWS: tl.constexpr, PAD_COLS: tl.constexpr,
                          UE8M0: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    pid = tl.program_id(0)
    if pid < n_token_programs:
        # Block row i holds group (i % GROUPS_PER_PROG) of tile row (i // GROUPS_PER_PROG).
        i = tl.arange(0, BLOCK_M * GROUPS_PER_PROG)
        rows = (pid // G_BLOCKS).to(tl.int64) * BLOCK_M + i // GROUPS_PER_PROG
        groups = (pid % G_BLOCKS).to(tl.int64) * GROUPS_PER_PROG + i % GROUPS_PER_PROG
        valid = (rows < M) & (groups < num_groups)
        cols = tl.arange(0, GROUP)
        x = tl.load(x_ptr + (rows * x_row_stride + groups * GROUP)[:, None] + cols[None, :],
                    mask=valid[:, None], other=0.0).to(tl.float32)
        q, scale = quantize_groups(x, eps, UE8M0, ROUND_IN_FP32)
        q = q.to(q_ptr.dtype.element_ty)
        for j in tl.static_range(TOPK):
            d = tl.load(dest_ptr + rows * TOPK + j, mask=valid, other=-1).to(tl.int64)
            ok = valid & (d >= 0)
            tl.store(q_ptr + (d * q_row_stride + groups * GROUP)[:, None] + cols[None, :], q,
                     mask=ok[:, None])
            tl.store(s_ptr + d * s_row_stride + groups * s_group_stride, scale, mask=ok)
    else:
        # Names differ from the token branch's: Triton wants a name both branches assign to
        # have one type (rows there is [BLOCK_M * GROUPS_PER_PROG], here [PAD_ROWS]).
        layout_rows = (pid - n_token_programs).to(tl.int64) * PAD_ROWS + tl.arange(0, PAD_ROWS)
        in_range = layout_rows < M_sum
        pad = in_range & (tl.load(src_ptr + layout_rows, mask=in_range, other=0) < 0)
        if tl.sum(pad.to(tl.int32), axis=0) > 0:
            K = num_groups * GROUP
            zeros = tl.zeros([PAD_ROWS, PAD_COLS], tl.float32).to(q_ptr.dtype.element_ty)
            for c0 in range(0, K, PAD_COLS):
                c = c0 + tl.arange(0, PAD_COLS)
                tl.store(q_ptr + layout_rows[:, None] * q_row_stride + c[None, :], zeros,
                         mask=pad[:, None] & (c < K)[None, :])
            g = tl.arange(0, BLOCK_G).to(tl.int64)
            tl.store(s_ptr + layout_rows[:, None] * s_row_stride + g[None, :] * s_group_stride,
                     tl.zeros([PAD_ROWS, BLOCK_G], tl.float32),
                     mask=pad[:, None] & (g < num_groups)[None, :])


def quant_permute_triton(x: torch.Tensor, layout: ContiguousLayout, out_q: torch.Tensor,
                         out_s: torch.Tensor, use_ue8m0: bool = False, *,
                         round_in_fp32: bool = INTERPRETING) -> None:
    """Launch `_quant_permute_kernel` on validated tensors (CUDA, or CPU under TRITON_INTERPRET=1;
    same arguments as `quant_permute`). The token tile is the quant kernel's (fp8_quant's
    QUANT_* sizes, its small-M tile below QUANT_BLOCK_M rows); round_in_fp32 as there."""
    M, K = x.shape
    m_sum = out_q.shape[0]
    num_groups = K // SCALE_BLOCK
    if m_sum == 0 or num_groups == 0:
        return
    topk = layout.dest.shape[0] // M if M else 1
    small = M < QUANT_BLOCK_M
    block_m = QUANT_SMALL_M_BLOCK_M if small else QUANT_BLOCK_M
    num_warps = QUANT_SMALL_M_NUM_WARPS if small else QUANT_NUM_WARPS
    groups_per_prog = min(QUANT_GROUPS_PER_PROG, next_power_of_2(num_groups))
    g_blocks = cdiv(num_groups, groups_per_prog)
    n_token_programs = cdiv(M, block_m) * g_blocks
    _launch((n_token_programs + cdiv(m_sum, PAD_ROWS), 1, 1), num_warps,
            (x, layout.dest, layout.src_row, out_q, out_s),
            (M, num_groups, m_sum, x.stride(0), out_q.stride(0), out_s.stride(0),
             out_s.stride(1), QUANT_EPS, n_token_programs, g_blocks, topk, SCALE_BLOCK, block_m,
             groups_per_prog, next_power_of_2(num_groups), PAD_ROWS, PAD_COLS, bool(use_ue8m0),
             bool(round_in_fp32)))


_launch = KernelLauncher(_quant_permute_kernel)


def quant_permute_ref(x: torch.Tensor, layout: ContiguousLayout, out_q: torch.Tensor,
                      out_s: torch.Tensor, use_ue8m0: bool = False) -> None:
    """Torch reference of `quant_permute`: the quant's reference, then permute_rows'."""
    q, s = per_token_group_quant_fp8_ref(x, SCALE_BLOCK, QUANT_EPS, use_ue8m0)
    permute_rows_ref(q, s, layout, out_q, out_s)


def quant_permute(x: torch.Tensor, layout: ContiguousLayout, out_q: torch.Tensor,
                  out_s: torch.Tensor, *, use_ue8m0: bool = False) -> None:
    """Quantise x per 1x128 group into the contiguous layout's rows (module docstring).

    Args:
        x: bfloat16 [M, K], rows contiguous (stride(1) == 1); K a multiple of 128.
        layout: from build_contiguous_layout for M*k slots (dest int32 [M*k], src_row int32
            [M_sum]).
        out_q: float8_e4m3fn [M_sum, K], rows contiguous (written; padding rows exact zeros).
        out_s: float32 [M_sum, K/128], any strides (the experts pass (1, M_sum), MN-major);
            written, padding rows 0.
        use_ue8m0: round every scale up to a power of two, as per_token_group_quant_fp8 does.

    The same bits as per_token_group_quant_fp8(x, use_ue8m0=use_ue8m0) followed by
    permute_rows(...). One Triton kernel on CUDA (`quant_permute_triton`), the torch reference
    elsewhere.
    """
    _check(x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1,
           f"x must be bfloat16 [M, K] with contiguous rows, got {x.dtype} {tuple(x.shape)} "
           f"strides {x.stride()}")
    M, K = x.shape
    m_sum = layout.src_row.shape[0]
    _check(K % SCALE_BLOCK == 0, f"x: K must be a multiple of {SCALE_BLOCK}, got {K}")
    _check(layout.dest.dim() == 1 and (layout.dest.numel() % M == 0 if M else True),
           f"layout.dest must be [M*k] for M={M}, got {tuple(layout.dest.shape)}")
    check_permuted_outputs(out_q, out_s, m_sum, K)
    devices = {t.device for t in (x, out_q, out_s, layout.src_row, layout.dest)}
    _check(len(devices) == 1, f"all tensors must be on one device, got {sorted(map(str, devices))}")
    check_bool("use_ue8m0", use_ue8m0)
    if x.is_cuda:
        quant_permute_triton(x, layout, out_q, out_s, use_ue8m0)
    else:
        quant_permute_ref(x, layout, out_q, out_s, use_ue8m0)
