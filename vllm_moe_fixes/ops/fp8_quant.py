"""Per-token-group FP8 quantisation: one float32 scale per `group_size` consecutive channels.

Kernel design: one program quantises a tile of BLOCK_M rows x GROUPS_PER_PROG groups, laid out as
a 2-D block [BLOCK_M * GROUPS_PER_PROG, group_size] (one group per block row), so the per-group
max is a single `tl.max(axis=1)` and each program keeps many bytes in flight (the default tile is
8 rows x 8 groups x 128 channels = 16 KiB of bf16). Row i of the block is row i // GROUPS_PER_PROG
of the tile and group i % GROUPS_PER_PROG; groups past K / group_size are masked, so any number of
groups works (7168 / 128 = 56 = 7 tiles of 8). All offsets are int64.

The arithmetic is vLLM's recipe (its CUDA per-token-group kernel), in float32. `quantize_groups`
(the kernel's) and `per_token_group_quant_fp8_ref` (torch's, below) perform the same operations,
so both give identical bits on any device; the fused SiLU-and-mul quant kernel (silu_mul_quant.py)
calls the same `quantize_groups`:

    amax  = max(float32(eps), max |x| over the group)   NaN elements take no part in the max
    scale = amax / 448                                  IEEE division
    use_ue8m0: scale = 2**ceil(log2(max(scale, float32(1e-10))))
                                      exact, on the bits: (bits + 0x7FFFFF) & 0x7F800000
    q     = min(max(x / scale, -448), 448)              IEEE division; max/min return the non-NaN
                                                        operand, so a NaN quotient becomes -448
    x_q   = q cast to float8_e4m3fn, round-to-nearest-even

The ue8m0 bit formula is the one vLLM's register kernel (16-bit inputs, group 128) uses; its
shared-memory kernel computes exp2f(ceilf(log2f(.))), which can differ only for a scale within an
ulp or two above a power of two, which amax / 448 never is when amax is a 16-bit value.

Divisions are tensor / tensor on purpose: torch on CUDA turns `t / 448.0` (a Python scalar) into a
multiply by the reciprocal, which rounds differently at ties; tensor / tensor is IEEE division on
both devices (`tl.math.div_rn` in Triton, whose plain fp32 `/` is approximate).

Host cost matters as much as the kernel for small M (decode): the public op validates with plain
attribute reads, allocates the values and the scales with one host call each, reshapes only inputs
that are not already 2-D and launches through a `KernelLauncher` (triton_utils), which finds the
kernel Triton compiled for the same specialisation with one dict lookup and calls it directly.
Triton's own `kernel[grid](...)` re-binds every argument, hashes a cache key and reads its option
knobs on every call.
"""

import torch
import triton
import triton.language as tl

from vllm_moe_fixes.ops.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    SCALE_BLOCK,
    empty_mn_major_scales,
    tma_aligned_rows,
)
from vllm_moe_fixes.ops.triton_utils import (
    INTERPRETING,
    KernelLauncher,
    next_power_of_2,
    round_to_e4m3_grid,
)
from vllm_moe_fixes.sizes import cdiv

_SUPPORTED_X = (torch.bfloat16, torch.float16, torch.float32)

# vLLM floors the ue8m0 scale at float32(1e-10) before rounding it up to a power of two (2**-33).
UE8M0_SCALE_FLOOR = 1e-10

_FP8_MAX = tl.constexpr(FP8_MAX)
_UE8M0_FLOOR = tl.constexpr(UE8M0_SCALE_FLOOR)

# Default launch config, from the H200 sweep (`python -m benchmarks.bench_quant --sweep`, K = 7168,
# bf16; benchmarks/results/bench_quant_sweep.json): block_m 8, 8 groups per program, 8 warps has
# the smallest worst-case slowdown over M in {256, 4096, 16384, 65536} against each M's best.
QUANT_BLOCK_M, QUANT_GROUPS_PER_PROG, QUANT_NUM_WARPS = 8, 8, 8
# Below QUANT_BLOCK_M rows a tile of 8 rows would compute mostly masked rows (7 of 8 at M = 1, a
# decode step), and the kernel is one short program per 8 groups: one row per program, 4 warps
# (16-byte loads of 8 bf16 per thread).
QUANT_SMALL_M_BLOCK_M, QUANT_SMALL_M_NUM_WARPS = 1, 4
QUANT_EPS = 1e-10  # default floor on a group's max |x| (vLLM's)


# ---------------------------------------------------------------- device helpers

@triton.jit
def quantize_groups(x, eps, UE8M0: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """vLLM's per-group FP8 recipe on float32 x [G, GROUP] (one group per row).

    Returns (q float32 [G, GROUP]: values in [-448, 448] ready for the float8_e4m3fn cast, on the
    e4m3 grid already when ROUND_IN_FP32; scale float32 [G]). The steps are the recipe above.
    """
    # tl.max and tl.maximum return the non-NaN operand: NaN elements take no part in the max.
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), eps)
    scale = tl.math.div_rn(amax, tl.zeros_like(amax) + _FP8_MAX)
    if UE8M0:  # 2**ceil(log2(scale)) on the bits: a non-zero mantissa carries into the exponent
        scale = tl.maximum(scale, _UE8M0_FLOOR)
        scale = ((scale.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32,
                                                                                 bitcast=True)
    q = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    q = tl.minimum(tl.maximum(q, -_FP8_MAX), _FP8_MAX)  # a NaN quotient becomes -448
    if ROUND_IN_FP32:
        q = round_to_e4m3_grid(q)
    return q, scale


@triton.jit
def _per_token_group_quant_fp8_kernel(
    x_ptr, q_ptr, s_ptr, M, num_groups, x_row_stride, s_row_stride, s_group_stride, eps,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
    UE8M0: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
):
    # Block row i holds group (i % GROUPS_PER_PROG) of tile row (i // GROUPS_PER_PROG).
    i = tl.arange(0, BLOCK_M * GROUPS_PER_PROG)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + i // GROUPS_PER_PROG
    groups = tl.program_id(1).to(tl.int64) * GROUPS_PER_PROG + i % GROUPS_PER_PROG
    valid = (rows < M) & (groups < num_groups)
    cols = tl.arange(0, GROUP)
    mask = valid[:, None]

    x = tl.load(x_ptr + (rows * x_row_stride + groups * GROUP)[:, None] + cols[None, :],
                mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_groups(x, eps, UE8M0, ROUND_IN_FP32)
    # x_q is contiguous: its row stride is K = num_groups * GROUP.
    tl.store(q_ptr + (rows * num_groups + groups)[:, None] * GROUP + cols[None, :],
             q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows * s_row_stride + groups * s_group_stride, scale, mask=valid)


# ---------------------------------------------------------------- launcher

def per_token_group_quant_fp8_triton(
    x: torch.Tensor, x_q: torch.Tensor, x_s: torch.Tensor, group_size: int, eps: float,
    use_ue8m0: bool, *, block_m: int | None = None, groups_per_prog: int | None = None,
    num_warps: int | None = None, round_in_fp32: bool = INTERPRETING,
) -> None:
    """Launch the quant kernel on validated tensors (CUDA, or CPU under TRITON_INTERPRET=1).

    x: [M, K] with stride(1) == 1; x_q: float8_e4m3fn [M, K], contiguous (written);
    x_s: float32 [M, K // group_size] with any strides (written). block_m and groups_per_prog
    (powers of two; groups_per_prog defaults to min(8, next power of two of K // group_size)) and
    num_warps override the defaults above (the small-M ones when M < QUANT_BLOCK_M).
    round_in_fp32 rounds to the e4m3 grid in float32 before the cast; default: only under the
    interpreter, whose float8 cast rounds wrongly.
    The GPU's cast is already exact RNE, so there it is optional and gives identical bits (tested);
    the sweep in benchmarks/bench_quant.py measures its cost.
    """
    M, K = x.shape
    num_groups = K // group_size
    if M == 0 or num_groups == 0:
        return
    small = M < QUANT_BLOCK_M
    if block_m is None:
        block_m = QUANT_SMALL_M_BLOCK_M if small else QUANT_BLOCK_M
    if num_warps is None:
        num_warps = QUANT_SMALL_M_NUM_WARPS if small else QUANT_NUM_WARPS
    if groups_per_prog is None:
        groups_per_prog = (QUANT_GROUPS_PER_PROG if num_groups >= QUANT_GROUPS_PER_PROG
                           else next_power_of_2(num_groups))
    grid = (cdiv(M, block_m), cdiv(num_groups, groups_per_prog), 1)
    # The kernel's parameters after the tensors, in its signature order, constexprs included
    # (Triton's launcher takes them all and skips the constexprs). eps as a float: an int eps
    # would be specialised; the flags as bools: the by-value key reads 1 as True.
    _launch_quant(grid, num_warps, (x, x_q, x_s), (
        M, num_groups, x.stride(0), *x_s.stride(), float(eps), group_size, block_m,
        groups_per_prog, bool(use_ue8m0), bool(round_in_fp32)))


_launch_quant = KernelLauncher(_per_token_group_quant_fp8_kernel)


# ---------------------------------------------------------------- references

def _full(like: torch.Tensor, value: float) -> torch.Tensor:
    """A float32 0-d tensor on like's device (a tensor operand, never a Python scalar)."""
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def group_scales_ref(amax: torch.Tensor, eps: float, use_ue8m0: bool) -> torch.Tensor:
    """float32 scales from float32 group maxima (any shape, NaN-free), by the recipe above."""
    scale = torch.maximum(amax, _full(amax, eps)) / _full(amax, FP8_MAX)
    if use_ue8m0:
        scale = torch.maximum(scale, _full(scale, UE8M0_SCALE_FLOOR))
        scale = ((scale.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)
    return scale


def per_token_group_quant_fp8_ref(
    x: torch.Tensor, group_size: int, eps: float, use_ue8m0: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise x [..., K] (bf16/fp16/fp32) per group of `group_size` channels (arguments already
    validated), by the recipe above.

    Returns (x_q float8_e4m3fn [..., K] contiguous, x_s float32 [..., K // group_size] row-major).
    """
    groups = x.float().unflatten(-1, (x.shape[-1] // group_size, group_size))
    magnitudes = groups.abs().nan_to_num(nan=0.0, posinf=float("inf"))  # NaN ignored by the max
    scale = group_scales_ref(magnitudes.amax(dim=-1), eps, use_ue8m0)
    q = torch.fmax(groups / scale.unsqueeze(-1), _full(x, -FP8_MAX))  # fmax: NaN -> -448
    q = torch.fmin(q, _full(x, FP8_MAX))
    return q.to(FP8_DTYPE).flatten(-2), scale


# ---------------------------------------------------------------- public op: check, allocate, run

def _check_arguments(x, group_size, eps, dtype, column_major_scales) -> None:
    """Validate x and the scalar arguments of per_token_group_quant_fp8 (see its docstring)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _SUPPORTED_X:
        raise ValueError(f"x must be a bfloat16/float16/float32 tensor, got "
                         f"{getattr(x, 'dtype', type(x))}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension [..., K]")
    if (not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0
            or group_size & (group_size - 1)):
        raise ValueError(f"group_size must be a positive power of two (int), got {group_size!r}")
    K = x.shape[-1]
    if K % group_size:
        raise ValueError(f"x's last dimension K={K} is not a multiple of group_size={group_size}")
    if x.stride(-1) != 1 and x.numel() > 1:
        raise ValueError(f"x's last dimension must be contiguous (stride 1), got strides "
                         f"{tuple(x.stride())}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    if dtype is not FP8_DTYPE:
        raise ValueError(f"dtype must be torch.float8_e4m3fn, got {dtype}")
    if column_major_scales and x.dim() != 2:
        raise ValueError(f"column_major_scales needs a 2-D x [M, K], got shape {tuple(x.shape)}")


def _values_buffer(x, out_q) -> torch.Tensor:
    """x_q: out_q after checks, or a new float8_e4m3fn tensor of x's shape."""
    if out_q is None:  # empty_like: one call cheaper on the host than torch.empty(x.shape, ...)
        return torch.empty_like(x, dtype=FP8_DTYPE, memory_format=torch.contiguous_format)
    if not isinstance(out_q, torch.Tensor) or out_q.dtype is not FP8_DTYPE:
        raise ValueError(f"out_q must be a torch.float8_e4m3fn tensor, got "
                         f"{getattr(out_q, 'dtype', type(out_q))}")
    if out_q.shape != x.shape or out_q.device != x.device:
        raise ValueError(f"out_q must have x's shape {tuple(x.shape)} on {x.device}, got "
                         f"{tuple(out_q.shape)} on {out_q.device}")
    if not out_q.is_contiguous():
        raise ValueError("out_q must be contiguous")
    return out_q


def _column_stride(M, tma_aligned) -> int:
    """The group stride of column-major scales for M rows: M, or M padded to 16 bytes."""
    return tma_aligned_rows(M) if tma_aligned else M


def _scales_buffer(x, num_groups, out_s, column_major, tma_aligned) -> torch.Tensor:
    """x_s: out_s after checks, or new float32 scales [..., num_groups] in the layout the flags
    ask for."""
    if out_s is None:
        if not column_major:  # sizes as separate ints: cheaper to parse than a shape tuple
            return torch.empty(*x.shape[:-1], num_groups, dtype=torch.float32, device=x.device)
        return empty_mn_major_scales((*x.shape[:-1], num_groups), x.device,
                                     tma_aligned=tma_aligned)
    shape = (*x.shape[:-1], num_groups)
    if not isinstance(out_s, torch.Tensor) or out_s.dtype is not torch.float32:
        raise ValueError(f"out_s must be a torch.float32 tensor, got "
                         f"{getattr(out_s, 'dtype', type(out_s))}")
    if tuple(out_s.shape) != shape or out_s.device != x.device:
        raise ValueError(f"out_s must have shape {shape} on {x.device}, got "
                         f"{tuple(out_s.shape)} on {out_s.device}")
    if column_major:
        ld = _column_stride(shape[0], tma_aligned)
        if out_s.numel() and tuple(out_s.stride()) != (1, ld):
            flags = "column_major_scales" + (" and tma_aligned_scales" if tma_aligned else "")
            raise ValueError(f"with {flags} out_s must have strides (1, {ld}), got "
                             f"{tuple(out_s.stride())}")
    elif x.dim() != 2 and not out_s.is_contiguous():
        raise ValueError(f"out_s must be contiguous for a {x.dim()}-D x (any strides only for "
                         f"2-D x)")
    return out_s


def per_token_group_quant_fp8(
    x: torch.Tensor,
    group_size: int = SCALE_BLOCK,
    eps: float = QUANT_EPS,
    dtype: torch.dtype = FP8_DTYPE,
    column_major_scales: bool = False,
    tma_aligned_scales: bool = False,
    out_q: torch.Tensor | None = None,
    use_ue8m0: bool = False,
    out_s: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations to FP8 with one float32 scale per group of channels (vLLM's numbers).

    Arguments:
        x: `[..., K]` bfloat16 / float16 / float32, last dimension contiguous, K % group_size == 0.
        group_size: channels per scale, a power of two (128 for DeepSeek-style block FP8).
        eps: positive floor on each group's max |x| (all-zero groups get scale eps / 448).
        dtype: output dtype; only torch.float8_e4m3fn (max 448).
        column_major_scales: return x_s as a `[M, K/g]` view with strides (1, M); x must be 2-D.
        tma_aligned_scales: with column_major_scales, strides (1, align4(M)), the MN-major layout
            DeepGEMM's SM90 kernels want (the M stride padded to 16 bytes). Without
            column_major_scales the flag has no effect (scales stay row-major), as in vLLM.
        out_q: optional float8_e4m3fn tensor of x's shape and device, contiguous; written and
            returned as x_q.
        use_ue8m0: round every scale up to a power of two, 2**ceil(log2(max(scale, 1e-10))).
        out_s: optional float32 tensor `[..., K / group_size]` on x's device; written and returned
            as x_s (e.g. a view into a workspace). Its strides: with column_major_scales exactly
            the ones the flags would produce, (1, M) or with tma_aligned_scales (1, align4(M));
            otherwise any strides for a 2-D x, and contiguous for any other rank.

    Returns:
        x_q: float8_e4m3fn `[..., K]`, q = clamp(x / scale, -448, 448) rounded to nearest even.
        x_s: float32 `[..., K / group_size]` row-major, or `[M, K / group_size]` column-major.
        scale = max(amax, eps) / 448 per group, both divisions IEEE-rounded (vLLM's CUDA kernel's
        recipe; the exact float32 steps are in this module's docstring).

    NaN and inf (the same on the Triton and the torch path, and in vLLM's CUDA kernel): NaN
    elements take no part in a group's max and are written as -448 (code 0xFE); the other elements
    of that group quantise normally. A group holding +-inf gets scale inf; its finite elements
    become +-0 and its +-inf elements -448 (inf / inf is NaN). No error is raised.

    CUDA tensors run the Triton kernel (int64 offsets); CPU tensors run the torch reference.
    """
    _check_arguments(x, group_size, eps, dtype, column_major_scales)
    K = x.shape[-1]
    num_groups = K // group_size
    x_q = _values_buffer(x, out_q)
    x_s = _scales_buffer(x, num_groups, out_s, column_major_scales,
                         column_major_scales and tma_aligned_scales)
    if x.is_cuda:
        if x.dim() == 2:  # the engine's case: no reshapes
            per_token_group_quant_fp8_triton(x, x_q, x_s, group_size, eps, use_ue8m0)
        elif x.numel():
            per_token_group_quant_fp8_triton(x.reshape(-1, K), x_q.view(-1, K),
                                             x_s.view(-1, num_groups), group_size, eps, use_ue8m0)
    elif x.numel():
        q, s = per_token_group_quant_fp8_ref(x, group_size, eps, use_ue8m0)
        x_q.copy_(q)
        x_s.copy_(s)
    return x_q, x_s


def quant_batched_fp8(x: torch.Tensor, out_q: torch.Tensor | None = None,
                      out_s: torch.Tensor | None = None, *, use_ue8m0: bool = False):
    """bf16 [E, T, K] -> (fp8 [E, T, K], float32 scales [E, T, K/128] with strides
    (T*K/128, 1, T): MN-major per expert, DeepEP's low-latency layout). 1x128 groups, every row.

    out_q: fp8 [E, T, K] contiguous, out_s: float32 [E, T, K/128] with those strides; each
    allocated when None; use_ue8m0 as per_token_group_quant_fp8's. The quant kernel takes 2-D
    scale strides over the E*T flattened rows, and per-expert MN-major (row e*T + t, group g at
    e*T*G + g*T + t) is not of that form, so the scales are written row-major first and copied
    (E*T*K/32 bytes).
    """
    e, t, k = x.shape
    q, s = per_token_group_quant_fp8(x.reshape(e * t, k), SCALE_BLOCK,
                                     out_q=None if out_q is None else out_q.view(e * t, k),
                                     use_ue8m0=use_ue8m0)
    if out_s is None:
        out_s = empty_mn_major_scales((e, t, k // SCALE_BLOCK), x.device, tma_aligned=False)
    out_s.copy_(s.view(e, t, k // SCALE_BLOCK))
    return q.view(e, t, k), out_s
