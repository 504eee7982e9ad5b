"""Rebalancing: place E logical experts on ``num_physical`` slots of ``world_size`` ranks so that
the busiest rank's load is as small as possible.

A placement is ``physical_to_logical`` int64 [num_physical]: physical expert p holds logical
expert ``physical_to_logical[p]`` and lives on rank ``p // (num_physical // world_size)``; every
logical expert appears at least once. Routing splits a logical expert's token-slots evenly over
its replicas, so a replica of expert e carries ``load[e] / replicas[e]`` and a rank's load is the
sum over its slots (``rank_loads``). The mean rank load is ``load.sum() / world_size`` whatever
the placement; max/mean is the figure both planners are judged on.

Two planners, both plain numpy on the host (a planner, not a kernel):

``rebalance_hierarchical`` is the published baseline (DeepSeek's EPLB): pack the expert groups
onto nodes (equal group counts per node, heaviest group first onto the lightest node), replicate
within each node (each extra slot to the expert with the highest load per replica), then pack each
node's physical experts onto its GPUs (equal slot counts, heaviest first onto the lightest GPU).
When the groups do not divide over the nodes it runs globally (one node, one group).

``rebalance`` is ours. It differs in three places:
  * Replica counts are searched, not fixed. Greedy replication by load per replica minimises the
    largest replica, but with equal slot counts per rank a replica too many can hurt: eight hot
    experts with 72 replicas over 64 ranks put two replicas on eight ranks (max/mean 16/9), while
    64 replicas (8 each) and 8 cold duplicates give every rank one (max/mean 1). So for each
    number r of redundant slots given to loaded experts (the rest duplicate the least loaded
    experts, load 0 where cold), it replicates greedily and packs; r runs down from R and stops
    once the largest replica alone exceeds the best max found. A smaller r is taken only where
    it lowers the max by more than ``SEARCH_MARGIN`` of the mean rank load: the plan meets
    traffic it was not made from, and fewer replicas of the hot experts, balanced to the last
    token on past counts, fare worse on the next counts (in ``simulate``'s shift scenario at
    EP 8 without the margin, 1.05-1.08 against 1.02-1.03 with it).
  * Packing: longest processing time with equal slot counts (as the baseline), then pairwise
    swaps: while swapping a physical expert of the busiest rank with one of another rank lowers
    the larger of the two ranks' loads below the busiest's, make the best such swap.
  * ``previous``: the slots that can stay do. The planner also packs starting from the previous
    placement's kept replicas; that packing wins when its max is no higher. Either way the packed
    ranks are matched to the physical ranks by overlap with ``previous`` and each rank's slots
    are ordered to keep an expert in the slot it held.

Ties are broken by index everywhere (stable sorts, lowest index first): equal inputs give equal
placements on every rank. The planning itself is numpy only; it returns numpy int64 arrays;
loads and placements may be numpy arrays, lists or CPU/GPU torch tensors.
"""

from __future__ import annotations

import numpy as np

from vllm_moe_fixes._validate import check, check_positive_int

__all__ = ["count_moves", "rank_loads", "rebalance", "rebalance_hierarchical",
           "replica_counts"]

# Relative margin below which a swap does not count as lowering a load (float noise).
_REL_TOL = 1e-12
# Fraction of the mean rank load that fewer useful replicas must save to be preferred.
SEARCH_MARGIN = 0.01


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------
def _host(values):
    """A torch tensor as a host numpy array (duck-typed: no torch import); others unchanged."""
    return values.detach().cpu().numpy() if hasattr(values, "detach") else values


def _as_load(load) -> np.ndarray:
    """The load as float64 [E]; ValueError unless it is 1-D, non-empty, finite and >= 0."""
    load = _host(load)
    arr = np.asarray(load, dtype=np.float64)
    check(arr.ndim == 1 and arr.size >= 1,
          f"load must be a non-empty 1-D [num_logical] array, got shape {tuple(arr.shape)}")
    check(bool(np.isfinite(arr).all()) and bool((arr >= 0).all()),
          f"load must be finite and >= 0, got min {arr.min()!r}, max {arr.max()!r}")
    return arr


def _check_layout(num_logical: int, num_physical, world_size) -> int:
    """Validate the slot counts; return the slots per rank."""
    check_positive_int("num_physical", num_physical)
    check_positive_int("world_size", world_size)
    check(num_physical >= num_logical,
          f"num_physical={num_physical} must be >= the {num_logical} logical experts")
    check(num_physical % world_size == 0,
          f"num_physical={num_physical} must be divisible by world_size={world_size} "
          f"(equal physical experts per rank)")
    return num_physical // world_size


def _as_placement(name: str, phys_to_log, num_logical: int, num_physical: int) -> np.ndarray:
    """A placement as int64 [num_physical]; ValueError unless it names every logical expert."""
    phys_to_log = _host(phys_to_log)
    arr = np.asarray(phys_to_log)
    check(arr.shape == (num_physical,) and np.issubdtype(arr.dtype, np.integer),
          f"{name} must be an int [num_physical={num_physical}] array, got "
          f"{arr.dtype} {tuple(arr.shape)}")
    arr = arr.astype(np.int64)
    check(bool(((arr >= 0) & (arr < num_logical)).all()),
          f"{name} holds ids outside [0, {num_logical})")
    missing = np.setdiff1d(np.arange(num_logical), arr)
    check(missing.size == 0, f"{name} lacks logical experts {missing[:8].tolist()}")
    return arr


# ----------------------------------------------------------------------------------------------
# The load model
# ----------------------------------------------------------------------------------------------
def rank_loads(load, physical_to_logical, world_size: int) -> np.ndarray:
    """Each rank's load float64 [world_size] under ``physical_to_logical`` (int [num_physical]):
    a logical expert's ``load`` (float [num_logical]) split evenly over its replicas."""
    w = _as_load(load)
    p2l = _as_placement("physical_to_logical", physical_to_logical, w.size,
                        len(physical_to_logical))
    slots = _check_layout(w.size, p2l.size, world_size)
    replicas = np.bincount(p2l, minlength=w.size)
    return (w[p2l] / replicas[p2l]).reshape(world_size, slots).sum(1)


def count_moves(previous, physical_to_logical) -> int:
    """Physical slots whose logical expert changes (each is one expert's weights to copy)."""
    a, b = np.asarray(_host(previous)), np.asarray(_host(physical_to_logical))
    check(a.shape == b.shape, f"previous {a.shape} and physical_to_logical {b.shape} differ")
    return int((a != b).sum())


# ----------------------------------------------------------------------------------------------
# Steps shared by both planners
# ----------------------------------------------------------------------------------------------
def replica_counts(load, num_physical: int) -> np.ndarray:
    """Replicas per logical expert int64 [E] (sum num_physical, each >= 1): every extra slot goes
    to the expert of highest load per replica (lowest index on ties). With no load at all the
    extra slots go round-robin (fewest replicas, then lowest index)."""
    w = _as_load(load)
    check_positive_int("num_physical", num_physical)
    check(num_physical >= w.size, f"num_physical={num_physical} must be >= {w.size} experts")
    counts = np.ones(w.size, dtype=np.int64)
    for _ in range(num_physical - w.size):
        # lexsort's last key is primary: highest load per replica, then fewest replicas, index.
        counts[np.lexsort((np.arange(w.size), counts, -(w / counts)))[0]] += 1
    return counts


def _replicas(counts: np.ndarray) -> np.ndarray:
    """Logical id of each replica int64 [sum(counts)], in logical order."""
    return np.repeat(np.arange(counts.size), counts)


def _pack(weights: np.ndarray, bins: int, start: np.ndarray | None = None) -> np.ndarray:
    """Longest processing time with equal counts: item i (heaviest first, index on ties) goes to
    the lightest bin with a free place (lowest index on ties). ``start`` (int [n], -1 = free)
    pins items to bins first. Returns the bin of each item, int64 [n]."""
    n = weights.size
    cap = n // bins
    where = np.full(n, -1, dtype=np.int64) if start is None else start.copy()
    fill = np.bincount(where[where >= 0], minlength=bins)
    # float64 even when nothing is pinned (bincount of no items returns int64 zeros)
    total = np.bincount(where[where >= 0], weights[where >= 0], minlength=bins).astype(np.float64)
    for i in np.argsort(-weights, kind="stable"):
        if where[i] >= 0:
            continue
        b = int(np.argmin(np.where(fill < cap, total, np.inf)))
        where[i], fill[b], total[b] = b, fill[b] + 1, total[b] + weights[i]
    return where


def _refine(weights: np.ndarray, where: np.ndarray, bins: int) -> np.ndarray:
    """Pairwise swaps: while exchanging an item of the busiest bin with an item elsewhere lowers
    the larger of the two bins' loads below the busiest's, make the swap that lowers it most."""
    where = where.copy()
    total = np.bincount(where, weights, minlength=bins)
    tol = _REL_TOL * max(float(total.max()), 1.0)
    for _ in range(4 * weights.size):
        top = int(np.argmax(total))
        mine, other = np.flatnonzero(where == top), np.flatnonzero(where != top)
        if other.size == 0:
            break
        delta = weights[mine][:, None] - weights[other][None, :]  # [mine, other]
        pair = np.maximum(total[top] - delta, total[where[other]][None, :] + delta)
        best = int(np.argmin(pair))
        if pair.flat[best] >= total[top] - tol:
            break
        a, b = mine[best // other.size], other[best % other.size]
        total[top] -= delta.flat[best]
        total[where[b]] += delta.flat[best]
        where[a], where[b] = where[b], top
    return where


def _slots(logical: np.ndarray, where: np.ndarray) -> np.ndarray:
    """physical_to_logical [n] from each replica's logical id and bin: bin b's replicas fill its
    slots in logical order."""
    order = np.lexsort((logical, where))
    return logical[order]


def _check_planner(load, num_physical, world_size) -> tuple[np.ndarray, int]:
    w = _as_load(load)
    return w, _check_layout(w.size, num_physical, world_size)


# ----------------------------------------------------------------------------------------------
# The baseline: DeepSeek's hierarchical EPLB
# ----------------------------------------------------------------------------------------------
def rebalance_hierarchical(load, *, num_physical: int, world_size: int, num_groups: int = 1,
                           num_nodes: int = 1) -> np.ndarray:
    """DeepSeek's hierarchical EPLB (the baseline): physical_to_logical int64 [num_physical].

    Arguments:
        load: float [num_logical] (>= 0), token-slots per logical expert.
        num_physical: slots in all (>= num_logical, divisible by world_size).
        world_size: ranks (GPUs); num_nodes of them per node in equal numbers.
        num_groups: expert groups (contiguous, equal; must divide num_logical); when they do not
            divide over num_nodes (or num_nodes does not divide world_size), the global variant
            runs: one node, one group.
    """
    w, _ = _check_planner(load, num_physical, world_size)
    check_positive_int("num_groups", num_groups)
    check_positive_int("num_nodes", num_nodes)
    check(w.size % num_groups == 0,
          f"num_groups={num_groups} must divide the {w.size} logical experts")
    if num_groups % num_nodes or world_size % num_nodes or num_physical % num_nodes:
        num_groups, num_nodes = 1, 1
    group_size = w.size // num_groups
    node_of_group = _pack(w.reshape(num_groups, group_size).sum(1), num_nodes)
    placement = []
    for node in range(num_nodes):
        experts = np.concatenate([np.arange(g * group_size, (g + 1) * group_size)
                                  for g in np.flatnonzero(node_of_group == node)])
        counts = replica_counts(w[experts], num_physical // num_nodes)
        logical = experts[_replicas(counts)]
        gpu = _pack(w[logical] / counts[_replicas(counts)], world_size // num_nodes)
        placement.append(_slots(logical, gpu))
    return np.concatenate(placement)


# ----------------------------------------------------------------------------------------------
# Ours
# ----------------------------------------------------------------------------------------------
def _counts_for(w: np.ndarray, num_physical: int, useful: int) -> np.ndarray:
    """Replica counts with ``useful`` extra slots replicating by load per replica and the rest
    duplicating the least loaded experts (load 0 when cold: fillers that cost no load)."""
    counts = replica_counts(w, w.size + useful)
    order = np.lexsort((np.arange(w.size), w))  # least loaded first, lowest index on ties
    spare = num_physical - w.size - useful
    np.add.at(counts, order[np.arange(spare) % w.size], 1)
    return counts


def _packed(w: np.ndarray, counts: np.ndarray, world_size: int,
            start: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """(logical id [n], rank [n], max rank load) of ``counts``' replicas packed and refined."""
    logical = _replicas(counts)
    weights = w[logical] / counts[logical]
    where = _refine(weights, _pack(weights, world_size, start), world_size)
    return logical, where, float(np.bincount(where, weights, minlength=world_size).max())


def _search_counts(w: np.ndarray, num_physical: int, world_size: int) -> tuple:
    """The best packing over the number of useful redundant slots (module docstring)."""
    redundant = num_physical - w.size
    margin = SEARCH_MARGIN * w.sum() / world_size
    best = None
    for useful in range(redundant, -1, -1):
        counts = _counts_for(w, num_physical, useful)
        loaded = counts[w > 0]
        if best is not None and loaded.size and (w[w > 0] / loaded).max() > best[2][2]:
            break  # fewer useful replicas only make the largest replica larger
        result = _packed(w, counts, world_size)
        if best is None or result[2] < best[2][2] - margin:
            best = (useful, counts, result)
    return best[1], best[2]


def _kept(previous: np.ndarray, counts: np.ndarray, slots: int) -> np.ndarray:
    """Each replica's rank pinned from ``previous`` (-1 = free): expert e keeps the first
    min(counts[e], previous replicas) of its previous slots."""
    logical = _replicas(counts)
    start = np.full(logical.size, -1, dtype=np.int64)
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    for e in range(counts.size):
        ranks = np.flatnonzero(previous == e)[:counts[e]] // slots
        start[first[e]:first[e] + ranks.size] = ranks
    return start


def _match_ranks(previous: np.ndarray, logical: np.ndarray, where: np.ndarray, world_size: int,
                 slots: int) -> np.ndarray:
    """Relabel the packed bins as ranks (bins are interchangeable): greedily, the bin and rank
    sharing the most experts first (lowest indices on ties)."""
    num_logical = int(max(previous.max(), logical.max())) + 1
    have = np.zeros((world_size, num_logical), dtype=np.int64)
    np.add.at(have, (np.arange(previous.size) // slots, previous), 1)
    want = np.zeros((world_size, num_logical), dtype=np.int64)
    np.add.at(want, (where, logical), 1)
    overlap = np.minimum(want[:, None, :], have[None, :, :]).sum(-1)  # [bin, rank]
    rank_of = np.full(world_size, -1, dtype=np.int64)
    taken = np.zeros(world_size, dtype=bool)
    for flat in np.argsort(-overlap, axis=None, kind="stable"):
        b, r = divmod(int(flat), world_size)
        if rank_of[b] < 0 and not taken[r]:
            rank_of[b], taken[r] = r, True
    return rank_of[where]


def _align_slots(previous: np.ndarray, logical: np.ndarray, rank: np.ndarray,
                 slots: int) -> np.ndarray:
    """physical_to_logical with each rank's experts in the slots they held in ``previous`` where
    they were on that rank already, the rest in the rank's remaining slots in logical order."""
    out = np.full(previous.size, -1, dtype=np.int64)
    for r in range(previous.size // slots):
        mine = sorted(logical[rank == r].tolist())
        held = previous[r * slots:(r + 1) * slots]
        rest = []
        for e in mine:
            free = np.flatnonzero((held == e) & (out[r * slots:(r + 1) * slots] < 0))
            if free.size:
                out[r * slots + free[0]] = e
            else:
                rest.append(e)
        out[r * slots + np.flatnonzero(out[r * slots:(r + 1) * slots] < 0)] = rest
    return out


def rebalance(load, *, num_physical: int, world_size: int, previous=None) -> np.ndarray:
    """Our planner (module docstring): physical_to_logical int64 [num_physical].

    Arguments:
        load: float [num_logical] (>= 0), token-slots per logical expert.
        num_physical: slots in all (>= num_logical, divisible by world_size).
        world_size: ranks.
        previous: optional int [num_physical], the placement in force: slots keep their expert
            where that costs no max load (fewer weight moves, ``count_moves``).
    """
    w, slots = _check_planner(load, num_physical, world_size)
    counts, (logical, where, top) = _search_counts(w, num_physical, world_size)
    if previous is None:
        return _slots(logical, where)
    prev = _as_placement("previous", previous, w.size, num_physical)
    sticky = _packed(w, counts, world_size, start=_kept(prev, counts, slots))
    if sticky[2] <= top * (1 + _REL_TOL):
        logical, where, _ = sticky
    rank = _match_ranks(prev, logical, where, world_size, slots)
    return _align_slots(prev, logical, rank, slots)
