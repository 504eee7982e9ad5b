"""The naive low-latency layer in a CUDA graph (NCCL; one GPU per rank).

A whole layer pass (TorchAll2AllBuffer low-latency dispatch -> BatchedTritonExperts ->
low-latency combine, through FusedMoEModularKernel with max_tokens_across_ranks given) is
captured once; replays on new inputs copied into the static input tensors must match an eager
call on the same inputs bit for bit, and the reference within the layer tolerance. Capture fails
on any host synchronisation, and the eager pass also runs under torch's sync debug mode "error".
"""

import pytest
import torch
from _dist import run_distributed
from test_ep_kernel import check, local_slice, make_weights
from test_torch_buffer import make_problem

from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer
from vllm_moe_fixes.fused_moe.batched_experts import BatchedTritonExperts
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import DeepEPLLPrepareAndFinalize
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel

N, HIDDEN, E, TOPK = 32, 2048, 32, 6   # tokens per rank per pass, hidden, experts, top-k
TOKENS = 29                             # tokens per rank in each call (< N: padded slab rows)


def _inputs(seed, rank, world, device):
    xs, ids, ws = make_problem(seed, [TOKENS] * world, E, TOPK, HIDDEN, "uneven", device)
    return xs[rank], ids[rank], ws[rank].float()


def _graph_worker(rank, world):
    dev = torch.device("cuda", rank)
    buffer = TorchAll2AllBuffer(None, low_latency_mode=True, num_max_dispatch_tokens_per_rank=N,
                                hidden=HIDDEN, num_experts=E)
    kernel = FusedMoEModularKernel(
        DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=world, max_tokens_per_rank=N), BatchedTritonExperts())
    full = make_weights(0, E, HIDDEN, dev)
    lw1, ls1, lw2, ls2, expert_map = local_slice(rank, world, E, *full)
    x, ids, w = (t.clone() for t in _inputs(1, rank, world, dev))  # the graph's static inputs

    def layer():
        return kernel(x, lw1, lw2, w, ids, w1_scale=ls1, w2_scale=ls2, global_num_experts=E,
                      expert_map=expert_map, max_tokens_across_ranks=TOKENS)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels and set up NCCL outside the capture
        for _ in range(3):
            layer()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer()

    for seed in (2, 3, 4):
        new_x, new_ids, new_w = _inputs(seed, rank, world, dev)
        x.copy_(new_x), ids.copy_(new_ids), w.copy_(new_w)
        graph.replay()
        replayed = static_out.clone()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = layer()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager), (replayed.float() - eager.float()).abs().max()
        check(replayed, new_x, *full, new_ids, new_w)


@pytest.mark.gpu
def test_low_latency_layer_cuda_graph_one_gpu():
    run_distributed(_graph_worker, 1, backend="nccl")


@pytest.mark.multi_gpu
def test_low_latency_layer_cuda_graph_two_gpus():
    run_distributed(_graph_worker, 2, backend="nccl")
