"""prepare_async / finalize_async against prepare / finalize, bit for bit, with two micro-batches in
flight (both dispatched before either is received, both combines started before either is
waited for), for every expert-parallel prepare/finalize: high-throughput (the ``naive`` backend:
TorchAll2AllBuffer), low-latency (its low-latency mode), V2 (TorchElasticBuffer, with and without
the CPU sync) on gloo ranks; low-latency and high-throughput over real DeepEP on GPUs.

The experts are a stand-in (the dequantised rows times a factor per expert, the same arithmetic
in both runs): what is compared is the transfer, not the GEMMs.
"""

import faulthandler

import pytest
import torch
from _dist import device_for, run_distributed

from vllm_moe_fixes.distributed.buffers import clear_all2all_buffers, make_all2all_buffer
from vllm_moe_fixes.distributed.torch_buffer import Completion, TorchAll2AllBuffer
from vllm_moe_fixes.distributed.torch_elastic_buffer import TorchElasticBuffer
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import (
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
    DeepEPV2PrepareAndFinalize,
)
from vllm_moe_fixes.fused_moe.interfaces import ActivationFormat
from vllm_moe_fixes.ops.fp8 import SCALE_BLOCK

E_LOCAL, TOPK, N = 3, 3, 8  # experts per rank, k, max tokens per rank and micro-batch


def _dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s.float().repeat_interleave(SCALE_BLOCK, -1)


def _experts(prep, num_experts: int, topk_ids) -> torch.Tensor:
    """The stand-in experts' unreduced output: STANDARD [M', k, K], row * (id + 1) / E in each
    slot (exact zeros at -1); BATCHED [E_l, T, K], row * (e + 1)."""
    x = _dequant(prep.a1q, prep.a1q_scale)
    if prep.expert_num_tokens is not None:
        factor = torch.arange(1, x.shape[0] + 1, device=x.device).view(-1, 1, 1)
        return (x * factor).to(torch.bfloat16)
    factor = torch.where(topk_ids >= 0, (topk_ids + 1).float() / num_experts, 0.0)
    return (x.unsqueeze(1) * factor.unsqueeze(-1)).to(torch.bfloat16)


def _micro_batches(rank: int, world: int, hidden: int, device) -> list:
    """Two micro-batches of this rank: (x bf16 [T, K], weights f32 [T, k], ids int64 [T, k]),
    T from 0, 1 and odd counts up to N; some slots -1."""
    g = torch.Generator().manual_seed(50 + rank)
    sizes = [(N, 1), (5, 0), (1, 7), (3, N)][rank % 4]
    num_experts = E_LOCAL * world
    out = []
    for t in sizes:
        x = torch.randn(t, hidden, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:TOPK] for _ in range(t)]) \
            if t else torch.zeros(0, TOPK, dtype=torch.int64)
        ids[torch.rand(t, TOPK, generator=g) < 0.2] = -1
        w = torch.rand(t, TOPK, generator=g) + 0.1
        out.append((x.to(device), w.to(device), ids.to(device)))
    return out


def _run(pf, batches, num_experts: int, overlapped: bool) -> list:
    """Each micro-batch's (received a1q as bytes, scales, ids, counts, output). overlapped: both
    prepares before either receiver, both finalizes before either receiver."""
    preps, outs = [], []
    if overlapped:
        receivers = [pf.prepare_async(x, w, ids, num_experts, None, False)
                     for x, w, ids in batches]
        preps = [receive() for receive in receivers]
    else:
        preps = [None] * len(batches)
    finishing = []
    for i, (x, w, ids) in enumerate(batches):
        if not overlapped:
            preps[i] = pf.prepare(x, w, ids, num_experts, None, False)
        prep = preps[i]
        got_ids = prep.topk_ids if prep.topk_ids is not None else ids
        got_w = prep.topk_weights if prep.topk_weights is not None else w
        snapshot = _received(prep)  # before a later dispatch may reuse the buffer
        fused = _experts(prep, num_experts, got_ids)
        out = torch.full_like(x, float("nan"))
        if overlapped:
            finishing.append(pf.finalize_async(out, fused, got_w, got_ids, False,
                                               handle=prep.handle))
        else:
            pf.finalize(out, fused, got_w, got_ids, False)
        outs.append((snapshot, out))
    for receive in finishing:
        receive()
    return outs


def _received(prep) -> list:
    """What a prepare received, comparable bit for bit: a BATCHED slice's valid rows, each with
    its scales, as a sorted multiset. DeepEP's low-latency send numbers an expert's rows with an
    atomicAdd per (token, expert) (internode_ll.cu, v1.2.1), so their order within a slice
    differs from call to call; the combine finds each row's token through the handle."""
    if prep.expert_num_tokens is None:
        return [prep.a1q.view(torch.uint8).clone(), prep.a1q_scale.clone(),
                prep.topk_ids.clone(), prep.topk_weights.clone()]
    slices = []
    for e, c in enumerate(prep.expert_num_tokens.tolist()):
        scales = prep.a1q_scale[e, :c]  # MN-major: copied row-major to view as bytes
        scales = torch.empty(scales.shape, dtype=scales.dtype, device=scales.device).copy_(scales)
        rows = torch.cat([prep.a1q[e, :c].view(torch.uint8), scales.view(torch.uint8)], dim=1)
        slices.append(list(torch.unique(rows, dim=0, return_counts=True)) if c else [rows])
    return [prep.expert_num_tokens.clone(), slices]


def _same(a, b) -> bool:
    """Bit for bit (NaN poison past V2's valid rows included)."""
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _poison(buffer) -> None:
    """Overwrite what a torch buffer's low-latency workspaces hold (the synchronous run's
    results), so that an overlapped run that skipped a receive step cannot pass on them."""
    for pair in getattr(buffer, "_ll_workspaces", {}).values():
        for workspace in pair:
            for t in vars(workspace).values():
                if not isinstance(t, torch.Tensor):
                    continue
                if t.dtype == torch.bool:
                    t.fill_(True)
                elif t.element_size() == 1:  # bytes and fp8: NaN
                    t.view(torch.uint8).fill_(0x7F)
                else:
                    t.fill_(float("nan") if t.is_floating_point() else 12345)


def _compare(pf, batches, num_experts: int) -> None:
    sync = _run(pf, batches, num_experts, overlapped=False)
    _poison(pf.buffer)
    overlapped = _run(pf, batches, num_experts, overlapped=True)
    for i, ((got_in, got_out), (want_in, want_out)) in enumerate(zip(overlapped, sync)):
        name = f"{type(pf).__name__} micro-batch {i}"
        assert _same(got_in, want_in), f"{name}: received rows differ"
        assert _same(got_out, want_out), f"{name}: outputs differ"
        if got_out.numel():
            assert torch.isfinite(got_out.float()).all(), f"{name}: output not written"


class _OneCallInFlight(TorchAll2AllBuffer):
    """TorchAll2AllBuffer whose low-latency calls fail where DeepEP v1.2.1 hangs: a call issued
    while an earlier call's receive hook has not run (its send zeroes the counters that hook waits
    on: DeepEPLLPrepareAndFinalize's docstring cites the lines), or a hook run twice."""

    _pending = None

    def _issue(self, result: tuple) -> tuple:
        hook = result[-1]
        if hook is None:
            return result

        def once() -> None:
            assert self._pending is once, "receive hook run twice, or after a later call"
            self._pending = None
            hook()

        self._pending = once
        return (*result[:-1], once)

    def _check_idle(self) -> None:
        assert self._pending is None, ("a low-latency call issued before the previous call's "
                                       "receive hook ran (DeepEP hangs there)")

    def low_latency_dispatch(self, *args, **kwargs):
        self._check_idle()
        return self._issue(super().low_latency_dispatch(*args, **kwargs))

    def low_latency_combine(self, *args, **kwargs):
        self._check_idle()
        return self._issue(super().low_latency_combine(*args, **kwargs))


def _torch_buffers_worker(rank: int, world: int) -> None:
    hidden, num_experts = 2048, E_LOCAL * world  # a hidden size DeepEP LL serves
    device = device_for(rank)
    batches = _micro_batches(rank, world, hidden, device)
    wiring = dict(num_dispatchers=world, rank_expert_offset=rank * E_LOCAL)
    ht = DeepEPHTPrepareAndFinalize(TorchAll2AllBuffer(), **wiring)
    ll_buffer = _OneCallInFlight(low_latency_mode=True, num_max_dispatch_tokens_per_rank=N,
                                   hidden=hidden, num_experts=num_experts)
    elastic = TorchElasticBuffer(num_max_tokens_per_rank=N, hidden=hidden, num_topk=TOPK,
                                 use_fp8_dispatch=True)
    for pf in (ht,
               DeepEPLLPrepareAndFinalize(ll_buffer, num_dispatchers=world,
                                          max_tokens_per_rank=N),
               DeepEPLLPrepareAndFinalize(ll_buffer, num_dispatchers=world,
                                          max_tokens_per_rank=N, use_fp8_dispatch=False),
               DeepEPV2PrepareAndFinalize(elastic, max_tokens_per_rank=N, **wiring),
               DeepEPV2PrepareAndFinalize(elastic, max_tokens_per_rank=N, do_cpu_sync=False,
                                          **wiring)):
        assert pf.supports_async()
        _compare(pf, batches, num_experts)


@pytest.mark.parametrize("world", [2, 4])
def test_async_equals_sync_on_torch_buffers(world):
    run_distributed(_torch_buffers_worker, world)


HANG_SECONDS = 120  # a rank still running then is a hang: it exits with its stacks, and fails


def _deep_ep_worker(rank: int, world: int, backend: str) -> None:
    """The same comparison over a real deep_ep.Buffer (hidden 2048: a size DeepEP's low-latency
    kernels are compiled for)."""
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    hidden, num_experts = 2048, E_LOCAL * world
    batches = _micro_batches(rank, world, hidden, torch.device("cuda", rank))
    buffer = make_all2all_buffer(backend, None, max_tokens_per_rank=N, hidden=hidden,
                                 num_experts=num_experts)
    assert type(buffer).__module__.startswith("deep_ep")
    if backend == "deepep_low_latency":
        pf = DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=world, max_tokens_per_rank=N)
        assert pf.activation_format == ActivationFormat.BATCHED
    else:
        pf = DeepEPHTPrepareAndFinalize(buffer, num_dispatchers=world,
                                        rank_expert_offset=rank * E_LOCAL)
    _compare(pf, batches, num_experts)
    torch.cuda.synchronize()
    clear_all2all_buffers()
    faulthandler.cancel_dump_traceback_later()


@pytest.mark.gpu
@pytest.mark.deep_ep
def test_async_equals_sync_on_deep_ep_low_latency_world_1():
    run_distributed(_deep_ep_worker, 1, "deepep_low_latency", backend="nccl")


@pytest.mark.multi_gpu
@pytest.mark.deep_ep
@pytest.mark.parametrize("backend", ["deepep_high_throughput", "deepep_low_latency"])
def test_async_equals_sync_on_deep_ep_two_ranks(backend):
    # DeepEP v1.2.1 runs high-throughput intranode with 2 to 8 ranks only.
    run_distributed(_deep_ep_worker, 2, backend, backend="nccl")


def test_a_completion_runs_once_and_reports_pending():
    calls = []
    done = Completion(lambda: calls.append(1))
    assert done.event is done
    done()
    done.current_stream_wait()
    assert calls == [1] and done.event is None


def test_finalize_async_of_a_one_prepare_class_takes_no_handle():
    from vllm_moe_fixes.fused_moe.no_ep_prepare_finalize import NoEPPrepareAndFinalize
    pf = NoEPPrepareAndFinalize()
    assert not pf.supports_async()
    out = torch.empty(2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="takes no handle"):
        pf.finalize_async(out, out, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int64),
                          False, output_is_reduced=True, handle=object())
