"""Grouped FP8 GEMMs (contiguous and masked layouts) against an independent float32 reference.

CPU: the Triton launchers under TRITON_INTERPRET=1 at small shapes, the torch references against
an unquantised bf16 matmul, and every validation error. GPU: realistic and > 2**31-element shapes.
"""

import math

import pytest
import torch

from vllm_moe_fixes.ops.grouped_gemm import (
    _DESCRIPTORS,
    _launch_args,
    _resolve_config,
    _tma_views,
    contiguous_config,
    grouped_fp8_gemm_contiguous,
    grouped_fp8_gemm_contiguous_ref,
    grouped_fp8_gemm_contiguous_triton,
    grouped_fp8_gemm_masked,
    grouped_fp8_gemm_masked_ref,
    grouped_fp8_gemm_masked_triton,
    masked_config,
)
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, FP8_MAX, SCALE_BLOCK, empty_mn_major_scales
from vllm_moe_fixes.sizes import ROW_ALIGNMENT
from vllm_moe_fixes.testing import calc_diff, quant_block_fp8


# ---------------------------------------------------------------- helpers written for the tests
def quant_rows(x):
    """Per-token 1x128 quantisation as DeepGEMM's tests do it: x [..., K] -> (fp8, [..., K/128])."""
    g = x.float().unflatten(-1, (-1, SCALE_BLOCK))
    amax = g.abs().amax(-1).clamp(min=1e-4)
    q = (g * (FP8_MAX / amax)[..., None]).to(FP8_DTYPE).flatten(-2)
    return q, amax / FP8_MAX


def mn_major(s):
    """Copy scales [..., M, G] into the MN-major layout with the M stride padded to 4; the
    padding rows hold NaN (0xFF bytes), so a kernel that reads them fails the comparison."""
    view = empty_mn_major_scales(s.shape, s.device)
    view.untyped_storage().fill_(0xFF)
    view.copy_(s)
    return view


def expected_rows(a_q, a_s, w_q, w_s):
    """float32 sum over K blocks of (A_blk @ W_blk^T) * a_s * w_s: one expert, rows [R, K]."""
    R, K = a_q.shape
    N = w_q.shape[0]
    y = torch.zeros(R, N, device=a_q.device)
    for kb in range(K // SCALE_BLOCK):
        ks = slice(kb * SCALE_BLOCK, (kb + 1) * SCALE_BLOCK)
        part = a_q[:, ks].float() @ w_q[:, ks].float().t()
        w_scale = w_s[:, kb].float().repeat_interleave(SCALE_BLOCK)
        y += part * a_s[:, kb, None].float() * w_scale[None, :]
    return y


def contiguous_layout(segments, pad_last=True, extra_pad_blocks=0):
    """int32 m_indices: expert e's rows start at a multiple of ROW_ALIGNMENT (128), padding -1."""
    ids = []
    for e, n in enumerate(segments):
        span = -(-n // ROW_ALIGNMENT) * ROW_ALIGNMENT if (pad_last or e < len(segments) - 1) else n
        ids += [e] * n + [-1] * (span - n)
    ids += [-1] * (ROW_ALIGNMENT * extra_pad_blocks)
    return torch.tensor(ids, dtype=torch.int32)


def make_problem(E, N, K, rows_shape, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(*rows_shape, K, generator=g).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, generator=g) / math.sqrt(K)).to(device=device, dtype=torch.bfloat16)
    return x, w, quant_rows(x), quant_block_fp8(w)


def check_contiguous(out, a_q, a_s, w_q, w_s, m_idx, tol):
    m_idx = m_idx.to(out.device)
    pad = m_idx < 0
    assert torch.equal(out[pad], torch.zeros_like(out[pad])), "padding rows must be exact zeros"
    for e in range(w_q.shape[0]):
        rows = (m_idx == e).nonzero().flatten()
        if rows.numel() == 0:
            continue
        y = expected_rows(a_q[rows], a_s[rows], w_q[e], w_s[e])
        got = out[rows].float()
        assert not got.isnan().any()
        assert calc_diff(got, y) < tol
        torch.testing.assert_close(got, y, rtol=1e-2, atol=1e-2 * y.abs().max().item())


# ---------------------------------------------------------------- references vs bf16 matmul
def test_contiguous_reference_matches_bf16_matmul():
    segments = [5, 130, 0, 64]
    m_idx = contiguous_layout(segments)
    x, w, (a_q, a_s), (w_q, w_s) = make_problem(4, 256, 512, (m_idx.numel(),), "cpu", 1)
    out = torch.full((m_idx.numel(), 256), float("nan"), dtype=torch.bfloat16)
    grouped_fp8_gemm_contiguous_ref((a_q, a_s), (w_q, w_s), out, m_idx)
    assert torch.equal(out[m_idx < 0], torch.zeros_like(out[m_idx < 0]))
    for e in range(4):
        rows = m_idx == e
        if rows.any():
            exact = x[rows].float() @ w[e].float().t()
            assert calc_diff(out[rows], exact) < 1e-3


def test_masked_reference_matches_bf16_matmul():
    masked_m = torch.tensor([0, 1, 40, 48], dtype=torch.int32)
    x, w, (a_q, a_s), (w_q, w_s) = make_problem(4, 256, 512, (4, 48), "cpu", 2)
    out = torch.full((4, 48, 256), float("nan"), dtype=torch.bfloat16)
    grouped_fp8_gemm_masked_ref((a_q, a_s), (w_q, w_s), out, masked_m)
    for e, m in enumerate(masked_m.tolist()):
        assert out[e, m:].isnan().all()
        if m:
            assert calc_diff(out[e, :m], x[e, :m].float() @ w[e].float().t()) < 1e-3


# ---------------------------------------------------------------- Triton kernels
# Under the interpreter (CPU) float32 -> bf16 casts truncate instead of rounding to nearest (a
# triton 3.9 defect, like its float32 -> float8 cast, see ops/fp8_quant.py): up to one bf16 ulp,
# calc_diff ~7e-6. The GPU rounds correctly (~1e-6).
CONFIGS = [None, dict(BLOCK_M=64, BLOCK_N=256, GROUP_M=2, num_warps=4, num_stages=2)]


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "m64n256"])
@pytest.mark.parametrize("layout", ["row_major", "mn_major"])
@pytest.mark.parametrize(
    "segments,pad_last,extra",
    [([1, 130, 0], True, 1), ([127, 128, 0, 1], False, 0), ([0, 0], True, 2)],
    ids=["1-130-0+pad", "127-128-0-1-unpadded", "all-padding"],
)
def test_contiguous_triton(kernel_device, config, layout, segments, pad_last, extra):
    m_idx = contiguous_layout(segments, pad_last, extra).to(kernel_device)
    M, E, N, K = m_idx.numel(), len(segments), 256, 256
    _, _, (a_q, a_s), (w_q, w_s) = make_problem(E, N, K, (M,), kernel_device, 3 + M)
    if layout == "mn_major":
        a_s = mn_major(a_s)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=kernel_device)
    res = grouped_fp8_gemm_contiguous_triton((a_q, a_s), (w_q, w_s), out, m_idx, config)
    assert res is out
    check_contiguous(out, a_q, a_s, w_q, w_s, m_idx, 1e-5)


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "m64n256"])
@pytest.mark.parametrize("layout", ["row_major", "mn_major"])
def test_masked_triton(kernel_device, config, layout):
    E, T, N, K = 4, 132, 256, 256
    masked_m = torch.tensor([0, 1, 130, T], dtype=torch.int32, device=kernel_device)
    _, _, (a_q, a_s), (w_q, w_s) = make_problem(E, N, K, (E, T), kernel_device, 7)
    if layout == "mn_major":
        a_s = mn_major(a_s)  # strides (K/128 * T, 1, T): DeepEP's low-latency layout
        assert a_s.stride() == (K // SCALE_BLOCK * T, 1, T)
    out = torch.full((E, T, N), float("nan"), dtype=torch.bfloat16, device=kernel_device)
    res = grouped_fp8_gemm_masked_triton((a_q, a_s), (w_q, w_s), out, masked_m, 64, config)
    assert res is out
    check_masked(out, a_q, a_s, w_q, w_s, masked_m, 1e-5)


# contiguous_config: without a GROUP_M from the caller, a swizzle group is about one expert's M
# tiles (a power of two, 4 to 32); only the tile order changes, so the output bits do not.
@pytest.mark.parametrize("rows,experts,group_m", [(4 * 8192, 4, 32), (8 * 1024, 8, 16),
                                                  (8 * 768, 8, 8), (32 * 256, 32, 4),
                                                  (128, 8, 4), (0, 4, 4)])
def test_contiguous_config_groups_one_experts_tiles(rows, experts, group_m):
    assert contiguous_config(rows, experts)["GROUP_M"] == group_m
    assert contiguous_config(rows, experts, dict(GROUP_M=2))["GROUP_M"] == 2
    assert contiguous_config(rows, experts, dict(BLOCK_M=128))["BLOCK_M"] == 128


# Deep K (GEMM1 at hidden 7168) promotes every 64 of K unless the caller names IMPRECISE_ACC.
@pytest.mark.parametrize("K,promoted", [(7168, 64), (4096, 64), (4095, 0), (2048, 0), (0, 0)])
def test_deep_k_promotes_unless_named(K, promoted):
    assert contiguous_config(1024, 8, K=K)["IMPRECISE_ACC"] == promoted
    assert masked_config(K)["IMPRECISE_ACC"] == promoted
    for named in (0, 32):
        assert contiguous_config(1024, 8, dict(IMPRECISE_ACC=named), K)["IMPRECISE_ACC"] == named
        assert masked_config(K, dict(IMPRECISE_ACC=named))["IMPRECISE_ACC"] == named


@pytest.mark.gpu
def test_deep_k_launch_runs_the_promoted_config_gpu():
    """The launchers run the promotion of their K: with no config, the bits of IMPRECISE_ACC 64,
    not of Triton's default (0), at K 7168 on SM90 (elsewhere both accumulate in float32)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the promotion changes bits only on SM90's FP8 tensor cores")
    segments, N, K = [1024, 513, 0, 700], 1024, 7168
    m_idx = contiguous_layout(segments).cuda()
    M = m_idx.numel()
    _, _, (a_q, a_s), (w_q, w_s) = make_problem(len(segments), N, K, (M,), "cuda", 31)
    a_s = mn_major(a_s)
    outs = {}
    for name, config in (("none", None), ("64", dict(IMPRECISE_ACC=64)),
                         ("0", dict(IMPRECISE_ACC=0))):
        outs[name] = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
        grouped_fp8_gemm_contiguous_triton((a_q, a_s), (w_q, w_s), outs[name], m_idx, config)
    assert torch.equal(outs["none"], outs["64"])
    assert not torch.equal(outs["none"], outs["0"])
    check_contiguous(outs["none"], a_q, a_s, w_q, w_s, m_idx, 1e-5)


def test_contiguous_group_m_keeps_the_bits(kernel_device):
    m_idx = contiguous_layout([130, 0, 5, 256, 64, 128]).to(kernel_device)
    M, E, N, K = m_idx.numel(), 6, 256, 256
    _, _, (a_q, a_s), (w_q, w_s) = make_problem(E, N, K, (M,), kernel_device, 70)
    outs = []
    for cfg in (None, dict(GROUP_M=1), dict(GROUP_M=32)):
        out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=kernel_device)
        grouped_fp8_gemm_contiguous_triton((a_q, a_s), (w_q, w_s), out, m_idx, cfg)
        check_contiguous(out, a_q, a_s, w_q, w_s, m_idx, 1e-5)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


# Inputs that a TMA descriptor cannot describe: the launchers fall back to pointer loads.
def _misaligned(t, offset):
    """Copy of t in a fresh buffer at `offset` elements past a 16-byte boundary."""
    buf = torch.empty(t.numel() + 16, dtype=t.dtype, device=t.device)
    view = buf[offset:offset + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def _padded_rows(t, pad):
    """Copy of t [..., R, K] whose rows are `pad` elements apart beyond K (row stride K + pad)."""
    buf = torch.empty(*t.shape[:-1], t.shape[-1] + pad, dtype=t.dtype, device=t.device)
    view = buf[..., :t.shape[-1]]
    view.copy_(t)
    return view


def check_masked(out, a_q, a_s, w_q, w_s, masked_m, tol):
    for e, m in enumerate(masked_m.tolist()):
        assert out[e, m:].isnan().all(), "rows past masked_m must stay untouched"
        if m:
            y = expected_rows(a_q[e, :m], a_s[e, :m], w_q[e], w_s[e])
            assert calc_diff(out[e, :m].float(), y) < tol
            torch.testing.assert_close(out[e, :m].float(), y, rtol=1e-2,
                                       atol=1e-2 * y.abs().max().item())


def test_tma_views_cover_regular_inputs():
    a_q = torch.empty(3, 5, 256, dtype=FP8_DTYPE)
    w_q = torch.empty(3, 128, 256, dtype=FP8_DTYPE)
    rows, w_rows = _tma_views(a_q, w_q)
    assert rows.shape == (15, 256) and rows.data_ptr() == a_q.data_ptr()
    assert w_rows.shape == (384, 256)
    assert _tma_views(a_q[:, 1:], w_q) is None          # experts not at a uniform row stride
    assert _tma_views(a_q[:1, 1:], w_q) is not None     # one expert: no stride between experts
    assert _tma_views(a_q[0, 1:], w_q) is not None      # offset of 256 bytes: aligned
    assert _tma_views(_misaligned(a_q[0], 1), w_q) is None
    assert _tma_views(_padded_rows(a_q[0], 8), w_q) is None
    assert _tma_views(_padded_rows(a_q[0], 16), w_q) is not None
    assert _tma_views(a_q[0], _misaligned(w_q, 8)) is None
    assert _tma_views(a_q[0], w_q[:0]) is None          # E == 0


def test_descriptor_cache_follows_the_operands():
    cfg = _resolve_config(None)
    a_q = torch.empty(256, 256, dtype=FP8_DTYPE)
    w_q = torch.empty(2, 128, 256, dtype=FP8_DTYPE)
    descs, kwargs = _launch_args(cfg, a_q, w_q)
    assert kwargs["TMA"] and descs[0].base.data_ptr() == a_q.data_ptr()
    assert tuple(descs[1].shape) == (256, 256) and list(descs[1].block_shape) == [128, 128]
    assert _launch_args(cfg, a_q, w_q)[0] is descs  # same operands: the cached pair
    # The same object pointed at other memory (or given another shape) gets new descriptors.
    other = torch.empty(256, 256, dtype=FP8_DTYPE)
    a_q.set_(other.untyped_storage(), 0, (256, 256), (256, 1))
    moved = _launch_args(cfg, a_q, w_q)[0]
    assert moved is not descs and moved[0].base.data_ptr() == other.data_ptr()
    a_q.set_(other.untyped_storage(), 0, (128, 256), (256, 1))
    assert tuple(_launch_args(cfg, a_q, w_q)[0][0].shape) == (128, 256)
    # An entry does not keep its operands alive and leaves with them.
    before = len(_DESCRIPTORS)
    tmp = torch.empty(128, 256, dtype=FP8_DTYPE)
    _launch_args(cfg, tmp, w_q)
    assert len(_DESCRIPTORS) == before + 1
    del tmp
    assert len(_DESCRIPTORS) == before
    misaligned = _misaligned(a_q, 1)
    assert _launch_args(cfg, misaligned, w_q) == ([None, None], dict(cfg, BLOCK_K=SCALE_BLOCK,
                                                                      TMA=False))


@pytest.mark.parametrize("case", ["misaligned", "row_stride"])
def test_pointer_fallback_contiguous(kernel_device, case):
    m_idx = contiguous_layout([1, 130, 0, 64], extra_pad_blocks=1).to(kernel_device)
    M, E, N, K = m_idx.numel(), 4, 256, 384
    _, _, (a_q, a_s), (w_q, w_s) = make_problem(E, N, K, (M,), kernel_device, 40)
    if case == "misaligned":
        a_q, w_q = _misaligned(a_q, 1), _misaligned(w_q, 8)
    else:
        a_q = _padded_rows(a_q, 8)
    assert _tma_views(a_q, w_q) is None
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=kernel_device)
    grouped_fp8_gemm_contiguous_triton((a_q, a_s), (w_q, w_s), out, m_idx)
    check_contiguous(out, a_q, a_s, w_q, w_s, m_idx, 1e-5)


def test_pointer_fallback_masked(kernel_device):
    E, T, N, K = 4, 96, 256, 384
    masked_m = torch.tensor([0, 1, 70, 96], dtype=torch.int32, device=kernel_device)
    _, _, (a_q, a_s), (w_q, w_s) = make_problem(E, N, K, (E, T + 5), kernel_device, 41)
    a_q, a_s = a_q[:, :T], mn_major(a_s[:, :T])  # experts T + 5 rows apart
    assert _tma_views(a_q, w_q) is None
    out = torch.full((E, T, N), float("nan"), dtype=torch.bfloat16, device=kernel_device)
    grouped_fp8_gemm_masked_triton((a_q, a_s), (w_q, w_s), out, masked_m, None)
    check_masked(out, a_q, a_s, w_q, w_s, masked_m, 1e-5)


def test_contiguous_no_experts(kernel_device):
    m_idx = contiguous_layout([], extra_pad_blocks=1).to(kernel_device)
    a_q = torch.ones(128, 128, device=kernel_device).to(FP8_DTYPE)
    a_s = torch.ones(128, 1, device=kernel_device)
    w = (torch.empty(0, 128, 128, device=kernel_device, dtype=FP8_DTYPE),
         torch.empty(0, 1, 1, device=kernel_device))
    out = torch.full((128, 128), float("nan"), dtype=torch.bfloat16, device=kernel_device)
    grouped_fp8_gemm_contiguous_triton((a_q, a_s), w, out, m_idx)
    assert torch.equal(out, torch.zeros_like(out))


def test_public_api_on_cpu_uses_reference():
    m_idx = contiguous_layout([3, 129])
    _, _, (a_q, a_s), (w_q, w_s) = make_problem(2, 128, 256, (m_idx.numel(),), "cpu", 11)
    out = torch.full((m_idx.numel(), 128), float("nan"), dtype=torch.bfloat16)
    assert grouped_fp8_gemm_contiguous((a_q, a_s), (w_q, w_s), out, m_idx) is out
    check_contiguous(out, a_q, a_s, w_q, w_s, m_idx, 1e-5)

    masked_m = torch.tensor([5, 0], dtype=torch.int32)
    _, _, (b_q, b_s), _ = make_problem(2, 128, 256, (2, 8), "cpu", 12)
    out = torch.full((2, 8, 128), float("nan"), dtype=torch.bfloat16)
    assert grouped_fp8_gemm_masked((b_q, b_s), (w_q, w_s), out, masked_m, expected_m=4) is out
    assert out[0, 5:].isnan().all() and out[1].isnan().all()
    y = expected_rows(b_q[0, :5], b_s[0, :5], w_q[0], w_s[0])
    assert calc_diff(out[0, :5], y) < 1e-5


# ---------------------------------------------------------------- validation
def _contiguous_args():
    M, E, N, K = 128, 2, 128, 256
    return dict(
        a=(torch.zeros(M, K, dtype=FP8_DTYPE), torch.ones(M, K // SCALE_BLOCK)),
        w=(torch.zeros(E, N, K, dtype=FP8_DTYPE),
           torch.ones(E, N // SCALE_BLOCK, K // SCALE_BLOCK)),
        out=torch.empty(M, N, dtype=torch.bfloat16),
        m_indices=torch.zeros(M, dtype=torch.int32),
    )


def _masked_args():
    E, T, N, K = 2, 8, 128, 256
    return dict(
        a=(torch.zeros(E, T, K, dtype=FP8_DTYPE), torch.ones(E, T, K // SCALE_BLOCK)),
        w=(torch.zeros(E, N, K, dtype=FP8_DTYPE),
           torch.ones(E, N // SCALE_BLOCK, K // SCALE_BLOCK)),
        out=torch.empty(E, T, N, dtype=torch.bfloat16),
        masked_m=torch.zeros(E, dtype=torch.int32),
    )


def _with(args, key, index=None, value=None):
    if index is None:
        args[key] = value
    else:
        pair = list(args[key])
        pair[index] = value
        args[key] = tuple(pair)
    return args


COMMON_BAD = [
    ("a", "not-a-pair", None, "a:"),
    ("a", 0, lambda t: t.to(torch.bfloat16), "a\\[0\\]"),
    ("a", 0, lambda t: torch.zeros(*t.shape[:-1], 192, dtype=FP8_DTYPE), "a\\[0\\]"),
    ("a", 0, lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2), "a\\[0\\]"),
    ("a", 1, lambda t: t.double(), "a\\[1\\]"),
    ("a", 1, lambda t: t[..., :1], "a\\[1\\]"),
    ("w", 0, lambda t: t.to(torch.bfloat16), "w\\[0\\]"),
    ("w", 0, lambda t: t[:, :, :128].contiguous(), "w\\[0\\]"),
    ("w", 0, lambda t: torch.zeros(t.shape[0], 192, t.shape[2], dtype=FP8_DTYPE), "w\\[0\\]"),
    ("w", 0, lambda t: t.transpose(0, 1).contiguous().transpose(0, 1), "w\\[0\\]"),
    ("w", 1, lambda t: t[:, :, :1], "w\\[1\\]"),
    ("w", 1, lambda t: t.half(), "w\\[1\\]"),
    ("out", None, lambda t: t.float(), "out"),
    ("out", None, lambda t: t[..., :-1], "out"),
    ("out", None, lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2), "out"),
]


def _apply(args, key, index, fn):
    if fn is None:  # replace the whole argument by a bad value
        return _with(args, key, None, index)
    if index is None:
        return _with(args, key, None, fn(args[key]))
    return _with(args, key, index, fn(args[key][index]))


@pytest.mark.parametrize("key,index,fn,match", COMMON_BAD)
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_common_validation(layout, key, index, fn, match):
    if layout == "contiguous":
        args, op = _contiguous_args(), grouped_fp8_gemm_contiguous
    else:
        args, op = _masked_args(), grouped_fp8_gemm_masked
    with pytest.raises(ValueError, match=match):
        op(**_apply(args, key, index, fn))


@pytest.mark.parametrize("value,match", [
    (torch.zeros(128, dtype=torch.int64), "m_indices"),
    (torch.zeros(127, dtype=torch.int32), "m_indices"),
    (torch.zeros(128, 1, dtype=torch.int32), "m_indices"),
    (torch.zeros(256, dtype=torch.int32)[::2], "m_indices"),
    ([0] * 128, "m_indices"),
])
def test_contiguous_validation(value, match):
    with pytest.raises(ValueError, match=match):
        grouped_fp8_gemm_contiguous(**_with(_contiguous_args(), "m_indices", None, value))


def test_contiguous_validation_config_and_device():
    with pytest.raises(ValueError, match="config"):
        grouped_fp8_gemm_contiguous(**_contiguous_args(), config=dict(BLOCK_M=256))
    with pytest.raises(ValueError, match="config"):
        grouped_fp8_gemm_contiguous(**_contiguous_args(), config=dict(BLOCK_Q=1))
    with pytest.raises(ValueError, match="config"):
        grouped_fp8_gemm_masked(**_masked_args(), config=dict(BLOCK_N=192))
    with pytest.raises(ValueError, match="BLOCK_N"):
        grouped_fp8_gemm_masked(**_masked_args(), config=dict(BLOCK_N=384))
    with pytest.raises(ValueError, match="IMPRECISE_ACC"):
        grouped_fp8_gemm_contiguous(**_contiguous_args(), config=dict(IMPRECISE_ACC=16))
    args = _contiguous_args()
    args["m_indices"] = args["m_indices"].to("meta")
    with pytest.raises(ValueError, match="device"):
        grouped_fp8_gemm_contiguous(**args)


@pytest.mark.parametrize("kwargs,match", [
    (dict(masked_m=torch.zeros(2, dtype=torch.int64)), "masked_m"),
    (dict(masked_m=torch.zeros(3, dtype=torch.int32)), "masked_m"),
    (dict(masked_m=None), "masked_m"),
    (dict(expected_m=-1), "expected_m"),
    (dict(expected_m=2.5), "expected_m"),
    (dict(w=(torch.zeros(3, 128, 256, dtype=FP8_DTYPE), torch.ones(3, 1, 2))), "experts"),
    (dict(a=(torch.zeros(8, 256, dtype=FP8_DTYPE), torch.ones(8, 2))), "a\\[0\\]"),
])
def test_masked_validation(kwargs, match):
    args = _masked_args()
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        grouped_fp8_gemm_masked(**args)


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("segments,N,K", [
    ([300, 257, 0, 311], 512, 1024),
    ([1024, 700, 1, 1100, 128, 0, 900, 513], 4096, 7168),  # DeepSeek-V3 GEMM1-like
    ([1024, 700, 1, 1100, 128, 0, 900, 513], 7168, 2048),  # DeepSeek-V3 GEMM2-like
])
@pytest.mark.parametrize("layout", ["row_major", "mn_major"])
def test_contiguous_gpu(segments, N, K, layout):
    m_idx = contiguous_layout(segments, extra_pad_blocks=1).cuda()
    M = m_idx.numel()
    _, _, (a_q, a_s), (w_q, w_s) = make_problem(len(segments), N, K, (M,), "cuda", 21)
    if layout == "mn_major":
        a_s = mn_major(a_s)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_fp8_gemm_contiguous((a_q, a_s), (w_q, w_s), out, m_idx)
    ref = torch.full_like(out, float("nan"))
    grouped_fp8_gemm_contiguous_ref((a_q, a_s), (w_q, w_s), ref, m_idx)
    assert torch.equal(out[m_idx < 0], torch.zeros_like(out[m_idx < 0]))
    assert calc_diff(out[m_idx >= 0], ref[m_idx >= 0]) < 1e-5
    check_contiguous(out, a_q, a_s, w_q, w_s, m_idx, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, dict(BLOCK_M=128, BLOCK_N=128, num_warps=8,
                                                num_stages=4, GROUP_M=8),
                                    dict(IMPRECISE_ACC=32), dict(IMPRECISE_ACC=64)],
                         ids=["default", "m128", "acc32", "acc64"])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer-fallback"])
def test_tma_and_fallback_gpu(config, tma):
    segments, N, K = [1024, 700, 1, 0, 513], 4096, 7168 - 128
    m_idx = contiguous_layout(segments, extra_pad_blocks=1).cuda()
    M = m_idx.numel()
    _, _, (a_q, a_s), (w_q, w_s) = make_problem(len(segments), N, K, (M,), "cuda", 23)
    a_s = mn_major(a_s)
    if not tma:
        a_q, w_q = _misaligned(a_q, 1), _misaligned(w_q, 8)
    assert (_tma_views(a_q, w_q) is not None) == tma
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_fp8_gemm_contiguous((a_q, a_s), (w_q, w_s), out, m_idx, config)
    check_contiguous(out, a_q, a_s, w_q, w_s, m_idx, 1e-5)

    masked_m = torch.tensor([0, 1, 300, 511, 512], dtype=torch.int32, device="cuda")
    T = 512 if tma else 500  # the fallback: experts 512 rows apart, 500 used
    a_q = a_q[:5 * 512].view(5, 512, K)[:, :T]
    a_s = mn_major(a_s[:5 * 512].reshape(5, 512, -1)[:, :T])
    masked_m.clamp_(max=T)
    assert (_tma_views(a_q, w_q) is not None) == tma
    out = torch.full((5, T, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_fp8_gemm_masked((a_q, a_s), (w_q, w_s), out, masked_m, None, config)
    check_masked(out, a_q, a_s, w_q, w_s, masked_m, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("expected_m", [None, 16, 256])
def test_masked_gpu(expected_m):
    E, T, N, K = 8, 256, 4096, 7168
    masked_m = torch.tensor([0, 1, 17, 64, 100, 200, 255, 256], dtype=torch.int32, device="cuda")
    _, _, (a_q, a_s), (w_q, w_s) = make_problem(E, N, K, (E, T), "cuda", 22)
    a_s = mn_major(a_s)
    out = torch.full((E, T, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_fp8_gemm_masked((a_q, a_s), (w_q, w_s), out, masked_m, expected_m)
    check_masked(out, a_q, a_s, w_q, w_s, masked_m, 1e-5)


def _big_fp8(shape, seed):
    """Random FP8 values spread over e4m3fn's range. A plain cast does not saturate: magnitudes
    past 448 become NaN, so clamp first."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16) * 100
    return x.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


@pytest.mark.gpu
def test_contiguous_gpu_past_2_31_elements():
    K, N = 7168, 128
    segments = [299_000, 700, 200]  # M_sum = 300032 rows: M_sum * K > 2**31
    m_idx = contiguous_layout(segments).cuda()
    M = m_idx.numel()
    assert M * K > 2**31
    a_q = _big_fp8((M, K), 31)
    a_s = mn_major(torch.rand(M, K // SCALE_BLOCK, device="cuda") * 1e-3 + 1e-4)
    w_q = _big_fp8((3, N, K), 32)
    w_s = torch.rand(3, N // SCALE_BLOCK, K // SCALE_BLOCK, device="cuda") * 1e-3 + 1e-4
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_fp8_gemm_contiguous((a_q, a_s), (w_q, w_s), out, m_idx)
    for rows in ((m_idx == 2).nonzero().flatten(), torch.arange(256, device="cuda")):
        e = int(m_idx[rows[0]])
        y = expected_rows(a_q[rows], a_s[rows], w_q[e], w_s[e])
        assert calc_diff(out[rows], y) < 1e-5
    assert torch.equal(out[m_idx < 0], torch.zeros_like(out[m_idx < 0]))


@pytest.mark.gpu
def test_masked_gpu_past_2_31_elements():
    E, T, K, N = 2, 150_016, 7168, 128
    assert E * T * K > 2**31
    a_q = _big_fp8((E, T, K), 33)
    a_s = mn_major(torch.rand(E, T, K // SCALE_BLOCK, device="cuda") * 1e-3 + 1e-4)
    w_q = _big_fp8((E, N, K), 34)
    w_s = torch.rand(E, N // SCALE_BLOCK, K // SCALE_BLOCK, device="cuda") * 1e-3 + 1e-4
    masked_m = torch.tensor([T, T - 3], dtype=torch.int32, device="cuda")
    out = torch.full((E, T, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_fp8_gemm_masked((a_q, a_s), (w_q, w_s), out, masked_m)
    rows = slice(T - 500, T - 3)
    y = expected_rows(a_q[1, rows], a_s[1, rows], w_q[1], w_s[1])
    assert calc_diff(out[1, rows], y) < 1e-5
    assert out[1, T - 3:].isnan().all()
