"""Tests for ops/activation.py: launcher under the interpreter, CPU path, errors, GPU checks."""

import pytest
import torch

from vllm_moe_fixes.ops.activation import silu_and_mul, silu_and_mul_triton
from vllm_moe_fixes.ops.reference import silu_and_mul_ref


def _make_x(shape, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).mul_(3).to(dtype).to(device)


def _check(x, out):
    """out within one unit in the last place (of its dtype) of silu(gate) * up in float64."""
    x64 = x.cpu().double()
    gate, up = x64[..., : x.shape[-1] // 2], x64[..., x.shape[-1] // 2:]
    want = gate / (1 + torch.exp(-gate)) * up
    eps = torch.finfo(x.dtype).eps
    torch.testing.assert_close(out.cpu().double(), want, rtol=eps, atol=1e-6)


SHAPES = [(1, 256), (7, 1024), (33, 200), (0, 256), (2, 14336), (2, 3, 512)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_launcher(shape, dtype, kernel_device):
    x = _make_x(shape, dtype, kernel_device)
    out = torch.full((*shape[:-1], shape[-1] // 2), float("nan"), dtype=dtype,
                     device=kernel_device)
    silu_and_mul_triton(x.view(-1, shape[-1]), out.view(-1, shape[-1] // 2), block_m=2,
                        block_n=128)
    _check(x, out)


@pytest.mark.parametrize("shape", SHAPES)
def test_public_op_cpu(shape):
    x = _make_x(shape, torch.float16, seed=1)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == x.dtype
    _check(x, out)
    given = torch.full_like(out, float("nan"))
    assert silu_and_mul(x, out=given) is given
    assert torch.equal(given, out)
    rows = _make_x((6, 2 * shape[-1]), torch.float16, seed=2)[::2, : shape[-1]]  # strided rows
    _check(rows, silu_and_mul(rows))


def test_errors():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    for bad in (x.double(), x.to(torch.int32), x[:, :63], torch.randn(64, 4).t(), "x",
                torch.tensor(1.0)):
        with pytest.raises(ValueError):
            silu_and_mul(bad)
    for bad_out in (torch.empty(4, 32), torch.empty(4, 64, dtype=torch.bfloat16),
                    torch.empty(64, 4, dtype=torch.bfloat16).t()[:, :32],
                    torch.empty(4, 32, dtype=torch.bfloat16, device="meta"), 1):
        with pytest.raises(ValueError):
            silu_and_mul(x, out=bad_out)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 256), (257, 4096), (3, 5, 14336)])
def test_gpu_matches_reference(shape):
    x = _make_x(shape, device="cuda", seed=3)
    out = silu_and_mul(x)
    torch.testing.assert_close(out.double(), silu_and_mul_ref(x).double(),
                               rtol=torch.finfo(x.dtype).eps, atol=1e-6)


@pytest.mark.gpu
def test_gpu_past_int32_elements():
    M, two_n, tail = 140_000, 16384, 256
    assert M * two_n > 2**31
    x = torch.randn((M, two_n), dtype=torch.bfloat16, device="cuda")
    out = silu_and_mul(x)
    torch.testing.assert_close(out[-tail:].double(), silu_and_mul_ref(x[-tail:]).double(),
                               rtol=torch.finfo(x.dtype).eps, atol=1e-6)
