"""The Gluon (sm_90) contiguous grouped FP8 GEMM: availability, config checks and dispatch on CPU,
an offline sm_90 compile where this Triton can compile without a GPU, and results against the
torch reference on an H200 (gpu marker; skipped elsewhere)."""

import pytest
import torch

from vllm_moe_fixes.ops import grouped_gemm, grouped_gemm_gluon
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, SCALE_BLOCK, empty_mn_major_scales
from vllm_moe_fixes.ops.grouped_gemm import (
    contiguous_config, grouped_fp8_gemm_contiguous_ref, grouped_fp8_gemm_contiguous_triton)
from vllm_moe_fixes.sizes import ROW_ALIGNMENT
from vllm_moe_fixes.testing import calc_diff

GLUON_GPU = grouped_gemm_gluon.gluon_available() if torch.cuda.is_available() else False


def problem(segments, N, K, device, seed=0):
    """Random FP8 operands, MN-major activation scales, m_indices with each expert's rows padded
    to ROW_ALIGNMENT by -1 rows except the last expert's (so M need not be a tile multiple)."""
    ids = []
    for e, n in enumerate(segments):
        span = n if e == len(segments) - 1 else -(-n // ROW_ALIGNMENT) * ROW_ALIGNMENT
        ids += [e] * n + [-1] * (span - n)
    m_idx = torch.tensor(ids, dtype=torch.int32, device=device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    M, E = len(ids), len(segments)
    a_q = torch.randn(M, K, generator=g).to(FP8_DTYPE).to(device)
    a_s = empty_mn_major_scales((M, K // SCALE_BLOCK), device)
    a_s.copy_(torch.rand(M, K // SCALE_BLOCK, generator=g) * 0.01 + 0.001)
    w_q = (torch.randn(E, N, K, generator=g) * 0.5).to(FP8_DTYPE).to(device)
    w_s = (torch.rand(E, N // SCALE_BLOCK, K // SCALE_BLOCK, generator=g) * 0.01 + 0.001)
    return (a_q, a_s), (w_q, w_s.to(device)), m_idx


def resolved(M, E, K, **tile):
    return contiguous_config(M, E, dict(grouped_gemm_gluon.GLUON_CONFIG, **tile), K)


# ---------------------------------------------------------------- CPU
def test_unavailable_without_sm90_gpu():
    assert grouped_gemm_gluon.gluon_available("cpu") is False
    if not torch.cuda.is_available():
        assert grouped_gemm_gluon.gluon_available() is False


def test_enabled_never_takes_cpu_tensors(monkeypatch):
    monkeypatch.setattr(grouped_gemm_gluon, "ENABLED", True)
    a, w, m_idx = problem([3, 1], 128, 256, "cpu")
    assert grouped_gemm_gluon.use_gluon(a[0], w[0]) is False
    out = torch.full((m_idx.numel(), 128), float("nan"), dtype=torch.bfloat16)
    grouped_gemm.grouped_fp8_gemm_contiguous(a, w, out, m_idx)
    ref = grouped_fp8_gemm_contiguous_ref(a, w, torch.empty_like(out), m_idx)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("change, match", [
    (dict(BLOCK_M=32), "BLOCK_M and BLOCK_N 64 or 128, got 32x128"),
    (dict(BLOCK_N=256), "BLOCK_M and BLOCK_N 64 or 128, got 128x256"),
    (dict(num_warps=2), "num_warps 4 or 8, got 2"),
    (dict(num_stages=1), "num_stages must be >= 2, got 1"),
])
def test_check_config_rejects(change, match):
    with pytest.raises(ValueError, match=match):
        grouped_gemm_gluon.check_config(resolved(1024, 8, 7168, **change))


def test_check_config_accepts_the_default():
    cfg = resolved(1024, 8, 7168)
    assert grouped_gemm_gluon.check_config(cfg) is cfg


def _offline_compile(cfg, N=256, K=512):
    """Compile the kernel for sm_90a without a GPU, through Triton's own argument binder (skips
    where this Triton's internals differ)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime import jit
    gluon_runtime = pytest.importorskip("triton.experimental.gluon._runtime")
    kernel = grouped_gemm_gluon._kernel()
    if not hasattr(jit, "create_function_from_signature") or not hasattr(kernel, "_pack_args"):
        pytest.skip("this Triton has no create_function_from_signature / _pack_args")
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    (a_q, a_s), (w_q, w_s), m_idx = problem([256, 1], N, K, "cpu")
    M = m_idx.numel()
    out = torch.empty(M, N, dtype=torch.bfloat16)
    bk = cfg["IMPRECISE_ACC"] or SCALE_BLOCK
    a_layout, w_layout, mma = grouped_gemm_gluon._layouts(cfg["BLOCK_M"], cfg["BLOCK_N"], bk,
                                                          cfg["num_warps"])
    descs = grouped_gemm_gluon._descriptors(a_q, w_q, cfg["BLOCK_M"], cfg["BLOCK_N"], bk,
                                            a_layout, w_layout)
    args = (*descs, a_s, w_s, out, m_idx, M, N, K, *a_s.stride(), *w_s.stride(), out.stride(0))
    kwargs = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk,
                  GROUP_M=cfg["GROUP_M"], STAGES=cfg["num_stages"], MMA=mma,
                  WARP_SPECIALIZE=cfg["WARP_SPECIALIZE"], num_warps=cfg["num_warps"])
    binder = jit.create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                              specialization, options)
    src = gluon_runtime.GluonASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


@pytest.mark.parametrize("tile", [dict(), dict(BLOCK_M=64, num_warps=4, IMPRECISE_ACC=64),
                                  dict(WARP_SPECIALIZE=True)])
def test_compiles_for_sm90_offline(tile):
    ptx = _offline_compile(resolved(257, 2, 512, **tile)).asm["ptx"]
    # The K loop is asynchronous wgmma fed by TMA through mbarriers.
    for instruction in ("wgmma.mma_async", "wgmma.wait_group", "cp.async.bulk.tensor",
                        "mbarrier.try_wait"):
        assert instruction in ptx


# ---------------------------------------------------------------- H200
needs_gluon = pytest.mark.skipif(not GLUON_GPU, reason="needs an sm_90 GPU and Hopper Gluon")


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("segments, N, K, tile", [
    ([1], 128, 128, dict()),                                   # one row, one K block
    ([130, 0, 257, 64, 3], 384, 512, dict()),                  # 5 experts, one empty, M % 128
    ([200, 77, 5], 256, 1024, dict(BLOCK_M=64, num_warps=4)),  # 3 experts, 64-row tiles
    ([129, 1], 128, 4096, dict(IMPRECISE_ACC=64, num_stages=3)),  # promotion every 64 of K
    ([130, 0, 257, 64, 3], 384, 512, dict(WARP_SPECIALIZE=True)),  # producer warp, padding tiles
    ([1], 128, 1024, dict(WARP_SPECIALIZE=True, num_stages=2)),     # ring wraps 4 times
])
def test_matches_reference(segments, N, K, tile):
    a, w, m_idx = problem(segments, N, K, "cuda", seed=len(segments))
    M = m_idx.numel()
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped_gemm_gluon.grouped_fp8_gemm_contiguous_gluon(
        a, w, out, m_idx, resolved(M, len(segments), K, **tile))
    ref = grouped_fp8_gemm_contiguous_ref(a, w, torch.empty_like(out), m_idx)
    pad = m_idx < 0
    assert torch.equal(out[pad], torch.zeros_like(out[pad])), "padding rows must be exact zeros"
    assert not out.isnan().any()
    assert calc_diff(out[~pad], ref[~pad]) < 1e-5


@pytest.mark.gpu
@needs_gluon
def test_empty_rows_leave_out_alone():
    a, w, _ = problem([1], 128, 256, "cuda")
    a = (a[0][:0], a[1][:0])
    out = torch.empty(0, 128, device="cuda", dtype=torch.bfloat16)
    m_idx = torch.empty(0, device="cuda", dtype=torch.int32)
    assert grouped_gemm_gluon.grouped_fp8_gemm_contiguous_gluon(
        a, w, out, m_idx, resolved(0, 1, 256)) is out


@pytest.mark.gpu
@needs_gluon
def test_enabled_dispatch_runs_gluon_and_matches_triton(monkeypatch):
    monkeypatch.setattr(grouped_gemm_gluon, "ENABLED", True)
    a, w, m_idx = problem([300, 2], 256, 512, "cuda", seed=3)
    out = torch.full((m_idx.numel(), 256), float("nan"), device="cuda", dtype=torch.bfloat16)
    calls = []
    real = grouped_gemm.grouped_fp8_gemm_contiguous_gluon
    monkeypatch.setattr(grouped_gemm, "grouped_fp8_gemm_contiguous_gluon",
                        lambda *args: calls.append(1) or real(*args))
    grouped_gemm.grouped_fp8_gemm_contiguous(a, w, out, m_idx)
    assert calls == [1]
    triton_out = grouped_fp8_gemm_contiguous_triton(a, w, torch.empty_like(out), m_idx, {})
    assert calc_diff(out.float(), triton_out.float()) < 1e-5
