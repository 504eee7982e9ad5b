"""All-to-all buffers (DeepEP or its API on torch.distributed) and DeepEP's buffer sizing."""

from vllm_moe_fixes.distributed.deepep import (
    deepep_ll_rdma_bytes,
    deepep_nvl_bytes,
    deepep_rdma_bytes,
    make_all2all_buffer,
)
from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer

__all__ = ["TorchAll2AllBuffer", "deepep_ll_rdma_bytes", "deepep_nvl_bytes", "deepep_rdma_bytes",
           "make_all2all_buffer"]
