"""Host cost of one MoE layer call through vLLM's FusedMoEKernel with this library's adapters
against our own FusedMoEModularKernel: same problem, same kernels (GPU only).

    python tests/vllm_support/host_cost.py OUT.json [--experts triton,deep_gemm] [--calls 30]
        [--rounds 8] [--tokens 128,1] [--before DIR]

Both run under torch.inference_mode, as vLLM's model runner runs a forward. Variants:
- ``ours``: FusedMoEModularKernel(NoEPPrepareAndFinalize(), experts), the input quantised by
  prepare (the target's reference, issue 28); activation scales as vLLM decides them for the
  adapters (``use_ue8m0``: vLLM's is_deep_gemm_e8m0_used()), here and below;
- ``ours_deferred``: the same with NoEPPrepareAndFinalize(defer_input_quant=True), the one-rank
  layer make_moe_kernel builds (the experts quantise the input where they permute it);
- ``adapter``: vLLM's FusedMoEKernel(VllmNoEPPrepareAndFinalize(), Vllm...Experts);
- ``adapter_before`` (with --before DIR): the same with DIR/experts.py and
  DIR/prepare_finalize.py as the adapters (an earlier version, in the same process).
Per experts kind and token count, after a warm-up, timed three ways in ``rounds`` rounds that
take the variants in turn (a different order each round), so that a slow stretch of the host
falls on all of them:
- ``host_us``: the call alone, started on an idle GPU (synchronised before each call), median
  of every call: the Python and launch work of one call, which no GPU queue can hide or
  stretch;
- ``loop_us``: a plain launch loop up to one final synchronisation, per call (the larger of host
  and GPU time per call), median of the rounds;
- ``gpu_us``: the same loop between two CUDA events, median of the rounds.
``ratio_*``: adapter / ours and adapter / ours_deferred of those medians; ``ratio_host_rounds``
the median of the rounds' own host ratios.
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


def _host_times(fn, calls: int) -> list[float]:
    """Wall time (seconds) of each of ``calls`` calls, each started on an idle GPU."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return times


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


def _interleaved(variants: dict, calls: int, rounds: int) -> tuple[dict, dict]:
    """(rows: host_us / loop_us / gpu_us of each variant (name -> call), each round's host_us
    by variant), measured in ``rounds`` rounds that take every variant in turn, each round in
    another order (module docstring)."""
    names = list(variants)
    host = {name: [] for name in names}
    loop = {name: [] for name in names}
    gpu = {name: [] for name in names}
    round_host = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        if r % 2:
            order.reverse()
        for name in order:
            fn = variants[name]
            times = _host_times(fn, calls)
            host[name] += times
            round_host[name].append(statistics.median(times) * 1e6)
            loop[name].append(_loop_us(fn, calls))
            gpu[name].append(_gpu_us(fn, calls))
    rows = {name: {"host_us": statistics.median(host[name]) * 1e6,
                   "loop_us": statistics.median(loop[name]),
                   "gpu_us": statistics.median(gpu[name]),
                   "host_us_rounds": [round(t, 1) for t in round_host[name]]}
            for name in names}
    return rows, round_host


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


def _load_adapters(folder: str):
    """(experts module, prepare_finalize module) from folder/experts.py and
    folder/prepare_finalize.py, loaded under names of their own beside the current adapters."""
    import importlib.util
    import os

    modules = []
    for name in ("experts", "prepare_finalize"):
        spec = importlib.util.spec_from_file_location(
            f"vllm_moe_fixes.integrations.vllm._before_{name}", os.path.join(folder, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules.append(module)
    return modules


def measure(experts: str, M: int, calls: int, rounds: int, before: str | None) -> dict:
    """The host_us / loop_us / gpu_us rows and the split for one experts kind and M tokens."""
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
    from vllm_moe_fixes.integrations.vllm.support import vllm_rounds_scales_to_ue8m0
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
    name_of_experts = "VllmDeepGemmExperts" if experts == "deep_gemm" else "VllmTritonExperts"
    our_cls = ours.DeepGemmExperts if experts == "deep_gemm" else ours.TritonExperts
    theirs = mk.FusedMoEKernel(pfs.VllmNoEPPrepareAndFinalize(),
                               getattr(adapters, name_of_experts)(cfg, qc))
    # Activation scales as the adapters take them from vLLM (power-of-two where its DeepGEMM
    # E8M0 recipe is on, as on an H200 with DeepGEMM): the same bits.
    use_ue8m0 = vllm_rounds_scales_to_ue8m0()
    mine = ours.FusedMoEModularKernel(ours.NoEPPrepareAndFinalize(use_ue8m0=use_ue8m0),
                                      our_cls())
    mine_deferred = ours.FusedMoEModularKernel(
        ours.NoEPPrepareAndFinalize(defer_input_quant=True, use_ue8m0=use_ue8m0), our_cls())

    def vllm_call(kernel):
        return lambda: kernel.apply(x, w.w1, w.w2, tw, ids, MoEActivation.SILU, E, None, False)

    def our_call(kernel):
        return lambda: kernel(x, w.w1, w.w2, tw, ids, w1_scale=w.w1_scale,
                              w2_scale=w.w2_scale, global_num_experts=E)

    variants = {"ours": our_call(mine), "ours_deferred": our_call(mine_deferred),
                "adapter": vllm_call(theirs)}
    if before is not None:
        old_experts, old_pfs = _load_adapters(before)
        variants["adapter_before"] = vllm_call(mk.FusedMoEKernel(
            old_pfs.VllmNoEPPrepareAndFinalize(), getattr(old_experts, name_of_experts)(cfg, qc)))
    for _ in range(3):  # compile, JIT, grow the workspaces
        for fn in variants.values():
            fn()
    want = variants["ours"]()
    equal = {name: torch.equal(fn(), want) for name, fn in variants.items()}
    if not all(equal.values()):  # recorded, and the timing goes on (a time limit is short)
        print(f"{experts} M={M}: outputs differ from ours: {equal}", flush=True)
    rows, round_host = _interleaved(variants, calls, rounds)
    rows["bit_equal_to_ours"] = equal
    rows["use_ue8m0"] = use_ue8m0
    for what in ("host_us", "loop_us"):
        for base in ("ours", "ours_deferred"):
            suffix = "" if base == "ours" else "_vs_deferred"
            rows[f"ratio_{what[:-3]}{suffix}"] = rows["adapter"][what] / rows[base][what]
    rows["ratio_host_rounds"] = statistics.median(
        a / o for a, o in zip(round_host["adapter"], round_host["ours"]))
    # What reusing vLLM's workspace views saves: the adapter without it (our experts rebuild
    # their views on each call's fresh workspace objects).
    theirs.fused_experts._workspaces_kept_by_vllm = False
    rows["adapter_fresh_views"] = {
        "host_us": statistics.median(_host_times(variants["adapter"], calls)) * 1e6}
    theirs.fused_experts._workspaces_kept_by_vllm = True
    rows.update(_split(theirs, mine, variants["adapter"], variants["ours"], calls,
                       (x, tw, ids, E, M, 2 * I, K, k, w)))
    return rows


def _split(theirs, mine, adapter_call, our_call, calls: int, problem) -> dict:
    """``split`` and ``split_python_alone`` of the module docstring (the library's methods and
    the adapters' are timed, then stubbed, as instance attributes)."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    x, tw, ids, E, M, N, K, k, w = problem
    adapter_pf, adapter_ex = theirs.prepare_finalize, theirs.fused_experts
    # The methods of the adapters' own classes that vLLM's kernel calls on every call.
    asked = ["apply", "workspace_shapes", "finalize_weight_and_reduce_impl", "moe_problem_size"]
    adapter_methods = [(adapter_pf, "prepare"), (adapter_pf, "finalize")] + [
        (adapter_ex, name) for name in asked
        if getattr(type(adapter_ex), name) is not getattr(mk.FusedMoEExpertsModular, name)]
    # Where the host time goes, in the calls as they run: the time inside the library's
    # prepare / experts apply / finalize ("library") and inside the adapters' methods vLLM calls.
    library_of_ours = [(mine.prepare_finalize, "prepare"), (mine.experts, "apply"),
                       (mine.prepare_finalize, "finalize")]
    library_of_adapter = [(adapter_pf.ours, "prepare"), (adapter_ex.experts, "apply"),
                          (adapter_pf.ours, "finalize")]
    total, _, library = _time_inside(our_call, [], library_of_ours, calls)
    split = {"ours_kernel_us": total - library, "library_under_ours_us": library}
    total, adapters, library = _time_inside(adapter_call, adapter_methods, library_of_adapter,
                                            calls)
    split.update(vllm_kernel_us=total - adapters, adapters_us=adapters - library,
                 library_under_vllm_us=library)

    # The same split in a loop of the Python alone (caches warm, nothing launched): the
    # library's work stubbed under both kernels (instance attributes), then the adapters' too.
    answers = {"workspace_shapes": adapter_ex.workspace_shapes(M, N, K, k, E, E, None,
                                                               MoEActivation.SILU),
               "finalize_weight_and_reduce_impl": adapter_ex.finalize_weight_and_reduce_impl(),
               "moe_problem_size": adapter_ex.moe_problem_size(x, w.w1, w.w2, ids),
               "apply": None, "finalize": None}
    prepared = mine.prepare_finalize.prepare(x, tw, ids, E, None, False)
    for pf in (mine.prepare_finalize, adapter_pf.ours):
        pf.prepare = lambda *args, **kwargs: prepared
    for ex in (mine.experts, adapter_ex.experts):
        ex.apply = lambda *args, **kwargs: None
    alone = {"ours_kernel_us": _python_us(our_call, calls * 5),
             "vllm_plus_adapters_us": _python_us(adapter_call, calls * 5)}
    answers["prepare"] = (prepared.a1q, prepared.a1q_scale, None, None, None)
    for obj, name in adapter_methods:
        setattr(obj, name, lambda *args, _answer=answers[name], **kwargs: _answer)
    alone["vllm_kernel_us"] = _python_us(adapter_call, calls * 5)
    alone["adapters_us"] = alone["vllm_plus_adapters_us"] - alone["vllm_kernel_us"]
    return {"split": split, "split_python_alone": alone}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--experts", default="triton",
                        help="comma-separated: triton, deep_gemm")
    parser.add_argument("--calls", type=int, default=30, help="calls per variant and round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", default="128,1", help="comma-separated token counts M")
    parser.add_argument("--before", help="a folder holding an earlier experts.py and "
                        "prepare_finalize.py of the adapters, timed as adapter_before")
    args = parser.parse_args()
    kinds = args.experts.split(",")
    unknown = set(kinds) - {"triton", "deep_gemm"}
    if unknown:
        parser.error(f"--experts {args.experts!r}: unknown {sorted(unknown)}")
    tokens = [int(m) for m in args.tokens.split(",")]

    import vllm
    from vllm.v1.worker.workspace import init_workspace_manager

    from vllm_moe_fixes.testing import run_environment

    init_workspace_manager(torch.device("cuda"))
    result = {"environment": {**run_environment(), "vllm": vllm.__version__},
              "problem": dict(M=tokens, E=32, K=7168, I=2048, k=8, calls=args.calls,
                              rounds=args.rounds, mode="torch.inference_mode")}
    with torch.inference_mode():
        # The file is rewritten after each measurement: a time limit keeps what was measured.
        for M in tokens:
            for kind in kinds:
                key = f"{kind}_M{M}"
                result[key] = measure(kind, M, args.calls, args.rounds, args.before)
                print(key, json.dumps(result[key], indent=1), flush=True)
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
