"""Experts over the batched (masked) layout of DeepEP's low-latency dispatch.

Input a1q fp8 [E_l, T, K] (T = R*N rows per local expert, only the first expert_num_tokens[e]
valid). One `apply`:

    step          reads                     writes
    GEMM1 (w1)    a1q, a1q_scale            H  bf16 [E_l, T, 2N]   start of ws13
    silu_and_mul  H                         G  bf16 [E_l, T, N]    ws2
    requantise    G                         G' fp8 [E_l, T, N]     ws13 bytes after the output
                                            + f32 scales [E_l, T, N/128], MN-major per expert
    GEMM2 (w2)    G'                        Y  bf16 [E_l, T, K]    output = start of ws13

The GEMMs are masked: they compute only the valid rows of each expert (rows past the count are
left as they were). The elementwise steps run over whole slices. ws13 is sized
max(2N, K + N) per row so that G' (N bytes per row) fits after Y (2K bytes per row).
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from vllm_moe_fixes._compat import deep_gemm as _deep_gemm
from vllm_moe_fixes.fused_moe.modular_kernel import ActivationFormat, Experts
from vllm_moe_fixes.ops.activation import silu_and_mul
from vllm_moe_fixes.ops.fp8_quant import per_token_group_quant_fp8
from vllm_moe_fixes.ops.grouped_gemm import grouped_fp8_gemm_masked

FP8_DTYPE = torch.float8_e4m3fn
BLOCK = 128


def quant_batched_fp8(x: torch.Tensor, out_q: torch.Tensor | None = None):
    """bf16 [E, T, K] -> (fp8 [E, T, K], float32 scales [E, T, K/128] with strides
    (T*K/128, 1, T): MN-major per expert, DeepEP's low-latency layout). 1x128 groups."""
    e, t, k = x.shape
    q, s = per_token_group_quant_fp8(x.reshape(e * t, k), BLOCK,
                                     out_q=None if out_q is None else out_q.view(e * t, k))
    s_mn = torch.empty(e, k // BLOCK, t, dtype=torch.float32, device=x.device).transpose(1, 2)
    s_mn.copy_(s.view(e, t, k // BLOCK))
    return q.view(e, t, k), s_mn


class BatchedExperts(Experts):
    """Shared body of BatchedTritonExperts and BatchedDeepGemmExperts; subclasses give `gemm`."""

    activation_format = ActivationFormat.BATCHED

    @abstractmethod
    def gemm(self, a, w, out: torch.Tensor, masked_m: torch.Tensor, expected_m: int) -> None:
        """Masked grouped GEMM (DeepGEMM's contract, ops.grouped_fp8_gemm_masked)."""

    def workspace_shapes(self, M, N, K, topk, local_num_experts):
        """M is T, the rows of each expert slice."""
        return ((local_num_experts, M, max(2 * N, K + N)), (local_num_experts, M, max(N, K)),
                (local_num_experts, M, K))

    def apply(self, output, a1q, a1q_scale, w1, w2, w1_scale, w2_scale, topk_ids, expert_map,
              activation, workspace13, workspace2, expert_num_tokens) -> None:
        """a1q fp8 [E_l, T, K], a1q_scale f32 [E_l, T, K/128]; expert_num_tokens int32 [E_l];
        output bf16 [E_l, T, K] (valid rows written). topk_ids / expert_map are not needed."""
        if activation != "silu":
            raise ValueError(f"activation must be 'silu', got {activation!r}")
        if expert_num_tokens is None:
            raise ValueError("batched experts need expert_num_tokens (int32 [E_l])")
        e_l, t, _ = a1q.shape
        n = w2.shape[2]
        masked_m = expert_num_tokens.to(torch.int32).contiguous()
        h = workspace13.view(-1)[:e_l * t * 2 * n].view(e_l, t, 2 * n)
        self.gemm((a1q, a1q_scale), (w1, w1_scale), h, masked_m, t)
        g = workspace2.view(-1)[:e_l * t * n].view(e_l, t, n)
        silu_and_mul(h.view(e_l * t, 2 * n), out=g.view(e_l * t, n))
        # G' goes right after the output's bytes, 16-byte aligned.
        start = (output.numel() * output.element_size() + 15) // 16 * 16
        g_q = workspace13.view(-1).view(torch.uint8)[start:start + e_l * t * n].view(FP8_DTYPE)
        g_q, g_s = quant_batched_fp8(g, out_q=g_q.view(e_l, t, n))
        self.gemm((g_q, g_s), (w2, w2_scale), output, masked_m, t)


class BatchedTritonExperts(BatchedExperts):
    """Batched experts on `ops.grouped_fp8_gemm_masked` (Triton on CUDA, torch reference on CPU)."""

    def gemm(self, a, w, out, masked_m, expected_m) -> None:
        grouped_fp8_gemm_masked(a, w, out, masked_m)


class BatchedDeepGemmExperts(BatchedExperts):
    """Batched experts on DeepGEMM's masked grouped FP8 GEMM (N, K multiples of 128).

    expected_m (DeepGEMM's tiling hint) is T, an upper bound, so no count is read on the host.
    Raises RuntimeError (naming VLLM_USE_DEEP_GEMM and DeepGEMM) when DeepGEMM is not usable.
    """

    def __init__(self) -> None:
        _deep_gemm.require("BatchedDeepGemmExperts")

    def gemm(self, a, w, out, masked_m, expected_m) -> None:
        _deep_gemm.m_grouped_fp8_gemm_nt_masked(a, w, out, masked_m, expected_m)
