"""The modular MoE layer: prepare/finalize (NoEP, DeepEP high-throughput, low-latency, V2) x
experts."""

from vllm_moe_fixes.distributed.collectives import CollectiveRefusal
from vllm_moe_fixes.fused_moe.batched_experts import (
    BatchedDeepGemmExperts,
    BatchedTritonExperts,
)
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import (
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
    DeepEPV2PrepareAndFinalize,
)
from vllm_moe_fixes.fused_moe.contiguous_experts import (
    DeepGemmExperts,
    TritonExperts,
)
from vllm_moe_fixes.fused_moe.experts_selection import experts_for_format
from vllm_moe_fixes.fused_moe.grouped_topk import grouped_topk
from vllm_moe_fixes.fused_moe.kernel_factory import (
    local_expert_map,
    make_moe_kernel,
    make_prepare_finalize,
)
from vllm_moe_fixes.fused_moe.interfaces import (
    ActivationFormat,
    Experts,
    Fp8MoEWeights,
    PrepareAndFinalize,
    PrepareResult,
)
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.fused_moe.no_ep_prepare_finalize import NoEPPrepareAndFinalize
from vllm_moe_fixes.fused_moe.reference import moe_reference
from vllm_moe_fixes.fused_moe.routing import fused_topk
from vllm_moe_fixes.fused_moe.workspaces import Workspaces

__all__ = ["ActivationFormat", "BatchedDeepGemmExperts", "BatchedTritonExperts",
           "CollectiveRefusal", "DeepEPHTPrepareAndFinalize", "DeepEPLLPrepareAndFinalize",
           "DeepEPV2PrepareAndFinalize", "DeepGemmExperts", "Experts", "Fp8MoEWeights",
           "FusedMoEModularKernel", "NoEPPrepareAndFinalize", "PrepareAndFinalize",
           "PrepareResult", "TritonExperts", "Workspaces", "experts_for_format", "fused_topk",
           "grouped_topk", "local_expert_map", "make_moe_kernel", "make_prepare_finalize",
           "moe_reference"]
