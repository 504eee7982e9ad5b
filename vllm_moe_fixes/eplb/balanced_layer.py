"""A MoE layer over a placement with redundant experts: logical ids in, the kernel runs on
physical ones.

    topk_ids (logical, [M, k]) --record--> ExpertLoadStats (logical load)
             --route--> physical ids [M, k] --> FusedMoEModularKernel(global_num_experts =
                        num_physical, expert_map = this rank's slots, weights = its physical
                        experts) --> output [M, K]

The kernel is built for ``num_physical`` experts (``make_moe_kernel(num_experts=num_physical)``):
physical expert p lives on rank p // num_local, which is the placement every prepare/finalize
already follows, so no prepare/finalize or experts class knows about replicas. A replica is a copy
of its logical expert's weights, so a (token, slot) gives the same bits on whichever replica runs.

The routing tables live in device buffers sized for the largest replica count a placement of
these sizes can have (R + 1), and ``rebalance`` writes the new tables and weights into the same
storage: a CUDA graph captured before a rebalance replays the new placement.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vllm_moe_fixes._validate import check
from vllm_moe_fixes.eplb.load_stats import ExpertLoadStats
from vllm_moe_fixes.eplb.placement import ExpertPlacement, route_ids
from vllm_moe_fixes.eplb.weight_move import MoveReport, move_weights
from vllm_moe_fixes.fused_moe.interfaces import Fp8MoEWeights
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel

__all__ = ["BalancedMoELayer", "physical_weights"]


def physical_weights(logical: Fp8MoEWeights, placement: ExpertPlacement,
                     rank: int) -> Fp8MoEWeights:
    """`rank`'s physical experts: a copy of each slot's logical expert, taken from `logical`
    (every logical expert's weights, `[E, ...]` stacks) and contiguous."""
    check(logical.w1.shape[0] == placement.num_logical,
          f"logical weights hold {logical.w1.shape[0]} experts, the placement "
          f"{placement.num_logical}")
    slots = placement.local_logical_experts(rank).to(logical.w1.device)
    return Fp8MoEWeights(*(t.index_select(0, slots).contiguous() for t in logical))


class BalancedMoELayer:
    """One MoE layer with redundant experts.

    Args:
        kernel: a FusedMoEModularKernel built for ``placement.num_physical`` experts over the
            placement's ``world_size`` ranks.
        placement: an ExpertPlacement.
        weights: this rank's physical experts (``physical_weights``): `[num_local, ...]` stacks.
        rank: this rank in the expert-parallel group.
        load_stats: an ExpertLoadStats to record the logical ids in, or None.
        layer_index: this layer's index in load_stats.
    """

    def __init__(self, kernel: FusedMoEModularKernel, placement: ExpertPlacement,
                 weights: Fp8MoEWeights, *, rank: int = 0,
                 load_stats: ExpertLoadStats | None = None, layer_index: int = 0) -> None:
        check(isinstance(kernel, FusedMoEModularKernel),
              f"kernel must be a FusedMoEModularKernel, got {type(kernel).__name__}")
        check(isinstance(placement, ExpertPlacement),
              f"placement must be an ExpertPlacement, got {type(placement).__name__}")
        ranks = kernel.prepare_finalize.num_dispatchers()
        check(placement.world_size == ranks,
              f"placement.world_size={placement.world_size} but the kernel dispatches over "
              f"{ranks} ranks")
        weights = Fp8MoEWeights(*weights)
        check(weights.w1.shape[0] == placement.num_local,
              f"weights hold {weights.w1.shape[0]} experts but rank {rank} has "
              f"{placement.num_local} physical experts (num_physical={placement.num_physical} "
              f"over {ranks} ranks)")
        check(load_stats is None or load_stats.num_logical == placement.num_logical,
              f"load_stats counts {load_stats and load_stats.num_logical} experts, the placement "
              f"{placement.num_logical}")
        self.kernel, self.weights, self.rank = kernel, weights, rank
        self.load_stats, self.layer_index = load_stats, layer_index
        device = weights.w1.device
        slots = placement.local_physical_experts(rank).to(device)
        self.expert_map = None
        if ranks > 1:
            self.expert_map = torch.full((placement.num_physical,), -1, dtype=torch.int32,
                                         device=device)
            self.expert_map[slots] = torch.arange(slots.numel(), dtype=torch.int32, device=device)
        self._table = torch.full((placement.num_logical, placement.num_redundant + 1), -1,
                                 dtype=torch.int64, device=device)
        self._replicas = torch.empty(placement.num_logical, dtype=torch.int64, device=device)
        self._set_placement(placement)

    def _set_placement(self, placement: ExpertPlacement) -> None:
        """Write placement's tables into the layer's buffers (same storage)."""
        self._table.fill_(-1)
        width = placement.logical_to_physical.shape[1]
        self._table[:, :width].copy_(placement.logical_to_physical)
        self._replicas.copy_(placement.replica_count)
        self.placement = placement

    def __call__(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """The layer on logical `topk_ids` (`[M, k]`, integer, in [-1, num_logical); checked
        for CPU tensors); other arguments as FusedMoEModularKernel's (kwargs: activation,
        apply_router_weight_on_input, max_tokens_across_ranks). Returns bfloat16 `[M, K]`."""
        if topk_ids.device.type == "cpu" and topk_ids.numel():
            lo, hi = int(topk_ids.min()), int(topk_ids.max())
            check(lo >= -1 and hi < self.placement.num_logical,
                  f"topk_ids must be logical ids in [-1, {self.placement.num_logical}), got "
                  f"[{lo}, {hi}]")
        if self.load_stats is not None:
            self.load_stats.record(self.layer_index, topk_ids)
        physical = route_ids(topk_ids, self._table, self._replicas)
        w = self.weights
        return self.kernel(hidden_states, w.w1, w.w2, topk_weights, physical,
                           w1_scale=w.w1_scale, w2_scale=w.w2_scale,
                           global_num_experts=self.placement.num_physical,
                           expert_map=self.expert_map, **kwargs)

    def rebalance(self, placement: ExpertPlacement, group: dist.ProcessGroup | None = None, *,
                  max_bytes: int | None = None) -> MoveReport:
        """Move to `placement` (same sizes): ``move_weights`` rewrites the weights in place,
        then the routing tables change. Every rank of `group` calls it with the same placement.
        A refusal (CollectiveRefusal on every rank) keeps the old placement and weights."""
        report = move_weights(self.placement, placement, self.weights, group=group,
                              max_bytes=max_bytes)
        self._set_placement(placement)
        return report
