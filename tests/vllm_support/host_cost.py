"""Host cost of one MoE layer call through vLLM's FusedMoEKernel with this library's adapters
against our own FusedMoEModularKernel: same problem, same kernels (GPU only).

    python tests/vllm_support/host_cost.py OUT.json [--experts triton,deep_gemm] [--calls 200]
        [--tokens 128]

Both run under torch.inference_mode, as vLLM's model runner runs a forward. Per experts kind, each
variant is warmed up, then timed three ways:
- ``host_us``: the call alone, started on an idle GPU (synchronised before each call), median:
  the Python and launch work of one call, which no GPU queue can hide or stretch;
- ``loop_us``: a plain launch loop up to one final synchronisation, per call (the larger of host
  and GPU time per call);
- ``gpu_us``: the same loop between two CUDA events.
``adapter_fresh_views`` times the adapter without its reuse of vLLM's workspace views (as it was
before it reused them).
Then where the host time goes (``split``: the calls as they run, with timers around the methods
each kernel calls):
- ``library_under_*_us``: inside the library's prepare, experts apply and finalize (the same
  work under both kernels: quantisation, layout, GEMM launches...);
- ``ours_kernel_us``: the rest of our FusedMoEModularKernel's call (its checks, workspaces);
- ``vllm_kernel_us``: the rest of vLLM's FusedMoEKernel's call, outside the adapters' methods;
- ``adapters_us``: inside the adapters' methods, outside the library's.
``split_python_alone`` gives the same three in loops of the Python alone (the library's work, and
for vllm_kernel_us the adapters' too, replaced by stubs: caches warm, nothing launched).
The target (issue 28): the adapter's host_us at most 1.05x ours.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _host_us(fn, calls: int) -> float:
    """Median wall time of one call started on an idle GPU."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _loop_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def _gpu_us(fn, calls: int) -> float:
    """GPU time per call, from CUDA events around the same loop."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / calls * 1e3


def _python_us(fn, calls: int) -> float:
    """Per call of a loop that launches nothing on the GPU (best of five rounds)."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


def _time_inside(fn, outer, inner, calls: int) -> tuple[float, float, float]:
    """Mean per call of fn started on an idle GPU: its wall time, and the time spent inside the
    methods ``outer`` and ``inner`` name ((object, name) pairs; each inner method runs inside an
    outer one, when there are outer ones). The methods are wrapped as instance attributes for
    the measurement, then unwrapped."""
    spent = {"outer": 0.0, "inner": 0.0}

    def timed(obj, name, bucket):
        method = getattr(obj, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[bucket] += time.perf_counter() - start

        setattr(obj, name, wrapper)

    for bucket, methods in (("outer", outer), ("inner", inner)):
        for obj, name in methods:
            timed(obj, name, bucket)
    total = 0.0
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
    torch.cuda.synchronize()
    for obj, name in outer + inner:
        delattr(obj, name)
    return tuple(t / calls * 1e6 for t in (total, spent["outer"], spent["inner"]))


def measure(experts: str, M: int, calls: int) -> dict:
    """The host_us / loop_us / gpu_us rows and the split for one experts kind."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
        fp8_w8a8_moe_quant_config,
    )

    from vllm_moe_fixes import fused_moe as ours
    from vllm_moe_fixes.integrations.vllm import experts as adapters
    from vllm_moe_fixes.integrations.vllm import prepare_finalize as pfs
    from vllm_moe_fixes.testing import random_fp8_moe_weights

    E, K, I, k = 32, 7168, 2048, 8  # DeepSeek-V3's expert shapes, 32 local
    w = random_fp8_moe_weights(E, K, I, device="cuda")
    x = torch.randn(M, K, device="cuda").bfloat16()
    tw, ti = ours.fused_topk(torch.randn(M, E, device="cuda"), k, renormalize=True)
    ids = ti.to(torch.int32)
    cfg = FusedMoEConfig(
        num_experts=E, experts_per_token=k, hidden_dim=K, intermediate_size=I,
        num_local_experts=E, num_logical_experts=E, activation=MoEActivation.SILU,
        device="cuda", routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=torch.bfloat16,
        intermediate_size_per_partition=I)
    qc = fp8_w8a8_moe_quant_config(w1_scale=w.w1_scale, w2_scale=w.w2_scale,
                                   block_shape=[128, 128])
    vllm_cls, our_cls = ((adapters.VllmDeepGemmExperts, ours.DeepGemmExperts)
                         if experts == "deep_gemm"
                         else (adapters.VllmTritonExperts, ours.TritonExperts))
    theirs = mk.FusedMoEKernel(pfs.VllmNoEPPrepareAndFinalize(), vllm_cls(cfg, qc))
    mine = ours.FusedMoEModularKernel(ours.NoEPPrepareAndFinalize(), our_cls())

    def adapter_call():
        return theirs.apply(x, w.w1, w.w2, tw, ids, MoEActivation.SILU, E, None, False)

    def our_call():
        return mine(x, w.w1, w.w2, tw, ids, w1_scale=w.w1_scale, w2_scale=w.w2_scale,
                    global_num_experts=E)

    for _ in range(3):  # compile, JIT, grow the workspaces
        adapter_call()
        our_call()
    assert torch.equal(adapter_call(), our_call())
    rows = {}
    for name, fn in (("adapter", adapter_call), ("ours", our_call)):
        rows[name] = {"host_us": _host_us(fn, calls), "loop_us": _loop_us(fn, calls),
                      "gpu_us": _gpu_us(fn, calls)}
    for what in ("host_us", "loop_us"):
        rows[f"ratio_{what[:-3]}"] = rows["adapter"][what] / rows["ours"][what]
    # What reusing vLLM's workspace views saves: the adapter as it was without it (our experts
    # rebuild their views on each call's fresh workspace objects).
    theirs.fused_experts._workspaces_kept_by_vllm = False
    rows["adapter_fresh_views"] = {"host_us": _host_us(adapter_call, calls),
                                   "loop_us": _loop_us(adapter_call, calls)}
    theirs.fused_experts._workspaces_kept_by_vllm = True

    # Where the host time goes, in the calls as they run: the time inside the library's
    # prepare / experts apply / finalize ("library") and inside the adapters' methods vLLM calls.
    library_of_ours = [(mine.prepare_finalize, "prepare"), (mine.experts, "apply"),
                       (mine.prepare_finalize, "finalize")]
    adapter_pf, adapter_ex = theirs.prepare_finalize, theirs.fused_experts
    library_of_adapter = [(adapter_pf.ours, "prepare"), (adapter_ex.experts, "apply"),
                          (adapter_pf.ours, "finalize")]
    adapter_methods = [(adapter_pf, "prepare"), (adapter_pf, "finalize"), (adapter_ex, "apply"),
                       (adapter_ex, "workspace_shapes")]
    total, _, library = _time_inside(our_call, [], library_of_ours, calls)
    split = {"ours_kernel_us": total - library, "library_under_ours_us": library}
    total, adapters, library = _time_inside(adapter_call, adapter_methods, library_of_adapter,
                                            calls)
    split.update(vllm_kernel_us=total - adapters, adapters_us=adapters - library,
                 library_under_vllm_us=library)
    rows["split"] = split

    # The same split in a loop of the Python alone (caches warm, nothing launched): the
    # library's work stubbed under both kernels (instance attributes), then the adapters' too.
    prepared = mine.prepare_finalize.prepare(x, tw, ids, E, None, False)
    for pf in (mine.prepare_finalize, theirs.prepare_finalize.ours):
        pf.prepare = lambda *args, **kwargs: prepared
    for ex in (mine.experts, theirs.fused_experts.experts):
        ex.apply = lambda *args, **kwargs: None
    alone = {"ours_kernel_us": _python_us(our_call, calls * 5),
             "vllm_plus_adapters_us": _python_us(adapter_call, calls * 5)}
    as_prepared = (prepared.a1q, prepared.a1q_scale, None, None, None)
    shapes = adapter_ex.workspace_shapes(M, 2 * I, K, k, E, E, None, MoEActivation.SILU)
    adapter_pf.prepare = lambda *args, **kwargs: as_prepared
    adapter_pf.finalize = lambda *args, **kwargs: None
    adapter_ex.apply = lambda *args, **kwargs: None
    adapter_ex.workspace_shapes = lambda *args, **kwargs: shapes
    alone["vllm_kernel_us"] = _python_us(adapter_call, calls * 5)
    alone["adapters_us"] = alone["vllm_plus_adapters_us"] - alone["vllm_kernel_us"]
    rows["split_python_alone"] = alone
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--experts", default="triton",
                        help="comma-separated: triton, deep_gemm")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    kinds = args.experts.split(",")
    unknown = set(kinds) - {"triton", "deep_gemm"}
    if unknown:
        parser.error(f"--experts {args.experts!r}: unknown {sorted(unknown)}")

    import vllm
    from vllm.v1.worker.workspace import init_workspace_manager

    from benchmarks._common import environment

    init_workspace_manager(torch.device("cuda"))
    result = {"environment": {**environment(), "vllm": vllm.__version__},
              "problem": dict(M=args.tokens, E=32, K=7168, I=2048, k=8, calls=args.calls,
                              mode="torch.inference_mode")}
    with torch.inference_mode():
        for kind in kinds:  # the file is rewritten after each kind: a time limit keeps the first
            result[kind] = measure(kind, args.tokens, args.calls)
            print(kind, json.dumps(result[kind], indent=1), flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
