"""Expert load balancing at scale, simulated on the host: DeepSeek-V3/R1 routing (256 routed
experts, top-8 of 8 groups with the best 4 groups eligible, ``grouped_topk``) replayed at EP 8, 32,
64, 128 and 256 with 0, 8, 16, 32 and 64 redundant experts (where E + R divides by EP), for no
EPLB (expert e on rank e // (E / EP)), the hierarchical baseline and ours
(``vllm_moe_fixes.eplb.rebalance``).

    python -m benchmarks.bench_eplb_sim [--tokens N] [--steps S] [--quick]

Scenarios (each step routes ``--tokens`` tokens of the whole EP group):
  zero      the engine's dummy run: every token the same top-8 (one router row for all).
  zipf1.0   expert popularity p_e ~ 1 / rank^1.0 over a fixed random order of the experts;
            a token's logits are log p + Gumbel noise (so its top-k is a popularity-weighted
            draw without replacement), then grouped top-k.
  zipf1.5   the same, heavier skew.
  shift     zipf1.0 whose popularity order drifts: each step swaps ``SWAPS_PER_STEP`` random
            neighbours in it (an expert climbs or falls one place at a time). Every
            ``REBALANCE_EVERY`` steps both planners re-plan from the sliding window of the last
            ``WINDOW`` steps' counts; each step is measured with the placement in force.
The stationary scenarios plan from one window of ``WINDOW`` steps and are measured on a fresh
step (the placement never sees the traffic it is judged on).

Per row: max/mean rank load (a logical expert's token-slots split evenly over its replicas, as
``ExpertPlacement.route`` spreads them) and the expected MoE layer time: the busiest rank's time
from our measured per-rank layer time as a function of the token-slots it receives
(``layer_time_points``: bench_eplb_layer's sweep where benchmarks/results/eplb_layer.json exists,
else experts.json's DeepGemmExperts rows on the H200, K 7168, I 2048, top-8, at 128 / 1024 /
8192 tokens; piecewise linear, extrapolated along the last segment), at ``TOKENS_PER_RANK``
tokens per rank (the mean rank receives TOKENS_PER_RANK x 8 slots). The ``shift`` rows also
give the slots each planner rewrites per rebalance (ours keeps slots of the previous placement
where it costs no max load; the baseline plans from scratch). Writes
benchmarks/results/eplb_sim.json and, with matplotlib, eplb_sim.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from vllm_moe_fixes.eplb.rebalance import count_moves, rank_loads, rebalance, rebalance_hierarchical
from vllm_moe_fixes.fused_moe.grouped_topk import grouped_topk

EXPERTS, TOPK, GROUPS, TOPK_GROUP = 256, 8, 8, 4
GPUS_PER_NODE = 8
EPS = (8, 32, 64, 128, 256)
REDUNDANT = (0, 8, 16, 32, 64)
SCENARIOS = ("zero", "zipf1.0", "zipf1.5", "shift")
WINDOW, REBALANCE_EVERY = 8, 4
SWAPS_PER_STEP = 16
TOKENS_PER_RANK = 4096
RESULTS = Path(__file__).resolve().parent / "results"


def layer_time_points() -> tuple[np.ndarray, np.ndarray, str]:
    """(token-slots received [n], us [n], source) of our measured per-rank layer, ascending:
    bench_eplb_layer's tokens-per-rank sweep (eplb_layer.json, ``layer_time``) where it has
    been run, else experts.json's DeepGemmExperts rows (M tokens, all top-8 slots local)."""
    sweep = RESULTS / "eplb_layer.json"
    if sweep.exists():
        points = sorted((r["recv_slots"], r["us"])
                        for r in json.loads(sweep.read_text())["layer_time"])
        source = "benchmarks/results/eplb_layer.json (layer_time: us against recv_slots)"
    else:
        rows = json.loads((RESULTS / "experts.json").read_text())["results"]
        points = sorted((TOPK * r["M"], r["us"]) for r in rows if r["backend"] == "deep_gemm")
        source = "benchmarks/results/experts.json (backend deep_gemm: us against M x top-8)"
    return (np.array([p[0] for p in points], float), np.array([p[1] for p in points], float),
            source)


def layer_us(slots: float, points: tuple[np.ndarray, np.ndarray]) -> float:
    """Piecewise-linear layer time at ``slots`` received, extended along the end segments."""
    x, y = points
    if slots > x[-1]:
        return float(y[-1] + (slots - x[-1]) * (y[-1] - y[-2]) / (x[-1] - x[-2]))
    return float(np.interp(slots, x, y))


def _route(logits: torch.Tensor) -> np.ndarray:
    """Token-slots per logical expert float64 [E] of router logits [T, E] (grouped top-k)."""
    _, ids = grouped_topk(logits, TOPK, renormalize=True, num_expert_group=GROUPS,
                          topk_group=TOPK_GROUP)
    return np.bincount(ids.reshape(-1).numpy(), minlength=EXPERTS).astype(np.float64)


def _zipf_logits(order: np.ndarray, s: float, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """log-popularity of the experts in ``order`` (most popular first) plus Gumbel noise."""
    log_p = torch.empty(EXPERTS, dtype=torch.float64)
    log_p[torch.from_numpy(order)] = -s * torch.log(torch.arange(1, EXPERTS + 1,
                                                                 dtype=torch.float64))
    u = torch.rand(tokens, EXPERTS, generator=gen, dtype=torch.float64).clamp_min(1e-300)
    return (log_p - torch.log(-torch.log(u))).float()


def scenario_steps(name: str, *, tokens: int, steps: int, seed: int) -> list[np.ndarray]:
    """Per step, token-slots per logical expert float64 [E]."""
    rng = np.random.default_rng([seed, SCENARIOS.index(name)])
    gen = torch.Generator().manual_seed(seed)
    if name == "zero":
        one = _route(torch.randn(1, EXPERTS, generator=gen)) * tokens
        return [one] * steps
    order = rng.permutation(EXPERTS)
    out = []
    for _ in range(steps):
        if name == "shift":
            for i in rng.integers(EXPERTS - 1, size=SWAPS_PER_STEP):
                order[[i, i + 1]] = order[[i + 1, i]]
        s = 1.5 if name == "zipf1.5" else 1.0
        out.append(_route(_zipf_logits(order, s, tokens, gen)))
    return out


def _planners(ep: int, redundant: int):
    """name -> planner(load, previous) of physical_to_logical, for one (EP, R). No EPLB keeps
    the E experts in order, without redundant slots."""
    physical = EXPERTS + redundant
    nodes = max(1, ep // GPUS_PER_NODE)
    return {
        "none": lambda load, previous: np.arange(EXPERTS),
        "baseline": lambda load, previous: rebalance_hierarchical(
            load, num_physical=physical, world_size=ep, num_groups=GROUPS, num_nodes=nodes),
        "ours": lambda load, previous: rebalance(load, num_physical=physical, world_size=ep,
                                                 previous=previous),
    }


def _imbalance(load: np.ndarray, p2l, ep: int) -> float:
    return float(rank_loads(load, p2l, ep).max() / (load.sum() / ep))


def run_stationary(steps: list[np.ndarray], ep: int, redundant: int) -> dict:
    """Plan from the first WINDOW steps; max/mean on that window (planned) and on the next
    step (measured)."""
    window, fresh = sum(steps[:WINDOW]), steps[WINDOW]
    planned, measured = {}, {}
    for name, plan in _planners(ep, redundant).items():
        p2l = plan(window, None)
        planned[name], measured[name] = _imbalance(window, p2l, ep), _imbalance(fresh, p2l, ep)
    return {"planned": planned, "measured": measured}


def run_shift(steps: list[np.ndarray], ep: int, redundant: int) -> dict:
    """Re-plan every REBALANCE_EVERY steps from the last WINDOW steps; planned: the mean
    max/mean on the windows planned from; measured: the mean over the steps that follow, with
    the placement then in force."""
    planned, measured, moves = {}, {}, {}
    for name, plan in _planners(ep, redundant).items():
        current, on_window, series, rewritten = None, [], [], []
        for t in range(WINDOW, len(steps)):
            if (t - WINDOW) % REBALANCE_EVERY == 0:
                window = sum(steps[t - WINDOW:t])
                new = plan(window, current)
                if current is not None:
                    rewritten.append(count_moves(current, new))
                current = new
                on_window.append(_imbalance(window, current, ep))
            series.append(_imbalance(steps[t], current, ep))
        planned[name], measured[name] = float(np.mean(on_window)), float(np.mean(series))
        moves[name] = float(np.mean(rewritten))
    return {"planned": planned, "measured": measured, "moves_per_rebalance": moves}


def rows(tokens: int, steps: int, seed: int, *, eps=EPS, scenarios=SCENARIOS) -> list[dict]:
    """One dict per (scenario, EP, R): planned and measured max/mean per planner, layer_us (at
    the measured ratio) and, for shift, moves_per_rebalance."""
    *points, _ = layer_time_points()
    out = []
    for scenario in scenarios:
        traffic = scenario_steps(scenario, tokens=tokens,
                                 steps=steps if scenario == "shift" else WINDOW + 1, seed=seed)
        for ep in eps:
            for redundant in REDUNDANT:
                if (EXPERTS + redundant) % ep:
                    continue
                run = run_shift if scenario == "shift" else run_stationary
                row = {"scenario": scenario, "ep": ep, "redundant": redundant,
                       **run(traffic, ep, redundant)}
                row["layer_us"] = {name: layer_us(TOKENS_PER_RANK * TOPK * ratio, points)
                                   for name, ratio in row["measured"].items()}
                out.append(row)
    return out


def _print(table: list[dict]) -> None:
    print(f"{'scenario':9} {'EP':>4} {'R':>3}  {'planned max/mean none/base/ours':>31}  "
          f"{'measured':>23}  {'layer us none/base/ours':>23}  moves base/ours")
    for r in table:
        p, m, t = r["planned"], r["measured"], r["layer_us"]
        mv = r.get("moves_per_rebalance")
        moves = "" if mv is None else f"{mv['baseline']:.0f}/{mv['ours']:.0f}"
        print(f"{r['scenario']:9} {r['ep']:>4} {r['redundant']:>3}  "
              f"{p['none']:9.2f} {p['baseline']:10.3f} {p['ours']:10.3f}  "
              f"{m['none']:7.2f} {m['baseline']:7.3f} {m['ours']:7.3f}  "
              f"{t['none']:7.0f} {t['baseline']:7.0f} {t['ours']:7.0f}  {moves}")


def _plot(table: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SCENARIOS), figsize=(16, 4.5), sharey=True)
    for ax, scenario in zip(axes, SCENARIOS):
        sel = [r for r in table if r["scenario"] == scenario]
        labels = [f"EP{r['ep']} R{r['redundant']}" for r in sel]
        for name, style in (("none", "--"), ("baseline", "-"), ("ours", "-")):
            ax.plot(range(len(sel)), [r["measured"][name] for r in sel], marker="o",
                    linestyle=style, label=name)
        ax.set_xticks(range(len(sel)), labels, rotation=60, ha="right", fontsize="small")
        ax.set_yscale("log")
        ax.set_title(scenario)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("max / mean rank load (measured)")
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step of the EP group")
    p.add_argument("--steps", type=int, default=24, help="steps of the shift scenario")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small run: no JSON, no plot")
    args = p.parse_args(argv)
    start = time.perf_counter()
    table = rows(args.tokens, args.steps, args.seed)
    _print(table)
    elapsed = time.perf_counter() - start
    source = layer_time_points()[2]
    print(f"({elapsed:.1f} s; layer time from {source} at {TOKENS_PER_RANK} tokens per rank)")
    if not args.quick:
        from benchmarks._common import write_json

        path = write_json("eplb_sim", {
            "config": {"experts": EXPERTS, "topk": TOPK, "groups": GROUPS,
                       "topk_group": TOPK_GROUP, "gpus_per_node": GPUS_PER_NODE,
                       "tokens_per_step": args.tokens, "steps_shift": args.steps,
                       "window": WINDOW, "rebalance_every": REBALANCE_EVERY, "seed": args.seed,
                       "tokens_per_rank_for_time": TOKENS_PER_RANK,
                       "layer_time_source": source},
            "rows": table, "elapsed_s": elapsed})
        _plot(table, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
