"""Prepare/finalize without expert parallelism: quantise in; out, nothing left to do when the
experts reduce (they write the layer's output), else a weighted moe_sum."""

from __future__ import annotations

import torch

from vllm_moe_fixes._validate import check_bool
from vllm_moe_fixes.fused_moe.interfaces import (
    ActivationFormat,
    PrepareAndFinalize,
    PrepareResult,
)
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, SCALE_BLOCK
from vllm_moe_fixes.ops.fp8_quant import (
    QUANT_EPS,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_triton,
)
from vllm_moe_fixes.ops.moe_sum import moe_sum


class NoEPPrepareAndFinalize(PrepareAndFinalize):
    """Single rank: every token stays here, expert_map (if any) is applied by the experts.

    prepare: a1q, a1q_scale = per-token 1x128 FP8 quantisation of a1 (a1 * weight first when
    apply_router_weight_on_input); topk_ids / topk_weights pass through unchanged.
    defer_input_quant=True (for experts whose `takes_unquantized_input` is True: the contiguous
    experts): prepare returns a1q = a1 itself (bf16, weighted as above) and a1q_scale None, and the
    experts quantise it where they permute it (one kernel instead of two, the same bits). Not
    while torch.compile traces: the experts' op there takes a scale tensor.
    use_ue8m0=True: every activation quant of the layer rounds its scales up to powers of two
    (PrepareAndFinalize.use_ue8m0): this quant, and the experts' through the kernel.
    finalize: an output the experts reduced is already the layer's output
    (passes_reduced_output_through; copied only if it is another tensor); an unreduced
    [M, k, K] is summed over the k slots times topk_weights (weights unless they were applied on
    the input): one weighted moe_sum pass, float32 math.
    """

    activation_format = ActivationFormat.STANDARD
    passes_reduced_output_through = True

    def __init__(self, *, defer_input_quant: bool = False, use_ue8m0: bool = False) -> None:
        check_bool("use_ue8m0", use_ue8m0)
        self.defer_input_quant = defer_input_quant
        self.use_ue8m0 = use_ue8m0

    def defer_input_quant_to(self, experts) -> bool:
        """Leave the input quant to `experts` where they take unquantised input (our contiguous
        experts quantise it where they permute it: one kernel instead of two, the same bits);
        return whether this prepare now defers it."""
        self.defer_input_quant = bool(experts.takes_unquantized_input)
        return self.defer_input_quant

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input) -> PrepareResult:
        if apply_router_weight_on_input:
            a1 = a1 * topk_weights.to(a1.dtype)  # k == 1: [M, 1] broadcasts over K
        if self.defer_input_quant and not torch.compiler.is_compiling():
            return PrepareResult(a1q=a1, a1q_scale=None)
        if not a1.is_cuda:
            a1q, a1q_scale = per_token_group_quant_fp8(a1, SCALE_BLOCK,
                                                       use_ue8m0=self.use_ue8m0)
            return PrepareResult(a1q=a1q, a1q_scale=a1q_scale)
        # The public op's launch without its argument checks (the modular kernel has validated
        # a1: bf16 [M, K] with contiguous channels, K a multiple of 128): the same kernel and
        # tensors, less host time.
        M, K = a1.shape
        a1q = torch.empty((M, K), dtype=FP8_DTYPE, device=a1.device)
        a1q_scale = torch.empty((M, K // SCALE_BLOCK), dtype=torch.float32, device=a1.device)
        per_token_group_quant_fp8_triton(a1, a1q, a1q_scale, SCALE_BLOCK, QUANT_EPS,
                                         self.use_ue8m0)
        return PrepareResult(a1q=a1q, a1q_scale=a1q_scale)

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, *, output_is_reduced=False) -> None:
        if output_is_reduced:
            if fused_expert_output is not output:
                output.copy_(fused_expert_output)
            return
        moe_sum(fused_expert_output, out=output,
                topk_weights=None if apply_router_weight_on_input else topk_weights)
