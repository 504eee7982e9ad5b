"""The experts' steps around and including the Triton GEMMs, each with its two implementations:
the Triton launcher for CUDA tensors (arguments already validated: no public-op checks, host time
counts at small M) and the torch reference for CPU ones (Triton's interpreter is for tests).

`takes_triton` is the one device rule: a step runs where the tensor it reads lives, so a layer
computes on its inputs' device.

    step                reads     CUDA: Triton launcher         CPU: torch reference
    build_layout        topk_ids  build_contiguous_layout_triton  build_contiguous_layout_into
    permute             a1q       permute_rows_triton             permute_rows_ref
    quant_permute       a1        quant_permute_triton            quant_permute_ref
    silu_and_mul_quant  h         silu_and_mul_quant_fp8_triton   silu_and_mul_quant_fp8
    unpermute_reduce    y         unpermute_reduce_triton         unpermute_reduce_ref
    contiguous_gemm     a         grouped_fp8_gemm_contiguous_    ..._triton / ..._ref
    masked_gemm         a         grouped_fp8_gemm_masked_        ..._triton / ..._ref
"""

from __future__ import annotations

import torch

from vllm_moe_fixes.ops.grouped_gemm import (
    grouped_fp8_gemm_contiguous_ref,
    grouped_fp8_gemm_contiguous_triton,
    grouped_fp8_gemm_masked_ref,
    grouped_fp8_gemm_masked_triton,
)
from vllm_moe_fixes.ops.permute import (
    build_contiguous_layout_into,
    build_contiguous_layout_triton,
    permute_rows_ref,
    permute_rows_triton,
    unpermute_reduce_ref,
    unpermute_reduce_triton,
)
from vllm_moe_fixes.ops.quant_permute import quant_permute_ref, quant_permute_triton
from vllm_moe_fixes.ops.silu_mul_quant import silu_and_mul_quant_fp8, silu_and_mul_quant_fp8_triton


def takes_triton(reads: torch.Tensor) -> bool:
    """Whether a step that reads `reads` runs its Triton launcher (CUDA) or its reference."""
    return reads.is_cuda


def build_layout(topk_ids, local_num_experts, expert_map, layout, counts) -> None:
    if takes_triton(topk_ids):
        build_contiguous_layout_triton(topk_ids, local_num_experts, expert_map, layout, counts)
    else:
        build_contiguous_layout_into(topk_ids, local_num_experts, expert_map, layout, counts)


def permute(a1q, a1q_scale, layout, out_q, out_s) -> None:
    if takes_triton(a1q):
        permute_rows_triton(a1q, a1q_scale, layout, out_q, out_s)
    else:
        permute_rows_ref(a1q, a1q_scale, layout, out_q, out_s)


def quant_permute(a1, layout, out_q, out_s, use_ue8m0: bool) -> None:
    """a1: the unquantised bf16 input (a prepare that deferred its quant); use_ue8m0: the layer's
    scale rounding (PrepareAndFinalize.use_ue8m0)."""
    if takes_triton(a1):
        quant_permute_triton(a1, layout, out_q, out_s, use_ue8m0)
    else:
        quant_permute_ref(a1, layout, out_q, out_s, use_ue8m0)


def silu_and_mul_quant(h, out_q, out_s, masked_m, use_ue8m0: bool, expert_ends=None) -> None:
    """masked_m: int32 [E_l] valid rows per expert slice (batched layout); expert_ends: int32
    [E_l] psum ends (contiguous layout: padding rows skipped); neither: every row. use_ue8m0:
    the layer's scale rounding (PrepareAndFinalize.use_ue8m0)."""
    if takes_triton(h):
        silu_and_mul_quant_fp8_triton(h, out_q, out_s, masked_m, use_ue8m0,
                                      expert_ends=expert_ends)
    else:
        silu_and_mul_quant_fp8(h, out_q=out_q, out_s=out_s, expert_num_tokens=masked_m,
                               expert_ends=expert_ends, use_ue8m0=use_ue8m0)


def unpermute_reduce(y, dest, topk_weights, out) -> None:
    if takes_triton(y):
        unpermute_reduce_triton(y, dest, topk_weights, out)
    else:
        unpermute_reduce_ref(y, dest, topk_weights, out)


def contiguous_gemm(a, w, out, m_indices) -> None:
    if takes_triton(a[0]):
        grouped_fp8_gemm_contiguous_triton(a, w, out, m_indices)
    else:
        grouped_fp8_gemm_contiguous_ref(a, w, out, m_indices)


def masked_gemm(a, w, out, masked_m) -> None:
    if takes_triton(a[0]):
        grouped_fp8_gemm_masked_triton(a, w, out, masked_m)
    else:
        grouped_fp8_gemm_masked_ref(a, w, out, masked_m)
