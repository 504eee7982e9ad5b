"""Benchmark grouped_topk (DeepSeek-V3 routing: E 256, 8 groups, top-4 groups, k 8) on the GPU.

Run from the repo root:  python -m benchmarks.bench_grouped_topk [--sweep]

bf16 router logits [M, 256], a float32 correction bias, renormalize, routed_scaling_factor 2.5.
For each M in 1, 16, 128, 1024, 8192, 65536 it times, in the same run:
  triton_us        the public op on CUDA tensors (one Triton kernel), eager (do_bench median)
  graph_us         the same under CUDA-graph replay (16 calls per graph, per call)
  triton_host_us   host time per call of the public op (launch loop, one sync at the end)
  torch_us, torch_host_us      the torch path (grouped_topk_ref: float64 scores, stable sorts)
                               on the same CUDA tensors: the anchor the kernel must match
  deepseek_us, deepseek_host_us  DeepSeek-V3's model-code routing as plain float32 torch ops
                               (sigmoid, topk(2) group sums, topk, gather; unordered ties): what
                               an engine without this kernel runs
  ids_equal        the kernel's ids equal the torch path's on the first input set
Writes benchmarks/results/grouped_topk.json. --sweep also times (block_m, num_warps) of the
launcher per M, prints the best and adds them to the JSON.
"""

import argparse
import functools
import itertools

import torch

from benchmarks._common import (
    bench_us,
    gbps,
    graph_us,
    host_us,
    print_best,
    print_table,
    require_cuda,
    rotating,
    write_json,
)
from vllm_moe_fixes.fused_moe.grouped_topk import (
    grouped_topk,
    grouped_topk_ref,
    grouped_topk_triton,
)

MS = (1, 16, 128, 1024, 8192, 65536)
E, GROUPS, TOPK_GROUP, TOPK, SCALE = 256, 8, 4, 8, 2.5
ROUTING = dict(renormalize=True, num_expert_group=GROUPS, topk_group=TOPK_GROUP,
               scoring_func="sigmoid", routed_scaling_factor=SCALE)


def _make(M, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(M, E, generator=g, device="cuda", dtype=torch.bfloat16),
            torch.randn(E, generator=g, device="cuda") / 8)


def _triton(logits, bias):
    return grouped_topk(logits, TOPK, e_score_correction_bias=bias, **ROUTING)


def _torch_path(logits, bias):
    return grouped_topk_ref(logits, TOPK, e_score_correction_bias=bias, **ROUTING)


def _deepseek(logits, bias):
    """DeepSeek-V3's MoEGate (noaux_tc) routing, float32 torch ops."""
    scores = logits.float().sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, GROUPS, E // GROUPS).topk(2, dim=-1)[0].sum(-1)
    group_idx = group_scores.topk(TOPK_GROUP, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, GROUPS, E // GROUPS).reshape(-1, E)
    ids = choice.masked_fill(expert_mask == 0, float("-inf")).topk(TOPK, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    return weights / (weights.sum(-1, keepdim=True) + 1e-20) * SCALE, ids


def _bytes(M):
    return M * E * 2 + E * 4 + M * TOPK * (4 + 8)  # logits + bias + weights + ids


def _launcher(logits, bias, w, ids, **config):
    grouped_topk_triton(logits, w, ids, e_score_correction_bias=bias, **ROUTING, **config)


def _sweep(M, sets):
    outs = [(torch.empty(M, TOPK, device="cuda"),
             torch.empty(M, TOPK, dtype=torch.int64, device="cuda")) for _ in sets]
    launch_sets = [s + o for s, o in zip(sets, outs)]
    rows = []
    for block_m, warps in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8)):
        us = bench_us(functools.partial(_launcher, block_m=block_m, num_warps=warps), launch_sets,
                      rep=50)
        rows.append({"M": M, "block_m": block_m, "num_warps": warps, "us": us,
                     "GB/s": gbps(_bytes(M), us)})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time launch configs")
    args = parser.parse_args()
    require_cuda("bench_grouped_topk")
    rows, sweep = [], []
    for M in MS:
        sets = rotating(functools.partial(_make, M), _bytes(M))
        got, want = _triton(*sets[0]), _torch_path(*sets[0])
        t, t_torch, t_ds = (bench_us(f, sets) for f in (_triton, _torch_path, _deepseek))
        rows.append({
            "M": M, "triton_us": t, "GB/s": gbps(_bytes(M), t), "graph_us": graph_us(_triton, sets),
            "triton_host_us": host_us(_triton, sets),
            "torch_us": t_torch, "torch_host_us": host_us(_torch_path, sets),
            "deepseek_us": t_ds, "deepseek_host_us": host_us(_deepseek, sets),
            "x_vs_torch": t_torch / t, "x_vs_deepseek": t_ds / t,
            "ids_equal": bool(torch.equal(got[1], want[1])),
        })
        if args.sweep:
            sweep += _sweep(M, sets)
        del sets
        torch.cuda.empty_cache()
    print_table(rows, list(rows[0]))
    payload = {"experts": E, "groups": GROUPS, "topk_group": TOPK_GROUP, "topk": TOPK,
               "logits_dtype": "bfloat16", "rows": rows}
    if args.sweep:
        print_best(sweep, "\nSweep (launcher, eager), best 6 per M:", n=6)
        payload["sweep"] = sweep
    write_json("grouped_topk", payload)


if __name__ == "__main__":
    main()
