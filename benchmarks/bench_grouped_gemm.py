"""Triton grouped FP8 GEMM (contiguous and masked layouts) against DeepGEMM and dense anchors.

Run from the repository root on a GPU:

    python -m benchmarks.bench_grouped_gemm          # table, benchmarks/results/grouped_gemm.json
    python -m benchmarks.bench_grouped_gemm --sweep  # also TFLOP/s of every SWEEP config per shape

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
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, SCALE_BLOCK, empty_mn_major_scales
from vllm_moe_fixes.ops.grouped_gemm import (
    default_config,
    grouped_fp8_gemm_contiguous_triton,
    grouped_fp8_gemm_masked_triton,
)
from vllm_moe_fixes.testing import calc_diff

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


def _cfg(bm, bn, warps, stages, group_m):
    return dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=group_m, num_warps=warps, num_stages=stages)


# Candidates of --sweep: the default (first; see the measured table in ops/grouped_gemm.py) and
# its neighbours, so a GPU run re-checks the choice in about a minute. Shared memory per stage is
# 24 KiB at 64x128, 32 KiB at 128x128 (an SM has 228 KiB).
SWEEP = [
    _cfg(64, 128, 4, 3, 16), _cfg(64, 128, 4, 4, 16), _cfg(64, 128, 4, 3, 8),
    _cfg(64, 128, 4, 3, 32), _cfg(128, 128, 8, 4, 16),
]


def tflops(flops: float, us: float | None) -> float | None:
    return None if us is None else flops / (us * 1e-6) / 1e12


def timed_us(fn) -> float:
    fn()  # compile / JIT outside the timed region
    torch.cuda.synchronize()
    return bench_us(fn, [()])


def config_name(cfg: dict) -> str:
    return (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} {cfg['num_warps']}w {cfg['num_stages']}s "
            f"g{cfg['GROUP_M']}")


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
               config=default_config())

    ref = None
    if sweep:
        rec["sweep"] = []
        for cfg in SWEEP:
            out.fill_(float("nan"))
            try:
                us = timed_us(lambda c=cfg: grouped_fp8_gemm_contiguous_triton(a, w, out, m_idx, c))
                # Every config must agree with the first one (the default config).
                ref = out.clone() if ref is None else ref
                diff = calc_diff(out, ref)
                out.fill_(float("nan"))  # the masked view of the same rows writes them again
                us_m = timed_us(lambda c=cfg: grouped_fp8_gemm_masked_triton(am, w, out_m, masked_m,
                                                                             rows, c))
            except Exception as exc:  # noqa: BLE001 (out of resources, ...): report and go on
                print(f"  {shape} {config_name(cfg)}: failed ({type(exc).__name__}: "
                      f"{str(exc)[:80]})")
                continue
            diff_m = calc_diff(out, ref)
            rec["sweep"].append(dict(config=cfg, us=us, tflops=tflops(flops, us), diff=diff,
                                     masked_tflops=tflops(flops, us_m), masked_diff=diff_m))
            bad = "  WRONG" if not max(diff, diff_m) < 1e-5 else ""
            print(f"  {shape} {config_name(cfg):<18} {tflops(flops, us):7.1f} TFLOP/s, masked "
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
        rows.append({
            "groups x rows": f"{r['groups']} x {r['rows']}", "N": r["N"], "K": r["K"],
            "triton": t, "masked": r["triton_masked_tflops"], "DeepGEMM": _dash(d),
            "ratio": _dash(d and t / d), "DG v2.6.1": fig, "v2.6.1 ratio": t / fig,
            "DG masked": _dash(r["deepgemm_masked_tflops"]), "_scaled_mm": r["scaled_mm_tflops"],
            "bf16": r["bf16_tflops"],
            "diff vs DG": _dash(r["diff_vs_deepgemm"] and f"{r['diff_vs_deepgemm']:.1e}"),
        })
    print(f"\nTFLOP/s over useful rows on {torch.cuda.get_device_name()} (triton "
          f"{triton.__version__}, torch {torch.__version__}, DeepGEMM "
          f"{'present' if dg.is_available() else 'absent'})")
    print_table(rows, list(rows[0]))
    print("ratio = Triton / DeepGEMM (same run, target >= 0.70); v2.6.1 ratio = Triton / "
          "DeepGEMM v2.6.1's TFLOP/s on an H200; _scaled_mm is tensorwise FP8 (a ceiling).")


def print_sweep(records):
    """Per kernel, one row per config: TFLOP/s on each shape and the geometric mean of its ratio
    to the best config of each shape."""
    for key, kernel in (("tflops", "contiguous"), ("masked_tflops", "masked")):
        rows = []
        for cfg in SWEEP:
            row, ratios = {"config": config_name(cfg)}, []
            for r in records:
                hit = [s for s in r["sweep"] if s["config"] is cfg]
                row[f"{r['groups']}x{r['rows']} {r['N']}/{r['K']}"] = hit[0][key] if hit else "-"
                if hit:
                    ratios.append(hit[0][key] / r["best_" + key])
            row["vs best (geomean)"] = (math.exp(sum(map(math.log, ratios)) / len(ratios))
                                        if len(ratios) == len(records) else "-")
            rows.append(row)
        print(f"\nSweep, {kernel} kernel: TFLOP/s per config and shape; last column 1.0 = best "
              "on every shape")
        print_table(rows, list(rows[0]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time every config of SWEEP too")
    parser.add_argument("--shapes", default="all",
                        help="comma-separated indices into the shape list (default: all)")
    args = parser.parse_args()
    require_cuda("bench_grouped_gemm")
    shapes = list(SHAPES.items())
    if args.shapes != "all":
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]

    torch.manual_seed(0)
    records = [run_shape(shape, fig, args.sweep) for shape, fig in shapes]
    if args.sweep:
        print_sweep(records)
    print_results(records)
    write_json("grouped_gemm", dict(deepgemm=dg.is_available(), results=records))


if __name__ == "__main__":
    main()
