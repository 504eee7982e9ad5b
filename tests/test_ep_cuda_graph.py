"""The naive low-latency layer in a CUDA graph (NCCL; one GPU per rank), and the host
synchronisations of each naive all-to-all call.

A whole layer pass (TorchAll2AllBuffer low-latency dispatch -> BatchedTritonExperts ->
low-latency combine, through FusedMoEModularKernel with max_tokens_across_ranks given) is
captured once; replays on new inputs copied into the static input tensors must match an eager
call on the same inputs bit for bit, and the reference within the layer tolerance. Capture fails
on any host synchronisation, and the eager pass also runs under torch's sync debug mode "error".
"""

import warnings

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
    pf = DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=world, max_tokens_per_rank=N)
    kernel = FusedMoEModularKernel(pf, BatchedTritonExperts())
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


# One rank on one GPU; two ranks where two GPUs exist.
WORLDS = [pytest.param(1, marks=pytest.mark.gpu), pytest.param(2, marks=pytest.mark.multi_gpu)]


@pytest.mark.parametrize("world", WORLDS)
def test_low_latency_layer_cuda_graph(world):
    run_distributed(_graph_worker, world, backend="nccl")


def _syncs(fn) -> int:
    """Synchronising CUDA operations fn makes (torch's sync debug mode, one warning each)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Each synchronising call warns "called a synchronizing CUDA operation"; the notice that the
    # debug mode is a prototype, which also says "synchronizing", is not one.
    return sum("called a synchronizing" in str(w.message) for w in caught)


def _sync_count_worker(rank, world):
    """High-throughput: get_dispatch_layout and combine none, dispatch one (its receive counts).
    Low-latency: none."""
    dev = torch.device("cuda", rank)
    x, ids, w = _inputs(5, rank, world, dev)
    buffer = TorchAll2AllBuffer(None, low_latency_mode=True, num_max_dispatch_tokens_per_rank=N,
                                hidden=HIDDEN, num_experts=E)
    state = {}

    def dispatch_ht():
        layout = buffer.get_dispatch_layout(ids, E)
        state["out"] = buffer.dispatch(
            x, num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1],
            num_tokens_per_expert=layout[2], is_token_in_rank=layout[3], topk_idx=ids,
            topk_weights=w)

    for _ in range(2):  # the second round is the steady state
        assert _syncs(lambda: buffer.get_dispatch_layout(ids, E)) == 0
        assert _syncs(dispatch_ht) == 1
        recv, handle = state["out"][0], state["out"][4]
        assert _syncs(lambda: buffer.combine(recv, handle)) == 0
        ll = {}
        assert _syncs(lambda: ll.update(d=buffer.low_latency_dispatch(x, ids, N, E))) == 0
        y = torch.randn(ll["d"][0][0].shape, device=dev).to(torch.bfloat16)
        assert _syncs(lambda: buffer.low_latency_combine(y, ids, w, ll["d"][2])) == 0


@pytest.mark.parametrize("world", WORLDS)
def test_naive_all2all_host_syncs(world):
    run_distributed(_sync_count_worker, world, backend="nccl")
