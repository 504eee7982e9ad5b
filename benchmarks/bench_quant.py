"""Benchmark per_token_group_quant_fp8 (group 128, bf16 input) on the GPU.

Run from the repo root:  python benchmarks/bench_quant.py [--sweep]

For each M in 256, 4096, 16384, 65536 (K = 7168) it times, in the same run:
  us / GB/s            the public op, eager (do_bench; includes host time when the host is slower
                       than the kernel, which is the case at small M)
  graph_us / graph_GB/s  the public op under CUDA-graph replay (16 calls per graph, per call):
                       the kernel plus launch gaps, no host time; how engines run decode
  tma_us, tma_graph_us the same with the TMA-aligned column-major scales DeepGEMM wants
  launcher_us          the Triton launcher alone, eager (no validation or allocation)
  host_us, launcher_host_us  host time per call of the public op / the launcher (back-to-back
                       calls, GPU left behind): Python + Triton's launch path
  torch_ref_us         the torch eager reference on the GPU
  copy_us              (graph replay) a device-to-device copy moving the same number of bytes
                       (half read, half written: the bandwidth ceiling)
Bytes = input (M*K*2) + FP8 output (M*K) + scales (M*K/128*4). Writes
benchmarks/results/bench_quant.json. --sweep also times a grid of launch configs of the launcher
(block_m x groups_per_prog x num_warps, plus the float32 grid rounding on the default config),
prints them and writes benchmarks/results/bench_quant_sweep.json.
"""

import argparse
import functools
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks._common import (  # noqa: E402
    bench_us,
    copy_us,
    gbps,
    graph_us,
    host_us,
    print_best,
    print_table,
    rotating,
    write_json,
)
from vllm_moe_fixes.ops.fp8_quant import (  # noqa: E402
    QUANT_BLOCK_M,
    QUANT_GROUPS_PER_PROG,
    QUANT_NUM_WARPS,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_triton,
)
from vllm_moe_fixes.ops.reference import per_token_group_quant_fp8_ref  # noqa: E402

K, GROUP = 7168, 128
MS = (256, 4096, 16384, 65536)
DEFAULT = {"block_m": QUANT_BLOCK_M, "groups_per_prog": QUANT_GROUPS_PER_PROG,
           "num_warps": QUANT_NUM_WARPS}


def _bytes(M):
    return M * K * 2 + M * K + M * (K // GROUP) * 4


def _inputs(M):
    def make(_):
        x = torch.randn((M, K), dtype=torch.bfloat16, device="cuda")
        q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.empty((M, K // GROUP), dtype=torch.float32, device="cuda")
        return x, q, s
    return rotating(make, _bytes(M))


def _row_major(x, q, s):
    return per_token_group_quant_fp8(x, GROUP, out_q=q)


def _tma(x, q, s):
    return per_token_group_quant_fp8(x, GROUP, column_major_scales=True, tma_aligned_scales=True,
                                     out_q=q)


def _launcher(x, q, s):
    per_token_group_quant_fp8_triton(x, q, s, GROUP, 1e-10, False)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time a grid of launch configs")
    args = parser.parse_args()
    rows, sweep = [], []
    for M in MS:
        sets = _inputs(M)
        nbytes = _bytes(M)
        t_row = bench_us(_row_major, sets)
        g_row = graph_us(_row_major, sets)
        t_tma = bench_us(_tma, sets)
        g_tma = graph_us(_tma, sets)
        t_launch = bench_us(_launcher, sets)
        t_ref = bench_us(lambda x, q, s: per_token_group_quant_fp8_ref(x, GROUP, 1e-10, False),
                         sets[:2], rep=50)
        t_copy = copy_us(nbytes)
        rows.append({
            "M": M, "K": K, "config": str(DEFAULT),
            "us": t_row, "GB/s": gbps(nbytes, t_row),
            "graph_us": g_row, "graph_GB/s": gbps(nbytes, g_row),
            "tma_us": t_tma, "tma_graph_us": g_tma, "tma_graph_GB/s": gbps(nbytes, g_tma),
            "launcher_us": t_launch,
            "host_us": host_us(_row_major, sets), "launcher_host_us": host_us(_launcher, sets),
            "torch_ref_us": t_ref, "x_vs_torch": t_ref / g_row,
            "copy_us": t_copy, "copy_GB/s": gbps(nbytes, t_copy), "frac_of_copy": t_copy / g_row,
        })
        if args.sweep:
            sweep += _sweep(M, sets, nbytes)
        del sets
        torch.cuda.empty_cache()
    print_table(rows, list(rows[0]))
    write_json("bench_quant", {"group_size": GROUP, "dtype": "bfloat16", "rows": rows})
    if args.sweep:
        _report_sweep(sweep)


def _sweep(M, sets, nbytes):
    configs = [{"block_m": bm, "groups_per_prog": g, "num_warps": w, "round_in_fp32": False}
               for bm, g, w in itertools.product((1, 2, 4, 8, 16), (2, 4, 8), (2, 4, 8))]
    configs.append(dict(DEFAULT, round_in_fp32=True))
    out = []
    for cfg in configs:
        launch = functools.partial(per_token_group_quant_fp8_triton, group_size=GROUP, eps=1e-10,
                                   use_ue8m0=False, **cfg)
        us = bench_us(launch, sets, rep=50)
        out.append({"M": M, **cfg, "us": us, "GB/s": gbps(nbytes, us)})
    return out


def _report_sweep(sweep):
    print_best(sweep, "\nSweep (row-major scales), best 8 per M:")
    # A config that is good everywhere: smallest worst-case slowdown against each M's best.
    fastest = {M: min(r["us"] for r in sweep if r["M"] == M) for M in MS}
    keys = ("block_m", "groups_per_prog", "num_warps", "round_in_fp32")
    score = {}
    for r in sweep:
        k = tuple(r[c] for c in keys)
        score[k] = max(score.get(k, 0.0), r["us"] / fastest[r["M"]])
    ranked = sorted(score.items(), key=lambda kv: kv[1])[:8]
    print("\nBest configs over all M (worst-case time / per-M best):")
    print_table([{**dict(zip(keys, k)), "worst_ratio": v} for k, v in ranked],
                [*keys, "worst_ratio"])
    write_json("bench_quant_sweep", {"rows": sweep})


if __name__ == "__main__":
    main()
