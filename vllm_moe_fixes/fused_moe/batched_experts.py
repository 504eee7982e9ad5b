"""Experts over the batched (masked) layout of DeepEP's low-latency dispatch.

Input a1q fp8 [E_l, T, K] (T = R*N rows per local expert, only the first expert_num_tokens[e]
valid). One `apply`:

    step          reads                     writes
    GEMM1 (w1)    a1q, a1q_scale            H  bf16 [E_l, T, 2N]   start of ws13
    silu_and_mul  H                         G  bf16 [E_l, T, N]    ws2 (all of it)
    requantise    G                         G' fp8 [E_l, T, N]     ws13 bytes after Y's
                                            + f32 scales [E_l, T, N/128], MN-major per expert
                                              (strides (T*N/128, 1, T)), ws13 bytes after G'
    GEMM2 (w2)    G'                        Y  bf16 [E_l, T, K]    output = start of ws13

The GEMMs are masked: they compute only the valid rows of each expert (rows past the count are
left as they were). The elementwise steps run over whole slices. Byte layout of ws13 after
silu_and_mul (every part 16-byte aligned, as K and N are multiples of 128):

    [Y: E_l*T*2K bytes][G': E_l*T*N bytes][scales: E_l*T*N/32 bytes]

so ws13 has max(2N, K + N/2 + N/64) bf16 elements per row (vllm_moe_fixes.sizes
.batched_workspace_shapes). The quant kernel writes scales with 2-D strides over the E_l*T
flattened rows, and per-expert MN-major (row e*T + t, group g at e*T*G + g*T + t) is not of the
form row*a + group*b, so it writes them row-major into Y's bytes (unused until GEMM2) and one small
copy (E_l*T*N/32 bytes) moves them into the MN-major region. No per-call allocation.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from vllm_moe_fixes._compat import deep_gemm as _deep_gemm
from vllm_moe_fixes.fused_moe.experts_selection import select_experts_of
from vllm_moe_fixes.fused_moe.modular_kernel import ActivationFormat, Experts
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, SCALE_BLOCK
from vllm_moe_fixes.ops.activation import silu_and_mul
from vllm_moe_fixes.ops.fp8_quant import per_token_group_quant_fp8
from vllm_moe_fixes.ops.grouped_gemm import grouped_fp8_gemm_masked
from vllm_moe_fixes.sizes import batched_workspace_shapes


def quant_batched_fp8(x: torch.Tensor, out_q: torch.Tensor | None = None,
                      out_s: torch.Tensor | None = None, tmp_s: torch.Tensor | None = None):
    """bf16 [E, T, K] -> (fp8 [E, T, K], float32 scales [E, T, K/128] with strides
    (T*K/128, 1, T): MN-major per expert, DeepEP's low-latency layout). 1x128 groups.

    out_q: fp8 [E, T, K] contiguous, out_s: float32 [E, T, K/128] with those strides, tmp_s:
    float32 [E*T, K/128] contiguous scratch for the row-major scales (the kernel cannot write
    per-expert MN-major directly, see the module docstring); each allocated when None.
    """
    e, t, k = x.shape
    q, s = per_token_group_quant_fp8(x.reshape(e * t, k), SCALE_BLOCK,
                                     out_q=None if out_q is None else out_q.view(e * t, k),
                                     out_s=tmp_s)
    if out_s is None:
        out_s = torch.empty(e, k // SCALE_BLOCK, t, dtype=torch.float32,
                            device=x.device).transpose(1, 2)
    out_s.copy_(s.view(e, t, k // SCALE_BLOCK))
    return q.view(e, t, k), out_s


def _align16(nbytes: int) -> int:
    return (nbytes + 15) // 16 * 16


class BatchedExperts(Experts):
    """Shared body of BatchedTritonExperts and BatchedDeepGemmExperts; subclasses give `gemm`."""

    activation_format = ActivationFormat.BATCHED

    @abstractmethod
    def gemm(self, a, w, out: torch.Tensor, masked_m: torch.Tensor, expected_m: int) -> None:
        """Masked grouped GEMM (DeepGEMM's contract, ops.grouped_fp8_gemm_masked)."""

    def workspace_shapes(self, M, N, K, topk, local_num_experts):
        """M is T, the rows of each expert slice (vllm_moe_fixes.sizes)."""
        return batched_workspace_shapes(M, N, K, local_num_experts)

    def apply(self, output, a1q, a1q_scale, w1, w2, w1_scale, w2_scale, topk_ids, expert_map,
              activation, workspace13, workspace2, expert_num_tokens, *, topk_weights=None,
              expected_m=None) -> None:
        """a1q fp8 [E_l, T, K], a1q_scale f32 [E_l, T, K/128]; expert_num_tokens int32 [E_l];
        output bf16 [E_l, T, K] (valid rows written). expected_m: rows per expert the caller
        expects on average (the masked GEMM's tiling hint), None = T. topk_ids, expert_map and
        topk_weights are not needed: the combine after the experts weights and reduces."""
        if activation != "silu":  # (tests/test_ep_kernel.py calls apply directly)
            raise ValueError(f"activation must be 'silu', got {activation!r}")
        if expert_num_tokens is None:
            raise ValueError("batched experts need expert_num_tokens (int32 [E_l])")
        e_l, t, _ = a1q.shape
        n = w2.shape[2]
        masked_m = expert_num_tokens.to(torch.int32).contiguous()
        h = workspace13.view(-1)[:e_l * t * 2 * n].view(e_l, t, 2 * n)
        expected_m = t if expected_m is None else expected_m
        self.gemm((a1q, a1q_scale), (w1, w1_scale), h, masked_m, expected_m)
        g = workspace2.view(-1)[:e_l * t * n].view(e_l, t, n)
        silu_and_mul(h.view(e_l * t, 2 * n), out=g.view(e_l * t, n))
        # G' right after Y's bytes, then its MN-major scales. The row-major scales the quant
        # kernel writes first go to the start of ws13 (H, dead after silu_and_mul; Y's bytes,
        # written only by GEMM2), and are dead once copied into the MN-major view.
        ws = workspace13.view(-1).view(torch.uint8)
        groups = n // SCALE_BLOCK
        start = _align16(e_l * t * output.shape[2] * output.element_size())
        g_q = ws[start:start + e_l * t * n].view(FP8_DTYPE).view(e_l, t, n)
        s_start = _align16(start + e_l * t * n)
        s_bytes = e_l * t * groups * 4
        g_s = ws[s_start:s_start + s_bytes].view(torch.float32).view(e_l, groups, t)
        tmp_s = ws[:s_bytes].view(torch.float32).view(e_l * t, groups) if s_bytes <= start \
            else None  # (only when N > 64K)
        g_q, g_s = quant_batched_fp8(g, out_q=g_q, out_s=g_s.transpose(1, 2), tmp_s=tmp_s)
        self.gemm((g_q, g_s), (w2, w2_scale), output, masked_m, expected_m)


class BatchedTritonExperts(BatchedExperts):
    """Batched experts on `ops.grouped_fp8_gemm_masked` (Triton on CUDA, torch reference on CPU)."""

    def gemm(self, a, w, out, masked_m, expected_m) -> None:
        grouped_fp8_gemm_masked(a, w, out, masked_m)


class BatchedDeepGemmExperts(BatchedExperts):
    """Batched experts on DeepGEMM's masked grouped FP8 GEMM (N, K multiples of 128).

    expected_m (DeepGEMM's tiling hint) is what the modular kernel passes: the average rows per
    expert at full dispatch capacity (vllm_moe_fixes.sizes.expected_rows_per_expert), computed on
    the host without reading a count. Raises RuntimeError (naming VLLM_USE_DEEP_GEMM and DeepGEMM) when DeepGEMM is not usable.
    """

    def __init__(self) -> None:
        _deep_gemm.require("BatchedDeepGemmExperts")

    def gemm(self, a, w, out, masked_m, expected_m) -> None:
        _deep_gemm.m_grouped_fp8_gemm_nt_masked(a, w, out, masked_m, expected_m)


def select_batched_experts(intermediate_size: int, hidden_size: int) -> BatchedExperts:
    """The batched experts the environment asks for: BatchedDeepGemmExperts when
    VLLM_USE_DEEP_GEMM, else BatchedTritonExperts (see `select_experts_of` for the errors and the
    warning on sizes that are not multiples of 128).

    Args:
        intermediate_size: N = I (w1 is [E_l, 2N, K], w2 is [E_l, K, N]).
        hidden_size: K.
    """
    return select_experts_of(BatchedTritonExperts, BatchedDeepGemmExperts, intermediate_size,
                             hidden_size)
