"""The whole MoE layer (NoEP + TritonExperts / DeepGemmExperts) and the batched experts.

Run from the repository root on a GPU:

    python -m benchmarks.bench_experts               # all three tables, JSON in benchmarks/results/
    python -m benchmarks.bench_experts --m 128 1024     # a subset of token counts
    python -m benchmarks.bench_experts --skip-layer --skip-batched    # only the chunk sweep

Each table writes its own JSON: experts.json (layer), experts_chunks.json, experts_batched.json.

DeepSeek-V3 shapes on one rank: K=7168, I=2048, E_l=8 local experts, top-8 routing spread over
them. Columns of the layer table, per backend and M:

  loop_us     per call in a launch loop: wall time of many back-to-back calls with one
              synchronisation at the end, divided by the calls (what a caller pays per call)
  us          triton.testing.do_bench median (GPU time; the L2 is flushed between calls)
  gemms_us    the two grouped GEMM calls alone on the same layout and workspaces (do_bench)
  overhead    (us - gemms_us) / gemms_us: what the layer costs beyond its GEMMs
  tflops      useful TFLOP/s of the layer (2 * M * k * 3 * I * K / us), gemms_tflops the GEMMs
  kernels     CUDA kernels per call (torch.profiler)
  host_us     host time per eager call (launch loop without synchronisation, best of 5)
  graph_us    per call under CUDA-graph replay; graph_gemms_us: the two GEMMs alone, replayed
  peak_MiB    peak memory of a first call on a fresh kernel beyond inputs and weights;
              expected_MiB = sizes.layer_declared_bytes (workspaces + output + prepare's a1q)
  anchor_us   the anchor, vllm_moe_fixes.testing.unfused_moe_layer: the layer unfused on the
              same GEMMs (stable-sort layout, torch gathers, silu_and_mul then the quant, a
              [M, k, K] gather and moe_sum), and diff = calc_diff(layer, anchor)

Chunk-size sweep (M = 32768): time per token and peak memory of a fresh kernel per
VLLM_FUSED_MOE_CHUNK_SIZE, to choose the default.

Batched experts (decode at world size 1: 32 local experts, top-8, capacity T = 128 rows per
expert): experts.apply at 1/32/128 tokens with BatchedTritonExperts / BatchedDeepGemmExperts
(the latter gets expected_m = 128 * 1 * 8 / 32 = 32, as the modular kernel passes it).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks._common import (
    bench_us,
    graph_us,
    host_us,
    print_table,
    require_cuda,
    write_json,
)
from vllm_moe_fixes._compat import deep_gemm as dg
from vllm_moe_fixes._memory import peak_memory
from vllm_moe_fixes.fused_moe.batched_experts import (
    BatchedDeepGemmExperts,
    BatchedTritonExperts,
)
from vllm_moe_fixes.fused_moe.contiguous_experts import (
    DeepGemmExperts,
    TritonExperts,
    workspace_views,
)
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.fused_moe.no_ep_prepare_finalize import NoEPPrepareAndFinalize
from vllm_moe_fixes.fused_moe.routing import fused_topk
from vllm_moe_fixes.ops.fp8_quant import quant_batched_fp8
from vllm_moe_fixes.sizes import expected_rows_per_expert, layer_declared_bytes
from vllm_moe_fixes.testing import (
    Fp8MoEWeights,
    calc_diff,
    kernels_per_call,
    random_fp8_moe_weights,
    unfused_moe_layer,
)

K, I, LOCAL_NUM_EXPERTS, TOPK = 7168, 2048, 8, 8
BATCHED_E, BATCHED_T = 32, 128
CHUNK_SIZES = (2048, 4096, 8192, 16384, 32768)
CHUNK_SWEEP_M = 32768


def loop_us(fn, calls: int) -> float:
    """Per-call wall time of `calls` back-to-back calls and one synchronisation (best of 3)."""
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


# (row, fn) pairs whose "kernels" column main() fills after every timing: once torch.profiler has
# run in a process, launches there cost more host time, so no timing may follow a profile.
_TO_PROFILE: list = []


def count_kernels_later(row: dict, fn) -> None:
    row["kernels"] = None
    _TO_PROFILE.append((row, fn))


def make_weights(num_experts: int, seed: int = 0) -> Fp8MoEWeights:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return random_fp8_moe_weights(num_experts, K, I, generator=g, device="cuda")


def make_inputs(M: int, num_experts: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    weights, ids = fused_topk(torch.randn(M, num_experts, device="cuda", generator=g), TOPK, True)
    return x, weights, ids


def gemms_alone(kernel, experts, w, M):
    """The two grouped GEMM calls of one layer call, on the layout the last call left in the
    kernel's workspaces."""
    w1, w1s, w2, w2s = w
    ws13, ws2, _ = experts.workspace_shapes(M, I, K, TOPK, LOCAL_NUM_EXPERTS)
    v = workspace_views(*kernel.workspaces.get(ws13, ws2, torch.device("cuda"), torch.bfloat16),
               M * TOPK, LOCAL_NUM_EXPERTS, K, I)

    def run():
        experts.gemm(v.a, (w1, w1s), v.h, v.layout.m_indices)
        experts.gemm(v.g, (w2, w2s), v.y, v.layout.m_indices)
    return run


def bench_layer(name, make_experts, w, m_values):
    rows = []
    for M in m_values:
        x, weights, ids = make_inputs(M, LOCAL_NUM_EXPERTS, seed=M)
        experts = make_experts()
        kw = dict(w1_scale=w[1], w2_scale=w[3], global_num_experts=LOCAL_NUM_EXPERTS)
        kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(), experts)
        layer = lambda: kernel(x, w[0], w[2], weights, ids, **kw)  # noqa: E731
        with peak_memory() as peak:
            out = layer()
        anchor = lambda: unfused_moe_layer(x, w, weights, ids, experts.gemm)  # noqa: E731
        diff = calc_diff(out, anchor())
        gemms = gemms_alone(kernel, experts, w, M)
        calls = max(10, 20000 // M)
        row = dict(backend=name, M=M, loop_us=loop_us(layer, calls), us=bench_us(layer, [()]),
                   gemms_us=bench_us(gemms, [()]))
        row["overhead"] = (row["us"] - row["gemms_us"]) / row["gemms_us"]
        flop = 2 * M * TOPK * 3 * I * K  # the useful GEMM work: 3 I x K matrices per slot
        row.update(tflops=flop / row["us"] / 1e6, gemms_tflops=flop / row["gemms_us"] / 1e6)
        row.update(host_us=host_us(layer, [()], calls=calls),
                   graph_us=graph_us(layer, [()], calls=max(1, 1024 // M)),
                   graph_gemms_us=graph_us(gemms, [()], calls=max(1, 1024 // M)),
                   peak_MiB=peak.bytes / 2**20,
                   expected_MiB=layer_declared_bytes(M, I, K, TOPK, LOCAL_NUM_EXPERTS) / 2**20,
                   anchor_us=bench_us(anchor, [()]), diff=diff)
        count_kernels_later(row, layer)
        rows.append(row)
        print_table(rows[-1:], list(row))
    return rows


def bench_chunk_sizes(name, make_experts, w):
    """Time per token and peak memory at M = CHUNK_SWEEP_M for each chunk size."""
    rows = []
    x, weights, ids = make_inputs(CHUNK_SWEEP_M, LOCAL_NUM_EXPERTS, seed=1)
    kw = dict(w1_scale=w[1], w2_scale=w[3], global_num_experts=LOCAL_NUM_EXPERTS)
    saved = os.environ.get("VLLM_FUSED_MOE_CHUNK_SIZE")
    try:
        for chunk in CHUNK_SIZES:
            os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = str(chunk)
            kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(), make_experts())
            layer = lambda: kernel(x, w[0], w[2], weights, ids, **kw)  # noqa: E731
            torch.cuda.empty_cache()
            with peak_memory() as peak:
                layer()
            us = bench_us(layer, [()], warmup=5, rep=200)
            rows.append(dict(backend=name, M=CHUNK_SWEEP_M, chunk=chunk, us=us,
                             ns_per_token=us * 1e3 / CHUNK_SWEEP_M, peak_MiB=peak.bytes / 2**20))
            print_table(rows[-1:], list(rows[-1]))
            del kernel
    finally:
        if saved is None:
            os.environ.pop("VLLM_FUSED_MOE_CHUNK_SIZE", None)
        else:
            os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = saved
    return rows


def bench_batched(name, make_experts, w, token_counts):
    """experts.apply on a [32, 128, K] batched layout filled as a low-latency dispatch of
    `tokens` top-8 tokens at world size 1 would fill it."""
    rows = []
    experts = make_experts()
    ws13_shape, ws2_shape, out_shape = experts.workspace_shapes(BATCHED_T, I, K, TOPK, BATCHED_E)
    ws13 = torch.empty(ws13_shape, dtype=torch.bfloat16, device="cuda")
    ws2 = torch.empty(ws2_shape, dtype=torch.bfloat16, device="cuda")
    out = ws13.view(-1)[:torch.Size(out_shape).numel()].view(out_shape)
    expected_m = expected_rows_per_expert(BATCHED_T, 1, TOPK, BATCHED_E, BATCHED_T)
    for tokens in token_counts:
        _, _, ids = make_inputs(tokens, BATCHED_E, seed=tokens)
        counts = torch.bincount(ids.view(-1), minlength=BATCHED_E).int()
        g = torch.Generator(device="cuda").manual_seed(tokens)
        a1q, a1s = quant_batched_fp8(torch.randn(BATCHED_E, BATCHED_T, K, device="cuda",
                                                 generator=g).bfloat16())

        def apply():
            experts.apply(out, a1q, a1s, w, workspace13=ws13, workspace2=ws2,
                          expert_num_tokens=counts, expected_m=expected_m)
        row = dict(backend=name, tokens=tokens, max_rows=int(counts.max()), expected_m=expected_m,
                   loop_us=loop_us(apply, 200), us=bench_us(apply, [()]),
                   graph_us=graph_us(apply, [()], calls=8), host_us=host_us(apply, [()]))
        count_kernels_later(row, apply)
        rows.append(row)
        print_table(rows[-1:], list(row))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[128, 1024, 8192])
    parser.add_argument("--batched-tokens", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--skip-layer", action="store_true", help="no layer table")
    parser.add_argument("--skip-chunks", action="store_true", help="no chunk-size sweep")
    parser.add_argument("--skip-batched", action="store_true", help="no batched-experts table")
    args = parser.parse_args()
    require_cuda("bench_experts")
    backends = [("triton", TritonExperts, BatchedTritonExperts)]
    if dg.is_available():
        backends.append(("deep_gemm", DeepGemmExperts, BatchedDeepGemmExperts))
    shape = dict(K=K, I=I, E_local=LOCAL_NUM_EXPERTS, topk=TOPK)
    tables = []
    w = make_weights(LOCAL_NUM_EXPERTS)
    if not args.skip_layer:
        layer = [r for name, cls, _ in backends for r in bench_layer(name, cls, w, args.m)]
        tables.append(("layer", "experts", layer))
    if not args.skip_chunks:
        chunks = [r for name, cls, _ in backends for r in bench_chunk_sizes(name, cls, w)]
        tables.append(("chunk sizes", "experts_chunks", chunks))
    del w
    if not args.skip_batched:
        wb = make_weights(BATCHED_E, seed=1)
        batched = [r for name, _, cls in backends
                   for r in bench_batched(name, cls, wb, args.batched_tokens)]
        tables.append(("batched experts", "experts_batched", batched))
        shape.update(batched_experts=BATCHED_E, batched_T=BATCHED_T)
    for row, fn in _TO_PROFILE:
        row["kernels"] = kernels_per_call(fn)[0]
    for title, json_name, rows in tables:
        print(f"\n{title}")
        print_table(rows, list(rows[0]))
        write_json(json_name, dict(shape=shape, deep_gemm=dg.is_available(), results=rows))


if __name__ == "__main__":
    main()
