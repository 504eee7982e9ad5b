"""The vLLM adapters on a GPU, NOT YET RUN (written while no device was lent; see the README's "vLLM
plugin" section for how to run them): vLLM's FusedMoEKernel (its WorkspaceManager handing fresh
views each call) with our prepare/finalize and experts against our own FusedMoEModularKernel, bit
for bit, with the Triton experts and with real DeepGEMM; the low-latency adapter over a real
``deep_ep.Buffer`` at world size 1. Skipped without vllm, a CUDA GPU, or the library a test needs.
"""

import pytest
import torch

pytest.importorskip("vllm")

import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402

from test_vllm_adapters import block_quant_config, moe_config  # noqa: E402
from vllm_moe_fixes import fused_moe as ours  # noqa: E402
from vllm_moe_fixes.integrations.vllm import experts as adapters  # noqa: E402
from vllm_moe_fixes.integrations.vllm import prepare_finalize as pfs  # noqa: E402
from vllm_moe_fixes.testing import random_fp8_moe_weights  # noqa: E402

pytestmark = pytest.mark.gpu


def _init_workspace_manager():
    """vLLM's process-wide WorkspaceManager, which its kernel takes workspaces from on CUDA."""
    from vllm.v1.worker import workspace
    if not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(torch.device("cuda", torch.cuda.current_device()))


@pytest.fixture
def workspace_manager():
    _init_workspace_manager()


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
    want = ours.FusedMoEModularKernel(ours.NoEPPrepareAndFinalize(), our_cls())(
        x, w.w1, w.w2, tw, ti, w1_scale=w.w1_scale, w2_scale=w.w2_scale, global_num_experts=E)
    assert out.abs().sum() > 0
    assert torch.equal(out, want)


@pytest.mark.deep_ep
def test_low_latency_adapter_over_real_deepep_at_world_size_1():
    from _dist import run_distributed
    assert all(run_distributed(_ll_world_size_1, 1, backend="nccl"))


def _ll_world_size_1(rank, world_size):
    import torch.distributed as dist

    from vllm_moe_fixes.distributed import make_all2all_buffer
    _init_workspace_manager()
    E, K, I, k, N = 32, 2048, 512, 4, 128
    w, x, tw, ti = _problem(100, E, K, I, k, seed=5)
    buffer = make_all2all_buffer("deepep_low_latency", dist.group.WORLD, max_tokens_per_rank=N,
                                 hidden=K, num_experts=E)
    cfg = moe_config(E, k, hidden_dim=K, intermediate_size=I, intermediate_size_per_partition=I,
                     device="cuda")
    pf = pfs.VllmDeepEPLLPrepareAndFinalize(buffer, max_tokens_per_rank=N, num_dispatchers=1,
                                            hidden=K, num_experts=E)
    experts = adapters.VllmBatchedTritonExperts(cfg, block_quant_config(w), max_num_tokens=N,
                                                num_dispatchers=1)
    out = mk.FusedMoEKernel(pf, experts).apply(x, w.w1, w.w2, tw, ti, MoEActivation.SILU, E,
                                               None, False)
    want = ours.FusedMoEModularKernel(
        ours.DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=1, max_tokens_per_rank=N),
        ours.BatchedTritonExperts())(x, w.w1, w.w2, tw, ti, w1_scale=w.w1_scale,
                                     w2_scale=w.w2_scale, global_num_experts=E)
    return bool(torch.equal(out, want) and out.abs().sum() > 0)
