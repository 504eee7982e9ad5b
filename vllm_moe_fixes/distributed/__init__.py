"""All-to-all buffers (DeepEP or its API on torch.distributed) and DeepEP's buffer sizing.

The sizing functions need no torch (`vllm-moe-fixes plan` imports only them); TorchAll2AllBuffer
is imported on first use. ``vllm_moe_fixes.distributed.launch`` (run_distributed: run a
function on fresh local gloo/NCCL ranks) imports torch and is not imported here.
"""

from vllm_moe_fixes.distributed.buffers import make_all2all_buffer
from vllm_moe_fixes.distributed.deepep_sizing import (
    deepep_ll_rdma_bytes,
    deepep_nvl_bytes,
    deepep_rdma_bytes,
)

__all__ = ["TorchAll2AllBuffer", "deepep_ll_rdma_bytes", "deepep_nvl_bytes", "deepep_rdma_bytes",
           "make_all2all_buffer"]


def __getattr__(name: str):
    if name == "TorchAll2AllBuffer":
        from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer
        return TorchAll2AllBuffer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
