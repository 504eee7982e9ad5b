"""Triton grouped FP8 GEMM (contiguous and masked layouts) against DeepGEMM and dense anchors.

Run from the repository root on a GPU:

    python benchmarks/bench_grouped_gemm.py          # table, benchmarks/results/grouped_gemm.json
    python benchmarks/bench_grouped_gemm.py --sweep  # TFLOP/s of every block config per shape

TFLOP/s count useful rows only: 2 * groups * rows * N * K. Anchors measured in the same run:
DeepGEMM when it imports (through vllm_moe_fixes._compat.deep_gemm), torch._scaled_mm FP8 dense
of the same total M x N x K (tensorwise scales: less work than block scaling, so a hardware
ceiling rather than a like-for-like), and a bf16 torch.matmul. figures.md's DeepGEMM numbers
(v2.6.1 on this workplace's H200) are printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_moe_fixes._compat import deep_gemm as dg  # noqa: E402
from vllm_moe_fixes.ops.grouped_gemm import (  # noqa: E402
    default_config,
    grouped_fp8_gemm_contiguous_triton,
    grouped_fp8_gemm_masked_triton,
)

FP8 = torch.float8_e4m3fn
# (groups, rows per group, N, K) -> DeepGEMM v2.6.1 TFLOP/s from figures.md / contracts/deep_gemm.md
SHAPES = {
    (4, 8192, 4096, 7168): 1225,
    (4, 8192, 7168, 2048): 1134,
    (8, 4096, 4096, 7168): 1206,
    (8, 1024, 4096, 7168): 1085,
    (8, 1024, 7168, 2048): 1061,
    (32, 256, 4096, 7168): 904,
}
# (BLOCK_M, BLOCK_N, num_warps, num_stages, GROUP_M). ptxas (sm_90a) spills with 128x256 at 8 warps
# and 128x128 at 4 warps, so those are left out. 128x128/8 warps uses 208 registers: one CTA per
# SM. The 4-warp 64x128 / 128x64 tiles (~222 registers, <= 96 KiB shared at 3-4 stages) fit two
# CTAs per SM, so one CTA's scaling FMAs can overlap the other's tensor-core work.
SWEEP = [dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=g, num_warps=w, num_stages=s)
         for bm, bn, w, s, g in [
             (128, 128, 8, 3, 8), (128, 128, 8, 4, 8), (128, 128, 8, 5, 8), (128, 128, 8, 6, 8),
             (128, 128, 8, 4, 4), (128, 128, 8, 4, 16), (128, 128, 8, 4, 32),
             (64, 256, 8, 3, 8), (64, 256, 8, 4, 8), (64, 128, 4, 3, 8), (64, 128, 4, 4, 8),
             (64, 128, 4, 4, 16), (128, 64, 4, 3, 8), (128, 64, 4, 4, 8)]]


# ---------------------------------------------------------------- minimal helpers (see report)
def bench_ms(fn) -> float:
    fn()  # compile / JIT outside the timed region
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None else flops / (ms * 1e-3) / 1e12


def calc_diff(x, y) -> float:
    x, y = x.double(), y.double()
    return (1 - 2 * (x * y).sum() / (x * x + y * y).sum()).item()


def fmt(v, spec=".0f"):
    return "-" if v is None else format(v, spec)


# ---------------------------------------------------------------- problems
def make_inputs(groups, rows, N, K):
    """Random FP8 operands: contiguous rows [groups*rows, K] with MN-major TMA-aligned scales."""
    M = groups * rows
    a_q = (torch.randn(M, K, device="cuda") * 0.5).to(FP8)
    a_s = torch.empty(K // 128, -(-M // 4) * 4, device="cuda")[:, :M].t()
    a_s.copy_(torch.rand(M, K // 128, device="cuda") * 0.01 + 0.001)
    w_q = (torch.randn(groups, N, K, device="cuda") * 0.5).to(FP8)
    w_s = torch.rand(groups, N // 128, K // 128, device="cuda") * 0.01 + 0.001
    m_idx = torch.arange(groups, device="cuda", dtype=torch.int32).repeat_interleave(rows)
    return (a_q, a_s), (w_q, w_s), m_idx


def masked_view(a, groups, rows):
    """Masked-layout view of the same rows: a_q [E, T, K], scales MN-major per expert."""
    a_q, a_s = a
    K = a_q.shape[1]
    s = torch.empty(groups, K // 128, rows, device="cuda").transpose(1, 2)
    s.copy_(a_s.reshape(groups, rows, K // 128))
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

    if sweep:
        rec["sweep"] = []
        for cfg in SWEEP:
            try:
                ms = bench_ms(lambda: grouped_fp8_gemm_contiguous_triton(a, w, out, m_idx, cfg))
            except Exception as exc:  # noqa: BLE001 (out of resources, ...): report and go on
                print(f"  {cfg}: failed ({type(exc).__name__}: {str(exc)[:80]})")
                continue
            rec["sweep"].append(dict(config=cfg, ms=ms, tflops=tflops(flops, ms)))
            print(f"  {shape} {cfg}: {tflops(flops, ms):7.1f} TFLOP/s")
        best = max(rec["sweep"], key=lambda r: r["tflops"])
        print(f"  best for {shape}: {best['config']} {best['tflops']:.1f} TFLOP/s")
        rec["best"] = best

    ms = bench_ms(lambda: grouped_fp8_gemm_contiguous_triton(a, w, out, m_idx))
    rec["triton_ms"], rec["triton_tflops"] = ms, tflops(flops, ms)
    ms = bench_ms(lambda: grouped_fp8_gemm_masked_triton(am, w, out_m, masked_m, rows))
    rec["triton_masked_tflops"] = tflops(flops, ms)
    triton_out = out.clone()

    rec["deepgemm_tflops"] = rec["deepgemm_masked_tflops"] = rec["diff_vs_deepgemm"] = None
    if dg.is_available():
        ms = bench_ms(lambda: dg.m_grouped_fp8_gemm_nt_contiguous(a, w, out, m_idx))
        rec["deepgemm_tflops"] = tflops(flops, ms)
        rec["diff_vs_deepgemm"] = calc_diff(triton_out, out)
        try:
            ms = bench_ms(lambda: dg.m_grouped_fp8_gemm_nt_masked(am, w, out_m, masked_m, rows))
            rec["deepgemm_masked_tflops"] = tflops(flops, ms)
        except RuntimeError as exc:
            print(f"  DeepGEMM masked GEMM unavailable: {exc}")

    # Dense anchors over the same total M x N x K.
    a_q = a[0]
    b = w[0][0]  # [N, K]: b.t() is the column-major operand _scaled_mm wants
    one = torch.ones((), device="cuda")
    ms = bench_ms(lambda: torch._scaled_mm(a_q, b.t(), scale_a=one, scale_b=one,
                                           out_dtype=torch.bfloat16))
    rec["scaled_mm_tflops"] = tflops(flops, ms)
    x16, w16 = a_q.to(torch.bfloat16), b.to(torch.bfloat16).t()
    ms = bench_ms(lambda: torch.matmul(x16, w16))
    rec["bf16_tflops"] = tflops(flops, ms)
    return rec


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time every config of SWEEP too")
    parser.add_argument("--shapes", default="all",
                        help="comma-separated indices into the shape list (default: all)")
    parser.add_argument("--out", default="benchmarks/results/grouped_gemm.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_grouped_gemm needs a CUDA GPU")
    shapes = list(SHAPES.items())
    if args.shapes != "all":
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]

    torch.manual_seed(0)
    records = [run_shape(shape, fig, args.sweep) for shape, fig in shapes]

    head = (f"{'groups x rows':>14} {'N':>5} {'K':>5} | {'triton':>6} {'masked':>6} | "
            f"{'DeepGEMM':>8} {'ratio':>5} | {'fig.md':>6} {'ratio':>5} | {'DG mskd':>7} | "
            f"{'_scaled_mm':>10} {'bf16':>5} | diff vs DG")
    print(f"\nTFLOP/s over useful rows on {torch.cuda.get_device_name()} "
          f"(triton {triton.__version__}, torch {torch.__version__}, "
          f"DeepGEMM {'present' if dg.is_available() else 'absent'})")
    print(head)
    print("-" * len(head))
    for r in records:
        t, d = r["triton_tflops"], r["deepgemm_tflops"]
        print(f"{r['groups']:>5} x {r['rows']:<6} {r['N']:>5} {r['K']:>5} | {t:6.0f} "
              f"{r['triton_masked_tflops']:6.0f} | {fmt(d):>8} {fmt(d and t / d, '.2f'):>5} | "
              f"{r['figure_deepgemm_tflops']:6d} {t / r['figure_deepgemm_tflops']:5.2f} | "
              f"{fmt(r['deepgemm_masked_tflops']):>7} | {r['scaled_mm_tflops']:10.0f} "
              f"{r['bf16_tflops']:5.0f} | {fmt(r['diff_vs_deepgemm'], '.1e')}")
    print("ratio = Triton / DeepGEMM (same run, target >= 0.70); fig.md ratio = Triton / "
          "figures.md's DeepGEMM v2.6.1 figure; _scaled_mm is tensorwise FP8 (a ceiling).")

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), triton=triton.__version__,
                torch=torch.__version__, deepgemm=dg.is_available())
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, results=records), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
