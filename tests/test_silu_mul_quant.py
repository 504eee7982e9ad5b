"""Tests for ops/silu_mul_quant.py: the fused kernel (interpreter on CPU) against the composition
of the two unfused ops, the batched layout's row counts, the public op's CPU path and errors, and
GPU checks (bit-exact against the unfused CUDA ops; past 2**31 elements)."""

import pytest
import torch

from vllm_moe_fixes.ops.activation import silu_and_mul, silu_and_mul_triton
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE
from vllm_moe_fixes.ops.fp8_quant import per_token_group_quant_fp8, per_token_group_quant_fp8_triton
from vllm_moe_fixes.ops.silu_mul_quant import (
    silu_and_mul_quant_fp8,
    silu_and_mul_quant_fp8_ref,
    silu_and_mul_quant_fp8_triton,
)

# The interpreter's exp (numpy) overflows to inf for very negative gates, as CUDA's does.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

POISON_Q, POISON_S = 0x7F, -7.0  # 0x7F is the float8_e4m3fn NaN


def _make_x(shape, dtype=torch.bfloat16, device="cpu", seed=0):
    """Random gate|up with per-row magnitudes from 1e-3 to 1e2, so scales vary per row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if x.numel():
        rows = x.view(-1, shape[-1])
        rows *= torch.logspace(-3, 2, rows.shape[0]).unsqueeze(1)
    return x.to(dtype).to(device)


def _poisoned(shape, device, mn_major=True):
    """x_q filled with NaN codes and x_s with -7; x_s MN-major like the experts' workspaces."""
    q = torch.full(shape, POISON_Q, dtype=torch.uint8, device=device).view(FP8_DTYPE)
    *batch, rows, n = shape
    if mn_major:
        s = torch.full((*batch, n // 128, rows + 3), POISON_S, device=device)[..., :rows]
        s = s.transpose(-1, -2)
    else:
        s = torch.full((*batch, rows, n // 128), POISON_S, device=device)
    return q, s


def _composed(x, use_ue8m0=False):
    """The unfused ops the kernel replaces, on x's device (torch on CPU, Triton on CUDA)."""
    return per_token_group_quant_fp8(silu_and_mul(x), 128, use_ue8m0=use_ue8m0)


def _unfused_kernels(x, use_ue8m0=False):
    """The two unfused Triton kernels on x's device (CUDA, or the interpreter on CPU, where both
    kernels share numpy's exp, which can differ from torch's CPU exp in float32)."""
    y = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
    silu_and_mul_triton(x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1]))
    q = torch.empty(y.shape, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((*y.shape[:-1], y.shape[-1] // 128), device=x.device)
    per_token_group_quant_fp8_triton(y.view(-1, y.shape[-1]), q.view(-1, y.shape[-1]),
                                     s.view(-1, s.shape[-1]), 128, 1e-10, use_ue8m0)
    return q, s


def _assert_same(q, s, want_q, want_s):
    assert torch.equal(q.cpu().view(torch.uint8), want_q.cpu().view(torch.uint8))
    assert torch.equal(s.cpu(), want_s.cpu())


# ---------------------------------------------------------------- contiguous layout [M, 2I]

@pytest.mark.parametrize("M", [1, 5, 33, 0])
@pytest.mark.parametrize("n", [128, 384])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_launcher_contiguous(M, n, use_ue8m0, kernel_device):
    x = _make_x((M, 2 * n), device=kernel_device, seed=M + n)
    q, s = _poisoned((M, n), kernel_device)
    silu_and_mul_quant_fp8_triton(x, q, s, None, use_ue8m0)
    _assert_same(q, s, *_unfused_kernels(x, use_ue8m0))
    _assert_same(q, s, *silu_and_mul_quant_fp8_ref(x.cpu(), use_ue8m0))  # bf16: exact here too


@pytest.mark.parametrize("tile", [(1, 1), (2, 4), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_launcher_tiles_and_dtypes(tile, dtype, kernel_device):
    x = _make_x((7, 768), dtype=dtype, device=kernel_device, seed=1)
    q, s = _poisoned((7, 384), kernel_device, mn_major=False)
    silu_and_mul_quant_fp8_triton(x, q, s, None, False, block_m=tile[0],
                                  groups_per_prog=tile[1], num_warps=2)
    _assert_same(q, s, *_unfused_kernels(x))


def test_launcher_strided_rows(kernel_device):
    """x rows with a stride larger than 2I (a view into a wider buffer)."""
    x = _make_x((6, 1024), device=kernel_device, seed=2)[:, :512]
    q, s = _poisoned((6, 256), kernel_device)
    silu_and_mul_quant_fp8_triton(x, q, s, None, False)
    _assert_same(q, s, *_unfused_kernels(x))


def test_reference_is_the_composition():
    """The CPU reference equals the two public ops composed (what the fusion must preserve)."""
    x = _make_x((9, 512), seed=3)
    _assert_same(*silu_and_mul_quant_fp8_ref(x, False), *_composed(x))


# ---------------------------------------------------------------- contiguous layout, psum ends

def _psum_case(counts, n=128, seed=0, device="cpu"):
    """x [M_sum, 2n] of a psum layout with `counts` rows per expert (segments start at multiples
    of 128 rows), its expert_ends and the live row ranges."""
    ranges, first = [], 0
    for c in counts:
        ranges.append((first, first + c))
        first += -(-c // 128) * 128
    m_sum = max(first, 1)
    x = _make_x((m_sum, 2 * n), device=device, seed=seed)
    ends = torch.tensor([e for _, e in ranges], dtype=torch.int32, device=device)
    return x, ends, ranges


def _check_psum(x, q, s, ranges):
    live = torch.zeros(x.shape[0], dtype=torch.bool)
    for first, end in ranges:
        live[first:end] = True
        if end > first:
            _assert_same(q[first:end], s[first:end], *_composed(x[first:end].cpu()))
    assert (q.cpu()[~live].view(torch.uint8) == POISON_Q).all()
    assert (s.cpu()[~live] == POISON_S).all()


@pytest.mark.parametrize("counts, tile", [([3, 0, 130], (1, 1)), ([1], (4, 4)), ([0, 0], (2, 1)),
                                          ([129, 5, 0, 7], (4, 1))])
def test_launcher_psum_ends(counts, tile, kernel_device):
    """Only each expert's rows [align128(end[e-1]), end[e]) are written, with the composition's
    bits; padding rows keep their poison. max_programs 2 makes every program loop."""
    x, ends, ranges = _psum_case(counts, seed=sum(counts), device=kernel_device)
    q, s = _poisoned((x.shape[0], 128), kernel_device)
    silu_and_mul_quant_fp8_triton(x, q, s, None, False, expert_ends=ends, block_m=tile[0],
                                  groups_per_prog=tile[1], num_warps=2, max_programs=2)
    _check_psum(x, q, s, ranges)


def test_public_op_psum_ends_cpu():
    x, ends, ranges = _psum_case([2, 0, 5], n=256, seed=9)
    q, s = _poisoned((x.shape[0], 256), "cpu")
    got_q, got_s = silu_and_mul_quant_fp8(x, out_q=q, out_s=s, expert_ends=ends)
    assert got_q is q and got_s is s
    _check_psum(x, q, s, ranges)


# ---------------------------------------------------------------- batched layout [E, T, 2I]

@pytest.mark.parametrize("counts", [[0, 3, 7], [7], [0], [2, 0, 7, 1], [9, 1]])
def test_launcher_batched_counts(counts, kernel_device):
    """Rows t < counts[e] (clamped to T) are written with the composition's bits; every other
    row of x_q and x_s keeps its poison."""
    E, T, n = len(counts), 7, 256
    x = _make_x((E, T, 2 * n), device=kernel_device, seed=sum(counts))
    num_tokens = torch.tensor(counts, dtype=torch.int32, device=kernel_device)
    q, s = _poisoned((E, T, n), kernel_device)
    silu_and_mul_quant_fp8_triton(x, q, s, num_tokens, False)
    _check_batched(x, q, s, counts)


def _check_batched(x, q, s, counts):
    T = x.shape[1]
    for e, count in enumerate(counts):
        rows = min(count, T)
        if rows:
            _assert_same(q[e, :rows], s[e, :rows], *_composed(x[e, :rows]))
        assert (q[e, rows:].cpu().view(torch.uint8) == POISON_Q).all()
        assert (s[e, rows:].cpu() == POISON_S).all()


def test_public_op_batched_cpu():
    counts = [4, 0, 5]
    x = _make_x((3, 5, 512), seed=5)
    q, s = _poisoned((3, 5, 256), "cpu")
    num_tokens = torch.tensor(counts, dtype=torch.int32)
    got_q, got_s = silu_and_mul_quant_fp8(x, out_q=q, out_s=s, expert_num_tokens=num_tokens)
    assert got_q is q and got_s is s
    _check_batched(x, q, s, counts)


# ---------------------------------------------------------------- public op

@pytest.mark.parametrize("M", [1, 6, 0])
def test_public_op_defaults(M):
    x = _make_x((M, 512), seed=6)
    x_q, x_s = silu_and_mul_quant_fp8(x)
    assert x_q.dtype == FP8_DTYPE and x_q.shape == (M, 256) and x_q.is_contiguous()
    assert x_s.dtype == torch.float32 and x_s.shape == (M, 2)
    if M:
        assert x_s.stride() == (1, (M + 3) // 4 * 4)  # MN-major, TMA-aligned
        _assert_same(x_q, x_s, *_composed(x))


def test_public_op_batched_default_scales():
    x = _make_x((2, 5, 256), seed=7)
    num_tokens = torch.tensor([5, 2], dtype=torch.int32)
    x_q, x_s = silu_and_mul_quant_fp8(x, expert_num_tokens=num_tokens, use_ue8m0=True)
    assert x_s.shape == (2, 5, 1) and x_s.stride()[1:] == (1, 8)
    _assert_same(x_q[0], x_s[0], *_composed(x[0], use_ue8m0=True))
    _assert_same(x_q[1, :2], x_s[1, :2], *_composed(x[1, :2], use_ue8m0=True))


def _bad(match, **changes):
    args = dict(x=torch.randn(4, 512, dtype=torch.bfloat16))
    args.update(changes)
    with pytest.raises(ValueError, match=match):
        silu_and_mul_quant_fp8(**args)


def test_errors():
    x3 = torch.randn(2, 3, 512, dtype=torch.bfloat16)
    counts = torch.tensor([1, 2], dtype=torch.int32)
    _bad("bfloat16/float16/float32", x=torch.randn(4, 512, dtype=torch.float64))
    _bad("bfloat16/float16/float32", x="x")
    _bad(r"\[M, 2I\]", x=x3)
    _bad(r"\[E, T, 2I\]", expert_num_tokens=counts)
    _bad("multiple of 256", x=torch.randn(4, 384, dtype=torch.bfloat16))
    _bad("multiple of 256", x=torch.randn(4, 0, dtype=torch.bfloat16))
    _bad("contiguous", x=torch.randn(512, 4, dtype=torch.bfloat16).t())
    _bad("int32", x=x3, expert_num_tokens=counts.long())
    _bad("int32", x=x3, expert_num_tokens=[1, 2])
    _bad(r"shape \(2,\)", x=x3, expert_num_tokens=torch.tensor([1], dtype=torch.int32))
    _bad("contiguous", x=x3, expert_num_tokens=torch.tensor([1, 0, 2, 0], dtype=torch.int32)[::2])
    _bad("use_ue8m0", use_ue8m0=1)
    ends = torch.tensor([4], dtype=torch.int32)
    _bad("not both", x=x3, expert_num_tokens=counts, expert_ends=ends)
    _bad("expert_ends must be a torch.int32", expert_ends=ends.long())
    _bad(r"expert_ends must have shape \(E,\)", expert_ends=ends.view(1, 1))
    _bad("out_q", out_q=torch.empty(4, 256, dtype=torch.bfloat16))
    _bad("out_q", out_q=torch.empty(4, 512, dtype=FP8_DTYPE))
    _bad("out_q", out_q=torch.empty(4, 256, dtype=FP8_DTYPE, device="meta"))
    _bad("out_q", out_q=torch.empty(256, 4, dtype=FP8_DTYPE).t())
    _bad("out_s", out_s=torch.empty(4, 2, dtype=torch.float64))
    _bad("out_s", out_s=torch.empty(4, 4))


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 127, 4096])
@pytest.mark.parametrize("n", [128, 2048])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_gpu_bit_exact_vs_unfused(M, n, use_ue8m0):
    x = _make_x((M, 2 * n), device="cuda", seed=M)
    x_q, x_s = silu_and_mul_quant_fp8(x, use_ue8m0=use_ue8m0)
    _assert_same(x_q, x_s, *_composed(x, use_ue8m0))
    _assert_same(x_q, x_s, *silu_and_mul_quant_fp8_ref(x, use_ue8m0))  # torch CUDA ops


@pytest.mark.gpu
def test_gpu_batched_counts():
    E, T, n = 32, 256, 2048
    x = _make_x((E, T, 2 * n), device="cuda", seed=8)
    counts = torch.randint(0, T + 1, (E,), dtype=torch.int32)
    counts[:4] = torch.tensor([0, 1, T, T + 5], dtype=torch.int32)
    q, s = _poisoned((E, T, n), "cuda")
    silu_and_mul_quant_fp8(x, out_q=q, out_s=s, expert_num_tokens=counts.cuda())
    _check_batched(x, q, s, counts.tolist())


@pytest.mark.gpu
def test_gpu_psum_ends():
    """DeepSeek-sized rows on a psum layout of 8 experts (one empty): live rows bit-exact, padding
    untouched, with the default launch config (looping programs)."""
    counts = [1000, 0, 7, 128, 129, 3000, 1, 517]
    x, ends, ranges = _psum_case(counts, n=2048, seed=11, device="cuda")
    q, s = _poisoned((x.shape[0], 2048), "cuda")
    silu_and_mul_quant_fp8(x, out_q=q, out_s=s, expert_ends=ends)
    _check_psum(x, q, s, ranges)


@pytest.mark.gpu
def test_gpu_past_int32_elements():
    """x_q has more than 2**31 elements (M * I), x more than 2**32: the last rows are right."""
    M, n, tail = 1_100_000, 2048, 512
    assert M * n > 2**31
    x = torch.randn((M, 2 * n), dtype=torch.bfloat16, device="cuda")
    x_q, x_s = silu_and_mul_quant_fp8(x)
    _assert_same(x_q[-tail:], x_s[-tail:], *_composed(x[-tail:]))
