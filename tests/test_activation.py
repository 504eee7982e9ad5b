"""Tests for ops/activation.py: launcher under the interpreter, CPU path, errors, GPU checks.

The contract is `F.silu(gate) * up` in x's dtype, bit for bit. On the GPU the kernel is compared
with torch's CUDA ops exactly. Under the interpreter the kernel's exp is numpy's, so there it is
compared exactly with the same two-rounding formula evaluated in numpy (`_numpy_silu_and_mul`).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vllm_moe_fixes.ops.activation import silu_and_mul, silu_and_mul_ref, silu_and_mul_triton

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _make_x(shape, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).mul_(3).to(dtype).to(device)


def _torch_silu_and_mul(x):
    """What vLLM's tests compare with: F.silu(gate) * up in x's dtype (on x's device)."""
    n = x.shape[-1] // 2
    return F.silu(x[..., :n]) * x[..., n:]


def _numpy_silu_and_mul(x):
    """g / (1 + exp(-g)) in numpy float32, rounded to x's dtype, times up, rounded again."""
    n = x.shape[-1] // 2
    x32 = x.cpu().float().numpy()
    g, up = x32[..., :n], x32[..., n:]
    silu = torch.from_numpy(g / (np.float32(1.0) + np.exp(-g))).to(x.dtype)
    return (silu.float() * torch.from_numpy(up)).to(x.dtype)


SHAPES = [(1, 256), (7, 1024), (33, 200), (0, 256), (2, 14336), (2, 3, 512)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_launcher(shape, dtype, kernel_device):
    x = _make_x(shape, dtype, kernel_device)
    out = torch.full((*shape[:-1], shape[-1] // 2), float("nan"), dtype=dtype,
                     device=kernel_device)
    silu_and_mul_triton(x.view(-1, shape[-1]), out.view(-1, shape[-1] // 2), block_m=2,
                        block_n=128)
    want = _torch_silu_and_mul(x) if x.is_cuda else _numpy_silu_and_mul(x)
    assert torch.equal(out.cpu(), want.cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_two_roundings(dtype, kernel_device):
    """silu is rounded to x's dtype before the product: one rounding of the float32 product
    differs on this data (checked, so the test can fail), and the kernel follows torch."""
    x = _make_x((16, 2048), dtype, seed=4)
    gate, up = x.float().chunk(2, dim=-1)
    once = (F.silu(gate) * up).to(dtype)
    assert (once != _torch_silu_and_mul(x)).any()
    out = torch.empty((16, 1024), dtype=dtype, device=kernel_device)
    silu_and_mul_triton(x.to(kernel_device), out)
    want = _torch_silu_and_mul(x) if kernel_device == "cuda" else _numpy_silu_and_mul(x)
    assert torch.equal(out.cpu(), want.cpu())
    assert (out.cpu() != once).any()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_public_op_cpu(shape, dtype):
    x = _make_x(shape, dtype, seed=1)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == x.dtype
    assert torch.equal(out, _torch_silu_and_mul(x))
    given = torch.full_like(out, float("nan"))
    assert silu_and_mul(x, out=given) is given
    assert torch.equal(given, out)
    rows = _make_x((6, 2 * shape[-1]), dtype, seed=2)[::2, : shape[-1]]  # strided rows
    assert torch.equal(silu_and_mul(rows), _torch_silu_and_mul(rows))


def test_errors():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    x_dtype = "x must be a bfloat16/float16/float32 tensor, got "
    for bad, match in ((x.double(), x_dtype + "torch.float64"),
                       (x.to(torch.int32), x_dtype + "torch.int32"),
                       (x[:, :63], r"x must be \[\.\.\., 2I\] with an even last dimension, "
                                   r"got \(4, 63\)"),
                       (torch.randn(64, 4).t(),
                        r"last dimension must be contiguous, got strides \(1, 4\)"),
                       ("x", x_dtype + "<class 'str'>"),
                       (torch.tensor(1.0), r"even last dimension, got \(\)")):
        with pytest.raises(ValueError, match=match):
            silu_and_mul(bad)
    out_shape = r"out must be a contiguous \[4, 32\] tensor on cpu, got "
    out_dtype = "out must be a torch.bfloat16 tensor, got "
    for bad_out, match in ((torch.empty(4, 32), out_dtype + "torch.float32"),
                           (torch.empty(4, 64, dtype=torch.bfloat16),
                            out_shape + r"\(4, 64\) on cpu"),
                           (torch.empty(64, 4, dtype=torch.bfloat16).t()[:, :32],
                            out_shape + r"\(4, 32\) on cpu"),
                           (torch.empty(4, 32, dtype=torch.bfloat16, device="meta"),
                            out_shape + r"\(4, 32\) on meta"),
                           (1, out_dtype + "1")):
        with pytest.raises(ValueError, match=match):
            silu_and_mul(x, out=bad_out)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 256), (257, 4096), (3, 5, 14336)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_bit_exact_vs_torch(shape, dtype):
    """vLLM's test compares silu_and_mul with F.silu(gate) * up exactly: so does this."""
    x = _make_x(shape, dtype, device="cuda", seed=3)
    x[..., :3] = torch.tensor([100.0, -100.0, 0.0], dtype=dtype)  # exp overflow/underflow
    out = silu_and_mul(x)
    assert torch.equal(out, _torch_silu_and_mul(x))
    assert torch.equal(out, silu_and_mul_ref(x))


@pytest.mark.gpu
def test_gpu_past_int32_elements():
    M, two_n, tail = 140_000, 16384, 256
    assert M * two_n > 2**31
    x = torch.randn((M, two_n), dtype=torch.bfloat16, device="cuda")
    out = silu_and_mul(x)
    assert torch.equal(out[-tail:], _torch_silu_and_mul(x[-tail:]))
