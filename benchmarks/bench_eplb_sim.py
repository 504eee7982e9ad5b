"""Expert load balancing at scale, simulated on the host (``vllm_moe_fixes.eplb.simulate``):
DeepSeek-V3/R1 routing (256 routed experts, top-8 of the best 4 of 8 groups) replayed at EP 8,
32, 64, 128 and 256 with 0, 8, 16, 32 and 64 redundant experts (where E + R divides by EP), for
no EPLB, the hierarchical baseline and ours, in the scenarios zero, zipf1.0, zipf1.5 and shift.

    python -m benchmarks.bench_eplb_sim [--tokens N] [--steps S] [--seed S] [--quick]

Per row: max/mean rank load planned (on the window planned from) and measured (on the steps
after it), the expected MoE layer time of the busiest rank and, for shift, the slots each
planner rewrites per rebalance. The layer time comes from our measured per-rank layer time
against the token-slots received (``layer_time_curve``: bench_eplb_layer's sweep where
benchmarks/results/eplb_layer.json exists, else experts.json's DeepGemmExperts rows on the H200,
K 7168, I 2048, top-8, at 128 / 1024 / 8192 tokens), read at 4096 tokens per rank. Writes
benchmarks/results/eplb_sim.json and, with matplotlib, eplb_sim.png (``plots.draw_eplb_sim``);
--quick runs EP 8 and 64 at 512 tokens a step and writes neither.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import time

from benchmarks._common import RESULTS_DIR, write_json
from benchmarks.plots import draw_eplb_sim
from vllm_moe_fixes.eplb.simulate import LayerTimeCurve, SimulationConfig, run_simulation


def layer_time_curve() -> tuple[LayerTimeCurve, str]:
    """(our measured per-rank layer time against token-slots received, where it came from):
    bench_eplb_layer's tokens-per-rank sweep (eplb_layer.json, ``layer_time``) where it has been
    run, else experts.json's DeepGemmExperts rows (M tokens, all top-8 slots local)."""
    sweep = RESULTS_DIR / "eplb_layer.json"
    if sweep.exists():
        points = [(r["recv_slots"], r["us"]) for r in json.loads(sweep.read_text())["layer_time"]]
        return (LayerTimeCurve.from_points(points),
                "benchmarks/results/eplb_layer.json (layer_time: us against recv_slots)")
    rows = json.loads((RESULTS_DIR / "experts.json").read_text())["results"]
    topk = SimulationConfig().shape.topk
    points = [(topk * r["M"], r["us"]) for r in rows if r["backend"] == "deep_gemm"]
    return (LayerTimeCurve.from_points(points),
            "benchmarks/results/experts.json (backend deep_gemm: us against M x top-8)")


def print_rows(rows: list[dict]) -> None:
    print(f"{'scenario':9} {'EP':>4} {'R':>3}  {'planned max/mean none/base/ours':>31}  "
          f"{'measured':>23}  {'layer us none/base/ours':>23}  moves base/ours")
    for r in rows:
        p, m, t = r["planned"], r["measured"], r["layer_us"]
        mv = r.get("moves_per_rebalance")
        moves = "" if mv is None else f"{mv['baseline']:.0f}/{mv['ours']:.0f}"
        print(f"{r['scenario']:9} {r['ep']:>4} {r['redundant']:>3}  "
              f"{p['none']:9.2f} {p['baseline']:10.3f} {p['ours']:10.3f}  "
              f"{m['none']:7.2f} {m['baseline']:7.3f} {m['ours']:7.3f}  "
              f"{t['none']:7.0f} {t['baseline']:7.0f} {t['ours']:7.0f}  {moves}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step of the EP group")
    p.add_argument("--steps", type=int, default=24, help="steps of the shift scenario")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="EP 8 and 64 at 512 tokens a step; no JSON, no plot")
    args = p.parse_args(argv)
    config = SimulationConfig(tokens_per_step=512 if args.quick else args.tokens,
                              steps_shift=args.steps, seed=args.seed,
                              **({"eps": (8, 64)} if args.quick else {}))
    curve, source = layer_time_curve()
    start = time.perf_counter()
    rows = run_simulation(config, curve)
    elapsed = time.perf_counter() - start
    print_rows(rows)
    print(f"({elapsed:.1f} s; layer time from {source} at {config.tokens_per_rank} tokens per "
          f"rank)")
    if not args.quick:
        path = write_json("eplb_sim", {"config": dataclasses.asdict(config),
                                       "layer_time_source": source, "rows": rows,
                                       "elapsed_s": elapsed})
        if importlib.util.find_spec("matplotlib") is None:
            print("matplotlib is not installed: no plot (pip install 'vllm-moe-fixes[plot]')")
        else:
            print(f"wrote {draw_eplb_sim(rows, path.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
