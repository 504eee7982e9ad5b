"""Triton grouped FP8 GEMM (contiguous and masked layouts) against DeepGEMM and dense anchors.

Run from the repository root on a GPU:

    python -m benchmarks.bench_grouped_gemm          # table, benchmarks/results/grouped_gemm.json
    python -m benchmarks.bench_grouped_gemm --sweep  # also TFLOP/s of every SWEEP config per shape
    python -m benchmarks.bench_grouped_gemm --compile-only 0,1 &   # Triton's cache, in parallel
    python -m benchmarks.bench_grouped_gemm --warm-deepgemm --shapes 0,1 &  # DeepGEMM's JIT cache

TFLOP/s count useful rows only: 2 * groups * rows * N * K. Anchors measured in the same run:
DeepGEMM when it imports (through vllm_moe_fixes._compat.deep_gemm), torch._scaled_mm FP8 dense
of the same total M x N x K (tensorwise scales: less work than block scaling, so a hardware
ceiling rather than a like-for-like), and a bf16 torch.matmul. DeepGEMM v2.6.1's TFLOP/s on an
H200 (SHAPES) are printed beside them, for machines without DeepGEMM.
"""

import argparse
import math
import sys

import torch
import triton

from benchmarks._common import bench_us, print_table, require_cuda, write_json
from vllm_moe_fixes._compat import deep_gemm as dg
from vllm_moe_fixes.fused_moe import FusedMoEModularKernel, NoEPPrepareAndFinalize, TritonExperts
from vllm_moe_fixes.fused_moe.routing import fused_topk
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, SCALE_BLOCK, empty_mn_major_scales
from vllm_moe_fixes.ops.fp8_quant import per_token_group_quant_fp8, per_token_group_quant_fp8_ref
from vllm_moe_fixes.ops.grouped_gemm import (
    contiguous_config,
    grouped_fp8_gemm_contiguous_ref,
    grouped_fp8_gemm_contiguous_triton,
    grouped_fp8_gemm_masked_triton,
    masked_config,
)
from vllm_moe_fixes.testing import calc_diff, quant_block_fp8

# (groups, rows per group, N, K) -> DeepGEMM v2.6.1's TFLOP/s on an H200 (its grouped contiguous
# GEMM, same shapes).
SHAPES = {
    (4, 8192, 4096, 7168): 1225,
    (4, 8192, 7168, 2048): 1134,
    (8, 4096, 4096, 7168): 1206,
    (8, 1024, 4096, 7168): 1085,
    (8, 1024, 7168, 2048): 1061,
    (32, 256, 4096, 7168): 904,
}


def _cfg(bm, bn, warps, stages, group_m, **flags):
    return dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=group_m, num_warps=warps, num_stages=stages,
                **flags)


# Candidates of --sweep: DEFAULT_CONFIG's tile with each GROUP_M that contiguous_config can pick
# (the first one is the reference of the others' bits), and the nearest larger tile. The table of
# the default (no config) shows what contiguous_config picked for each shape.
SWEEP = [
    _cfg(64, 128, 4, 3, 32), _cfg(64, 128, 4, 3, 16), _cfg(64, 128, 4, 3, 8),
    _cfg(64, 128, 4, 3, 4), _cfg(128, 128, 8, 4, 16),
]


def tflops(flops: float, us: float | None) -> float | None:
    return None if us is None else flops / (us * 1e-6) / 1e12


def timed_us(fn) -> float:
    fn()  # compile / JIT outside the timed region
    torch.cuda.synchronize()
    return bench_us(fn, [()])


def config_name(cfg: dict) -> str:
    flags = (f" acc{cfg['IMPRECISE_ACC']}" if cfg.get("IMPRECISE_ACC") else "") + (
        " ws" if cfg.get("WARP_SPECIALIZE") else "")
    return (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} {cfg['num_warps']}w {cfg['num_stages']}s "
            f"g{cfg['GROUP_M']}{flags}")


# ---------------------------------------------------------------- problems
def make_inputs(groups, rows, N, K):
    """Random FP8 operands: contiguous rows [groups*rows, K] with MN-major TMA-aligned scales."""
    M = groups * rows
    a_q = (torch.randn(M, K, device="cuda") * 0.5).to(FP8_DTYPE)
    a_s = empty_mn_major_scales((M, K // SCALE_BLOCK), "cuda")
    a_s.copy_(torch.rand(M, K // SCALE_BLOCK, device="cuda") * 0.01 + 0.001)
    w_q = (torch.randn(groups, N, K, device="cuda") * 0.5).to(FP8_DTYPE)
    w_s = torch.rand(groups, N // SCALE_BLOCK, K // SCALE_BLOCK, device="cuda") * 0.01 + 0.001
    m_idx = torch.arange(groups, device="cuda", dtype=torch.int32).repeat_interleave(rows)
    return (a_q, a_s), (w_q, w_s), m_idx


def masked_view(a, groups, rows):
    """Masked-layout view of the same rows: a_q [E, T, K], scales MN-major per expert."""
    a_q, a_s = a
    K = a_q.shape[1]
    s = empty_mn_major_scales((groups, rows, K // SCALE_BLOCK), "cuda")
    s.copy_(a_s.reshape(groups, rows, K // SCALE_BLOCK))
    return a_q.view(groups, rows, K), s


def run_shape(shape, figure, sweep):
    groups, rows, N, K = shape
    M = groups * rows
    flops = 2.0 * M * N * K
    a, w, m_idx = make_inputs(groups, rows, N, K)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    am = masked_view(a, groups, rows)
    out_m = out.view(groups, rows, N)
    masked_m = torch.full((groups,), rows, device="cuda", dtype=torch.int32)
    rec = dict(groups=groups, rows=rows, N=N, K=K, figure_deepgemm_tflops=figure,
               config=contiguous_config(M, groups, K=K), masked_config=masked_config(K))

    ref = None
    if sweep:
        rec["sweep"] = []
        for cfg in SWEEP:
            out.fill_(float("nan"))
            try:
                us = timed_us(lambda c=cfg: grouped_fp8_gemm_contiguous_triton(a, w, out, m_idx, c))
                # Every config must agree with the first one (the default config), bit for bit.
                ref = out.clone() if ref is None else ref
                diff, equal = calc_diff(out, ref), torch.equal(out, ref)
                out.fill_(float("nan"))  # the masked view of the same rows writes them again
                us_m = timed_us(lambda c=cfg: grouped_fp8_gemm_masked_triton(am, w, out_m, masked_m,
                                                                             rows, c))
            except Exception as exc:  # noqa: BLE001 (out of resources, ...): report and go on
                print(f"  {shape} {config_name(cfg)}: failed ({type(exc).__name__}: "
                      f"{str(exc)[:80]})")
                continue
            diff_m, equal_m = calc_diff(out, ref), torch.equal(out, ref)
            rec["sweep"].append(dict(config=cfg, us=us, tflops=tflops(flops, us), diff=diff,
                                     masked_tflops=tflops(flops, us_m), masked_diff=diff_m,
                                     equal_to_default=equal and equal_m))
            bad = "" if equal and equal_m else (
                "  WRONG" if not max(diff, diff_m) < 1e-5 else "  not bit-equal")
            print(f"  {shape} {config_name(cfg):<26} {tflops(flops, us):7.1f} TFLOP/s, masked "
                  f"{tflops(flops, us_m):7.1f} (diff vs default {diff:.1e} / {diff_m:.1e}{bad})")
        if not rec["sweep"]:
            sys.exit(f"no config of SWEEP ran on {shape}")
        for key in ("tflops", "masked_tflops"):
            best = max(rec["sweep"], key=lambda r, k=key: r[k])
            print(f"  best {key} for {shape}: {config_name(best['config'])} {best[key]:.1f}")
            rec["best_" + key] = best[key]

    us = timed_us(lambda: grouped_fp8_gemm_contiguous_triton(a, w, out, m_idx))
    rec["triton_us"], rec["triton_tflops"] = us, tflops(flops, us)
    us = timed_us(lambda: grouped_fp8_gemm_masked_triton(am, w, out_m, masked_m, rows))
    rec["triton_masked_tflops"] = tflops(flops, us)
    triton_out = out.clone()

    rec["deepgemm_tflops"] = rec["deepgemm_masked_tflops"] = rec["diff_vs_deepgemm"] = None
    if dg.is_available():
        us = timed_us(lambda: dg.m_grouped_fp8_gemm_nt_contiguous(a, w, out, m_idx))
        rec["deepgemm_tflops"] = tflops(flops, us)
        rec["diff_vs_deepgemm"] = calc_diff(triton_out, out)
        try:
            us = timed_us(lambda: dg.m_grouped_fp8_gemm_nt_masked(am, w, out_m, masked_m, rows))
            rec["deepgemm_masked_tflops"] = tflops(flops, us)
        except RuntimeError as exc:
            print(f"  DeepGEMM masked GEMM unavailable: {exc}")

    # Dense anchors over the same total M x N x K.
    a_q = a[0]
    b = w[0][0]  # [N, K]: b.t() is the column-major operand _scaled_mm wants
    one = torch.ones((), device="cuda")
    us = timed_us(lambda: torch._scaled_mm(a_q, b.t(), scale_a=one, scale_b=one,
                                           out_dtype=torch.bfloat16))
    rec["scaled_mm_tflops"] = tflops(flops, us)
    x16, w16 = a_q.to(torch.bfloat16), b.to(torch.bfloat16).t()
    us = timed_us(lambda: torch.matmul(x16, w16))
    rec["bf16_tflops"] = tflops(flops, us)
    return rec


def _dash(v):
    return "-" if v is None else v


def print_results(records):
    rows = []
    for r in records:
        t, d, fig = r["triton_tflops"], r["deepgemm_tflops"], r["figure_deepgemm_tflops"]
        tm, dm = r["triton_masked_tflops"], r["deepgemm_masked_tflops"]
        rows.append({
            "groups x rows": f"{r['groups']} x {r['rows']}", "N": r["N"], "K": r["K"],
            "GROUP_M": r["config"]["GROUP_M"], "triton": t, "masked": tm, "DeepGEMM": _dash(d),
            "ratio": _dash(d and t / d), "DG v2.6.1": fig, "v2.6.1 ratio": t / fig,
            "DG masked": _dash(dm), "masked ratio": _dash(dm and tm / dm),
            "_scaled_mm": r["scaled_mm_tflops"],
            "bf16": r["bf16_tflops"],
            "diff vs DG": _dash(r["diff_vs_deepgemm"] and f"{r['diff_vs_deepgemm']:.1e}"),
        })
    print(f"\nTFLOP/s over useful rows on {torch.cuda.get_device_name()} (triton "
          f"{triton.__version__}, torch {torch.__version__}, DeepGEMM "
          f"{'present' if dg.is_available() else 'absent'})")
    print_table(rows, list(rows[0]))
    print("ratio = Triton / DeepGEMM (same run, target >= 0.85), masked ratio the same for the "
          "masked GEMMs; GROUP_M: contiguous_config's pick; v2.6.1 ratio = Triton / DeepGEMM "
          "v2.6.1's TFLOP/s on an H200; _scaled_mm is tensorwise FP8 (a ceiling).")


def _geomean(values):
    return math.exp(sum(map(math.log, values)) / len(values))


def print_sweep(records):
    """Per kernel, one row per config: TFLOP/s on each shape, the geometric mean of its ratio
    to the best config of each shape, and (DeepGEMM present) its lowest and geometric-mean ratio
    to DeepGEMM's same-layout TFLOP/s in this run."""
    for key, dg_key, kernel in (("tflops", "deepgemm_tflops", "contiguous"),
                                ("masked_tflops", "deepgemm_masked_tflops", "masked")):
        rows = []
        for cfg in SWEEP:
            row, ratios, dg_ratios = {"config": config_name(cfg)}, [], []
            for r in records:
                hit = [s for s in r["sweep"] if s["config"] is cfg]
                row[f"{r['groups']}x{r['rows']} {r['N']}/{r['K']}"] = hit[0][key] if hit else "-"
                if hit:
                    ratios.append(hit[0][key] / r["best_" + key])
                    if r.get(dg_key):
                        dg_ratios.append(hit[0][key] / r[dg_key])
            full = len(ratios) == len(records)
            row["vs best (geomean)"] = _geomean(ratios) if full else "-"
            with_dg = len(dg_ratios) == len(records)
            row["/DG min"] = min(dg_ratios) if with_dg else "-"
            row["/DG geomean"] = _geomean(dg_ratios) if with_dg else "-"
            rows.append(row)
        print(f"\nSweep, {kernel} kernel: TFLOP/s per config and shape; 'vs best' 1.0 = best "
              "on every shape; /DG = ratio to DeepGEMM's TFLOP/s of the same layout, this run")
        print_table(rows, list(rows[0]))


# ---------------------------------------------------------------- accuracy (--accuracy)
# The FP8 accumulation of each kernel against the exact block-scaled product, and vLLM's
# fused-moe test (tests/kernels/moe/test_block_fp8.py, test_w8a8_block_fp8_fused_moe) at the
# K = 7168 cases that left its tolerance (issue 22), with our layer on each GEMM variant.
# Inputs as that test draws them: a = randn / 10 (bf16), weights randn / 15 block-quantised.
# The reference here quantises activations with exact amax / 448 scales, as vLLM does where
# DeepGEMM's E8M0 is off; where DeepGEMM imports on SM90, vLLM (and so its test's reference)
# rounds them up to powers of two. The test itself, run with our layer:
# tests/vllm_support/block_fp8_ours.py (benchmarks/results/vllm_block_fp8_h200.txt).
# "default" is the config the library runs (at K >= PROMOTE_FROM_K it promotes every 64 of K);
# "per128" Triton's own default, one promotion per 128-wide block as DeepGEMM does.
ACCURACY_VARIANTS = {"default": {}, "per128": {"IMPRECISE_ACC": 0},
                     "imprecise64": {"IMPRECISE_ACC": 64}, "imprecise32": {"IMPRECISE_ACC": 32}}
# (M, N = vLLM's intermediate size, K, E, top-k): the failing cases named in issue 22.
VLLM_FAILING_CASES = [(8192, 4608, 7168, 2, 1), (83, 4608, 7168, 2, 1), (83, 4608, 7168, 2, 2),
                      (128, 4608, 7168, 2, 1), (8192, 1024, 7168, 2, 1), (1, 4608, 7168, 2, 2)]


def exact_block_gemm(a_q, a_s, w_q, w_s):
    """float64 [R, N]: sum over K blocks of exact FP8 dot products times both scales."""
    acc = torch.zeros(a_q.shape[0], w_q.shape[0], dtype=torch.float64, device=a_q.device)
    w_s64 = w_s.double().repeat_interleave(SCALE_BLOCK, dim=0)[:w_q.shape[0]]
    for kb in range(a_q.shape[1] // SCALE_BLOCK):
        cols = slice(kb * SCALE_BLOCK, (kb + 1) * SCALE_BLOCK)
        part = a_q[:, cols].double() @ w_q[:, cols].double().t()
        acc += part * a_s[:, kb:kb + 1].double() * w_s64[:, kb]
    return acc


def _error_stats(out, exact):
    d = out.double() - exact
    return dict(rel_l2=float(d.norm() / exact.norm()),
                max_abs_over_rms=float(d.abs().max() / exact.pow(2).mean().sqrt()),
                bf16_mismatch=float((out != exact.to(torch.bfloat16)).double().mean()))


def gemm_accuracy(groups=2, rows=2048, N=9216, K=7168):
    """Each variant and DeepGEMM against exact_block_gemm on vLLM-test-like operands."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(groups * rows, K, device="cuda", generator=g).bfloat16() / 10
    a_q, a_s_rows = per_token_group_quant_fp8(x, SCALE_BLOCK)
    a_s = empty_mn_major_scales(a_s_rows.shape, "cuda")
    a_s.copy_(a_s_rows)
    w_q, w_s = quant_block_fp8(torch.randn(groups, N, K, device="cuda", generator=g) / 15)
    m_idx = torch.arange(groups, device="cuda", dtype=torch.int32).repeat_interleave(rows)
    exact = torch.cat([exact_block_gemm(a_q[e * rows:(e + 1) * rows], a_s_rows[e * rows:
                                        (e + 1) * rows], w_q[e], w_s[e]) for e in range(groups)])
    out = torch.empty(groups * rows, N, device="cuda", dtype=torch.bfloat16)
    rec = {"shape": [groups, rows, N, K]}
    for name, cfg in ACCURACY_VARIANTS.items():
        grouped_fp8_gemm_contiguous_triton((a_q, a_s), (w_q, w_s), out, m_idx, cfg)
        rec[name] = _error_stats(out, exact)
    if dg.is_available():
        dg.m_grouped_fp8_gemm_nt_contiguous((a_q, a_s), (w_q, w_s), out, m_idx)
        rec["deepgemm"] = _error_stats(out, exact)
    return rec


def _vllm_block_matmul(a, w, w_s):
    """vLLM's test reference for one GEMM: a (bf16) quantised per 1x128 group, each K block's
    float32 product scaled and summed in float32, rounded to bf16."""
    a_q, a_s = per_token_group_quant_fp8_ref(a, SCALE_BLOCK, 1e-10, False)
    acc = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float32, device=a.device)
    w_s_rows = w_s.repeat_interleave(SCALE_BLOCK, dim=0)[:w.shape[0]]
    for kb in range(a.shape[1] // SCALE_BLOCK):
        cols = slice(kb * SCALE_BLOCK, (kb + 1) * SCALE_BLOCK)
        acc += (a_q[:, cols].float() @ w[:, cols].float().t()) * a_s[:, kb:kb + 1] * \
            w_s_rows[:, kb]
    return acc.to(a.dtype)


def vllm_test_reference(a, w1, w1_s, w2, w2_s, weights, ids):
    """The reference of vLLM's test, written from its description: per expert GEMM1, SiLU-and-mul
    in bf16, GEMM2, router-weighted sum of the k slots in bf16."""
    M, k = ids.shape
    rows, flat = a.repeat_interleave(k, 0), ids.reshape(-1)
    slots = torch.zeros(M * k, w2.shape[1], dtype=a.dtype, device=a.device)
    n = w2.shape[2]
    for e in range(w1.shape[0]):
        sel = flat == e
        if sel.any():
            h = _vllm_block_matmul(rows[sel], w1[e], w1_s[e])
            act = torch.nn.functional.silu(h[:, :n]) * h[:, n:]
            slots[sel] = _vllm_block_matmul(act, w2[e], w2_s[e])
    return (slots.view(M, k, -1) * weights.view(M, k, 1).to(a.dtype)).sum(1)


def layer_tolerance():
    """tol-usage max|out - ref| / (tol + tol * |ref|) of our layer (Triton experts) on each GEMM
    variant, and with the exact GEMM in its place, at VLLM_FAILING_CASES (> 1 fails vLLM)."""
    from vllm_moe_fixes.fused_moe import experts_steps  # its contiguous_gemm calls the launcher
    records = []
    for M, N, K, E, k in VLLM_FAILING_CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(M, K, device="cuda", generator=g).bfloat16() / 10
        score = torch.randn(M, E, device="cuda", generator=g)
        w1, w1_s = quant_block_fp8(torch.randn(E, 2 * N, K, device="cuda", generator=g) / 15)
        w2, w2_s = quant_block_fp8(torch.randn(E, K, N, device="cuda", generator=g) / 15)
        weights, ids = fused_topk(score, k, renormalize=False)
        ref = vllm_test_reference(a, w1, w1_s, w2, w2_s, weights, ids).float()
        tol = 0.035 if M < 8192 else 0.039
        rec = {"M": M, "N": N, "K": K, "E": E, "topk": k, "tol": tol}
        kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(), TritonExperts())
        variants = dict(ACCURACY_VARIANTS, exact_gemm=None)
        for name, cfg in variants.items():
            launcher = experts_steps.grouped_fp8_gemm_contiguous_triton
            if cfg is None:  # the exact GEMM (float64 block products) in the layer's place
                experts_steps.grouped_fp8_gemm_contiguous_triton = grouped_fp8_gemm_contiguous_ref
            else:
                experts_steps.grouped_fp8_gemm_contiguous_triton = \
                    lambda a_, w_, o_, m_, c=cfg: launcher(a_, w_, o_, m_, c)
            try:
                out = kernel(a, w1, w2, weights, ids.to(torch.int32), w1_scale=w1_s,
                             w2_scale=w2_s, global_num_experts=E).float()
            finally:
                experts_steps.grouped_fp8_gemm_contiguous_triton = launcher
            d = (out - ref).abs()
            rec[name] = dict(tol_usage=float((d / (tol + tol * ref.abs())).max()),
                             max_abs=float(d.max()),
                             rel_l2=float((out - ref).norm() / ref.norm()))
        records.append(rec)
        print(f"  M={M} N={N} K={K} E={E} top-{k}: tol-usage " + ", ".join(
            f"{v} {rec[v]['tol_usage']:.2f}" for v in variants))
    return records


def compile_only(indices):
    """Compile the SWEEP configs `indices` (both kernels) on a small problem with the bench
    shapes' specialisations (every size and stride a multiple of 16), so that a later --sweep
    in another process loads them from Triton's cache; several such processes compile at once."""
    a, w, m_idx = make_inputs(2, 256, 512, 512)
    out = torch.empty(512, 512, device="cuda", dtype=torch.bfloat16)
    am = masked_view(a, 2, 256)
    masked_m = torch.full((2,), 256, device="cuda", dtype=torch.int32)
    for i in indices:
        try:
            grouped_fp8_gemm_contiguous_triton(a, w, out, m_idx, SWEEP[i])
            grouped_fp8_gemm_masked_triton(am, w, out.view(2, 256, 512), masked_m, 256, SWEEP[i])
            torch.cuda.synchronize()
            print(f"compiled [{i}] {config_name(SWEEP[i])}")
        except Exception as exc:  # noqa: BLE001 (out of resources, ...): the sweep reports it
            print(f"{config_name(SWEEP[i])}: failed ({type(exc).__name__}: {str(exc)[:80]})")


def warm_deepgemm(shapes):
    """One call of DeepGEMM's contiguous and masked GEMM per shape (its JIT cache)."""
    for groups, rows, N, K in shapes:
        a, w, m_idx = make_inputs(groups, rows, N, K)
        out = torch.empty(groups * rows, N, device="cuda", dtype=torch.bfloat16)
        masked_m = torch.full((groups,), rows, device="cuda", dtype=torch.int32)
        dg.m_grouped_fp8_gemm_nt_contiguous(a, w, out, m_idx)
        dg.m_grouped_fp8_gemm_nt_masked(masked_view(a, groups, rows), w,
                                        out.view(groups, rows, N), masked_m, rows)
        torch.cuda.synchronize()
        print(f"DeepGEMM ready for {(groups, rows, N, K)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time every config of SWEEP too")
    parser.add_argument("--shapes", default="all",
                        help="comma-separated indices into the shape list (default: all)")
    parser.add_argument("--accuracy", action="store_true",
                        help="only the accuracy checks (grouped_gemm_accuracy.json)")
    parser.add_argument("--configs", default="all",
                        help="--sweep: comma-separated indices into SWEEP (default: all)")
    parser.add_argument("--compile-only", metavar="I,J,...",
                        help="only compile these SWEEP configs (indices, or 'all')")
    parser.add_argument("--warm-deepgemm", action="store_true",
                        help="only call DeepGEMM once per shape (fills its JIT cache)")
    args = parser.parse_args()
    require_cuda("bench_grouped_gemm")
    if args.compile_only:
        compile_only(range(len(SWEEP)) if args.compile_only == "all" else
                     [int(i) for i in args.compile_only.split(",")])
        return
    if args.accuracy:
        acc = gemm_accuracy()
        print("GEMM against the exact block product (vLLM-test operands):")
        print_table([{"kernel": k, **v} for k, v in acc.items() if k != "shape"],
                    ["kernel", "rel_l2", "max_abs_over_rms", "bf16_mismatch"])
        write_json("grouped_gemm_accuracy", dict(gemm=acc, vllm_cases=layer_tolerance()))
        return
    shapes = list(SHAPES.items())
    if args.shapes != "all":
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    if args.warm_deepgemm:
        warm_deepgemm([shape for shape, _ in shapes])
        return

    if args.configs != "all":  # the first one stays the reference of the others' bits
        SWEEP[:] = [SWEEP[int(i)] for i in args.configs.split(",")]
    torch.manual_seed(0)
    records = [run_shape(shape, fig, args.sweep) for shape, fig in shapes]
    if args.sweep:
        print_sweep(records)
    print_results(records)
    write_json("grouped_gemm", dict(deepgemm=dg.is_available(), results=records))


if __name__ == "__main__":
    main()
