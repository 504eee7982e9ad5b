"""The whole low-latency decode layer at world size 1, eager and under a CUDA graph, against vLLM's
LL path around the same DeepEP buffer (issue 30's "LL decode layer" rows).

Run from the repository root on one GPU:

    python -m benchmarks.bench_decode                  # JSON in benchmarks/results/decode.json
    python -m benchmarks.bench_decode --tokens 1 --buffers naive

DeepSeek-V3 expert shapes: K 7168, I 2048, 32 local experts, top-8, capacity N = 128 tokens per
rank; FusedMoEModularKernel(DeepEPLLPrepareAndFinalize, BatchedDeepGemmExperts)
(BatchedTritonExperts where DeepGEMM is not usable) over each buffer of --buffers: `deepep`
(deep_ep.Buffer in low-latency mode, make_all2all_buffer("deepep_low_latency")) and `naive`
(TorchAll2AllBuffer, what make_all2all_buffer(None) gives by default, as docs/design.md's decode
example builds it). The layer is called as that example calls it (without max_tokens_across_ranks:
`none`) and with max_tokens_across_ranks=M (`given`); the two are timed in alternating rounds in one
process, so that warm-up, clocks and the allocator treat them alike.

Columns per (buffer, tokens, variant):
  loop_us   per call in a launch loop with one synchronisation at the end (best of the rounds):
            what an eager caller pays per call
  host_us   the same loop timed without its synchronisation (host time per call, best of rounds)
  us        triton.testing.do_bench median (GPU time)
  graph_us  per call under CUDA-graph replay (none only; at one rank both variants capture alike)
  anchor_*  vLLM's own LL path (its DeepEPLLPrepareAndFinalize + BatchedDeepGemmExperts in its
            FusedMoEKernel) around the deepep buffer, same inputs; absent where vLLM or DeepEP
            does not import (the reason is printed and kept in the JSON). Without vLLM's compiled
            ops, its _C.persistent_masked_m_silu_mul_quant is the stand-in of
            tests/vllm_support/stand_ins, which runs our Triton silu-mul-quant kernel (one cached
            launch, called through torch's dispatcher into Python): the anchor runs our kernel
            for that op.
  *_host_median_us  the median over the rounds of host_us (a host slowed by other processes
            shows in every round; a first-call effect only in the first)

Host conditions go into the JSON and the output: every fn gets --warmup calls before the timed
rounds (compile, JIT, allocator), the load average is read before and after, and host_ref_us
(a fixed pure-Python workload, timed before and after) shows a slow or loaded host: a run whose
host_ref_us is well above another's was slowed as a whole.

--host-profile: where the host time of one eager call of ours goes, per stage (wrappers timing
the kernel's checks, prepare, DeepEP's dispatch and combine, the workspaces, the experts' apply,
each masked GEMM and DeepGEMM's own call inside it, the SiLU step and its Triton launch,
finalize): per layer call, inclusive and self microseconds, over rounds of calls with a
synchronisation between rounds only (outside the timings), so that a GPU slower than the host
never blocks a launch. --cprofile N adds cProfile's N most expensive functions (own time) of
ours and of the anchor at the first token count.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks._common import bench_us, graph_us, print_table, require_cuda, write_json
from vllm_moe_fixes._compat import deep_gemm as dg
from vllm_moe_fixes.distributed import make_all2all_buffer
from vllm_moe_fixes.fused_moe import (
    BatchedDeepGemmExperts,
    BatchedTritonExperts,
    DeepEPLLPrepareAndFinalize,
    FusedMoEModularKernel,
    experts_steps,
    fused_topk,
    local_expert_map,
    modular_kernel,
)
from vllm_moe_fixes.testing import random_fp8_moe_weights

E, K, I, TOPK, N = 32, 7168, 2048, 8, 128


def timed_rounds(fns: dict, calls: int, rounds: int) -> dict:
    """{name: (loop_us, host_us, host_median_us)}: every round times each fn in turn (loop and
    host: best over the rounds; host_median: their median)."""
    loops = {name: [] for name in fns}
    hosts = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            host = time.perf_counter() - t0
            torch.cuda.synchronize()
            loop = time.perf_counter() - t0
            loops[name].append(loop / calls * 1e6)
            hosts[name].append(host / calls * 1e6)
    return {name: (min(loops[name]), min(hosts[name]), statistics.median(hosts[name]))
            for name in fns}


def host_ref_us() -> float:
    """A fixed pure-Python workload (10**5 small function calls), best of 3, in microseconds:
    the same host gives the same figure; a loaded or slowed one a larger one."""
    def step(i):
        return i + 1

    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(100_000):
            step(i)
        best = min(best, (time.perf_counter() - t0) * 1e6)
    return best


def host_conditions() -> dict:
    return {"loadavg": os.getloadavg(), "host_ref_us": host_ref_us(),
            "cpus": os.cpu_count()}


class StageTimer:
    """Wraps callables so that each call adds its wall time to its stage: inclusive, and self
    (minus the wrapped calls made inside it)."""

    def __init__(self) -> None:
        self.inclusive, self.own, self.calls = {}, {}, {}
        self._children: list[float] = []  # per open stage: time of its wrapped callees

    def wrap_hooked(self, name: str, fn):
        """wrap(name, fn), and the receive hook fn returns last (DeepEP's return_recv_hook) timed
        as its own stage where the caller calls it."""
        hook_name = f"{name} hook"
        self.wrap(hook_name, None)
        timed = self.wrap(name, fn)

        def with_timed_hook(*args, **kwargs):
            result = timed(*args, **kwargs)
            if isinstance(result, tuple) and callable(result[-1]):
                result = (*result[:-1], self.wrap(hook_name, result[-1]))
            return result
        return with_timed_hook

    def wrap(self, name: str, fn):
        for table in (self.inclusive, self.own, self.calls):
            table.setdefault(name, 0)
        stack = self._children

        def timed(*args, **kwargs):
            stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                inner = stack.pop()
                self.inclusive[name] += dt
                self.own[name] += dt - inner
                self.calls[name] += 1
                if stack:
                    stack[-1] += dt
        return timed


def stage_patches(kernel, buffer) -> list[tuple]:
    """(owner, attribute, stage name) of every stage the host profile times, outermost first."""
    pf, experts = kernel.prepare_finalize, kernel.experts
    patches = [
        (modular_kernel, "stream_is_capturing", "stream_is_capturing"),
        (modular_kernel, "check_layer_call", "checks (check_layer_call)"),
        (pf, "prepare", "prepare"),
        (buffer, "low_latency_dispatch", "  deep_ep low_latency_dispatch"),
        (kernel.workspaces, "get", "workspaces.get"),
        (experts, "apply", "experts.apply"),
        (experts, "gemm", "  masked GEMM (x2)"),
        (experts_steps, "silu_and_mul_quant", "  silu_and_mul_quant step"),
        (experts_steps, "silu_and_mul_quant_fp8_triton", "    Triton launch"),
        (pf, "finalize", "finalize"),
        (buffer, "low_latency_combine", "  deep_ep low_latency_combine"),
    ]
    api = getattr(dg, "_API", None)
    if api is not None and getattr(api, "masked", None) is not None:
        patches.insert(7, (api, "masked", "    DeepGEMM's own call"))
    return patches


def host_profile(kernel, buffer, fn, calls: int, rounds: int, per_sync: int = 32) -> dict:
    """Per layer call: {stage: (calls, inclusive us, self us)} of `fn` (a layer call of `kernel`
    over `buffer`), plus the plain and the wrapped host time per call (the wrappers' own cost is
    their difference). Synchronises every per_sync calls, outside the timings."""
    def loop(f) -> float:
        spent = 0.0
        for _ in range(rounds):
            for _ in range(0, calls, per_sync):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(per_sync):
                    f()
                spent += time.perf_counter() - t0
        torch.cuda.synchronize()
        return spent

    n = rounds * len(range(0, calls, per_sync)) * per_sync
    plain = loop(fn) / n * 1e6
    timer = StageTimer()
    patches = stage_patches(kernel, buffer)
    saved = [(owner, attr, owner.__dict__.get(attr, None), attr in owner.__dict__)
             for owner, attr, _ in patches]
    try:
        for owner, attr, name in patches:
            wrap = timer.wrap_hooked if attr.startswith("low_latency_") else timer.wrap
            setattr(owner, attr, wrap(name, getattr(owner, attr)))
        whole = timer.wrap("layer call", fn)
        loop(whole)
    finally:
        for owner, attr, value, had in reversed(saved):
            if had:
                setattr(owner, attr, value)
            else:
                delattr(owner, attr)
    stages = {name: (timer.calls[name] / n, timer.inclusive[name] / n * 1e6,
                     timer.own[name] / n * 1e6) for name in timer.calls}
    stages = {"layer call": stages.pop("layer call"), **stages}
    return {"plain_host_us": plain, "wrapped_host_us": stages["layer call"][1],
            "stages": stages}


def print_profile(M: int, profile: dict) -> None:
    print(f"host profile, M={M}: {profile['plain_host_us']:.1f} us per call unwrapped, "
          f"{profile['wrapped_host_us']:.1f} wrapped (the difference is the wrappers' cost)")
    print(f"  {'stage':40s} {'calls':>6s} {'incl_us':>8s} {'self_us':>8s}")
    for name, (n, incl, own) in profile["stages"].items():
        if n:  # (a receive hook stage stays empty where DeepEP is not asked for hooks)
            print(f"  {name:40s} {n:6.2f} {incl:8.1f} {own:8.1f}")


def cprofile_top(fn, calls: int, top: int) -> str:
    """cProfile's `top` functions by own time over `calls` calls of fn (its overhead inflates
    Python functions, not C ones)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def vllm_ll_layer(buffer, w, experts_is_deep_gemm: bool):
    """vLLM's LL path around `buffer`: a callable (x, topk_weights, topk_ids) -> output."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
        fp8_w8a8_moe_quant_config,
    )
    from vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe import (
        BatchedDeepGemmExperts as VllmBatchedDeepGemmExperts,
    )
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import (
        DeepEPLLPrepareAndFinalize as VllmDeepEPLL,
    )
    from vllm.v1.worker.workspace import init_workspace_manager

    if not experts_is_deep_gemm:
        raise RuntimeError("the anchor runs vLLM's batched DeepGEMM experts: DeepGEMM not usable")
    init_workspace_manager(torch.device("cuda"))
    cfg = FusedMoEConfig(
        num_experts=E, experts_per_token=TOPK, hidden_dim=K, intermediate_size=I,
        num_local_experts=E, num_logical_experts=E, activation=MoEActivation.SILU,
        device="cuda", routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=torch.bfloat16,
        intermediate_size_per_partition=I)
    qc = fp8_w8a8_moe_quant_config(w1_scale=w.w1_scale, w2_scale=w.w2_scale,
                                   block_shape=[128, 128])
    pf = VllmDeepEPLL(buffer, max_tokens_per_rank=N, num_dispatchers=1, use_fp8_dispatch=True)
    kernel = mk.FusedMoEKernel(pf, VllmBatchedDeepGemmExperts(cfg, qc, max_num_tokens=N,
                                                              num_dispatchers=1))

    def layer(x, topk_weights, topk_ids):
        return kernel.apply(x, w.w1, w.w2, topk_weights, topk_ids, MoEActivation.SILU, E, None,
                            False)
    return layer


def bench_buffer(name: str, buffer, w, tokens: list[int], calls: int, rounds: int,
                 with_anchor: bool, warmup: int, profile: bool, cprofile: int) -> list[dict]:
    deep_gemm = dg.is_available()
    experts = BatchedDeepGemmExperts() if deep_gemm else BatchedTritonExperts()
    pf = DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=1, max_tokens_per_rank=N)
    kernel = FusedMoEModularKernel(pf, experts)
    expert_map = local_expert_map(dist.group.WORLD, E, "cuda")
    anchor, anchor_error = None, None
    if with_anchor:
        try:
            anchor = vllm_ll_layer(buffer, w, deep_gemm)
        except Exception as e:  # noqa: BLE001 (any failure: the row says why, ours still runs)
            anchor_error = f"{type(e).__name__}: {e}"
            print(f"{name}: vLLM anchor unavailable: {anchor_error}")
    rows = []
    for M in tokens:
        x = torch.randn(M, K, device="cuda").bfloat16()
        tw, ti = fused_topk(torch.randn(M, E, device="cuda"), TOPK, renormalize=True)

        def ours(given, x=x, tw=tw, ti=ti, M=M):
            extra = {"max_tokens_across_ranks": M} if given else {}
            return kernel(x, w.w1, w.w2, tw, ti, w1_scale=w.w1_scale, w2_scale=w.w2_scale,
                          global_num_experts=E, expert_map=expert_map, **extra)

        fns = {"none": lambda: ours(False), "given": lambda: ours(True)}
        for fn in fns.values():  # compile, JIT and allocate outside the timings
            for _ in range(warmup):
                fn()
        if anchor is not None:
            try:
                fns["anchor"] = lambda x=x, tw=tw, ti=ti: anchor(x, tw, ti)
                for _ in range(warmup):
                    fns["anchor"]()
            except Exception as e:  # noqa: BLE001
                anchor, anchor_error = None, f"{type(e).__name__}: {e}"
                del fns["anchor"]
                print(f"{name}: vLLM anchor failed at M={M}: {anchor_error}")
        timed = timed_rounds(fns, calls, rounds)
        row = {"buffer": name, "experts": type(experts).__name__, "M": M}
        for variant, (loop, host, host_median) in timed.items():
            row[f"{variant}_loop_us"], row[f"{variant}_host_us"] = loop, host
            row[f"{variant}_host_median_us"] = host_median
            row[f"{variant}_us"] = bench_us(fns[variant], [()])
        if profile:
            row["host_profile"] = host_profile(kernel, buffer, fns["none"], calls, rounds)
            print_profile(M, row["host_profile"])
        if cprofile and M == tokens[0]:
            for variant in ("none", "anchor"):
                if variant in fns:
                    print(f"cProfile of {variant} at M={M}, {calls} calls:")
                    print(cprofile_top(fns[variant], calls, cprofile))
        row["none_graph_us"] = graph_us(fns["none"], [()])
        if anchor is not None:
            out, ref = ours(False), fns["anchor"]()
            row["anchor_max_abs_diff"] = float((out.float() - ref.float()).abs().max())
            try:
                row["anchor_graph_us"] = graph_us(fns["anchor"], [()])
            except Exception as e:  # noqa: BLE001 (eager figures stand; the row says why)
                row["anchor_graph_error"] = f"{type(e).__name__}: {e}"
        if anchor_error:
            row["anchor_error"] = anchor_error
        rows.append(row)
        print(f"{name} M={M}: " + ", ".join(  # as it comes: a run cut short keeps these
            f"{k} {v:.1f}" for k, v in row.items() if k.endswith("_us") and isinstance(v, float)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--buffers", nargs="+", choices=("deepep", "naive"),
                        default=["deepep", "naive"])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=50,
                        help="calls of each fn before the timed rounds")
    parser.add_argument("--no-anchor", action="store_true", help="skip vLLM's LL path")
    parser.add_argument("--host-profile", action="store_true",
                        help="per-stage host time of ours (deepep buffer)")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="print cProfile's N most expensive functions at the first M")
    args = parser.parse_args()
    require_cuda("bench_decode")
    dist.init_process_group("nccl", init_method=f"file://{tempfile.mktemp()}", rank=0,
                            world_size=1)
    torch.manual_seed(0)
    before = host_conditions()
    print(f"host before: load {before['loadavg']}, host_ref_us {before['host_ref_us']:.0f}, "
          f"warm-up {args.warmup} calls per fn")
    w = random_fp8_moe_weights(E, K, I, device="cuda")
    rows, skipped = [], {}
    for name in args.buffers:
        backend = "deepep_low_latency" if name == "deepep" else "naive"
        try:
            buffer = make_all2all_buffer(backend, dist.group.WORLD, max_tokens_per_rank=N,
                                         hidden=K, num_experts=E)
        except ImportError as e:
            skipped[name] = str(e)
            print(f"{name}: skipped ({e})")
            continue
        rows += bench_buffer(name, buffer, w, args.tokens, args.calls, args.rounds,
                             with_anchor=name == "deepep" and not args.no_anchor,
                             warmup=args.warmup, profile=args.host_profile and name == "deepep",
                             cprofile=args.cprofile if name == "deepep" else 0)
    after = host_conditions()
    print(f"host after: load {after['loadavg']}, host_ref_us {after['host_ref_us']:.0f}")
    if any("anchor_loop_us" in row for row in rows):
        print("anchor: vLLM's _C.persistent_masked_m_silu_mul_quant is the stand-in running our "
              "Triton silu-mul-quant kernel (through torch's dispatcher into Python)")
    columns = ["buffer", "M"] + [f"{v}_{c}" for v in ("none", "given", "anchor")
                                 for c in ("loop_us", "host_us", "host_median_us", "us")] + [
        "none_graph_us", "anchor_graph_us"]
    print_table(rows, columns)
    write_json("decode", {"problem": dict(E=E, K=K, I=I, topk=TOPK, N=N, world_size=1,
                                          calls=args.calls, rounds=args.rounds,
                                          warmup=args.warmup),
                          "host_before": before, "host_after": after,
                          "skipped": skipped, "rows": rows})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
