"""vLLM integration: this library's prepare/finalize and experts behind vLLM's modular-kernel ABCs,
and the ``vllm.general_plugins`` hook that makes vLLM's block-FP8 FusedMoE layers use them.

    prepare_finalize  VllmNoEPPrepareAndFinalize, VllmDeepEPHTPrepareAndFinalize,
                      VllmDeepEPLLPrepareAndFinalize, VllmDeepEPV2PrepareAndFinalize
                      (FusedMoEPrepareAndFinalizeModular)
    experts           VllmTritonExperts, VllmDeepGemmExperts, VllmBatchedTritonExperts,
                      VllmBatchedDeepGemmExperts (FusedMoEExpertsModular), their base VllmExperts
    support           what they serve (the reasons for a refusal), DeepEP buffer checks
    plugin            register (the entry point), make_kernel, prepare_finalize_adapter
    versions          UnsupportedVllmVersionError (register's refusal of an older vLLM)

Importing this package imports no vllm: the names below load their module (and vllm) on first
use, so the entry point stays cheap while VLLM_MOE_FIXES is unset.
"""

import importlib

_MODULE_OF = {
    "VllmNoEPPrepareAndFinalize": "prepare_finalize",
    "VllmDeepEPHTPrepareAndFinalize": "prepare_finalize",
    "VllmDeepEPLLPrepareAndFinalize": "prepare_finalize",
    "VllmDeepEPV2PrepareAndFinalize": "prepare_finalize",
    "VllmExperts": "experts",
    "VllmTritonExperts": "experts",
    "VllmDeepGemmExperts": "experts",
    "VllmBatchedTritonExperts": "experts",
    "VllmBatchedDeepGemmExperts": "experts",
    "register": "plugin",
    "make_kernel": "plugin",
    "prepare_finalize_adapter": "plugin",
    "UnsupportedVllmVersionError": "versions",
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
