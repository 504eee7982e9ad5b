"""One selector for both layouts: the Triton or the DeepGEMM class of a pair, by VLLM_USE_DEEP_GEMM.

`select_experts` (contiguous) and `select_batched_experts` (batched) call `select_experts_of` with
their class pair.
"""

from __future__ import annotations

import logging

from vllm_moe_fixes import envs
from vllm_moe_fixes._compat import deep_gemm as _deep_gemm
from vllm_moe_fixes._validate import check_positive_int
from vllm_moe_fixes.ops.fp8 import SCALE_BLOCK

logger = logging.getLogger(__name__)

_warned_shapes: set[tuple[str, int, int]] = set()  # (Triton class, I, K) already warned about


def select_experts_of(triton_cls: type, deep_gemm_cls: type, intermediate_size: int,
                      hidden_size: int):
    """An instance of deep_gemm_cls when VLLM_USE_DEEP_GEMM, else of triton_cls.

    Args:
        triton_cls / deep_gemm_cls: the layout's Experts classes (constructed without arguments).
        intermediate_size: I (w1 is [E_l, 2I, K], w2 is [E_l, K, I]), an int >= 1.
        hidden_size: K, an int >= 1.

    With VLLM_USE_DEEP_GEMM=1: DeepGEMM not importable -> MissingLibraryError (an ImportError)
    naming VLLM_USE_DEEP_GEMM and DeepGEMM; I or K not a multiple of 128 -> triton_cls with one
    logged warning per shape, but no backend runs such a layer: the kernel's validation then
    raises a ValueError naming the sizes. Sizes that are not positive ints -> ValueError.
    """
    check_positive_int("intermediate_size", intermediate_size)
    check_positive_int("hidden_size", hidden_size)
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
