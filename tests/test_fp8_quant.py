"""Tests for ops/fp8_quant.py: the Triton launcher (interpreter on CPU), the public op's CPU path,
every error path, and GPU checks (bit-exact against the reference; past 2**31 elements)."""

import math

import numpy as np
import pytest
import torch
import triton

from vllm_moe_fixes.ops import fp8_quant as fq
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, FP8_MAX
from vllm_moe_fixes.ops.fp8_quant import (
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_ref,
    per_token_group_quant_fp8_triton,
    quant_batched_fp8,
)



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


def _expected(x, group_size, eps, use_ue8m0):
    """vLLM's recipe in numpy float32, independent of per_token_group_quant_fp8_ref: (codes as
    uint8, scales).

    amax = fmax-reduction (NaN ignored) floored at eps; scale = amax / 448 (IEEE float32
    division); ue8m0: 2**ceil(log2(max(scale, 1e-10))) with the log2 in float64 (exact on a
    float32); q = fmin(fmax(x / scale, -448), 448) (IEEE float32 division), cast to e4m3 (RNE).
    """
    g = x.float().cpu().numpy()
    g = g.reshape(*g.shape[:-1], g.shape[-1] // group_size, group_size)
    amax = np.fmax(np.fmax.reduce(np.abs(g), axis=-1, initial=-np.inf), np.float32(eps))
    s = (amax / np.float32(FP8_MAX)).astype(np.float32)
    if use_ue8m0:
        s = np.exp2(np.ceil(np.log2(np.fmax(s, np.float32(1e-10)).astype(np.float64))))
        s = s.astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        v = np.fmin(np.fmax(g / s[..., None], np.float32(-FP8_MAX)), np.float32(FP8_MAX))
    codes = torch.from_numpy(v.reshape(x.shape)).to(FP8_DTYPE).view(torch.uint8)
    return codes, torch.from_numpy(s)


def _check(x, x_q, x_s, group_size, eps, use_ue8m0):
    """x_q and x_s are exactly vLLM's codes and scales (see _expected)."""
    want_q, want_s = _expected(x, group_size, eps, use_ue8m0)
    assert torch.equal(x_s.cpu(), want_s)
    assert torch.equal(x_q.cpu().view(torch.uint8), want_q)


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
    x_q = torch.full(shape, 0x7F, dtype=torch.uint8, device=kernel_device).view(FP8_DTYPE)
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
    x_q = torch.empty((5, 384), dtype=FP8_DTYPE, device=kernel_device)
    x_s = torch.full((5, 3), float("nan"), device=kernel_device)
    per_token_group_quant_fp8_triton(x, x_q, x_s, 128, 1e-4, False, block_m=tile[0],
                                     groups_per_prog=tile[1], num_warps=2)
    _check(x.cpu(), x_q.cpu(), x_s.cpu(), 128, 1e-4, False)


def test_round_in_fp32_matters_under_interpreter(kernel_device):
    """The float32 grid rounding gives the reference's bits; on CPU it is what makes them agree."""
    x = _make_x((3, 256), device=kernel_device, seed=2)
    ref_q, _ = per_token_group_quant_fp8_ref(x, 128, 1e-10, False)
    x_q = torch.empty((3, 256), dtype=FP8_DTYPE, device=kernel_device)
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
    vals = [FP8_MAX, -1e-4, -3e-7, -2.0**-10, -1e-3, 1e-4, 2.0**-10, -2.0**-126, -0.0]
    x = torch.tensor(vals + [-5e-5] * (128 - len(vals)), dtype=torch.float32,
                     device=kernel_device).repeat(3, 1)
    x_q = torch.full((3, 128), 0x7F, dtype=torch.uint8, device=kernel_device).view(FP8_DTYPE)
    x_s = torch.empty((3, 1), device=kernel_device)
    per_token_group_quant_fp8_triton(x, x_q, x_s, 128, 1e-10, False, round_in_fp32=round_in_fp32)
    got = x_q.view(torch.uint8).cpu()
    want = [0x7E, 0x80, 0x80, 0x80, 0x81, 0x00, 0x00, 0x80, 0x80]
    assert got[:, :len(vals)].tolist() == [want] * 3
    assert (got[:, len(vals):] == 0x80).all()
    ref_q, _ = per_token_group_quant_fp8_ref(x, 128, 1e-10, False)
    assert torch.equal(x_q.view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.parametrize("shape", SHAPES + [(2, 3, 256), (256,)])
@pytest.mark.parametrize("group_size", [64, 128])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_public_op_row_major(shape, group_size, use_ue8m0):
    x = _make_x(shape, seed=3)
    x_q, x_s = per_token_group_quant_fp8(x, group_size, use_ue8m0=use_ue8m0)
    assert x_q.dtype == FP8_DTYPE and x_q.shape == x.shape
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
    out_q = torch.full((9, 256), 0x7F, dtype=torch.uint8).view(FP8_DTYPE)
    x_q, x_s = per_token_group_quant_fp8(x, 128, eps=1e-3, out_q=out_q)
    assert x_q is out_q
    _check(x, x_q, x_s, 128, 1e-3, False)
    # the all-zero group gets eps / 448
    torch.testing.assert_close(x_s[-1, 0].double(),
                               torch.tensor(1e-3 / FP8_MAX, dtype=torch.float64), rtol=2e-7, atol=0)


def test_tma_flag_without_column_major_gives_row_major_scales():
    """vLLM accepts tma_aligned_scales=True with row-major scales and ignores it: so does this."""
    x = _make_x((5, 256), seed=13)
    x_q, x_s = per_token_group_quant_fp8(x, 128, tma_aligned_scales=True)
    assert x_s.shape == (5, 2) and x_s.is_contiguous()
    _check(x, x_q, x_s, 128, 1e-10, False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_division_not_reciprocal_multiply(dtype, kernel_device):
    """Codes are x / scale (IEEE), not x * (1 / scale): on this data the two differ somewhere
    (checked, so the test can fail: 16-bit inputs make exact ties common), and both the launcher
    and the public op give the division."""
    x = _make_x((64, 1024), dtype=dtype, seed=14)
    g = x.float().unflatten(-1, (8, 128))
    scale = torch.maximum(g.abs().amax(-1), torch.tensor(1e-10)) / torch.tensor(FP8_MAX)
    by_multiply = (g * (torch.ones_like(scale) / scale).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    by_division = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    multiplied = by_multiply.to(FP8_DTYPE).view(torch.uint8)
    assert (multiplied != by_division.to(FP8_DTYPE).view(torch.uint8)).any()
    want = by_division.to(FP8_DTYPE).flatten(-2).view(torch.uint8)
    x_q = torch.empty(x.shape, dtype=FP8_DTYPE, device=kernel_device)
    x_s = torch.empty((64, 8), device=kernel_device)
    per_token_group_quant_fp8_triton(x.to(kernel_device), x_q, x_s, 128, 1e-10, False)
    assert torch.equal(x_q.cpu().view(torch.uint8), want)
    assert torch.equal(per_token_group_quant_fp8(x, 128)[0].view(torch.uint8), want)


def test_ue8m0_scale_floor(kernel_device):
    """ue8m0 floors the scale at float32(1e-10) before rounding up: tiny groups get 2**-33."""
    x = torch.zeros((2, 256), device=kernel_device)
    x[1, 128:] = 1e-9  # scale 1e-9 / 448 ~ 2.2e-12, below the floor
    x_q, x_s = per_token_group_quant_fp8(x, 128, use_ue8m0=True)
    assert (x_s == 2.0**-33).all()
    _, x_s_plain = per_token_group_quant_fp8(x, 128)
    assert x_s_plain[0, 0] == torch.tensor(1e-10) / torch.tensor(FP8_MAX)


def _nan_inf_input(device):
    """Row 0: one NaN in group 0; row 1: +inf and -inf in group 0; row 2: all NaN in group 1."""
    x = _make_x((3, 256), dtype=torch.float32, seed=15)
    x[0, 5] = float("nan")
    x[1, 7], x[1, 9] = float("inf"), float("-inf")
    x[2, 128:] = float("nan")
    return x.to(device)


def _check_nan_inf(x, x_q, x_s):
    codes = x_q.cpu().view(torch.uint8)
    scales = x_s.cpu()
    x = x.cpu()
    # NaN is ignored by the max: the scale is that of the group without it.
    clean = x[0, :128].clone()
    clean[5] = 0.0
    assert scales[0, 0] == clean.abs().max() / torch.tensor(FP8_MAX)
    assert codes[0, 5] == 0xFE  # NaN -> -448
    assert codes[1, 7] == 0xFE and codes[1, 9] == 0xFE  # +-inf / inf is NaN -> -448
    assert scales[1, 0] == float("inf")
    finite = torch.ones(128, dtype=torch.bool)
    finite[[7, 9]] = False
    assert (codes[1, :128][finite] & 0x7F == 0).all()  # finite / inf = +-0
    assert scales[2, 1] == torch.tensor(1e-10) / torch.tensor(FP8_MAX)  # all NaN: eps floor
    assert (codes[2, 128:] == 0xFE).all()
    assert torch.isfinite(scales[[0, 2]]).all()
    _check(x, x_q, x_s, 128, 1e-10, False)


def test_nan_inf_public_op():
    x = _nan_inf_input("cpu")
    _check_nan_inf(x, *per_token_group_quant_fp8(x, 128))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy: inf / inf
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # numpy's nanmax
def test_nan_inf_launcher(kernel_device):
    x = _nan_inf_input(kernel_device)
    x_q = torch.empty(x.shape, dtype=FP8_DTYPE, device=kernel_device)
    x_s = torch.empty((3, 2), device=kernel_device)
    per_token_group_quant_fp8_triton(x, x_q, x_s, 128, 1e-10, False)
    _check_nan_inf(x, x_q, x_s)


@pytest.mark.gpu
@pytest.mark.parametrize("round_in_fp32", [True, False])
def test_gpu_nan_inf(round_in_fp32):
    x = _nan_inf_input("cuda")
    x_q, x_s = per_token_group_quant_fp8(x, 128)
    _check_nan_inf(x, x_q, x_s)
    q2 = torch.empty_like(x_q)
    per_token_group_quant_fp8_triton(x, q2, x_s, 128, 1e-10, False, round_in_fp32=round_in_fp32)
    _check_nan_inf(x, q2, x_s)


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


def _bad(match, **kw):
    args = dict(x=torch.randn(4, 256, dtype=torch.bfloat16))
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        per_token_group_quant_fp8(**args)


def test_errors():
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    x_dtype = "x must be a bfloat16/float16/float32 tensor, got "
    power = "group_size must be a positive power of two \\(int\\), got "
    _bad("K=200 is not a multiple of group_size=128", x=torch.randn(4, 200, dtype=torch.bfloat16))
    _bad(x_dtype + "torch.float64", x=x.to(torch.float64))
    _bad(x_dtype + "torch.int32", x=x.to(torch.int32))
    _bad(x_dtype + "torch.float8_e4m3fn", x=x.to(FP8_DTYPE))
    _bad(x_dtype + "<class 'list'>", x=[1.0, 2.0])
    _bad(r"x must have at least one dimension", x=torch.tensor(1.0, dtype=torch.bfloat16))
    _bad(r"last dimension must be contiguous \(stride 1\), got strides \(1, 4\)",
         x=torch.randn(256, 4, dtype=torch.bfloat16).t())
    _bad(power + "96", group_size=96)
    _bad(power + "0", group_size=0)
    _bad(power + "128.0", group_size=128.0)
    _bad("eps must be > 0, got 0.0", eps=0.0)
    _bad("eps must be > 0, got -1.0", eps=-1.0)
    _bad("eps must be > 0, got '1e-10'", eps="1e-10")
    _bad("dtype must be torch.float8_e4m3fn, got torch.float8_e5m2", dtype=torch.float8_e5m2)
    _bad("dtype must be torch.float8_e4m3fn, got torch.bfloat16", dtype=torch.bfloat16)
    _bad(power + "True", group_size=True)
    _bad("eps must be > 0, got True", eps=True)
    _bad(r"column_major_scales needs a 2-D x \[M, K\], got shape \(2, 4, 256\)",
         x=torch.randn(2, 4, 256, dtype=torch.bfloat16), column_major_scales=True)
    _bad("out_q must be a torch.float8_e4m3fn tensor, got torch.bfloat16",
         out_q=torch.empty(4, 256, dtype=torch.bfloat16))
    _bad(r"out_q must have x's shape \(4, 256\) on cpu, got \(4, 128\) on cpu",
         out_q=torch.empty(4, 128, dtype=FP8_DTYPE))
    _bad("out_q must be contiguous", out_q=torch.empty(256, 4, dtype=FP8_DTYPE).t())
    _bad(r"out_q must have x's shape \(4, 256\) on cpu, got \(4, 256\) on meta",
         out_q=torch.empty(4, 256, dtype=FP8_DTYPE, device="meta"))
    _bad("out_q must be a torch.float8_e4m3fn tensor, got <class 'str'>", out_q="buffer")
    _bad("out_s must be a torch.float32 tensor, got torch.bfloat16",
         out_s=torch.empty(4, 2, dtype=torch.bfloat16))
    _bad(r"out_s must have shape \(4, 2\) on cpu, got \(4, 4\) on cpu", out_s=torch.empty(4, 4))


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
    q2 = torch.full_like(x_q.view(torch.uint8), 0x7F).view(FP8_DTYPE)
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
@pytest.mark.parametrize("block_m,groups,warps", [(1, 2, 2), (1, 8, 4), (2, 4, 4), (4, 8, 4),
                                                  (8, 8, 8), (16, 4, 8)])
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


def test_quant_batched_fp8_into_given_buffers():
    x = torch.randn(3, 5, 256).bfloat16()
    want_q, want_s = quant_batched_fp8(x)
    assert want_s.shape == (3, 5, 2) and want_s.stride() == (10, 1, 5)
    q = torch.empty(3, 5, 256, dtype=FP8_DTYPE)
    s_mn = torch.full((3, 2, 5), float("nan")).transpose(1, 2)
    got_q, got_s = quant_batched_fp8(x, out_q=q, out_s=s_mn)
    assert got_q.data_ptr() == q.data_ptr() and got_s is s_mn
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got_s, want_s)


# ---------------------------------------------------------------- the cached launch path

@pytest.mark.gpu
def test_gpu_cached_launches_keep_every_specialisation():
    """Launches that Triton specialises differently (M of 1, a multiple of 16 or neither; a row
    stride not a multiple of 16; a base not 16-byte aligned; scales row- or column-major), in an
    order that would reuse a wrong kernel if the key missed one, all give the reference's bits."""
    wide = _make_x((80, 7168 + 8), device="cuda", seed=11)
    cases = [wide[:1, :7168], wide[:32, :7168], wide[:33, :7168], wide[:16, 8:7176],
             wide[1:34, 1:7169], _make_x((48, 7168), device="cuda", seed=12), wide[:1, :7168],
             wide[:1, :7168].half(), wide[:3, :7168].float(), wide[:1, 1:7169]]
    for i, x in enumerate(cases * 2):
        M = x.shape[0]
        x_q = torch.full((M, 7168), 0x7F, dtype=torch.uint8, device="cuda").view(FP8_DTYPE)
        x_s = _scales_buffer(M, 56, ("row", "col", "tma")[i % 3], "cuda")
        per_token_group_quant_fp8_triton(x, x_q, x_s, 128, 1e-10, False)
        ref_q, ref_s = per_token_group_quant_fp8_ref(x, 128, 1e-10, False)
        assert torch.equal(x_q.view(torch.uint8), ref_q.view(torch.uint8)), i
        assert torch.equal(x_s, ref_s), i


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 256])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_gpu_cached_launch_matches_triton_jit(M, use_ue8m0):
    """The public op's cached launch (its second call and later) writes the bits that
    Triton's own kernel[grid](...) writes with the same config, on fresh inputs each call."""
    for seed in range(3):
        x = _make_x((M, 7168), device="cuda", seed=20 + seed)
        got_q, got_s = per_token_group_quant_fp8(x, 128, use_ue8m0=use_ue8m0)
        want_q = torch.full((M, 7168), 0x7F, dtype=torch.uint8, device="cuda").view(FP8_DTYPE)
        want_s = torch.full((M, 56), float("nan"), device="cuda")
        block_m = fq.QUANT_SMALL_M_BLOCK_M if M < fq.QUANT_BLOCK_M else fq.QUANT_BLOCK_M
        warps = fq.QUANT_SMALL_M_NUM_WARPS if M < fq.QUANT_BLOCK_M else fq.QUANT_NUM_WARPS
        grid = (triton.cdiv(M, block_m), triton.cdiv(56, fq.QUANT_GROUPS_PER_PROG))
        fq._per_token_group_quant_fp8_kernel[grid](
            x, want_q, want_s, M, 56, x.stride(0), 56, 1, 1e-10, GROUP=128, BLOCK_M=block_m,
            GROUPS_PER_PROG=fq.QUANT_GROUPS_PER_PROG, UE8M0=use_ue8m0, ROUND_IN_FP32=False,
            num_warps=warps)
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), seed
        assert torch.equal(got_s, want_s), seed
