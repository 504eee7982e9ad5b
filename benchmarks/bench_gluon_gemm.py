"""The Gluon grouped FP8 GEMM (ops/grouped_gemm_gluon) against the Triton kernel and DeepGEMM.

For the shapes of bench_grouped_gemm (contiguous layout, DeepSeek-V3's K 7168 / 2048), every
Gluon variant in VARIANTS is checked against the Triton kernel (calc_diff < 1e-5, the tolerance of
tests/test_grouped_gemm.py; output poisoned with NaN before each call) and timed beside the Triton
kernel (its default config, and with IMPRECISE_ACC 0: one promotion per 128 of K, as DeepGEMM)
and DeepGEMM in the same process (CUDA events, medians). --smoke I first runs variant I alone on a
small padded problem against the torch reference (benchmarks/device_gluon_gemm.sh runs each in its
own process, so that a variant that hangs or faults the context costs only itself).

    python -m benchmarks.bench_gluon_gemm --smoke 0
    python -m benchmarks.bench_gluon_gemm --variants 0,1,2,3     # writes results/gluon_gemm.json
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback

import torch

from benchmarks._common import bench_us, print_table, require_cuda, write_json
from benchmarks.bench_grouped_gemm import SHAPES, make_inputs, tflops
from vllm_moe_fixes._compat import deep_gemm as dg
from vllm_moe_fixes.ops import grouped_gemm_gluon as gluon_gemm
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, SCALE_BLOCK, empty_mn_major_scales
from vllm_moe_fixes.ops.grouped_gemm import (
    contiguous_config, grouped_fp8_gemm_contiguous_ref, grouped_fp8_gemm_contiguous_triton)
from vllm_moe_fixes.testing import calc_diff
from vllm_moe_fixes.sizes import ROW_ALIGNMENT

TOLERANCE = 1e-5


def _variant(bm, bn, warps, stages, **extra):
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **extra)


# IMPRECISE_ACC 0: one wgmma chain and one float32 promotion per 128 of K (DeepGEMM's); without
# the key, contiguous_config promotes every 64 at K >= 4096 as the Triton kernel does.
# WARP_SPECIALIZE: a producer warp issues the TMA loads (DeepGEMM's split).
VARIANTS = [
    _variant(128, 128, 8, 4, IMPRECISE_ACC=0),
    _variant(128, 128, 8, 4, IMPRECISE_ACC=0, WARP_SPECIALIZE=True),
    _variant(128, 128, 8, 6, IMPRECISE_ACC=0, WARP_SPECIALIZE=True),
    _variant(64, 128, 4, 4, IMPRECISE_ACC=0),
    _variant(128, 128, 8, 4),
    _variant(128, 128, 8, 4, WARP_SPECIALIZE=True),
]


def variant_name(v: dict) -> str:
    acc = "acc0" if v.get("IMPRECISE_ACC") == 0 else "acc-default"
    ws = " ws" if v.get("WARP_SPECIALIZE") else ""
    return f"{v['BLOCK_M']}x{v['BLOCK_N']} {v['num_warps']}w {v['num_stages']}s {acc}{ws}"


def _tail(exc: BaseException, lines: int = 6) -> str:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run_gluon(v, a, w, out, m_idx):
    cfg = contiguous_config(a[0].shape[0], w[0].shape[0], v, a[0].shape[1])
    return gluon_gemm.grouped_fp8_gemm_contiguous_gluon(a, w, out, m_idx, cfg)


def timed_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return bench_us(fn, [()])


# ---------------------------------------------------------------- smoke (one variant, small)
def padded_problem(segments=(1, 130, 0, 257, 64, 3), N=384, K=512):
    """Experts' rows padded to ROW_ALIGNMENT with -1 rows, a tile of padding only before the last
    expert, whose 3 rows are not padded (M no multiple of the tile); random FP8 operands and
    scales."""
    idx = []
    for e, n in enumerate(segments):
        if e == len(segments) - 1:
            idx += [-1] * ROW_ALIGNMENT + [e] * n
        else:
            idx += [e] * n + [-1] * (-(-n // ROW_ALIGNMENT) * ROW_ALIGNMENT - n)
    m_idx = torch.tensor(idx, dtype=torch.int32, device="cuda")
    M, E = m_idx.numel(), len(segments)
    a_q = torch.randn(M, K, device="cuda").to(FP8_DTYPE)
    # MN-major scales whose padding holds NaN (0xFF bytes): a kernel reading it fails the check.
    a_s = empty_mn_major_scales((M, K // SCALE_BLOCK), "cuda")
    a_s.untyped_storage().fill_(0xFF)
    a_s.copy_(torch.rand(M, K // SCALE_BLOCK, device="cuda") * 0.01 + 0.001)
    w_q = (torch.randn(E, N, K, device="cuda") * 0.5).to(FP8_DTYPE)
    w_s = torch.rand(E, N // SCALE_BLOCK, K // SCALE_BLOCK, device="cuda") * 0.01 + 0.001
    return (a_q, a_s), (w_q, w_s), m_idx


def smoke(i: int) -> bool:
    v = VARIANTS[i]
    print(f"smoke [{i}] {variant_name(v)}: gluon_available={gluon_gemm.gluon_available()}")
    a, w, m_idx = padded_problem()
    ref = grouped_fp8_gemm_contiguous_ref(a, w, torch.empty(m_idx.numel(), w[0].shape[1],
                                                            device="cuda", dtype=torch.bfloat16),
                                          m_idx)
    out = torch.full_like(ref, float("nan"))
    try:
        run_gluon(v, a, w, out, m_idx)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 (compile error, out of resources): report it
        print(f"smoke [{i}] FAILED to run:\n{_tail(exc)}")
        return False
    pad = m_idx < 0
    diff = calc_diff(out[~pad], ref[~pad])
    zeros = bool(torch.equal(out[pad], torch.zeros_like(out[pad])))
    ok = diff < TOLERANCE and zeros and not out.isnan().any().item()
    print(f"smoke [{i}] {'PASS' if ok else 'FAIL'}: diff vs torch reference {diff:.2e}, "
          f"padding rows zero: {zeros}, equal: {torch.equal(out, ref)}")
    return ok


# ---------------------------------------------------------------- timing (all shapes)
def _time_checked(name, fn, out, ref, rec, flops):
    """Time fn; record TFLOP/s and its diff against ref (None: fn is the reference)."""
    try:
        out.fill_(float("nan"))
        us = timed_us(fn)
    except Exception as exc:  # noqa: BLE001 (compile error, out of resources): report, go on
        print(f"  {name}: FAILED\n{_tail(exc)}")
        rec[name] = dict(error=_tail(exc, 2))
        return
    entry = dict(us=us, tflops=tflops(flops, us))
    if ref is not None:
        entry["diff"] = calc_diff(out, ref)
        entry["equal"] = bool(torch.equal(out, ref))
        entry["ok"] = entry["diff"] < TOLERANCE
    rec[name] = entry
    check = "" if ref is None else (f"  diff {entry['diff']:.1e}" + ("" if entry["ok"] else
                                                                     "  WRONG"))
    print(f"  {name:<32} {entry['tflops']:7.1f} TFLOP/s{check}")


def run_shape(shape, variants):
    groups, rows, N, K = shape
    M = groups * rows
    flops = 2.0 * M * N * K
    a, w, m_idx = make_inputs(groups, rows, N, K)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    rec = dict(groups=groups, rows=rows, N=N, K=K)
    print(f"{shape}:")
    refs = {}
    for acc in (None, 0):  # the Triton kernel's default, then one promotion per 128
        name = "triton" if acc is None else "triton acc0"
        # An explicit config (empty: the default) keeps the Triton kernel where Gluon is enabled.
        config = {} if acc is None else dict(IMPRECISE_ACC=0)
        _time_checked(name, lambda c=config: grouped_fp8_gemm_contiguous_triton(a, w, out, m_idx,
                                                                                  c),
                      out, None, rec, flops)
        refs[acc] = out.clone()
    for i, v in variants:
        ref = refs[0 if v.get("IMPRECISE_ACC") == 0 else None]
        _time_checked(f"gluon [{i}] {variant_name(v)}",
                      lambda v=v: run_gluon(v, a, w, out, m_idx), out, ref, rec, flops)
    if dg.is_available():
        _time_checked("deepgemm", lambda: dg.m_grouped_fp8_gemm_nt_contiguous(a, w, out, m_idx),
                      out, refs[0], rec, flops)
    return rec


def _ratio(rec, name):
    entry, anchor = rec.get(name, {}), rec.get("deepgemm", {})
    if "tflops" not in entry or "tflops" not in anchor:
        return None
    return entry["tflops"] / anchor["tflops"]


def print_summary(records, names):
    print("\nTFLOP/s (ratio to DeepGEMM in the same run):")
    rows = []
    for rec in records:
        row = {"shape": f"{rec['groups']}x{rec['rows']} N{rec['N']} K{rec['K']}"}
        for name in names:
            entry, r = rec.get(name, {}), _ratio(rec, name)
            row[name] = ("failed" if "error" in entry else "-" if "tflops" not in entry else
                         f"{entry['tflops']:.0f}" + ("" if r is None else f" ({r:.3f})") +
                         ("" if entry.get("ok", True) else " WRONG"))
        rows.append(row)
    print_table(rows, ["shape", *names])
    for name in names:
        ratios = [_ratio(rec, name) for rec in records]
        if ratios and all(r is not None for r in ratios):
            geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
            print(f"  {name}: geometric mean of the ratio to DeepGEMM {geo:.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", type=int, metavar="I", help="only check variant I (small)")
    parser.add_argument("--count", action="store_true", help="print the number of variants")
    parser.add_argument("--variants", default="all",
                        help="comma-separated indices into VARIANTS to time ('' for none)")
    parser.add_argument("--shapes", default="all", help="comma-separated indices into SHAPES")
    args = parser.parse_args()
    if args.count:
        print(len(VARIANTS))
        return
    require_cuda("bench_gluon_gemm")
    torch.manual_seed(0)
    if args.smoke is not None:
        sys.exit(0 if smoke(args.smoke) else 1)
    picked = range(len(VARIANTS)) if args.variants == "all" else [
        int(i) for i in args.variants.split(",") if i]
    variants = [(i, VARIANTS[i]) for i in picked]
    shapes = list(SHAPES)
    if args.shapes != "all":
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    print(f"gluon_available={gluon_gemm.gluon_available()}, deepgemm={dg.is_available()}")
    records = []
    for shape in shapes:
        records.append(run_shape(shape, variants))
        # Written after every shape: a later hang or fault leaves the finished shapes.
        write_json("gluon_gemm", dict(deepgemm=dg.is_available(), tolerance=TOLERANCE,
                                      variants={i: v for i, v in variants}, results=records))
    names = ["triton", "triton acc0", *[f"gluon [{i}] {variant_name(v)}" for i, v in variants]]
    print_summary(records, names + (["deepgemm"] if dg.is_available() else []))


if __name__ == "__main__":
    main()
