"""Decode as engines run it (GPU): the low-latency layer over a real DeepEP buffer, built and
called as the example of docs/design.md's "Decode under CUDA graphs" does (max_tokens_per_rank =
VLLM_MOE_DP_CHUNK_SIZE, no max_tokens_across_ranks), captured in a CUDA graph with both batched
experts; replays on new inputs copied into the captured tensors equal eager calls bit for bit, and
an eager call runs under torch's sync debug mode "error" (no host synchronisation and no pageable
copy). High-throughput mode is refused inside a capture and runs eagerly afterwards; the group's
count agreement (eager, several ranks) makes one synchronisation, its read, and no pageable copy.

Each case runs in fresh NCCL ranks (run_distributed), so NVSHMEM starts clean in each. The CPU
side of the capture rules: tests/test_capture_contract.py.
"""

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from test_ep_cuda_graph import _syncs

from vllm_moe_fixes import envs
from vllm_moe_fixes.distributed.buffers import clear_all2all_buffers, make_all2all_buffer
from vllm_moe_fixes.fused_moe import (
    BatchedDeepGemmExperts,
    BatchedTritonExperts,
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
    FusedMoEModularKernel,
    TritonExperts,
    fused_topk,
)
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import group_max_tokens
from vllm_moe_fixes.testing import moe_reference, random_fp8_moe_weights, rel_err

M, K, I, E, TOPK = 16, 2048, 128, 8, 2  # that example's sizes


def _layer_parts(rank, world):
    """This rank's weights and expert_map (from one global draw) and a maker of fresh inputs."""
    device = torch.device("cuda", rank)
    e_l = E // world
    weights = random_fp8_moe_weights(E, K, I, generator=torch.Generator().manual_seed(7))
    full = [t.to(device) for t in weights]
    local = [t[rank * e_l:(rank + 1) * e_l].contiguous() for t in full]
    expert_map = torch.full((E,), -1, dtype=torch.int32, device=device)
    expert_map[rank * e_l:(rank + 1) * e_l] = torch.arange(e_l, dtype=torch.int32, device=device)

    def inputs(seed):
        g = torch.Generator().manual_seed(seed * 100 + rank)
        x = torch.randn(M, K, generator=g).bfloat16()
        topk_weights, topk_ids = fused_topk(torch.randn(M, E, generator=g), TOPK,
                                            renormalize=True)
        return x.to(device), topk_weights.to(device), topk_ids.to(device)

    return full, local, expert_map, inputs


def _capture_worker(rank, world, experts_kind):
    full, (w1, w1_scale, w2, w2_scale), expert_map, inputs = _layer_parts(rank, world)
    max_tokens = envs.VLLM_MOE_DP_CHUNK_SIZE
    buffer = make_all2all_buffer("deepep_low_latency", dist.group.WORLD,
                                 max_tokens_per_rank=max_tokens, hidden=K, num_experts=E)
    assert type(buffer).__module__.startswith("deep_ep")
    pf = DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=world, max_tokens_per_rank=max_tokens)
    experts = BatchedDeepGemmExperts() if experts_kind == "deep_gemm" else BatchedTritonExperts()
    kernel = FusedMoEModularKernel(pf, experts)
    x, topk_weights, topk_ids = inputs(0)  # the graph's static inputs

    def layer(**kw):
        return kernel(x, w1, w2, topk_weights, topk_ids, w1_scale=w1_scale, w2_scale=w2_scale,
                      global_num_experts=E, expert_map=expert_map, **kw)

    # Several ranks agree on the pass count eagerly (one all-reduce and its read); with every
    # rank's M given there is nothing to agree, which the sync-free eager call below needs.
    eager_kw = {} if world == 1 else {"max_tokens_across_ranks": M}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels and warm DeepEP up outside the capture
        for _ in range(3):
            layer()
            layer(**eager_kw)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()

    for seed in (1, 2, 3):
        new_x, new_w, new_ids = inputs(seed)
        x.copy_(new_x), topk_weights.copy_(new_w), topk_ids.copy_(new_ids)
        graph.replay()
        replayed = out.clone()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = layer(**eager_kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager), (replayed.float() - eager.float()).abs().max()
        ref = moe_reference(new_x, full[0], full[2], new_w, new_ids, w1_scale=full[1],
                            w2_scale=full[3])
        assert rel_err(replayed, ref) < 0.06, rel_err(replayed, ref)
    del graph
    clear_all2all_buffers()
    torch.cuda.synchronize()


EXPERTS_KINDS = ["triton", pytest.param("deep_gemm", marks=pytest.mark.deep_gemm)]
WORLDS = [pytest.param(1, marks=pytest.mark.gpu), pytest.param(2, marks=pytest.mark.multi_gpu)]


@pytest.mark.gpu
@pytest.mark.deep_ep
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("experts_kind", EXPERTS_KINDS)
def test_deepep_low_latency_layer_captured_as_the_readme_calls_it(world, experts_kind):
    run_distributed(_capture_worker, world, experts_kind, backend="nccl")


def _ht_refused_worker(rank, world, backend):
    full, (w1, w1_scale, w2, w2_scale), expert_map, inputs = _layer_parts(rank, world)
    buffer = make_all2all_buffer(backend, dist.group.WORLD, max_tokens_per_rank=M, hidden=K,
                                 num_experts=E)
    pf = DeepEPHTPrepareAndFinalize(buffer, num_dispatchers=world,
                                    rank_expert_offset=rank * (E // world))
    kernel = FusedMoEModularKernel(pf, TritonExperts())
    x, topk_weights, topk_ids = inputs(4)

    def layer():
        return kernel(x, w1, w2, topk_weights, topk_ids, w1_scale=w1_scale, w2_scale=w2_scale,
                      global_num_experts=E, expert_map=expert_map)

    layer()  # compiled and warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match=r"CUDA graph capture.*low-latency mode.*eagerly"):
        with torch.cuda.graph(graph):
            layer()
    out = layer()
    ref = moe_reference(x, full[0], full[2], topk_weights, topk_ids, w1_scale=full[1],
                        w2_scale=full[3])
    assert rel_err(out, ref) < 0.06
    clear_all2all_buffers()
    torch.cuda.synchronize()


# DeepEP's high-throughput kernels exist for 2, 4 and 8 ranks only (v1.2.1 has no config for
# one): one GPU runs the same prepare/finalize over the torch stand-in (the refusal comes before
# the buffer is touched, and the eager call after it needs a buffer that runs at one rank).
HT_BUFFERS = [pytest.param(1, "naive", marks=pytest.mark.gpu, id="one_gpu_torch_buffer"),
              pytest.param(2, "deepep_high_throughput", id="two_gpus_deep_ep",
                           marks=[pytest.mark.multi_gpu, pytest.mark.deep_ep])]


@pytest.mark.gpu
@pytest.mark.parametrize("world, backend", HT_BUFFERS)
def test_deepep_high_throughput_refused_inside_a_capture(world, backend):
    run_distributed(_ht_refused_worker, world, backend, backend="nccl")


def _count_agreement_worker(rank, world):
    for _ in range(2):  # the second round is the steady state
        assert _syncs(lambda: group_max_tokens(None, 3 + rank, chunk_size=4)) == 1
    assert group_max_tokens(None, 3 + rank, chunk_size=4) == 2 + world


@pytest.mark.multi_gpu
def test_count_agreement_makes_one_sync_and_no_pageable_copy():
    run_distributed(_count_agreement_worker, 2, backend="nccl")
