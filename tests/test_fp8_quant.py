"""Tests for ops/fp8_quant.py: the Triton launcher (interpreter on CPU), the public op's CPU path,
every error path, and GPU checks (bit-exact against the reference; past 2**31 elements)."""

import math

import pytest
import torch
import triton

from vllm_moe_fixes.ops.fp8_quant import (
    next_power_of_2,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_triton,
)
from vllm_moe_fixes.ops.reference import per_token_group_quant_fp8_ref

FP8 = torch.float8_e4m3fn


def _make_x(shape, dtype=torch.bfloat16, device="cpu", seed=0):
    """Random data with per-row magnitudes from 1e-6 to 1e3 (subnormal-range and saturating
    quotients both occur), one all-zero group (eps floor) and known rounding traps in row 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    if x.numel():
        rows = x.view(-1, shape[-1])
        rows *= torch.logspace(-6, 3, rows.shape[0]).unsqueeze(1)
        rows[0, :6] = torch.tensor([126.45, 31.78, 0.0019, -1e-4, -300.0, 447.0])
        rows[-1, :128] = 0.0
    return x.to(dtype).to(device)


def _expected_scales(x, group_size, eps, use_ue8m0):
    """Scale per group in float64, independent of reference.py."""
    amax = x.double().unflatten(-1, (-1, group_size)).abs().amax(-1)
    s = amax.clamp(min=eps) / 448.0
    return torch.exp2(torch.ceil(torch.log2(s))) if use_ue8m0 else s


def _check(x, x_q, x_s, group_size, eps, use_ue8m0):
    """x_s matches the float64 scales (exactly for ue8m0, else to float32 rounding) and each
    x_q value is the e4m3 value nearest to clamp(x / x_s, -448, 448)."""
    want_s = _expected_scales(x, group_size, eps, use_ue8m0)
    got_s = x_s.double()
    if use_ue8m0:
        assert torch.equal(got_s, want_s)
    else:
        torch.testing.assert_close(got_s, want_s, rtol=2e-7, atol=0)
    v = (x.double().unflatten(-1, (-1, group_size)) / got_s.unsqueeze(-1)).clamp(-448, 448)
    q = x_q.double().unflatten(-1, (-1, group_size))
    # e4m3 spacing: 2**(e - 3) for normals (|v| >= 2**-6), 2**-9 below.
    exp = torch.floor(torch.log2(v.abs().clamp(min=2.0**-6)))
    half_ulp = torch.exp2(exp - 4)
    assert ((q - v).abs() <= half_ulp * (1 + 1e-6)).all()
    assert torch.equal(torch.signbit(q[v != 0]), torch.signbit(v[v != 0]))


def _scales_buffer(M, num_groups, layout, device):
    if layout == "row":
        s = torch.empty((M, num_groups), device=device)
    else:
        ld = (M + 3) // 4 * 4 if layout == "tma" else M
        s = torch.empty((num_groups, ld), device=device)[:, :M].t()
    return s.fill_(float("nan"))


SHAPES = [(1, 128), (7, 512), (33, 512), (0, 512), (2, 7168)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group_size", [64, 128])
@pytest.mark.parametrize("layout", ["row", "col", "tma"])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_triton_launcher(shape, group_size, layout, use_ue8m0, kernel_device):
    M, K = shape
    x = _make_x(shape, device=kernel_device)
    x_q = torch.full(shape, 0x7F, dtype=torch.uint8, device=kernel_device).view(FP8)
    x_s = _scales_buffer(M, K // group_size, layout, kernel_device)
    per_token_group_quant_fp8_triton(x, x_q, x_s, group_size, 1e-10, use_ue8m0)
    _check(x.cpu(), x_q.cpu(), x_s.cpu(), group_size, 1e-10, use_ue8m0)
    ref_q, ref_s = per_token_group_quant_fp8_ref(x, group_size, 1e-10, use_ue8m0)
    assert torch.equal(x_q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(x_s, ref_s)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("tile", [(1, 1), (2, 4), (8, 8)])
def test_triton_launcher_dtypes_and_tiles(dtype, tile, kernel_device):
    x = _make_x((5, 384), dtype=dtype, device=kernel_device, seed=1)
    x_q = torch.empty((5, 384), dtype=FP8, device=kernel_device)
    x_s = torch.full((5, 3), float("nan"), device=kernel_device)
    per_token_group_quant_fp8_triton(x, x_q, x_s, 128, 1e-4, False, block_m=tile[0],
                                     groups_per_prog=tile[1], num_warps=2)
    _check(x.cpu(), x_q.cpu(), x_s.cpu(), 128, 1e-4, False)


def test_round_in_fp32_matters_under_interpreter(kernel_device):
    """The float32 grid rounding gives the reference's bits; on CPU it is what makes them agree."""
    x = _make_x((3, 256), device=kernel_device, seed=2)
    ref_q, _ = per_token_group_quant_fp8_ref(x, 128, 1e-10, False)
    x_q = torch.empty((3, 256), dtype=FP8, device=kernel_device)
    x_s = torch.empty((3, 2), device=kernel_device)
    per_token_group_quant_fp8_triton(x, x_q, x_s, 128, 1e-10, False, round_in_fp32=True)
    assert torch.equal(x_q.view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.parametrize("round_in_fp32", [True, False])
def test_round_in_fp32_keeps_sign_of_zero(round_in_fp32, kernel_device):
    """Quotients that round to zero keep their sign (-0.0 is byte 0x80), like torch's cast. The
    group max 448 makes the scale ~1, so v ~ x: tiny negatives below 2**-10 must give 0x80, ties
    at 2**-10 go to even (0), -1e-3 goes to -2**-9 (0x81). round_in_fp32=False is the GPU's cast
    (the interpreter's own float8 cast is not exact, so that case is checked on the GPU only)."""
    if not round_in_fp32 and kernel_device == "cpu":
        pytest.skip("the interpreter's float8 cast is not RNE; covered by round_in_fp32=True")
    vals = [448.0, -1e-4, -3e-7, -2.0**-10, -1e-3, 1e-4, 2.0**-10, -2.0**-126, -0.0]
    x = torch.tensor(vals + [-5e-5] * (128 - len(vals)), dtype=torch.float32,
                     device=kernel_device).repeat(3, 1)
    x_q = torch.full((3, 128), 0x7F, dtype=torch.uint8, device=kernel_device).view(FP8)
    x_s = torch.empty((3, 1), device=kernel_device)
    per_token_group_quant_fp8_triton(x, x_q, x_s, 128, 1e-10, False, round_in_fp32=round_in_fp32)
    got = x_q.view(torch.uint8).cpu()
    want = [0x7E, 0x80, 0x80, 0x80, 0x81, 0x00, 0x00, 0x80, 0x80]
    assert got[:, :len(vals)].tolist() == [want] * 3
    assert (got[:, len(vals):] == 0x80).all()
    ref_q, _ = per_token_group_quant_fp8_ref(x, 128, 1e-10, False)
    assert torch.equal(x_q.view(torch.uint8), ref_q.view(torch.uint8))


def test_next_power_of_2_matches_triton():
    assert [next_power_of_2(n) for n in range(1, 5000)] == [
        triton.next_power_of_2(n) for n in range(1, 5000)]


@pytest.mark.parametrize("shape", SHAPES + [(2, 3, 256), (256,)])
@pytest.mark.parametrize("group_size", [64, 128])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_public_op_row_major(shape, group_size, use_ue8m0):
    x = _make_x(shape, seed=3)
    x_q, x_s = per_token_group_quant_fp8(x, group_size, use_ue8m0=use_ue8m0)
    assert x_q.dtype == FP8 and x_q.shape == x.shape
    assert x_s.dtype == torch.float32 and x_s.shape == (*shape[:-1], shape[-1] // group_size)
    assert x_s.is_contiguous()
    _check(x, x_q, x_s, group_size, 1e-10, use_ue8m0)


@pytest.mark.parametrize("M", [1, 7, 33, 0])
@pytest.mark.parametrize("tma", [False, True])
def test_public_op_column_major(M, tma):
    x = _make_x((M, 512), seed=4) if M else torch.empty((0, 512), dtype=torch.bfloat16)
    x_q, x_s = per_token_group_quant_fp8(x, 128, column_major_scales=True, tma_aligned_scales=tma)
    assert x_s.shape == (M, 4)
    if M:
        assert x_s.stride() == (1, (M + 3) // 4 * 4 if tma else M)
        _check(x, x_q, x_s, 128, 1e-10, False)


def test_public_op_out_q_and_eps():
    x = _make_x((9, 256), dtype=torch.float32, seed=5)
    out_q = torch.full((9, 256), 0x7F, dtype=torch.uint8).view(FP8)
    x_q, x_s = per_token_group_quant_fp8(x, 128, eps=1e-3, out_q=out_q)
    assert x_q is out_q
    _check(x, x_q, x_s, 128, 1e-3, False)
    torch.testing.assert_close(x_s[-1, 0].double(), torch.tensor(1e-3 / 448, dtype=torch.float64),
                               rtol=2e-7, atol=0)  # the all-zero group gets eps / 448


def test_public_op_non_contiguous_rows():
    x = _make_x((6, 1024), seed=6)[::2, :512]
    x_q, x_s = per_token_group_quant_fp8(x, 128)
    _check(x, x_q, x_s, 128, 1e-10, False)


@pytest.mark.parametrize("layout", ["row", "strided", "col", "tma", "3d"])
def test_public_op_out_s(layout, kernel_device):
    """out_s (a workspace view) is written and returned with the same bits as the allocating
    call; any strides for 2-D x, exact strides with the column-major flags, contiguous for 3-D."""
    shape = (2, 5, 512) if layout == "3d" else (7, 512)
    x = _make_x(shape, device=kernel_device, seed=12)
    G = shape[-1] // 128
    if layout in ("row", "3d"):
        out_s = torch.full((*shape[:-1], G), float("nan"), device=kernel_device)
    elif layout == "strided":  # every other float of a wider buffer, groups outermost
        out_s = torch.full((G, 2 * shape[0]), float("nan"), device=kernel_device)[:, ::2].t()
    else:
        ld = 8 if layout == "tma" else 7
        out_s = torch.full((G, ld), float("nan"), device=kernel_device)[:, :7].t()
    flags = dict(column_major_scales=layout in ("col", "tma"), tma_aligned_scales=layout == "tma")
    x_q, x_s = per_token_group_quant_fp8(x, 128, out_s=out_s, **flags)
    assert x_s is out_s
    ref_q, ref_s = per_token_group_quant_fp8(x, 128, **flags)
    assert x_s.stride() == out_s.stride()
    assert torch.equal(x_s, ref_s) and torch.equal(x_q.view(torch.uint8), ref_q.view(torch.uint8))


def test_public_op_out_s_errors():
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    for bad, flags, match in [
        (torch.empty(4, 2, dtype=torch.float64), {}, "float32"),
        ("scales", {}, "float32"),
        (torch.empty(4, 3), {}, "shape"),
        (torch.empty(2, 4), {}, "shape"),
        (torch.empty(4, 2, device="meta"), {}, "shape"),
        (torch.empty(4, 2), dict(column_major_scales=True), r"strides \(1, 4\)"),  # row-major
        (torch.empty(2, 5)[:, :4].t(), dict(column_major_scales=True), r"strides \(1, 4\)"),
        (torch.empty(2, 4).t(), dict(column_major_scales=True, tma_aligned_scales=False,
                                     ), None),  # the right strides: accepted
        (torch.empty(2, 4).t(), dict(column_major_scales=True, tma_aligned_scales=True), None),
    ]:
        if match is None:
            per_token_group_quant_fp8(x, 128, out_s=bad, **flags)
            continue
        with pytest.raises(ValueError, match=match):
            per_token_group_quant_fp8(x, 128, out_s=bad, **flags)
    x3 = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        per_token_group_quant_fp8(x3, 128, out_s=torch.empty(2, 2, 3).transpose(1, 2))
    # M = 5 with tma_aligned_scales pads the M stride to 8: strides (1, 5) are refused.
    x5 = torch.randn(5, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"strides \(1, 8\)"):
        per_token_group_quant_fp8(x5, 128, column_major_scales=True, tma_aligned_scales=True,
                                  out_s=torch.empty(2, 5).t())


def _bad(**kw):
    args = dict(x=torch.randn(4, 256, dtype=torch.bfloat16))
    args.update(kw)
    with pytest.raises(ValueError):
        per_token_group_quant_fp8(**args)


def test_errors():
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    _bad(x=torch.randn(4, 200, dtype=torch.bfloat16))  # K % group_size
    _bad(x=x.to(torch.float64))
    _bad(x=x.to(torch.int32))
    _bad(x=x.to(FP8))
    _bad(x=[1.0, 2.0])
    _bad(x=torch.tensor(1.0, dtype=torch.bfloat16))  # 0-D
    _bad(x=torch.randn(256, 4, dtype=torch.bfloat16).t())  # last dim not contiguous
    _bad(group_size=96)
    _bad(group_size=0)
    _bad(group_size=128.0)
    _bad(eps=0.0)
    _bad(eps=-1.0)
    _bad(eps="1e-10")
    _bad(dtype=torch.float8_e5m2)
    _bad(dtype=torch.bfloat16)
    _bad(tma_aligned_scales=True)
    _bad(x=torch.randn(2, 4, 256, dtype=torch.bfloat16), column_major_scales=True)
    _bad(out_q=torch.empty(4, 256, dtype=torch.bfloat16))
    _bad(out_q=torch.empty(4, 128, dtype=FP8))
    _bad(out_q=torch.empty(256, 4, dtype=FP8).t())
    _bad(out_q=torch.empty(4, 256, dtype=FP8, device="meta"))
    _bad(out_q="buffer")
    _bad(out_s=torch.empty(4, 2, dtype=torch.bfloat16))
    _bad(out_s=torch.empty(4, 4))


# ---------------------------------------------------------------- GPU (bit-exact, > 2**31)

@pytest.mark.gpu
@pytest.mark.parametrize("shape,layout", [
    (shape, layout) for shape in [(1, 128), (33, 512), (4096, 7168), (3, 5, 1024), (1024,)]
    for layout in (["row", "col", "tma"] if len(shape) == 2 else ["row"])])  # column-major: 2-D
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_gpu_bit_exact(shape, layout, use_ue8m0):
    x = _make_x(shape, device="cuda", seed=7)
    x_q, x_s = per_token_group_quant_fp8(x, 128, column_major_scales=layout != "row",
                                         tma_aligned_scales=layout == "tma", use_ue8m0=use_ue8m0)
    ref_q, ref_s = per_token_group_quant_fp8_ref(x, 128, 1e-10, use_ue8m0)
    assert torch.equal(x_q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(x_s, ref_s)
    # The float32 grid rounding (used under the interpreter) gives the same bits on the GPU,
    # -0.0 for tiny negatives included (triton 3.6 once turned those into +0.0: fp8_quant.py).
    q2 = torch.full_like(x_q.view(torch.uint8), 0x7F).view(FP8)
    s2 = torch.empty_like(ref_s)
    per_token_group_quant_fp8_triton(x.view(-1, shape[-1]), q2.view(-1, shape[-1]),
                                     s2.view(-1, shape[-1] // 128), 128, 1e-10, use_ue8m0,
                                     round_in_fp32=True)
    assert torch.equal(q2.view(torch.uint8), ref_q.view(torch.uint8))
    _check(x.cpu(), x_q.cpu(), x_s.cpu(), 128, 1e-10, use_ue8m0)
    _check(x.cpu(), q2.cpu(), x_s.cpu(), 128, 1e-10, use_ue8m0)


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [{}, dict(column_major_scales=True, tma_aligned_scales=True)])
def test_gpu_out_s_bit_exact(flags):
    """The Triton path writes out_s in place (MN-major workspace view, or row-major)."""
    x = _make_x((1001, 7168), device="cuda", seed=9)
    ref_q, ref_s = per_token_group_quant_fp8_ref(x, 128, 1e-10, False)
    if flags:
        out_s = torch.full((56, 1004), float("nan"), device="cuda")[:, :1001].t()
    else:
        out_s = torch.full((1001, 56), float("nan"), device="cuda")
    x_q, x_s = per_token_group_quant_fp8(x, 128, out_s=out_s, **flags)
    assert x_s is out_s
    assert torch.equal(x_q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(x_s, ref_s)


@pytest.mark.gpu
def test_gpu_past_int32_elements():
    M, K, tail = 300_000, 7168, 1024
    assert M * K > 2**31
    x = torch.randn((M, K), dtype=torch.bfloat16, device="cuda")
    x_q, x_s = per_token_group_quant_fp8(x, 128, column_major_scales=True,
                                         tma_aligned_scales=True)
    ref_q, ref_s = per_token_group_quant_fp8_ref(x[-tail:], 128, 1e-10, False)
    assert torch.equal(x_q[-tail:].view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(x_s[-tail:], ref_s)
    assert math.isfinite(x_s.min().item())


@pytest.mark.gpu
@pytest.mark.parametrize("block_m,groups,warps", [(1, 2, 2), (2, 4, 4), (4, 8, 4), (8, 8, 8),
                                                  (16, 4, 8)])
def test_gpu_launch_configs_bit_exact(block_m, groups, warps):
    """Every config the benchmark sweep may pick gives the reference's bits (odd M, 56 groups)."""
    x = _make_x((1001, 7168), device="cuda", seed=8)
    ref_q, ref_s = per_token_group_quant_fp8_ref(x, 128, 1e-10, False)
    x_q = torch.empty_like(ref_q)
    x_s = _scales_buffer(1001, 56, "tma", "cuda")
    per_token_group_quant_fp8_triton(x, x_q, x_s, 128, 1e-10, False, block_m=block_m,
                                     groups_per_prog=groups, num_warps=warps)
    assert torch.equal(x_q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(x_s, ref_s)
