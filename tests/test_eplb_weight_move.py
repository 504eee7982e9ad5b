"""Weight moves between placements: the plan (rounds, bounds, refusals) on the host, and the move
on 2 and 4 gloo ranks: a rebalance under load rewrites only the changed slots, leaves the layer's
outputs equal to a layer built on the new placement, and a refusal on one rank raises on all."""

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from test_eplb_layer import (
    E,
    R,
    _kernels,
    bits,
    logical_weights,
    random_placement,
    tokens,
)

from vllm_moe_fixes.distributed.collectives import CollectiveRefusal
from vllm_moe_fixes.eplb import (
    BalancedMoELayer,
    ExpertLoadStats,
    ExpertPlacement,
    expert_bytes,
    move_bytes,
    move_weights,
    physical_weights,
    plan_moves,
)
from vllm_moe_fixes.eplb.rebalance import rebalance


def _replay(old, new, rounds):
    """Apply the rounds to slot contents (logical ids), reading each round before writing it."""
    cur = old.physical_to_logical.tolist()
    for moves in rounds:
        reads = [(d, cur[s]) for s, d in moves]
        for (s, d), (_, e) in zip(moves, reads):
            assert e == new.physical_to_logical[d], (s, d)  # the source holds the new expert
        for d, e in reads:
            cur[d] = e
    return cur


@pytest.mark.parametrize("caps", [None, [1, 1], [2, None], [1, 3]])
def test_plan_reaches_the_new_placement(caps):
    old = ExpertPlacement.identity(8, 2, num_redundant=4)
    new = random_placement(2, seed=5)
    rounds = plan_moves(old, new, caps)
    assert _replay(old, new, rounds) == new.physical_to_logical.tolist()
    written = sorted(d for r in rounds for _, d in r)
    changed = old.physical_to_logical != new.physical_to_logical
    assert written == torch.nonzero(changed).flatten().tolist()
    for r in rounds:
        for rank, cap in enumerate(caps or [None, None]):
            assert cap is None or sum(d // 6 == rank for _, d in r) <= cap
    assert (len(rounds) == 1) == (caps is None)


def test_plan_prefers_local_sources():
    new = ExpertPlacement.from_physical_to_logical(torch.tensor([0, 1, 2, 3, 0, 2]), 2)
    old = ExpertPlacement.from_physical_to_logical(torch.tensor([0, 1, 0, 2, 3, 1]), 2)
    # slots 3 and 5 copy from their own rank; 2 and 4 from the other rank
    assert plan_moves(old, new) == [[(3, 2), (4, 3), (0, 4), (3, 5)]]


def test_plan_refusals():
    swap = [ExpertPlacement.from_physical_to_logical(torch.tensor(p), 1) for p in ([0, 1],
                                                                                   [1, 0])]
    assert plan_moves(*swap, [2]) == [[(1, 0), (0, 1)]]
    with pytest.raises(ValueError, match=r"no round can start within the staging bounds "
                                         r"\(experts per round and rank \[1\]\)"):
        plan_moves(*swap, [1])
    with pytest.raises(ValueError, match=r"ranks \[0\] have slots to rewrite but staging for no "
                                         r"expert"):
        plan_moves(*swap, [0])
    with pytest.raises(ValueError, match=r"differ in \(num_logical, num_physical, world_size\)"):
        plan_moves(swap[0], ExpertPlacement.identity(2, 2))


def _setup(rank, world):
    logical = logical_weights()
    old = ExpertPlacement.identity(E, world, num_redundant=R)
    stats = ExpertLoadStats(1, E, 4)
    layer = BalancedMoELayer(_kernels("ht", world, E + R), old,
                             physical_weights(logical, old, rank), rank=rank, load_stats=stats)
    return logical, old, stats, layer


def _rebalance_worker(rank, world):
    logical, old, stats, layer = _setup(rank, world)
    for step in range(3):  # skewed load: most slots on experts 5 and 6
        x, w, ids = tokens(100 * step + rank, 6, "router")
        ids[:, :2] = torch.tensor([5, 6])
        layer(x, w, ids)
        stats.step()
    new = ExpertPlacement.from_physical_to_logical(
        rebalance(stats.group_load()[0].float(), num_physical=E + R, world_size=world,
                  previous=old.physical_to_logical), world, num_logical=E)
    assert new != old and int(new.replica_count[5]) > 1
    before = [t.clone() for t in layer.weights]
    need = move_bytes(old, new, layer.weights, rank)
    report = layer.rebalance(new)
    size = expert_bytes(layer.weights)
    changed = old.local_logical_experts(rank) != new.local_logical_experts(rank)
    # Only the changed slots were written, each once; the bytes add up across the ranks.
    assert report.written_slots == int(changed.sum()) and need == report.written_slots * size
    assert report.received_bytes + report.local_bytes == need == report.peak_extra_bytes
    totals = torch.tensor([report.sent_bytes, report.received_bytes])
    dist.all_reduce(totals)
    assert totals[0] == totals[1]
    for now, was, want in zip(layer.weights, before, physical_weights(logical, new, rank)):
        assert torch.equal(bits(now), bits(want))
        assert torch.equal(bits(now)[~changed], bits(was)[~changed])
    # The moved layer gives the bits of a layer built on the new placement.
    fresh = BalancedMoELayer(_kernels("ht", world, E + R), new,
                             physical_weights(logical, new, rank), rank=rank)
    x, w, ids = tokens(7 + rank, 9, "zeros")
    assert torch.equal(layer(x, w, ids), fresh(x, w, ids))
    # Bounded: one expert of staging per rank and round gives the same weights, in more rounds.
    back = move_weights(new, old, layer.weights, max_bytes=size)
    assert back.rounds > 1 and back.peak_extra_bytes <= size
    for now, want in zip(layer.weights, physical_weights(logical, old, rank)):
        assert torch.equal(bits(now), bits(want))


@pytest.mark.parametrize("world", [2, 4])
def test_rebalance_under_load_moves_only_changed_experts(world):
    run_distributed(_rebalance_worker, world)


def _refusal_worker(rank, world):
    logical, old, _, layer = _setup(rank, world)
    new = random_placement(world, seed=3)
    before = [t.clone() for t in layer.weights]
    weights = layer.weights
    if rank == 1:  # this rank's stacks lack a slot
        layer.weights = type(weights)(*(t[1:] for t in weights))
    with pytest.raises(CollectiveRefusal, match="rank 1 refused the weight move: w1 must be a "
                                                "contiguous") as info:
        layer.rebalance(new)
    assert info.value.rank == 1
    layer.weights = weights
    assert layer.placement is old
    for now, was in zip(layer.weights, before):
        assert torch.equal(bits(now), bits(was))
    # A bound one rank cannot meet (no staging at all) refuses everywhere, too.
    with pytest.raises(CollectiveRefusal, match=r"ranks \[1\] have slots to rewrite"):
        move_weights(old, new, layer.weights, max_bytes=0 if rank == 1 else None)
    for now, was in zip(layer.weights, before):
        assert torch.equal(bits(now), bits(was))


@pytest.mark.parametrize("world", [2, 4])
def test_refusal_on_one_rank_raises_on_all(world):
    run_distributed(_refusal_worker, world)


def test_bad_max_bytes():
    old = ExpertPlacement.identity(E, 1, num_redundant=R)
    weights = physical_weights(logical_weights(), old, 0)
    with pytest.raises(ValueError, match="max_bytes=-1 must be None or an int >= 0"):
        move_weights(old, random_placement(1), weights, max_bytes=-1)
