"""Experts over the expert-contiguous layout: DeepGEMM or Triton grouped FP8 GEMMs.

`TritonExperts` and `DeepGemmExperts` share everything but the GEMM call. One `apply`, four or
five launches besides the two GEMMs:

    step                      reads                    writes (inside the two workspaces)
    layout (1 or 2 kernels)   topk_ids [M, k]          int32 index vectors       (tail of ws2)
    permute a1q               a1q [M, K] fp8           A  fp8 [M_sum, K] + scales  (ws13 bytes)
      or quant + permute      a1 [M, K] bf16           the same A (prepare deferred its quant)
    GEMM1 (w1)                A                        H  bf16 [M_sum, 2I]         (ws2)
    silu_and_mul + requant    H                        G' fp8 [M_sum, I] + scales  (ws13 bytes)
    GEMM2 (w2)                G'                       Y  bf16 [M_sum, K]          (ws2)
    un-permute + reduce       Y, topk_weights          output [M, K]

Each step reads only what the previous one wrote, so two buffers suffice (shapes in
vllm_moe_fixes.sizes.contiguous_workspace_shapes). The layout's index vectors sit after H's and
Y's columns in ws2 and live through the whole call. The output is the layer's output or a view of
the start of ws13 (G' is dead once GEMM2 has run). M_sum counts the LOCAL experts
(ops/permute.py). No allocation per call.

Passes: apply takes what the rank received in passes of at most `experts_pass_tokens` tokens (the
modular kernel passes VLLM_FUSED_MOE_CHUNK_SIZE, read once per layer call, to workspace_shapes and
apply alike: the most tokens one pass of the experts takes), so the workspaces are
sized by that bound and not by the received count, whatever the routing: with high-throughput EP
and skewed ids one rank can receive every token of the group. Each pass runs the table above on
its tokens (a token's k slots stay in one pass) with one pass's A, G', H and Y, after the [M, K]
output in ws13, which is then no longer shared with A and G'. Every kernel computes each slot's
row and each token's sum on its own (no GEMM tile spans two experts, the per-row quantisations
read their row only, the sum runs over a token's slots in slot order), and so does every torch
reference on CPU, so the passes give the bits of one pass. M comes from topk_ids' shape, which
the dispatch already read on the host: no host synchronisation is added. When the received tokens
fit in one pass, apply is the one pass it was.

The experts reduce (`reduces_output`): the un-permute reads each token's k rows of Y through the
layout and sums them with the router weights, so finalize receives [M, K].

Unquantised input (`takes_unquantized_input`): apply also takes a1q bf16 [M, K] with a1q_scale
None, from a prepare that leaves the quant to the experts (NoEPPrepareAndFinalize with
defer_input_quant=True). The permute step then quantises each token row once and writes it to
its k rows (ops/quant_permute.py): one kernel instead of the prepare's quant and the permute, and
the same bits.

The GEMMs get the layout twice: m_indices (a row's expert, -1 on padding) and expert_ends (each
expert's last row + 1, DeepGEMM's psum layout). DeepGEMM's SM90 kernel loads A, its scales and B
for every 128-row block of M_sum it is given in the m_indices form, padding blocks included (it
only skips their math); in the psum form its scheduler visits only the blocks that hold slots, so
DeepGemmExperts passes expert_ends where the build takes use_psum_layout (as vLLM's own
DeepGemmExperts does on SM90). Padding rows of H, G' and Y may then hold anything (blocks past
an expert's slots are not written, and the SiLU step skips padding rows through the same ends);
nothing reads them (the un-permute reads slots' rows only). DeepGemmExperts also pass DeepGEMM
the slots per expert (M*k / E_l) as its expected M: without it DeepGEMM sizes its tiles for one
group of M_sum rows, padding included. DeepGEMM's PDL setting for the two GEMMs comes from one
rule, deep_gemm_pdl.
"""

from __future__ import annotations

import contextlib
import math
from abc import abstractmethod
from typing import NamedTuple

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
from vllm_moe_fixes.ops.permute import ContiguousLayout, carve_layout
from vllm_moe_fixes.sizes import (
    LAYOUT_INDEX_COLUMNS,
    cdiv,
    ROW_ALIGNMENT,
    contiguous_num_rows,
    contiguous_workspace_shapes,
)


def _byte_view(ws: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype):
    """A `dtype` tensor of `shape` over ws's bytes [offset, offset + size)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return ws.view(-1).view(torch.uint8)[offset:offset + nbytes].view(dtype).view(shape)


def _fp8_with_mn_major_scales(ws: torch.Tensor, rows: int, cols: int):
    """fp8 [rows, cols] at the start of ws, then float32 scales [rows, cols/128] with strides
    (1, rows) right after (rows is a multiple of 128, so the scales are 16-byte aligned)."""
    q = _byte_view(ws, 0, (rows, cols), FP8_DTYPE)
    s = mn_major_scales_view(ws, rows * cols, (rows, cols // SCALE_BLOCK))
    return q, s


class _Views(NamedTuple):
    """The tensors of one apply, as views of the two workspaces."""

    layout: ContiguousLayout
    counts: torch.Tensor  # int32 [n_chunks * E_l], the layout kernels' scratch
    a: tuple[torch.Tensor, torch.Tensor]  # A fp8 [M_sum, K], scales [M_sum, K/128] MN-major
    h: torch.Tensor  # H bf16 [M_sum, 2I]
    g: tuple[torch.Tensor, torch.Tensor]  # G' fp8 [M_sum, I], scales [M_sum, I/128] MN-major
    y: torch.Tensor  # Y bf16 [M_sum, K]


def _make_views(ws13: torch.Tensor, ws2: torch.Tensor, num_slots: int, local_num_experts: int,
                K: int, I: int, offset13: int) -> _Views:
    """The views of the module docstring's table for one pass of num_slots = M*k slots: M_sum
    rows, A and G' from bf16 element offset13 of ws13 on, the index vectors at the end of ws2."""
    m_sum = contiguous_num_rows(num_slots, local_num_experts)
    index_numel = m_sum * LAYOUT_INDEX_COLUMNS  # bf16 elements = 2x as many int32
    flat2 = ws2.view(-1)
    layout, counts = carve_layout(flat2[flat2.numel() - index_numel:].view(torch.int32),
                                  num_slots, local_num_experts)
    scratch13 = ws13.view(-1)[offset13:]
    return _Views(layout=layout, counts=counts, a=_fp8_with_mn_major_scales(scratch13, m_sum, K),
                  h=flat2[:m_sum * 2 * I].view(m_sum, 2 * I),
                  g=_fp8_with_mn_major_scales(scratch13, m_sum, I),
                  y=flat2[:m_sum * K].view(m_sum, K))


def workspace_views(ws13: torch.Tensor, ws2: torch.Tensor, num_slots: int,
                    local_num_experts: int, K: int, I: int, offset13: int = 0) -> _Views:
    """_make_views, cached on the workspaces (workspaces.views_cached_on). offset13: where one
    pass's A and G' start in ws13 (bf16 elements): 0 for one pass, M*K for several."""
    return views_cached_on(ws13, ws2, _make_views, num_slots, local_num_experts, K, I, offset13)


class ContiguousExperts(Experts):
    """Shared body of TritonExperts and DeepGemmExperts; subclasses provide `gemm`.

    apply trusts its arguments (the modular kernel validates them at its edge) and launches the
    kernels directly, without the public ops' checks: host time counts at small M.
    """

    activation_format = ActivationFormat.STANDARD
    reduces_output = True
    takes_unquantized_input = True  # apply takes bf16 a1q with a1q_scale None (module docstring)

    @abstractmethod
    def gemm(self, a: tuple[torch.Tensor, torch.Tensor], w: tuple[torch.Tensor, torch.Tensor],
             out: torch.Tensor, m_indices: torch.Tensor,
             expert_ends: torch.Tensor | None = None, expected_m: int | None = None) -> None:
        """Contiguous grouped GEMM, DeepGEMM's contract (ops.grouped_fp8_gemm_contiguous).
        expert_ends: the same layout as int32 [E_l] psum ends (ContiguousLayout.expert_ends), for
        a GEMM that skips the blocks past each expert's slots; None: m_indices only.
        expected_m: slots per local expert on average (a tiling hint; None: not known)."""

    def workspace_shapes(self, M, I, K, topk, local_num_experts, *, experts_pass_tokens=None):
        """sizes.contiguous_workspace_shapes for M received tokens in passes of experts_pass_tokens:
        one pass's workspaces (plus the [M, K] output in ws13 when there are several)."""
        return contiguous_workspace_shapes(M, I, K, topk, local_num_experts, experts_pass_tokens)

    @one_op_when_compiled
    def apply(self, output, a1q, a1q_scale, weights, *, workspace13, workspace2, topk_ids=None,
              expert_map=None, expert_num_tokens=None, topk_weights=None, expected_m=None,
              experts_pass_tokens=None, activation="silu", use_ue8m0=False) -> None:
        """output bf16 [M, K] (written: the weighted sum of each token's k expert rows; slots
        with no local expert add 0); topk_weights float32 [M, k] or None (plain sum); a1q fp8
        [M, K] with a1q_scale float32 [M, K/128], or a1q bf16 [M, K] with a1q_scale None (the
        experts quantise it); use_ue8m0: the scales of that quant and of G''s rounded up to
        powers of two (the prepare/finalize's use_ue8m0).

        M tokens are taken in passes of at most experts_pass_tokens (module docstring; None: one
        pass); the workspaces are those workspace_shapes declares for M and the same bound."""
        M = topk_ids.shape[0]
        shared = dict(weights=weights, expert_map=expert_map, workspace13=workspace13,
                      workspace2=workspace2, use_ue8m0=use_ue8m0)
        if experts_pass_tokens is None or M <= experts_pass_tokens:
            self._apply_pass(output, a1q, a1q_scale, topk_ids, topk_weights, offset13=0,
                             **shared)
            return
        offset13 = M * weights.w2.shape[1]  # one pass's A and G' sit after the [M, K] output
        for start in range(0, M, experts_pass_tokens):
            rows = slice(start, min(start + experts_pass_tokens, M))
            self._apply_pass(output[rows], a1q[rows],
                             None if a1q_scale is None else a1q_scale[rows], topk_ids[rows],
                             None if topk_weights is None else topk_weights[rows],
                             offset13=offset13, **shared)

    def _apply_pass(self, output, a1q, a1q_scale, topk_ids, topk_weights, *, weights,
                    expert_map, workspace13, workspace2, offset13, use_ue8m0) -> None:
        """The module docstring's table for one pass's tokens (apply's arguments, sliced)."""
        local_num_experts, K, I = weights.w2.shape
        v = workspace_views(workspace13, workspace2, topk_ids.numel(), local_num_experts, K, I,
                            offset13)
        m_indices = v.layout.m_indices
        ends = v.layout.expert_ends
        gemm = dict(m_indices=m_indices, expert_ends=ends,
                    expected_m=cdiv(topk_ids.numel(), local_num_experts))
        steps.build_layout(topk_ids, local_num_experts, expert_map, v.layout, v.counts)
        if a1q_scale is None:
            steps.quant_permute(a1q, v.layout, *v.a, use_ue8m0)
        else:
            steps.permute(a1q, a1q_scale, v.layout, *v.a)
        with self.launch_settings(topk_ids.numel()):
            self.gemm(v.a, (weights.w1, weights.w1_scale), v.h, **gemm)
            steps.silu_and_mul_quant(v.h, *v.g, None, use_ue8m0, expert_ends=ends)
            self.gemm(v.g, (weights.w2, weights.w2_scale), v.y, **gemm)
        steps.unpermute_reduce(v.y, v.layout.dest, topk_weights, output)

    def launch_settings(self, num_slots: int):
        """A context for the GEMMs of a pass of num_slots slots (default: none)."""
        return contextlib.nullcontext()


class TritonExperts(ContiguousExperts):
    """Experts on the Triton grouped GEMM of `ops.grouped_fp8_gemm_contiguous` (its torch
    reference on CPU: experts_steps.contiguous_gemm)."""

    def gemm(self, a, w, out, m_indices, expert_ends=None, expected_m=None) -> None:
        steps.contiguous_gemm(a, w, out, m_indices)


class DeepGemmExperts(ContiguousExperts):
    """Experts on DeepGEMM's contiguous grouped FP8 GEMM (SM90/SM100; I, K multiples of 128).

    Raises MissingLibraryError (an ImportError naming VLLM_USE_DEEP_GEMM and DeepGEMM) when
    DeepGEMM is not usable; RuntimeError on a GPU other than SM90, or when its contiguous layout
    wants another segment alignment than the one ops/permute.py builds.
    """

    def __init__(self) -> None:
        _deep_gemm.require("DeepGemmExperts")
        alignment = _deep_gemm.get_m_alignment_for_contiguous_layout()
        if alignment != ROW_ALIGNMENT:
            raise RuntimeError(f"this DeepGEMM build aligns expert segments to {alignment} rows; "
                               f"the contiguous layout here aligns them to {ROW_ALIGNMENT}")

    def gemm(self, a, w, out, m_indices, expert_ends=None, expected_m=None) -> None:
        _deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, w, out, m_indices, expert_ends,
                                                     expected_m=expected_m)

    def launch_settings(self, num_slots: int):
        """DeepGEMM's PDL as deep_gemm_pdl chooses for num_slots, the process's setting after."""
        return _deep_gemm.pdl_set_to(deep_gemm_pdl(num_slots))


def deep_gemm_pdl(num_slots: int) -> bool:
    """Whether DeepGemmExperts launch their GEMMs with DeepGEMM's programmatic dependent launch
    (PDL) for a pass of num_slots (M*topk) slots: the one rule for it, for eager calls and CUDA-graph
    captures alike (a capture records the launches as this rule made them). On at every size
    measured: on the H200 (DeepSeek-V3 shapes, 128 to 8192 tokens; benchmarks.bench_gpu_time) PDL
    was never slower than without it, eager or replayed, and saved about 1% of the layer's GPU
    time at 8192 tokens."""
    return True
