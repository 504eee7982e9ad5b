"""moe_sum: reduce the top-k expert outputs of each token, x [M, topk, K] -> [M, K], optionally
weighting each slot by its router weight on the way (one pass instead of an in-place multiply of
the whole [M, topk, K] tensor followed by the sum).

Kernel design: one program owns a tile of BLOCK_M rows x BLOCK_K channels and adds the topk
slices in index order with a float32 accumulator. TOPK is a compile-time constant and the loop is
unrolled (tl.static_range), so all topk loads of a tile are issued before the first add: the kernel
is purely memory bound and needs those bytes in flight. int64 offsets throughout. The float32 sums
are taken in the same order as `moe_sum_ref`, so the results match it bit for bit; with weights,
each product is rounded before it is added (fp fusion off: no FMA), as torch computes it.
"""

import torch
import triton
import triton.language as tl

from vllm_moe_fixes.ops.triton_utils import (
    INTERPRETING,
    KernelLauncher,
    next_power_of_2,
    round_to_bf16_grid,
)
from vllm_moe_fixes.sizes import cdiv

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _moe_sum_kernel(
    x_ptr, w_ptr, out_ptr, M, K,
    x_stride_m, x_stride_t, x_stride_k, w_stride_m, w_stride_t, out_stride_m, out_stride_k,
    TOPK: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    ptrs = x_ptr + rows[:, None] * x_stride_m + cols[None, :] * x_stride_k
    w_ptrs = w_ptr + rows * w_stride_m
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for t in tl.static_range(TOPK):
        if t > 0:  # pointer steps: no int32 product t * x_stride_t that could overflow
            ptrs += x_stride_t
            w_ptrs += w_stride_t
        if WEIGHTED:
            # A zero-weight slot is not read at all: it adds exactly 0 even over NaN garbage.
            w = tl.load(w_ptrs, mask=rows < M, other=0.0)
            term = tl.load(ptrs, mask=mask & (w != 0)[:, None], other=0.0).to(tl.float32)
            term = term * w[:, None]
        else:
            term = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        acc = term if t == 0 else acc + term
    if ROUND_BF16:  # interpreter only: its bfloat16 cast truncates
        acc = round_to_bf16_grid(acc)
    tl.store(out_ptr + rows[:, None] * out_stride_m + cols[None, :] * out_stride_k,
             acc.to(out_ptr.dtype.element_ty), mask=mask)


def default_moe_sum_config(num_rows: int, K: int) -> dict:
    """Default launch config, the fastest of the H200 sweep (`python -m benchmarks.bench_moe_sum
    --sweep`, top-8, K = 7168, bf16; benchmarks/results/bench_moe_sum_sweep.json): one row per
    program, 4 warps; 4096 channels per program from 1024 rows up, 2048 below (there 4096 leaves
    too few programs for 132 SMs). Capped at K's next power of two."""
    block_k = 4096 if num_rows >= 1024 else 2048
    return {"block_m": 1, "block_k": min(block_k, next_power_of_2(K)), "num_warps": 4}


def moe_sum_triton(x: torch.Tensor, out: torch.Tensor, topk_weights: torch.Tensor | None = None,
                   *, block_m: int | None = None, block_k: int | None = None,
                   num_warps: int = 4) -> None:
    """Launch the kernel on validated tensors (CUDA, or CPU under TRITON_INTERPRET=1).

    x: [M, topk, K], any strides; out: [M, K] of x's dtype, any strides (written); topk_weights:
    float32 [M, topk], any strides, or None. block_m and block_k (powers of two) and num_warps
    override `default_moe_sum_config`.
    """
    M, topk, K = x.shape
    if M == 0 or K == 0:
        return
    if block_k is None:
        block_k = default_moe_sum_config(M, K)["block_k"]
    block_m = block_m or 1
    grid = (cdiv(M, block_m), cdiv(K, block_k))
    weighted = topk_weights is not None
    # Unweighted, out stands in for w_ptr (WEIGHTED=False: never read).
    w, w_strides = (topk_weights, topk_weights.stride()) if weighted else (out, (0, 0))
    _launch_moe_sum((*grid, 1), num_warps, (x, w, out), (
        M, K, *x.stride(), *w_strides, *out.stride(), topk, weighted, block_m, block_k,
        INTERPRETING and out.dtype == torch.bfloat16))


# fp fusion off: each weighted product is rounded before it is added, as torch computes it
_launch_moe_sum = KernelLauncher(_moe_sum_kernel, enable_fp_fusion=False)


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


def moe_sum(x: torch.Tensor, out: torch.Tensor | None = None,
            topk_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum each token's top-k expert outputs, optionally weighted by the router weights.

    Arguments:
        x: [M, topk, K] bfloat16 / float16 / float32, topk >= 1, any strides.
        out: optional [M, K] tensor of x's dtype and device (any strides); written and returned.
        topk_weights: optional float32 [M, topk] on x's device (any strides): slot t of token m
            is multiplied by topk_weights[m, t] (in float32) before it is added; a slot whose
            weight is 0 is not read and adds exactly 0 (DeepEP gives masked slots weight 0, and
            0 * NaN would be NaN).

    Returns:
        out: [M, K] in x's dtype, out[m] = sum over t of x[m, t] (* topk_weights[m, t]),
        accumulated in float32 in order t = 0, 1, ... CUDA tensors run the Triton kernel (int64
        offsets), CPU the reference.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in _SUPPORTED:
        raise ValueError(f"x must be a bfloat16/float16/float32 tensor, got "
                         f"{getattr(x, 'dtype', type(x))}")
    shape = x.shape
    if len(shape) != 3 or shape[1] < 1:
        raise ValueError(f"x must be [M, topk, K] with topk >= 1, got shape {tuple(shape)}")
    M, _, K = shape
    if out is None:
        out = torch.empty((M, K), dtype=x.dtype, device=x.device)
    elif not isinstance(out, torch.Tensor) or out.dtype != x.dtype:
        raise ValueError(f"out must be a {x.dtype} tensor, got {getattr(out, 'dtype', out)}")
    elif out.shape != (M, K) or out.device != x.device:
        raise ValueError(f"out must be [{M}, {K}] on {x.device}, got {tuple(out.shape)} on "
                         f"{out.device}")
    if topk_weights is not None and (
            not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32
            or topk_weights.shape != shape[:2] or topk_weights.device != x.device):
        raise ValueError(f"topk_weights must be float32 [{M}, {shape[1]}] on {x.device}, got "
                         f"{getattr(topk_weights, 'dtype', type(topk_weights))} "
                         f"{tuple(getattr(topk_weights, 'shape', ()))}")
    if x.is_cuda:
        moe_sum_triton(x, out, topk_weights)
    else:
        out.copy_(moe_sum_ref(x, topk_weights))
    return out
