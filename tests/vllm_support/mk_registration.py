"""Register this library's vLLM adapters in vLLM 0.33's own modular-kernel test harness
(``tests/kernels/moe/modular_kernel_tools`` of vLLM's source tree), so that
``test_modular_kernel_combinations.py -k singlegpu`` pairs them with vLLM's classes and checks them
against its torch reference. Load it as a pytest plugin, with this folder on PYTHONPATH so that the
process vLLM spawns for each case imports ``sitecustomize`` from here and registers there too
(unpickling a case imports our classes, and the spawned rank looks them up in the registries):

    cd $VLLM_SRC && PYTHONPATH=$REPO/tests/vllm_support:$REPO \\
        python -m pytest -p mk_registration --confcutdir=tests/kernels \\
        tests/kernels/moe/test_modular_kernel_combinations.py -k singlegpu

(``--confcutdir``: vLLM's top ``tests/conftest.py`` imports half of vLLM's test dependencies; the
one fixture the harness takes from it, ``workspace_init``, is defined here.)

Registered (``mk_objects``): the experts VllmTritonExperts (standard format) and
VllmBatchedTritonExperts (batched), and where DeepGEMM runs VllmDeepGemmExperts and
VllmBatchedDeepGemmExperts, FP8 only with 128x128 blocks; the prepare/finalize
VllmNoEPPrepareAndFinalize (single GPU, standard format). vLLM 0.33's harness has no single-GPU
prepare/finalize of the batched format, so the batched experts get single-GPU cases from none.
Its ``common.make_modular_kernel`` builds the prepare/finalize from the all-to-all backend and not
from the case's class, so it is wrapped to swap ours in where the case names it; its case filter
(``common.Config.is_valid``) keeps only block-FP8 cases for our classes, which refuse the
harness's per-tensor and per-channel FP8 cases.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

_HARNESS_PACKAGES = ("tests.kernels.moe.modular_kernel_tools", "kernels.moe.modular_kernel_tools",
                     "moe.modular_kernel_tools", "modular_kernel_tools")


def register(mk_objects) -> None:
    """Add our classes to the registries of the harness module ``mk_objects`` (once)."""
    if getattr(mk_objects, "_vllm_moe_fixes_registered", False):
        return
    import torch

    from vllm_moe_fixes.integrations.vllm import experts as adapters
    from vllm_moe_fixes.integrations.vllm import prepare_finalize as pfs

    fp8 = [torch.float8_e4m3fn]
    experts = [(adapters.VllmTritonExperts, mk_objects.standard_format, False),
               (adapters.VllmBatchedTritonExperts, mk_objects.batched_format, False)]
    if adapters.VllmDeepGemmExperts._supports_current_device():
        experts += [(adapters.VllmDeepGemmExperts, mk_objects.standard_format, True),
                    (adapters.VllmBatchedDeepGemmExperts, mk_objects.batched_format, True)]
    for cls, fmt, needs_deep_gemm in experts:
        mk_objects.register_experts(cls, fmt, fp8, blocked_quantization_support=True,
                                    needs_matching_quant=False, needs_deep_gemm=needs_deep_gemm)
    mk_objects.register_prepare_and_finalize(
        pfs.VllmNoEPPrepareAndFinalize, mk_objects.standard_format, fp8,
        blocked_quantization_support=True, backend=None)
    mk_objects._vllm_moe_fixes_registered = True


def _our_prepare_finalize_classes() -> tuple[type, ...]:
    from vllm_moe_fixes.integrations.vllm import prepare_finalize as pfs

    return (pfs.VllmNoEPPrepareAndFinalize,)


def patch_common(common) -> None:
    """Wrap the harness module ``common``: ``make_modular_kernel`` builds our prepare/finalize
    where the case names it (vLLM 0.33 builds vLLM's from the backend whatever the case names),
    and ``Config.is_valid`` refuses every quantisation but block FP8 128x128 with dynamic 1x128
    activations for a case with one of our classes (once)."""
    if getattr(common, "_vllm_moe_fixes_patched", False):
        return
    make_modular_kernel = common.make_modular_kernel

    def make_modular_kernel_with_ours(config, vllm_config, quant_config):
        kernel = make_modular_kernel(config, vllm_config, quant_config)
        ours = config.prepare_finalize_type
        if ours not in _our_prepare_finalize_classes():
            return kernel
        return type(kernel)(prepare_finalize=ours(), fused_experts=kernel.fused_experts)

    common.make_modular_kernel = make_modular_kernel_with_ours
    only_block_fp8(common.Config)
    common._vllm_moe_fixes_patched = True


def only_block_fp8(config_cls) -> None:
    """Make the harness's ``Config.is_valid`` refuse non-block-FP8 cases of our classes."""
    is_valid = config_cls.is_valid

    def filtered(self):
        ours = any(getattr(t, "__module__", "").startswith("vllm_moe_fixes.")
                   for t in (self.prepare_finalize_type, self.fused_experts_type))
        quant = self.quant_config
        block_fp8 = (quant is not None and list(quant.block_shape or []) == [128, 128]
                     and not quant.per_act_token_quant and not quant.per_out_ch_quant)
        if ours and not block_fp8:
            return False, "vllm_moe_fixes serves block FP8 128x128 only"
        return is_valid(self)

    config_cls.is_valid = filtered


# What runs after the harness module of each name has been imported.
_AFTER_IMPORT = {**{f"{p}.mk_objects": register for p in _HARNESS_PACKAGES},
                 **{f"{p}.common": patch_common for p in _HARNESS_PACKAGES}}


def register_when_imported() -> None:
    """Run each of _AFTER_IMPORT's steps now for a module already loaded, else as soon as it is
    (an import hook)."""
    pending = {}
    for name, step in _AFTER_IMPORT.items():
        if name in sys.modules:
            step(sys.modules[name])
        else:
            pending[name] = step
    if pending and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(pending))


class _AfterImport:
    """A meta-path finder that lets the normal import of a harness module run, then runs its
    step on it."""

    def __init__(self, steps) -> None:
        self.steps = steps

    def find_spec(self, name, path=None, target=None):
        step = self.steps.get(name)
        if step is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_step(module):
            exec_module(module)
            step(module)

        spec.loader.exec_module = exec_then_step
        return spec


def pytest_configure(config) -> None:
    register_when_imported()


@pytest.fixture
def workspace_init():
    """vLLM's fixture of the same name (its top tests/conftest.py, cut off by --confcutdir): the
    process-wide workspace manager on GPU 0 for the test, reset after it."""
    import torch
    from vllm.v1.worker.workspace import init_workspace_manager, reset_workspace_manager

    init_workspace_manager(torch.device(0))
    yield
    reset_workspace_manager()
