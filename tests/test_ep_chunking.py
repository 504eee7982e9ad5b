"""Expert-parallel layer calls longer than one pass: every rank runs the same number of chunks.

Ranks hold unequal token counts (none, fewer than one chunk, several chunks); each runs the whole
FusedMoEModularKernel over a TorchAll2AllBuffer on gloo, with the group's maximum given
(max_tokens_across_ranks) and found by the prepare/finalize's all-reduce, and compares with a
single-process computation of its tokens. The buffers are counted: every rank makes
cdiv(max tokens, chunk) dispatches, and the low-latency buffer is sized for one chunk only.
"""

import os

import pytest
from _dist import run_distributed
from test_ep_kernel import check, local_slice, make_weights
from test_torch_buffer import make_problem

from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer
from vllm_moe_fixes.fused_moe.batched_experts import BatchedTritonExperts
from vllm_moe_fixes.fused_moe.contiguous_experts import TritonExperts
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import (
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
    group_max_tokens,
)
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel

CHUNK = 4                          # dispatch chunk (LL: max_tokens_per_rank; HT: VLLM_FUSED_MOE_CHUNK_SIZE)
TOKENS = [13, 0, 3, 9]             # per rank (the first `world`): several chunks, none, < 1 chunk
E, K_TOP = 8, 2


def _counting(buffer, method):
    """Wrap buffer.<method> so that buffer.calls counts its calls."""
    inner = getattr(buffer, method)
    buffer.calls = 0

    def counted(*args, **kwargs):
        buffer.calls += 1
        return inner(*args, **kwargs)

    setattr(buffer, method, counted)
    return buffer


def _run(rank, world, pf, experts, hidden, seed):
    """This rank's share through the kernel, twice (maximum given / found); returns the number of
    passes each call made."""
    xs, ids, ws = make_problem(seed, TOKENS[:world], E, K_TOP, hidden, "uneven")
    x, idx, w = xs[rank], ids[rank], ws[rank]
    full = make_weights(seed, E, hidden, "cpu")
    lw1, ls1, lw2, ls2, expert_map = local_slice(rank, world, E, *full)
    kernel = FusedMoEModularKernel(pf, experts)
    passes = []
    for given in (max(TOKENS[:world]), None, max(TOKENS[:world]) + CHUNK):
        before = pf.buffer.calls
        out = kernel(x, lw1, lw2, w, idx.int() if given is None else idx, w1_scale=ls1, w2_scale=ls2,
                     global_num_experts=E, expert_map=expert_map, max_tokens_across_ranks=given)
        check(out, x, *full, idx, w)
        passes.append(pf.buffer.calls - before)
    return passes


def _worker(rank, world):
    os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = str(CHUNK)  # this forked rank's environment only
    want = -(-max(TOKENS[:world]) // CHUNK)
    ht = _counting(TorchAll2AllBuffer(None), "dispatch")
    ht_pf = DeepEPHTPrepareAndFinalize(ht, num_dispatchers=world, rank_expert_offset=rank * (E // world))
    assert _run(rank, world, ht_pf, TritonExperts(), 256, 20) == [want, want, want + 1]

    ll = _counting(TorchAll2AllBuffer(None, low_latency_mode=True, num_max_dispatch_tokens_per_rank=CHUNK,
                                      hidden=2048, num_experts=E), "low_latency_dispatch")
    ll_pf = DeepEPLLPrepareAndFinalize(ll, num_dispatchers=world, max_tokens_per_rank=CHUNK)
    assert _run(rank, world, ll_pf, BatchedTritonExperts(), 2048, 21) == [want, want, want + 1]

    assert group_max_tokens(None, 10 * rank + 1) == 10 * (world - 1) + 1
    assert ll_pf.num_chunks(3, CHUNK, None) == 1 and ll_pf.num_chunks(0, CHUNK, 0) == 0


@pytest.mark.parametrize("world", [2, 4])
def test_chunks_agreed_across_ranks(world):
    run_distributed(_worker, world)
