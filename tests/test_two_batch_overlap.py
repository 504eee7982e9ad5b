"""FusedMoEModularKernel(micro_batches=n): the overlapped call gives the non-overlapped call's
output bit for bit on CPU, over every expert-parallel prepare/finalize (high-throughput and V2 with
2 and 3 micro-batches, low-latency with 2), on 1, 2 and 4 gloo ranks, with several chunks per
call and ranks with 0 and 1 tokens; a chunk too small to pay for a split runs unsplit; and the
arguments it refuses."""

import os
import time

import pytest
import torch
import torch.distributed as dist
from _dist import device_for, run_distributed

from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer
from vllm_moe_fixes.distributed.torch_elastic_buffer import TorchElasticBuffer
from vllm_moe_fixes.fused_moe.batched_experts import BatchedTritonExperts
from vllm_moe_fixes.fused_moe.contiguous_experts import TritonExperts
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import (
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
    DeepEPV2PrepareAndFinalize,
)
from vllm_moe_fixes.fused_moe.kernel_factory import local_expert_map
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel, micro_batches_for
from vllm_moe_fixes.fused_moe.no_ep_prepare_finalize import NoEPPrepareAndFinalize
from vllm_moe_fixes.fused_moe.workspaces import Workspaces
from vllm_moe_fixes.testing import random_fp8_moe_weights

K, I, E_LOCAL, TOPK = 2048, 128, 4, 3  # K: a hidden size DeepEP's low-latency kernels serve
CHUNK = 6                              # VLLM_FUSED_MOE_CHUNK_SIZE: several chunks per call
TOKENS = [13, 1, 0, 7]                 # per rank


def _inputs(rank: int, world: int, m: int | None = None):
    """Rank ``rank``'s layer arguments with m tokens (None: TOKENS[rank])."""
    num_experts = E_LOCAL * world
    weights = random_fp8_moe_weights(num_experts, K, I, generator=torch.Generator().manual_seed(7))
    local = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    local_weights = [t[local].contiguous() for t in weights]
    g = torch.Generator().manual_seed(30 + rank)
    m = TOKENS[rank] if m is None else m
    x = torch.randn(m, K, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:TOPK] for _ in range(m)]) \
        if m else torch.zeros(0, TOPK, dtype=torch.int64)
    ids[torch.rand(m, TOPK, generator=g) < 0.2] = -1
    topk_weights = torch.rand(m, TOPK, generator=g)
    return num_experts, local_weights, x, topk_weights, ids


def _layer(kernel, inputs, max_tokens_across_ranks=None):
    num_experts, (w1, s1, w2, s2), x, topk_weights, ids = inputs
    expert_map = local_expert_map(dist.group.WORLD, num_experts, x.device)
    return kernel(x, w1, w2, topk_weights, ids, w1_scale=s1, w2_scale=s2,
                  global_num_experts=num_experts, expert_map=expert_map,
                  max_tokens_across_ranks=max_tokens_across_ranks)


def _worker(rank: int, world: int) -> None:
    os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = str(CHUNK)  # this forked rank's environment only
    num_experts = E_LOCAL * world
    wiring = dict(num_dispatchers=world, rank_expert_offset=rank * E_LOCAL)
    ll_buffer = TorchAll2AllBuffer(low_latency_mode=True, num_max_dispatch_tokens_per_rank=8,
                                   hidden=K, num_experts=num_experts)
    elastic = TorchElasticBuffer(num_max_tokens_per_rank=CHUNK, hidden=K, num_topk=TOPK,
                                 use_fp8_dispatch=True)
    kinds = [
        (lambda: DeepEPHTPrepareAndFinalize(TorchAll2AllBuffer(), **wiring), TritonExperts,
         (2, 3)),
        (lambda: DeepEPLLPrepareAndFinalize(ll_buffer, num_dispatchers=world,
                                            max_tokens_per_rank=8),
         BatchedTritonExperts, (2,)),
        (lambda: DeepEPV2PrepareAndFinalize(elastic, max_tokens_per_rank=CHUNK, **wiring),
         TritonExperts, (2,)),
    ]
    inputs = _inputs(rank, world)
    for make_pf, experts, splits in kinds:
        want = _layer(FusedMoEModularKernel(make_pf(), experts()), inputs)
        assert torch.isfinite(want.float()).all()
        for micro_batches in splits:
            kernel = FusedMoEModularKernel(make_pf(), experts(), micro_batches=micro_batches,
                                           min_micro_batch_tokens=1)  # split the tiny chunks
            got = _layer(kernel, inputs)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
                (type(kernel.prepare_finalize).__name__, micro_batches)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_overlapped_call_equals_the_plain_call(world):
    run_distributed(_worker, world)


class _CountingBuffer(TorchAll2AllBuffer):
    """TorchAll2AllBuffer counting its high-throughput dispatches (one per micro-batch)."""

    dispatches = 0

    def dispatch(self, *args, **kwargs):
        self.dispatches += 1
        return super().dispatch(*args, **kwargs)


# (world, tokens per rank, max_tokens_across_ranks, micro_batches, dispatches per call) with
# min_micro_batch_tokens 4: on one rank the rule reads M; over ranks the busiest rank's count
# (max_tokens_across_ranks), unknown without it (the call splits as asked; every rank empty:
# no pass to split).
SPLITS = {1: [((7,), None, 2, 1), ((8,), None, 2, 2), ((13,), None, 4, 3), ((20,), None, 4, 4)],
          2: [((3, 9), 9, 4, 2), ((3, 5), 5, 4, 1), ((3, 5), None, 4, 4), ((0, 0), None, 2, 0)]}


def _split_worker(rank: int, world: int) -> None:
    for tokens, max_tokens, micro_batches, dispatches in SPLITS[world]:
        inputs = _inputs(rank, world, tokens[rank])
        wiring = dict(num_dispatchers=world, rank_expert_offset=rank * E_LOCAL)
        want = _layer(FusedMoEModularKernel(
            DeepEPHTPrepareAndFinalize(TorchAll2AllBuffer(), **wiring), TritonExperts()),
            inputs, max_tokens)
        buffer = _CountingBuffer()
        kernel = FusedMoEModularKernel(DeepEPHTPrepareAndFinalize(buffer, **wiring),
                                       TritonExperts(), micro_batches=micro_batches,
                                       min_micro_batch_tokens=4)
        got = _layer(kernel, inputs, max_tokens)
        assert buffer.dispatches == dispatches, (tokens, max_tokens, buffer.dispatches)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), tokens


@pytest.mark.parametrize("world", [1, 2])
def test_small_chunks_run_unsplit(world):
    run_distributed(_split_worker, world)


@pytest.mark.parametrize("micro_batches, group_tokens, chunk_tokens, want", [
    (2, 511, 8192, 1), (2, 512, 8192, 2), (4, 1024, 8192, 4), (4, 768, 8192, 3),
    (4, 100_000, 512, 2),  # the chunk caps a micro-batch's tokens
    (4, None, 8192, 4),    # the group's count unknown: split as asked
    (1, 4096, 8192, 1),
])
def test_micro_batches_for(micro_batches, group_tokens, chunk_tokens, want):
    assert micro_batches_for(micro_batches, group_tokens, chunk_tokens, 256) == want


class _StubBuffer:
    """What the kernel's argument checks read of a buffer: nothing is dispatched."""

    low_latency_mode = True

    def __init__(self):
        self.num_sms = None

    def set_num_sms(self, n):
        self.num_sms = n

    get_dispatch_layout = dispatch = combine = low_latency_dispatch = low_latency_combine = None


def _ht():
    buffer = _StubBuffer()
    buffer.get_dispatch_layout = buffer.dispatch = buffer.combine = lambda *a, **k: None
    return DeepEPHTPrepareAndFinalize(buffer, num_dispatchers=1, rank_expert_offset=0)


def _ll():
    buffer = _StubBuffer()
    buffer.low_latency_dispatch = buffer.low_latency_combine = lambda *a, **k: None
    return DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=1, max_tokens_per_rank=8)


@pytest.mark.parametrize("make_pf, experts, kwargs, match", [
    (_ht, TritonExperts, dict(micro_batches=0), "micro_batches=0 must be an int >= 1"),
    (_ht, TritonExperts, dict(micro_batches=True), "micro_batches=True must be an int"),
    (NoEPPrepareAndFinalize, TritonExperts, dict(micro_batches=2),
     "NoEPPrepareAndFinalize has no asynchronous prepare/finalize"),
    (_ll, BatchedTritonExperts, dict(micro_batches=3), "holds two dispatches' results; use 2"),
    (_ht, TritonExperts, dict(comm_sms=7), "comm_sms=7 must be a positive even int"),
    (_ht, TritonExperts, dict(min_micro_batch_tokens=0),
     "min_micro_batch_tokens=0 must be a positive int"),
    (NoEPPrepareAndFinalize, TritonExperts, dict(comm_sms=8), "has no buffer with set_num_sms"),
])
def test_overlap_arguments_refused(make_pf, experts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedMoEModularKernel(make_pf(), experts(), **kwargs)


def _shared_workspaces_worker(rank: int, world: int) -> None:
    """Two layers sharing one Workspaces, each splitting its call in two: they share the odd
    micro-batches' set too, and two layers in a row still give the plain layers' outputs."""
    os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = str(CHUNK)  # this forked rank's environment only
    wiring = dict(num_dispatchers=world, rank_expert_offset=rank * E_LOCAL)

    def kernels(**kwargs):
        shared = Workspaces()
        return [FusedMoEModularKernel(DeepEPHTPrepareAndFinalize(TorchAll2AllBuffer(), **wiring),
                                      TritonExperts(), shared, **kwargs) for _ in range(2)]

    plain, split = kernels(), kernels(micro_batches=2, min_micro_batch_tokens=1)
    assert split[0]._second_workspaces is split[1]._second_workspaces
    assert split[0]._second_workspaces is not split[0].workspaces
    num_experts, weights, x, topk_weights, ids = _inputs(rank, world)
    want = got = x
    for plain_layer, split_layer in zip(plain, split):
        want = _layer(plain_layer, (num_experts, weights, want, topk_weights, ids))
        got = _layer(split_layer, (num_experts, weights, got, topk_weights, ids))
    assert torch.isfinite(want.float()).all() and torch.equal(got, want)


def test_layers_sharing_workspaces_share_the_second_set():
    run_distributed(_shared_workspaces_worker, 2)


def test_comm_sms_is_declared_to_the_buffer():
    pf = _ht()
    kernel = FusedMoEModularKernel(pf, TritonExperts(), micro_batches=2, comm_sms=24)
    assert pf.buffer.num_sms == 24 and kernel.micro_batches == 2


def _delayed_worker(rank: int, world: int, per_dispatch: float) -> None:
    """Two asynchronous dispatches over the simulated link, each of per_dispatch seconds: the
    plain buffer's rows, the second transfer queued after the first, the waits returning no
    earlier than the link's end (CPU: on the host; CUDA: on the caller's stream, which the host
    does not wait for)."""
    from test_torch_buffer import make_problem

    from vllm_moe_fixes.distributed.delayed_buffer import DelayedAll2AllBuffer

    device = device_for(rank)
    xs, ids, ws = make_problem(3, [5, 3][:world], 4, 2, 256, device=device)
    x, idx, w = xs[rank], ids[rank], ws[rank]
    plain = TorchAll2AllBuffer()
    layout = plain.get_dispatch_layout(idx, 4)[:4]
    args = dict(num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1],
                is_token_in_rank=layout[3], num_tokens_per_expert=layout[2], topk_idx=idx,
                topk_weights=w)
    want = plain.dispatch(x, **args)[0]
    row_bytes = 256 * 2 + idx.shape[1] * (8 + 4)  # x, ids, weights packed
    spb = per_dispatch / (int(layout[0].sum()) * row_bytes)
    delayed = DelayedAll2AllBuffer(seconds_per_byte=spb)
    delayed.dispatch(x, **args)  # warm-up (CUDA: the link stream, the copy rate)
    delayed.bytes_sent = 0
    timer = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if x.is_cuda else None
    if timer:
        torch.cuda.synchronize()
        timer[0].record()
    began = time.perf_counter()
    first = delayed.dispatch(x, async_finish=True, **args)
    second = delayed.dispatch(x, async_finish=True, **args)
    assert delayed.bytes_sent * spb == pytest.approx(2 * per_dispatch)
    first[-1].current_stream_wait()
    second[-1].current_stream_wait()
    host = time.perf_counter() - began
    if timer:
        timer[1].record()
        timer[1].synchronize()
        assert host < per_dispatch  # the host did not wait for the link
        assert timer[0].elapsed_time(timer[1]) * 1e-3 >= 0.9 * 2 * per_dispatch
    else:
        assert host >= 2 * per_dispatch
    assert torch.equal(first[0], want) and torch.equal(second[0], want)


def test_delayed_buffer_books_a_serial_link():
    run_distributed(_delayed_worker, 2, 5e-4)


@pytest.mark.gpu
def test_delayed_buffer_spends_the_link_on_the_gpu():
    run_distributed(_delayed_worker, 1, 0.05, backend="nccl")


def _deep_ep_low_latency_worker(rank: int, world: int) -> None:
    """Over a real deep_ep.Buffer: the two-batch call equals the plain one bit for bit (each
    receive hook runs before DeepEP's next low-latency call: DeepEPLLPrepareAndFinalize)."""
    from vllm_moe_fixes.distributed.buffers import clear_all2all_buffers, make_all2all_buffer
    os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = str(CHUNK)  # this spawned rank's environment only
    device = torch.device("cuda", rank)
    num_experts, weights, x, topk_weights, ids = _inputs(rank, world, m=29)
    inputs = (num_experts, [t.to(device) for t in weights], x.to(device), topk_weights.to(device),
              ids.to(device))
    buffer = make_all2all_buffer("deepep_low_latency", None, max_tokens_per_rank=8, hidden=K,
                                 num_experts=num_experts)

    def kernel(**kwargs):
        pf = DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=world, max_tokens_per_rank=8)
        return FusedMoEModularKernel(pf, BatchedTritonExperts(), **kwargs)

    want = _layer(kernel(), inputs)
    got = _layer(kernel(micro_batches=2, min_micro_batch_tokens=1), inputs)
    torch.cuda.synchronize()
    assert torch.isfinite(want.float()).all() and torch.equal(got, want)
    clear_all2all_buffers()


@pytest.mark.gpu
@pytest.mark.deep_ep
def test_overlapped_call_equals_the_plain_call_over_deep_ep_low_latency():
    run_distributed(_deep_ep_low_latency_worker, 1, backend="nccl")


def test_delayed_buffer_refuses_a_negative_delay():
    from vllm_moe_fixes.distributed.delayed_buffer import DelayedAll2AllBuffer
    with pytest.raises(ValueError, match="seconds_per_byte=-1 must be a number >= 0"):
        DelayedAll2AllBuffer(seconds_per_byte=-1)
