"""Expert-parallel load balancing: placement with redundant experts, routing to replicas, load
statistics, the balanced layer, weight moves and rebalancing."""

from vllm_moe_fixes.eplb.placement import ExpertPlacement, route_reference

__all__ = ["ExpertPlacement", "route_reference"]
