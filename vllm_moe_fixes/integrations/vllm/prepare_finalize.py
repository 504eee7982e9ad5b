"""This library's prepare/finalize classes behind vLLM's ``FusedMoEPrepareAndFinalizeModular``.

    vLLM's FusedMoEKernel                 adapter                      ours
    prepare(a1, w, ids, E, map, on_input,  -> check quant_config   -> prepare(...) -> PrepareResult
            quant_config, defer)              (once per object), a1
                                           <- (a1q, a1q_scale, ExpertTokensMetadata|None, ids|None,
                                               weights|None)
    finalize(out, fused, w, ids, on_input, -> NoOP: reduced           finalize(...,
             weight_and_reduce_impl)          Contiguous / Delegate:   output_is_reduced=...)
                                              unreduced [M', k, K]

vLLM's conventions that differ from ours, translated here:
- ``finalize`` learns from the experts' ``TopKWeightAndReduce`` whether they already weighted
  and summed the k slots (NoOP) or left [M', k, K] (Contiguous; Delegate on the standard layout);
  ours take ``output_is_reduced``. The low-latency combine always weights and reduces: it takes
  Delegate only, as vLLM's own does.
- High-throughput and DeepEP V2 prepare return vLLM's ids: an id the dispatch marked -1
  (expert elsewhere) becomes a global id of another rank (E - 1 on rank 0, else 0), which the
  layer's expert_map maps to -1. Ours mean the same with -1.
- The input quant: paired with our contiguous experts, the one-rank adapter leaves it to them
  (``post_init_setup``): they ask for it through vLLM's ``expects_unquantized_inputs``, which
  vLLM's kernel passes to prepare as ``defer_input_quant``, as in our own one-rank layer.
- ``ExpertTokensMetadata`` is built directly (its ``make_from_list`` pins host memory, which
  fails without an accelerator).
- Activation scales: vLLM's prepare/finalizes quantise with power-of-two scales where
  ``is_deep_gemm_e8m0_used()`` holds (support.vllm_rounds_scales_to_ue8m0); the one-rank,
  high-throughput and V2 adapters build ours with that use_ue8m0. The low-latency dispatch's
  cast keeps exact scales, as vLLM's own does (it rounds there only for experts that take packed
  UE8M0 scales, Blackwell's DeepGEMM, none of ours).

Asynchronous prepare/finalize (vLLM's shared-expert overlap and dual-batch overlap, DBO): the
dispatch adapters (high-throughput, low-latency, V2) answer ``supports_async()`` with True and
return vLLM's ``(hook, receiver)`` pairs from ``prepare_async`` / ``finalize_async``: the hook
waits for our receiver (the transfer), the receiver converts. Under DBO vLLM registers the hook
and yields to the other micro-batch, so its work runs while the transfer is under way. Each
prepare's dispatch handle is kept per micro-batch (vLLM's ``dbo_current_ubatch_id``) and handed
to that micro-batch's finalize; the received counts are read when the dispatch returns. The
one-rank adapter has nothing to transfer: ``supports_async()`` is False there, as before (vLLM
then runs shared experts after the layer and asserts that micro-batching is off).

Quantisation parameters come in ``quant_config``; a configuration other than block FP8 128x128 with
dynamic 1x128 activations raises ValueError naming what differs. vLLM's routing tables (built for
round-robin placement only, EPLB or not: support.check_no_routing_tables) are refused at
construction.
"""

from __future__ import annotations

import logging
import math

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.v1.worker.ubatching import dbo_current_ubatch_id
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOP,
)

from vllm_moe_fixes import envs
from vllm_moe_fixes.fused_moe import (
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
    DeepEPV2PrepareAndFinalize,
    NoEPPrepareAndFinalize,
)
from vllm_moe_fixes.fused_moe.interfaces import completed
from vllm_moe_fixes.integrations.vllm.experts import VllmExperts
from vllm_moe_fixes.integrations.vllm.support import (
    check_deepep_buffer,
    check_no_routing_tables,
    quant_config_problem,
    vllm_rounds_scales_to_ue8m0,
)
from vllm_moe_fixes.ops import SCALE_BLOCK
from vllm_moe_fixes.sizes import cdiv

logger = logging.getLogger("vllm.plugins.vllm_moe_fixes")


def output_is_reduced(weight_and_reduce_impl: mk.TopKWeightAndReduce) -> bool:
    """Whether the experts that chose ``weight_and_reduce_impl`` already weighted and summed the
    k slots (NoOP) or left them to finalize (Contiguous, Delegate)."""
    if isinstance(weight_and_reduce_impl, TopKWeightAndReduceNoOP):
        return True
    if isinstance(weight_and_reduce_impl, (TopKWeightAndReduceContiguous,
                                           TopKWeightAndReduceDelegate)):
        return False
    raise ValueError(f"weight_and_reduce_impl={type(weight_and_reduce_impl).__name__}: a "
                     "standard-layout finalize takes TopKWeightAndReduceNoOP, ...Contiguous or "
                     "...Delegate")


def _unreduced_view(fused_expert_output: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """[M', k, K] view of an unreduced experts output given as [M' * k, K] or [M', k, K]."""
    m, k = topk_ids.shape
    return fused_expert_output.view(m, k, fused_expert_output.shape[-1])


class _VllmPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    """What every adapter checks of what vLLM hands ``prepare``, and the one path of prepare and
    finalize: vLLM's (hook, receiver) pairs over ours' prepare_async / finalize_async (module
    docstring), the synchronous calls being the pairs run at once."""

    _checked_quant_config = None  # the last FusedMoEQuantConfig found block-FP8 128x128
    ours = None  # our prepare/finalize

    def __init__(self) -> None:
        super().__init__()
        self._handles: dict = {}  # micro-batch -> its last dispatch handle, prepare to finalize

    def supports_async(self) -> bool:
        return self.ours.supports_async()

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input, quant_config, defer_input_quant=False):
        """prepare_async's hook and receiver, at once (the tuple _converted documents)."""
        hook, receiver = self.prepare_async(a1, topk_weights, topk_ids, num_experts, expert_map,
                                            apply_router_weight_on_input, quant_config,
                                            defer_input_quant)
        hook()
        return receiver()

    def prepare_async(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                      apply_router_weight_on_input, quant_config, defer_input_quant=False):
        """Start ours' dispatch; return (hook: waits for it, receiver: vLLM's prepare tuple)."""
        self._check_prepare_inputs(a1, quant_config, defer_input_quant)
        receive = self.ours.prepare_async(a1, topk_weights, topk_ids, num_experts, expert_map,
                                          apply_router_weight_on_input)
        dispatched = self._dispatch_state()
        ubatch, received = dbo_current_ubatch_id(), []

        def hook() -> None:
            if not received:
                received.append(receive())
                self._handles[ubatch] = received[0].handle

        def receiver():
            hook()
            return self._converted(received[0], a1, topk_ids, num_experts, dispatched)

        return hook, receiver

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, weight_and_reduce_impl) -> None:
        """finalize_async's hook and receiver, at once."""
        hook, receiver = self.finalize_async(output, fused_expert_output, topk_weights, topk_ids,
                                             apply_router_weight_on_input, weight_and_reduce_impl)
        hook()
        receiver()

    def finalize_async(self, output, fused_expert_output, topk_weights, topk_ids,
                       apply_router_weight_on_input, weight_and_reduce_impl):
        """Start ours' combine of this micro-batch (its prepare's handle); return (hook: waits
        for it and writes output, receiver: nothing left)."""
        fused_expert_output, reduced = self._finalize_input(fused_expert_output, topk_ids,
                                                            weight_and_reduce_impl)
        handle = self._handles.pop(dbo_current_ubatch_id(), None)
        hook = self.ours.finalize_async(output, fused_expert_output, topk_weights, topk_ids,
                                        apply_router_weight_on_input, output_is_reduced=reduced,
                                        handle=handle)
        return hook, completed  # the hook writes output

    def _dispatch_state(self):
        """What the conversion needs of the dispatch, read as it returns (a later micro-batch's
        dispatch may change it before this one's receiver runs); None by default."""
        return None

    def _check_prepare_inputs(self, a1: torch.Tensor, quant_config,
                              defer_input_quant: bool) -> None:
        """The quantisation once per quant_config object (vLLM builds it once per layer and
        passes the experts' own on every call), then what a call can change: the
        defer_input_quant flag (vLLM's kernel passes its experts' expects_unquantized_inputs:
        it must be what ours does) and a1, bfloat16 [M, K] with contiguous channels and K a
        multiple of 128 (the quantisation launch on CUDA relies on it)."""
        if quant_config is not self._checked_quant_config:
            problem = quant_config_problem(quant_config)
            if problem is not None:
                raise ValueError(f"vllm_moe_fixes prepare/finalize serves block-FP8 128x128 "
                                 f"layers: {problem}")
            self._checked_quant_config = quant_config
        if defer_input_quant != self.ours.defer_input_quant:
            raise ValueError(
                f"defer_input_quant={defer_input_quant}: this prepare/finalize "
                + ("leaves the input quant to its experts (post_init_setup paired it with our "
                   "contiguous experts)" if self.ours.defer_input_quant else
                   "always quantises the input (pair it with experts that take FP8 "
                   "activations)"))
        if not (a1.dim() == 2 and a1.dtype == torch.bfloat16 and a1.shape[1] % SCALE_BLOCK == 0
                and (a1.stride(1) == 1 or a1.shape[1] <= 1)):
            raise ValueError(f"a1 must be bfloat16 [M, K] with contiguous channels and K a "
                             f"multiple of {SCALE_BLOCK}, got {a1.dtype} {tuple(a1.shape)} "
                             f"strides {a1.stride()}")


class _StandardAdapter(_VllmPrepareAndFinalize):
    """What the two standard-layout adapters share: format, finalize's reduction mapping."""

    def __init__(self, ours) -> None:
        super().__init__()
        self.ours = ours

    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    def max_num_tokens_per_rank(self) -> int | None:
        return None

    def num_dispatchers(self) -> int:
        return self.ours.num_dispatchers()

    def _finalize_input(self, fused_expert_output, topk_ids, weight_and_reduce_impl):
        """(ours' fused_expert_output, output_is_reduced) of vLLM's: [M', K] reduced (NoOP,
        possibly the layer's output itself) or [M', k, K] / [M' * k, K] unreduced; topk_ids
        [M', k] as prepare returned them (else the router's)."""
        reduced = output_is_reduced(weight_and_reduce_impl)
        if not reduced:
            fused_expert_output = _unreduced_view(fused_expert_output, topk_ids)
        return fused_expert_output, reduced


class VllmNoEPPrepareAndFinalize(_StandardAdapter):
    """``NoEPPrepareAndFinalize`` for vLLM: one rank, quantise in, weighted sum out (nothing to do
    when the experts reduced into the layer's output)."""

    def __init__(self) -> None:
        super().__init__(NoEPPrepareAndFinalize(use_ue8m0=vllm_rounds_scales_to_ue8m0()))

    @classmethod
    def for_vllm_layer(cls, moe_config, buffer, **wiring):
        """The adapter for the factory's wiring (no buffer, no arguments)."""
        return cls(**wiring)

    def post_init_setup(self, fused_experts) -> None:
        """vLLM's FusedMoEKernel hands over its experts when built. Our contiguous experts
        quantise the input where they permute it (one kernel instead of prepare's quant and the
        permute, the same bits), as in the one-rank layer make_moe_kernel builds: with them
        prepare hands a1 on as it is, and they answer vLLM's expects_unquantized_inputs with
        True, which vLLM's kernel passes to prepare as defer_input_quant."""
        if isinstance(fused_experts, VllmExperts) and \
                self.ours.defer_input_quant_to(fused_experts.experts):
            fused_experts.expects_unquantized_inputs = True

    def topk_indices_dtype(self) -> torch.dtype | None:
        return None

    def output_is_reduced(self) -> bool:
        return False  # no all-reduce across ranks happened (vLLM's tensor parallel one follows)

    def _converted(self, res, a1, topk_ids, num_experts, dispatched):
        """a1 bf16 [M, K] -> (a1q fp8 [M, K], a1q_scale f32 [M, K/128], None, None, None), or
        with defer_input_quant (post_init_setup) (a1 bf16 [M, K] (times the router weight with
        apply_router_weight_on_input), None, None, None, None)."""
        return res.a1q, res.a1q_scale, None, None, None


class _StandardDispatchAdapter(_StandardAdapter):
    """What the two standard-layout DeepEP adapters (high-throughput, V2) share: int64 ids
    in, a reduced output out of combine, prepare's result in vLLM's convention, and a log line
    of the experts' workspace bytes each time this rank receives more tokens than ever before
    (routing may send one rank every token of the group, as vLLM's profile run with all-zero ids
    does; our contiguous experts then take them in passes of VLLM_FUSED_MOE_CHUNK_SIZE tokens,
    which bounds those bytes)."""

    _experts = None  # vLLM's experts of this kernel, from post_init_setup
    _most_received = 0

    def post_init_setup(self, fused_experts) -> None:
        """vLLM's FusedMoEKernel hands over its experts when built: kept for the log."""
        self._experts = fused_experts

    def _log_workspaces(self, received: int, a1: torch.Tensor, topk: int) -> None:
        """Log what vLLM's kernel allocates for ``received`` tokens: max(workspace13, output) and
        workspace2, in the experts' workspace dtype (``FusedMoEKernel``'s allocation)."""
        experts = self._experts
        local_num_experts, _, intermediate_blocks = experts.w2_scale.shape  # [E_l, K/128, I/128]
        ws13, ws2, out = experts.workspace_shapes(
            received, 2 * intermediate_blocks * SCALE_BLOCK, a1.shape[1], topk,
            local_num_experts * self.num_dispatchers(), local_num_experts, None, None)
        nbytes = ((max(math.prod(ws13), math.prod(out)) + math.prod(ws2))
                  * experts.workspace_dtype(a1.dtype).itemsize)
        rank = self.ours.rank_expert_offset // local_num_experts  # rank r holds [r*E_l, ...)
        step = envs.VLLM_FUSED_MOE_CHUNK_SIZE  # the contiguous experts' bound
        logger.info("vllm_moe_fixes: rank %d received %d tokens (this layer's most so far): "
                    "experts' workspaces %d bytes, %d pass(es) of at most %d tokens "
                    "(VLLM_FUSED_MOE_CHUNK_SIZE)", rank, received, nbytes, cdiv(received, step),
                    step)

    def topk_indices_dtype(self) -> torch.dtype | None:
        return torch.int64

    def output_is_reduced(self) -> bool:
        return True

    def _dispatch_state(self) -> list[int]:
        """The received counts per local expert ([] where V2 ran without the CPU sync)."""
        return list(self.ours.num_recv_tokens_per_expert)

    def _converted(self, res, a1, topk_ids, num_experts, dispatched):
        """a1 bf16 [M, K] -> the M' tokens received: (a1q fp8 [M', K], a1q_scale f32
        [M', K/128], ExpertTokensMetadata (int32 [E_l] received per local expert, on the device
        and on the host; None where V2 dispatched without the CPU sync), topk_ids int64 [M', k]
        global ids in vLLM's convention (module docstring), topk_weights f32 [M', k] (0 where
        the expert is elsewhere))."""
        elsewhere = num_experts - 1 if self.ours.rank_expert_offset == 0 else 0
        ids = torch.where(res.topk_ids >= 0, res.topk_ids, elsewhere)
        meta = None
        if dispatched:  # [] where V2 ran without the CPU sync
            counts = torch.tensor(dispatched, dtype=torch.int32)
            meta = mk.ExpertTokensMetadata(expert_num_tokens=counts.to(res.a1q.device),
                                           expert_num_tokens_cpu=counts)
        received = res.a1q.shape[0]
        if received > self._most_received and self._experts is not None:
            self._most_received = received
            self._log_workspaces(received, a1, topk_ids.shape[1])
        return res.a1q, res.a1q_scale, meta, ids, res.topk_weights


class VllmDeepEPHTPrepareAndFinalize(_StandardDispatchAdapter):
    """``DeepEPHTPrepareAndFinalize`` for vLLM over vLLM's high-throughput DeepEP buffer.

    Arguments (what vLLM's ``maybe_make_prepare_finalize`` knows):
        buffer: the ``deep_ep.Buffer`` of vLLM's all2all manager (or a ``TorchAll2AllBuffer``).
        num_dispatchers: ranks of the expert-parallel group (R).
        rank_expert_offset: this rank's first global expert id (rank * E_l).
        hidden: K; num_experts: global E. With them, DeepEP's refusals and the NVLink / RDMA
            sizes run against ``buffer`` here, before the first forward (``check_deepep_buffer``).
    """

    def __init__(self, buffer, *, num_dispatchers: int, rank_expert_offset: int, hidden: int,
                 num_experts: int) -> None:
        super().__init__(DeepEPHTPrepareAndFinalize(
            buffer, num_dispatchers=num_dispatchers, rank_expert_offset=rank_expert_offset,
            use_ue8m0=vllm_rounds_scales_to_ue8m0()))
        check_deepep_buffer(buffer, low_latency=False, num_ranks=num_dispatchers, hidden=hidden,
                            num_experts=num_experts)

    @classmethod
    def for_vllm_layer(cls, moe_config, buffer, **wiring):
        """The adapter for the factory's wiring over vLLM's buffer, checked for the layer's
        hidden size and expert count."""
        return cls(buffer, hidden=moe_config.hidden_dim, num_experts=moe_config.num_experts,
                   **wiring)


class VllmDeepEPV2PrepareAndFinalize(_StandardDispatchAdapter):
    """``DeepEPV2PrepareAndFinalize`` for vLLM over the ``ElasticBuffer`` of vLLM's deepep_v2
    all2all manager: the per-token receive layout, our standard format (as high-throughput).

    Arguments:
        buffer: vLLM's ``deep_ep.ElasticBuffer`` (or a ``TorchElasticBuffer``).
        num_dispatchers: ranks of the expert-parallel group (R).
        rank_expert_offset: this rank's first global expert id (rank * E_l).
        max_tokens_per_rank: N, the layer's tokens per rank per dispatch.
        do_cpu_sync: wait for the exact receive count (eager engines) or take R*N rows without a
            host read (an engine that captures CUDA graphs).
        topk_idx_dtype: the dtype the buffer takes ids in (DeepEP V2's ``topk_idx_t``).
    The buffer's rank count is checked against num_dispatchers when built; its bytes, by V2's
    own checks at the first dispatch.
    """

    def __init__(self, buffer, *, num_dispatchers: int, rank_expert_offset: int,
                 max_tokens_per_rank: int, do_cpu_sync: bool,
                 topk_idx_dtype: torch.dtype = torch.int64) -> None:
        super().__init__(DeepEPV2PrepareAndFinalize(
            buffer, num_dispatchers=num_dispatchers, rank_expert_offset=rank_expert_offset,
            max_tokens_per_rank=max_tokens_per_rank, do_cpu_sync=do_cpu_sync,
            topk_idx_dtype=topk_idx_dtype, use_ue8m0=vllm_rounds_scales_to_ue8m0()))

    @classmethod
    def for_vllm_layer(cls, moe_config, buffer, **wiring):
        """The adapter for the factory's wiring over vLLM's ElasticBuffer."""
        return cls(buffer, **wiring)


class VllmDeepEPLLPrepareAndFinalize(_VllmPrepareAndFinalize):
    """``DeepEPLLPrepareAndFinalize`` for vLLM over vLLM's low-latency DeepEP buffer; batched
    layout [E_l, R*N, K]; FP8 dispatch (DeepEP's cast, 1x128 groups, exact scales as in vLLM's
    own low-latency prepare for our experts: module docstring).

    Arguments:
        buffer: the low-latency ``deep_ep.Buffer`` of vLLM's all2all manager (or a
            ``TorchAll2AllBuffer(low_latency_mode=True)``).
        max_tokens_per_rank: N, vLLM's ``moe.max_num_tokens``.
        num_dispatchers: R.
        hidden: K; num_experts: global E (checked against the buffer with DeepEP's rules).
        global_to_physical / physical_to_global / local_expert_global_ids: vLLM's EPLB or
            round-robin routing tables; not served (ValueError when given).
    """

    def __init__(self, buffer, *, max_tokens_per_rank: int, num_dispatchers: int, hidden: int,
                 num_experts: int, global_to_physical=None, physical_to_global=None,
                 local_expert_global_ids=None) -> None:
        super().__init__()
        check_no_routing_tables((global_to_physical, physical_to_global, local_expert_global_ids))
        self.ours = DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=num_dispatchers,
                                               max_tokens_per_rank=max_tokens_per_rank,
                                               use_fp8_dispatch=True)
        check_deepep_buffer(buffer, low_latency=True, num_ranks=num_dispatchers, hidden=hidden,
                            num_experts=num_experts, max_tokens_per_rank=max_tokens_per_rank)

    @classmethod
    def for_vllm_layer(cls, moe_config, buffer, **wiring):
        """The adapter for the factory's wiring over vLLM's buffer, checked for the layer's
        hidden size and expert count."""
        return cls(buffer, hidden=moe_config.hidden_dim, num_experts=moe_config.num_experts,
                   **wiring)

    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.BatchedExperts

    def topk_indices_dtype(self) -> torch.dtype | None:
        return torch.int64

    def max_num_tokens_per_rank(self) -> int | None:
        return self.ours.max_num_tokens_per_rank()

    def num_dispatchers(self) -> int:
        return self.ours.num_dispatchers()

    def output_is_reduced(self) -> bool:
        return True

    def _converted(self, res, a1, topk_ids, num_experts, dispatched):
        """a1 bf16 [M, K] (M <= N) -> (a1q fp8 [E_l, R*N, K], a1q_scale f32 [E_l, R*N, K/128]
        MN-major per expert, ExpertTokensMetadata (int32 [E_l] valid rows, device only), None,
        None); rows past a count are undefined."""
        meta = mk.ExpertTokensMetadata(expert_num_tokens=res.expert_num_tokens,
                                       expert_num_tokens_cpu=None)
        return res.a1q, res.a1q_scale, meta, None, None

    def _finalize_input(self, fused_expert_output, topk_ids, weight_and_reduce_impl):
        """fused_expert_output bf16 [E_l, R*N, K], combined, weighted and reduced into output
        bf16 [M, K] (contiguous) by the low-latency combine: vLLM's experts must leave that to
        it (TopKWeightAndReduceDelegate)."""
        if not isinstance(weight_and_reduce_impl, TopKWeightAndReduceDelegate):
            raise ValueError(f"weight_and_reduce_impl={type(weight_and_reduce_impl).__name__}: "
                             "the low-latency combine weights and reduces, so the batched "
                             "experts must return TopKWeightAndReduceDelegate")
        return fused_expert_output, False


# The plugin's name map: the prepare/finalize the library's factory picks -> its adapter.
ADAPTER_OF_PREPARE_FINALIZE = {
    NoEPPrepareAndFinalize: VllmNoEPPrepareAndFinalize,
    DeepEPHTPrepareAndFinalize: VllmDeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize: VllmDeepEPLLPrepareAndFinalize,
    DeepEPV2PrepareAndFinalize: VllmDeepEPV2PrepareAndFinalize,
}
