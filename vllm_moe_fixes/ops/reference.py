"""Plain-torch references for the ops in fp8_quant.py, moe_sum.py and activation.py, the
block-FP8 (de)quantisation of weights every float32 reference and test uses, and the accuracy
metrics they are judged by.

The public ops run these on CPU tensors; the GPU tests run them on CUDA tensors and compare the
Triton kernels against them bit for bit (quant, moe_sum) or to within one output ulp (silu_and_mul,
whose exp differs between torch and Triton). They take already validated arguments.

FP8 quantisation arithmetic (shared with the Triton kernel in fp8_quant.py, operation for operation,
so both give identical bits on any device):

    amax  = max |x| over the group, in float32 (exact: max is order independent)
    scale = max(amax, float32(eps)) * float32(1/448)          # a multiply, never `/ 448`
    use_ue8m0: scale = 2**ceil(log2(scale)), done on the bits: (bits + 0x7FFFFF) & 0x7F800000
    inv   = 1 / scale                                         # IEEE-rounded division, once a group
    q     = clamp(x * inv, -448, 448) cast to float8_e4m3fn with round-to-nearest-even

Why a multiply by a float32 reciprocal: torch on CUDA turns `t / 448.0` into `t * (1/448)` while
the CPU divides exactly, and Triton's plain fp32 `/` need not be IEEE-exact. A float32 multiply is
exact-rounded everywhere, and `inv` is a tensor / tensor division (IEEE in torch on both devices,
`tl.math.div_rn` in Triton).
"""

import torch

SCALE_BLOCK = 128
FP8_MAX = 448.0
# float32(1/448): the one constant both implementations multiply by.
INV_FP8_MAX = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32).item()


def group_scales_ref(amax: torch.Tensor, eps: float, use_ue8m0: bool) -> torch.Tensor:
    """float32 scales from float32 group maxima (any shape), by the arithmetic above."""
    eps32 = torch.tensor(eps, dtype=torch.float32, device=amax.device)
    inv448 = torch.tensor(INV_FP8_MAX, dtype=torch.float32, device=amax.device)
    scale = torch.maximum(amax, eps32) * inv448
    if use_ue8m0:
        scale = ((scale.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)
    return scale


def per_token_group_quant_fp8_ref(
    x: torch.Tensor, group_size: int, eps: float, use_ue8m0: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise x [..., K] (bf16/fp16/fp32) per group of `group_size` channels.

    Returns (x_q float8_e4m3fn [..., K] contiguous, x_s float32 [..., K // group_size] row-major).
    """
    groups = x.float().unflatten(-1, (x.shape[-1] // group_size, group_size))
    scale = group_scales_ref(groups.abs().amax(dim=-1), eps, use_ue8m0)
    inv = torch.ones_like(scale) / scale  # tensor / tensor: IEEE division on CPU and CUDA
    q = (groups * inv.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn).flatten(-2), scale


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
    """x [..., 2N] -> silu(x[..., :N]) * x[..., N:] as [..., N], float32 math, x's dtype."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


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
