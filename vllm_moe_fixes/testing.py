"""What tests, benchmarks and users of the layer share: random block-FP8 layer weights, the
float32 reference of a whole MoE layer (fused_moe.reference's, handed on), the unfused torch
path over the same ops (the benchmarks' anchor), the accuracy metrics they are judged by, a
kernel count, and the record of where a measurement ran (run_environment).

    w1, w1_scale, w2, w2_scale = random_fp8_moe_weights(num_experts, K, I, generator=g)
    out = kernel(x, w1, w2, topk_weights, topk_ids, w1_scale=w1_scale, w2_scale=w2_scale)
    ref = moe_reference(x, w1, w2, topk_weights, topk_ids, w1_scale=w1_scale, w2_scale=w2_scale)
    calc_diff(out, ref)  # small (FP8 activations) when the layer is right

Weights are quantised per 128x128 block (DeepGEMM's per-block recipe); `dequant_block_fp8` in
ops/fp8.py is its inverse.
"""

from __future__ import annotations

import torch

from vllm_moe_fixes.ops.activation import silu_and_mul
from vllm_moe_fixes.fused_moe.interfaces import Fp8MoEWeights
from vllm_moe_fixes.fused_moe.reference import moe_reference
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, FP8_MAX, SCALE_BLOCK
from vllm_moe_fixes.ops.fp8_quant import per_token_group_quant_fp8
from vllm_moe_fixes.ops.moe_sum import moe_sum
from vllm_moe_fixes.ops.permute import build_contiguous_layout_ref

__all__ = ["Fp8MoEWeights", "calc_diff", "cuda_kernel_events", "kernels_per_call", "moe_reference",
           "quant_block_fp8", "random_fp8_moe_weights", "rel_err", "unfused_moe_layer"]


# ------------------------------------------------------------------------- weights

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
    q = (blocks * (FP8_MAX / amax)).to(FP8_DTYPE).flatten(-2).flatten(-3, -2)
    return q, (amax / FP8_MAX).squeeze(-1).squeeze(-2)


def random_fp8_moe_weights(num_experts: int, hidden_size: int, intermediate_size: int, *,
                           generator: torch.Generator | None = None,
                           device: torch.device | str | None = None) -> Fp8MoEWeights:
    """Random expert weights, block-quantised: w1 = randn / sqrt(K), w2 = randn / sqrt(I), drawn
    in that order from `generator` (on `device`, CPU when None), so that activations keep their
    size through the layer.

    Arguments:
        num_experts: E; hidden_size: K; intermediate_size: I (K and I multiples of 128).
        generator: the random source (torch's default one when None).
        device: where the weights are drawn and stay.

    Returns:
        Fp8MoEWeights (w1, w1_scale, w2, w2_scale), shapes as the class documents.
    """
    E, K, I = num_experts, hidden_size, intermediate_size
    w1 = torch.randn(E, 2 * I, K, generator=generator, device=device) / K ** 0.5
    w1, w1_scale = quant_block_fp8(w1)
    w2 = torch.randn(E, K, I, generator=generator, device=device) / I ** 0.5
    w2, w2_scale = quant_block_fp8(w2)
    return Fp8MoEWeights(w1, w1_scale, w2, w2_scale)


# ------------------------------------------------------------------------- the unfused layer

def unfused_moe_layer(x: torch.Tensor, weights: Fp8MoEWeights | tuple, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, gemm) -> torch.Tensor:
    """The layer as separate torch-level steps on the given grouped GEMM, every intermediate a new
    tensor: quantise x, lay its rows out by expert (the stable-sort reference), GEMM1,
    silu_and_mul then the quant into MN-major scales, GEMM2, gather each token's k rows and
    moe_sum them with the router weights.

    Arguments:
        x: bf16 [M, K]; weights: (w1, w1_scale, w2, w2_scale) of the local experts, as
            Fp8MoEWeights documents; topk_weights float32 [M, k]; topk_ids int [M, k], local ids.
        gemm: `gemm((a_q, a_s), (w_q, w_s), out, m_indices)`, a contiguous grouped FP8 GEMM (an
            experts class's `gemm`).

    Returns bf16 [M, K]. On CPU every step is a torch reference, so it matches the modular
    kernel with NoEP + TritonExperts bit for bit (tested); on a GPU it is the benchmarks' anchor.
    """
    w1, w1s, w2, w2s = weights
    M, k = topk_ids.shape
    hidden = x.shape[1]
    a_q, a_s = per_token_group_quant_fp8(x, SCALE_BLOCK)
    lay = build_contiguous_layout_ref(topk_ids, w1.shape[0], None)
    src = lay.src_row.long().clamp(min=0)
    used = (lay.src_row >= 0).unsqueeze(1)
    a_p = (a_q.view(torch.uint8)[src] * used.to(torch.uint8)).view(FP8_DTYPE)
    a_ps = (a_s[src] * used).t().contiguous().t()  # MN-major copy
    m_idx = lay.m_indices
    h = torch.empty(a_p.shape[0], w1.shape[1], dtype=torch.bfloat16, device=x.device)
    gemm((a_p, a_ps), (w1, w1s), h, m_idx)
    g_q, g_s = per_token_group_quant_fp8(silu_and_mul(h), SCALE_BLOCK, column_major_scales=True,
                                         tma_aligned_scales=True)
    y = torch.empty(a_p.shape[0], hidden, dtype=torch.bfloat16, device=x.device)
    gemm((g_q, g_s), (w2, w2s), y, m_idx)
    rows = torch.where((lay.dest >= 0).unsqueeze(1), y[lay.dest.long().clamp(min=0)], 0)
    return moe_sum(rows.view(M, k, hidden), topk_weights=topk_weights)


# ------------------------------------------------------------------------- metrics

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


def cuda_kernel_events(fn, calls: int) -> list:
    """torch.profiler's CUDA events (kernels, memcpy, memset) of `calls` calls of fn, after a
    warm-up call."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def kernels_per_call(fn, calls: int = 3, *, copies: bool = True) -> tuple[float, list[str]]:
    """(CUDA kernels per call of fn, their sorted names), from torch.profiler after a warm-up
    call; copies=False leaves out memcpy and memset operations."""
    kernels = [e for e in cuda_kernel_events(fn, calls)
               if copies or not e.name.startswith(("Memcpy", "Memset"))]
    return len(kernels) / calls, sorted({e.name for e in kernels})


def run_environment() -> dict:
    """Where a measurement ran, for its JSON: GPU name (None without CUDA), torch, triton (None
    where it is not installed) and Python versions, the UTC date and the repository's git
    commit (None outside a checkout)."""
    import datetime
    import platform
    import subprocess
    from pathlib import Path

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parents[1],
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
    }
