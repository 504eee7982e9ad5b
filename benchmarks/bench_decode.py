"""The whole low-latency decode layer at world size 1, eager and under a CUDA graph, against vLLM's
LL path around the same DeepEP buffer (issue 30's "LL decode layer" rows).

Run from the repository root on one GPU:

    python -m benchmarks.bench_decode                  # JSON in benchmarks/results/decode.json
    python -m benchmarks.bench_decode --tokens 1 --buffers naive

DeepSeek-V3 expert shapes: K 7168, I 2048, 32 local experts, top-8, capacity N = 128 tokens per
rank; FusedMoEModularKernel(DeepEPLLPrepareAndFinalize, BatchedDeepGemmExperts)
(BatchedTritonExperts where DeepGEMM is not usable) over each buffer of --buffers: `deepep`
(deep_ep.Buffer in low-latency mode, make_all2all_buffer("deepep_low_latency")) and `naive`
(TorchAll2AllBuffer, what make_all2all_buffer(None) gives by default, as the README's example builds
it). The layer is called as the README calls it (without max_tokens_across_ranks: `none`) and with
max_tokens_across_ranks=M (`given`); the two are timed in alternating rounds in one process, so that
warm-up, clocks and the allocator treat them alike.

Columns per (buffer, tokens, variant):
  loop_us   per call in a launch loop with one synchronisation at the end (best of the rounds):
            what an eager caller pays per call
  host_us   the same loop timed without its synchronisation (host time per call, best of rounds)
  us        triton.testing.do_bench median (GPU time)
  graph_us  per call under CUDA-graph replay (none only; at one rank both variants capture alike)
  anchor_*  vLLM's own LL path (its DeepEPLLPrepareAndFinalize + BatchedDeepGemmExperts in its
            FusedMoEKernel) around the deepep buffer, same inputs; absent where vLLM or DeepEP
            does not import (the reason is printed and kept in the JSON)
"""

from __future__ import annotations

import argparse
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
    fused_topk,
    local_expert_map,
)
from vllm_moe_fixes.testing import random_fp8_moe_weights

E, K, I, TOPK, N = 32, 7168, 2048, 8, 128


def timed_rounds(fns: dict, calls: int, rounds: int) -> dict:
    """{name: (loop_us, host_us)}: every round times each fn in turn (best over the rounds)."""
    best = {name: [float("inf"), float("inf")] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            host = time.perf_counter() - t0
            torch.cuda.synchronize()
            loop = time.perf_counter() - t0
            best[name][0] = min(best[name][0], loop / calls * 1e6)
            best[name][1] = min(best[name][1], host / calls * 1e6)
    return {name: tuple(v) for name, v in best.items()}


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
                 with_anchor: bool) -> list[dict]:
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
            for _ in range(3):
                fn()
        if anchor is not None:
            try:
                fns["anchor"] = lambda x=x, tw=tw, ti=ti: anchor(x, tw, ti)
                for _ in range(3):
                    fns["anchor"]()
            except Exception as e:  # noqa: BLE001
                anchor, anchor_error = None, f"{type(e).__name__}: {e}"
                del fns["anchor"]
                print(f"{name}: vLLM anchor failed at M={M}: {anchor_error}")
        timed = timed_rounds(fns, calls, rounds)
        row = {"buffer": name, "experts": type(experts).__name__, "M": M}
        for variant, (loop, host) in timed.items():
            row[f"{variant}_loop_us"], row[f"{variant}_host_us"] = loop, host
            row[f"{variant}_us"] = bench_us(fns[variant], [()])
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
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--buffers", nargs="+", choices=("deepep", "naive"),
                        default=["deepep", "naive"])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-anchor", action="store_true", help="skip vLLM's LL path")
    args = parser.parse_args()
    require_cuda("bench_decode")
    dist.init_process_group("nccl", init_method=f"file://{tempfile.mktemp()}", rank=0,
                            world_size=1)
    torch.manual_seed(0)
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
                             with_anchor=name == "deepep" and not args.no_anchor)
    columns = ["buffer", "M"] + [f"{v}_{c}" for v in ("none", "given", "anchor")
                                 for c in ("loop_us", "host_us", "us")] + [
        "none_graph_us", "anchor_graph_us"]
    print_table(rows, columns)
    write_json("decode", {"problem": dict(E=E, K=K, I=I, topk=TOPK, N=N, world_size=1,
                                          calls=args.calls, rounds=args.rounds),
                          "skipped": skipped, "rows": rows})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
