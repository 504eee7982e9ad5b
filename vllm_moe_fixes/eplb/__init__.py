"""Expert-parallel load balancing (EPLB): redundant copies of the busiest experts, placed so that
the busiest rank's load is least, and moved as the load moves.

    topk_ids (logical) --BalancedMoELayer--> ExpertLoadStats.record (per layer, on the device)
                                         \\-> ExpertPlacement.route: physical ids --> the MoE
                                              kernel built for E + R experts
    ExpertLoadStats.group_load --rebalance--> physical_to_logical --> ExpertPlacement
                               --BalancedMoELayer.rebalance (move_weights: the changed slots)

Before a run, ``run_simulation`` plans the time (max/mean rank load and the busiest rank's layer
time under skewed routing) and ``vllm-moe-fixes plan --redundant-experts`` the memory.
"""

# Placement and routing to replicas
from vllm_moe_fixes.eplb.placement import ExpertPlacement, route_ids, route_reference

# Load statistics
from vllm_moe_fixes.eplb.load_stats import ExpertLoadStats

# The layer over a placement
from vllm_moe_fixes.eplb.balanced_layer import BalancedMoELayer, physical_weights

# Weight moves
from vllm_moe_fixes.eplb.weight_move import (
    MoveReport,
    expert_bytes,
    move_bytes,
    move_weights,
    plan_moves,
)

# Rebalancing: our planner and the hierarchical baseline
from vllm_moe_fixes.eplb.rebalance import (
    count_moves,
    rank_loads,
    rebalance,
    rebalance_hierarchical,
    replica_counts,
)

# Simulation: planning the time before a run
from vllm_moe_fixes.eplb.simulate import (
    DEEPSEEK_V3,
    SCENARIOS,
    LayerTimeCurve,
    RoutingShape,
    SimulationConfig,
    max_mean,
    planners,
    replay,
    run_simulation,
    scenario_loads,
)

__all__ = [
    # placement and routing
    "ExpertPlacement", "route_ids", "route_reference",
    # load statistics
    "ExpertLoadStats",
    # the layer
    "BalancedMoELayer", "physical_weights",
    # weight moves
    "MoveReport", "expert_bytes", "move_bytes", "move_weights", "plan_moves",
    # rebalancing
    "count_moves", "rank_loads", "rebalance", "rebalance_hierarchical", "replica_counts",
    # simulation
    "DEEPSEEK_V3", "SCENARIOS", "LayerTimeCurve", "RoutingShape", "SimulationConfig",
    "max_mean", "planners", "replay", "run_simulation", "scenario_loads",
]
