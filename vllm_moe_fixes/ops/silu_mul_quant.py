"""SiLU-and-mul fused with the 1x128 FP8 requantisation: GEMM1's output in, GEMM2's input out.

    x    [M, 2I] or [E, T, 2I]  (gate | up)  --one kernel-->  x_q float8_e4m3fn [..., I]
                                                               x_s float32 [..., I / 128]

Numbers: exactly `per_token_group_quant_fp8(silu_and_mul(x), 128)`: silu(gate) rounded to x's
dtype, the product with `up` rounded to x's dtype, then vLLM's quant recipe on that value
(`silu_and_mul_values` from activation.py and `quantize_groups` from fp8_quant.py, the functions
the two unfused kernels run), so fusing changes speed, not bits.

Kernel: a program takes tiles of BLOCK_M rows x GROUPS_PER_PROG groups of 128 output channels of
one expert (grid: row programs x group tiles x experts), striding over that expert's rows by the
row programs' count, which is capped (max_programs): a few thousand programs that each loop cost
less than one short program per tile. A tile is a 2-D block [BLOCK_M * GROUPS_PER_PROG, 128], one
group per block row, so each group's max is one `tl.max(axis=1)`. It reads the gate and up halves
once and writes the FP8 values and one scale per group; the intermediate bf16 product never
reaches memory. Which rows of an expert are live (others are neither read nor written):
  - every row (plain [M, 2I]);
  - batched [E, T, 2I] with `expert_num_tokens`: rows t < min(count[e], T), counts read on the
    device (no host sync);
  - contiguous [M_sum, 2I] with `expert_ends` (DeepGEMM's psum layout, ops/permute.py): expert
    e's rows [align128(ends[e-1]), ends[e]); padding rows are skipped, which the GEMMs on that
    layout never read.
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
from vllm_moe_fixes.sizes import ROW_ALIGNMENT, align_up, cdiv

_SUPPORTED_X = (torch.bfloat16, torch.float16, torch.float32)

# Default launch config, from `python -m benchmarks.bench_quant --only fused --sweep` on the H200.
FUSED_BLOCK_M, FUSED_GROUPS_PER_PROG, FUSED_NUM_WARPS = 4, 4, 4
# Row programs x group tiles x experts stays at or under this (each row program loops).
FUSED_MAX_PROGRAMS = 8192

# Which rows of an expert the kernel processes (module docstring).
ALL_ROWS, COUNTED_ROWS, PSUM_ROWS = 0, 1, 2


@triton.jit
def _silu_and_mul_quant_tile(x_ptr, q_ptr, s_ptr, row_start, num_rows, num_groups, x_row_stride,
                             q_row_stride, s_row_stride, s_group_stride, eps,
                             BLOCK_M: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                             UE8M0: tl.constexpr, INTERPRETED: tl.constexpr,
                             SCALE_BLOCK: tl.constexpr):
    """One tile: rows [row_start, row_start + BLOCK_M) below num_rows, this program's groups."""
    # Block row i holds group (i % GROUPS_PER_PROG) of tile row (i // GROUPS_PER_PROG).
    i = tl.arange(0, BLOCK_M * GROUPS_PER_PROG)
    rows = row_start + i // GROUPS_PER_PROG
    groups = tl.program_id(1).to(tl.int64) * GROUPS_PER_PROG + i % GROUPS_PER_PROG
    valid = (rows < num_rows) & (groups < num_groups)
    mask = valid[:, None]
    cols = tl.arange(0, SCALE_BLOCK)

    # gate is x[..., :I], up is x[..., I:], I = num_groups * 128.
    gate_ptrs = x_ptr + (rows * x_row_stride + groups * SCALE_BLOCK)[:, None] + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0)
    up = tl.load(gate_ptrs + num_groups * SCALE_BLOCK, mask=mask, other=0.0)
    y = silu_and_mul_values(gate, up, x_ptr.dtype.element_ty, INTERPRETED)
    q, scale = quantize_groups(y.to(tl.float32), eps, UE8M0, INTERPRETED)

    q_ptrs = q_ptr + (rows * q_row_stride + groups * SCALE_BLOCK)[:, None] + cols[None, :]
    tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows * s_row_stride + groups * s_group_stride, scale, mask=valid)


@triton.jit
def _silu_and_mul_quant_fp8_kernel(
    x_ptr, q_ptr, s_ptr, bounds_ptr, rows_per_expert, num_groups,
    x_expert_stride, x_row_stride, q_expert_stride, q_row_stride,
    s_expert_stride, s_row_stride, s_group_stride, eps,
    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
    UE8M0: tl.constexpr, INTERPRETED: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    ROW_ALIGNMENT: tl.constexpr,
):
    expert = tl.program_id(2).to(tl.int64)
    # This expert's live rows [first, end) (module docstring; ROWS names the case).
    first = tl.zeros((), tl.int64)
    end = tl.zeros((), tl.int64) + rows_per_expert
    if ROWS == 1:  # COUNTED_ROWS: bounds_ptr holds the batched slices' row counts
        end = tl.minimum(tl.load(bounds_ptr + expert).to(tl.int64), end)
    if ROWS == 2:  # PSUM_ROWS: bounds_ptr holds each expert's end row
        previous = tl.load(bounds_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int64)
        first = (previous + ROW_ALIGNMENT - 1) // ROW_ALIGNMENT * ROW_ALIGNMENT
        end = tl.minimum(tl.load(bounds_ptr + expert).to(tl.int64), end)
    x_ptr += expert * x_expert_stride
    q_ptr += expert * q_expert_stride
    s_ptr += expert * s_expert_stride
    step = tl.num_programs(0).to(tl.int64) * BLOCK_M
    for row_start in range(first + tl.program_id(0) * BLOCK_M, end, step):
        _silu_and_mul_quant_tile(x_ptr, q_ptr, s_ptr, row_start, end, num_groups, x_row_stride,
                                 q_row_stride, s_row_stride, s_group_stride, eps, BLOCK_M,
                                 GROUPS_PER_PROG, UE8M0, INTERPRETED, SCALE_BLOCK)


def silu_and_mul_quant_fp8_triton(
    x: torch.Tensor, x_q: torch.Tensor, x_s: torch.Tensor,
    expert_num_tokens: torch.Tensor | None, use_ue8m0: bool, *,
    expert_ends: torch.Tensor | None = None,
    block_m: int = FUSED_BLOCK_M, groups_per_prog: int = FUSED_GROUPS_PER_PROG,
    num_warps: int = FUSED_NUM_WARPS, max_programs: int = FUSED_MAX_PROGRAMS,
) -> None:
    """Launch on validated tensors (CUDA, or CPU under TRITON_INTERPRET=1; arguments as in
    silu_and_mul_quant_fp8; at most one of expert_num_tokens and expert_ends). block_m and
    groups_per_prog are powers of two; max_programs bounds the grid (each program loops)."""
    if x.dim() == 2:
        rows_per_expert, x_e, q_e, s_e = x.shape[0], 0, 0, 0
        experts = 1 if expert_ends is None else expert_ends.shape[0]
    else:
        experts, rows_per_expert = x.shape[:2]
        x_e, q_e, s_e = x.stride(0), x_q.stride(0), x_s.stride(0)
    num_groups = x_q.shape[-1] // SCALE_BLOCK
    if experts == 0 or rows_per_expert == 0 or num_groups == 0:
        return
    group_tiles = cdiv(num_groups, groups_per_prog)
    # Rows one expert holds on average (psum: M_sum spread over the experts), capped.
    row_programs = min(cdiv(rows_per_expert, block_m * (experts if x.dim() == 2 else 1)),
                       max(1, max_programs // (group_tiles * experts)))
    rows, bounds = ((PSUM_ROWS, expert_ends) if expert_ends is not None
                    else (COUNTED_ROWS, expert_num_tokens) if expert_num_tokens is not None
                    else (ALL_ROWS, x))  # ALL_ROWS: x stands in for bounds_ptr, never read
    # the parameters after the tensors, in signature order, constexprs last (ROWS ..)
    _launch_fused((row_programs, group_tiles, experts), num_warps, (x, x_q, x_s, bounds), (
        rows_per_expert, num_groups, x_e, x.stride(-2), q_e, x_q.stride(-2), s_e,
        x_s.stride(-2), x_s.stride(-1), float(QUANT_EPS), rows, block_m, groups_per_prog,
        bool(use_ue8m0), INTERPRETING, SCALE_BLOCK, ROW_ALIGNMENT))


_launch_fused = KernelLauncher(_silu_and_mul_quant_fp8_kernel)


def silu_and_mul_quant_fp8_ref(
    x: torch.Tensor, use_ue8m0: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., 2I] (I a multiple of 128) -> the FP8 quant (group 128, eps QUANT_EPS) of
    silu_and_mul_ref(x): (float8_e4m3fn [..., I], float32 [..., I / 128] row-major)."""
    return per_token_group_quant_fp8_ref(silu_and_mul_ref(x), SCALE_BLOCK, QUANT_EPS, use_ue8m0)


def _silu_and_mul_quant_fp8_torch(x, x_q, x_s, expert_num_tokens, use_ue8m0,
                                   expert_ends=None) -> None:
    """The CPU path: the two reference ops composed, on the live rows only."""
    for x_rows, q_rows, s_rows in _live_rows(x, x_q, x_s, expert_num_tokens, expert_ends):
        if x_rows.shape[0]:
            q, s = silu_and_mul_quant_fp8_ref(x_rows, use_ue8m0)
            q_rows.copy_(q)
            s_rows.copy_(s)


def _live_rows(x, x_q, x_s, expert_num_tokens, expert_ends):
    """(x, x_q, x_s) views of each run of live rows (module docstring)."""
    if expert_num_tokens is not None:
        rows = [min(max(c, 0), x.shape[1]) for c in expert_num_tokens.tolist()]
        return [(x[e, :r], x_q[e, :r], x_s[e, :r]) for e, r in enumerate(rows)]
    if expert_ends is None:
        return [(x, x_q, x_s)]
    runs, first = [], 0
    for end in expert_ends.tolist():
        end = min(end, x.shape[0])
        runs.append((x[first:end], x_q[first:end], x_s[first:end]))
        first = align_up(max(end, first), ROW_ALIGNMENT)
    return runs


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


def _check_counts(name, counts, want_len, x) -> None:
    """expert_num_tokens / expert_ends: int32, [want_len], contiguous, on x's device."""
    if counts is None:
        return
    if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int32:
        raise ValueError(f"{name} must be a torch.int32 tensor, got "
                         f"{getattr(counts, 'dtype', type(counts))}")
    if (counts.dim() != 1 or (want_len is not None and counts.shape[0] != want_len)
            or counts.device != x.device):
        want = f"({want_len},)" if want_len is not None else "(E,)"
        raise ValueError(f"{name} must have shape {want} on {x.device}, got "
                         f"{tuple(counts.shape)} on {counts.device}")
    if not counts.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


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
    expert_ends: torch.Tensor | None = None,
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
        expert_ends: `[E]` torch.int32 on x's device, for the contiguous layout `[M_sum, 2I]`
            in DeepGEMM's psum form (ContiguousLayout.expert_ends): only expert e's rows
            [align128(expert_ends[e-1]), expert_ends[e]) are read and written (padding rows
            keep what they held). Read on the device. Not with expert_num_tokens.
        use_ue8m0: round every scale up to a power of two, as per_token_group_quant_fp8 does.

    Returns:
        x_q: float8_e4m3fn `[..., I]`, x_s: float32 `[..., I / 128]`, bit for bit
        `per_token_group_quant_fp8(silu_and_mul(x), 128, use_ue8m0=use_ue8m0)` on the rows
        processed (eps 1e-10; NaN and inf as documented there).

    CUDA tensors run the Triton kernel (int64 offsets); CPU tensors run the two torch references
    composed.
    """
    _check_x(x, expert_num_tokens)
    if expert_ends is not None and expert_num_tokens is not None:
        raise ValueError("give expert_num_tokens (batched layout) or expert_ends (contiguous "
                         "layout), not both")
    _check_counts("expert_num_tokens", expert_num_tokens, x.shape[0], x)
    _check_counts("expert_ends", expert_ends, None, x)
    check_bool("use_ue8m0", use_ue8m0)
    n = x.shape[-1] // 2
    x_q = _output("out_q", out_q, (*x.shape[:-1], n), FP8_DTYPE, x.device)
    x_s = _output("out_s", out_s, (*x.shape[:-1], n // SCALE_BLOCK), torch.float32, x.device)
    if x.is_cuda:
        silu_and_mul_quant_fp8_triton(x, x_q, x_s, expert_num_tokens, use_ue8m0,
                                      expert_ends=expert_ends)
    else:
        _silu_and_mul_quant_fp8_torch(x, x_q, x_s, expert_num_tokens, use_ue8m0, expert_ends)
    return x_q, x_s
