"""The whole MoE layer (NoEP + TritonExperts / DeepGemmExperts) and the batched experts.

Run from the repository root on a GPU:

    python -m benchmarks.bench_experts               # all three tables, JSON in benchmarks/results/
    python -m benchmarks.bench_experts --m 128 1024     # a subset of token counts
    python -m benchmarks.bench_experts --skip-layer --skip-batched    # only the chunk sweep
    python -m benchmarks.bench_experts --backends deep_gemm vllm --profile 1024 8192

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

Our layer is NoEPPrepareAndFinalize(defer_input_quant=True) + the experts: the quant happens in
the experts' permute (ops/quant_permute.py). The backend `vllm` is the second anchor: vLLM 0.33's
own DeepGEMM contiguous layer, FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(),
DeepGemmExperts) from vLLM's Python tree (on PYTHONPATH), same weights and inputs (int32 ids),
same columns; its gemms_us replays the two DeepGEMM calls of its last layer call with the
operands recorded there, and diff = calc_diff(vLLM, our deep_gemm layer). Without vLLM or
DeepGEMM its row says why. Where vLLM's compiled ops are torch stand-ins (no .so files), the one
on its timed path, _C.per_token_group_fp8_quant, runs our Triton quant (the same recipe, one
launch, as vLLM's CUDA kernel is): the row names it. The DeepGEMM operands each side hands over
(rows, layout form, blocks DeepGEMM visits, scale layout) are printed and kept in the JSON.
vLLM turns DeepGEMM's PDL on when it first resolves DeepGEMM (a process-wide setting): the anchor
is built before any row, so with the vllm backend every row runs as in a vLLM process (PDL on;
column pdl). Rows run deep_gemm and vllm side by side per M, then triton; experts.json is written
after every row, so a run cut by a time limit keeps what it measured.
--profile M...: per-kernel GPU time of one call (torch.profiler) for each backend at those M.

Chunk-size sweep (M = 32768): time per token and peak memory of a fresh kernel per
VLLM_FUSED_MOE_CHUNK_SIZE, to choose the default.

Batched experts (decode at world size 1: 32 local experts, top-8, capacity T = 128 rows per
expert): experts.apply at 1/32/128 tokens with BatchedTritonExperts / BatchedDeepGemmExperts
(the latter gets expected_m = 128 * 1 * 8 / 32 = 32, as the modular kernel passes it).
"""

from __future__ import annotations

import argparse
import os
import sys
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
from vllm_moe_fixes.ops.fp8 import FP8_MAX
from vllm_moe_fixes.ops.fp8_quant import per_token_group_quant_fp8_triton, quant_batched_fp8
from vllm_moe_fixes.sizes import expected_rows_per_expert, layer_declared_bytes
from vllm_moe_fixes.testing import (
    Fp8MoEWeights,
    calc_diff,
    cuda_kernel_events,
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
    kernel's workspaces, and a summary of what they hand the GEMM."""
    w1, w1s, w2, w2s = w
    ws13, ws2, _ = experts.workspace_shapes(M, I, K, TOPK, LOCAL_NUM_EXPERTS)
    v = workspace_views(*kernel.workspaces.get(ws13, ws2, w1.device, torch.bfloat16),
                        M * TOPK, LOCAL_NUM_EXPERTS, K, I)
    lay = v.layout

    def run():
        experts.gemm(v.a, (w1, w1s), v.h, lay.m_indices, lay.expert_ends)
        experts.gemm(v.g, (w2, w2s), v.y, lay.m_indices, lay.expert_ends)
    psum = isinstance(experts, DeepGemmExperts) and dg.contiguous_layout_form() == "psum"
    return run, operands(v.a, lay.expert_ends if psum else lay.m_indices, psum)


def operands(a, grouped_layout, psum: bool) -> dict:
    """What a contiguous grouped GEMM call is handed: rows (M_sum), the layout's form and the
    128-row blocks DeepGEMM's scheduler visits with it (m_indices: every block of M_sum, padding
    included; psum: the blocks holding each expert's rows), A's scales (dtype, strides, 16-byte
    alignment of the pointer: the TMA's)."""
    a_q, a_s = a
    m_sum = a_q.shape[0]
    layout = grouped_layout.tolist()
    if psum:  # expert e's rows: [align128(end of e - 1), end of e)
        blocks = rows = start = 0
        for end in layout:
            blocks += -(-(end - start) // 128)
            rows += end - start
            start = -(-end // 128) * 128
    else:
        blocks, rows = m_sum // 128, sum(1 for e in layout if e >= 0)
    return dict(m_sum=m_sum, layout="psum" if psum else "m_indices", rows=rows,
                blocks=blocks, sf_dtype=str(a_s.dtype).replace("torch.", ""),
                sf_strides=tuple(a_s.stride()), sf_aligned16=a_s.data_ptr() % 16 == 0,
                layout_head=layout[:LOCAL_NUM_EXPERTS] if psum else None)


_OUTPUTS: dict = {}  # M -> our deep_gemm layer's output, for the vLLM rows' diff
_OPERANDS: list = []  # (backend, M, GEMM1's operands) of every row


def timing_columns(layer, gemms, M, graphs: bool = True) -> dict:
    """The columns every backend's row shares (module docstring); graphs=False leaves out the
    CUDA-graph columns (a failed capture can leave the device unusable for what follows)."""
    calls = max(10, 20000 // M)
    row = dict(loop_us=loop_us(layer, calls), us=bench_us(layer, [()]),
               gemms_us=bench_us(gemms, [()]))
    row["overhead"] = (row["us"] - row["gemms_us"]) / row["gemms_us"]
    row["beyond_gemms"] = (row["us"] - row["gemms_us"]) / row["us"]
    flop = 2 * M * TOPK * 3 * I * K  # the useful GEMM work: 3 I x K matrices per slot
    row.update(tflops=flop / row["us"] / 1e6, gemms_tflops=flop / row["gemms_us"] / 1e6,
               host_us=host_us(layer, [()], calls=calls))
    if graphs:
        row.update(graph_us=graph_us(layer, [()], calls=max(1, 1024 // M)),
                   graph_gemms_us=graph_us(gemms, [()], calls=max(1, 1024 // M)))
    return row


def layer_row(name, make_experts, w, M) -> dict:
    """Our layer's row at M (module docstring)."""
    x, weights, ids = make_inputs(M, LOCAL_NUM_EXPERTS, seed=M)
    ids = ids.to(torch.int32)  # the vllm rows' ids (vLLM's router gives int32)
    experts = make_experts()
    kw = dict(w1_scale=w[1], w2_scale=w[3], global_num_experts=LOCAL_NUM_EXPERTS)
    kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(defer_input_quant=True), experts)
    layer = lambda: kernel(x, w[0], w[2], weights, ids, **kw)  # noqa: E731
    with peak_memory() as peak:
        out = layer()
    if name == "deep_gemm":
        _OUTPUTS[M] = out
    anchor = lambda: unfused_moe_layer(x, w, weights, ids, experts.gemm)  # noqa: E731
    diff = calc_diff(out, anchor())
    gemms, ops = gemms_alone(kernel, experts, w, M)
    _OPERANDS.append((name, M, ops))
    row = dict(backend=name, M=M, **timing_columns(layer, gemms, M),
               peak_MiB=peak.bytes / 2**20,
               expected_MiB=layer_declared_bytes(M, I, K, TOPK, LOCAL_NUM_EXPERTS) / 2**20,
               anchor_us=bench_us(anchor, [()]), diff=diff, pdl=deep_gemm_pdl())
    count_kernels_later(row, layer)
    print_table([row], list(row))
    return row


def deep_gemm_pdl():
    """DeepGEMM's programmatic-dependent-launch setting now (None where it has none), read from
    the module _compat loaded."""
    get_pdl = getattr(sys.modules.get("deep_gemm"), "get_pdl", None)
    return None if get_pdl is None else bool(get_pdl())


# ---------------------------------------------------------------- the second anchor: vLLM's own

def _our_quant_for_vllm(x, out_q, out_s, group_size, eps, fp8_min, fp8_max, ue8m0):
    """vLLM's _C.per_token_group_fp8_quant as our Triton quant (the same recipe, one launch)."""
    if x.dim() != 2 or not x.is_contiguous() or fp8_max != FP8_MAX or fp8_min != -FP8_MAX:
        raise ValueError(f"the fair stand-in covers 2-D contiguous x with fp8 bounds +-448, got "
                         f"{tuple(x.shape)}, [{fp8_min}, {fp8_max}]")
    per_token_group_quant_fp8_triton(x, out_q, out_s, group_size, eps, ue8m0)


def vllm_deep_gemm_layer():
    """(make, stand_ins) for vLLM 0.33's DeepGEMM contiguous layer, or (None, why it cannot run).
    make(w) -> (call(x, topk_weights, topk_ids) -> output, record(call) -> (replay, operands))."""
    if not dg.is_available():
        return None, "DeepGEMM is not importable"
    os.environ.setdefault("VLLM_USE_DEEP_GEMM", "1")
    try:
        import vllm.model_executor.layers.fused_moe.experts.deep_gemm_moe as vllm_dg
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.config import (
            FusedMoEConfig,
            FusedMoEParallelConfig,
            RoutingMethodType,
            fp8_w8a8_moe_quant_config,
        )
        from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
            MoEPrepareAndFinalizeNoDPEPModular,
        )
        from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used
        from vllm.v1.worker.workspace import init_workspace_manager
        import vllm._C_stable_libtorch as compiled_ops
    except Exception as exc:  # noqa: BLE001 (any import failure: the row says which)
        return None, f"vLLM 0.33 is not importable: {type(exc).__name__}: {exc}"[:200]
    stand_ins = "none (vLLM's compiled ops)"
    if str(getattr(compiled_ops, "__file__", "")).endswith(".py"):  # the torch stand-ins
        if hasattr(compiled_ops, "CUDA_QUANT"):
            compiled_ops.CUDA_QUANT = _our_quant_for_vllm
            stand_ins = "_C.per_token_group_fp8_quant: our Triton quant (same recipe, 1 launch)"
        else:
            stand_ins = "_C.per_token_group_fp8_quant: torch stand-in (penalises vLLM)"
    init_workspace_manager(torch.device("cuda"))
    # vLLM 0.33's default (VLLM_USE_DEEP_GEMM_E8M0=1): on SM90 its activation scales are float32
    # rounded up to powers of two; DeepGEMM's SM90 kernel is the same either way.
    stand_ins += f"; activation scales rounded to powers of two: {is_deep_gemm_e8m0_used()}"
    E = LOCAL_NUM_EXPERTS

    def make(w):
        cfg = FusedMoEConfig(
            num_experts=E, experts_per_token=TOPK, hidden_dim=K, intermediate_size=I,
            num_local_experts=E, num_logical_experts=E, activation=MoEActivation.SILU,
            device="cuda", routing_method=RoutingMethodType.Renormalize,
            moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
            in_dtype=torch.bfloat16, intermediate_size_per_partition=I)
        qc = fp8_w8a8_moe_quant_config(w1_scale=w.w1_scale, w2_scale=w.w2_scale,
                                       block_shape=[128, 128])
        kernel = mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(),
                                   vllm_dg.DeepGemmExperts(cfg, qc))

        def call(x, topk_weights, topk_ids):
            return kernel.apply(x, w.w1, w.w2, topk_weights, topk_ids, MoEActivation.SILU, E,
                                None, False)
        return call

    def record(call):
        """One call with vLLM's DeepGEMM wrapper recorded: (replay of its two GEMM calls on the
        recorded operands, GEMM1's operands)."""
        real = vllm_dg.m_grouped_fp8_gemm_nt_contiguous
        seen = []
        vllm_dg.m_grouped_fp8_gemm_nt_contiguous = lambda *a, **k: (seen.append((a, k)),
                                                                     real(*a, **k))[1]
        try:
            call()
        finally:
            vllm_dg.m_grouped_fp8_gemm_nt_contiguous = real

        def replay():
            for args, kwargs in seen:
                real(*args, **kwargs)
        (a, _, _, layout), kwargs = seen[0]
        return replay, operands(a, layout, bool(kwargs.get("use_psum_layout")))

    return (make, record), stand_ins


def vllm_row(anchor, stand_ins, w, M) -> dict:
    """The vllm row at M (module docstring); anchor: vllm_deep_gemm_layer's (make, record), or
    None (then the row says why: stand_ins holds the reason)."""
    if anchor is None:
        return dict(backend="vllm", M=M, missing=stand_ins)
    make, record = anchor
    x, weights, ids = make_inputs(M, LOCAL_NUM_EXPERTS, seed=M)
    call = make(w)
    ids32 = ids.to(torch.int32)  # our rows' ids too
    layer = lambda: call(x, weights, ids32)  # noqa: E731
    with peak_memory() as peak:
        out = layer()
    gemms, ops = record(layer)
    _OPERANDS.append(("vllm", M, ops))
    ours = _OUTPUTS.get(M)
    row = dict(backend="vllm", M=M, **timing_columns(layer, gemms, M, graphs=False),
               peak_MiB=peak.bytes / 2**20,
               diff=None if ours is None else calc_diff(out, ours), pdl=deep_gemm_pdl(),
               stand_ins=stand_ins)
    count_kernels_later(row, layer)
    print_table([row], [c for c in row if c != "stand_ins"])
    return row


def save_layer_rows(shape, rows) -> None:
    """experts.json with the rows so far (a run cut by a time limit keeps them)."""
    write_json("experts", dict(shape=shape, deep_gemm=dg.is_available(), results=rows,
                               operands=[dict(backend=b, M=m, **ops) for b, m, ops in _OPERANDS],
                               partial=True))


def print_versus_vllm(rows) -> None:
    """Our deep_gemm rows over the vllm rows at each M: us, loop_us, gemms_us, host_us."""
    theirs = {r["M"]: r for r in rows if r["backend"] == "vllm" and r.get("us")}
    table = []
    for r in rows:
        v = theirs.get(r["M"]) if r["backend"] == "deep_gemm" else None
        if v is not None:
            table.append(dict(M=r["M"], **{f"{c}_ratio": r[c] / v[c] for c in
                                           ("us", "loop_us", "gemms_us", "host_us")}))
    if table:
        print("\nours (deep_gemm) / vLLM's DeepGEMM layer, same run")
        print_table(table, list(table[0]))


def kernel_table(fn, calls: int = 5) -> list[dict]:
    """GPU time per call of each kernel fn launches (torch.profiler, after a warm-up call),
    largest first; names cut at their first '<' or '(' and at 60 characters."""
    totals: dict = {}
    for e in cuda_kernel_events(fn, calls):
        name = e.name.split("<")[0].split("(")[0][:60]
        n, t = totals.get(name, (0, 0.0))
        totals[name] = (n + 1, t + e.time_range.elapsed_us())
    whole = sum(t for _, t in totals.values()) or 1.0
    return sorted((dict(kernel=k, per_call=n / calls, us=t / calls, share=t / whole)
                   for k, (n, t) in totals.items()), key=lambda r: -r["us"])


def bench_chunk_sizes(name, make_experts, w):
    """Time per token and peak memory at M = CHUNK_SWEEP_M for each chunk size."""
    rows = []
    x, weights, ids = make_inputs(CHUNK_SWEEP_M, LOCAL_NUM_EXPERTS, seed=1)
    kw = dict(w1_scale=w[1], w2_scale=w[3], global_num_experts=LOCAL_NUM_EXPERTS)
    saved = os.environ.get("VLLM_FUSED_MOE_CHUNK_SIZE")
    try:
        for chunk in CHUNK_SIZES:
            os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = str(chunk)
            kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(defer_input_quant=True),
                                           make_experts())
            layer = lambda: kernel(x, w[0], w[2], weights, ids, **kw)  # noqa: E731
            torch.cuda.empty_cache()
            with peak_memory() as peak:
                layer()
            us = bench_us(layer, [()], warmup=5, rep=200)
            rows.append(dict(backend=name, M=CHUNK_SWEEP_M, chunk=chunk, us=us,
                             ns_per_token=us * 1e3 / CHUNK_SWEEP_M, peak_MiB=peak.bytes / 2**20))
            print_table(rows[-1:], list(rows[-1]))
            kernel = layer = None  # free the workspaces before the next chunk size
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
    parser.add_argument("--backends", nargs="+", choices=("triton", "deep_gemm", "vllm"),
                        default=["triton", "deep_gemm", "vllm"],
                        help="layer rows to run (vllm: the second anchor; the other tables take "
                             "triton and deep_gemm)")
    parser.add_argument("--profile", type=int, nargs="*", default=[],
                        help="M values whose layer calls get a per-kernel GPU time table")
    args = parser.parse_args()
    require_cuda("bench_experts")
    backends = [("triton", TritonExperts, BatchedTritonExperts)]
    if dg.is_available():
        backends.append(("deep_gemm", DeepGemmExperts, BatchedDeepGemmExperts))
    backends = [b for b in backends if b[0] in args.backends]
    shape = dict(K=K, I=I, E_local=LOCAL_NUM_EXPERTS, topk=TOPK)
    tables = []
    w = make_weights(LOCAL_NUM_EXPERTS)
    if not args.skip_layer:
        layer = []
        tables.append(("layer", "experts", layer))
        # The vLLM anchor first: building it turns DeepGEMM's PDL on for the whole process, so
        # every row below runs under the setting of a vLLM process (the pdl column says which).
        anchor, stand_ins = vllm_deep_gemm_layer() if "vllm" in args.backends else (None, None)
        if "vllm" in args.backends:
            print(f"vllm anchor: {stand_ins}")
        # deep_gemm and vllm side by side per M, triton after: a time limit keeps the pairs.
        order = [b for b in backends if b[0] == "deep_gemm"]
        for M in args.m:
            for name, cls, _ in order:
                layer.append(layer_row(name, cls, w, M))
                save_layer_rows(shape, layer)
            if "vllm" in args.backends:
                layer.append(vllm_row(anchor, stand_ins, w, M))
                save_layer_rows(shape, layer)
        for name, cls, _ in backends:
            if name != "deep_gemm":
                for M in args.m:
                    layer.append(layer_row(name, cls, w, M))
                    save_layer_rows(shape, layer)
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
    profiles = []
    for row, fn in _TO_PROFILE:
        row["kernels"] = kernels_per_call(fn)[0]
        if "gemms_us" in row and row["M"] in args.profile:
            table = kernel_table(fn)
            gemm_us = sum(r["us"] for r in table if "gemm" in r["kernel"].lower())
            total_us = sum(r["us"] for r in table)
            row["beyond_gemm_kernels"] = 1 - gemm_us / total_us
            profiles.append(dict(backend=row["backend"], M=row["M"], kernels=table,
                                 gpu_us=total_us, gemm_kernels_us=gemm_us))
            print(f"\nkernels of one call: {row['backend']}, M={row['M']}: {total_us:.1f} us of "
                  f"GPU time, {total_us - gemm_us:.1f} us ({1 - gemm_us / total_us:.1%}) beyond "
                  f"the GEMM kernels")
            print_table(table, list(table[0]))
    if _OPERANDS:
        print("\nwhat GEMM1 hands the grouped GEMM (GEMM2: the same layout)")
        print_table([dict(backend=b, M=m, **ops) for b, m, ops in _OPERANDS],
                    ["backend", "M", *_OPERANDS[0][2]])
    if not args.skip_layer:
        print_versus_vllm(tables[0][2])
    for title, json_name, rows in tables:
        print(f"\n{title}")
        columns = [c for c in dict.fromkeys(c for r in rows for c in r)
                   if c not in ("stand_ins", "graph_error", "missing")]
        print_table(rows, columns)
        extra = {}
        if json_name == "experts":
            extra = dict(operands=[dict(backend=b, M=m, **ops) for b, m, ops in _OPERANDS],
                         profiles=profiles)
        write_json(json_name, dict(shape=shape, deep_gemm=dg.is_available(), results=rows,
                                   **extra))


if __name__ == "__main__":
    main()
