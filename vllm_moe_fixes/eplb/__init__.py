"""Expert-parallel load balancing: placement with redundant experts, routing to replicas, load
statistics, the balanced layer, weight moves and rebalancing."""

from vllm_moe_fixes.eplb.balanced_layer import BalancedMoELayer, physical_weights
from vllm_moe_fixes.eplb.load_stats import ExpertLoadStats
from vllm_moe_fixes.eplb.placement import ExpertPlacement, route_ids, route_reference
from vllm_moe_fixes.eplb.rebalance import (
    count_moves,
    rank_loads,
    rebalance,
    rebalance_hierarchical,
)
from vllm_moe_fixes.eplb.weight_move import (
    MoveReport,
    expert_bytes,
    move_bytes,
    move_weights,
    plan_moves,
)

__all__ = ["BalancedMoELayer", "ExpertLoadStats", "ExpertPlacement", "MoveReport",
           "count_moves", "expert_bytes", "move_bytes", "move_weights", "physical_weights",
           "plan_moves", "rank_loads", "rebalance", "rebalance_hierarchical", "route_ids",
           "route_reference"]
