"""The DeepEP high-throughput and low-latency adapters inside vLLM's FusedMoEKernel, on 2 gloo
ranks over TorchAll2AllBuffer (DeepEP's Buffer API on torch.distributed): each rank's output equals
our own FusedMoEModularKernel's with the same prepare/finalize, bit for bit; vLLM's id convention
and ExpertTokensMetadata are checked on the way. Skipped without vllm."""

import pytest
import torch

pytest.importorskip("vllm")

import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402

from _dist import run_distributed  # noqa: E402
from test_vllm_adapters import (  # noqa: E402
    block_quant_config,
    exact_scales_in_vllm,
    moe_config,
)
from vllm_moe_fixes.distributed import TorchAll2AllBuffer  # noqa: E402
from vllm_moe_fixes.fused_moe import (  # noqa: E402
    BatchedTritonExperts,
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
    FusedMoEModularKernel,
    TritonExperts,
    fused_topk,
)
from vllm_moe_fixes.integrations.vllm import (  # noqa: E402
    VllmBatchedTritonExperts,
    VllmDeepEPHTPrepareAndFinalize,
    VllmDeepEPLLPrepareAndFinalize,
    VllmTritonExperts,
)
from vllm_moe_fixes.testing import Fp8MoEWeights, random_fp8_moe_weights  # noqa: E402

E, I, TOPK = 8, 128, 3


def _rank_problem(rank, world, M, K):
    """This rank's tokens and routing, and its slice of one set of weights (same on all ranks)."""
    e_l = E // world
    w = random_fp8_moe_weights(E, K, I, generator=torch.Generator().manual_seed(11))
    sl = slice(rank * e_l, (rank + 1) * e_l)
    local = Fp8MoEWeights(*(t[sl].contiguous() for t in w))
    expert_map = torch.full((E,), -1, dtype=torch.int32)
    expert_map[sl] = torch.arange(e_l, dtype=torch.int32)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(M, K, generator=g).bfloat16()
    tw, ti = fused_topk(torch.randn(M, E, generator=g), TOPK, renormalize=True)
    return x, tw, ti, local, expert_map


def _high_throughput(rank, world):
    buffer = TorchAll2AllBuffer(None)
    results = []
    for M in ((5, 0), (17, 33)):
        x, tw, ti, local, expert_map = _rank_problem(rank, world, M[rank], 256)
        w1, s1, w2, s2 = local
        e_l = E // world
        pf = VllmDeepEPHTPrepareAndFinalize(buffer, num_dispatchers=world,
                                            rank_expert_offset=rank * e_l, hidden=256,
                                            num_experts=E)
        qc = block_quant_config(local)
        # vLLM's convention, seen in prepare's output: no -1, off-rank slots map to -1
        a1q, a1s, meta, ids, rw = pf.prepare(x, tw, ti, E, expert_map, False, qc, False)
        assert (ids >= 0).all() and (expert_map[ids][rw == 0] == -1).all()
        assert meta.expert_num_tokens_cpu.tolist() == pf.ours.num_recv_tokens_per_expert
        assert not meta.expert_num_tokens_cpu.is_pinned()
        pf.finalize(torch.empty_like(x), torch.zeros(a1q.shape[0], 256, dtype=torch.bfloat16),
                    rw, ids, False, VllmTritonExperts(moe_config(E, TOPK, e_l), qc)
                    .finalize_weight_and_reduce_impl())  # complete the dispatch above
        kernel = mk.FusedMoEKernel(pf, VllmTritonExperts(moe_config(E, TOPK, e_l), qc))
        out = kernel.apply(x, w1, w2, tw, ti.to(torch.int64), MoEActivation.SILU, E,
                           expert_map, False)
        ours = FusedMoEModularKernel(
            DeepEPHTPrepareAndFinalize(buffer, num_dispatchers=world,
                                       rank_expert_offset=rank * e_l,
                                       use_ue8m0=pf.ours.use_ue8m0), TritonExperts())(
            x, w1, w2, tw, ti, w1_scale=s1, w2_scale=s2, global_num_experts=E,
            expert_map=expert_map, max_tokens_across_ranks=max(M))
        results.append((torch.equal(out, ours), x.shape[0] == 0 or bool(out.abs().sum() > 0)))
    return results


def _low_latency(rank, world, K=2048, N=8):
    exact_scales_in_vllm()
    buffer = TorchAll2AllBuffer(None, low_latency_mode=True, num_max_dispatch_tokens_per_rank=N,
                                hidden=K, num_experts=E)
    results = []
    for M in ((3, 8), (1, 1)):
        x, tw, ti, local, expert_map = _rank_problem(rank, world, M[rank], K)
        w1, s1, w2, s2 = local
        e_l = E // world
        qc = block_quant_config(local)
        pf = VllmDeepEPLLPrepareAndFinalize(buffer, max_tokens_per_rank=N,
                                            num_dispatchers=world, hidden=K, num_experts=E)
        experts = VllmBatchedTritonExperts(moe_config(E, TOPK, e_l, hidden_dim=K), qc,
                                           max_num_tokens=N, num_dispatchers=world)
        out = mk.FusedMoEKernel(pf, experts).apply(x, w1, w2, tw, ti.to(torch.int64),
                                                   MoEActivation.SILU, E, expert_map, False)
        ours = FusedMoEModularKernel(
            DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=world, max_tokens_per_rank=N),
            BatchedTritonExperts())(x, w1, w2, tw, ti, w1_scale=s1, w2_scale=s2,
                                    global_num_experts=E, expert_map=expert_map,
                                    max_tokens_across_ranks=max(M))
        results.append((torch.equal(out, ours), bool(out.abs().sum() > 0)))
    return results


@pytest.mark.parametrize("case", [_high_throughput, _low_latency],
                         ids=["high_throughput", "low_latency"])
def test_deepep_adapters_in_vllms_kernel_equal_ours_on_two_ranks(case):
    for rank_results in run_distributed(case, 2):
        assert rank_results and all(equal and nonzero for equal, nonzero in rank_results), \
            rank_results
