"""Moving a layer's physical expert weights from one placement to another over the EP group.

Only the slots whose logical expert changes are written. Each is filled from a current holder of
its new expert: a slot of the same rank when there is one (a local copy), else the rank that
sends least in that round. A move runs in rounds; in each, every rank

    reads its sources (sends of slices of the live weights, local copies into staging)
    receives into staging  [arrivals this round, ...] per weight stack   (its extra memory)
    then writes the staging into its slots

so a round reads only what was there before it. A rank's staging holds at most
``max_bytes // expert_bytes`` experts; the planner (``plan_moves``) keeps, after each round,
a copy of every expert that a later round still reads, and refuses when no round can make
progress within the bounds (a cycle of moves larger than a rank's staging).

Safety: every rank checks its arguments, plans and allocates its staging before anything moves;
a refusal or failure there on any rank is raised on every rank as CollectiveRefusal (the verdict
all-reduce of ``distributed.collectives``), and no weight has been written. gloo does not carry
float8: those stacks travel as uint8 views (no copy).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from vllm_moe_fixes._validate import check, check_nonnegative_int
from vllm_moe_fixes.distributed.collectives import (
    CollectiveRefusal,
    encode_verdict,
    raise_verdict,
    run_collective,
)
from vllm_moe_fixes.eplb.placement import ExpertPlacement
from vllm_moe_fixes.fused_moe.interfaces import Fp8MoEWeights

__all__ = ["MoveReport", "expert_bytes", "move_bytes", "move_weights", "plan_moves"]

Move = tuple[int, int]  # (source physical slot, destination physical slot)


class MoveReport(NamedTuple):
    """What one rank did in a move."""

    rounds: int            # rounds of the whole group's move
    written_slots: int     # this rank's slots that changed expert
    sent_bytes: int        # to other ranks
    received_bytes: int    # from other ranks
    local_bytes: int       # copied between this rank's own slots
    peak_extra_bytes: int  # the staging this rank allocated


def expert_bytes(weights: Fp8MoEWeights) -> int:
    """Bytes of one expert over the four stacks (w1, w1_scale, w2, w2_scale)."""
    return sum(t[0].numel() * t.element_size() for t in weights)


def _check_same_sizes(old: ExpertPlacement, new: ExpertPlacement) -> None:
    check(isinstance(old, ExpertPlacement) and isinstance(new, ExpertPlacement),
          f"old and new must be ExpertPlacements, got {type(old).__name__}, "
          f"{type(new).__name__}")
    a, b = ((p.num_logical, p.num_physical, p.world_size) for p in (old, new))
    check(a == b, f"old and new placements differ in (num_logical, num_physical, world_size): "
                  f"{a} vs {b}")


# ----------------------------------------------------------------------------------------------
# The plan (host, the same on every rank)
# ----------------------------------------------------------------------------------------------
def _take_round(pending: list[int], caps: list[int | None], num_local: int) -> list[int]:
    """The pending destinations that fit each rank's staging, in slot order."""
    taken, used = [], [0] * len(caps)
    for d in pending:
        r = d // num_local
        if caps[r] is None or used[r] < caps[r]:
            taken.append(d)
            used[r] += 1
    return taken


def _keep_needed_copies(taken: list[int], pending: list[int], cur: list[int],
                        target: list[int]) -> list[int]:
    """taken without the writes that would overwrite the last copy of an expert that a move
    left for later rounds still reads."""
    while True:
        written = set(taken)
        after = {e for s, e in enumerate(cur) if s not in written} | {target[d] for d in taken}
        lost = {target[d] for d in pending if d not in written} - after
        if not lost:
            return taken
        taken = [d for d in taken if cur[d] not in lost]


def _take_safe(pending: list[int], caps: list[int | None], num_local: int, cur: list[int],
               target: list[int]) -> list[int]:
    """Destinations that fit each rank's staging and whose write leaves a copy of what they
    hold for every move not taken (taken in slot order)."""
    holders = {e: cur.count(e) for e in set(cur)}
    needs: dict[int, int] = {}
    for d in pending:
        needs[target[d]] = needs.get(target[d], 0) + 1
    taken, used = [], [0] * len(caps)
    for d in pending:
        r, held = d // num_local, cur[d]
        if caps[r] is not None and used[r] >= caps[r]:
            continue
        if holders[held] > 1 or not needs.get(held, 0):
            taken.append(d)
            used[r] += 1
            holders[held] -= 1
            needs[target[d]] -= 1
    return taken


def _sources(taken: list[int], cur: list[int], target: list[int], num_local: int) -> list[Move]:
    """A source for each destination: a current holder on the same rank, else on the rank that
    sends least so far this round (lowest slot on ties)."""
    holders: dict[int, list[int]] = {}
    for s, e in enumerate(cur):
        holders.setdefault(e, []).append(s)
    sends: dict[int, int] = {}
    moves = []
    for d in taken:
        s = min(holders[target[d]], key=lambda s: (s // num_local != d // num_local,
                                                     sends.get(s // num_local, 0), s))
        if s // num_local != d // num_local:
            sends[s // num_local] = sends.get(s // num_local, 0) + 1
        moves.append((s, d))
    return moves


def plan_moves(old: ExpertPlacement, new: ExpertPlacement,
               caps: list[int | None] | None = None) -> list[list[Move]]:
    """The rounds of the move from `old` to `new`: lists of (source slot, destination slot),
    destinations in increasing order. caps[r]: the most experts rank r receives in one round
    (None: unbounded; caps None: every rank unbounded, one round). ValueError when a rank with
    slots to write has cap 0, or when the moves left form a cycle no round can start."""
    _check_same_sizes(old, new)
    L, world = old.num_local, old.world_size
    caps = [None] * world if caps is None else list(caps)
    check(len(caps) == world, f"caps has {len(caps)} entries, world_size is {world}")
    cur, target = old.physical_to_logical.tolist(), new.physical_to_logical.tolist()
    pending = [d for d in range(len(cur)) if cur[d] != target[d]]
    starved = sorted({d // L for d in pending if caps[d // L] is not None and caps[d // L] < 1})
    check(not starved, f"ranks {starved} have slots to rewrite but staging for no expert "
                       f"(max_bytes below one expert's bytes)")
    rounds = []
    while pending:
        # Two ways to fill a round, the larger wins: everything that fits, less the writes that
        # would lose a copy still needed (takes whole cycles); or writes that lose nothing.
        taken = max(_keep_needed_copies(_take_round(pending, caps, L), pending, cur, target),
                    _take_safe(pending, caps, L, cur, target), key=len)
        check(bool(taken),
              f"no round can start within the staging bounds (experts per round and rank "
              f"{caps}): each of the {len(pending)} moves left would overwrite the last copy of "
              f"an expert another of them still reads; raise max_bytes")
        rounds.append(_sources(taken, cur, target, L))
        for d in taken:
            cur[d] = target[d]
        done = set(taken)
        pending = [d for d in pending if d not in done]
    return rounds


def move_bytes(old: ExpertPlacement, new: ExpertPlacement, weights: Fp8MoEWeights,
               rank: int) -> int:
    """The staging `rank` allocates to move from `old` to `new` in one round (no max_bytes):
    one expert's bytes for each of its slots that changes expert. With max_bytes the staging is
    at most max_bytes (rounded down to whole experts)."""
    _check_same_sizes(old, new)
    slots = old.local_physical_experts(rank)
    changed = int((old.physical_to_logical[slots] != new.physical_to_logical[slots]).sum())
    return changed * expert_bytes(weights)


# ----------------------------------------------------------------------------------------------
# Agreement across the ranks
# ----------------------------------------------------------------------------------------------
def _agree(refusal: Exception | None, group, rank: int, world: int, device) -> None:
    """Raise CollectiveRefusal on every rank when any rank refused (naming the lowest one and
    its error); return on every rank when none did. One all-reduce; on a refusal, one more
    exchange carries the refusing rank's words to its peers."""
    if world == 1:
        if refusal is not None:
            raise refusal
        return
    verdict = torch.tensor([encode_verdict(rank, world, refusal)], dtype=torch.int64,
                           device=device)
    run_collective(dist.all_reduce, verdict, op=dist.ReduceOp.MAX, group=group)
    try:
        raise_verdict(int(verdict.item()), rank, world, refusal)
    except CollectiveRefusal as agreed:
        words = [None] * world
        dist.all_gather_object(words, None if refusal is None else str(refusal), group=group)
        reason = words[agreed.rank]
        raise CollectiveRefusal(
            f"rank {agreed.rank} refused the weight move: {reason} (raised on every rank of the "
            "group; no weight was written, the old placement stands)",
            rank=agreed.rank, reason=reason) from refusal


def _gather_caps(cap: int | None, group, world: int, device) -> list[int | None]:
    """Every rank's cap (-1 travels for None)."""
    if world == 1:
        return [cap]
    mine = torch.tensor([-1 if cap is None else cap], dtype=torch.int64, device=device)
    caps = [torch.empty_like(mine) for _ in range(world)]
    run_collective(dist.all_gather, caps, mine, group=group)
    return [None if c < 0 else c for c in torch.cat(caps).tolist()]


# ----------------------------------------------------------------------------------------------
# The move
# ----------------------------------------------------------------------------------------------
def _check_move(old, new, weights: Fp8MoEWeights, world: int,
                max_bytes: int | None) -> int | None:
    """Check the arguments; return this rank's cap (experts per round) or None."""
    _check_same_sizes(old, new)
    check(old.world_size == world,
          f"the placements span {old.world_size} ranks, the group has {world}")
    for name, t in zip(Fp8MoEWeights._fields, weights):
        check(t.shape[0] == old.num_local and t.is_contiguous(),
              f"{name} must be a contiguous [num_local={old.num_local}, ...] stack, got shape "
              f"{tuple(t.shape)}")
    check_nonnegative_int("max_bytes", max_bytes, or_none=True)
    return None if max_bytes is None else max_bytes // expert_bytes(weights)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """t as the collectives carry it: float8 as uint8 (a view; gloo has no float8)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def _run_round(moves: list[Move], weights: Fp8MoEWeights, staging: list[torch.Tensor],
               rank: int, num_local: int, group) -> tuple[int, int, int]:
    """One round on this rank: sends, receives and local copies into staging, then the writes.
    Returns (sent, received, local) bytes."""
    ops, writes, sent, received, local = [], [], 0, 0, 0
    size = expert_bytes(weights)
    for s, d in moves:
        src, dst = divmod(s, num_local), divmod(d, num_local)
        if dst[0] == rank:
            slot = len(writes)
            writes.append((slot, dst[1]))
            if src[0] == rank:
                for buf, t in zip(staging, weights):
                    buf[slot].copy_(t[src[1]])
                local += size
                continue
            received += size
            ops += [dist.P2POp(dist.irecv, _wire(buf[slot]), group=group,
                               group_peer=src[0], tag=4 * d + i)
                    for i, buf in enumerate(staging)]
        elif src[0] == rank:
            sent += size
            ops += [dist.P2POp(dist.isend, _wire(t[src[1]]), group=group, group_peer=dst[0],
                               tag=4 * d + i) for i, t in enumerate(weights)]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for slot, local_slot in writes:
        for buf, t in zip(staging, weights):
            t[local_slot].copy_(buf[slot])
    return sent, received, local


def _rank_and_size(group) -> tuple[int, int]:
    """(this rank, rank count) of group; (0, 1) without torch.distributed."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def move_weights(old: ExpertPlacement, new: ExpertPlacement, weights: Fp8MoEWeights, *,
                 group: dist.ProcessGroup | None = None,
                 max_bytes: int | None = None) -> MoveReport:
    """Rewrite this rank's physical expert weights from `old`'s placement to `new`'s, in place.

    Arguments:
        old, new: ExpertPlacements of the same sizes, the same on every rank.
        weights: this rank's stacks (w1 float8_e4m3fn `[num_local, 2I, K]`, w1_scale float32,
            w2 float8_e4m3fn `[num_local, K, I]`, w2_scale float32), contiguous; written in place.
        group: the expert-parallel group (every rank calls this); None: the default group, or
            one process when torch.distributed is not initialised.
        max_bytes: this rank's staging bound (``move_bytes`` gives the unbounded need); the move
            runs in as many rounds as the bounds of all ranks need. None: one round.

    Returns this rank's MoveReport. Raises CollectiveRefusal (a ValueError) on every rank when
    any rank refuses (bad arguments, a bound no round fits, staging it cannot allocate), before
    any weight is written; on one process, the refusal itself.
    """
    weights = Fp8MoEWeights(*weights)
    rank, world = _rank_and_size(group)
    device = weights.w1.device
    cap, refusal = None, None
    try:
        cap = _check_move(old, new, weights, world, max_bytes)
    except ValueError as err:
        refusal = err
    caps = _gather_caps(cap, group, world, device)
    _agree(refusal, group, rank, world, device)
    rounds, staging = [], []
    try:
        rounds = plan_moves(old, new, caps)
        arrivals = max((sum(d // old.num_local == rank for _, d in r) for r in rounds), default=0)
        staging = [torch.empty((arrivals, *t.shape[1:]), dtype=t.dtype, device=device)
                   for t in weights]
    except (ValueError, RuntimeError) as err:  # RuntimeError: torch's out-of-memory among them
        refusal = err
    _agree(refusal, group, rank, world, device)
    totals = [0, 0, 0]
    for moves in rounds:
        totals = [a + b for a, b in zip(totals, _run_round(moves, weights, staging, rank,
                                                           old.num_local, group))]
    written = sum(d // old.num_local == rank for r in rounds for _, d in r)
    return MoveReport(rounds=len(rounds), written_slots=written, sent_bytes=totals[0],
                      received_bytes=totals[1], local_bytes=totals[2],
                      peak_extra_bytes=sum(t.numel() * t.element_size() for t in staging))
