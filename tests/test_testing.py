"""vllm_moe_fixes.testing: the metrics, the block-FP8 weight recipe, the random layer weights,
moe_reference against a per-token loop, and the unfused layer against the fused one."""

import pytest
import torch

from vllm_moe_fixes.fused_moe import FusedMoEModularKernel, NoEPPrepareAndFinalize, TritonExperts
from vllm_moe_fixes.fused_moe import moe_reference as exported_moe_reference
from vllm_moe_fixes.fused_moe.routing import fused_topk
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, dequant_block_fp8
from vllm_moe_fixes.testing import (
    calc_diff,
    moe_reference,
    quant_block_fp8,
    random_fp8_moe_weights,
    rel_err,
    run_environment,
    unfused_moe_layer,
)


def test_calc_diff():
    x = torch.randn(64, 32)
    assert calc_diff(x, x) == pytest.approx(0.0, abs=1e-12)
    assert calc_diff(x, -x) == pytest.approx(2.0)
    assert calc_diff(x, 2 * x) == pytest.approx(1 - 4 / 5)
    assert calc_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    assert 0.8 < calc_diff(x, torch.randn(64, 32)) < 1.2


def test_rel_err():
    x = torch.randn(64, 32)
    assert rel_err(x, x) == 0.0
    assert rel_err(2 * x, x) == pytest.approx(1.0)
    assert rel_err(x.bfloat16(), x) == pytest.approx(
        float((x.bfloat16().double() - x.double()).norm() / x.double().norm()))
    # An all-zero reference stays finite (clamped denominator): 0 for zeros, huge otherwise.
    assert rel_err(torch.zeros(3), torch.zeros(3)) == 0.0
    assert rel_err(torch.ones(3), torch.zeros(3)) == pytest.approx(3 ** 0.5 / 1e-12)


def test_block_quant_roundtrip():
    w = torch.randn(2, 256, 384, generator=torch.Generator().manual_seed(1))
    q, s = quant_block_fp8(w)
    assert q.dtype == FP8_DTYPE and s.shape == (2, 2, 3)
    d = dequant_block_fp8(q, s)
    assert ((d - w).norm() / w.norm()) < 0.04
    # Each 128x128 block uses its own scale: scaling one block scales only that block.
    s2 = s.clone()
    s2[1, 1, 2] *= 2
    d2 = dequant_block_fp8(q, s2)
    assert torch.equal(d2[1, 128:, 256:], 2 * d[1, 128:, 256:])
    assert torch.equal(d2[0], d[0]) and torch.equal(d2[1, :128], d[1, :128])
    with pytest.raises(ValueError, match="multiples of 128"):
        quant_block_fp8(torch.randn(100, 128))


def test_moe_reference_per_token_loop():
    g = torch.Generator().manual_seed(2)
    E, k, M, I, K = 4, 2, 5, 128, 128
    w1, w1s, w2, w2s = random_fp8_moe_weights(E, K, I, generator=g)
    x = torch.randn(M, K, generator=g).bfloat16()
    weights, ids = fused_topk(torch.randn(M, E, generator=g), k, True)
    emap = torch.tensor([1, -1, 0, -1], dtype=torch.int32)  # global 0 -> local 1, 2 -> 0
    w1l, w1sl, w2l, w2sl = w1[[2, 0]], w1s[[2, 0]], w2[[2, 0]], w2s[[2, 0]]
    got = moe_reference(x, w1l, w2l, weights, ids, w1_scale=w1sl, w2_scale=w2sl, expert_map=emap)
    W1, W2 = dequant_block_fp8(w1, w1s), dequant_block_fp8(w2, w2s)
    want = torch.zeros(M, K)
    for m in range(M):
        for j in range(k):
            e = int(ids[m, j])
            if e in (0, 2):
                h = x[m].float() @ W1[e].t()
                want[m] += weights[m, j] * ((torch.nn.functional.silu(h[:I]) * h[I:]) @ W2[e].t())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_random_fp8_moe_weights_follow_the_recipe():
    """w1 then w2 from one generator, each randn / sqrt(fan-in), block-quantised."""
    E, K, I = 3, 256, 128
    got = random_fp8_moe_weights(E, K, I, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    w1, w1s = quant_block_fp8(torch.randn(E, 2 * I, K, generator=g) / K ** 0.5)
    w2, w2s = quant_block_fp8(torch.randn(E, K, I, generator=g) / I ** 0.5)
    for name, want in zip(("w1", "w1_scale", "w2", "w2_scale"), (w1, w1s, w2, w2s)):
        t = getattr(got, name)
        assert t.shape == want.shape and t.dtype == want.dtype, name
        assert torch.equal(t.view(torch.uint8) if t.dtype == FP8_DTYPE else t,
                           want.view(torch.uint8) if want.dtype == FP8_DTYPE else want), name
    assert got.w1.shape == (E, 2 * I, K) and got.w2_scale.shape == (E, K // 128, I // 128)


def test_fused_moe_exports_the_same_moe_reference():
    assert exported_moe_reference is moe_reference


def test_unfused_layer_matches_the_fused_layer_bit_for_bit_on_cpu():
    """On CPU every op of both paths is a torch reference, so the unfused layer (the benchmarks'
    anchor) and the modular kernel give the same bits: the benchmark's diff column measures only
    the GPU kernels."""
    g = torch.Generator().manual_seed(0)
    E, k, M, I, K = 8, 8, 40, 128, 256
    weights = random_fp8_moe_weights(E, K, I, generator=g)
    w1, w1s, w2, w2s = weights
    x = torch.randn(M, K, generator=g).bfloat16()
    topk_weights, ids = fused_topk(torch.randn(M, E, generator=g), k, renormalize=True)
    kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(), TritonExperts())
    out = kernel(x, w1, w2, topk_weights, ids, w1_scale=w1s, w2_scale=w2s, global_num_experts=E)
    anchor = unfused_moe_layer(x, weights, topk_weights, ids, TritonExperts().gemm)
    assert torch.equal(out, anchor)


def test_run_environment_says_where_a_measurement_ran(monkeypatch):
    import re
    import subprocess

    env = run_environment()
    assert set(env) == {"gpu", "torch", "triton", "python", "date_utc", "git_commit"}
    assert env["torch"] == torch.__version__ and re.fullmatch(r"\d+\.\d+\.\d+", env["python"])
    assert env["git_commit"] is None or re.fullmatch(r"[0-9a-f]{40}", env["git_commit"])

    def no_git(*args, **kwargs):
        raise OSError("git not installed")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert run_environment()["git_commit"] is None
