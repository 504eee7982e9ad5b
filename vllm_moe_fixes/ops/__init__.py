"""Kernels: Triton on CUDA tensors, the torch reference on CPU tensors, inputs validated."""

# FP8 block quantisation: dtype, largest value, scale block, MN-major (TMA-aligned) scales
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, FP8_MAX, SCALE_BLOCK, empty_mn_major_scales

# Kernels, in the order a layer runs them
from vllm_moe_fixes.ops.fp8_quant import per_token_group_quant_fp8
from vllm_moe_fixes.ops.grouped_gemm import grouped_fp8_gemm_contiguous, grouped_fp8_gemm_masked
from vllm_moe_fixes.ops.activation import silu_and_mul
from vllm_moe_fixes.ops.silu_mul_quant import silu_and_mul_quant_fp8
from vllm_moe_fixes.ops.moe_sum import moe_sum

__all__ = ["FP8_DTYPE", "FP8_MAX", "SCALE_BLOCK", "empty_mn_major_scales",
           "per_token_group_quant_fp8", "grouped_fp8_gemm_contiguous", "grouped_fp8_gemm_masked",
           "silu_and_mul", "silu_and_mul_quant_fp8", "moe_sum"]
