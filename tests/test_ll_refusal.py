"""DeepEPLLPrepareAndFinalize over DeepEP's own buffer refuses a dispatch in which a rank sends more
than N rows to one expert (a top-k repeating an expert: one row per slot), on every rank and before
DeepEP is called, where values are checked; DeepEP itself would write past its receive area.

On gloo ranks the buffer is a TorchAll2AllBuffer that is_deep_ep_buffer takes for DeepEP's own
and that counts its dispatches; the twin runs over a real deep_ep.Buffer on one GPU.
"""

import os

import pytest
import torch
from _dist import device_for, run_distributed

from vllm_moe_fixes.distributed.buffers import clear_all2all_buffers, make_all2all_buffer
from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import DeepEPLLPrepareAndFinalize
from vllm_moe_fixes.ops.fp8 import SCALE_BLOCK

N, E_LOCAL, TOPK, HIDDEN = 4, 2, 3, 2048  # HIDDEN: the smallest DeepEP's low-latency kernels take


class _NamedLikeDeepEP(TorchAll2AllBuffer):
    """A torch buffer that is_deep_ep_buffer takes for DeepEP's own."""

    __module__ = "deep_ep.buffer"


def _count_dispatches(buffer) -> list:
    """Wrap this buffer object's low_latency_dispatch: the returned list gains one entry a call."""
    calls, dispatch = [], buffer.low_latency_dispatch

    def counted(*args, **kwargs):
        calls.append(None)
        return dispatch(*args, **kwargs)

    buffer.low_latency_dispatch = counted
    return calls


def _zero_routing(tokens: int, seed: int, device):
    """x bf16 [tokens, HIDDEN] random, weights f32 [tokens, k] random, ids int64 zeros (every
    slot of every token names expert 0, as a dummy run's ids do)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    w = torch.rand(tokens, TOPK, generator=g)
    ids = torch.zeros(tokens, TOPK, dtype=torch.int64)
    return x.to(device), w.to(device), ids.to(device)


def _check_refused_then_served(buffer, rank: int, world: int, too_many_on: int) -> None:
    """Rank ``too_many_on`` sends 2k > N rows to expert 0, the others k <= N: ValueError on every
    rank naming that rank, DeepEP not called. Then k <= N rows from every rank: served, expert 0
    holds world*k rows, each slot's weight counted in the combine."""
    dispatches = _count_dispatches(buffer)
    pf = DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=world, max_tokens_per_rank=N)
    device = device_for(rank)
    num_experts = E_LOCAL * world
    x, w, ids = _zero_routing(2 if rank == too_many_on else 1, seed=rank, device=device)
    match = (rf"num_max_dispatch_tokens_per_rank={N} \(rank {too_many_on} sends {2 * TOPK} to "
             r"expert 0\): a token's top-k repeats an expert")
    with pytest.raises(ValueError, match=match):
        pf.prepare(x, w, ids, num_experts, None, False)
    assert not dispatches
    x, w, ids = x[:1], w[:1], ids[:1]
    prep = pf.prepare(x, w, ids, num_experts, None, False)
    want_counts = [world * TOPK if rank == 0 else 0, 0]
    assert prep.expert_num_tokens.tolist() == want_counts
    rows = prep.a1q.float() * prep.a1q_scale.float().repeat_interleave(SCALE_BLOCK, -1)
    out = torch.full_like(x, float("nan"))
    pf.finalize(out, rows.to(torch.bfloat16), w, ids, False)
    torch.testing.assert_close(out.float(), x.float() * w.sum(1, keepdim=True), rtol=0.07,
                               atol=0.02)
    assert len(dispatches) == 1


def _gloo_worker(rank: int, world: int) -> None:
    buffer = _NamedLikeDeepEP(None, low_latency_mode=True, num_max_dispatch_tokens_per_rank=N,
                              hidden=HIDDEN, num_experts=E_LOCAL * world)
    _check_refused_then_served(buffer, rank, world, too_many_on=1)


def test_too_many_rows_for_one_expert_refused_on_every_rank():
    run_distributed(_gloo_worker, 2)


def _deep_ep_worker(rank: int, world: int) -> None:
    os.environ["VLLM_MOE_CHECK_IDS"] = "1"  # CUDA ids are checked only when asked
    buffer = make_all2all_buffer("deepep_low_latency", None, max_tokens_per_rank=N,
                                 hidden=HIDDEN, num_experts=E_LOCAL * world)
    assert type(buffer).__module__.startswith("deep_ep")
    try:
        _check_refused_then_served(buffer, rank, world, too_many_on=0)
    finally:
        torch.cuda.synchronize()
        clear_all2all_buffers()


@pytest.mark.gpu
@pytest.mark.deep_ep
def test_too_many_rows_for_one_expert_refused_over_deep_ep():
    run_distributed(_deep_ep_worker, 1, backend="nccl")
