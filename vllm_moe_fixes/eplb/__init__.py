"""Expert-parallel load balancing: placement with redundant experts, routing to replicas, load
statistics, the balanced layer, weight moves and rebalancing."""

from vllm_moe_fixes.eplb.load_stats import ExpertLoadStats
from vllm_moe_fixes.eplb.placement import ExpertPlacement, route_ids, route_reference

__all__ = ["ExpertLoadStats", "ExpertPlacement", "route_ids", "route_reference"]
