"""The MoE layer time of the busiest rank at EP 8, with and without redundant experts, at
balanced and skewed routing (world 1: the tokens that rank would receive).

Run from the repository root on a GPU:

    python -m benchmarks.bench_eplb_layer            # JSON in benchmarks/results/eplb_layer.json
    python -m benchmarks.bench_eplb_layer --smoke    # tiny shapes, CPU or GPU, prints only

DeepSeek-V3/R1 shapes (K 7168, I 2048, top-8, 256 experts), EP 8: each of 8 ranks routes
--tokens tokens; the layer of the rank that receives the most token-slots runs on one GPU with
its local experts (NoEP kernel, local ids, -1 for the slots served elsewhere):

  balanced        top-8 of random router scores, 32 experts per rank (the anchor, same run)
  zeros / zipf    every id 0 / experts drawn by Zipf(1.0) popularity, 32 experts per rank
  ... + eplb      the same ids over 256 + 32 physical experts placed by
                  vllm_moe_fixes.eplb.rebalance (36 per rank), each source rank routing its
                  own tokens to the replicas (ExpertPlacement.route)

Columns: recv_tokens / recv_slots (what the busiest rank got), max_mean (its slots over the
mean rank's), us (median), vs_balanced (us / balanced us; target for "+ eplb" rows: <= 1.15).
The JSON also holds layer_time: the busiest rank's us against the tokens it received, over a
sweep of --sweep tokens per rank at balanced routing (the table the EPLB simulation reads).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks._common import bench_us, print_table, write_json
from vllm_moe_fixes.eplb import ExpertPlacement
from vllm_moe_fixes.eplb.rebalance import rebalance
from vllm_moe_fixes.fused_moe import fused_topk, make_moe_kernel
from vllm_moe_fixes.testing import random_fp8_moe_weights

FULL = dict(K=7168, I=2048, E=256, topk=8, ep=8, redundant=32)
SMOKE = dict(K=256, I=128, E=16, topk=4, ep=4, redundant=4)


def routing(kind: str, tokens: int, shape: dict, g: torch.Generator, device) -> torch.Tensor:
    """Logical ids int64 [tokens, topk] of one kind: balanced, zeros or zipf."""
    E, k = shape["E"], shape["topk"]
    if kind == "zeros":
        return torch.zeros(tokens, k, dtype=torch.int64, device=device)
    if kind == "balanced":
        scores = torch.randn(tokens, E, generator=g, device=device)
        return fused_topk(scores, k, renormalize=True)[1].long()
    popularity = 1.0 / torch.arange(1, E + 1, dtype=torch.float32, device=device)
    popularity = popularity[torch.randperm(E, generator=g, device=device)]
    return torch.multinomial(popularity.expand(tokens, E), k, replacement=False, generator=g)


def busiest_rank(physical: torch.Tensor, placement: ExpertPlacement):
    """(rank, its received token mask [T], its local ids [T', k] with -1 elsewhere, max/mean)."""
    L = placement.num_local
    rank_of = torch.where(physical >= 0, physical // L, -1)
    slots = torch.stack([(rank_of == r).sum() for r in range(placement.world_size)])
    rank = int(slots.argmax())
    mine = rank_of == rank
    rows = mine.any(1)
    local = torch.where(mine, physical - rank * L, -1)[rows]
    return rank, rows, local, float(slots.max() / slots.float().mean())


def time_us(fn, smoke: bool) -> float:
    """Median us: do_bench on a GPU; a few timed calls on the CPU (smoke)."""
    if not smoke:
        return bench_us(fn, [()])
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


class Rank:
    """The busiest rank's layer for one number of local experts (weights shared by all rows)."""

    def __init__(self, shape, num_local, device, g):
        self.shape, self.num_local = shape, num_local
        self.w = random_fp8_moe_weights(num_local, shape["K"], shape["I"], generator=g,
                                        device=device)
        self.kernel = make_moe_kernel(None, hidden_size=shape["K"],
                                      intermediate_size=shape["I"], num_experts=num_local)

    def time(self, x, weights, local_ids, smoke):
        w = self.w
        return time_us(lambda: self.kernel(x, w.w1, w.w2, weights, local_ids,
                                           w1_scale=w.w1_scale, w2_scale=w.w2_scale,
                                           global_num_experts=self.num_local), smoke)


def route_per_source(placement: ExpertPlacement, ids: torch.Tensor, ep: int) -> torch.Tensor:
    """Each source rank routes its own tokens (its own occurrence counts), as in a real run."""
    return torch.cat([placement.route(part) for part in ids.chunk(ep)])


def row(name, ids, placement, rank_layer, x, weights, smoke):
    physical = route_per_source(placement, ids, placement.world_size)
    rank, rows, local, max_mean = busiest_rank(physical, placement)
    us = rank_layer.time(x[rows], weights[rows], local, smoke)
    return dict(routing=name, rank=rank, recv_tokens=int(rows.sum()),
                recv_slots=int((local >= 0).sum()), max_mean=round(max_mean, 3), us=us)


def compare(shape, tokens, device, smoke, g):
    """The table: balanced anchor, skewed without and with EPLB."""
    ep, E = shape["ep"], shape["E"]
    total = ep * tokens
    x = torch.randn(total, shape["K"], generator=g, device=device).bfloat16()
    weights = torch.softmax(torch.randn(total, shape["topk"], generator=g, device=device), -1)
    plain = ExpertPlacement.identity(E, ep).to(device)
    rank_plain = Rank(shape, E // ep, device, g)
    rank_eplb = Rank(shape, (E + shape["redundant"]) // ep, device, g)
    rows = [row("balanced", routing("balanced", total, shape, g, device), plain, rank_plain, x,
                weights, smoke)]
    for kind in ("zeros", "zipf"):
        ids = routing(kind, total, shape, g, device)
        rows.append(row(kind, ids, plain, rank_plain, x, weights, smoke))
        load = torch.bincount(ids.flatten(), minlength=E).double()
        placement = ExpertPlacement.from_physical_to_logical(
            rebalance(load.cpu(), num_physical=E + shape["redundant"], world_size=ep), ep,
            num_logical=E).to(device)
        rows.append(row(kind + " + eplb", ids, placement, rank_eplb, x, weights, smoke))
    for r in rows:
        r["vs_balanced"] = round(r["us"] / rows[0]["us"], 3)
    return rows


def sweep(shape, token_counts, device, smoke, g):
    """layer_time: the busiest rank's us against what it received, balanced routing."""
    ep, E = shape["ep"], shape["E"]
    plain = ExpertPlacement.identity(E, ep).to(device)
    rank_plain = Rank(shape, E // ep, device, g)
    points = []
    for tokens in token_counts:
        total = ep * tokens
        x = torch.randn(total, shape["K"], generator=g, device=device).bfloat16()
        weights = torch.softmax(torch.randn(total, shape["topk"], generator=g, device=device), -1)
        r = row("balanced", routing("balanced", total, shape, g, device), plain, rank_plain, x,
                weights, smoke)
        points.append(dict(tokens_per_rank=tokens, recv_tokens=r["recv_tokens"],
                           recv_slots=r["recv_slots"], us=r["us"]))
    return points


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096,
                        help="tokens each of the 8 ranks routes")
    parser.add_argument("--sweep", type=int, nargs="*",
                        default=[16, 64, 128, 256, 512, 1024, 2048, 4096, 8192],
                        help="tokens per rank of the layer-time sweep (none: skip it)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, CPU allowed, a few calls, no JSON")
    args = parser.parse_args(argv)
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench_eplb_layer needs a CUDA GPU (or --smoke)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = SMOKE if smoke else FULL
    tokens, token_counts = (8, [2, 8]) if smoke else (args.tokens, args.sweep)
    g = torch.Generator(device=device).manual_seed(0)
    rows = compare(shape, tokens, device, smoke, g)
    print_table(rows, list(rows[0]))
    points = sweep(shape, token_counts, device, smoke, g)
    print_table(points, list(points[0]) if points else [])
    if not smoke:
        write_json("eplb_layer", dict(shape=shape, tokens_per_rank=tokens, rows=rows,
                                      layer_time=points))


if __name__ == "__main__":
    main()
