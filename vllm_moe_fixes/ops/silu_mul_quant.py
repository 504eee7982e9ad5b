"""SiLU-and-mul fused with the 1x128 FP8 requantisation: GEMM1's output in, GEMM2's input out.

    x    [M, 2I] or [E, T, 2I]  (gate | up)  --one kernel-->  x_q float8_e4m3fn [..., I]
                                                               x_s float32 [..., I / 128]

Numbers: exactly `per_token_group_quant_fp8(silu_and_mul(x), 128)`: silu(gate) rounded to x's
dtype, the product with `up` rounded to x's dtype, then vLLM's quant recipe on that value
(`silu_and_mul_values` from activation.py and `quantize_groups` from fp8_quant.py, the functions
the two unfused kernels run), so fusing changes speed, not bits.

Kernel: one program per tile of BLOCK_M rows x GROUPS_PER_PROG groups of 128 output channels of
one expert (grid: row tiles x group tiles x experts, sized by x's shape). A tile is a 2-D block
[BLOCK_M * GROUPS_PER_PROG, 128], one group per block row, so each group's max is one
`tl.max(axis=1)`. It reads the gate and up halves once and writes the FP8 values and one scale per
group; the intermediate bf16 product never reaches memory. In the batched layout each program
reads its expert's row count from `expert_num_tokens` on the device (no host sync) and returns at
once when its tile starts past it; rows at or past the count are neither read nor written.
All offsets are int64.
"""

import torch
import triton
import triton.language as tl

from vllm_moe_fixes._validate import check_bool
from vllm_moe_fixes.ops.activation import silu_and_mul_ref, silu_and_mul_values
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, SCALE_BLOCK, empty_mn_major_scales
from vllm_moe_fixes.ops.fp8_quant import QUANT_EPS, per_token_group_quant_fp8_ref, quantize_groups
from vllm_moe_fixes.ops.triton_utils import INTERPRETING, KernelLauncher
from vllm_moe_fixes.sizes import cdiv

_SUPPORTED_X = (torch.bfloat16, torch.float16, torch.float32)

# Default launch config (`python -m benchmarks.bench_quant --only fused --sweep` times others):
# 4 rows x 4 groups per program keeps decode tiles small (a few rows per expert) and reads 8 KiB
# of bf16 per program.
FUSED_BLOCK_M, FUSED_GROUPS_PER_PROG, FUSED_NUM_WARPS = 4, 4, 4


@triton.jit
def _silu_and_mul_quant_fp8_kernel(
    x_ptr, q_ptr, s_ptr, counts_ptr, rows_per_expert, num_groups,
    x_expert_stride, x_row_stride, q_expert_stride, q_row_stride,
    s_expert_stride, s_row_stride, s_group_stride, eps,
    HAS_COUNTS: tl.constexpr, BLOCK_M: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
    UE8M0: tl.constexpr, INTERPRETED: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):
    expert = tl.program_id(2).to(tl.int64)
    # Rows of this expert to process: all of them, or its count (at most rows_per_expert).
    num_rows = rows_per_expert
    if HAS_COUNTS:
        num_rows = tl.minimum(tl.load(counts_ptr + expert), rows_per_expert)
    row_start = tl.program_id(0) * BLOCK_M
    if row_start >= num_rows:
        return

    # Block row i holds group (i % GROUPS_PER_PROG) of tile row (i // GROUPS_PER_PROG).
    i = tl.arange(0, BLOCK_M * GROUPS_PER_PROG)
    rows = row_start.to(tl.int64) + i // GROUPS_PER_PROG
    groups = tl.program_id(1).to(tl.int64) * GROUPS_PER_PROG + i % GROUPS_PER_PROG
    valid = (rows < num_rows) & (groups < num_groups)
    mask = valid[:, None]
    cols = tl.arange(0, SCALE_BLOCK)

    # gate is x[..., :I], up is x[..., I:], I = num_groups * 128.
    gate_ptrs = (x_ptr + expert * x_expert_stride
                 + (rows * x_row_stride + groups * SCALE_BLOCK)[:, None] + cols[None, :])
    gate = tl.load(gate_ptrs, mask=mask, other=0.0)
    up = tl.load(gate_ptrs + num_groups * SCALE_BLOCK, mask=mask, other=0.0)
    y = silu_and_mul_values(gate, up, x_ptr.dtype.element_ty, INTERPRETED)
    q, scale = quantize_groups(y.to(tl.float32), eps, UE8M0, INTERPRETED)

    q_ptrs = (q_ptr + expert * q_expert_stride
              + (rows * q_row_stride + groups * SCALE_BLOCK)[:, None] + cols[None, :])
    tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + expert * s_expert_stride + rows * s_row_stride + groups * s_group_stride,
             scale, mask=valid)


def silu_and_mul_quant_fp8_triton(
    x: torch.Tensor, x_q: torch.Tensor, x_s: torch.Tensor,
    expert_num_tokens: torch.Tensor | None, use_ue8m0: bool, *,
    block_m: int = FUSED_BLOCK_M, groups_per_prog: int = FUSED_GROUPS_PER_PROG,
    num_warps: int = FUSED_NUM_WARPS,
) -> None:
    """Launch on validated tensors (CUDA, or CPU under TRITON_INTERPRET=1; arguments as in
    silu_and_mul_quant_fp8). block_m and groups_per_prog are powers of two."""
    if x.dim() == 2:
        experts, rows_per_expert = 1, x.shape[0]
        x_e, q_e, s_e = 0, 0, 0
    else:
        experts, rows_per_expert = x.shape[:2]
        x_e, q_e, s_e = x.stride(0), x_q.stride(0), x_s.stride(0)
    num_groups = x_q.shape[-1] // SCALE_BLOCK
    if experts == 0 or rows_per_expert == 0 or num_groups == 0:
        return
    grid = (cdiv(rows_per_expert, block_m), cdiv(num_groups, groups_per_prog), experts)
    # Without counts x stands in for counts_ptr (HAS_COUNTS=False: never read).
    counts = x if expert_num_tokens is None else expert_num_tokens
    # the parameters after the tensors, in signature order, constexprs last (HAS_COUNTS ..)
    _launch_fused(grid, num_warps, (x, x_q, x_s, counts), (
        rows_per_expert, num_groups, x_e, x.stride(-2), q_e, x_q.stride(-2), s_e,
        x_s.stride(-2), x_s.stride(-1), float(QUANT_EPS), expert_num_tokens is not None, block_m,
        groups_per_prog, bool(use_ue8m0), INTERPRETING, SCALE_BLOCK))


_launch_fused = KernelLauncher(_silu_and_mul_quant_fp8_kernel)


def silu_and_mul_quant_fp8_ref(
    x: torch.Tensor, use_ue8m0: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., 2I] (I a multiple of 128) -> the FP8 quant (group 128, eps QUANT_EPS) of
    silu_and_mul_ref(x): (float8_e4m3fn [..., I], float32 [..., I / 128] row-major)."""
    return per_token_group_quant_fp8_ref(silu_and_mul_ref(x), SCALE_BLOCK, QUANT_EPS, use_ue8m0)


def _silu_and_mul_quant_fp8_torch(x, x_q, x_s, expert_num_tokens, use_ue8m0) -> None:
    """The CPU path: the two reference ops composed, on the valid rows only."""
    if x.dim() == 2:
        q, s = silu_and_mul_quant_fp8_ref(x, use_ue8m0)
        x_q.copy_(q)
        x_s.copy_(s)
        return
    for e, count in enumerate(expert_num_tokens.tolist()):
        rows = min(max(count, 0), x.shape[1])
        if rows:
            q, s = silu_and_mul_quant_fp8_ref(x[e, :rows], use_ue8m0)
            x_q[e, :rows].copy_(q)
            x_s[e, :rows].copy_(s)


def _check_x(x, expert_num_tokens) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in _SUPPORTED_X:
        raise ValueError(f"x must be a bfloat16/float16/float32 tensor, got "
                         f"{getattr(x, 'dtype', type(x))}")
    want_dim = 2 if expert_num_tokens is None else 3
    if x.dim() != want_dim:
        layout = ("[M, 2I] without expert_num_tokens" if want_dim == 2
                  else "[E, T, 2I] with expert_num_tokens")
        raise ValueError(f"x must be {layout}, got shape {tuple(x.shape)}")
    two_i = x.shape[-1]
    if two_i == 0 or two_i % (2 * SCALE_BLOCK):
        raise ValueError(f"x's last dimension 2I={two_i} must be a positive multiple of "
                         f"{2 * SCALE_BLOCK} (I a multiple of {SCALE_BLOCK})")
    if x.stride(-1) != 1:
        raise ValueError(f"x's rows must be contiguous (last stride 1), got strides "
                         f"{tuple(x.stride())}")


def _check_counts(expert_num_tokens, x) -> None:
    if expert_num_tokens is None:
        return
    if not isinstance(expert_num_tokens, torch.Tensor) or expert_num_tokens.dtype != torch.int32:
        raise ValueError(f"expert_num_tokens must be a torch.int32 tensor, got "
                         f"{getattr(expert_num_tokens, 'dtype', type(expert_num_tokens))}")
    if tuple(expert_num_tokens.shape) != (x.shape[0],) or expert_num_tokens.device != x.device:
        raise ValueError(f"expert_num_tokens must have shape ({x.shape[0]},) on {x.device}, got "
                         f"{tuple(expert_num_tokens.shape)} on {expert_num_tokens.device}")
    if not expert_num_tokens.is_contiguous():
        raise ValueError("expert_num_tokens must be contiguous")


def _output(name, out, shape, dtype, device) -> torch.Tensor:
    """out after checks (dtype, shape, device, last stride 1 for x_q), or a new tensor: x_q
    contiguous, x_s MN-major and TMA-aligned (the layout the GEMMs read)."""
    if out is None:
        if dtype is FP8_DTYPE:
            return torch.empty(shape, dtype=dtype, device=device)
        return empty_mn_major_scales(shape, device)
    if not isinstance(out, torch.Tensor) or out.dtype is not dtype:
        raise ValueError(f"{name} must be a {dtype} tensor, got "
                         f"{getattr(out, 'dtype', type(out))}")
    if tuple(out.shape) != tuple(shape) or out.device != device:
        raise ValueError(f"{name} must have shape {tuple(shape)} on {device}, got "
                         f"{tuple(out.shape)} on {out.device}")
    if dtype is FP8_DTYPE and out.numel() > 1 and out.stride(-1) != 1:
        raise ValueError(f"out_q's rows must be contiguous (last stride 1), got strides "
                         f"{tuple(out.stride())}")
    return out


def silu_and_mul_quant_fp8(
    x: torch.Tensor,
    *,
    out_q: torch.Tensor | None = None,
    out_s: torch.Tensor | None = None,
    expert_num_tokens: torch.Tensor | None = None,
    use_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU-and-mul, then per-token 1x128 FP8 quantisation, in one kernel.

    Arguments:
        x: `[M, 2I]` (contiguous layout), or `[E, T, 2I]` with expert_num_tokens (batched
            layout), bfloat16 / float16 / float32, last stride 1, I a positive multiple of 128.
            The gate is x[..., :I], the up projection x[..., I:].
        out_q: optional `[..., I]` float8_e4m3fn on x's device, last stride 1 (any other
            strides); written and returned as x_q. Default: a new contiguous tensor.
        out_s: optional `[..., I / 128]` float32 on x's device, any strides (e.g. the MN-major
            scales the grouped GEMMs read); written and returned as x_s. Default: MN-major and
            TMA-aligned (`ops.fp8.empty_mn_major_scales`).
        expert_num_tokens: `[E]` torch.int32 on x's device, for the batched layout: only rows
            t < min(expert_num_tokens[e], T) of expert e are read and written; the other rows of
            x_q and x_s keep what they held. Read on the device (no host sync).
        use_ue8m0: round every scale up to a power of two, as per_token_group_quant_fp8 does.

    Returns:
        x_q: float8_e4m3fn `[..., I]`, x_s: float32 `[..., I / 128]`, bit for bit
        `per_token_group_quant_fp8(silu_and_mul(x), 128, use_ue8m0=use_ue8m0)` on the rows
        processed (eps 1e-10; NaN and inf as documented there).

    CUDA tensors run the Triton kernel (int64 offsets); CPU tensors run the two torch references
    composed.
    """
    _check_x(x, expert_num_tokens)
    _check_counts(expert_num_tokens, x)
    check_bool("use_ue8m0", use_ue8m0)
    n = x.shape[-1] // 2
    x_q = _output("out_q", out_q, (*x.shape[:-1], n), FP8_DTYPE, x.device)
    x_s = _output("out_s", out_s, (*x.shape[:-1], n // SCALE_BLOCK), torch.float32, x.device)
    if x.is_cuda:
        silu_and_mul_quant_fp8_triton(x, x_q, x_s, expert_num_tokens, use_ue8m0)
    else:
        _silu_and_mul_quant_fp8_torch(x, x_q, x_s, expert_num_tokens, use_ue8m0)
    return x_q, x_s
