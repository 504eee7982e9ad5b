"""Benchmark moe_sum ([M, 8, 7168] bf16 -> [M, 7168], float32 accumulation) on the GPU.

Run from the repo root:  python -m benchmarks.bench_moe_sum [--sweep]

For each M in 256, 4096, 16384 it times, in the same run:
  us / GB/s              the public op, eager (do_bench; includes host time when the host is
                         slower than the kernel)
  graph_us / graph_GB/s  the public op under CUDA-graph replay (16 calls per graph, per call)
  launcher_us            the Triton launcher alone, eager
  host_us, launcher_host_us  host time per call of the public op / the launcher
  torch_sum_us           torch.sum(x, dim=1, out=o), graph replay (float32 accumulation too)
  floor_us / floor_GB/s  (graph replay) the byte floor: a sum-free Triton kernel (below) that
                         reads exactly M*topk*K*2 bytes and writes exactly M*K*2, with moe_sum's
                         tiling, combining the top-k slices with an integer XOR, no float math
  copy_us                (graph replay) a device-to-device copy of (M*topk*K*2 + M*K*2) / 2
                         bytes (the same total, but half read and half written)
Bytes = input (M*topk*K*2) + output (M*K*2). Writes benchmarks/results/bench_moe_sum.json.
--sweep also times a grid of (block_m, block_k, num_warps) of the launcher, prints the best and
writes benchmarks/results/bench_moe_sum_sweep.json.
"""

import argparse
import functools
import itertools

import torch
import triton
import triton.language as tl

from benchmarks._common import (
    bench_us,
    copy_us,
    gbps,
    graph_us,
    host_us,
    print_best,
    print_table,
    require_cuda,
    rotating,
    write_json,
)
from vllm_moe_fixes.ops.moe_sum import default_moe_sum_config, moe_sum, moe_sum_triton
from vllm_moe_fixes.sizes import cdiv

TOPK, K = 8, 7168
MS = (256, 4096, 16384)


@triton.jit
def _byte_floor_kernel(x_ptr, out_ptr, K, TOPK: tl.constexpr, BLOCK_K: tl.constexpr):
    """moe_sum's memory traffic without its arithmetic: x [M, TOPK, K] and out [M, K] contiguous
    16-bit words; out[m] = XOR over t of x[m, t] (every load is used, so none is dropped)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = cols < K
    ptrs = x_ptr + row * TOPK * K + cols
    acc = tl.load(ptrs, mask=mask, other=0)
    for _ in tl.static_range(1, TOPK):
        ptrs += K
        acc ^= tl.load(ptrs, mask=mask, other=0)
    tl.store(out_ptr + row * K + cols, acc, mask=mask)


def _byte_floor(x, o):
    M, topk, K_ = x.shape
    block_k = default_moe_sum_config(M, K_)["block_k"]
    _byte_floor_kernel[(M, cdiv(K_, block_k))](x.view(torch.int16), o.view(torch.int16), K_,
                                               TOPK=topk, BLOCK_K=block_k, num_warps=4)


def _bytes(M):
    return M * TOPK * K * 2 + M * K * 2


def _make(M, _):
    return (torch.randn((M, TOPK, K), dtype=torch.bfloat16, device="cuda"),
            torch.empty((M, K), dtype=torch.bfloat16, device="cuda"))


def _public(x, o):
    moe_sum(x, out=o)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time a grid of launch configs")
    args = parser.parse_args()
    require_cuda("bench_moe_sum")
    rows, sweep = [], []
    for M in MS:
        sets = rotating(functools.partial(_make, M), _bytes(M))
        nbytes = _bytes(M)
        t = bench_us(_public, sets)
        g = graph_us(_public, sets)
        t_sum = graph_us(lambda x, o: torch.sum(x, dim=1, out=o), sets)
        t_floor = graph_us(_byte_floor, sets)
        t_copy = copy_us(nbytes)
        rows.append({
            "M": M, "topk": TOPK, "K": K, "config": str(default_moe_sum_config(M, K)),
            "us": t, "GB/s": gbps(nbytes, t), "graph_us": g, "graph_GB/s": gbps(nbytes, g),
            "launcher_us": bench_us(moe_sum_triton, sets),
            "host_us": host_us(_public, sets), "launcher_host_us": host_us(moe_sum_triton, sets),
            "torch_sum_us": t_sum, "torch_sum_GB/s": gbps(nbytes, t_sum),
            "x_vs_torch": t_sum / g, "floor_us": t_floor, "floor_GB/s": gbps(nbytes, t_floor),
            "copy_us": t_copy, "copy_GB/s": gbps(nbytes, t_copy),
        })
        if args.sweep:
            for bm, bk, w in itertools.product((1, 2, 4), (512, 1024, 2048, 4096), (4, 8, 16)):
                launch = functools.partial(moe_sum_triton, block_m=bm, block_k=bk, num_warps=w)
                us = bench_us(launch, sets, rep=50)
                sweep.append({"M": M, "block_m": bm, "block_k": bk, "num_warps": w, "us": us,
                              "GB/s": gbps(nbytes, us)})
        del sets
        torch.cuda.empty_cache()
    print_table(rows, list(rows[0]))
    write_json("bench_moe_sum", {"dtype": "bfloat16", "rows": rows})
    if args.sweep:
        print_best(sweep, "\nSweep (launcher, eager), best 8 per M:")
        write_json("bench_moe_sum_sweep", {"rows": sweep})


if __name__ == "__main__":
    main()
