"""Kernels: Triton on CUDA tensors, the torch reference on CPU tensors, inputs validated."""

from vllm_moe_fixes.ops.activation import silu_and_mul
from vllm_moe_fixes.ops.fp8_quant import per_token_group_quant_fp8
from vllm_moe_fixes.ops.grouped_gemm import grouped_fp8_gemm_contiguous, grouped_fp8_gemm_masked
from vllm_moe_fixes.ops.moe_sum import moe_sum

__all__ = ["grouped_fp8_gemm_contiguous", "grouped_fp8_gemm_masked", "moe_sum",
           "per_token_group_quant_fp8", "silu_and_mul"]
