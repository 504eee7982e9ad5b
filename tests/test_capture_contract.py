"""What the layer decides when a CUDA graph capture is under way, checked on CPU ranks (gloo).

A CPU cannot capture, but the layer's rules for a captured call can run on CPU tensors: torch is
made to report a capture (``torch.backends.cuda.is_built`` and
``torch.cuda.is_current_stream_capturing`` patched to return True) and the all-reduce that agrees
the pass count is replaced by one that fails the test. Checked here:
- a group of one rank agrees nothing: no all-reduce, eager or captured, whatever
  max_tokens_across_ranks says (the count is its own tokens over the pass size);
- low-latency without max_tokens_across_ranks under capture: one pass of at most
  min(VLLM_FUSED_MOE_CHUNK_SIZE, max_tokens_per_rank) tokens, no collective besides the dispatch
  and the combine; a longer call raises a ValueError naming max_tokens_across_ranks before any
  collective; with the maximum given, its passes and still no all-reduce;
- high-throughput under capture (and DeepEP V2 with do_cpu_sync=True) is refused before any
  collective, naming the way out;
- the checked modes (VLLM_MOE_CHECK_IDS, VLLM_MOE_CHECK_FINITE), which read values on the host,
  are refused under capture before any collective;
- after each refusal the same kernel runs a good eager call.
The capture itself, with real DeepEP on GPUs: tests/test_decode_capture.py.
"""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from test_ep_chunking import _counting
from test_ep_kernel import check, local_slice, make_weights
from test_torch_buffer import make_problem

from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer
from vllm_moe_fixes.fused_moe.batched_experts import BatchedTritonExperts
from vllm_moe_fixes.fused_moe.contiguous_experts import TritonExperts
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import (
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
    DeepEPV2PrepareAndFinalize,
)
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.fused_moe.no_ep_prepare_finalize import NoEPPrepareAndFinalize

HIDDEN, E, K_TOP = 2048, 8, 2      # a hidden size DeepEP's low-latency kernels take
GROUP_TIMEOUT = datetime.timedelta(seconds=30)  # a rank left waiting fails within this
HT_REFUSAL = r"CUDA graph capture.*low-latency mode.*eagerly"
_ALL_REDUCE = dist.all_reduce


def _pretend_capture(on: bool = True) -> None:
    """From here on (this forked rank only) torch reports a CUDA graph capture under way, or,
    with on=False, reports none again."""
    if on:
        torch.backends.cuda.is_built = lambda: True
        torch.cuda.is_current_stream_capturing = lambda: True
    else:
        torch.cuda.is_current_stream_capturing = lambda: False


def _forbid_all_reduce() -> None:
    """Any all-reduce from here on (this forked rank only) fails the test."""
    def refused(*args, **kwargs):
        raise AssertionError("the layer all-reduced")

    dist.all_reduce = refused
    dist.distributed_c10d.all_reduce = refused


def _call(kernel, x, idx, w, local, given=None):
    lw1, ls1, lw2, ls2, expert_map = local
    return kernel(x, lw1, lw2, w, idx, w1_scale=ls1, w2_scale=ls2, global_num_experts=E,
                  expert_map=expert_map, max_tokens_across_ranks=given)


def _passes(buffer, fn):
    """fn's result and the number of dispatches it made on buffer (a _counting buffer)."""
    before = buffer.calls
    out = fn()
    return out, buffer.calls - before


def _one_rank_worker(rank, world):
    os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = "4"
    _forbid_all_reduce()
    xs, ids, ws = make_problem(30, [13], E, K_TOP, HIDDEN)
    x, idx, w = xs[0], ids[0], ws[0]
    full = make_weights(30, E, HIDDEN, "cpu")
    local = local_slice(0, 1, E, *full)
    ll = _counting(TorchAll2AllBuffer(None, low_latency_mode=True,
                                      num_max_dispatch_tokens_per_rank=4, hidden=HIDDEN,
                                      num_experts=E), "low_latency_dispatch")
    ht = _counting(TorchAll2AllBuffer(None), "dispatch")
    ll_kernel = FusedMoEModularKernel(
        DeepEPLLPrepareAndFinalize(ll, num_dispatchers=1, max_tokens_per_rank=4),
        BatchedTritonExperts())
    ht_kernel = FusedMoEModularKernel(
        DeepEPHTPrepareAndFinalize(ht, num_dispatchers=1, rank_expert_offset=0), TritonExperts())
    for kernel, buffer in ((ll_kernel, ll), (ht_kernel, ht)):
        for given in (None, 13, 10 ** 12):  # one rank: the maximum is its own M, whatever given
            out, passes = _passes(buffer, lambda: _call(kernel, x, idx, w, local, given))
            check(out, x, *full, idx, w)
            assert passes == 4, (type(kernel.prepare_finalize).__name__, given, passes)
        out, passes = _passes(buffer, lambda: _call(kernel, x[:0], idx[:0], w[:0], local))
        assert out.shape == (0, HIDDEN) and passes == 0  # nobody to keep in step with
    eager = _call(ll_kernel, x, idx, w, local)
    _pretend_capture()
    for given in (None, 10 ** 12):  # captured: the same passes, bit for bit the same output
        out, passes = _passes(ll, lambda: _call(ll_kernel, x, idx, w, local, given))
        assert passes == 4 and torch.equal(out, eager)
    with pytest.raises(ValueError, match=HT_REFUSAL):
        _call(ht_kernel, x, idx, w, local)
    assert ht.calls == 12
    _pretend_capture(False)
    check(_call(ht_kernel, x, idx, w, local), x, *full, idx, w)  # usable after the refusal


def test_group_of_one_rank_never_all_reduces():
    run_distributed(_one_rank_worker, 1)


def _two_rank_capture_worker(rank, world):
    group = dist.new_group(timeout=GROUP_TIMEOUT)
    n = 4
    buffer = _counting(TorchAll2AllBuffer(group, low_latency_mode=True,
                                          num_max_dispatch_tokens_per_rank=n, hidden=HIDDEN,
                                          num_experts=E), "low_latency_dispatch")
    kernel = FusedMoEModularKernel(
        DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=world, max_tokens_per_rank=n),
        BatchedTritonExperts())
    full = make_weights(31, E, HIDDEN, "cpu")
    local = local_slice(rank, world, E, *full)

    def problem(seed, tokens):
        xs, ids, ws = make_problem(seed, tokens, E, K_TOP, HIDDEN)
        return xs[rank], ids[rank], ws[rank]

    _forbid_all_reduce()
    _pretend_capture()
    x, idx, w = problem(32, [4, 3])  # at most max_tokens_per_rank on every rank: one pass
    out, passes = _passes(buffer, lambda: _call(kernel, x, idx, w, local))
    check(out, x, *full, idx, w)
    assert passes == 1

    x, idx, w = problem(33, [5, 6])  # more: refused before the dispatch
    with pytest.raises(ValueError, match=r"max_tokens_across_ranks.*M=[56]"):
        _call(kernel, x, idx, w, local)
    out, passes = _passes(buffer, lambda: _call(kernel, x, idx, w, local, given=6))
    check(out, x, *full, idx, w)
    assert passes == 2  # the maximum given: its passes, still no all-reduce

    os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = "2"  # a pass is also at most the chunk size
    x, idx, w = problem(34, [3, 4])
    with pytest.raises(ValueError, match=r"max_tokens_across_ranks.*at most 2 tokens"):
        _call(kernel, x, idx, w, local)
    del os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"]

    for name in ("VLLM_MOE_CHECK_IDS", "VLLM_MOE_CHECK_FINITE"):  # they read values on the host
        os.environ[name] = "1"
        with pytest.raises(ValueError, match=rf"{name}=1.*CUDA graph capture"):
            _call(kernel, x, idx, w, local)
        del os.environ[name]
    assert buffer.calls == 3  # no refused call dispatched anything

    _pretend_capture(False)
    dist.all_reduce = dist.distributed_c10d.all_reduce = _ALL_REDUCE
    out, passes = _passes(buffer, lambda: _call(kernel, x, idx, w, local))  # eager: agreed
    check(out, x, *full, idx, w)
    assert passes == 1



def test_low_latency_capture_contract_two_ranks():
    run_distributed(_two_rank_capture_worker, 2)


class _RecordingBuffer:
    """The methods a prepare/finalize looks for; records every call (a refused call makes
    none)."""

    METHODS = ("get_dispatch_layout", "dispatch", "combine", "get_buffer_size_hint")

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if name in self.METHODS:
            return lambda *args, **kwargs: self.calls.append(name)
        raise AttributeError(name)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("given", [None, 5])
def test_high_throughput_refused_under_capture_before_any_collective(world, given, monkeypatch):
    """No process group exists here: an all-reduce or a dispatch would fail differently."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    collectives = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: collectives.append("all_reduce"))
    buffer = _RecordingBuffer()
    kernel = FusedMoEModularKernel(
        DeepEPHTPrepareAndFinalize(buffer, num_dispatchers=world, rank_expert_offset=0),
        TritonExperts())
    xs, ids, ws = make_problem(35, [5] * world, E, K_TOP, 256)
    local = local_slice(0, world, E, *make_weights(35, E, 256, "cpu"))
    with pytest.raises(ValueError, match=HT_REFUSAL):
        _call(kernel, xs[0], ids[0], ws[0], local, given)
    assert buffer.calls == [] and collectives == []


def test_deepep_v2_with_host_sync_refused_under_capture(monkeypatch):
    """DeepEP V2 waits for the receive counts on the host unless do_cpu_sync=False."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    buffer = _RecordingBuffer()
    make = lambda sync: DeepEPV2PrepareAndFinalize(  # noqa: E731
        buffer, num_dispatchers=1, rank_expert_offset=0, max_tokens_per_rank=8,
        do_cpu_sync=sync)
    kernel = FusedMoEModularKernel(make(True), TritonExperts())
    xs, ids, ws = make_problem(37, [5], E, K_TOP, 256)
    local = local_slice(0, 1, E, *make_weights(37, E, 256, "cpu"))
    with pytest.raises(ValueError, match=r"do_cpu_sync=True.*CUDA graph capture.*"
                                         r"do_cpu_sync=False.*eagerly"):
        _call(kernel, xs[0], ids[0], ws[0], local)
    assert buffer.calls == []
    make(False).check_capturable()  # reads nothing on the host: capturable


def test_one_rank_without_ep_runs_its_chunks_under_capture(monkeypatch):
    """NoEP has no collective: a captured call runs every chunk, as eagerly."""
    xs, ids, ws = make_problem(36, [7], E, K_TOP, 256)
    full = make_weights(36, E, 256, "cpu")
    kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(), TritonExperts())
    local = local_slice(0, 1, E, *full)
    monkeypatch.setenv("VLLM_FUSED_MOE_CHUNK_SIZE", "3")
    eager = _call(kernel, xs[0], ids[0], ws[0], local)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert torch.equal(_call(kernel, xs[0], ids[0], ws[0], local), eager)
    assert torch.equal(_call(kernel, xs[0], ids[0], ws[0], local, given=7), eager)
    check(eager, xs[0], *full, ids[0], ws[0])
