"""Tests for ops/moe_sum.py: launcher under the interpreter, CPU path, errors, GPU checks."""

import pytest
import torch

from vllm_moe_fixes.ops.moe_sum import moe_sum, moe_sum_ref, moe_sum_triton


def _make_x(M, topk, K, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((M, topk, K), generator=g).mul_(4).to(dtype).to(device)


def _expected(x, w=None):
    """float32 running sum over topk in index order (each slot times its weight when given),
    written independently of moe_sum_ref."""
    acc = torch.zeros((x.shape[0], x.shape[2]), dtype=torch.float32)
    for t in range(x.shape[1]):
        slot = x[:, t].cpu().float()
        if w is not None:
            weight = w[:, t].cpu().unsqueeze(1)
            slot = (slot * weight).masked_fill(weight == 0, 0.0)
        acc += slot
    return acc.to(x.dtype)


def _make_w(M, topk, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    return torch.rand((M, topk), generator=g).add_(0.01).to(device)


def _poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


CASES = [(1, 8, 128), (7, 1, 512), (33, 2, 512), (0, 8, 128), (3, 8, 7168), (5, 6, 100)]


@pytest.mark.parametrize("M,topk,K", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_launcher(M, topk, K, dtype, kernel_device):
    x = _make_x(M, topk, K, dtype, kernel_device)
    out = _poisoned((M, K), dtype, kernel_device)
    moe_sum_triton(x, out)
    assert torch.equal(out.cpu(), _expected(x))
    assert torch.equal(out, moe_sum_ref(x))
    # float32 accumulation: differs from a sum rounded to x's dtype at every step
    torch.testing.assert_close(out.cpu().double(), x.cpu().double().sum(1),
                               rtol=2**-7 if dtype == torch.bfloat16 else 1e-6, atol=1e-5)


@pytest.mark.parametrize("M,topk,K", CASES)
def test_triton_launcher_weighted(M, topk, K, kernel_device):
    x = _make_x(M, topk, K, torch.bfloat16, kernel_device, seed=5)
    # weights as a strided view (every other column of a wider buffer)
    w = _make_w(M, 2 * topk, kernel_device)[:, ::2]
    if M > 1:  # zero-weight slots holding NaN add exactly 0
        w[1, 0] = 0.0
        x[1, 0] = float("nan")
    out = _poisoned((M, K), torch.bfloat16, kernel_device)
    moe_sum_triton(x, out, w)
    assert torch.equal(out.cpu(), _expected(x, w))
    assert torch.equal(out, moe_sum_ref(x, w))


@pytest.mark.parametrize("tile", [(1, 64, 1), (4, 256, 4), (2, 1024, 8)])
def test_triton_launcher_tiles_and_strides(tile, kernel_device):
    # x and out both strided: x is a topk-major buffer seen as [M, topk, K]; out a column slice.
    x = _make_x(4, 9, 300, device=kernel_device, seed=1).transpose(0, 1)
    out_buf = _poisoned((9, 400), torch.bfloat16, kernel_device)
    out = out_buf[:, 50:350]
    moe_sum_triton(x, out, block_m=tile[0], block_k=tile[1], num_warps=tile[2])
    assert torch.equal(out.cpu(), _expected(x))
    assert out_buf[:, :50].isnan().all() and out_buf[:, 350:].isnan().all()


@pytest.mark.parametrize("M,topk,K", CASES)
def test_public_op_cpu(M, topk, K):
    x = _make_x(M, topk, K, torch.float16, seed=2)
    out = moe_sum(x)
    assert out.shape == (M, K) and out.dtype == x.dtype
    assert torch.equal(out, _expected(x))
    given = _poisoned((M, K), torch.float16, "cpu")
    assert moe_sum(x, out=given) is given
    assert torch.equal(given, out)


def test_public_op_cpu_weighted():
    x, w = _make_x(9, 3, 256, seed=6), _make_w(9, 3)
    out = _poisoned((9, 256), torch.bfloat16, "cpu")
    assert moe_sum(x, out=out, topk_weights=w) is out
    assert torch.equal(out, _expected(x, w))


def test_errors():
    x = torch.randn(4, 2, 64, dtype=torch.bfloat16)
    for bad_w in (torch.rand(4, 2).double(), torch.rand(4, 3), torch.rand(2, 4), torch.rand(8),
                  torch.rand(4, 2, device="meta"), [[1.0, 1.0]] * 4):
        with pytest.raises(ValueError, match="topk_weights"):
            moe_sum(x, topk_weights=bad_w)
    x_dtype = "x must be a bfloat16/float16/float32 tensor, got "
    x_shape = r"x must be \[M, topk, K\] with topk >= 1, got shape "
    for bad, match in ((x.double(), x_dtype + "torch.float64"),
                       (x.to(torch.int32), x_dtype + "torch.int32"),
                       (x[0], x_shape + r"\(2, 64\)"),
                       (x.unsqueeze(0), x_shape + r"\(1, 4, 2, 64\)"),
                       (x[:, :0], x_shape + r"\(4, 0, 64\)"), ("x", x_dtype + "<class 'str'>")):
        with pytest.raises(ValueError, match=match):
            moe_sum(bad)
    out_dtype = "out must be a torch.bfloat16 tensor, got "
    out_shape = r"out must be \[4, 64\] on cpu, got "
    for bad_out, match in ((torch.empty(4, 64), out_dtype + "torch.float32"),
                           (torch.empty(4, 63, dtype=torch.bfloat16),
                            out_shape + r"\(4, 63\) on cpu"),
                           (torch.empty(4, 2, 64, dtype=torch.bfloat16),
                            out_shape + r"\(4, 2, 64\) on cpu"),
                           (torch.empty(4, 64, dtype=torch.bfloat16, device="meta"),
                            out_shape + r"\(4, 64\) on meta"),
                           (3, out_dtype + "3")):
        with pytest.raises(ValueError, match=match):
            moe_sum(x, out=bad_out)


@pytest.mark.gpu
@pytest.mark.parametrize("M,topk,K", [(1, 8, 7168), (257, 8, 7168), (1025, 8, 7168),
                                     (4096, 6, 2048), (33, 1, 100)])
def test_gpu_bit_exact(M, topk, K):
    x = _make_x(M, topk, K, device="cuda", seed=3)
    assert torch.equal(moe_sum(x), moe_sum_ref(x))
    w = _make_w(M, topk, "cuda")
    assert torch.equal(moe_sum(x, topk_weights=w), moe_sum_ref(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("block_m,block_k,warps", [(1, 512, 4), (2, 1024, 8), (4, 4096, 16)])
def test_gpu_launch_configs_bit_exact(block_m, block_k, warps):
    x = _make_x(1001, 8, 7168, device="cuda", seed=4)
    out = _poisoned((1001, 7168), torch.bfloat16, "cuda")
    moe_sum_triton(x, out, block_m=block_m, block_k=block_k, num_warps=warps)
    assert torch.equal(out, moe_sum_ref(x))


@pytest.mark.gpu
def test_gpu_past_int32_elements():
    M, topk, K, tail = 300_000, 8, 1024, 512
    assert M * topk * K > 2**31
    x = torch.randn((M, topk, K), dtype=torch.bfloat16, device="cuda")
    out = moe_sum(x)
    assert torch.equal(out[-tail:], moe_sum_ref(x[-tail:]))
    w = _make_w(M, topk, "cuda")
    out = moe_sum(x, topk_weights=w)
    assert torch.equal(out[-tail:], moe_sum_ref(x[-tail:], w[-tail:]))
