"""Benchmark moe_sum ([M, 8, 7168] bf16 -> [M, 7168], float32 accumulation) on the GPU.

Run from the repo root:  python benchmarks/bench_moe_sum.py [--sweep]

For each M in 256, 4096, 16384 it times, in the same run: the Triton kernel, torch.sum(x, dim=1)
(the anchor; it accumulates in float32 too) and a device-to-device copy moving the same bytes.
Bytes = input (M*topk*K*2) + output (M*K*2). Writes benchmarks/results/bench_moe_sum.json.
--sweep also times a grid of (block_m, block_k, num_warps), prints the best and writes
benchmarks/results/bench_moe_sum_sweep.json.
"""

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks._common import bench_us, gbps, print_table, rotating, write_json  # noqa: E402
from vllm_moe_fixes.ops.moe_sum import default_moe_sum_config, moe_sum, moe_sum_triton  # noqa: E402

TOPK, K = 8, 7168
MS = (256, 4096, 16384)


def _bytes(M):
    return M * TOPK * K * 2 + M * K * 2


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time a grid of launch configs")
    args = parser.parse_args()
    rows, sweep = [], []
    for M in MS:
        sets = rotating(lambda _: (torch.randn((M, TOPK, K), dtype=torch.bfloat16, device="cuda"),
                                   torch.empty((M, K), dtype=torch.bfloat16, device="cuda")),
                        _bytes(M))
        nbytes = _bytes(M)
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        t = bench_us(lambda x, o: moe_sum(x, out=o), sets)
        t_sum = bench_us(lambda x, o: torch.sum(x, dim=1, out=o), sets)
        t_copy = bench_us(lambda: dst.copy_(src), [()])
        rows.append({
            "M": M, "topk": TOPK, "K": K, "config": str(default_moe_sum_config(M, K)),
            "us": t, "GB/s": gbps(nbytes, t), "torch_sum_us": t_sum,
            "torch_sum_GB/s": gbps(nbytes, t_sum), "x_vs_torch": t_sum / t, "copy_us": t_copy,
            "copy_GB/s": gbps(nbytes, t_copy),
        })
        if args.sweep:
            for bm, bk, w in itertools.product((1, 2, 4), (512, 1024, 2048, 4096), (4, 8, 16)):
                us = bench_us(lambda x, o: moe_sum_triton(x, o, block_m=bm, block_k=bk,
                                                          num_warps=w), sets, rep=50)
                sweep.append({"M": M, "block_m": bm, "block_k": bk, "num_warps": w, "us": us,
                              "GB/s": gbps(nbytes, us)})
        del sets, src, dst
        torch.cuda.empty_cache()
    print_table(rows, list(rows[0]))
    write_json("bench_moe_sum", {"dtype": "bfloat16", "rows": rows})
    if args.sweep:
        print("\nSweep, best 8 per M:")
        for M in MS:
            best = sorted((r for r in sweep if r["M"] == M), key=lambda r: r["us"])[:8]
            print_table(best, list(best[0]))
        write_json("bench_moe_sum_sweep", {"rows": sweep})


if __name__ == "__main__":
    main()
