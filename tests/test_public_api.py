"""The public names of design.md import from where users import them, and the README's
environment table says what the registry says."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_moe_fixes import envs

PUBLIC = {
    "vllm_moe_fixes.ops": ["per_token_group_quant_fp8", "moe_sum", "silu_and_mul",
                           "grouped_fp8_gemm_contiguous", "grouped_fp8_gemm_masked"],
    "vllm_moe_fixes.fused_moe": ["FusedMoEModularKernel", "DeepGemmExperts", "TritonExperts",
                                 "BatchedTritonExperts", "BatchedDeepGemmExperts",
                                 "NoEPPrepareAndFinalize", "DeepEPHTPrepareAndFinalize",
                                 "DeepEPLLPrepareAndFinalize", "fused_topk", "moe_reference",
                                 "select_experts", "select_batched_experts"],
    "vllm_moe_fixes.distributed": ["TorchAll2AllBuffer", "make_all2all_buffer",
                                   "deepep_ll_rdma_bytes", "deepep_nvl_bytes", "deepep_rdma_bytes"],
    "vllm_moe_fixes.worker": ["maybe_randomize_inputs"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_import(module):
    mod = importlib.import_module(module)
    for name in PUBLIC[module]:
        assert callable(getattr(mod, name)), f"{module}.{name}"
        assert name in mod.__all__


def test_readme_environment_table_matches_registry():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for var in envs.REGISTRY.values():
        default = {True: "1", False: "0"}.get(var.default, var.default) \
            if isinstance(var.default, bool) else var.default
        row = f"| `{var.name}` | {var.allowed} | `{default}` | {var.help} |"
        assert row in readme, f"README row out of date for {var.name}:\n{row}"


def _readme_python_blocks():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]


@pytest.mark.parametrize("index", range(len(_readme_python_blocks())))
def test_readme_examples_run(index, tmp_path):
    """Every python block of the README runs as written (each in its own process, on CPU)."""
    script = tmp_path / "example.py"
    script.write_text(_readme_python_blocks()[index])
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
