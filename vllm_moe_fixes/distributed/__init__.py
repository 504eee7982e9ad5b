"""All-to-all buffers (DeepEP or its API on torch.distributed) and DeepEP's buffer sizing.

The sizing functions (DeepEP v1.2.1's and V2's) need no torch (`vllm-moe-fixes plan` imports only
them); TorchAll2AllBuffer, TorchElasticBuffer (V2's API) and DelayedAll2AllBuffer (a
TorchAll2AllBuffer over a simulated slow link, for overlap measurements) are imported on first
use. ``vllm_moe_fixes.distributed.launch`` (run_distributed: run a function on fresh local
gloo/NCCL ranks) imports torch and is not imported here.
"""

from vllm_moe_fixes.distributed.buffers import make_all2all_buffer
from vllm_moe_fixes.distributed.deepep_sizing import (
    deepep_ll_rdma_bytes,
    deepep_nvl_bytes,
    deepep_rdma_bytes,
)
from vllm_moe_fixes.distributed.deepep_v2_sizing import elastic_buffer_size_hint

__all__ = ["DelayedAll2AllBuffer", "TorchAll2AllBuffer", "TorchElasticBuffer",
           "deepep_ll_rdma_bytes", "deepep_nvl_bytes", "deepep_rdma_bytes",
           "elastic_buffer_size_hint", "make_all2all_buffer"]


def __getattr__(name: str):
    if name == "TorchAll2AllBuffer":
        from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer
        return TorchAll2AllBuffer
    if name == "TorchElasticBuffer":
        from vllm_moe_fixes.distributed.torch_elastic_buffer import TorchElasticBuffer
        return TorchElasticBuffer
    if name == "DelayedAll2AllBuffer":
        from vllm_moe_fixes.distributed.delayed_buffer import DelayedAll2AllBuffer
        return DelayedAll2AllBuffer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
