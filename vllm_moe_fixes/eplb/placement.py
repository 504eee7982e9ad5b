"""Expert placement with redundant experts, and routing of logical ids to replicas.

A placement puts E logical experts on ``num_physical = E + R`` physical slots (R redundant),
``num_physical / world_size`` slots per rank::

    physical id p:      0   1   2   3 | 4   5   6   7      (world_size 2, E 6, R 2)
    rank p // 4:        ---rank 0---- | ---rank 1----
    physical_to_logical 0   1   2   3 | 4   5   0   3      (experts 0 and 3 have 2 replicas)
    logical_to_physical [[0, 6], [1, -1], [2, -1], [3, 7], [4, -1], [5, -1]]

A layer runs with ``global_num_experts = num_physical``: its ids are physical ids, and a rank's
weights are those of its physical experts (each a copy of its logical expert's weights). Routing
(``route``) maps each (token, slot) logical id to one replica, so every prepare/finalize and
experts class runs unchanged.

Spread: the k-th occurrence (in row-major order of ``topk_ids``) of logical expert e goes to its
replica ``(k + e) % replica_count[e]``. Every replica of e then receives ``floor`` or ``ceil`` of
e's count over its replicas, whatever the ids (all-zero ids included), and the ``+ e`` rotation
keeps the replicas that get the ``ceil`` from all being the first ones. It is a function of the
ids alone: the same ids give the same physical ids on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_moe_fixes._validate import check, check_nonnegative_int, check_positive_int

__all__ = ["ExpertPlacement", "route_ids", "route_reference"]


def _as_physical_to_logical(physical_to_logical) -> torch.Tensor:
    """The placement as a CPU int64 [num_physical] tensor; ValueError unless 1-D integer."""
    t = torch.as_tensor(physical_to_logical)
    check(t.dim() == 1 and t.numel() >= 1,
          f"physical_to_logical must be a non-empty 1-D [num_physical] tensor, got shape "
          f"{tuple(t.shape)}")
    check(not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool,
          f"physical_to_logical must hold integers, got {t.dtype}")
    return t.detach().to(device="cpu", dtype=torch.int64).clone()


def _check_names_every_expert(p2l: torch.Tensor, num_logical: int) -> None:
    """ValueError unless p2l holds only ids in [0, num_logical) and each of them at least once."""
    lo, hi = int(p2l.min()), int(p2l.max())
    check(lo >= 0 and hi < num_logical,
          f"physical_to_logical holds ids in [{lo}, {hi}], outside [0, {num_logical})")
    missing = torch.nonzero(torch.bincount(p2l, minlength=num_logical) == 0).flatten()
    check(missing.numel() == 0,
          f"physical_to_logical lacks logical experts {missing[:8].tolist()} (every logical "
          f"expert 0..{num_logical - 1} needs at least one replica)")


def _logical_to_physical(p2l: torch.Tensor, num_logical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logical_to_physical int64 [E, max_replicas] padded with -1, replica_count int64 [E]);
    each row lists its physical ids in increasing order."""
    counts = torch.bincount(p2l, minlength=num_logical)
    sorted_logical, physical = torch.sort(p2l, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    column = torch.arange(p2l.numel()) - starts[sorted_logical]
    table = torch.full((num_logical, int(counts.max())), -1, dtype=torch.int64)
    table[sorted_logical, column] = physical
    return table, counts


def _occurrence(flat_ids: torch.Tensor, num_bins: int) -> torch.Tensor:
    """For each element of flat_ids (int64 [n], values in [0, num_bins)), how many equal
    elements precede it: int64 [n]. A stable sort groups equal ids in their original order."""
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    counts = torch.zeros(num_bins, dtype=torch.int64, device=flat_ids.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    starts = torch.cumsum(counts, 0) - counts
    rank_in_group = torch.arange(flat_ids.numel(), device=flat_ids.device) - starts[sorted_ids]
    return torch.empty_like(flat_ids).scatter_(0, order, rank_in_group)


@dataclass(frozen=True, eq=False)
class ExpertPlacement:
    """Where each logical expert's replicas live. Build with ``from_physical_to_logical`` or
    ``identity``; ``to(device)`` gives the same placement with its tables on a device (``route``
    needs them on the ids' device).

    Fields:
        physical_to_logical: `[num_physical]` with `torch.int64`, the logical expert of each slot.
        logical_to_physical: `[num_logical, max_replicas]` with `torch.int64`, each logical
            expert's physical ids in increasing order, padded with -1.
        replica_count: `[num_logical]` with `torch.int64`, replicas per logical expert (>= 1).
        world_size: ranks; rank r holds physical experts r * num_local .. (r + 1) * num_local - 1.
    """

    physical_to_logical: torch.Tensor
    logical_to_physical: torch.Tensor
    replica_count: torch.Tensor
    world_size: int

    @classmethod
    def from_physical_to_logical(cls, physical_to_logical, world_size: int, *,
                                 num_logical: int | None = None) -> "ExpertPlacement":
        """The placement of `physical_to_logical` (int [num_physical], each logical expert
        0..E-1 at least once; E is ``num_logical`` when given, else max + 1) over
        `world_size` ranks (num_physical divisible by world_size)."""
        check_positive_int("world_size", world_size)
        p2l = _as_physical_to_logical(physical_to_logical)
        if num_logical is None:
            num_logical = int(p2l.max()) + 1
        check_positive_int("num_logical", num_logical)
        check(p2l.numel() % world_size == 0,
              f"num_physical={p2l.numel()} must be divisible by world_size={world_size} "
              f"(equal physical experts per rank)")
        _check_names_every_expert(p2l, num_logical)
        table, counts = _logical_to_physical(p2l, num_logical)
        return cls(physical_to_logical=p2l, logical_to_physical=table, replica_count=counts,
                   world_size=world_size)

    @classmethod
    def identity(cls, num_experts: int, world_size: int,
                 num_redundant: int = 0) -> "ExpertPlacement":
        """Logical expert e in slot e; the redundant slots E..E+R-1 hold experts 0, 1, ...
        round-robin (slot E + i holds expert i % E)."""
        check_positive_int("num_experts", num_experts)
        check_nonnegative_int("num_redundant", num_redundant)
        p2l = torch.arange(num_experts + num_redundant, dtype=torch.int64) % num_experts
        return cls.from_physical_to_logical(p2l, world_size, num_logical=num_experts)

    @property
    def num_physical(self) -> int:
        return self.physical_to_logical.numel()

    @property
    def num_logical(self) -> int:
        return self.replica_count.numel()

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_logical

    @property
    def num_local(self) -> int:
        """Physical experts per rank."""
        return self.num_physical // self.world_size

    def _check_rank(self, rank: int) -> None:
        check(isinstance(rank, int) and not isinstance(rank, bool)
              and 0 <= rank < self.world_size,
              f"rank={rank!r} must be an int in [0, world_size={self.world_size})")

    def local_physical_experts(self, rank: int) -> torch.Tensor:
        """The physical ids that `rank` holds, int64 [num_local], in slot order."""
        self._check_rank(rank)
        return torch.arange(rank * self.num_local, (rank + 1) * self.num_local,
                            dtype=torch.int64, device=self.physical_to_logical.device)

    def local_logical_experts(self, rank: int) -> torch.Tensor:
        """The logical expert in each of `rank`'s slots, int64 [num_local]."""
        return self.physical_to_logical[self.local_physical_experts(rank)]

    def to(self, device) -> "ExpertPlacement":
        """This placement with its tables on `device`."""
        return ExpertPlacement(physical_to_logical=self.physical_to_logical.to(device),
                               logical_to_physical=self.logical_to_physical.to(device),
                               replica_count=self.replica_count.to(device),
                               world_size=self.world_size)

    def __eq__(self, other) -> bool:
        if not isinstance(other, ExpertPlacement):
            return NotImplemented
        return (self.world_size == other.world_size and self.num_logical == other.num_logical
                and torch.equal(self.physical_to_logical.cpu(), other.physical_to_logical.cpu()))

    __hash__ = None

    def route(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Physical ids for logical `topk_ids` (`route_ids` with this placement's tables)."""
        return route_ids(topk_ids, self.logical_to_physical, self.replica_count)


def route_ids(topk_ids: torch.Tensor, logical_to_physical: torch.Tensor,
              replica_count: torch.Tensor) -> torch.Tensor:
    """Physical ids for logical `topk_ids`: the k-th occurrence of logical expert e (row-major)
    goes to ``logical_to_physical[e, (k + e) % replica_count[e]]``.

    Arguments:
        topk_ids: `[num_tokens, topk]` with an integer dtype, logical ids in [0, E) or -1 (no
            expert). Not checked here (a check would sync the host); the caller validates them.
        logical_to_physical: `[E, width]` with `torch.int64` on the ids' device, each row's
            first replica_count[e] entries the replicas (any padding after them).
        replica_count: `[E]` with `torch.int64` on the ids' device, each >= 1.

    Returns:
        `[num_tokens, topk]` with `topk_ids.dtype`; -1 stays -1. Device tensor ops only: no host
        sync, capturable in a CUDA graph.
    """
    num_logical = replica_count.numel()
    flat = topk_ids.reshape(-1).long()
    valid = flat >= 0
    # -1 ids count in a bin of their own (E) so that they neither shift nor take a replica.
    occurrence = _occurrence(torch.where(valid, flat, num_logical), num_logical + 1)
    safe = torch.where(valid, flat, 0)
    physical = logical_to_physical[safe, (occurrence + safe) % replica_count[safe]]
    return torch.where(valid, physical, -1).view(topk_ids.shape).to(topk_ids.dtype)


def route_reference(placement: ExpertPlacement, topk_ids: torch.Tensor) -> torch.Tensor:
    """``placement.route`` written as a loop over the ids in row-major order (tests)."""
    seen: dict[int, int] = {}
    out = []
    for e in topk_ids.reshape(-1).tolist():
        if e < 0:
            out.append(-1)
            continue
        k = seen.get(e, 0)
        seen[e] = k + 1
        r = int(placement.replica_count[e])
        out.append(int(placement.logical_to_physical[e, (k + e) % r]))
    return torch.tensor(out, dtype=topk_ids.dtype).view(topk_ids.shape)
