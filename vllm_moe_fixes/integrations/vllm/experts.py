"""This library's experts behind vLLM's ``FusedMoEExpertsModular``.

    vLLM                                        adapter                  ours
    cls(moe_config, quant_config,               checks the quantisation (a2_scale None) and the
        max_num_tokens, num_dispatchers)        activation once; w1/w2 scales <- quant_config
                                                (checked once per weight pair)
    workspace_shapes(M, N=2I, K, topk, E, E_l,  -> N // 2 = I            workspace_shapes(M, I,
                     meta, activation)                                   K, topk, E_l)
    apply(out, a1q, w1, w2, w, ids, act, E,     -> scales, "silu",       apply(out, a1q, a1q_scale,
          map, a1q_scale, a2_scale, ws13, ws2,     counts from meta,     w1, w2, w1_s, w2_s, ids,
          meta, on_input)                          expected_m            map, ...)
    finalize_weight_and_reduce_impl()           TopKWeightAndReduceNoOP (contiguous experts: they
                                                weight and sum the k slots into [M, K]) or
                                                ...Delegate (batched: the combine reduces)

vLLM hands the experts fresh workspace views on every call (its WorkspaceManager, or plain
tensors on CPU); when the output shape is the layer's, vLLM passes the layer's output itself. Our
experts carve their own views out of the workspaces once per workspace object
(``workspaces.views_cached_on``), so the adapter hands them the first view it was given of the same
memory and shape (``_stable_workspaces``): a fresh view each call costs a rebuild of those views,
tens of microseconds on the host.

``_supports_*`` (what vLLM's ``is_supported_config`` asks) declare exactly what the classes serve:
block FP8 128x128 weights with dynamic 1x128 FP8 activations, SiLU with a gate/up multiply,
hidden sizes multiples of 128, CUDA (Triton, or DeepGEMM on SM90) or CPU (the torch references,
Triton classes only), one rank or DeepEP high-throughput (standard) / DeepEP low-latency
(batched), with or without vLLM's EPLB (its physical experts are an ordinary layer to them:
support.py). ``unserved_reason`` adds what ``is_supported_config`` cannot see (intermediate size,
bias, LoRA, micro-batching, elastic EP...).
"""

from __future__ import annotations

import logging

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOP,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    kFp8Dynamic128Sym,
    kFp8Static128BlockSym,
)
from vllm.platforms import current_platform

from vllm_moe_fixes import envs
from vllm_moe_fixes import fused_moe as ours
from vllm_moe_fixes.fused_moe import kernel_checks
from vllm_moe_fixes.integrations.vllm.support import (
    activation_problem,
    moe_config_problem,
    parallel_config_problem,
    quant_config_problem,
    sizes_problem,
    vllm_rounds_scales_to_ue8m0,
)
from vllm_moe_fixes.sizes import expected_rows_per_expert


logger = logging.getLogger("vllm.plugins.vllm_moe_fixes")

# vLLM asks finalize_weight_and_reduce_impl twice per call; the reductions hold no state.
_REDUCED_BY_EXPERTS = TopKWeightAndReduceNoOP()
_REDUCED_BY_FINALIZE = TopKWeightAndReduceDelegate()


def _deep_gemm_usable() -> bool:
    """Whether this library's DeepGEMM experts can be built here (DeepGEMM importable, SM90)."""
    try:
        ours.DeepGemmExperts()
    except (ImportError, RuntimeError):  # DeepGEMM missing, or a GPU other than SM90
        return False
    return True


class VllmExperts(mk.FusedMoEExpertsModular):
    """What the four adapters share. A subclass names ``_ours`` (our Experts class), ``batched``
    (True: the batched layout of the low-latency dispatch) and ``_needs_deep_gemm``."""

    _ours: type
    batched: bool = False
    _needs_deep_gemm: bool = False
    _pending_experts_pass_tokens: int | None = None  # workspace_shapes reads it, apply takes it
    _MAX_CACHED = 64  # workspace shapes and views remembered (vLLM's CUDA graph sizes: ~67)
    # What vLLM's kernel reads on every call, as plain attributes instead of its properties:
    # a2_scale is None (refused otherwise when built); the input comes quantised unless our
    # prepare/finalize leaves the quant to these experts (VllmNoEPPrepareAndFinalize's
    # post_init_setup sets True on the instance).
    a2_scale = None
    expects_unquantized_inputs = False

    def __init__(self, moe_config, quant_config, max_num_tokens=None,
                 num_dispatchers=None) -> None:
        super().__init__(moe_config, quant_config, max_num_tokens, num_dispatchers)
        # What vLLM fixes per layer is checked here, once: the quantisation (a2_scale among it)
        # and the activation; apply checks only what a call can change.
        problem = quant_config_problem(quant_config) or activation_problem(moe_config)
        if problem is not None:
            raise ValueError(f"{type(self).__name__} serves block-FP8 128x128 SiLU-and-mul "
                             f"layers: {problem}")
        self.experts = self._ours()
        # vLLM's experts quantise activations (SiLU-and-mul's output, a deferred input) with
        # power-of-two scales where vLLM's E8M0 decision holds
        # (support.vllm_rounds_scales_to_ue8m0): ours follow it.
        self.use_ue8m0 = vllm_rounds_scales_to_ue8m0()
        self._weights = None  # the Fp8MoEWeights last checked (one layer: one pair, checked once)
        self._own_workspaces = None  # where vLLM's are on another device than the inputs
        self._shapes = {}  # workspace_shapes' answers by (M, N, K, topk, E_l, experts_pass_tokens)
        # vLLM's kernel takes workspaces from its WorkspaceManager on every platform but the CPU,
        # where it allocates them per call (_stable_workspaces keeps nothing there).
        self._workspaces_kept_by_vllm = not current_platform.is_cpu()
        self._workspace_views = {}  # _stable_workspaces: the first views of each memory and shape
        self._workspace_storage = None  # the address of the vLLM buffer those views are of

    # --- what vLLM's is_supported_config asks (it calls them on the class)
    @classmethod
    def _supports_current_device(cls) -> bool:
        if cls._needs_deep_gemm:
            return current_platform.is_cuda() and _deep_gemm_usable()
        return current_platform.is_cuda() or current_platform.is_cpu()

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return (weight_key, activation_key) == (kFp8Static128BlockSym, kFp8Dynamic128Sym)

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_shape(hidden_dim: int) -> bool:
        return sizes_problem(hidden_dim) is None

    @classmethod
    def _supports_parallel_config(cls, moe_parallel_config) -> bool:
        return parallel_config_problem(moe_parallel_config, cls.batched) is None

    @classmethod
    def unserved_reason(cls, moe_config) -> str | None:
        """What about the layer ``moe_config`` describes this class does not serve, beyond
        ``is_supported_config`` (sizes, bias, LoRA, DBO, placement; batched DeepGEMM's slice
        rows), or None."""
        problem = moe_config_problem(moe_config)
        if problem is None:
            problem = parallel_config_problem(moe_config.moe_parallel_config, cls.batched)
        return problem

    # --- the call
    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                         expert_tokens_meta, activation):
        """vLLM's N is w1's rows, 2I; ours take I. vLLM's kernel asks this twice per call (for
        its chunk and for the whole call, the same M in vLLM 0.33), then calls apply:
        VLLM_FUSED_MOE_CHUNK_SIZE is read at the first ask and kept for the second and for that
        apply (a read costs microseconds of host time; apply takes it)."""
        experts_pass_tokens = self._pending_experts_pass_tokens
        if experts_pass_tokens is None:
            experts_pass_tokens = self._pending_experts_pass_tokens = envs.VLLM_FUSED_MOE_CHUNK_SIZE
        if torch.compiler.is_compiling():  # M is symbolic: a dict lookup would fix its value
            return self.experts.workspace_shapes(M, N // 2, K, topk, local_num_experts,
                                                 experts_pass_tokens=experts_pass_tokens)
        key = (M, N, K, topk, local_num_experts, experts_pass_tokens)
        shapes = self._shapes.get(key)
        if shapes is None:
            if len(self._shapes) >= self._MAX_CACHED:
                self._shapes.clear()
            shapes = self._shapes[key] = self.experts.workspace_shapes(
                M, N // 2, K, topk, local_num_experts, experts_pass_tokens=experts_pass_tokens)
        return shapes

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input) -> None:
        """vLLM's apply: on the inputs' device (below), the weights checked once per pair, then
        the layout's own ``_apply_ours`` with the weights and their scales as one record."""
        if workspace13.device != hidden_states.device:  # see _apply_on_inputs_device
            return self._apply_on_inputs_device(dict(
                output=output, hidden_states=hidden_states, w1=w1, w2=w2,
                topk_weights=topk_weights, topk_ids=topk_ids, activation=activation,
                global_num_experts=global_num_experts, expert_map=expert_map,
                a1q_scale=a1q_scale, a2_scale=a2_scale, workspace13=workspace13,
                workspace2=workspace2, expert_tokens_meta=expert_tokens_meta,
                apply_router_weight_on_input=apply_router_weight_on_input))
        experts_pass_tokens = self._pending_experts_pass_tokens
        self._pending_experts_pass_tokens = None
        if experts_pass_tokens is None:  # called without workspace_shapes before it
            experts_pass_tokens = envs.VLLM_FUSED_MOE_CHUNK_SIZE
        if self._workspaces_kept_by_vllm and not torch.compiler.is_compiling():
            workspace13, workspace2 = self._stable_workspaces(workspace13, workspace2)
        self._apply_ours(output, hidden_states, self._checked_weights(hidden_states, w1, w2),
                         topk_weights=topk_weights, topk_ids=topk_ids,
                         global_num_experts=global_num_experts, expert_map=expert_map,
                         a1q_scale=a1q_scale, workspace13=workspace13, workspace2=workspace2,
                         expert_tokens_meta=expert_tokens_meta,
                         apply_router_weight_on_input=apply_router_weight_on_input,
                         experts_pass_tokens=experts_pass_tokens)

    def _apply_on_inputs_device(self, args: dict) -> None:
        """``apply(**args)`` in workspaces and an output on the inputs' device, then the output
        copied into vLLM's. vLLM's kernel takes workspaces from its WorkspaceManager on any
        platform but the CPU, on the one device the manager was made for, whatever the inputs'
        device; a layer computes where its inputs are (CPU inputs on a GPU machine: the
        adapters' CPU tests run there too). vLLM takes workspace2 and the output (a view of
        workspace13's memory, or the layer's output where it is on the same device) from the
        same manager, so workspace13's device stands for all three."""
        device = args["hidden_states"].device
        if self._own_workspaces is None:
            logger.info("vllm_moe_fixes: vLLM hands %s its workspaces on %s, the inputs are on "
                        "%s: the experts compute in their own workspaces there",
                        type(self).__name__, args["workspace13"].device, device)
            self._own_workspaces = ours.Workspaces()
        vllm_output = args["output"]
        ws13, ws2 = self._own_workspaces.get(tuple(args["workspace13"].shape),
                                             tuple(args["workspace2"].shape), device,
                                             args["workspace13"].dtype)
        output = torch.empty(vllm_output.shape, dtype=vllm_output.dtype, device=device)
        self.apply(**{**args, "output": output, "workspace13": ws13, "workspace2": ws2})
        vllm_output.copy_(output)

    def _checked_weights(self, hidden_states, w1, w2) -> ours.Fp8MoEWeights:
        """w1, w2 and quant_config's scales as one record, checked against the library's weight
        rules (w1 fp8 [E_l, 2I, K], w2 fp8 [E_l, K, I], contiguous, I and K multiples of 128, K
        that of hidden_states; scales float32 [E_l, 2I/128, K/128] / [E_l, K/128, I/128]) once
        per set of tensors: the layer passes its own weights on every call."""
        w1_scale, w2_scale = self.w1_scale, self.w2_scale
        weights = self._weights
        if (weights is not None and weights.w1 is w1 and weights.w2 is w2
                and weights.w1_scale is w1_scale and weights.w2_scale is w2_scale):
            return weights
        local_num_experts, i = kernel_checks.check_weights(w1, w2, hidden_states.shape[-1])
        kernel_checks.check_weight_scales(w1_scale, w2_scale, local_num_experts, i,
                                          hidden_states.shape[-1])
        self._weights = ours.Fp8MoEWeights(w1, w1_scale, w2, w2_scale)
        return self._weights

    def _stable_workspaces(self, workspace13, workspace2):
        """The first (workspace13, workspace2) vLLM handed over for the same memory and shapes.
        vLLM's WorkspaceManager gives fresh views of one buffer on every call; our experts cache
        the views they carve on the workspace objects (workspaces.views_cached_on), which a
        fresh object misses. The views kept hold vLLM's buffer: when vLLM replaces it (it grows
        before its manager is locked), this layer's first call that sees the new one lets the
        old go (vLLM's CPU kernel allocates per call: nothing is kept there). Not while
        torch.compile traces the call: a traced graph makes its views anew on every run."""
        key = (workspace13.data_ptr(), workspace13.shape, workspace2.data_ptr(),
               workspace2.shape, workspace13.dtype)
        views = self._workspace_views.get(key)
        if views is None:
            storage = workspace13.untyped_storage().data_ptr()
            if storage != self._workspace_storage or len(
                    self._workspace_views) >= self._MAX_CACHED:
                self._workspace_views.clear()
                self._workspace_storage = storage
            views = self._workspace_views[key] = (workspace13, workspace2)
        return views


class _ContiguousExperts(VllmExperts):
    """Standard layout: the experts weight and sum the k slots into the layer's [M, K]."""

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    def moe_problem_size(self, a1, w1, w2, topk_ids) -> tuple[int, int, int, int, int]:
        """vLLM's (E_l, M, N = 2I, K, topk) of a standard-layout call: a1 [M, K], topk_ids
        [M, topk], w1 [E_l, 2I, K] (checked once per weight set by apply), read from the shapes
        once each (vLLM's generic one asks size() six times)."""
        M, K = a1.shape
        rows, topk = topk_ids.shape
        if rows != M:
            raise ValueError(f"topk_ids must have a row per token of a1 ({M}), got {rows}")
        local_num_experts, N, _ = w1.shape
        return local_num_experts, M, N, K, topk

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return _REDUCED_BY_EXPERTS

    def _apply_ours(self, output, hidden_states, weights, topk_weights, topk_ids,
                    global_num_experts, expert_map, a1q_scale, workspace13, workspace2,
                    expert_tokens_meta, apply_router_weight_on_input, experts_pass_tokens) -> None:
        """output bf16 [M, K] <- sum over the k slots of weight * expert(hidden_states); slots
        whose expert is not local (expert_map -1, or id -1) add 0. hidden_states fp8 [M, K],
        a1q_scale f32 [M, K/128]; topk_ids int32/int64 [M, k] global ids; expert_map int32 [E]
        or None."""
        self.experts.apply(output, hidden_states, a1q_scale, weights,
                           workspace13=workspace13, workspace2=workspace2, topk_ids=topk_ids,
                           expert_map=expert_map,
                           topk_weights=None if apply_router_weight_on_input else topk_weights,
                           experts_pass_tokens=experts_pass_tokens, use_ue8m0=self.use_ue8m0)


class _BatchedExperts(VllmExperts):
    """Batched layout [E_l, T, K] of the low-latency dispatch; the combine weights and reduces."""

    batched = True

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.BatchedExperts

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return _REDUCED_BY_FINALIZE

    def _apply_ours(self, output, hidden_states, weights, topk_weights, topk_ids,
                    global_num_experts, expert_map, a1q_scale, workspace13, workspace2,
                    expert_tokens_meta, apply_router_weight_on_input, experts_pass_tokens) -> None:
        """output bf16 [E_l, T, K] (valid rows written) from hidden_states fp8 [E_l, T, K],
        a1q_scale f32 [E_l, T, K/128] and expert_tokens_meta.expert_num_tokens int32 [E_l]."""
        if expert_tokens_meta is None or expert_tokens_meta.expert_num_tokens is None:
            raise ValueError("batched experts need expert_tokens_meta.expert_num_tokens")
        t = hidden_states.shape[1]
        expected_m = expected_rows_per_expert(self.max_num_tokens, self.num_dispatchers,
                                              topk_ids.shape[1], global_num_experts, t)
        self.experts.apply(output, hidden_states, a1q_scale, weights,
                           workspace13=workspace13, workspace2=workspace2,
                           expert_num_tokens=expert_tokens_meta.expert_num_tokens,
                           expected_m=expected_m, experts_pass_tokens=experts_pass_tokens,
                           use_ue8m0=self.use_ue8m0)


class VllmTritonExperts(_ContiguousExperts):
    """``TritonExperts`` (Triton grouped FP8 GEMMs on CUDA, torch references on CPU)."""

    _ours = ours.TritonExperts


class VllmDeepGemmExperts(_ContiguousExperts):
    """``DeepGemmExperts`` (DeepGEMM's contiguous grouped GEMM, SM90)."""

    _ours = ours.DeepGemmExperts
    _needs_deep_gemm = True


class VllmBatchedTritonExperts(_BatchedExperts):
    """``BatchedTritonExperts`` (Triton masked grouped FP8 GEMMs; torch references on CPU)."""

    _ours = ours.BatchedTritonExperts


class VllmBatchedDeepGemmExperts(_BatchedExperts):
    """``BatchedDeepGemmExperts`` (DeepGEMM's masked grouped GEMM; slices of a multiple of 128
    rows)."""

    _ours = ours.BatchedDeepGemmExperts
    _needs_deep_gemm = True

    @classmethod
    def unserved_reason(cls, moe_config) -> str | None:
        problem = super().unserved_reason(moe_config)
        rows = moe_config.max_num_tokens * moe_config.moe_parallel_config.ep_size
        if problem is None and rows % cls._ours.MASKED_TILE_ROWS:
            problem = (f"T = ep_size * max_num_tokens = {rows} rows per expert slice is not a "
                       f"multiple of {cls._ours.MASKED_TILE_ROWS} (DeepGEMM's masked GEMM)")
        return problem


# The plugin's name map: the experts the library's factory picks -> their adapter.
ADAPTER_OF_EXPERTS = {cls._ours: cls for cls in (VllmTritonExperts, VllmDeepGemmExperts,
                                                 VllmBatchedTritonExperts,
                                                 VllmBatchedDeepGemmExperts)}
