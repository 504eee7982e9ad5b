"""The experts of a layer: one table (activation format x VLLM_USE_DEEP_GEMM -> experts class) and
one selector, `experts_for_format`.

    activation format   VLLM_USE_DEEP_GEMM=0     VLLM_USE_DEEP_GEMM=1
    standard            TritonExperts            DeepGemmExperts
    batched             BatchedTritonExperts     BatchedDeepGemmExperts
"""

from __future__ import annotations

import logging

from vllm_moe_fixes import envs
from vllm_moe_fixes._compat import deep_gemm as _deep_gemm
from vllm_moe_fixes._validate import check_positive_int
from vllm_moe_fixes.fused_moe.batched_experts import BatchedDeepGemmExperts, BatchedTritonExperts
from vllm_moe_fixes.fused_moe.contiguous_experts import DeepGemmExperts, TritonExperts
from vllm_moe_fixes.fused_moe.interfaces import ActivationFormat, Experts
from vllm_moe_fixes.ops.fp8 import SCALE_BLOCK

logger = logging.getLogger(__name__)

# activation format -> (its Triton class, its DeepGEMM class)
_EXPERTS_OF_FORMAT = {ActivationFormat.STANDARD: (TritonExperts, DeepGemmExperts),
                      ActivationFormat.BATCHED: (BatchedTritonExperts, BatchedDeepGemmExperts)}

_warned_shapes: set[tuple[str, int, int]] = set()  # (Triton class, I, K) already warned about


def experts_for_format(activation_format: ActivationFormat, intermediate_size: int,
                       hidden_size: int) -> Experts:
    """The experts of ``activation_format`` that VLLM_USE_DEEP_GEMM selects (module table).

    Args:
        activation_format: the ActivationFormat the prepare/finalize produces.
        intermediate_size: I (w1 is [E_l, 2I, K], w2 is [E_l, K, I]), an int >= 1.
        hidden_size: K, an int >= 1.

    With VLLM_USE_DEEP_GEMM=1: DeepGEMM not importable -> MissingLibraryError (an ImportError)
    naming VLLM_USE_DEEP_GEMM and DeepGEMM; I or K not a multiple of 128 -> the Triton class with
    one logged warning per shape, but no backend runs such a layer: the kernel's validation then
    raises a ValueError naming the sizes. A format that is not an ActivationFormat, or sizes that
    are not positive ints -> ValueError.
    """
    if not isinstance(activation_format, ActivationFormat):
        raise ValueError(f"activation_format must be an ActivationFormat, got "
                         f"{activation_format!r}")
    check_positive_int("intermediate_size", intermediate_size)
    check_positive_int("hidden_size", hidden_size)
    triton_cls, deep_gemm_cls = _EXPERTS_OF_FORMAT[activation_format]
    if not envs.VLLM_USE_DEEP_GEMM:
        return triton_cls()
    _deep_gemm.require(f"VLLM_USE_DEEP_GEMM=1 ({deep_gemm_cls.__name__})")
    if intermediate_size % SCALE_BLOCK or hidden_size % SCALE_BLOCK:
        key = (triton_cls.__name__, intermediate_size, hidden_size)
        if key not in _warned_shapes:
            _warned_shapes.add(key)
            logger.warning("VLLM_USE_DEEP_GEMM=1 but I=%d, K=%d are not multiples of %d: no "
                           "backend (DeepGEMM or Triton) supports such a layer; returning %s, "
                           "and running the layer will raise a ValueError",
                           intermediate_size, hidden_size, SCALE_BLOCK, triton_cls.__name__)
        return triton_cls()
    return deep_gemm_cls()
