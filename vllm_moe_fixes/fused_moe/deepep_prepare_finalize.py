"""Expert-parallel prepare/finalize over DeepEP's buffers: high-throughput and low-latency over a
deep_ep.Buffer or TorchAll2AllBuffer, V2 over an ElasticBuffer or TorchElasticBuffer.

High-throughput (STANDARD format): quantise to FP8 (1x128) on the source rank, send each token once
to every rank holding one of its experts (``get_dispatch_layout`` + ``dispatch``), run the
contiguous experts on what arrived, then weight and sum over the k slots (unless the experts did)
and ``combine`` back:

    a1 [M, K] bf16 --quant--> (fp8 [M, K], f32 [M, K/128])
        --dispatch--> (fp8 [M', K], f32 [M', K/128]),
        received ids (local, -1 = elsewhere) -> global ids (+ rank_expert_offset), weights (0 at -1)
    experts -> [M', K] reduced, or [M', k, K] (-1 slots exact zeros) --weighted moe_sum--> [M', K]
        --combine--> output [M, K]

Low-latency (BATCHED format): ``low_latency_dispatch`` builds the masked layout [E_l, R*N, K] with
per-expert valid-row counts; the batched experts compute those rows; ``low_latency_combine``
applies the weights, reduces and writes the caller's output.

Chunks: every dispatch and combine is a collective, so every rank of the group runs the same number
of passes (``num_chunks``), a rank with fewer tokens running empty ones (M = 0). A group of one rank
agrees nothing (no collective: its passes are its own). A call refused by the kernel's checks on one
rank joins the pass count all-reduce carrying that refusal, so every rank raises CollectiveRefusal
in the same call; over the torch buffers every dispatch also compares its pass (PassStamp) across
the ranks, so ranks that planned different passes raise together. Under CUDA graph capture nothing
is read on the host: high-throughput mode is refused, and low-latency mode without
max_tokens_across_ranks runs one pass (``num_chunks``).

Asynchronous: ``prepare_async`` / ``finalize_async`` start the dispatch / combine and return a
receiver that waits for it (vLLM's contract); ``prepare`` / ``finalize`` are the same calls waited
for at once. The buffer's own machinery carries the transfer: DeepEP's ``async_finish`` and
``EventOverlap`` (high-throughput: DeepEP orders each call after the work already on the compute
stream), its ``return_recv_hook`` (low-latency:
the send kernel now, the receive kernel in the receiver, both on the caller's stream, so a CUDA
graph can capture them), V2's ``async_with_compute_stream`` event; the torch buffers start their
exchange with ``async_op=True`` and complete it in the receiver. Nothing is read on the host that
the synchronous call does not read.

Each prepare's PrepareResult carries the dispatch handle its finalize needs (``handle``): with
several micro-batches in flight, pass it to finalize_async; without it, finalize takes the last
prepare's.

V2 (STANDARD format, DeepEP V2's ``ElasticBuffer``): one dispatch for prefill and decode (DeepEP
main at dd758caf, ``deep_ep/buffers/elastic.py``). Of its two receive layouts this uses the
per-token one (``do_expand=False``), the high-throughput rows as they stand: each token once per
destination rank, its k ids local to that rank (-1 elsewhere), so the flow is high-throughput's
above, except that ids past the valid rows become -1 too, their weights 0 (V2 leaves them
undefined there), and combine is an unweighted sum over ranks.

V2's other layout, ``do_expand=True`` (its "new GEMM layout": one row per (token, local expert),
grouped by expert, each expert's rows padded to ``expert_alignment``, 1-D weights, optionally
TMA-aligned column-major scales), is what our experts' layout and permute steps build from the
per-token rows. The links carry the same bytes either way (the expansion happens in V2's copy
epilogue on the receiving rank), and V2's combine does not apply weights in either layout. To
take it, the experts would need a variant without the layout and permute steps (expert ids per
row from ``psum_num_recv_tokens_per_expert``) that scales each output row by its weight before
combine; that variant does not exist yet, so this prepare/finalize asks for the per-token rows.

Host synchronisation: ``do_cpu_sync=True`` (V2's default) waits for the receive counts and gives
exactly M' rows. ``do_cpu_sync=False`` reads nothing on the host: M' = R*N rows, of which the
first ``psum_num_recv_tokens_per_scaleup_rank[-1]`` are valid; the rows past them get id -1
here (a comparison on the device), so the experts skip them and write zeros there, which
combine does not read. With DeepEP V2 that path can be captured in a CUDA graph (as one pass,
or given max_tokens_across_ranks in its passes, see ``num_chunks``); TorchElasticBuffer still reads
the counts. A capture with do_cpu_sync=True is refused before anything runs (check_capturable).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vllm_moe_fixes import envs
from vllm_moe_fixes._compat.deep_ep import is_deep_ep_buffer
from vllm_moe_fixes._validate import check_bool, check_experts_per_rank, check_positive_int
from vllm_moe_fixes.distributed import ll_exchange as ll
from vllm_moe_fixes.distributed.collectives import (
    NO_STAMP,
    PassStamp,
    chunk_size_mismatch,
    encode_verdict,
    raise_verdict,
    run_collective,
)
from vllm_moe_fixes.fused_moe.interfaces import (
    ActivationFormat,
    AsyncPrepareAndFinalize,
    PrepareResult,
    completed,
)
from vllm_moe_fixes.ops.fp8 import SCALE_BLOCK
from vllm_moe_fixes.ops.fp8_quant import per_token_group_quant_fp8, quant_batched_fp8
from vllm_moe_fixes.ops.moe_sum import moe_sum
from vllm_moe_fixes.sizes import cdiv


# Most passes one layer call may run. A pass is a dispatch and a combine (tens of microseconds at
# least on a GPU, milliseconds on gloo), so 2**16 passes take seconds to minutes; the largest real
# calls (a 128k-token prefill at low-latency N=16: 8192 passes) stay well below, while a
# max_tokens_across_ranks off by orders of magnitude (10**8 at N=16: 6.25 M passes, hours of empty
# dispatches) is refused before any collective.
MAX_PASSES_PER_CALL = 2**16


def weighted_input(a1: torch.Tensor, topk_weights: torch.Tensor, on_input: bool) -> torch.Tensor:
    """a1 * weight (k == 1) when the router weight goes on the input, else a1."""
    return a1 * topk_weights.to(a1.dtype) if on_input else a1


def group_max_tokens(group: dist.ProcessGroup | None, num_tokens: int,
                     chunk_size: int | None = None, *,
                     refusal: BaseException | None = None) -> int:
    """The largest ``num_tokens`` over the ranks of ``group``: one all-reduce (MAX), read on the
    host (a device synchronisation on NCCL; the values go to the device by an asynchronous copy
    from pinned memory, no pageable copy).

    chunk_size: this rank's tokens per dispatch chunk, agreed in the same all-reduce; ranks
    that differ all raise a ValueError naming VLLM_FUSED_MOE_CHUNK_SIZE and both values (their
    pass counts would differ, and their dispatches fall out of step until the group times out).

    refusal: this rank's error for the call, or None. It rides in the same all-reduce as a
    verdict (collectives.encode_verdict), so that every rank raises CollectiveRefusal when any
    rank refused, naming the lowest refusing rank and its reason; the refusing rank's error
    carries its own message."""
    values = [num_tokens, 0, 0, 0]
    if refusal is not None:
        values[3] = encode_verdict(dist.get_rank(group), dist.get_world_size(group), refusal)
    if chunk_size is not None:
        values[1:3] = chunk_size, -chunk_size
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
        counts = torch.tensor(values, dtype=torch.int64, pin_memory=True).to(device,
                                                                             non_blocking=True)
    else:
        counts = torch.tensor(values, dtype=torch.int64)
    run_collective(dist.all_reduce, counts, op=dist.ReduceOp.MAX, group=group)
    got = counts.tolist()
    if got[3]:  # a rank refused: raise on every rank before anything else is compared
        raise_verdict(got[3], dist.get_rank(group), dist.get_world_size(group), refusal)
    if chunk_size is not None and got[1] != -got[2]:
        raise chunk_size_mismatch(f"{-got[2]} on some ranks and {got[1]} on others (this rank: "
                                  f"{chunk_size})")
    return got[0]


def buffer_rank_and_size(buffer) -> tuple:
    """(this rank, the group's rank count) as the buffer states them, None where it does not:
    deep_ep.Buffer and TorchAll2AllBuffer name them rank / group_size, DeepEP V2's ElasticBuffer
    and TorchElasticBuffer rank_idx / num_ranks."""
    return (getattr(buffer, "rank", getattr(buffer, "rank_idx", None)),
            getattr(buffer, "group_size", getattr(buffer, "num_ranks", None)))


def _wait(event) -> None:
    """Make what an asynchronous buffer call returned valid on the current stream: DeepEP's
    EventOverlap, or the torch buffers' Completion (None: the call completed)."""
    if event is not None and event.event is not None:
        event.current_stream_wait()


class _DeepEPPrepareAndFinalize(AsyncPrepareAndFinalize):
    """What both DeepEP modes share: the buffer, the rank count, chunks agreed across ranks and
    the dispatch state kept from prepare to finalize."""

    _needs: tuple[str, ...] = ()  # buffer methods this mode calls
    _buffer_kinds = "a deep_ep.Buffer or TorchAll2AllBuffer"  # what has them (the refusal says)

    def __init__(self, buffer, num_dispatchers: int, use_ue8m0: bool) -> None:
        check_bool("use_ue8m0", use_ue8m0)
        self.use_ue8m0 = use_ue8m0
        missing = [m for m in self._needs if not callable(getattr(buffer, m, None))]
        if missing:
            raise ValueError(f"buffer must be {self._buffer_kinds} (with "
                             f"{', '.join(self._needs)}); got {type(buffer).__name__}")
        check_positive_int("num_dispatchers", num_dispatchers)
        group_size = buffer_rank_and_size(buffer)[1]
        if isinstance(group_size, int) and group_size != num_dispatchers:
            # A rank that counts itself alone skips the agreement its peers wait in: a hang.
            raise ValueError(f"num_dispatchers={num_dispatchers} but the buffer's group has "
                             f"{group_size} ranks")
        self.buffer = buffer
        self._num_dispatchers = num_dispatchers
        self._pending = None  # what finalize needs from the last prepare
        self._agreed_chunk_size: int | None = None  # the last one checked equal on every rank
        # Torch buffers compare a PassStamp of every dispatch across the ranks (collectives).
        self._stamps_passes = hasattr(buffer, "pass_stamp")
        self._plan = NO_STAMP  # the passes of the current call (index: the next prepare's)

    def num_dispatchers(self) -> int:
        return self._num_dispatchers

    def num_chunks(self, num_tokens: int, chunk_size: int, max_tokens_across_ranks: int | None,
                   *, capturing: bool = False, refusal: BaseException | None = None,
                   micro_batches: int = 1) -> int:
        """The same number of passes on every rank of the group.

        One rank: cdiv(num_tokens, chunk_size), no collective (max_tokens_across_ranks is not
        read). Several: cdiv(the group's largest token count, chunk_size), every rank's
        chunk_size checked equal on the buffer's group:
        - eager, without max_tokens_across_ranks: one all-reduce (group_max_tokens) finds the
          count, checks the chunk size and carries each rank's verdict on the call (refusal:
          this rank's error, raised after it as CollectiveRefusal on every rank);
        - with it: no collective of its own. Over the torch buffers every dispatch compares a
          PassStamp (pass index and count, chunk size, max_tokens_across_ranks) across the ranks
          in the count exchange it makes anyway: ranks that disagree raise ValueError together
          in the first pass. Over DeepEP's buffers nothing can ride in the dispatch: the chunk
          size is checked by one all-reduce at this object's first eager call (every rank's
          first call is the same call) and not again (a later change on some ranks only would
          run that all-reduce alone, a hang); a pass count that then differs is not detected;
        - captured (capturing), without it: nothing can be agreed, so the call is one pass on
          every rank: ValueError naming max_tokens_across_ranks when num_tokens > chunk_size.
        Without an all-reduce a refusal is raised at once, on this rank only. micro_batches:
        each pass is that many dispatches (two-batch overlap), each stamped as a pass of its own
        (ranks that split differently raise together in the first dispatch). A pass count above
        MAX_PASSES_PER_CALL (a max_tokens_across_ranks no buffer or chunk could serve) is
        refused before any collective: with the same value on every rank, on every rank.
        """
        if self._num_dispatchers == 1:
            if refusal is not None:
                raise refusal
            return cdiv(num_tokens, chunk_size)
        group = getattr(self.buffer, "group", None)
        if max_tokens_across_ranks is None and not capturing:
            max_tokens_across_ranks = group_max_tokens(group, num_tokens, chunk_size,
                                                       refusal=refusal)
            self._agreed_chunk_size = chunk_size
        elif refusal is not None:
            raise refusal
        elif max_tokens_across_ranks is None:  # captured: one pass
            if num_tokens > chunk_size:
                raise ValueError(
                    f"max_tokens_across_ranks: a call captured in a CUDA graph without it "
                    f"runs one pass of at most {chunk_size} tokens on every rank "
                    "(VLLM_FUSED_MOE_CHUNK_SIZE, capped by max_tokens_per_rank; no "
                    f"collective can agree on more), got M={num_tokens}; pass the largest M "
                    "of the group's ranks as max_tokens_across_ranks, or capture fewer tokens")
            return self._planned(1, micro_batches, chunk_size, 0)
        elif not (capturing or self._stamps_passes or self._agreed_chunk_size is not None):
            group_max_tokens(group, 0, chunk_size)
            self._agreed_chunk_size = chunk_size
        passes = cdiv(max_tokens_across_ranks, chunk_size)
        if passes > MAX_PASSES_PER_CALL:
            raise ValueError(
                f"max_tokens_across_ranks={max_tokens_across_ranks} would take {passes} passes "
                f"of {chunk_size} tokens (VLLM_FUSED_MOE_CHUNK_SIZE, capped by "
                f"max_tokens_per_rank), more than the {MAX_PASSES_PER_CALL} any call can "
                "sensibly run; pass the largest M of the group's ranks for this call")
        return self._planned(passes, micro_batches, chunk_size, max_tokens_across_ranks)

    def _planned(self, passes: int, micro_batches: int, chunk_size: int, max_tokens: int) -> int:
        """Keep the call's plan (passes * micro_batches dispatches) for the PassStamps of its
        dispatches; return passes."""
        self._plan = PassStamp(0, passes * micro_batches, chunk_size, max_tokens)
        return passes

    def _stamp_pass(self) -> None:
        """Hand the next dispatch its PassStamp (torch buffers); after the plan's last pass, and
        for prepares outside a layer call, NO_STAMP."""
        plan = self._plan
        if not self._stamps_passes:
            return
        if plan.index < plan.passes:
            self.buffer.pass_stamp = plan
            # positional: NamedTuple._replace costs twice as much per pass
            self._plan = PassStamp(plan.index + 1, plan.passes, plan.dispatch_chunk_tokens,
                                   plan.max_tokens)
        else:
            self.buffer.pass_stamp = NO_STAMP

    def _take_pending(self, handle=None):
        """The dispatch state finalize combines with: ``handle`` (a PrepareResult.handle), else
        the last prepare's."""
        if handle is not None:
            if handle is self._pending:
                self._pending = None
            return handle
        if self._pending is None:
            raise ValueError("finalize called without a preceding prepare")
        pending, self._pending = self._pending, None
        return pending


class PlacedExpertsPrepareAndFinalize(_DeepEPPrepareAndFinalize):
    """A DeepEP mode that hands the standard-layout experts GLOBAL ids: the received local ids
    plus rank_expert_offset, checked against the buffer's placement (see
    DeepEPHTPrepareAndFinalize); finalize sums the k slots where the experts did not and
    combines (``buffer.combine(x, handle)``, high-throughput and V2 alike)."""

    def __init__(self, buffer, num_dispatchers: int, rank_expert_offset: int,
                 use_ue8m0: bool) -> None:
        super().__init__(buffer, num_dispatchers, use_ue8m0)
        if isinstance(rank_expert_offset, bool) or not isinstance(rank_expert_offset, int) \
                or rank_expert_offset < 0:
            raise ValueError(f"rank_expert_offset={rank_expert_offset!r} must be an int >= 0")
        self.rank_expert_offset = rank_expert_offset
        self._checked_map: tuple | None = None  # (expert_map, its version, E_l) found right

    def _check_wiring(self, num_experts: int, local_num_experts: int,
                      expert_map: torch.Tensor | None) -> None:
        """ValueError unless this rank's experts are where the dispatch sends tokens (class
        docstring). Host integers only, except the expert_map, read once per map."""
        offset, E_l, R = self.rank_expert_offset, local_num_experts, self._num_dispatchers
        rank = buffer_rank_and_size(self.buffer)[0]
        if isinstance(rank, int):
            if offset != rank * E_l:
                raise ValueError(
                    f"rank_expert_offset={offset} does not match the buffer: this is rank {rank} "
                    f"of {R}, whose experts start at global id {rank} * E_l = {rank * E_l} "
                    f"(E_l = {num_experts} // {R}); pass rank_expert_offset=rank * E_l")
        elif offset % E_l or offset >= num_experts:
            raise ValueError(f"rank_expert_offset={offset} must be rank * E_l: a multiple of "
                             f"E_l = {E_l} below num_experts = {num_experts}")
        if expert_map is not None:
            self._check_expert_map(expert_map, E_l)

    def _check_expert_map(self, expert_map: torch.Tensor, local_num_experts: int) -> None:
        key = (expert_map, expert_map._version, local_num_experts)
        checked = self._checked_map
        if checked is not None and checked[0] is key[0] and checked[1:] == key[1:]:
            return
        if expert_map.is_cuda and torch.cuda.is_current_stream_capturing():
            return  # reading it would break the capture; the eager warm-up call has checked it
        offset = self.rank_expert_offset
        got = expert_map.tolist()
        want = [g - offset if offset <= g < offset + local_num_experts else -1
                for g in range(len(got))]
        if got != want:
            g = next(g for g in range(len(got)) if got[g] != want[g])
            raise ValueError(
                f"expert_map disagrees with rank_expert_offset={offset}: the dispatch brings this "
                f"rank global experts {offset}..{offset + local_num_experts - 1} as local ids "
                f"0..{local_num_experts - 1}, so expert_map[g] must be g - {offset} there and -1 "
                f"elsewhere; expert_map[{g}] = {got[g]}, not {want[g]}")
        self._checked_map = key

    def finalize_async(self, output, fused_expert_output, topk_weights, topk_ids,
                       apply_router_weight_on_input, *, output_is_reduced: bool = False,
                       handle=None):
        """Start combining the experts' output back to the source ranks; the receiver writes
        output [M, K].

        fused_expert_output: [M', K] already weighted and summed (output_is_reduced), combined as
        it is; or [M', k, K], first summed over k with the received weights (float32 math; none
        when the weights went on the input). Slots with id -1 hold exact zeros: the standard
        experts guarantee it (a zero weight alone would not cancel garbage, 0 * NaN = NaN).
        handle: the prepare's PrepareResult.handle (None: the last prepare's)."""
        handle = self._take_pending(handle)
        weights = None if apply_router_weight_on_input else topk_weights
        reduced = fused_expert_output if output_is_reduced else moe_sum(
            fused_expert_output, topk_weights=weights)
        combined, _, event = self.buffer.combine(reduced, handle, **self._async)

        def receive() -> None:
            _wait(event)
            output.copy_(combined)

        return receive


class DeepEPHTPrepareAndFinalize(PlacedExpertsPrepareAndFinalize):
    """DeepEP high-throughput (normal-mode) dispatch/combine; STANDARD activation format.

    The dispatch reads the receive counts on the host once per pass (DeepEP's does too).

    Arguments:
        buffer: a ``deep_ep.Buffer`` or ``TorchAll2AllBuffer`` over the expert-parallel group.
        num_dispatchers: ranks in that group (R).
        rank_expert_offset: global id of this rank's first expert (rank * E_l): added to the
            received local ids so the experts see global ids (with the caller's expert_map).
        use_ue8m0: the quant before the dispatch (and the experts', through the kernel) rounds
            its scales up to powers of two (PrepareAndFinalize.use_ue8m0).

    The dispatch brings this rank global experts rank * E_l ... rank * E_l + E_l - 1 (DeepEP's
    placement, E_l = num_experts / R), so prepare refuses with a ValueError a wiring that
    disagrees with it: rank_expert_offset other than the buffer's rank * E_l (where the buffer
    says its rank, see buffer_rank_and_size; else an offset that is no multiple of E_l below
    num_experts), or an expert_map other than global g -> g - rank_expert_offset on this rank's
    experts and -1 elsewhere. The map is read once per map tensor and version (a host
    synchronisation on CUDA, skipped while a CUDA graph is being captured).
    """

    activation_format = ActivationFormat.STANDARD
    _needs = ("get_dispatch_layout", "dispatch", "combine")
    _async = {"async_finish": True}  # the keyword that makes the buffer's calls asynchronous

    def check_capturable(self) -> None:
        raise ValueError("DeepEPHTPrepareAndFinalize cannot run under CUDA graph capture: its "
                         "dispatch reads the receive counts on the host. Capture the layer in "
                         "low-latency mode (DeepEPLLPrepareAndFinalize, as engines run decode), "
                         "or run this one eagerly, outside the graph")

    def __init__(self, buffer, *, num_dispatchers: int, rank_expert_offset: int,
                 use_ue8m0: bool = False) -> None:
        super().__init__(buffer, num_dispatchers, rank_expert_offset, use_ue8m0)
        self.num_recv_tokens_per_expert: list[int] | None = None  # of the last prepare

    def prepare_async(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                      apply_router_weight_on_input):
        """a1 bf16 [M, K] (M may be 0), topk_weights f32 [M, k], topk_ids int32/int64 [M, k]
        global ids.

        The receiver returns a1q fp8 [M', K] and row-major f32 scales [M', K/128] of the M'
        tokens received, topk_ids int64 [M', k] GLOBAL ids of experts on this rank (-1
        elsewhere) and topk_weights f32 [M', k] (0 at -1). The per-local-expert received counts
        are kept in ``num_recv_tokens_per_expert`` (known when this returns: the count exchange
        is synchronous).
        """
        local_num_experts = check_experts_per_rank(num_experts, self._num_dispatchers)
        self._check_wiring(num_experts, local_num_experts, expert_map)
        a1 = weighted_input(a1, topk_weights, apply_router_weight_on_input)
        a1q, a1s = per_token_group_quant_fp8(a1, SCALE_BLOCK, use_ue8m0=self.use_ue8m0)
        ids = topk_ids.to(torch.int64).contiguous()  # DeepEP takes int64 ids
        self._stamp_pass()
        per_rank, per_rdma, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            ids, num_experts)
        (recv_q, recv_s), recv_ids, recv_w, counts, handle, event = self.buffer.dispatch(
            (a1q, a1s), num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=ids,
            topk_weights=topk_weights.float().contiguous(), async_finish=True)
        self._pending = handle
        self.num_recv_tokens_per_expert = counts

        def receive() -> PrepareResult:
            _wait(event)
            global_ids = torch.where(recv_ids >= 0, recv_ids + self.rank_expert_offset, recv_ids)
            return PrepareResult(a1q=recv_q, a1q_scale=recv_s, topk_ids=global_ids,
                                 topk_weights=recv_w, handle=handle)

        return receive


class DeepEPLLPrepareAndFinalize(_DeepEPPrepareAndFinalize):
    """DeepEP low-latency dispatch/combine; BATCHED activation format [E_l, R*N, K].

    Neither DeepEP's nor TorchAll2AllBuffer's low-latency calls read the device on the host, so a
    layer call can be captured in a CUDA graph: with one rank as it is; with several, as one pass
    (M <= min(VLLM_FUSED_MOE_CHUNK_SIZE, max_tokens_per_rank) on every rank) or, given
    max_tokens_across_ranks, in its passes (num_chunks). prepare / finalize run each dispatch and
    combine as one DeepEP kernel on its own stream, fenced by events; prepare_async /
    finalize_async use its hook mode (return_recv_hook: a send kernel now, the receive kernel in
    the receiver, both on the caller's stream, as vLLM calls it), which measured slower for a
    call waited for at once on an H200, on the host and in a CUDA graph
    (benchmarks/bench_decode.py), and which lets the experts of another micro-batch run between
    the two kernels.

    One low-latency call in flight: DeepEP v1.2.1 flips between its two buffers at every call
    and each send zeroes the other buffer's arrival counters (csrc/deep_ep.cpp:1128-1129 and
    1249-1250, csrc/kernels/internode_ll.cu:183-186 and 604-608), which the previous call's
    receive kernel spins on (internode_ll.cu:278 and 773): a second send before the first call's
    receive hook would hang. So every call (sync or async, dispatch or combine) first runs the
    receive hook still pending, and a receiver whose hook already ran returns at once: in the
    kernel's two-batch schedule dispatch 1 stays in flight during experts 0 and combine 0 during
    experts 1 (bit-equal to the synchronous calls over a real Buffer on an H200, world 1).

    A top-k that repeats an expert (all-zero dummy ids) sends one row per slot, so a rank of M
    tokens can send M*k rows to one expert, while DeepEP receives N = max_tokens_per_rank rows
    per (local expert, source rank). Where values are checked (CPU tensors; CUDA with
    VLLM_MOE_CHECK_IDS=1, not under CUDA graph capture) a dispatch in which any rank sends more
    than N rows to one expert raises ValueError on every rank before DeepEP runs. Unchecked,
    DeepEP v1.2.1 numbers each expert's rows from a source rank with an unbounded counter: rows
    past N overwrite the next source rank's rows of that expert (or the next expert's, or run
    past the buffer), and the receive copies more than R*N rows into an expert's slice, with no
    error (TorchAll2AllBuffer instead makes the tokens of dropped rows NaN). The chunks keep
    M <= N per pass (min(VLLM_FUSED_MOE_CHUNK_SIZE, max_tokens_per_rank)), not M*k <= N: a
    router's top-k names k distinct experts and needs no more; where ids can repeat, keep
    M*k <= N (VLLM_FUSED_MOE_CHUNK_SIZE <= N // k, or a smaller M) or run with checked values.

    Arguments:
        buffer: a low-latency ``deep_ep.Buffer`` or ``TorchAll2AllBuffer(low_latency_mode=True)``
            sized for at least (max_tokens_per_rank, K, R, E).
        num_dispatchers: ranks in the group (R).
        max_tokens_per_rank: N, tokens per rank per pass (identical on every rank); longer calls
            run in chunks of N.
        use_fp8_dispatch: quantise inside the dispatch (DeepEP's cast); else send bf16 and
            quantise the received slices here.
        use_ue8m0: that quant rounds its scales up to powers of two (the dispatch's cast through
            DeepEP's round_scale, whose amax floor and scale arithmetic are DeepEP's own), and
            so do the experts' (through the kernel): PrepareAndFinalize.use_ue8m0.
    """

    activation_format = ActivationFormat.BATCHED
    _needs = ("low_latency_dispatch", "low_latency_combine")

    def __init__(self, buffer, *, num_dispatchers: int, max_tokens_per_rank: int,
                 use_fp8_dispatch: bool = True, use_ue8m0: bool = False) -> None:
        super().__init__(buffer, num_dispatchers, use_ue8m0)
        if not getattr(buffer, "low_latency_mode", False):
            raise ValueError("buffer must be built with low_latency_mode=True for low-latency "
                             "dispatch")
        check_positive_int("max_tokens_per_rank", max_tokens_per_rank)
        check_bool("use_fp8_dispatch", use_fp8_dispatch)
        self.max_tokens_per_rank_ = max_tokens_per_rank
        self.use_fp8_dispatch = use_fp8_dispatch
        self._unreceived = None  # the receive hook of the low-latency call in flight

    def max_num_tokens_per_rank(self) -> int:
        return self.max_tokens_per_rank_

    def _receive_in_flight(self) -> None:
        """Run the pending receive hook, if any: before another low-latency call (class
        docstring), or from its receiver."""
        hook, self._unreceived = self._unreceived, None
        if hook is not None:
            hook()

    def _receiver_of(self, hook):
        """A receiver that runs ``hook`` unless a later call already ran it."""
        self._unreceived = hook

        def receive() -> None:
            if self._unreceived is hook:
                self._receive_in_flight()

        return receive

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input) -> PrepareResult:
        """prepare_async's dispatch in one kernel (no receive hook), waited for at once."""
        return self._dispatch(a1, topk_weights, topk_ids, num_experts,
                              apply_router_weight_on_input, hook=False)()

    def prepare_async(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                      apply_router_weight_on_input):
        """a1 bf16 [M, K] with M <= max_tokens_per_rank; topk_ids int32/int64 [M, k] global ids.

        The receiver (the dispatch's receive hook, then the received-slice quant without FP8
        dispatch) returns a1q fp8 [E_l, R*N, K], a1q_scale f32 [E_l, R*N, K/128] (MN-major per
        expert) and expert_num_tokens int32 [E_l]; rows past a count are undefined. expert_map
        is not used: DeepEP places expert g on rank g // E_l. The buffer holds two dispatches'
        results (DeepEP's two low-latency buffers), but one call's transfer in flight (class docstring).
        """
        return self._dispatch(a1, topk_weights, topk_ids, num_experts,
                              apply_router_weight_on_input, hook=True)

    def _dispatch(self, a1, topk_weights, topk_ids, num_experts, apply_router_weight_on_input,
                  *, hook: bool):
        """The dispatch, with DeepEP's receive hook (hook) or as one kernel; its receiver."""
        n = self.max_tokens_per_rank_
        if a1.shape[0] > n:
            raise ValueError(f"{a1.shape[0]} tokens exceed max_tokens_per_rank={n}")
        a1 = weighted_input(a1, topk_weights, apply_router_weight_on_input).contiguous()
        # DeepEP takes int64 ids; combine needs them too
        ids = topk_ids if topk_ids.dtype == torch.int64 and topk_ids.is_contiguous() else \
            topk_ids.to(torch.int64).contiguous()
        if is_deep_ep_buffer(self.buffer):  # TorchAll2AllBuffer checks this in its dispatch
            self._check_expert_capacity(ids, num_experts)
        self._stamp_pass()
        self._receive_in_flight()
        recv_x, counts, handle, _, hook_fn = self.buffer.low_latency_dispatch(
            a1, ids, n, num_experts, use_fp8=self.use_fp8_dispatch,
            round_scale=self.use_fp8_dispatch and self.use_ue8m0, return_recv_hook=hook)
        pending = self._pending = (handle, ids)
        received = completed if hook_fn is None else self._receiver_of(hook_fn)

        def receive() -> PrepareResult:
            received()
            a1q, a1s = recv_x if self.use_fp8_dispatch else quant_batched_fp8(
                recv_x, use_ue8m0=self.use_ue8m0)
            return PrepareResult(a1q=a1q, a1q_scale=a1s, expert_num_tokens=counts,
                                 handle=pending)

        return receive

    def _check_expert_capacity(self, ids: torch.Tensor, num_experts: int) -> None:
        """Where values are checked (envs.values_checked_on; never under CUDA graph capture):
        ValueError on every rank when any rank's ids int64 [M, k] (in [-1, num_experts)) send
        more than N rows to one expert (ll.check_expert_capacity, the rule TorchAll2AllBuffer's
        dispatch applies), before DeepEP's dispatch would write past its receive area. One
        all-gather of each rank's ll.busiest_expert on the buffer's group, so every rank must
        check alike (the same VLLM_MOE_CHECK_IDS everywhere)."""
        if not envs.values_checked_on(ids.device) or (
                ids.is_cuda and torch.cuda.is_current_stream_capturing()):
            return
        busiest = ll.busiest_expert(ids, num_experts)
        if self._num_dispatchers > 1:
            gathered = busiest.new_empty(self._num_dispatchers * busiest.numel())
            run_collective(dist.all_gather_into_tensor, gathered, busiest,
                           group=getattr(self.buffer, "group", None))
            busiest = gathered
        ll.check_expert_capacity(busiest.view(-1, 2).tolist(), self.max_tokens_per_rank_)

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, *, output_is_reduced: bool = False,
                 handle=None) -> None:
        """finalize_async's combine in one kernel (no receive hook), waited for at once."""
        self._combine(output, fused_expert_output, topk_weights, apply_router_weight_on_input,
                      handle, hook=False)()

    def finalize_async(self, output, fused_expert_output, topk_weights, topk_ids,
                       apply_router_weight_on_input, *, output_is_reduced: bool = False,
                       handle=None):
        """fused_expert_output bf16 [E_l, R*N, K] (valid rows only are read): combined with the
        weights (ones when they went on the input) straight into output [M, K] (contiguous),
        which holds the result when the receiver (the combine's receive hook) has returned.
        handle: the prepare's PrepareResult.handle (None: the last prepare's)."""
        return self._combine(output, fused_expert_output, topk_weights,
                             apply_router_weight_on_input, handle, hook=True)

    def _combine(self, output, fused_expert_output, topk_weights, apply_router_weight_on_input,
                 handle, *, hook: bool):
        """The combine, with DeepEP's receive hook (hook) or as one kernel; its receiver."""
        handle, ids = self._take_pending(handle)
        if apply_router_weight_on_input:
            weights = torch.ones_like(topk_weights, dtype=torch.float32)
        elif topk_weights.dtype == torch.float32 and topk_weights.is_contiguous():
            weights = topk_weights
        else:
            weights = topk_weights.float().contiguous()
        self._receive_in_flight()
        _, _, hook_fn = self.buffer.low_latency_combine(fused_expert_output, ids, weights, handle,
                                                        out=output, return_recv_hook=hook)
        return completed if hook_fn is None else self._receiver_of(hook_fn)


class DeepEPV2PrepareAndFinalize(PlacedExpertsPrepareAndFinalize):
    """DeepEP V2 ``ElasticBuffer`` dispatch/combine; STANDARD activation format.

    Arguments:
        buffer: a ``deep_ep.ElasticBuffer`` or ``TorchElasticBuffer`` over the expert-parallel
            group, holding the layouts of (max_tokens_per_rank, K, k) with FP8 dispatch.
        num_dispatchers: ranks in that group (R).
        rank_expert_offset: global id of this rank's first expert (rank * E_l): added to the
            received local ids so the experts see global ids (with the caller's expert_map).
        max_tokens_per_rank: N, most tokens a rank dispatches per pass, the same on every rank
            (longer calls run in chunks of N); None: the buffer's ``num_max_tokens_per_rank``.
        do_cpu_sync: wait for the exact receive size (True) or take R*N rows without a host
            read (False).
        topk_idx_dtype: the dtype V2 was built to take ids in (``deep_ep.topk_idx_t``: int64
            unless DeepEP was built with EP_NUM_TOPK_IDX_BITS=32).
        use_ue8m0: the quant before the dispatch (and the experts', through the kernel) rounds
            its scales up to powers of two (PrepareAndFinalize.use_ue8m0).
    """

    _buffer_kinds = "a deep_ep.ElasticBuffer (DeepEP V2) or its stand-in TorchElasticBuffer"

    activation_format = ActivationFormat.STANDARD
    _needs = ("dispatch", "combine", "get_buffer_size_hint")
    _async = {"async_with_compute_stream": True}

    def __init__(self, buffer, *, num_dispatchers: int, rank_expert_offset: int,
                 max_tokens_per_rank: int | None = None, do_cpu_sync: bool = True,
                 topk_idx_dtype: torch.dtype = torch.int64, use_ue8m0: bool = False) -> None:
        super().__init__(buffer, num_dispatchers, rank_expert_offset, use_ue8m0)
        if max_tokens_per_rank is None:
            max_tokens_per_rank = getattr(buffer, "num_max_tokens_per_rank", 0)
        check_positive_int("max_tokens_per_rank", max_tokens_per_rank)
        if not isinstance(do_cpu_sync, bool):
            raise ValueError(f"do_cpu_sync={do_cpu_sync!r} must be a bool")
        if topk_idx_dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk_idx_dtype={topk_idx_dtype} must be torch.int32 or torch.int64")
        self.max_tokens_per_rank_ = max_tokens_per_rank
        self.do_cpu_sync = do_cpu_sync
        self.topk_idx_dtype = topk_idx_dtype
        self.num_recv_tokens_per_expert: list[int] | None = None  # of the last prepare

    def max_num_tokens_per_rank(self) -> int:
        return self.max_tokens_per_rank_

    def check_capturable(self) -> None:
        if self.do_cpu_sync:
            raise ValueError("DeepEPV2PrepareAndFinalize(do_cpu_sync=True) cannot run under CUDA "
                             "graph capture: its dispatch waits for the receive counts on the "
                             "host. Capture it with do_cpu_sync=False (make_moe_kernel's "
                             "low_latency=True), or run it eagerly, outside the graph")

    def prepare_async(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                      apply_router_weight_on_input):
        """a1 bf16 [M, K] (M <= max_tokens_per_rank, may be 0), topk_weights f32 [M, k],
        topk_ids int32/int64 [M, k] global ids.

        The receiver returns a1q fp8 [M', K] and row-major f32 scales [M', K/128] of the rows
        received, topk_ids [M', k] (topk_idx_dtype) GLOBAL ids of experts on this rank (-1
        elsewhere and on rows past the valid ones) and topk_weights f32 [M', k] (0 at -1). With
        do_cpu_sync the aligned per-local-expert counts are kept in
        ``num_recv_tokens_per_expert`` (else []).
        V2 places expert g on rank g // E_l: rank_expert_offset and expert_map are checked
        against that placement as DeepEPHTPrepareAndFinalize checks them.
        """
        n = self.max_tokens_per_rank_
        if a1.shape[0] > n:
            raise ValueError(f"{a1.shape[0]} tokens exceed max_tokens_per_rank={n}")
        local_num_experts = check_experts_per_rank(num_experts, self._num_dispatchers)
        self._check_wiring(num_experts, local_num_experts, expert_map)
        a1 = weighted_input(a1, topk_weights, apply_router_weight_on_input)
        a1q, a1s = per_token_group_quant_fp8(a1, SCALE_BLOCK, use_ue8m0=self.use_ue8m0)
        ids = topk_ids.to(self.topk_idx_dtype).contiguous()
        self._stamp_pass()
        (recv_q, recv_s), recv_ids, recv_w, handle, event = self.buffer.dispatch(
            (a1q, a1s), topk_idx=ids, topk_weights=topk_weights.float().contiguous(),
            num_experts=num_experts, num_max_tokens_per_rank=n, do_cpu_sync=self.do_cpu_sync,
            **self._async)
        self._pending = handle
        self.num_recv_tokens_per_expert = handle.num_recv_tokens_per_expert_list

        def receive() -> PrepareResult:
            _wait(event)
            here = recv_ids >= 0
            if not self.do_cpu_sync:  # rows past the received total hold whatever was there
                total = handle.psum_num_recv_tokens_per_scaleup_rank[-1]
                rows = torch.arange(recv_ids.shape[0], device=recv_ids.device)
                here &= (rows < total).unsqueeze(1)
            global_ids = torch.where(here, recv_ids + self.rank_expert_offset, -1)
            weights = torch.where(here, recv_w, 0.0)
            return PrepareResult(a1q=recv_q, a1q_scale=recv_s, topk_ids=global_ids,
                                 topk_weights=weights, handle=handle)

        return receive
