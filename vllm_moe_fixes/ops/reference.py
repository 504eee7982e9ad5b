"""Plain-torch references for the ops in fp8_quant.py, activation.py, silu_mul_quant.py and
moe_sum.py, the block-FP8 (de)quantisation of weights every float32 reference and test uses, and
the accuracy metrics they are judged by.

The public ops run these on CPU tensors; the GPU tests run them on CUDA tensors and compare the
Triton kernels against them bit for bit. They take already validated arguments.

FP8 quantisation arithmetic, vLLM's recipe (its CUDA per-token-group kernel), in float32; the
Triton kernels perform the same operations, so both give identical bits on any device:

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

SiLU-and-mul, vLLM's and torch's rounding: `F.silu(gate) * up` in the input dtype, i.e.
silu(g) = g / (1 + exp(-g)) in float32 rounded to the input dtype, then the product of two values
of that dtype rounded to it again.
"""

import torch

from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, FP8_MAX, SCALE_BLOCK

# vLLM floors the ue8m0 scale at float32(1e-10) before rounding it up to a power of two (2**-33).
UE8M0_SCALE_FLOOR = 1e-10


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
    """Quantise x [..., K] (bf16/fp16/fp32) per group of `group_size` channels.

    Returns (x_q float8_e4m3fn [..., K] contiguous, x_s float32 [..., K // group_size] row-major).
    """
    groups = x.float().unflatten(-1, (x.shape[-1] // group_size, group_size))
    magnitudes = groups.abs().nan_to_num(nan=0.0, posinf=float("inf"))  # NaN ignored by the max
    scale = group_scales_ref(magnitudes.amax(dim=-1), eps, use_ue8m0)
    q = torch.fmax(groups / scale.unsqueeze(-1), _full(x, -FP8_MAX))  # fmax: NaN -> -448
    q = torch.fmin(q, _full(x, FP8_MAX))
    return q.to(FP8_DTYPE).flatten(-2), scale


def moe_sum_ref(x: torch.Tensor, topk_weights: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, topk, K] -> [M, K] in x's dtype: the topk slices (each times its float32 weight
    topk_weights[:, t] when given; a zero weight gives exactly 0) summed in float32 in index
    order."""
    def term(t):
        v = x[:, t].float()
        if topk_weights is None:
            return v
        w = topk_weights[:, t, None].float()
        return torch.where(w != 0, v * w, torch.zeros_like(v))
    acc = term(0)
    for t in range(1, x.shape[1]):
        acc = acc + term(t)
    return acc.to(x.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2N] -> `F.silu(x[..., :N]) * x[..., N:]` as [..., N] in x's dtype (silu rounded to
    x's dtype, then the product rounded again)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_and_mul_quant_fp8_ref(
    x: torch.Tensor, use_ue8m0: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., 2N] (N a multiple of 128) -> the FP8 quant (group 128, eps 1e-10) of
    silu_and_mul_ref(x): (float8_e4m3fn [..., N], float32 [..., N / 128] row-major)."""
    return per_token_group_quant_fp8_ref(silu_and_mul_ref(x), SCALE_BLOCK, 1e-10, use_ue8m0)


def dequant_block_fp8(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [..., R, C] with float32 [..., cdiv(R,128), cdiv(C,128)] block scales
    -> float32 [..., R, C] = w * its 128x128 block's scale."""
    R, C = w.shape[-2:]
    s = w_scale.float().repeat_interleave(SCALE_BLOCK, dim=-2)[..., :R, :]
    s = s.repeat_interleave(SCALE_BLOCK, dim=-1)[..., :C]
    return w.float() * s


def quant_block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., R, C] (R, C multiples of 128) -> (float8_e4m3fn [..., R, C], float32
    [..., R/128, C/128]) with 128x128 block scales amax/448 (DeepGEMM's per-block recipe; amax
    floored at 1e-4). For making test and benchmark weights."""
    R, C = w.shape[-2:]
    if R % SCALE_BLOCK or C % SCALE_BLOCK:
        raise ValueError(f"w's last two dimensions must be multiples of {SCALE_BLOCK}, got "
                         f"{(R, C)}")
    blocks = w.float().unflatten(-1, (C // SCALE_BLOCK, SCALE_BLOCK))
    blocks = blocks.unflatten(-3, (R // SCALE_BLOCK, SCALE_BLOCK))
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=1e-4)
    q = (blocks * (448.0 / amax)).to(torch.float8_e4m3fn).flatten(-2).flatten(-3, -2)
    return q, (amax / 448.0).squeeze(-1).squeeze(-2)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity measure 1 - 2<x, y> / (<x, x> + <y, y>) in float64: 0 when x == y,
    ~1 for unrelated data (two all-zero tensors count as equal)."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denom) if denom > 0 else 0.0


def rel_err(x: torch.Tensor, y: torch.Tensor, eps: float = 1e-12) -> float:
    """Relative L2 error ||x - y|| / max(||y||, eps) in float64 (y is the reference; the clamp
    keeps an all-zero reference finite: then the error is ||x|| / eps, 0 when x is zero too)."""
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm().clamp(min=eps))
