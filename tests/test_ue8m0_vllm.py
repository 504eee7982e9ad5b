"""The vLLM adapters follow vLLM's E8M0 decision (vllm.utils.deep_gemm.is_deep_gemm_e8m0_used,
monkeypatched here) into the library's use_ue8m0 exactly where vLLM's own classes round their
activation scales: the one-rank, high-throughput and V2 prepare/finalizes' quant and every
experts' requant; not the low-latency dispatch's cast (vLLM's keeps exact scales for experts
without packed UE8M0 scales). Off (vLLM's CPU answer) stays off. Skipped without vllm."""

import pytest
import torch

pytest.importorskip("vllm")

import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.utils import deep_gemm as vllm_deep_gemm  # noqa: E402

from test_ue8m0 import _RecordingBuffer  # noqa: E402
from test_vllm_adapters import (  # noqa: E402
    block_quant_config,
    init_workspace_manager,
    moe_config,
    problem,
    vllm_kernel,
)
from vllm_moe_fixes.fused_moe import (  # noqa: E402
    FusedMoEModularKernel,
    NoEPPrepareAndFinalize,
    TritonExperts,
)
from vllm_moe_fixes.integrations.vllm import (  # noqa: E402
    VllmBatchedTritonExperts,
    VllmDeepEPHTPrepareAndFinalize,
    VllmDeepEPLLPrepareAndFinalize,
    VllmDeepEPV2PrepareAndFinalize,
    VllmNoEPPrepareAndFinalize,
    VllmTritonExperts,
)
from vllm_moe_fixes.integrations.vllm import prepare_finalize as pfs  # noqa: E402


@pytest.fixture(autouse=True)
def workspace_manager():
    init_workspace_manager()  # vLLM's kernel takes its workspaces there off the CPU platform


@pytest.fixture(params=[False, True], ids=["vllm_exact", "vllm_e8m0"])
def vllm_e8m0(request, monkeypatch):
    """vLLM's decision, as is_deep_gemm_e8m0_used() answers it (on a Hopper GPU with DeepGEMM:
    True by default; on CPU: False)."""
    monkeypatch.setattr(vllm_deep_gemm, "is_deep_gemm_e8m0_used", lambda: request.param)
    return request.param


def test_each_adapter_takes_vllms_decision_where_vllm_rounds(vllm_e8m0, monkeypatch):
    monkeypatch.setattr(pfs, "check_deepep_buffer", lambda *a, **kw: None)  # a stand-in buffer
    w, *_ = problem(1, 8, 2, seed=1)
    assert VllmNoEPPrepareAndFinalize().ours.use_ue8m0 is vllm_e8m0
    ht = VllmDeepEPHTPrepareAndFinalize(_RecordingBuffer(), num_dispatchers=1,
                                        rank_expert_offset=0, hidden=256, num_experts=8)
    assert ht.ours.use_ue8m0 is vllm_e8m0
    v2 = VllmDeepEPV2PrepareAndFinalize(_RecordingBuffer(), num_dispatchers=1,
                                        rank_expert_offset=0, max_tokens_per_rank=8,
                                        do_cpu_sync=True)
    assert v2.ours.use_ue8m0 is vllm_e8m0
    ll = VllmDeepEPLLPrepareAndFinalize(_RecordingBuffer(), max_tokens_per_rank=8,
                                        num_dispatchers=1, hidden=2048, num_experts=8)
    assert ll.ours.use_ue8m0 is False  # vLLM's low-latency dispatch keeps exact scales
    for cls, extra in ((VllmTritonExperts, {}),
                       (VllmBatchedTritonExperts, dict(max_num_tokens=8, num_dispatchers=1))):
        assert cls(moe_config(8, 2), block_quant_config(w), **extra).use_ue8m0 is vllm_e8m0


@pytest.mark.parametrize("M,E,k", [(1, 8, 2), (37, 8, 3)])
def test_vllm_kernel_with_adapters_equals_ours_with_vllms_scales(vllm_e8m0, M, E, k):
    """vLLM's FusedMoEKernel around the adapters: bit for bit our kernel with use_ue8m0 as vLLM
    decides, and (where vLLM rounds) another output than exact scales give."""
    w, x, tw, ti = problem(M, E, k, seed=M + 3)
    out = vllm_kernel(w, E, k).apply(x, w.w1, w.w2, tw, ti.to(torch.int32), MoEActivation.SILU,
                                     E, None, False)
    ours = {}
    for use_ue8m0 in (False, True):
        ours[use_ue8m0] = FusedMoEModularKernel(NoEPPrepareAndFinalize(use_ue8m0=use_ue8m0),
                                                TritonExperts())(
            x, w.w1, w.w2, tw, ti, w1_scale=w.w1_scale, w2_scale=w.w2_scale,
            global_num_experts=E)
    assert out.abs().sum() > 0
    assert torch.equal(out, ours[vllm_e8m0])
    assert not torch.equal(ours[True], ours[False])


def test_batched_experts_adapter_passes_vllms_decision_to_apply(vllm_e8m0):
    """The batched adapter's apply hands our experts use_ue8m0 as vLLM decided (vLLM's batched
    experts requantise with power-of-two scales where it holds)."""
    E, k, T = 4, 2, 8
    w, *_ = problem(1, E, k, seed=2)
    experts = VllmBatchedTritonExperts(moe_config(E, k), block_quant_config(w),
                                       max_num_tokens=T, num_dispatchers=1)
    seen = {}

    def apply(*args, **kwargs):
        seen.update(kwargs)
    experts.experts.apply = apply
    meta = mk.ExpertTokensMetadata(expert_num_tokens=torch.ones(E, dtype=torch.int32),
                                   expert_num_tokens_cpu=None)
    experts.apply(torch.empty(E, T, 256, dtype=torch.bfloat16), torch.empty(E, T, 256),
                  w.w1, w.w2, torch.ones(1, k), torch.zeros(1, k, dtype=torch.int64),
                  MoEActivation.SILU, E, None, torch.ones(E, T, 2), None,
                  torch.empty(10, dtype=torch.bfloat16), torch.empty(10, dtype=torch.bfloat16),
                  meta, False)
    assert seen["use_ue8m0"] is vllm_e8m0
