"""Register this library's vLLM adapters in vLLM's own modular-kernel test harness
(``tests/kernels/moe/modular_kernel_tools/mk_objects.py`` of a vLLM source tree), so that
``test_modular_kernel_combinations.py -k singlegpu`` pairs them with vLLM's classes and its
reference. NOT YET RUN: written while no device was lent; vLLM 0.33's registry signatures are
matched by name at run time (keywords the registry does not take are dropped).

Load it as a pytest plugin, with this folder on PYTHONPATH so that vLLM's spawned rank processes
import ``sitecustomize`` from here too and register there as well:

    PYTHONPATH=tests/vllm_support:$VLLM_SRC python -m pytest -p mk_registration \\
        $VLLM_SRC/tests/kernels/moe/test_modular_kernel_combinations.py -k singlegpu

Registered: experts VllmTritonExperts, VllmDeepGemmExperts (needs DeepGEMM) in the standard
format, VllmBatchedTritonExperts, VllmBatchedDeepGemmExperts in the batched one, all FP8 only with
128x128 blocks; prepare/finalize VllmNoEPPrepareAndFinalize (single GPU). The harness builds a
prepare/finalize from its all-to-all backend name, so its factory is wrapped to build ours, and its
case filter (``common.Config.is_valid``) keeps only block-FP8 cases for our classes.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys

MK_OBJECTS = ("tests.kernels.moe.modular_kernel_tools.mk_objects",
              "kernels.moe.modular_kernel_tools.mk_objects",
              "modular_kernel_tools.mk_objects")


def _call(fn, *args, **kwargs):
    """fn(*args, **the keywords fn takes)."""
    params = inspect.signature(fn).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


def register(mk_objects) -> None:
    """Add our classes to the registries of the harness module ``mk_objects`` (once)."""
    if getattr(mk_objects, "_vllm_moe_fixes_registered", False):
        return
    import torch

    from vllm_moe_fixes.integrations.vllm import experts as adapters
    from vllm_moe_fixes.integrations.vllm import prepare_finalize as pfs

    standard = mk_objects.standard_format
    batched = mk_objects.batched_format
    fp8 = [torch.float8_e4m3fn]
    common = dict(blocked_quantization_support=True, supports_chunking=False,
                  needs_matching_quant=False)
    for cls, fmt, expert_map in ((adapters.VllmTritonExperts, standard, True),
                                 (adapters.VllmBatchedTritonExperts, batched, False)):
        _call(mk_objects.register_experts, cls, fmt, fp8, supports_expert_map=expert_map,
              needs_deep_gemm=False, **common)
    if adapters.VllmDeepGemmExperts._supports_current_device():
        for cls, fmt, expert_map in ((adapters.VllmDeepGemmExperts, standard, True),
                                     (adapters.VllmBatchedDeepGemmExperts, batched, False)):
            _call(mk_objects.register_experts, cls, fmt, fp8, supports_expert_map=expert_map,
                  needs_deep_gemm=True, **common)
    _call(mk_objects.register_prepare_and_finalize, pfs.VllmNoEPPrepareAndFinalize, standard,
          fp8, blocked_quantization_support=True, backend=None,
          supports_apply_weight_on_input=True)
    _wrap_prepare_finalize_factory(mk_objects, pfs.VllmNoEPPrepareAndFinalize)
    mk_objects._vllm_moe_fixes_registered = True


def _wrap_prepare_finalize_factory(mk_objects, our_cls) -> None:
    """The harness's make_prepare_finalize(kind, backend, moe, quant_config) builds vLLM's no-EP
    class for every single-GPU kind: build ours for our kind. Rebound in mk_objects and in every
    module of its package that imported the function by name."""
    original = mk_objects.make_prepare_finalize

    def make_prepare_finalize(prepare_finalize_type, *args, **kwargs):
        if prepare_finalize_type is our_cls:
            return our_cls()
        return original(prepare_finalize_type, *args, **kwargs)

    harness = mk_objects.__name__.rpartition(".")[0]  # its package: the harness's modules
    for name, module in list(sys.modules.items()):
        if name == mk_objects.__name__ or (harness and name.startswith(harness + ".")):
            if vars(module).get("make_prepare_finalize") is original:
                module.make_prepare_finalize = make_prepare_finalize


def only_block_fp8(common) -> None:
    """Make the harness module ``common``'s ``Config.is_valid`` refuse, for a case with one of
    our classes, every quantisation but block FP8 128x128 with dynamic 1x128 activations (the
    harness otherwise offers them per-tensor and unquantised cases too, which our classes refuse
    with a ValueError at construction)."""
    config_cls = getattr(common, "Config", None)
    if config_cls is None or getattr(config_cls, "_vllm_moe_fixes_filtered", False):
        return
    is_valid = config_cls.is_valid

    def filtered(self):
        verdict = is_valid(self)
        ours = any(getattr(t, "__module__", "").startswith("vllm_moe_fixes.")
                   for t in (self.prepare_finalize_type, self.fused_experts_type))
        quant = self.quant_config
        block_fp8 = (quant is not None and list(quant.block_shape or []) == [128, 128]
                     and not quant.per_act_token_quant and not quant.per_out_ch_quant)
        if ours and not block_fp8:
            reason = "vllm_moe_fixes serves block FP8 128x128 only"
            return (False, reason) if isinstance(verdict, tuple) else False
        return verdict

    config_cls.is_valid = filtered
    config_cls._vllm_moe_fixes_filtered = True


# What runs after the harness module of each name has been imported.
_AFTER_IMPORT = {**{name: register for name in MK_OBJECTS},
                 **{name.rpartition(".")[0] + ".common": only_block_fp8 for name in MK_OBJECTS}}


def register_when_imported() -> None:
    """Run each of _AFTER_IMPORT's steps now for a module already loaded, else as soon as it is
    (an import hook)."""
    pending = {}
    for name, step in _AFTER_IMPORT.items():
        if name in sys.modules:
            step(sys.modules[name])
        else:
            pending[name] = step
    if pending:
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
