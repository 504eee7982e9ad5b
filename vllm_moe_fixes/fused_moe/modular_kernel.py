"""The modular MoE kernel: prepare -> experts -> finalize, with workspaces owned by the kernel.

A `PrepareAndFinalize` quantises (and, with expert parallelism, dispatches) the input and later
combines the experts' output; an `Experts` runs the two grouped GEMMs and, when it declares
`reduces_output`, also weights and sums each token's top-k rows. The kernel checks that both
speak the same `ActivationFormat`, asks the experts how much scratch they need
(`workspace_shapes`) and hands them views of two grow-only buffers that it keeps across calls:
a second call with the same or a smaller problem allocates no workspace.

    for each dispatch chunk (at most VLLM_FUSED_MOE_CHUNK_SIZE tokens, and at most the
                             prepare/finalize's max_num_tokens_per_rank; same workspaces):
        hidden_states[chunk] --prepare--> a1q, a1q_scale (+ received ids/weights with EP)
            --experts.apply--> [M', K] reduced (or [M', k, K] / [E_l, T, K] unreduced)
            --finalize--> output[chunk]

Memory of one call, counted on top of the inputs and weights:
    workspace13 + workspace2 (declared by the experts for one chunk, bf16 elements; kept)
    + the returned output [M, K]
    + what prepare allocates for one chunk (NoEP: a1q fp8 [M_c, K], a1q_scale f32 [M_c, K/128]).
(vllm_moe_fixes.sizes.layer_declared_bytes adds these up for one chunk.) The experts' output
(out_shape) is a view of the start of workspace13, so it costs nothing extra: an Experts
implementation must finish reading workspace13 before it writes `output`. When the experts reduce
and the prepare/finalize has nothing to combine (`passes_reduced_output_through`), the experts
write the layer's output directly.

Two-batch overlap (``micro_batches=2``, off by default): each chunk's tokens run as two
micro-batches, and one's transfer overlaps the other's experts, through the prepare/finalize's
asynchronous calls (prepare_async / finalize_async: their receivers wait):

    dispatch 0, dispatch 1 | experts 0 | combine 0 | experts 1 | combine 1
                  (hidden by experts 0) (hidden by experts 1)

More micro-batches pipeline the same way (dispatch i + 1 and combine i - 1 behind experts i), so
all but the first dispatch and the last combine can hide. A call splits only where each
micro-batch keeps at least MIN_MICRO_BATCH_TOKENS tokens (``micro_batches_for``). On CUDA the
transfers run on the communication library's stream (DeepEP's, or NCCL's for the torch buffers)
while the experts run on the caller's: two streams, each micro-batch's data handed over by events;
DeepEP's low-latency receive hook instead runs the receive kernel on the caller's stream, the
transfer itself taking no SM in between. The micro-batches alternate between two sets of
workspaces (a combine may still read the experts' output while the next micro-batch's experts
run).
"""

from __future__ import annotations

import inspect
import math
import os
import weakref
from typing import NamedTuple

import torch

from vllm_moe_fixes import envs
from vllm_moe_fixes._validate import check_positive_int
from vllm_moe_fixes.fused_moe.interfaces import (
    ActivationFormat,
    Experts,
    Fp8MoEWeights,
    PrepareAndFinalize,
)
from vllm_moe_fixes.fused_moe.kernel_checks import (
    check_finite,
    check_layer_call,
    check_weights_finite,
)
from vllm_moe_fixes.fused_moe.workspaces import Workspaces, views_cached_on
from vllm_moe_fixes.sizes import cdiv, expected_rows_per_expert


def stream_is_capturing() -> bool:
    """Whether a CUDA graph capture is under way on the current stream (False on a torch built
    without CUDA, whose torch.cuda.is_current_stream_capturing cannot be called)."""
    return torch.backends.cuda.is_built() and torch.cuda.is_current_stream_capturing()


# The fewest tokens a micro-batch gets on the group's busiest rank (micro_batches_for). Each
# micro-batch is one more dispatch and combine, and its GEMMs run on fewer rows: below this the
# split costs more than it can hide. Set by benchmarks.bench_overlap over gloo (2 ranks, K 256):
# 64 tokens a micro-batch (M 128, 2 micro-batches) cost +45% without delay, 256 and more were
# within the host's noise (-23% .. +5%); on an H200 over real DeepEP low-latency (world 1, K 7168)
# 64 tokens a micro-batch cost +83% .. +113%.
MIN_MICRO_BATCH_TOKENS = 256

# Chunk plans a kernel keeps (FusedMoEModularKernel._chunk_plan): one per chunk shape, and a
# decode engine calls a layer with a few dozen token counts at most.
_MAX_PLANS = 64


class _LayerCall(NamedTuple):
    """What every chunk of one validated layer call shares."""

    weights: Fp8MoEWeights
    global_num_experts: int
    expert_map: torch.Tensor | None
    on_input: bool  # apply_router_weight_on_input
    experts_pass_tokens: int  # VLLM_FUSED_MOE_CHUNK_SIZE, read once per call


class _ChunkPlan(NamedTuple):
    """What a chunk of one shape needs (FusedMoEModularKernel._chunk_plan), kept while the
    Workspaces it came from still holds those views (same object and generation)."""

    workspaces: Workspaces
    generation: int  # workspaces.generation when planned
    ws13: weakref.ref  # the views, weakly: a buffer that grows is freed before its successor
    ws2: weakref.ref
    fused_out: weakref.ref | None  # the experts' output view; None: the layer's output
    expected_m: int | None  # the masked GEMM's tiling hint (batched layout); None: standard


class FusedMoEModularKernel:
    """One MoE layer: `prepare_finalize.prepare` -> `experts.apply` -> `prepare_finalize.finalize`.

    Args:
        prepare_finalize: a PrepareAndFinalize (NoEP, DeepEP high-throughput / low-latency).
        experts: an Experts of the same activation_format.
        workspaces: a Workspaces to share between layers; default: one owned by this kernel.
        micro_batches: 1 (default): each chunk is one prepare -> experts -> finalize. 2:
            two-batch overlap (module docstring); more: the same pipeline over more
            micro-batches (not with a BATCHED prepare/finalize: DeepEP's low-latency buffer
            holds two dispatches' results). Needs a prepare/finalize with supports_async(), the same
            value on every rank; a second set of workspaces is kept for it (workspaces.partner():
            shared as the first set is). A call runs min(micro_batches, T // min_micro_batch_tokens)
            micro-batches (at least 1, unsplit), T the tokens of a chunk on the group's busiest rank
            (micro_batches_for): M on one rank, else max_tokens_across_ranks. With expert
            parallelism and without max_tokens_across_ranks no rank knows T before the dispatch, so
            such a call splits into micro_batches.
        min_micro_batch_tokens: the fewest tokens a micro-batch may get (int >= 1; default
            MIN_MICRO_BATCH_TOKENS, where the split stops costing more than it hides); 1 splits
            every call. The same value on every rank.
        comm_sms: SMs DeepEP's high-throughput kernels take (``set_num_sms`` of the
            prepare/finalize's buffer: process-wide, even), leaving the rest to the experts; None
            keeps the buffer's (DeepEP's default, 20).

    Raises ValueError for a pair of different activation formats, for reducing experts with
    a prepare/finalize whose finalize does not take output_is_reduced (see
    PrepareAndFinalize.finalize), and for a prepare/finalize with use_ue8m0 (its activation
    scales rounded to powers of two, for every quant of the layer) with experts whose apply does
    not take that keyword.
    """

    def __init__(self, prepare_finalize: PrepareAndFinalize, experts: Experts,
                 workspaces: Workspaces | None = None, *, micro_batches: int = 1,
                 comm_sms: int | None = None,
                 min_micro_batch_tokens: int = MIN_MICRO_BATCH_TOKENS) -> None:
        if not isinstance(prepare_finalize, PrepareAndFinalize):
            raise ValueError(f"prepare_finalize must be a PrepareAndFinalize, got "
                             f"{type(prepare_finalize).__name__}")
        if not isinstance(experts, Experts):
            raise ValueError(f"experts must be an Experts, got {type(experts).__name__}")
        if prepare_finalize.activation_format != experts.activation_format:
            raise ValueError(
                f"{type(prepare_finalize).__name__} produces the "
                f"{prepare_finalize.activation_format.value} "
                f"activation format but {type(experts).__name__} takes "
                f"{experts.activation_format.value}; pair standard with standard "
                "(NoEP / DeepEP high-throughput + TritonExperts / DeepGemmExperts) and batched "
                "with batched (DeepEP low-latency + BatchedTritonExperts / "
                "BatchedDeepGemmExperts)")
        if prepare_finalize.defer_input_quant and not experts.takes_unquantized_input:
            raise ValueError(
                f"{type(prepare_finalize).__name__} defers the input quant "
                f"(defer_input_quant=True) but {type(experts).__name__} takes quantised input: "
                "build the prepare/finalize with defer_input_quant=False")
        self._finalize_takes_reduced = _takes_keyword(prepare_finalize.finalize,
                                                      "output_is_reduced")
        # The layer's scale rounding (PrepareAndFinalize.use_ue8m0) reaches the experts' quants
        # through apply's keyword; experts written before it get no keyword, so they must not be
        # paired with a prepare/finalize that rounds.
        self._experts_take_ue8m0 = _takes_keyword(experts.apply, "use_ue8m0")
        if prepare_finalize.use_ue8m0 and not self._experts_take_ue8m0:
            raise ValueError(
                f"{type(prepare_finalize).__name__} rounds activation scales to powers of two "
                f"(use_ue8m0=True) but {type(experts).__name__}.apply does not take the keyword "
                "use_ue8m0, so its own quants would not follow: add `use_ue8m0: bool = False` to "
                "its signature, or build the prepare/finalize with use_ue8m0=False")
        if experts.reduces_output and not self._finalize_takes_reduced:
            raise ValueError(
                f"{type(experts).__name__} reduces its output, but "
                f"{type(prepare_finalize).__name__}.finalize does not take the keyword "
                "output_is_reduced, so it cannot tell a reduced [M', K] output from [M', k, K] "
                "rows: add `*, output_is_reduced: bool = False` to its signature and pass a "
                "reduced output on unchanged (docs/design.md, 'Writing a prepare/finalize or "
                "experts')")
        _check_overlap(prepare_finalize, micro_batches, comm_sms)
        check_positive_int("min_micro_batch_tokens", min_micro_batch_tokens)
        if comm_sms is not None:
            prepare_finalize.buffer.set_num_sms(comm_sms)
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        self.workspaces = workspaces if workspaces is not None else Workspaces()
        self.micro_batches = micro_batches
        self.min_micro_batch_tokens = min_micro_batch_tokens
        # the odd micro-batches' workspaces (a combine may still read the even one's output)
        self._second_workspaces = self.workspaces.partner() if micro_batches > 1 else None
        self._plans: dict[tuple, _ChunkPlan] = {}  # see _chunk_plan

    def __call__(self, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, w1_scale: torch.Tensor,
                 w2_scale: torch.Tensor, global_num_experts: int,
                 expert_map: torch.Tensor | None = None, activation: str = "silu",
                 apply_router_weight_on_input: bool = False,
                 max_tokens_across_ranks: int | None = None) -> torch.Tensor:
        """Run the layer.

        Args:
            hidden_states: bfloat16 [M, K] with contiguous channels (stride(1) == 1), on every
                prepare/finalize alike.
            w1: float8_e4m3fn [E_l, 2I, K] (rows 0..I-1 gate, I..2I-1 up), contiguous.
            w2: float8_e4m3fn [E_l, K, I], contiguous.
            topk_weights: float32 [M, k].
            topk_ids: int32 or int64 [M, k], global expert ids in [-1, global_num_experts);
                -1 means "no expert": the slot contributes nothing (DeepEP's convention).
            w1_scale: float32 [E_l, 2I/128, K/128]; w2_scale: float32 [E_l, K/128, I/128].
            global_num_experts: E.
            expert_map: int32 [E], global -> local id in [-1, E_l); None: all experts local
                (E == E_l).
            activation: "silu" (the only one).
            apply_router_weight_on_input: multiply the input by the weight (needs k == 1) instead
                of the experts' output.
            max_tokens_across_ranks: with expert parallelism, the largest M of the group's ranks
                for this call, if the caller knows it (then the number of chunks is agreed
                without a collective); None otherwise. Not read on one rank (no other rank's
                passes to match: the call makes its own cdiv(M, chunk) passes).

        Returns:
            bfloat16 [M, K]: sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(hidden_states),
            where a non-local expert contributes exactly zero.

        Raises ValueError on malformed arguments, and on ids or expert_map entries out of range:
        always for CPU tensors; for CUDA tensors only with VLLM_MOE_CHECK_IDS=1, because the
        check reads the values (a host synchronisation per call, which also cannot be captured
        in a CUDA graph). Unchecked, an out-of-range id counts as non-local on the one-rank path.
        With expert parallelism, eager and without max_tokens_across_ranks, such an error on any
        rank is raised on every rank of the group in the same call as CollectiveRefusal (a
        ValueError naming the refusing rank and its reason; DeepEP's num_chunks).

        Non-finite inputs follow vLLM's quant recipe, which requantises activations to FP8 before
        each GEMM (a NaN element becomes -448 and takes no part in its group's scale; a group
        holding +-inf gets scale inf): a NaN in hidden_states or w1_scale comes out as finite
        values; +-inf there, and NaN or +-inf in w2_scale or topk_weights, reaches the output of
        the tokens that use that entry. With VLLM_MOE_CHECK_FINITE=1, non-finite
        hidden_states, topk_weights, w1, w2, w1_scale or w2_scale raise ValueError naming the
        first such entry (one host synchronisation per call on CUDA; the weights and their
        scales are read once per tensor and version, kernel_checks.check_weights_finite).

        No autograd: the layer runs under torch.no_grad (its output never requires grad), and
        calls inside and outside torch.inference_mode share the same workspaces.

        Under CUDA graph capture (torch.cuda.is_current_stream_capturing()) nothing is read on
        the host: the checked modes (VLLM_MOE_CHECK_IDS, VLLM_MOE_CHECK_FINITE) and
        prepare/finalizes that read counts (DeepEP high-throughput, DeepEP V2 with
        do_cpu_sync=True) are refused with ValueError before anything runs; with expert
        parallelism and without max_tokens_across_ranks the call is one pass, so M must be at
        most min(VLLM_FUSED_MOE_CHUNK_SIZE, max_tokens_per_rank) on every rank (ValueError
        naming max_tokens_across_ranks otherwise).

        Tokens are processed in dispatch chunks of at most VLLM_FUSED_MOE_CHUNK_SIZE (and at
        most the prepare/finalize's max_num_tokens_per_rank), reusing the same workspaces; the
        experts take what a chunk received in passes of at most VLLM_FUSED_MOE_CHUNK_SIZE
        tokens (experts_pass_tokens). A token's output does not depend on the chunking on CPU
        (bit for bit: every step works row by row and the GEMM references sum each K block
        exactly). On CUDA the Triton experts run one
        tile configuration for every row count, which should give the same bits (a GPU test
        checks it; not yet run); DeepGEMM chooses its tiles by M, so there it is not promised.
        """
        capturing = stream_is_capturing()
        if capturing:
            self._check_capturable()
        try:
            check_layer_call(hidden_states, w1, w2, topk_weights, topk_ids, w1_scale=w1_scale,
                             w2_scale=w2_scale, global_num_experts=global_num_experts,
                             expert_map=expert_map, activation=activation,
                             apply_router_weight_on_input=apply_router_weight_on_input,
                             max_tokens_across_ranks=max_tokens_across_ranks)
            if envs.VLLM_MOE_CHECK_FINITE:
                check_finite(hidden_states=hidden_states, topk_weights=topk_weights)
                check_weights_finite(w1=w1, w1_scale=w1_scale, w2=w2, w2_scale=w2_scale)
        except ValueError as refusal:
            self._refuse_in_step(refusal, max_tokens_across_ranks, capturing)
        call = _LayerCall(weights=Fp8MoEWeights(w1, w1_scale, w2, w2_scale),
                          global_num_experts=global_num_experts, expert_map=expert_map,
                          on_input=apply_router_weight_on_input,
                          experts_pass_tokens=envs.VLLM_FUSED_MOE_CHUNK_SIZE)
        if torch.is_grad_enabled():  # an inference layer: nothing for autograd to record
            # set_grad_enabled's function form costs half the host time of a no_grad block
            torch.set_grad_enabled(False)
            try:
                return self._run(call, hidden_states, topk_weights, topk_ids,
                                 max_tokens_across_ranks, capturing)
            finally:
                torch.set_grad_enabled(True)
        return self._run(call, hidden_states, topk_weights, topk_ids, max_tokens_across_ranks,
                         capturing)

    def _check_capturable(self) -> None:
        """ValueError unless a pass can be captured in a CUDA graph (before anything runs)."""
        for name in ("VLLM_MOE_CHECK_IDS", "VLLM_MOE_CHECK_FINITE"):
            if getattr(envs, name):
                raise ValueError(f"{name}={os.environ[name]} reads the layer's inputs on the "
                                 "host, which a CUDA graph capture cannot do: unset it for the "
                                 "capture, or run the layer eagerly")
        self.prepare_finalize.check_capturable()

    def _refuse_in_step(self, refusal: ValueError, max_tokens_across_ranks,
                        capturing: bool) -> None:
        """Raise refusal, this rank's error for the call. Where the call agrees its pass count
        across an expert-parallel group (eager, without max_tokens_across_ranks: num_chunks), this
        rank first joins that agreement carrying the refusal, so that every rank of the group
        raises CollectiveRefusal in this call instead of waiting for this one in a dispatch."""
        if self.prepare_finalize.num_dispatchers() > 1:
            dispatch_chunk_tokens = self._dispatch_chunk_tokens(envs.VLLM_FUSED_MOE_CHUNK_SIZE)
            self.prepare_finalize.num_chunks(0, dispatch_chunk_tokens, max_tokens_across_ranks,
                                             capturing=capturing, refusal=refusal)
        raise refusal

    def _dispatch_chunk_tokens(self, experts_pass_tokens: int) -> int:
        """The most tokens of this rank one chunk (prepare -> experts -> finalize) takes:
        the experts' pass (VLLM_FUSED_MOE_CHUNK_SIZE) capped by the dispatch's
        max_num_tokens_per_rank."""
        capacity = self.prepare_finalize.max_num_tokens_per_rank()
        return experts_pass_tokens if capacity is None else min(experts_pass_tokens, capacity)

    def _run(self, call: _LayerCall, hidden_states, topk_weights, topk_ids,
             max_tokens_across_ranks, capturing) -> torch.Tensor:
        """The validated call: its chunks, each prepare -> experts -> finalize."""
        M = hidden_states.shape[0]
        pf = self.prepare_finalize
        chunk = self._dispatch_chunk_tokens(call.experts_pass_tokens)
        group_tokens = M if pf.num_dispatchers() == 1 else max_tokens_across_ranks
        split = micro_batches_for(self.micro_batches, group_tokens, chunk,
                                  self.min_micro_batch_tokens)
        num_chunks = pf.num_chunks(M, chunk, max_tokens_across_ranks, capturing=capturing,
                                   **({"micro_batches": split} if split > 1 else {}))
        step = max(chunk, cdiv(M, num_chunks)) if num_chunks else chunk
        output = torch.empty_like(hidden_states)
        if split > 1 and num_chunks:  # no pass (every rank's M is 0): nothing to pipeline
            self._run_overlapped(call, hidden_states, topk_weights, topk_ids, output,
                                 _micro_batch_rows(M, step, num_chunks, split))
            return output
        if num_chunks == 1:  # one pass takes the whole tensors (no slice views to build)
            self._run_chunk(call, hidden_states, topk_weights, topk_ids, output)
            return output
        for i in range(num_chunks):
            rows = slice(min(i * step, M), min((i + 1) * step, M))
            self._run_chunk(call, hidden_states[rows], topk_weights[rows], topk_ids[rows],
                            output[rows])
        return output

    def _run_chunk(self, call: _LayerCall, x, topk_weights, topk_ids, output) -> None:
        """prepare -> experts -> finalize for one chunk of tokens (validated arguments)."""
        pf = self.prepare_finalize
        prep = pf.prepare(x, topk_weights, topk_ids, call.global_num_experts, call.expert_map,
                          call.on_input)
        fused_out, topk_weights, topk_ids = self._apply_experts(
            call, prep, x, topk_weights, topk_ids, output, self.workspaces)
        if self._finalize_takes_reduced:
            pf.finalize(output, fused_out, topk_weights, topk_ids, call.on_input,
                        output_is_reduced=self.experts.reduces_output)
        else:  # a finalize of the signature before output_is_reduced (experts that do not reduce)
            pf.finalize(output, fused_out, topk_weights, topk_ids, call.on_input)

    def _run_overlapped(self, call: _LayerCall, hidden_states, topk_weights, topk_ids, output,
                        micro_batches: list[slice]) -> None:
        """The micro-batches pipelined (module docstring): micro-batch i + 1's dispatch is started
        before micro-batch i's experts run, and micro-batch i - 1's combine is waited for after
        them. Every micro-batch is a dispatch and a combine, empty ones included (collectives)."""
        pf = self.prepare_finalize

        def start(rows: slice):
            return pf.prepare_async(hidden_states[rows], topk_weights[rows], topk_ids[rows],
                                    call.global_num_experts, call.expert_map, call.on_input)

        receiving, combining = start(micro_batches[0]), None
        for i, rows in enumerate(micro_batches):
            upcoming = start(micro_batches[i + 1]) if i + 1 < len(micro_batches) else None
            prep = receiving()
            spaces = self._second_workspaces if i % 2 else self.workspaces
            fused_out, received_weights, received_ids = self._apply_experts(
                call, prep, hidden_states[rows], topk_weights[rows], topk_ids[rows],
                output[rows], spaces)
            if combining is not None:
                combining()
            combining = pf.finalize_async(output[rows], fused_out, received_weights, received_ids,
                                          call.on_input,
                                          output_is_reduced=self.experts.reduces_output,
                                          handle=prep.handle)
            receiving = upcoming
        combining()

    def _apply_experts(self, call: _LayerCall, prep, x, topk_weights, topk_ids, output,
                       spaces: Workspaces) -> tuple:
        """The experts on what prepare returned, with views of ``spaces``: (their output, the
        topk_weights and topk_ids finalize takes)."""
        pf, experts, weights = self.prepare_finalize, self.experts, call.weights
        local_num_experts, I, K = weights.w1.shape[0], weights.w2.shape[2], x.shape[1]
        topk, on_input = topk_ids.shape[1], call.on_input
        if prep.topk_ids is not None:
            topk_ids = prep.topk_ids
        if prep.topk_weights is not None:
            topk_weights = prep.topk_weights
        standard = experts.activation_format == ActivationFormat.STANDARD
        rows = prep.a1q.shape[0] if standard else prep.a1q.shape[1]
        ws13, ws2, fused_out, expected_m = self._chunk_plan(
            (rows, I, K, topk, local_num_experts, call.global_num_experts,
             call.experts_pass_tokens, x.device, x.dtype, spaces is self.workspaces), standard,
            spaces)
        if fused_out is None:
            fused_out = output
        if rows > 0:  # rows == 0: out_shape has a zero dimension, fused_out is empty
            scales = {"use_ue8m0": pf.use_ue8m0} if self._experts_take_ue8m0 else {}
            experts.apply(fused_out, prep.a1q, prep.a1q_scale, weights, topk_ids=topk_ids,
                          expert_map=call.expert_map, workspace13=ws13, workspace2=ws2,
                          expert_num_tokens=prep.expert_num_tokens,
                          topk_weights=None if on_input else topk_weights,
                          expected_m=expected_m, experts_pass_tokens=call.experts_pass_tokens,
                          **scales)
        return fused_out, topk_weights, topk_ids

    def _chunk_plan(self, key: tuple, standard: bool, spaces: Workspaces) -> tuple:
        """(ws13, ws2, the experts' output view or None for the layer's output, expected_m) of a
        chunk of key = (rows, I, K, topk, E_l, global_num_experts, experts_pass_tokens, device,
        dtype, whether ``spaces`` is the kernel's first Workspaces): what depends on these alone
        (the experts' workspace_shapes, the workspace views, the masked GEMM's expected_m),
        worked out once per key and kept while ``spaces`` keeps those views (same object and
        generation; a Workspaces shared with other layers may grow under them). The plan refers
        to the views weakly: a buffer that grows is freed before its successor is allocated, as
        without plans."""
        plan = self._plans.get(key)
        if plan is not None and plan.workspaces is spaces and plan.generation == spaces.generation:
            ws13, ws2 = plan.ws13(), plan.ws2()
            fused_out = None if plan.fused_out is None else plan.fused_out()
            if ws13 is not None and ws2 is not None and (plan.fused_out is None
                                                         or fused_out is not None):
                return ws13, ws2, fused_out, plan.expected_m
        rows, I, K, topk, local_num_experts, global_num_experts, experts_pass_tokens, device, \
            dtype, _ = key
        pf, experts = self.prepare_finalize, self.experts
        ws13_shape, ws2_shape, out_shape = experts.workspace_shapes(
            rows, I, K, topk, local_num_experts, experts_pass_tokens=experts_pass_tokens)
        ws13, ws2 = spaces.get(ws13_shape, ws2_shape, device, dtype)
        fused_out = None  # the layer's output: the experts reduce, finalize passes it through
        if not (experts.reduces_output and pf.passes_reduced_output_through):
            fused_out = views_cached_on(ws13, ws2, _experts_output_view, tuple(out_shape),
                                        type(experts).__name__)
        expected_m = None if standard or rows == 0 else expected_rows_per_expert(
            pf.max_num_tokens_per_rank(), pf.num_dispatchers(), topk, global_num_experts, rows)
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[key] = _ChunkPlan(
            workspaces=spaces, generation=spaces.generation, ws13=weakref.ref(ws13),
            ws2=weakref.ref(ws2), fused_out=None if fused_out is None else weakref.ref(fused_out),
            expected_m=expected_m)
        return ws13, ws2, fused_out, expected_m


def _experts_output_view(ws13: torch.Tensor, ws2: torch.Tensor, out_shape: tuple,
                         experts_name: str) -> torch.Tensor:
    """The experts' output: a view of out_shape at the start of workspace13 (ValueError naming
    the experts when it does not fit). Built once per workspace and shape (views_cached_on)."""
    if math.prod(out_shape) > ws13.numel():
        raise ValueError(f"{experts_name}.workspace_shapes: out_shape {out_shape} does not fit in "
                         f"workspace13 {tuple(ws13.shape)}")
    return ws13.view(-1)[:math.prod(out_shape)].view(out_shape)


def _check_overlap(prepare_finalize: PrepareAndFinalize, micro_batches: int,
                   comm_sms: int | None) -> None:
    """ValueError unless micro_batches and comm_sms are a two-batch overlap prepare_finalize can
    run (FusedMoEModularKernel's arguments)."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r} must be an int >= 1 (1: no overlap, "
                         "2: two-batch overlap)")
    name = type(prepare_finalize).__name__
    if micro_batches > 1 and not prepare_finalize.supports_async():
        raise ValueError(f"micro_batches={micro_batches}: {name} has no asynchronous "
                         "prepare/finalize (supports_async() is False), so nothing can overlap; "
                         "use micro_batches=1")
    if micro_batches > 1 and not _takes_keyword(prepare_finalize.num_chunks, "micro_batches"):
        raise ValueError(f"micro_batches={micro_batches}: {name}.num_chunks does not take the "
                         "keyword micro_batches (PrepareAndFinalize.num_chunks)")
    if micro_batches > 2 and prepare_finalize.activation_format == ActivationFormat.BATCHED:
        raise ValueError(f"micro_batches={micro_batches}: {name} dispatches into DeepEP's "
                         "low-latency buffer, which holds two dispatches' results; use 2")
    if comm_sms is None:
        return
    if isinstance(comm_sms, bool) or not isinstance(comm_sms, int) or comm_sms <= 0 \
            or comm_sms % 2:
        raise ValueError(f"comm_sms={comm_sms!r} must be a positive even int (DeepEP's "
                         "Buffer.set_num_sms)")
    if not callable(getattr(getattr(prepare_finalize, "buffer", None), "set_num_sms", None)):
        raise ValueError(f"comm_sms={comm_sms}: {name} has no buffer with set_num_sms (DeepEP's "
                         "high-throughput Buffer or TorchAll2AllBuffer)")


def micro_batches_for(micro_batches: int, group_tokens: int | None, chunk_tokens: int,
                      min_tokens: int) -> int:
    """The micro-batches a call splits each chunk into (FusedMoEModularKernel's rule): as many as
    keep min_tokens tokens each on the group's busiest rank, at most micro_batches, at least 1.

    group_tokens: the call's tokens on the group's busiest rank (the same on every rank), None
    where unknown (then micro_batches); chunk_tokens: the most tokens one chunk takes."""
    if group_tokens is None:
        return micro_batches
    return max(1, min(micro_batches, min(group_tokens, chunk_tokens) // min_tokens))


def _micro_batch_rows(num_tokens: int, step: int, num_chunks: int,
                      micro_batches: int) -> list[slice]:
    """The rows of each micro-batch: every chunk of ``step`` rows (the last one shorter, those
    past num_tokens empty) split into ``micro_batches`` parts of cdiv(chunk rows, micro_batches)
    (the last ones shorter or empty), num_chunks * micro_batches slices in order."""
    slices = []
    for i in range(num_chunks):
        start, stop = min(i * step, num_tokens), min((i + 1) * step, num_tokens)
        part = cdiv(stop - start, micro_batches)
        slices += [slice(min(start + j * part, stop), min(start + (j + 1) * part, stop))
                   for j in range(micro_batches)]
    return slices


def _takes_keyword(method, name: str) -> bool:
    """Whether method accepts the keyword `name` (by name or through **kwargs)."""
    params = inspect.signature(method).parameters.values()
    return any(p.name == name and p.kind != p.POSITIONAL_ONLY
               or p.kind == p.VAR_KEYWORD for p in params)
