"""GPU time of our contiguous DeepGEMM layer against vLLM 0.33's DeepGEMM layer, same run.

Run from the repository root on a GPU with DeepGEMM and vLLM's Python tree importable:

    python -m benchmarks.bench_gpu_time                  # M 128 1024 8192, JSON gpu_time.json
    python -m benchmarks.bench_gpu_time --m 1024 --rounds 3

bench_experts' shapes (K 7168, I 2048, 8 local experts, top-8). For each M, in this order (timings
before any profile: torch.profiler slows later launches):

  gemms      the two grouped GEMM calls alone, ours (with and without DeepGEMM's expected-M
             hint) and vLLM's recorded calls, interleaved over --rounds rounds (do_bench medians;
             the median over rounds): the same work, so any gap is in the arguments
  layer      per call (do_bench) and per CUDA-graph replay of our layer with PDL as
             contiguous_experts.deep_gemm_pdl chooses, forced on, forced off; vLLM's layer as
             vLLM runs it (PDL on)
  sweep      (--sweep M...) the SiLU kernel's launch configs on those M's layouts
  silu       SiLU-and-mul + requant on the layer's layout (padding rows skipped through the psum
             ends): ours, vLLM's kernel (same input, same ends), and the byte floor (the time
             of _byte_floor_kernel: the slots' rows read once and written once with one
             multiply between), and both kernels' time inside the layer (profile) over that
             floor; beyond_floor_us puts all three non-GEMM steps' bytes at that floor's rate
  profile    per-kernel GPU time of one call (torch.profiler): ours with PDL on and off, vLLM's

Every ratio is ours / vLLM's from this run.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from benchmarks import bench_experts as be
from benchmarks._common import bench_us, graph_us, print_table, require_cuda, write_json
from vllm_moe_fixes.fused_moe import contiguous_experts as ce
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.fused_moe.no_ep_prepare_finalize import NoEPPrepareAndFinalize
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, empty_mn_major_scales
from vllm_moe_fixes.ops.silu_mul_quant import silu_and_mul_quant_fp8_triton

K, I, E, TOPK = be.K, be.I, be.LOCAL_NUM_EXPERTS, be.TOPK
RULE = ce.deep_gemm_pdl
PDL_RULES = {"rule": RULE, "on": lambda num_slots: True, "off": lambda num_slots: False}


def our_layer(w, M):
    """(layer call, experts, kernel) of our DeepGEMM layer at M on bench_experts' inputs."""
    x, weights, ids = be.make_inputs(M, E, seed=M)
    experts = ce.DeepGemmExperts()
    kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(defer_input_quant=True), experts)
    kw = dict(w1_scale=w[1], w2_scale=w[3], global_num_experts=E)
    ids = ids.to(torch.int32)
    return (lambda: kernel(x, w[0], w[2], weights, ids, **kw)), experts, kernel


def vllm_layer(anchor, w, M):
    make, record = anchor
    x, weights, ids = be.make_inputs(M, E, seed=M)
    call = make(w)
    ids = ids.to(torch.int32)
    layer = lambda: call(x, weights, ids)  # noqa: E731
    layer()
    return layer, record(layer)[0]


def with_pdl_rule(rule: str, fn):
    """fn run with contiguous_experts.deep_gemm_pdl replaced by PDL_RULES[rule]."""
    def run():
        ce.deep_gemm_pdl = PDL_RULES[rule]
        try:
            fn()
        finally:
            ce.deep_gemm_pdl = RULE
    return run


def our_gemms(kernel, experts, w, M, hint: bool):
    """Our two GEMM calls on the layout the last layer call left, with or without expected_m,
    PDL as the rule chooses."""
    ws13, ws2, _ = experts.workspace_shapes(M, I, K, TOPK, E)
    v = ce.workspace_views(*kernel.workspaces.get(ws13, ws2, w[0].device, torch.bfloat16),
                           M * TOPK, E, K, I)
    expected_m = -(-M * TOPK // E) if hint else None

    def run():
        with experts.launch_settings(M * TOPK):
            experts.gemm(v.a, (w[0], w[1]), v.h, v.layout.m_indices, v.layout.expert_ends,
                         expected_m=expected_m)
            experts.gemm(v.g, (w[2], w[3]), v.y, v.layout.m_indices, v.layout.expert_ends,
                         expected_m=expected_m)
    return run, v


def interleaved(fns: dict, rounds: int) -> dict:
    """Median over rounds of each fn's do_bench median, the fns alternating within a round."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench_us(fn, [()]))
    return {name: statistics.median(t) for name, t in times.items()}


@triton.jit
def _byte_floor_kernel(h_ptr, q_ptr, s_ptr, num_rows, I: tl.constexpr, ROWS: tl.constexpr,
                       GROUP: tl.constexpr):
    """One program per ROWS rows x one 128-group: the SiLU step's loads and stores, one multiply
    between. Its time is what the bytes alone cost on this GPU (a copy's bandwidth is not: a
    read-heavy mix streams faster than a copy, and vLLM's kernel beat a copy-bandwidth floor)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    live = rows < num_rows
    offsets = rows[:, None] * 2 * I + cols[None, :]
    gate = tl.load(h_ptr + offsets, mask=live[:, None]).to(tl.float32)
    up = tl.load(h_ptr + offsets + I, mask=live[:, None]).to(tl.float32)
    y = gate * up
    tl.store(s_ptr + rows * (I // GROUP) + group, tl.max(tl.abs(y), axis=1), mask=live)
    tl.store(q_ptr + rows[:, None] * I + cols[None, :], y.to(q_ptr.dtype.element_ty),
             mask=live[:, None])


def byte_floor_us(slots: int) -> float:
    """The byte floor of SiLU-and-mul + requant over `slots` rows: _byte_floor_kernel's fastest
    tile height."""
    h = torch.randn(slots, 2 * I, device="cuda").bfloat16()
    q = torch.empty(slots, I, dtype=FP8_DTYPE, device="cuda")
    s = torch.empty(slots, I // 128, device="cuda")

    def run(rows):
        grid = (triton.cdiv(slots, rows), I // 128)
        return lambda: _byte_floor_kernel[grid](h, q, s, slots, I=I, ROWS=rows, GROUP=128)

    return min(bench_us(run(rows), [()]) for rows in (4, 8, 16, 32))


def silu_rows(v, M):
    """Our SiLU kernel and vLLM's on the layout's psum ends, and the byte floor."""
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        silu_mul_per_token_group_quant_fp8_colmajor as vllm_silu,
    )
    m_sum = v.h.shape[0]
    h = torch.randn(m_sum, 2 * I, device="cuda").bfloat16()
    q = torch.empty(m_sum, I, dtype=FP8_DTYPE, device="cuda")
    s = empty_mn_major_scales((m_sum, I // 128), "cuda")
    ends = v.layout.expert_ends
    slots = M * TOPK
    floor_us = byte_floor_us(slots)
    ours = lambda: silu_and_mul_quant_fp8_triton(h, q, s, None, False, expert_ends=ends)  # noqa
    theirs = lambda: vllm_silu(h, q, use_ue8m0=False, expert_ends=ends,  # noqa: E731
                               expert_alignment=128)
    t = interleaved({"ours": ours, "vllm": theirs}, 3)
    return dict(M=M, slots=slots, m_sum=m_sum, ours_us=t["ours"], vllm_us=t["vllm"],
                floor_us=floor_us, ours_over_floor=t["ours"] / floor_us,
                vllm_over_floor=t["vllm"] / floor_us, ours_over_vllm=t["ours"] / t["vllm"])


def silu_sweep(v, M):
    """Our SiLU kernel's launch configs on the layout (graph replay medians), best first."""
    m_sum = v.h.shape[0]
    h = torch.randn(m_sum, 2 * I, device="cuda").bfloat16()
    q = torch.empty(m_sum, I, dtype=FP8_DTYPE, device="cuda")
    s = empty_mn_major_scales((m_sum, I // 128), "cuda")
    rows = []
    for bm, gp, warps, progs in [(bm, gp, w, p) for bm in (2, 4, 8, 16) for gp in (1, 2, 4)
                                 for w in (4, 8) for p in (2048, 8192, 32768)]:
        if bm * gp * 128 // (warps * 32) < 4:
            continue  # fewer than 4 elements per thread
        fn = lambda bm=bm, gp=gp, w=warps, p=progs: silu_and_mul_quant_fp8_triton(  # noqa
            h, q, s, None, False, expert_ends=v.layout.expert_ends, block_m=bm,
            groups_per_prog=gp, num_warps=w, max_programs=p)
        rows.append(dict(M=M, block_m=bm, groups_per_prog=gp, num_warps=warps,
                         max_programs=progs, us=graph_us(fn, [()], calls=8)))
    return sorted(rows, key=lambda r: r["us"])


def kernel_split(fn) -> dict:
    table = be.kernel_table(fn)
    total = sum(r["us"] for r in table)
    gemm = sum(r["us"] for r in table if "gemm" in r["kernel"].lower())
    silu = sum(r["us"] for r in table if "silu" in r["kernel"].lower())
    return dict(gpu_us=total, gemm_us=gemm, beyond_us=total - gemm, silu_us=silu,
                beyond_share=(total - gemm) / total, kernels=table)


def measure(M, w, anchor, rounds, sweep):
    layer, experts, kernel = our_layer(w, M)
    layer()
    their_layer, their_gemms = vllm_layer(anchor, w, M)
    gemms_hint, v = our_gemms(kernel, experts, w, M, hint=True)
    gemms_plain, _ = our_gemms(kernel, experts, w, M, hint=False)
    g = interleaved({"ours_hint": gemms_hint, "ours_plain": gemms_plain, "vllm": their_gemms},
                    rounds)
    row = dict(M=M, gemms_ours_hint_us=g["ours_hint"], gemms_ours_plain_us=g["ours_plain"],
               gemms_vllm_us=g["vllm"], gemms_ratio_hint=g["ours_hint"] / g["vllm"],
               gemms_ratio_plain=g["ours_plain"] / g["vllm"])
    per_call = interleaved({**{f"ours_{r}": with_pdl_rule(r, layer) for r in PDL_RULES},
                            "vllm": their_layer}, rounds)
    row.update({f"us_{k}": t for k, t in per_call.items()})
    for rule in PDL_RULES:
        row[f"graph_us_ours_{rule}"] = graph_us(with_pdl_rule(rule, layer), [()],
                                                calls=max(1, 1024 // M))
    row["us_ratio_rule"] = per_call["ours_rule"] / per_call["vllm"]
    silu = silu_rows(v, M)
    sweep_rows = silu_sweep(v, M) if sweep else []
    profiles = {f"ours_pdl_{r}": kernel_split(with_pdl_rule(r, layer)) for r in ("on", "off")}
    profiles["vllm"] = kernel_split(their_layer)
    rule = "on" if ce.deep_gemm_pdl(M * TOPK) else "off"
    ours_p, their_p = profiles[f"ours_pdl_{rule}"], profiles["vllm"]
    silu.update(layer_ours_us=ours_p["silu_us"], layer_vllm_us=their_p["silu_us"],
                layer_ours_over_floor=ours_p["silu_us"] / silu["floor_us"],
                layer_vllm_over_floor=their_p["silu_us"] / silu["floor_us"])
    # The beyond-GEMM kernels' bytes (input quant + permute, SiLU step, unpermute + sum) at the
    # SiLU byte floor's rate: the least they cost as separate kernels, and the layer ratio
    # that leaves with our GEMM time (below it only by fusing them into the GEMMs).
    slots = M * TOPK
    quant_permute_bytes = M * K * 2 + slots * (K + K // 128 * 4)  # bf16 in, FP8 + scales out
    silu_bytes = slots * (2 * I * 2 + I + I // 128 * 4)
    unpermute_bytes = slots * K * 2 + M * K * 2  # the experts' bf16 rows in, the sums out
    beyond_floor_us = ((quant_permute_bytes + silu_bytes + unpermute_bytes) / silu_bytes
                       * silu["floor_us"])
    row.update(beyond_floor_us=beyond_floor_us,
               gpu_ratio_floor=(ours_p["gemm_us"] + beyond_floor_us) / their_p["gpu_us"])
    row.update(gpu_ratio=ours_p["gpu_us"] / their_p["gpu_us"],
               gemm_kernels_ratio=ours_p["gemm_us"] / their_p["gemm_us"],
               beyond_share_ours=ours_p["beyond_share"], beyond_share_vllm=their_p["beyond_share"])
    return row, silu, sweep_rows, profiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[128, 1024, 8192])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sweep", type=int, nargs="*", default=[],
                        help="M values whose layout gets the SiLU kernel's config sweep")
    args = parser.parse_args()
    require_cuda("bench_gpu_time")
    anchor, stand_ins = be.vllm_deep_gemm_layer()
    if anchor is None:
        raise SystemExit(f"vLLM's layer is the anchor and cannot run: {stand_ins}")
    w = be.make_weights(E)
    rows, silus, sweeps, profiles = [], [], [], []
    for M in args.m:
        row, silu, sweep, prof = measure(M, w, anchor, args.rounds, M in args.sweep)
        rows.append(row)
        silus.append(silu)
        sweeps += sweep
        profiles.append(dict(M=M, **prof))
        print_table([row], list(row))
        print_table([silu], list(silu))
        if sweep:
            print_table(sweep[:6], list(sweep[0]))
        for name, p in prof.items():
            print(f"{name} M={M}: GPU {p['gpu_us']:.1f} us, GEMM kernels {p['gemm_us']:.1f}, "
                  f"beyond {p['beyond_us']:.1f} ({p['beyond_share']:.1%}), silu {p['silu_us']:.1f}")
        write_json("gpu_time", dict(anchor="vLLM 0.33 DeepGemmExperts layer, same run",
                                    stand_ins=stand_ins, shape=dict(K=K, I=I, E_local=E, topk=TOPK),
                                    rows=rows, silu=silus, silu_sweep=sweeps, profiles=profiles))
    print("\nours / vLLM, same run")
    print_table(rows, list(rows[0]))
    print_table(silus, list(silus[0]))


if __name__ == "__main__":
    main()
