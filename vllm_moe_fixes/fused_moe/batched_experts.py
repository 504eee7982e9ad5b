"""Experts over the batched (masked) layout of DeepEP's low-latency dispatch.

Input a1q fp8 [E_l, T, K] (T = R*N rows per local expert, only the first expert_num_tokens[e]
valid). One `apply`, three launches:

    step                      reads                writes
    GEMM1 (w1)                a1q, a1q_scale       H  bf16 [E_l, T, 2I]   start of ws13
    silu_and_mul + requant    H (valid rows)       G' fp8 [E_l, T, I]     start of ws2
                                                   + f32 scales [E_l, T, I/128], MN-major per
                                                     expert (strides (T*I/128, 1, T)), after G'
    GEMM2 (w2)                G'                   Y  bf16 [E_l, T, K]    output = start of ws13

Every step touches only the valid rows of each expert: the GEMMs are masked, and the fused SiLU
kernel reads the counts on the device. Rows past a count are left as they were. Shapes in
vllm_moe_fixes.sizes.batched_workspace_shapes. No per-call allocation.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from vllm_moe_fixes._compat import deep_gemm as _deep_gemm
from vllm_moe_fixes.fused_moe import experts_steps as steps
from vllm_moe_fixes.fused_moe.interfaces import (
    ActivationFormat,
    Experts,
    one_op_when_compiled,
)
from vllm_moe_fixes.fused_moe.workspaces import views_cached_on
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, SCALE_BLOCK, mn_major_scales_view
from vllm_moe_fixes.sizes import batched_workspace_shapes


def _make_views(ws13: torch.Tensor, ws2: torch.Tensor, local_num_experts: int, t: int, I: int):
    """(H bf16 [E_l, T, 2I] at the start of ws13, G' fp8 [E_l, T, I] at the start of ws2, G''s
    float32 scales [E_l, T, I/128] MN-major per expert right after G')."""
    rows = local_num_experts * t
    h = ws13.view(-1)[:rows * 2 * I].view(local_num_experts, t, 2 * I)
    ws = ws2.view(-1).view(torch.uint8)
    g_q = ws[:rows * I].view(FP8_DTYPE).view(local_num_experts, t, I)
    g_s = mn_major_scales_view(ws2, rows * I, (local_num_experts, t, I // SCALE_BLOCK))
    return h, g_q, g_s


def workspace_views(ws13: torch.Tensor, ws2: torch.Tensor, local_num_experts: int, t: int,
                    I: int):
    """_make_views, cached on the workspaces (workspaces.views_cached_on)."""
    return views_cached_on(ws13, ws2, _make_views, local_num_experts, t, I)


class BatchedExperts(Experts):
    """Shared body of BatchedTritonExperts and BatchedDeepGemmExperts; subclasses give `gemm`.

    apply launches the kernels without the public ops' checks (host time counts in decode): the
    modular kernel validates the weights, and apply checks what only it knows.
    """

    activation_format = ActivationFormat.BATCHED

    @abstractmethod
    def gemm(self, a, w, out: torch.Tensor, masked_m: torch.Tensor, expected_m: int) -> None:
        """Masked grouped GEMM (DeepGEMM's contract, ops.grouped_fp8_gemm_masked)."""

    def check_rows_per_expert(self, t: int) -> None:
        """ValueError when the GEMM cannot take T = t rows per expert slice (default: any)."""

    def workspace_shapes(self, M, I, K, topk, local_num_experts, *, experts_pass_tokens=None):
        """M is T, the rows of each expert slice (vllm_moe_fixes.sizes); one pass takes every
        slice, so experts_pass_tokens is not read."""
        return batched_workspace_shapes(M, I, K, local_num_experts)

    @one_op_when_compiled
    def apply(self, output, a1q, a1q_scale, weights, *, workspace13, workspace2, topk_ids=None,
              expert_map=None, expert_num_tokens=None, topk_weights=None, expected_m=None,
              experts_pass_tokens=None, activation="silu", use_ue8m0=False) -> None:
        """a1q fp8 [E_l, T, K], a1q_scale f32 [E_l, T, K/128]; expert_num_tokens int32 [E_l];
        output bf16 [E_l, T, K] (valid rows written). expected_m: rows per expert the caller
        expects on average (the masked GEMM's tiling hint), None = T. use_ue8m0: G''s scales
        rounded up to powers of two (the prepare/finalize's use_ue8m0). topk_ids, expert_map,
        topk_weights and experts_pass_tokens are not needed: the combine after the experts weights
        and reduces, and every slice is one pass."""
        if activation != "silu":  # (tests/test_ep_kernel.py calls apply directly)
            raise ValueError(f"activation must be 'silu', got {activation!r}")
        if expert_num_tokens is None:
            raise ValueError("batched experts need expert_num_tokens (int32 [E_l])")
        local_num_experts, t, _ = a1q.shape
        self.check_rows_per_expert(t)
        masked_m = expert_num_tokens
        if masked_m.dtype != torch.int32 or not masked_m.is_contiguous():
            masked_m = masked_m.to(torch.int32).contiguous()
        expected_m = t if expected_m is None else expected_m
        h, g_q, g_s = workspace_views(workspace13, workspace2, local_num_experts, t,
                                      weights.w2.shape[2])
        self.gemm((a1q, a1q_scale), (weights.w1, weights.w1_scale), h, masked_m, expected_m)
        steps.silu_and_mul_quant(h, g_q, g_s, masked_m, use_ue8m0)
        self.gemm((g_q, g_s), (weights.w2, weights.w2_scale), output, masked_m, expected_m)


class BatchedTritonExperts(BatchedExperts):
    """Batched experts on the Triton masked GEMM of `ops.grouped_fp8_gemm_masked` (its torch
    reference on CPU)."""

    def gemm(self, a, w, out, masked_m, expected_m) -> None:
        steps.masked_gemm(a, w, out, masked_m)


class BatchedDeepGemmExperts(BatchedExperts):
    """Batched experts on DeepGEMM's masked grouped FP8 GEMM (I, K multiples of 128).

    expected_m (DeepGEMM's tiling hint) is what the modular kernel passes: the average rows per
    expert at full dispatch capacity (vllm_moe_fixes.sizes.expected_rows_per_expert), computed on
    the host without reading a count. Raises MissingLibraryError (an ImportError naming
    VLLM_USE_DEEP_GEMM and DeepGEMM) when DeepGEMM is not usable, RuntimeError on a GPU other
    than SM90.
    """

    # DeepGEMM's masked GEMM (SM90) stores whole output tiles of 64 or 128 rows into the flat
    # [E_l * T, I] view, bounded only by the view's end: with T not a multiple of the tile, an
    # expert's last tile overwrites the first rows of the next expert's slice. So T must be a
    # multiple of the largest tile.
    MASKED_TILE_ROWS = 128

    def __init__(self) -> None:
        _deep_gemm.require("BatchedDeepGemmExperts")

    def check_rows_per_expert(self, t: int) -> None:
        if t % self.MASKED_TILE_ROWS:
            raise ValueError(
                f"BatchedDeepGemmExperts needs T = num_dispatchers * max_tokens_per_rank rows per "
                f"expert slice to be a multiple of {self.MASKED_TILE_ROWS}, got T={t}: DeepGEMM's "
                "masked GEMM writes whole 128-row tiles (choose VLLM_MOE_DP_CHUNK_SIZE so that "
                "the rank count times it is a multiple of 128, or use BatchedTritonExperts)")

    def gemm(self, a, w, out, masked_m, expected_m) -> None:
        _deep_gemm.m_grouped_fp8_gemm_nt_masked(a, w, out, masked_m, expected_m)
