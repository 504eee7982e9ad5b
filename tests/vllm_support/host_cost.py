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
Then where the host time goes (``split``, launch loops of the Python alone, no kernel runs):
- ``ours_kernel_us``: our FusedMoEModularKernel with our prepare and experts stubbed (cached
  prepare result, experts that return at once): our kernel's own Python;
- ``vllm_plus_adapters_us``: vLLM's FusedMoEKernel with the same stubs under the adapters:
  vLLM's kernel Python plus the adapters' glue;
- ``vllm_kernel_us``: vLLM's FusedMoEKernel with the adapters' prepare, finalize, apply and
  workspace_shapes stubbed: vLLM's own Python alone;
- ``adapters_us`` = vllm_plus_adapters_us - vllm_kernel_us.
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

    # The split: the library's work stubbed under both kernels (instance attributes), then the
    # adapters' too under vLLM's.
    prepared = mine.prepare_finalize.prepare(x, tw, ids, E, None, False)
    for pf in (mine.prepare_finalize, theirs.prepare_finalize.ours):
        pf.prepare = lambda *args, **kwargs: prepared
    for ex in (mine.experts, theirs.fused_experts.experts):
        ex.apply = lambda *args, **kwargs: None
    split = {"ours_kernel_us": _python_us(our_call, calls * 5),
             "vllm_plus_adapters_us": _python_us(adapter_call, calls * 5)}
    adapter_pf, adapter_ex = theirs.prepare_finalize, theirs.fused_experts
    as_prepared = (prepared.a1q, prepared.a1q_scale, None, None, None)
    shapes = adapter_ex.workspace_shapes(M, 2 * I, K, k, E, E, None, MoEActivation.SILU)
    adapter_pf.prepare = lambda *args, **kwargs: as_prepared
    adapter_pf.finalize = lambda *args, **kwargs: None
    adapter_ex.apply = lambda *args, **kwargs: None
    adapter_ex.workspace_shapes = lambda *args, **kwargs: shapes
    split["vllm_kernel_us"] = _python_us(adapter_call, calls * 5)
    split["adapters_us"] = split["vllm_plus_adapters_us"] - split["vllm_kernel_us"]
    rows["split"] = split
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
