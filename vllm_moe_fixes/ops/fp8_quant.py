"""Per-token-group FP8 quantisation: one float32 scale per `group_size` consecutive channels.

Kernel design: one program quantises a tile of BLOCK_M rows x GROUPS_PER_PROG groups, laid out as
a 2-D block [BLOCK_M * GROUPS_PER_PROG, group_size] (one group per block row), so the per-group
max is a single `tl.max(axis=1)` and each program keeps many bytes in flight (the default tile is
8 rows x 8 groups x 128 channels = 16 KiB of bf16). Row i of the block is row i // GROUPS_PER_PROG
of the tile and group i % GROUPS_PER_PROG; groups past K / group_size are masked, so any number of
groups works (7168 / 128 = 56 = 7 tiles of 8). All offsets are int64.

The arithmetic is vLLM's recipe, written out once in reference.py; `quantize_groups` below performs
the same float32 operations (IEEE divisions through `tl.math.div_rn`), so on a GPU the kernel
matches `per_token_group_quant_fp8_ref` bit for bit. The fused SiLU-and-mul quant kernel
(silu_mul_quant.py) calls the same `quantize_groups`.

Host cost matters as much as the kernel for small M (decode): the public op validates with plain
attribute reads, allocates at most two tensors, reshapes only inputs that are not already 2-D and
launches with a fixed config, so it adds a few microseconds of Python to Triton's own launch.
"""

import os

import torch
import triton
import triton.language as tl

from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, FP8_MAX, empty_mn_major_scales, tma_aligned_rows
from vllm_moe_fixes.ops.reference import UE8M0_SCALE_FLOOR, per_token_group_quant_fp8_ref

_SUPPORTED_X = (torch.bfloat16, torch.float16, torch.float32)

# Triton chooses between compiling and interpreting when a kernel is decorated (at import), so the
# launchers read the same decision once, here, instead of the environment on every call.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

_FP8_MAX = tl.constexpr(FP8_MAX)
_UE8M0_FLOOR = tl.constexpr(UE8M0_SCALE_FLOOR)

# Default launch config, from the H200 sweep (benchmarks/bench_quant.py --sweep, K = 7168, bf16,
# triton 3.6): block_m 8, 8 groups per program, 8 warps has the smallest worst-case slowdown over
# M in {256, 4096, 16384, 65536} against each M's best config.
QUANT_BLOCK_M, QUANT_GROUPS_PER_PROG, QUANT_NUM_WARPS = 8, 8, 8
QUANT_EPS = 1e-10  # default floor on a group's max |x| (vLLM's)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1). Plain Python on purpose: triton.next_power_of_2 and
    triton.cdiv are ConstexprFunction objects in triton 3.6 and 3.9 and cost ~2 us per host call."""
    return 1 << (n - 1).bit_length()


# ---------------------------------------------------------------- device helpers

@triton.jit
def round_to_bf16_grid(v):
    """Round float32 v to the nearest bfloat16 value (ties to even), still in float32.

    Triton 3.9's interpreter truncates float32 -> bfloat16 casts (round toward zero); the GPU
    rounds to nearest even. Kernels that store bfloat16 call this first under the interpreter
    (a constexpr flag), so the cast that follows is exact. Integer-only: add half a bf16 ulp minus
    one plus the kept lowest bit (round-to-nearest-even on the bit pattern), clear 16 bits.
    """
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def round_to_e4m3_grid(v):
    """Round float32 v (|v| <= 448) to the nearest float8_e4m3fn value, ties to even, in float32.

    Works on the magnitude's bits and ORs the sign bit back at the end, so every result, -0.0
    included, has v's sign on any backend (a negation `-t` may compile to `0.0 - t`, which turns
    -0.0 into +0.0). Normals (|v| >= 2**-6) keep 3 of float32's 23 mantissa bits: add half an e4m3
    ulp minus one plus the kept lowest bit (round-to-nearest-even on the bit pattern), then clear
    the 20 dropped bits; a carry moves into the exponent as it should. Subnormals (|v| < 2**-6)
    sit on a fixed 2**-9 grid: |v| + 1.5 * 2**14 has a float32 ulp of exactly 2**-9, so the IEEE
    add rounds |v| to that grid (ties to even) and the subtraction is exact.
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = bits & -2147483648  # 0x80000000
    mag = bits & 0x7FFFFFFF
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & -1048576
    a = mag.to(tl.float32, bitcast=True)
    tiny = ((a + 24576.0) - 24576.0).to(tl.int32, bitcast=True)
    return (tl.where(a < 0.015625, tiny, normal) | sign).to(tl.float32, bitcast=True)


@triton.jit
def quantize_groups(x, eps, UE8M0: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """vLLM's per-group FP8 recipe on float32 x [G, GROUP] (one group per row).

    Returns (q float32 [G, GROUP]: values in [-448, 448] ready for the float8_e4m3fn cast, on the
    e4m3 grid already when ROUND_IN_FP32; scale float32 [G]). The steps are reference.py's.
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
    use_ue8m0: bool, *, block_m: int = QUANT_BLOCK_M, groups_per_prog: int | None = None,
    num_warps: int = QUANT_NUM_WARPS, round_in_fp32: bool = INTERPRETING,
) -> None:
    """Launch the quant kernel on validated tensors (CUDA, or CPU under TRITON_INTERPRET=1).

    x: [M, K] with stride(1) == 1; x_q: float8_e4m3fn [M, K], contiguous (written);
    x_s: float32 [M, K // group_size] with any strides (written). block_m and groups_per_prog
    (powers of two; groups_per_prog defaults to min(8, next power of two of K // group_size)) and
    num_warps override the sweep's defaults above. round_in_fp32 rounds to the e4m3 grid in
    float32 before the cast; default: only under the interpreter, whose float8 cast rounds wrongly.
    The GPU's cast is already exact RNE, so there it is optional and gives identical bits (tested);
    the sweep in benchmarks/bench_quant.py measures its cost.
    """
    M, K = x.shape
    num_groups = K // group_size
    if M == 0 or num_groups == 0:
        return
    if groups_per_prog is None:
        groups_per_prog = (QUANT_GROUPS_PER_PROG if num_groups >= QUANT_GROUPS_PER_PROG
                           else next_power_of_2(num_groups))
    grid = ((M + block_m - 1) // block_m, (num_groups + groups_per_prog - 1) // groups_per_prog)
    _per_token_group_quant_fp8_kernel[grid](
        x, x_q, x_s, M, num_groups, x.stride(0), x_s.stride(0), x_s.stride(1), eps,
        GROUP=group_size, BLOCK_M=block_m, GROUPS_PER_PROG=groups_per_prog,
        UE8M0=use_ue8m0, ROUND_IN_FP32=round_in_fp32, num_warps=num_warps,
    )


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
    if out_q is None:
        return torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
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
    shape = (*x.shape[:-1], num_groups)
    if out_s is None:
        if not column_major:
            return torch.empty(shape, dtype=torch.float32, device=x.device)
        if tma_aligned:
            return empty_mn_major_scales(shape, x.device)
        return torch.empty(shape[::-1], dtype=torch.float32, device=x.device).t()
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
    group_size: int = 128,
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
        recipe; the exact float32 steps are in reference.py).

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
