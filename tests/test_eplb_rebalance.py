"""The rebalancing planners: invariants of a placement, the load model against a plain loop, a
brute-force optimum on tiny cases, ours at or below the hierarchical baseline, the zero-ids case
worked out by hand, fewer moves from a previous placement, determinism and argument errors."""

import itertools

import numpy as np
import pytest
import torch

from vllm_moe_fixes.eplb.rebalance import (
    count_moves,
    rank_loads,
    rebalance,
    rebalance_hierarchical,
    replica_counts,
)
from vllm_moe_fixes.eplb.rebalance import _packed

# (logical, physical, ranks, groups, nodes): awkward sizes included (one rank, 3 ranks, R = 0).
LAYOUTS = [(16, 24, 4, 4, 2), (12, 15, 3, 4, 1), (7, 7, 1, 1, 1), (32, 40, 8, 8, 2),
           (24, 30, 5, 1, 1)]


def _loads(rng, num_logical):
    """Skewed random loads with some cold experts (never all zero)."""
    w = rng.pareto(1.2, size=num_logical) * rng.integers(0, 2, size=num_logical)
    w[rng.integers(num_logical)] += 1.0
    return w


def _both(w, num_physical, world_size, groups, nodes):
    ours = rebalance(w, num_physical=num_physical, world_size=world_size)
    base = rebalance_hierarchical(w, num_physical=num_physical, world_size=world_size,
                                  num_groups=groups, num_nodes=nodes)
    return ours, base


def _rank_loads_loop(w, p2l, world_size):
    """The load model as a loop: each replica carries its expert's load over its replica count."""
    slots = len(p2l) // world_size
    out = [0.0] * world_size
    for p, e in enumerate(p2l.tolist()):
        out[p // slots] += w[e] / p2l.tolist().count(e)
    return np.array(out)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_placement_invariants_and_load_model(layout):
    num_logical, num_physical, world_size, groups, nodes = layout
    rng = np.random.default_rng(list(layout))
    for _ in range(3):
        w = _loads(rng, num_logical)
        for p2l in _both(w, num_physical, world_size, groups, nodes):
            assert p2l.dtype == np.int64 and p2l.shape == (num_physical,)
            assert np.array_equal(np.unique(p2l), np.arange(num_logical))  # every expert
            np.testing.assert_allclose(rank_loads(w, p2l, world_size),
                                       _rank_loads_loop(w, p2l, world_size), rtol=1e-12)
            assert rank_loads(w, p2l, world_size).sum() == pytest.approx(w.sum())


def test_cold_experts_are_duplicated_only_when_it_lowers_the_max():
    """Ours gives a redundant slot to a cold (load 0) expert only when greedy replication of
    the loaded experts into every slot, packed the same way, has a higher max."""
    rng = np.random.default_rng(5)
    duplicated = 0
    for _ in range(20):
        w = _loads(rng, 32)
        p2l = rebalance(w, num_physical=40, world_size=8)
        counts = np.bincount(p2l, minlength=32)
        if (counts[w == 0] > 1).any():
            duplicated += 1
            greedy_max = _packed(w, replica_counts(w, 40), 8)[2]
            assert rank_loads(w, p2l, 8).max() < greedy_max
    assert duplicated > 0  # the case occurs on these seeds


def test_replica_counts_follow_load_per_replica():
    counts = replica_counts(np.array([9.0, 3.0, 0.0, 1.0]), 8)
    assert counts.tolist() == [4, 2, 1, 1]  # 9/4 = 2.25 > 3/2 = 1.5 > 1
    assert replica_counts(np.zeros(3), 7).tolist() == [3, 2, 2]  # no load: round-robin


def _brute_force(w, num_physical, world_size):
    """The least max rank load over every placement (all num_logical**num_physical arrays)."""
    p2l = np.array(list(itertools.product(range(w.size), repeat=num_physical)))
    counts = np.stack([(p2l == e).sum(1) for e in range(w.size)], axis=1)  # [n, E]
    p2l, counts = p2l[(counts > 0).all(1)], counts[(counts > 0).all(1)]
    per_slot = w[p2l] / np.take_along_axis(counts, p2l, axis=1)
    return per_slot.reshape(len(p2l), world_size, -1).sum(-1).max(1).min()


def test_ours_against_the_brute_force_optimum_on_tiny_cases():
    """Ours reaches the optimum in half the tiny cases and is within 4/3 of it in all (LPT-type
    packing; fewer replicas are taken only where they save 1% of the mean, SEARCH_MARGIN):
    measured 12 of 24 optimal, worst 1.19x on these seeds."""
    rng = np.random.default_rng(1)
    ratios = []
    for num_logical, world_size, num_physical in [(4, 2, 6), (3, 3, 6), (5, 2, 6), (2, 2, 4)]:
        for _ in range(6):
            w = rng.exponential(size=num_logical) * rng.integers(0, 2, size=num_logical).clip(0.2)
            ours = rank_loads(w, rebalance(w, num_physical=num_physical,
                                           world_size=world_size), world_size).max()
            ratios.append(ours / _brute_force(w, num_physical, world_size))
    assert min(ratios) >= 1 - 1e-12 and max(ratios) <= 4 / 3
    assert sum(r <= 1 + 1e-9 for r in ratios) >= len(ratios) // 2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ours_at_or_below_the_baseline(layout):
    num_logical, num_physical, world_size, groups, nodes = layout
    rng = np.random.default_rng([7, *layout])
    for _ in range(10):
        w = _loads(rng, num_logical)
        ours, base = _both(w, num_physical, world_size, groups, nodes)
        assert (rank_loads(w, ours, world_size).max()
                <= rank_loads(w, base, world_size).max() * (1 + 1e-12))


def test_zero_ids_reach_one_with_one_hot_replica_per_rank():
    """Eight hot experts (all tokens pick the same top-8), 64 redundant slots, 64 ranks: eight
    replicas each put one hot replica on every rank (max/mean 1.0). Greedy replication alone
    gives 9 each, 72 replicas, two on eight ranks: 16/9. The baseline packs the four hot groups
    onto four of eight nodes."""
    w = np.zeros(256)
    w[[0, 1, 2, 3, 32, 33, 64, 65]] = 100.0
    mean = w.sum() / 64
    ours, base = _both(w, 320, 64, 8, 8)
    assert rank_loads(w, ours, 64).max() / mean == pytest.approx(1.0)
    assert np.bincount(ours, minlength=256)[w > 0].tolist() == [8] * 8
    assert rank_loads(w, base, 64).max() / mean >= 2.0


def test_previous_placement_keeps_slots_at_no_cost():
    rng = np.random.default_rng(3)
    w = _loads(rng, 32)
    first = rebalance(w, num_physical=48, world_size=8)
    again = rebalance(w, num_physical=48, world_size=8, previous=first)
    assert count_moves(first, again) == 0
    shifted = w * rng.uniform(0.8, 1.25, size=32)
    fresh = rebalance(shifted, num_physical=48, world_size=8)
    kept = rebalance(shifted, num_physical=48, world_size=8, previous=first)
    assert (rank_loads(shifted, kept, 8).max()
            <= rank_loads(shifted, fresh, 8).max() * (1 + 1e-12))
    assert count_moves(first, kept) < count_moves(first, fresh)


def test_deterministic_and_input_kinds_agree():
    w = _loads(np.random.default_rng(11), 24)
    a = rebalance(w, num_physical=30, world_size=5)
    b = rebalance(torch.tensor(w, dtype=torch.float64), num_physical=30, world_size=5)
    c = rebalance(w.tolist(), num_physical=30, world_size=5)
    assert np.array_equal(a, b) and np.array_equal(a, c)
    assert np.array_equal(rebalance_hierarchical(w, num_physical=30, world_size=5),
                          rebalance_hierarchical(w, num_physical=30, world_size=5))
    zero = rebalance(np.zeros(24), num_physical=30, world_size=5)  # no load: still valid
    assert np.array_equal(np.unique(zero), np.arange(24))
    previous = torch.from_numpy(a)  # a torch placement is taken as well
    assert np.array_equal(rebalance(w, num_physical=30, world_size=5, previous=previous), a)


@pytest.mark.parametrize("kwargs, match", [
    (dict(load=np.ones((2, 4))), "non-empty 1-D"),
    (dict(load=np.array([])), "non-empty 1-D"),
    (dict(load=np.array([1.0, -1.0, 0.0, 0.0])), "finite and >= 0"),
    (dict(load=np.array([1.0, np.nan, 0.0, 0.0])), "finite and >= 0"),
    (dict(num_physical=3), "must be >= the 4 logical"),
    (dict(num_physical=7), "divisible by world_size=2"),
    (dict(world_size=0), "world_size=0 must be a positive int"),
    (dict(previous=np.zeros(6, dtype=np.int64)), "previous lacks logical experts"),
    (dict(previous=np.arange(5)), r"previous must be an int \[num_physical=6\]"),
    (dict(previous=np.array([0, 1, 2, 3, 4, 0])), r"outside \[0, 4\)"),
])
def test_bad_arguments(kwargs, match):
    args = dict(load=np.ones(4), num_physical=6, world_size=2) | kwargs
    load = args.pop("load")
    with pytest.raises(ValueError, match=match):
        rebalance(load, **args)


def test_baseline_bad_groups():
    with pytest.raises(ValueError, match="num_groups=3 must divide the 4 logical"):
        rebalance_hierarchical(np.ones(4), num_physical=4, world_size=2, num_groups=3)
