"""Per-token-group FP8 quantisation: one float32 scale per `group_size` consecutive channels.

Kernel design: one program quantises a tile of BLOCK_M rows x GROUPS_PER_PROG groups, laid out as
a 2-D block [BLOCK_M * GROUPS_PER_PROG, group_size] (one group per block row), so the per-group
max is a single `tl.max(axis=1)` and each program keeps many bytes in flight (the default tile is
4 rows x 8 groups x 128 channels = 8 KiB of bf16). Row i of the block is row i // GROUPS_PER_PROG
of the tile and group i % GROUPS_PER_PROG; groups past K / group_size are masked, so any number of
groups works (7168 / 128 = 56 = 7 tiles of 8). All offsets are int64.

The arithmetic is spelled out once, in reference.py; the kernel performs the same float32
operations in the same order, so on a GPU it matches `per_token_group_quant_fp8_ref` bit for bit.
"""

import os

import torch
import triton
import triton.language as tl

from vllm_moe_fixes.ops.reference import INV_FP8_MAX, per_token_group_quant_fp8_ref

_SUPPORTED_X = (torch.bfloat16, torch.float16, torch.float32)


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def round_to_bf16_grid(v):
    """Round float32 v to the nearest bfloat16 value (ties to even), still in float32.

    Triton 3.9's interpreter truncates float32 -> bfloat16 casts (round toward zero); the GPU
    rounds to nearest even. Kernels that store bfloat16 call this first under the interpreter
    (a constexpr flag), so the cast that follows is exact. Same bit trick as below, 16 bits.
    """
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_e4m3_grid(v):
    """Round float32 v (|v| <= 448) to the nearest float8_e4m3fn value, ties to even, in float32.

    Normals (|v| >= 2**-6) keep 3 of float32's 23 mantissa bits: add half an e4m3 ulp minus one
    plus the kept lowest bit (round-to-nearest-even on the bit pattern), then clear the 20 dropped
    bits; a carry moves into the exponent as it should. Subnormals (|v| < 2**-6) sit on a fixed
    2**-9 grid: |v| + 1.5 * 2**14 has a float32 ulp of exactly 2**-9, so the IEEE add rounds |v|
    to that grid (ties to even) and the subtraction is exact. The sign is put back afterwards so
    that tiny negatives give -0.0, as the hardware cast does.
    """
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    tiny = (tl.abs(v) + 24576.0) - 24576.0
    tiny = tl.where(v < 0, -tiny, tiny)
    return tl.where(tl.abs(v) < 0.015625, tiny, normal)


@triton.jit
def _per_token_group_quant_fp8_kernel(
    x_ptr, q_ptr, s_ptr,
    M, num_groups,
    x_row_stride, q_row_stride, s_row_stride, s_group_stride,
    eps, inv_fp8_max,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
    UE8M0: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
):
    i = tl.arange(0, BLOCK_M * GROUPS_PER_PROG)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + i // GROUPS_PER_PROG
    groups = tl.program_id(1).to(tl.int64) * GROUPS_PER_PROG + i % GROUPS_PER_PROG
    valid = (rows < M) & (groups < num_groups)
    cols = tl.arange(0, GROUP)
    mask = valid[:, None]

    x = tl.load(x_ptr + (rows * x_row_stride + groups * GROUP)[:, None] + cols[None, :],
                mask=mask, other=0.0).to(tl.float32)
    # scale = max(amax, eps) * float32(1/448); ue8m0 rounds it up to a power of two on the bits.
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), eps) * inv_fp8_max
    if UE8M0:
        scale = ((scale.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32,
                                                                                 bitcast=True)
    # 1 / scale with IEEE rounding (plain fp32 `/` may be approximate), once per group.
    inv = tl.math.div_rn(tl.full([BLOCK_M * GROUPS_PER_PROG], 1.0, tl.float32), scale)
    q = tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0)
    if ROUND_IN_FP32:
        q = _round_to_e4m3_grid(q)
    tl.store(q_ptr + (rows * q_row_stride + groups * GROUP)[:, None] + cols[None, :],
             q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows * s_row_stride + groups * s_group_stride, scale, mask=valid)


def default_quant_config(num_rows: int, num_groups: int) -> dict:
    """Default launch config: 8 groups per program when K allows it (fewer for narrow K), 4 rows
    per program once there are enough rows to fill the GPU (>= 1024), else 1, 4 warps."""
    groups = min(8, triton.next_power_of_2(num_groups))
    return {"block_m": 4 if num_rows >= 1024 else 1, "groups_per_prog": groups, "num_warps": 4}


def per_token_group_quant_fp8_triton(
    x: torch.Tensor, x_q: torch.Tensor, x_s: torch.Tensor, group_size: int, eps: float,
    use_ue8m0: bool, *, block_m: int | None = None, groups_per_prog: int | None = None,
    num_warps: int | None = None, round_in_fp32: bool | None = None,
) -> None:
    """Launch the quant kernel on validated tensors (CUDA, or CPU under TRITON_INTERPRET=1).

    x: [M, K] with stride(1) == 1; x_q: float8_e4m3fn [M, K] with stride(1) == 1 (written);
    x_s: float32 [M, K // group_size] with any strides (written). block_m, groups_per_prog
    (powers of two) and num_warps override `default_quant_config`. round_in_fp32 rounds to the
    e4m3 grid in float32 before the cast; default: only under the interpreter, whose float8 cast
    rounds wrongly (environment.md). The GPU's cast is already exact RNE, so there it is optional
    and gives identical bits (tested); the sweep in benchmarks/bench_quant.py measures its cost.
    """
    M, K = x.shape
    num_groups = K // group_size
    if M == 0 or num_groups == 0:
        return
    cfg = default_quant_config(M, num_groups)
    block_m = block_m or cfg["block_m"]
    groups_per_prog = groups_per_prog or cfg["groups_per_prog"]
    if round_in_fp32 is None:
        round_in_fp32 = interpreting()
    grid = (triton.cdiv(M, block_m), triton.cdiv(num_groups, groups_per_prog))
    _per_token_group_quant_fp8_kernel[grid](
        x, x_q, x_s, M, num_groups,
        x.stride(0), x_q.stride(0), x_s.stride(0), x_s.stride(1),
        eps, INV_FP8_MAX,
        GROUP=group_size, BLOCK_M=block_m, GROUPS_PER_PROG=groups_per_prog,
        UE8M0=use_ue8m0, ROUND_IN_FP32=round_in_fp32, num_warps=num_warps or cfg["num_warps"],
    )


def _empty_scales(x: torch.Tensor, num_groups: int, column_major: bool, tma_aligned: bool):
    if not column_major:
        return torch.empty((*x.shape[:-1], num_groups), dtype=torch.float32, device=x.device)
    M = x.shape[0]
    ld = (M + 3) // 4 * 4 if tma_aligned else M
    return torch.empty((num_groups, ld), dtype=torch.float32, device=x.device)[:, :M].t()


def per_token_group_quant_fp8(
    x: torch.Tensor,
    group_size: int = 128,
    eps: float = 1e-10,
    dtype: torch.dtype = torch.float8_e4m3fn,
    column_major_scales: bool = False,
    tma_aligned_scales: bool = False,
    out_q: torch.Tensor | None = None,
    use_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations to FP8 with one float32 scale per group of channels.

    Arguments:
        x: [..., K] bfloat16 / float16 / float32, last dimension contiguous, K % group_size == 0.
        group_size: channels per scale, a power of two (128 for DeepSeek-style block FP8).
        eps: positive floor on each group's max |x| (all-zero groups get scale eps / 448).
        dtype: output dtype; only torch.float8_e4m3fn (max 448).
        column_major_scales: return x_s as a [M, K/g] view with strides (1, M); x must be 2-D.
        tma_aligned_scales: with column_major_scales, strides (1, align4(M)), the MN-major layout
            DeepGEMM's SM90 kernels want (the M stride padded to 16 bytes).
        out_q: optional float8_e4m3fn tensor of x's shape and device, contiguous; written and
            returned as x_q.
        use_ue8m0: round every scale up to a power of two (2**ceil(log2(scale))).

    Returns:
        x_q: float8_e4m3fn [..., K], q = clamp(x / scale, -448, 448) rounded to nearest even.
        x_s: float32 [..., K / group_size] row-major, or [M, K / group_size] column-major as above.
        scale = max(amax, eps) / 448 per group; the exact float32 operations are in reference.py
        (a multiply by float32(1/448), then x times an IEEE reciprocal of the scale).

    CUDA tensors run the Triton kernel (int64 offsets); CPU tensors run the torch reference.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in _SUPPORTED_X:
        raise ValueError(f"x must be a bfloat16/float16/float32 tensor, got "
                         f"{getattr(x, 'dtype', type(x))}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension [..., K]")
    if not isinstance(group_size, int) or group_size <= 0 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a positive power of two, got {group_size!r}")
    K = x.shape[-1]
    if K % group_size:
        raise ValueError(f"x's last dimension K={K} is not a multiple of group_size={group_size}")
    if x.stride(-1) != 1 and x.numel() > 1:
        raise ValueError(f"x's last dimension must be contiguous (stride 1), got strides "
                         f"{tuple(x.stride())}")
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    if dtype != torch.float8_e4m3fn:
        raise ValueError(f"dtype must be torch.float8_e4m3fn, got {dtype}")
    if tma_aligned_scales and not column_major_scales:
        raise ValueError("tma_aligned_scales=True needs column_major_scales=True")
    if column_major_scales and x.dim() != 2:
        raise ValueError(f"column_major_scales needs a 2-D x [M, K], got shape {tuple(x.shape)}")
    if out_q is not None:
        if not isinstance(out_q, torch.Tensor) or out_q.dtype != dtype:
            raise ValueError(f"out_q must be a {dtype} tensor, got "
                             f"{getattr(out_q, 'dtype', type(out_q))}")
        if out_q.shape != x.shape or out_q.device != x.device:
            raise ValueError(f"out_q must have x's shape {tuple(x.shape)} on {x.device}, got "
                             f"{tuple(out_q.shape)} on {out_q.device}")
        if not out_q.is_contiguous():
            raise ValueError("out_q must be contiguous")

    x_q = out_q if out_q is not None else torch.empty(x.shape, dtype=dtype, device=x.device)
    x_s = _empty_scales(x, K // group_size, column_major_scales, tma_aligned_scales)
    if x.numel() == 0:
        return x_q, x_s
    if x.is_cuda:
        # Column-major scales are already 2-D; row-major ones flatten like x.
        s2 = x_s if column_major_scales else x_s.view(-1, K // group_size)
        per_token_group_quant_fp8_triton(x.reshape(-1, K), x_q.view(-1, K), s2, group_size, eps,
                                         use_ue8m0)
    else:
        q, s = per_token_group_quant_fp8_ref(x, group_size, eps, use_ue8m0)
        x_q.copy_(q)
        x_s.copy_(s)
    return x_q, x_s
