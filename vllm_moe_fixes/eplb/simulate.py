"""Planning expert load balancing before a run, on the host: how evenly each planner spreads a
routing scenario over the ranks, and what the busiest rank's MoE layer then costs. The memory of
E + R physical experts (weights, DeepEP buffers) is planned by ``vllm-moe-fixes plan
--redundant-experts``; this module plans the time.

    scenario_loads   per step, token-slots per logical expert, float64 [E]
         |
    replay           plan from a sliding window of steps, re-plan every few steps, score each
         |           later step with the placement then in force: max/mean rank load
    LayerTimeCurve   the busiest rank's layer time at max/mean x the mean rank's token-slots,
                     from a measured curve of layer time against token-slots received
    run_simulation   the three over (scenario, EP size, redundant experts): one row each

Scenarios (each step routes ``tokens`` tokens of the whole EP group through grouped top-k, as
DeepSeek-V3/R1 route: ``DEEPSEEK_V3``):
  zero      the engine's dummy run: every token the same top-k (one router row for all).
  zipf1.0   expert popularity p_e ~ 1 / rank^1.0 over a fixed random order of the experts; a
            token's logits are log p + Gumbel noise (so its top-k is a popularity-weighted
            draw without replacement), then grouped top-k.
  zipf1.5   the same, heavier skew.
  shift     zipf1.0 whose popularity order drifts: each step swaps ``swaps_per_step`` random
            neighbours in it (an expert climbs or falls one place at a time).

Planners (``planners``): ``none`` (no EPLB: expert e on rank e // (E / EP), no redundant slots),
``baseline`` (``rebalance_hierarchical``, nodes of ``gpus_per_node`` ranks) and ``ours``
(``rebalance``, given the placement in force). A rank's load is its token-slots, a logical
expert's slots split evenly over its replicas as ``ExpertPlacement.route`` spreads them. The
mean rank load is the same under every placement, so max/mean is how much longer the busiest
rank takes than a balanced one, and the others wait for it at the combine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_moe_fixes._validate import check, check_nonnegative_int, check_positive_int
from vllm_moe_fixes.eplb.rebalance import count_moves, rank_loads, rebalance, rebalance_hierarchical
from vllm_moe_fixes.fused_moe.grouped_topk import grouped_topk

__all__ = ["DEEPSEEK_V3", "SCENARIOS", "LayerTimeCurve", "RoutingShape", "SimulationConfig",
           "max_mean", "planners", "replay", "run_simulation", "scenario_loads"]

SCENARIOS = ("zero", "zipf1.0", "zipf1.5", "shift")
_ZIPF_EXPONENT = {"zipf1.0": 1.0, "zipf1.5": 1.5, "shift": 1.0}

# planner(load float64 [E], placement in force or None) -> physical_to_logical int64 [E + R]
Planner = Callable[[np.ndarray, "np.ndarray | None"], np.ndarray]


@dataclass(frozen=True)
class RoutingShape:
    """A grouped top-k router: ``num_experts`` logical experts in ``num_groups`` equal groups;
    each token takes ``topk`` experts from its best ``topk_group`` groups (``grouped_topk``
    checks the combination)."""

    num_experts: int
    topk: int
    num_groups: int
    topk_group: int

    def __post_init__(self) -> None:
        for name in ("num_experts", "topk", "num_groups", "topk_group"):
            check_positive_int(name, getattr(self, name))


DEEPSEEK_V3 = RoutingShape(num_experts=256, topk=8, num_groups=8, topk_group=4)


# ----------------------------------------------------------------------------------------------
# Scenarios
# ----------------------------------------------------------------------------------------------
def _route(logits: torch.Tensor, shape: RoutingShape) -> np.ndarray:
    """Token-slots per logical expert float64 [E] of router logits float32 [T, E]."""
    _, ids = grouped_topk(logits, shape.topk, renormalize=True, num_expert_group=shape.num_groups,
                          topk_group=shape.topk_group)
    return np.bincount(ids.reshape(-1).numpy(), minlength=shape.num_experts).astype(np.float64)


def _zipf_logits(order: np.ndarray, exponent: float, tokens: int,
                 gen: torch.Generator) -> torch.Tensor:
    """float32 [tokens, E]: the log-popularity of the experts in ``order`` (most popular first)
    plus Gumbel noise."""
    num_experts = order.size
    log_p = torch.empty(num_experts, dtype=torch.float64)
    log_p[torch.from_numpy(order)] = -exponent * torch.log(
        torch.arange(1, num_experts + 1, dtype=torch.float64))
    u = torch.rand(tokens, num_experts, generator=gen, dtype=torch.float64).clamp_min(1e-300)
    return (log_p - torch.log(-torch.log(u))).float()


def _drift(order: np.ndarray, rng: np.random.Generator, swaps: int) -> None:
    """Swap ``swaps`` random neighbours of the popularity ``order`` in place."""
    for i in rng.integers(order.size - 1, size=swaps):
        order[[i, i + 1]] = order[[i + 1, i]]


def scenario_loads(name: str, *, tokens: int, steps: int, seed: int = 0,
                   shape: RoutingShape = DEEPSEEK_V3, swaps_per_step: int = 16) -> list[np.ndarray]:
    """Per step, the token-slots per logical expert (float64 [shape.num_experts], summing to
    tokens x topk) of scenario `name` (one of SCENARIOS; module docstring). Equal arguments give
    equal loads."""
    check(name in SCENARIOS, f"name={name!r} must be one of {SCENARIOS}")
    check_positive_int("tokens", tokens)
    check_positive_int("steps", steps)
    check_nonnegative_int("seed", seed)
    check_nonnegative_int("swaps_per_step", swaps_per_step)
    rng = np.random.default_rng([seed, SCENARIOS.index(name)])
    gen = torch.Generator().manual_seed(seed)
    if name == "zero":
        one = _route(torch.randn(1, shape.num_experts, generator=gen), shape) * tokens
        return [one.copy() for _ in range(steps)]
    order = rng.permutation(shape.num_experts)
    loads = []
    for _ in range(steps):
        if name == "shift":
            _drift(order, rng, swaps_per_step)
        loads.append(_route(_zipf_logits(order, _ZIPF_EXPONENT[name], tokens, gen), shape))
    return loads


# ----------------------------------------------------------------------------------------------
# Planners, scoring and replay
# ----------------------------------------------------------------------------------------------
def max_mean(load, physical_to_logical, world_size: int) -> float:
    """The busiest rank's load over the mean rank's (1.0: balanced) under `physical_to_logical`
    (int [num_physical]) for `load` (float [E], >= 0, not all zero)."""
    total = float(np.sum(load))
    check(total > 0, "load must not be all zero (max/mean of no load is undefined)")
    return float(rank_loads(load, physical_to_logical, world_size).max() / (total / world_size))


def planners(*, num_experts: int, world_size: int, num_redundant: int, num_groups: int = 1,
             gpus_per_node: int = 8) -> dict[str, Planner]:
    """The three planners of one layout, by name: none, baseline, ours (module docstring)."""
    physical = num_experts + num_redundant
    nodes = max(1, world_size // gpus_per_node)
    return {
        "none": lambda load, previous: np.arange(num_experts),
        "baseline": lambda load, previous: rebalance_hierarchical(
            load, num_physical=physical, world_size=world_size, num_groups=num_groups,
            num_nodes=nodes),
        "ours": lambda load, previous: rebalance(load, num_physical=physical,
                                                 world_size=world_size, previous=previous),
    }


def replay(loads: Sequence[np.ndarray], plan: Planner, *, world_size: int, window: int,
           rebalance_every: int) -> dict:
    """Run `plan` over `loads` (per step float [E]): from step ``window`` on, every
    `rebalance_every` steps it re-plans from the last `window` steps' summed load (given the
    placement in force), and each step is scored with the placement in force.

    Returns a dict: planned (the mean max/mean on the windows planned from), measured (the mean
    max/mean of the steps scored: traffic the placement was not planned from) and
    moves_per_rebalance (the mean slots a re-plan rewrites, ``count_moves``; None with one plan).
    With ``window + 1`` steps it plans once and scores the next step.
    """
    check_positive_int("window", window)
    check_positive_int("rebalance_every", rebalance_every)
    check(len(loads) > window, f"loads holds {len(loads)} steps; replay needs more than "
                               f"window={window}")
    current, planned, measured, moves = None, [], [], []
    for t in range(window, len(loads)):
        if (t - window) % rebalance_every == 0:
            recent = sum(loads[t - window:t])
            new = plan(recent, current)
            if current is not None:
                moves.append(count_moves(current, new))
            current = new
            planned.append(max_mean(recent, current, world_size))
        measured.append(max_mean(loads[t], current, world_size))
    return {"planned": float(np.mean(planned)), "measured": float(np.mean(measured)),
            "moves_per_rebalance": float(np.mean(moves)) if moves else None}


# ----------------------------------------------------------------------------------------------
# Layer time
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerTimeCurve:
    """A rank's measured MoE layer time against the token-slots it receives: piecewise linear
    between the points, flat below the first, extended along the last segment above the last.

    Fields:
        slots: token-slots received, strictly increasing (>= 2 points).
        us: the layer time at each, microseconds (finite, >= 0).
    """

    slots: tuple[float, ...]
    us: tuple[float, ...]

    def __post_init__(self) -> None:
        x, y = np.asarray(self.slots, dtype=np.float64), np.asarray(self.us, dtype=np.float64)
        check(x.ndim == 1 and x.shape == y.shape and x.size >= 2,
              f"slots and us must be two equal-length lists of >= 2 points, got "
              f"{x.shape} and {y.shape}")
        check(bool((np.diff(x) > 0).all()), f"slots must be strictly increasing, got {self.slots}")
        check(bool(np.isfinite(y).all() and (y >= 0).all()),
              f"us must be finite and >= 0, got {self.us}")

    @classmethod
    def from_points(cls, points) -> "LayerTimeCurve":
        """The curve through (slots, us) pairs in any order."""
        ordered = sorted((float(s), float(u)) for s, u in points)
        return cls(slots=tuple(p[0] for p in ordered), us=tuple(p[1] for p in ordered))

    def __call__(self, slots: float) -> float:
        """The layer time in microseconds at `slots` token-slots received."""
        x, y = np.asarray(self.slots), np.asarray(self.us)
        if slots > x[-1]:
            return float(y[-1] + (slots - x[-1]) * (y[-1] - y[-2]) / (x[-1] - x[-2]))
        return float(np.interp(slots, x, y))


# ----------------------------------------------------------------------------------------------
# The whole simulation
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimulationConfig:
    """What ``run_simulation`` runs; the defaults: DeepSeek-V3/R1 at a deployment's EP sizes.

    Fields:
        shape: the router (RoutingShape).
        eps: EP sizes, each dividing E; redundant: redundant expert counts R (a layout runs
            where E + R divides by the EP size).
        scenarios: names from SCENARIOS.
        tokens_per_step: tokens the whole EP group routes per step.
        steps_shift: steps of the shift scenario (the others run window + 1: plan once, score
            the next step).
        window, rebalance_every: the sliding window and re-plan period, in steps.
        swaps_per_step: the shift scenario's drift.
        gpus_per_node: the baseline's node size.
        tokens_per_rank: the mean rank's tokens at which the layer time is read.
        seed: the scenarios' seed.
    """

    shape: RoutingShape = DEEPSEEK_V3
    eps: tuple[int, ...] = (8, 32, 64, 128, 256)
    redundant: tuple[int, ...] = (0, 8, 16, 32, 64)
    scenarios: tuple[str, ...] = SCENARIOS
    tokens_per_step: int = 8192
    steps_shift: int = 24
    window: int = 8
    rebalance_every: int = 4
    swaps_per_step: int = 16
    gpus_per_node: int = 8
    tokens_per_rank: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("tokens_per_step", "steps_shift", "window", "rebalance_every",
                     "gpus_per_node", "tokens_per_rank"):
            check_positive_int(name, getattr(self, name))
        for ep in self.eps:
            check_positive_int("eps", ep)
            check(self.shape.num_experts % ep == 0,
                  f"eps holds {ep}, which does not divide the {self.shape.num_experts} experts "
                  f"(no EPLB puts E / EP experts on a rank)")
        for r in self.redundant:
            check_nonnegative_int("redundant", r)
        check_nonnegative_int("seed", self.seed)
        check_nonnegative_int("swaps_per_step", self.swaps_per_step)
        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        check(not unknown, f"scenarios {unknown} are not among {SCENARIOS}")
        check(self.steps_shift > self.window,
              f"steps_shift={self.steps_shift} must be > window={self.window}")

    def layouts(self) -> list[tuple[int, int]]:
        """The (EP size, R) pairs that run: E + R physical experts divide over the ranks."""
        return [(ep, r) for ep in self.eps for r in self.redundant
                if (self.shape.num_experts + r) % ep == 0]


def _row(config: SimulationConfig, scenario: str, loads: list[np.ndarray], ep: int,
         redundant: int, layer_time: LayerTimeCurve | None) -> dict:
    """One (scenario, EP, R) row of ``run_simulation``."""
    shape = config.shape
    runs = {name: replay(loads, plan, world_size=ep, window=config.window,
                         rebalance_every=config.rebalance_every)
            for name, plan in planners(num_experts=shape.num_experts, world_size=ep,
                                       num_redundant=redundant, num_groups=shape.num_groups,
                                       gpus_per_node=config.gpus_per_node).items()}
    row = {"scenario": scenario, "ep": ep, "redundant": redundant}
    for key in ("planned", "measured", "moves_per_rebalance"):
        if runs["ours"][key] is not None:
            row[key] = {name: run[key] for name, run in runs.items()}
    if layer_time is not None:
        mean_slots = config.tokens_per_rank * shape.topk
        row["layer_us"] = {name: layer_time(mean_slots * run["measured"])
                           for name, run in runs.items()}
    return row


def run_simulation(config: SimulationConfig = SimulationConfig(),
                   layer_time: LayerTimeCurve | None = None) -> list[dict]:
    """One dict per (scenario, EP size, R) of `config`: scenario, ep, redundant; planned and
    measured max/mean per planner (``replay``); moves_per_rebalance where a scenario re-plans
    (shift); and with `layer_time`, layer_us per planner: the busiest rank's time at its
    measured max/mean of the mean rank's ``tokens_per_rank x topk`` token-slots."""
    rows = []
    for scenario in config.scenarios:
        steps = config.steps_shift if scenario == "shift" else config.window + 1
        loads = scenario_loads(scenario, tokens=config.tokens_per_step, steps=steps,
                               seed=config.seed, shape=config.shape,
                               swaps_per_step=config.swaps_per_step)
        rows += [_row(config, scenario, loads, ep, redundant, layer_time)
                 for ep, redundant in config.layouts()]
    return rows
