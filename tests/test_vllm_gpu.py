"""The vLLM adapters on a GPU (tests/vllm_support/device_run.sh runs them against vLLM 0.33's
Python tree): vLLM's FusedMoEKernel (its WorkspaceManager handing fresh views each call) with our
prepare/finalize and experts against our own FusedMoEModularKernel, bit for bit, with the Triton
experts and with real DeepGEMM; vLLM's FusedMoE layer with EPLB's physical experts against the
un-replicated layer, bit for bit; the low-latency adapter over a real ``deep_ep.Buffer`` at world
size 1 with the batched Triton and DeepGEMM experts. Skipped without vllm, a CUDA GPU, or the
library a test needs.
"""

import pytest
import torch

pytest.importorskip("vllm")

import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402

from test_vllm_adapters import (  # noqa: E402
    block_quant_config,
    exact_scales_in_vllm,
    init_workspace_manager,
    moe_config,
    our_no_ep,
)
from vllm_moe_fixes import fused_moe as ours  # noqa: E402
from vllm_moe_fixes.integrations.vllm import experts as adapters  # noqa: E402
from vllm_moe_fixes.integrations.vllm import prepare_finalize as pfs  # noqa: E402
from vllm_moe_fixes.testing import random_fp8_moe_weights  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def workspace_manager():
    init_workspace_manager()


def _problem(M, E, K, I, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = random_fp8_moe_weights(E, K, I, generator=g, device="cuda")
    x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
    tw, ti = ours.fused_topk(torch.randn(M, E, generator=g, device="cuda"), k, renormalize=True)
    return w, x, tw, ti


@pytest.mark.parametrize("pair", [
    (adapters.VllmTritonExperts, ours.TritonExperts),
    pytest.param((adapters.VllmDeepGemmExperts, ours.DeepGemmExperts),
                 marks=pytest.mark.deep_gemm),
], ids=["triton", "deep_gemm"])
@pytest.mark.parametrize("M", [1, 128, 333])
def test_vllm_kernel_with_adapters_equals_ours_on_gpu(workspace_manager, pair, M):
    vllm_cls, our_cls = pair
    E, K, I, k = 16, 1024, 512, 4
    w, x, tw, ti = _problem(M, E, K, I, k, seed=M)
    cfg = moe_config(E, k, hidden_dim=K, intermediate_size=I, intermediate_size_per_partition=I,
                     device="cuda")
    kernel = mk.FusedMoEKernel(pfs.VllmNoEPPrepareAndFinalize(),
                               vllm_cls(cfg, block_quant_config(w)))
    for _ in range(2):  # the second call gets fresh workspace views
        out = kernel.apply(x, w.w1, w.w2, tw, ti.to(torch.int32), MoEActivation.SILU, E, None,
                           False)
    want = ours.FusedMoEModularKernel(our_no_ep(), our_cls())(
        x, w.w1, w.w2, tw, ti, w1_scale=w.w1_scale, w2_scale=w.w2_scale, global_num_experts=E)
    assert out.abs().sum() > 0
    assert torch.equal(out, want)


@pytest.mark.parametrize("deep_gemm", [
    False, pytest.param(True, marks=pytest.mark.deep_gemm)], ids=["triton", "deep_gemm"])
def test_fused_moe_layer_through_the_hook_on_gpu(deep_gemm, monkeypatch):
    """vLLM's own FusedMoE layer (FusedMoEFactory + Fp8Config, block FP8) on the GPU with the
    plugin registered: our no-EP prepare/finalize and the experts VLLM_USE_DEEP_GEMM asks for,
    the checkpoint's weights kept in our layout, bit-equal to our kernel (world size 1, NCCL;
    the sizes of the kernel test above, whose compiled kernels it reuses)."""
    from _dist import run_distributed
    from test_vllm_plugin import _layer_through_the_hook
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1" if deep_gemm else "0")
    got = run_distributed(_layer_through_the_hook, 1, "cuda", (16, 1024, 512, 4),
                          backend="nccl")[0]
    assert got["backend"] == "TRITON"  # vLLM leaves the weights as loaded
    assert (got["pf"], got["experts"]) == (
        "VllmNoEPPrepareAndFinalize", "VllmDeepGemmExperts" if deep_gemm else "VllmTritonExperts")
    assert got["weights_kept"] and got["nonzero"] and got["equal"]


@pytest.mark.parametrize("deep_gemm", [
    False, pytest.param(True, marks=pytest.mark.deep_gemm)], ids=["triton", "deep_gemm"])
def test_fused_moe_layer_with_vllms_eplb_on_gpu(deep_gemm, monkeypatch):
    """vLLM's FusedMoE layer with EPLB (E = 8 logical experts, R = 4 redundant, placed by vLLM's
    DefaultEplbPolicy) on the GPU through the plugin's classes, vLLM's own Triton kernel mapping
    the ids to replicas and recording the load: bit-equal to the un-replicated layer before and
    after an in-place rebalance (test_vllm_eplb_layer.py's checks; world size 1, NCCL)."""
    from _dist import run_distributed
    from test_vllm_eplb_layer import _replicated_and_plain, check_equal_to_unreplicated
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1" if deep_gemm else "0")
    for M in (1, 333):
        got = run_distributed(_replicated_and_plain, 1, M, "cuda", backend="nccl")[0]
        check_equal_to_unreplicated(
            got, M, "VllmDeepGemmExperts" if deep_gemm else "VllmTritonExperts")


@pytest.mark.deep_ep
@pytest.mark.parametrize("experts", [
    ("VllmBatchedTritonExperts", "BatchedTritonExperts"),
    pytest.param(("VllmBatchedDeepGemmExperts", "BatchedDeepGemmExperts"),
                 marks=pytest.mark.deep_gemm),
], ids=["triton", "deep_gemm"])
def test_low_latency_adapter_over_real_deepep_at_world_size_1(experts):
    from _dist import run_distributed
    assert all(run_distributed(_ll_world_size_1, 1, *experts, backend="nccl"))


def _ll_world_size_1(rank, world_size, vllm_cls_name, our_cls_name):
    """N = 128 tokens per rank: the batched experts' slices of R*N = 128 rows, a multiple of
    DeepGEMM's masked tile."""
    import torch.distributed as dist

    from vllm_moe_fixes.distributed import make_all2all_buffer
    exact_scales_in_vllm()
    init_workspace_manager()
    E, K, I, k, N = 32, 2048, 512, 4, 128
    w, x, tw, ti = _problem(100, E, K, I, k, seed=5)
    buffer = make_all2all_buffer("deepep_low_latency", dist.group.WORLD, max_tokens_per_rank=N,
                                 hidden=K, num_experts=E)
    cfg = moe_config(E, k, hidden_dim=K, intermediate_size=I, intermediate_size_per_partition=I,
                     device="cuda")
    pf = pfs.VllmDeepEPLLPrepareAndFinalize(buffer, max_tokens_per_rank=N, num_dispatchers=1,
                                            hidden=K, num_experts=E)
    experts = getattr(adapters, vllm_cls_name)(cfg, block_quant_config(w), max_num_tokens=N,
                                               num_dispatchers=1)
    out = mk.FusedMoEKernel(pf, experts).apply(x, w.w1, w.w2, tw, ti, MoEActivation.SILU, E,
                                               None, False)
    want = ours.FusedMoEModularKernel(
        ours.DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=1, max_tokens_per_rank=N),
        getattr(ours, our_cls_name)())(x, w.w1, w.w2, tw, ti, w1_scale=w.w1_scale,
                                       w2_scale=w.w2_scale, global_num_experts=E)
    return bool(torch.equal(out, want) and out.abs().sum() > 0)

