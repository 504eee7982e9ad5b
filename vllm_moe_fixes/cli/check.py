"""``vllm-moe-fixes check``: versions, GPU, optional libraries, effective environment values and
what would run with them; exit status 2 when anything would keep a layer from running."""

from __future__ import annotations

import argparse
import platform
import sys

from vllm_moe_fixes import envs
from vllm_moe_fixes.cli._common import TORCH_INSTALL
from vllm_moe_fixes.sizes import SCALE_BLOCK

HELP = "versions, GPU, optional libraries, env values, backends"


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
    if problems:
        print("\nproblems:", *(f"  - {p}" for p in problems), sep="\n")
        return 2
    print("\nok")
    return 0

