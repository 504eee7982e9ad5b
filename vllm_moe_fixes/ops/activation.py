"""silu_and_mul: the gated activation between the two expert GEMMs, x [..., 2I] -> [..., I].

Numbers: `F.silu(gate) * up` in x's dtype, bit for bit, as vLLM's kernel and its torch reference
compute it: silu(g) = g / (1 + exp(-g)) in float32 (torch's formula on CUDA), rounded to x's dtype,
then the product of that and `up` rounded to x's dtype again. On the GPU the kernel calls CUDA's
accurate expf (libdevice, as torch's kernel does) and divides with IEEE rounding; Triton's own
`tl.exp` is an approximation. Under the interpreter exp is numpy's, which can differ from torch's
CPU exp in the last float32 bit (CPU tensors run the torch reference in normal use).

Kernel: one program per tile of BLOCK_M rows x BLOCK_N output channels, loading the gate half
x[..., :I] and the up half x[..., I:]. int64 offsets.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from vllm_moe_fixes.ops.triton_utils import (
    INTERPRETING,
    KernelLauncher,
    next_power_of_2,
    round_to_bf16_grid,
)
from vllm_moe_fixes.sizes import cdiv

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _round_to(v, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 v rounded to DTYPE (nearest even); the interpreter's bfloat16 cast truncates, so
    there v goes to the bfloat16 grid in float32 first."""
    if INTERPRETED:
        if DTYPE == tl.bfloat16:
            v = round_to_bf16_grid(v)
    return v.to(DTYPE)


@triton.jit
def silu_and_mul_values(gate, up, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """`F.silu(gate) * up` for gate, up of dtype DTYPE (same shape), returned in DTYPE."""
    g = gate.to(tl.float32)
    if INTERPRETED:
        e = tl.exp(-g)
    else:
        e = libdevice.exp(-g)  # __nv_expf, CUDA's expf
    silu = _round_to(tl.math.div_rn(g, 1.0 + e), DTYPE, INTERPRETED)
    return _round_to(silu.to(tl.float32) * up.to(tl.float32), DTYPE, INTERPRETED)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, M, I, x_row_stride, out_row_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < I)[None, :]
    gate_ptr = x_ptr + rows[:, None] * x_row_stride + cols[None, :]
    gate = tl.load(gate_ptr, mask=mask, other=0.0)
    up = tl.load(gate_ptr + I, mask=mask, other=0.0)
    y = silu_and_mul_values(gate, up, out_ptr.dtype.element_ty, INTERPRETED)
    tl.store(out_ptr + rows[:, None] * out_row_stride + cols[None, :], y, mask=mask)


def silu_and_mul_triton(x: torch.Tensor, out: torch.Tensor, *, block_m: int = 1,
                        block_n: int | None = None, num_warps: int = 4) -> None:
    """Launch on validated 2-D tensors: x [M, 2I], out [M, I], both with stride(1) == 1."""
    M, I = out.shape
    if M == 0 or I == 0:
        return
    block_n = block_n or min(1024, next_power_of_2(I))
    grid = (cdiv(M, block_m), cdiv(I, block_n), 1)
    _launch_silu_and_mul(grid, num_warps, (x, out), (
        M, I, x.stride(0), out.stride(0), block_m, block_n, INTERPRETING))


_launch_silu_and_mul = KernelLauncher(_silu_and_mul_kernel)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> `F.silu(x[..., :I]) * x[..., I:]` as [..., I] in x's dtype (silu rounded to
    x's dtype, then the product rounded again)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU-gated product.

    Arguments:
        x: [..., 2I] bfloat16 / float16 / float32, last dimension contiguous.
        out: optional [..., I] contiguous tensor of x's dtype and device; written and returned.

    Returns:
        out: [..., I] in x's dtype, `F.silu(x[..., :I]) * x[..., I:]` bit for bit (silu rounded to
        x's dtype, then the product rounded again; see the module docstring).
        CUDA tensors run the Triton kernel (int64 offsets), CPU tensors the torch reference.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in _SUPPORTED:
        raise ValueError(f"x must be a bfloat16/float16/float32 tensor, got "
                         f"{getattr(x, 'dtype', type(x))}")
    in_shape = x.shape
    ndim = len(in_shape)
    if ndim == 0 or in_shape[-1] % 2:
        raise ValueError(f"x must be [..., 2I] with an even last dimension, got {tuple(in_shape)}")
    if x.stride(-1) != 1 and x.numel() > 1:
        raise ValueError(f"x's last dimension must be contiguous, got strides {tuple(x.stride())}")
    n = in_shape[-1] // 2
    shape = (*in_shape[:-1], n)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif not isinstance(out, torch.Tensor) or out.dtype != x.dtype:
        raise ValueError(f"out must be a {x.dtype} tensor, got {getattr(out, 'dtype', out)}")
    elif out.shape != shape or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {list(shape)} tensor on {x.device}, got "
                         f"{tuple(out.shape)} on {out.device}")
    if x.is_cuda:
        if ndim == 2:  # the engine's case: no reshapes
            silu_and_mul_triton(x, out)
        else:
            silu_and_mul_triton(x.reshape(-1, 2 * n), out.view(-1, n))
    else:
        out.copy_(silu_and_mul_ref(x))
    return out
