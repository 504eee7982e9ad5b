"""DeepEP's ``Buffer`` API, the subset our expert-parallel paths call, on torch.distributed.

``TorchAll2AllBuffer`` is the ``naive`` all-to-all backend and the vehicle that lets CPU CI run the
expert-parallel code for real (gloo) as well as NCCL on GPUs. It speaks DeepEP v1.2.1's shapes,
dtypes, -1 conventions, return tuples and handle semantics, and refuses (``ValueError``, naming the
argument and the rule) what DeepEP's asserts refuse. Every exchange moves bytes (gloo has no
float8).

High-throughput (normal) mode sends each token once to every rank holding one of its experts, in
variable-size messages: ``dispatch`` reads the counts to the host once (DeepEP's does too: the
receive size is a host-side tensor shape), in one ``all_to_all_single`` of a [R, 1 + E_l + 2]
count matrix (its last two columns: the dispatch's PassStamp), then moves every per-row tensor of
the call (x, its scales, top-k ids and weights) packed into one byte row, in one
``all_to_all_single``. ``combine`` does not synchronise.

Every collective goes through ``collectives.run_collective``, which returns only once gloo has let
go of the CPU tensors (a late release during interpreter shutdown aborts the process).

Low-latency mode moves fixed-size messages and never reads a device value on the host, so a CUDA
graph can capture it (the device-side steps live in ``ll_exchange``):

    low_latency_dispatch (one all-gather):
        slab [N, row] bytes = (top-k ids int64 [k] | scales f32 [H/128] | fp8 [H]) per token,
            rows T..N-1 carry ids -1
        all_gather -> [R, N, row]: every rank sees every rank's slab
        route: the (source, token, slot) pairs whose expert lives here, numbered per expert by a
            cumulative sum (source rank, then token order), give each row's place in
            recv_x [E_l, R*N, H]; a Triton kernel copies the served rows there. As in DeepEP, a
            top-k that repeats an expert sends one row per slot; where values are checked, a
            rank sending more than N rows to one expert (DeepEP's receive capacity per expert
            and source rank) is refused on every rank, elsewhere a row past its expert's R*N
            is dropped and its token's output made NaN
    low_latency_combine (one all_to_all_single):
        each served (source, token, slot) pair's expert output row goes back to its source
            unweighted (bf16 [N, k, H] per rank); the source sums w * row over its k slots in
            slot order in float32 and rounds once to bf16, as DeepEP's combine does, so the
            output does not depend on which rank served a slot

    A group of one rank skips the collectives (its all-gather and all-to-all are copies) and its
    combine sums the weighted expert outputs straight into the bf16 output.

Asynchronous calls: ``dispatch`` / ``combine`` with ``async_finish=True`` and the low-latency
pair with ``async_finish`` or ``return_recv_hook`` start their data exchange
(``collectives.start_collective``: ``async_op=True``, gloo or NCCL) and return at once, with
results that are valid once the returned ``Completion`` (the event, or the hook) has been called:
it waits for the exchange and runs the steps that read what arrived (unpacking the packed rows,
the low-latency routing, the combine's sums) into the tensors already returned. The
high-throughput dispatch's count exchange stays synchronous (the receive size is a host-side
shape, as in DeepEP). Under CUDA graph capture the low-latency calls complete before they return
(their hook is then a no-op), so a capture holds no pending collective.

Differences from DeepEP, by design:
  * ``previous_event`` and ``allocate_on_comm_stream`` are accepted and ignored; events are
    ``Completion`` objects (``current_stream_wait()`` completes the call), ``None`` for a
    synchronous call.
  * Handles are private named tuples: pass them back, do not look inside.
  * ``num_worst_tokens`` and UE8M0 scales are not supported (``ValueError``); ``use_logfmt`` and
    ``zero_copy`` are accepted, combine is exact bf16/float32 either way.
  * Rows of the low-latency receive buffer past ``recv_count`` are undefined (stale), as in
    DeepEP.
  * Values (top-k ids in range, N equal on every rank, counts consistent with the mask) are
    checked for CPU tensors always and for CUDA tensors only with ``VLLM_MOE_CHECK_IDS=1``: a check
    reads the device on the host. Unchecked, an out-of-range expert id selects no expert.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from vllm_moe_fixes._validate import check, check_positive_int
from vllm_moe_fixes.distributed import buffer_checks as checks
from vllm_moe_fixes.distributed import deepep_sizing as sizing
from vllm_moe_fixes.distributed import ll_exchange as ll
from vllm_moe_fixes.distributed.collectives import (
    NO_STAMP,
    check_same_pass,
    run_collective,
    stamp_digest,
    start_collective,
)
from vllm_moe_fixes.sizes import align_up

# torch 2.13 names it all_gather_single; older releases all_gather_into_tensor (same arguments).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _HTHandle(NamedTuple):
    is_token_in_rank: torch.Tensor  # [T, R] bool, as dispatched
    send_rows: torch.Tensor         # [S] int64: token of each sent row, grouped by destination
    send_splits: list[int]          # rows sent to each rank
    recv_splits: list[int]          # rows received from each rank


class _LLHandle(NamedTuple):
    recv_row: torch.Tensor          # [R*N, k] int64: row of recv_x.view(-1, H) each received pair
                                    # filled (0 where the pair's expert lives elsewhere)
    served: torch.Tensor            # [R*N, k] bool: the pair's expert lives here
    num_tokens: int                 # T, this rank's dispatched tokens
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    workspace: ll.LLWorkspace       # the dispatch's tensors, reused by the combine


class Completion:
    """The rest of an asynchronous buffer call: waits for its exchange and runs the steps that
    read what arrived. Called directly (a receive hook), or as DeepEP's ``EventOverlap`` through
    ``current_stream_wait()``; it runs once, later calls return at once."""

    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish: Callable[[], None] | None = finish

    @property
    def event(self) -> Completion | None:
        """Not None while the call is pending (EventOverlap.event's role)."""
        return self if self._finish is not None else None

    def __call__(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()

    current_stream_wait = __call__


def _completed() -> None:
    """The receive hook of a call that completed before it returned."""


def completion(finish: Callable[[], None], asynchronous: bool) -> Completion | None:
    """Completion(finish) for an asynchronous call; else run finish now and return None (a
    synchronous call's event)."""
    if asynchronous:
        return Completion(finish)
    finish()
    return None


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t with row-major strides, for a view as another dtype. ``contiguous()`` is not enough: a
    tensor with one row or none counts as contiguous whatever its strides (a one-row slice of a
    packed row keeps the row's stride), and the view refuses strides it cannot divide."""
    strides, step = [], 1
    for n in reversed(t.shape):
        strides.append(step)
        step *= n
    if t.stride() == tuple(reversed(strides)):
        return t
    return t.clone(memory_format=torch.contiguous_format)


class TorchAll2AllBuffer:
    """The all-to-all buffer of the ``naive`` backend (DeepEP ``Buffer`` API, torch.distributed).

    Arguments:
        group: the expert-parallel process group (None: the default group); gloo for CPU tensors,
            NCCL for CUDA tensors.
        low_latency_mode: enable ``low_latency_dispatch``/``low_latency_combine``.
        num_max_dispatch_tokens_per_rank, hidden, num_experts: the sizes the low-latency buffer is
            built for (required with ``low_latency_mode``). A low-latency call needing more bytes
            than DeepEP's hint for these sizes is refused, as DeepEP's ``layout.total_bytes <=
            num_rdma_bytes`` assertion would refuse it.
    """

    num_sms: int = sizing.DEFAULT_NUM_SMS

    def __init__(self, group: dist.ProcessGroup | None = None, *, low_latency_mode: bool = False,
                 num_max_dispatch_tokens_per_rank: int | None = None, hidden: int | None = None,
                 num_experts: int | None = None) -> None:
        if not dist.is_initialized():
            raise ValueError("TorchAll2AllBuffer needs torch.distributed to be initialised")
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.low_latency_mode = low_latency_mode
        self.num_rdma_bytes = 0
        if low_latency_mode:
            for name, value in (("num_max_dispatch_tokens_per_rank",
                                 num_max_dispatch_tokens_per_rank),
                                ("hidden", hidden), ("num_experts", num_experts)):
                check_positive_int(name, value)  # low_latency_mode needs all three
            self.num_rdma_bytes = sizing.deepep_ll_rdma_bytes(
                num_max_dispatch_tokens_per_rank, hidden, self.group_size, num_experts)
        self.ll_sizes = (num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self._ll_sizes_ok: set[tuple[int, int, int]] = set()  # (N, H, E) that passed the checks
        self._ll_workspaces: dict[tuple, list[ll.LLWorkspace]] = {}  # see _ll_workspace
        # Set by the prepare/finalize before each dispatch, compared across the ranks in the
        # dispatch's count exchange (high-throughput) or N check (low-latency, where values are
        # checked): ranks at different passes of a layer call raise together (PassStamp).
        self.pass_stamp = NO_STAMP
        self._stamp_messages: dict[tuple, tuple] = {}  # see _stamp_message

    # ----------------------------------------------------------------- static helpers (DeepEP's)
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Record the SM count used by the normal-mode configs (even, as DeepEP requires)."""
        if new_num_sms <= 0 or new_num_sms % 2:
            raise ValueError(f"new_num_sms={new_num_sms} must be a positive even number")
        TorchAll2AllBuffer.num_sms = new_num_sms

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """DeepEP's low-latency RDMA size hint in bytes (``deepep_sizing.deepep_ll_rdma_bytes``)."""
        return sizing.deepep_ll_rdma_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                           num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> sizing.Config:
        """DeepEP's tuned dispatch config (accepted by ``dispatch`` and otherwise unused here)."""
        return sizing.get_dispatch_config(num_ranks, TorchAll2AllBuffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> sizing.Config:
        """DeepEP's tuned combine config (accepted by ``combine`` and otherwise unused here)."""
        return sizing.get_combine_config(num_ranks, TorchAll2AllBuffer.num_sms)

    # ----------------------------------------------------------------- communication primitives
    def _start_exchange(self, send: torch.Tensor, send_splits: list[int],
                        recv_splits: list[int]) -> tuple[torch.Tensor, Callable[[], None]]:
        """Start an all_to_all_single of the rows of ``send`` (any dtype; moved as bytes): the
        received rows [sum(recv_splits), ...] of send's dtype, valid once ``wait()`` returned."""
        row_bytes = math.prod(send.shape[1:]) * send.element_size()
        payload = _dense(send).view(torch.uint8).reshape(send.shape[0], row_bytes)
        out = torch.empty(sum(recv_splits), row_bytes, dtype=torch.uint8, device=send.device)
        wait = _completed
        if row_bytes:
            wait = self._start(dist.all_to_all_single, out, payload, recv_splits, send_splits,
                               group=self.group)
        return out.view(send.dtype).view(out.shape[0], *send.shape[1:]), wait

    def _start(self, collective, *args, **kwargs) -> Callable[[], None]:
        """Every exchange of the data starts here (collectives.start_collective); a stand-in
        that models the link (delayed_buffer.DelayedAll2AllBuffer) overrides it."""
        return start_collective(collective, *args, **kwargs)

    def _start_exchange_packed(self, fields: list[torch.Tensor], send_splits: list[int],
                               recv_splits: list[int], rows: torch.Tensor | None = None
                               ) -> tuple[list[torch.Tensor], Callable[[], None]]:
        """Start moving the rows of several tensors [T, ...] (any dtypes, same T) in ONE
        all_to_all_single: ([T', ...] per field, finish). Each row's fields are packed into one
        uint8 row (``rows``: the row indices to send, in send order; None: all rows); ``finish()``
        waits and slices the received rows into the returned contiguous tensors."""
        if len(fields) == 1:
            send = fields[0] if rows is None else fields[0][rows]
            got, wait = self._start_exchange(send, send_splits, recv_splits)
            return [got], wait
        t = fields[0].shape[0]
        widths = [math.prod(f.shape[1:]) * f.element_size() for f in fields]
        payload = torch.cat([_dense(f).view(torch.uint8).reshape(t, w)
                             for f, w in zip(fields, widths)], 1)
        got, wait = self._start_exchange(payload if rows is None else payload[rows],
                                         send_splits, recv_splits)
        outs = [torch.empty(got.shape[0], *f.shape[1:], dtype=f.dtype, device=f.device)
                for f in fields]

        def finish() -> None:
            wait()
            start = 0
            for out, w in zip(outs, widths):
                out.view(torch.uint8).view(got.shape[0], w).copy_(got[:, start:start + w])
                start += w

        return outs, finish

    def _all_gather(self, slab: torch.Tensor) -> torch.Tensor:
        """[n, ...] on every rank -> [R, n, ...]: rank s's slab at index s (a fixed-size
        message). A group of one rank gathers nothing: the slab itself, viewed [1, n, ...]."""
        r = self.group_size
        if r == 1:
            return slab.view(1, *slab.shape)
        out = torch.empty(r * slab.shape[0], *slab.shape[1:], dtype=slab.dtype, device=slab.device)
        # gloo wants the [R*n, ...] form
        run_collective(_all_gather, out, slab.contiguous(), group=self.group)
        return out.view(r, *slab.shape)

    # ------------------------------------------------------------- high-throughput (normal) mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Count what ``dispatch`` will send (local; no communication, no host sync).

        Arguments:
            topk_idx: int64 [T, k] contiguous, global expert ids, -1 = no selection.
            num_experts: global expert count E (a multiple of the rank count).

        Returns:
            num_tokens_per_rank: int32 [R], tokens sent to each rank (once per rank, not per
                expert).
            num_tokens_per_rdma_rank: int32 [R/8] per 8-rank node, or None up to 8 ranks (DeepEP's
                intranode case).
            num_tokens_per_expert: int32 [E], (token, expert) selections per expert.
            is_token_in_rank: bool [T, R].
            event: None.
        """
        local_num_experts = checks.check_topk(topk_idx, num_experts, self.group_size)
        r, dev = self.group_size, topk_idx.device
        valid = topk_idx >= 0
        # -1 slots land in a spare column / bin that is dropped: no boolean indexing, no host sync.
        dest = torch.where(valid, topk_idx // local_num_experts, r)
        in_rank = torch.zeros(topk_idx.shape[0], r + 1, dtype=torch.bool, device=dev) \
            .scatter_(1, dest, True)[:, :r].contiguous()
        per_rank = in_rank.sum(0, dtype=torch.int32)
        per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev).index_add_(
            0, torch.where(valid, topk_idx, num_experts).reshape(-1),
            torch.ones(topk_idx.numel(), dtype=torch.int32, device=dev))[:num_experts]
        per_rdma = None
        if r > sizing.NUM_MAX_NVL_PEERS:
            per_rdma = in_rank.view(-1, r // sizing.NUM_MAX_NVL_PEERS, sizing.NUM_MAX_NVL_PEERS) \
                .any(2).sum(0, dtype=torch.int32)
        return per_rank, per_rdma, per_expert, in_rank, None

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config=None, previous_event=None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send each token once to every rank holding one of its experts.

        Synchronises with the device once without a handle (the receive counts become host-side
        sizes, as in DeepEP); not at all with a handle.

        Arguments:
            x: contiguous [T, H] tensor (bf16; rows of a multiple of 16 bytes), or a tuple
                (float8_e4m3fn [T, H] contiguous, float32 scales [T, S]).
            handle: a handle from an earlier dispatch with the same routing: reuse its layout (then
                topk_idx/topk_weights must be None).
            num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert:
                ``get_dispatch_layout``'s results (needed without a handle).
            topk_idx: int64 [T, k] global ids (-1 allowed); topk_weights: float32 [T, k]; both
                contiguous, both given or neither.
            expert_alignment: each received per-expert count is rounded up to a multiple of this.
            num_worst_tokens: must be 0 (not supported).
            async_finish: return once the rows are on their way; the results are valid after
                ``event.current_stream_wait()`` (the count exchange has completed either way).
            config, previous_event, allocate_on_comm_stream: accepted, ignored.

        Returns:
            recv_x: like x, [T', ...]: the tokens received, grouped by source rank, token order.
            recv_topk_idx: int64 [T', k] LOCAL expert ids (id - rank * E_l) for experts here,
                else -1; recv_topk_weights: float32 [T', k], 0 where the id is -1 (None if not
                sent).
            num_recv_tokens_per_expert_list: list of E_l ints.
            handle: pass to ``combine`` (or to a cached ``dispatch``).
            event: a Completion with ``async_finish``, else None.
            With a handle: (recv_x, None, None, None, None, event).
        """
        if num_worst_tokens:
            raise ValueError(f"num_worst_tokens={num_worst_tokens}: not supported by "
                             "TorchAll2AllBuffer (use 0)")
        if expert_alignment < 1:
            raise ValueError(f"expert_alignment={expert_alignment} must be >= 1")
        x_data, x_scales = x if isinstance(x, tuple) else (x, None)
        checks.check_rows(x_data, x_scales)
        fields = [x_data] + ([x_scales] if x_scales is not None else [])
        if handle is not None:
            check(isinstance(handle, _HTHandle),
                  "handle must be the one this buffer's dispatch returned")
            checks.check_cached_dispatch(x_data, topk_idx, topk_weights,
                                         handle.is_token_in_rank.shape[0])
            got, finish = self._send_rows(handle, fields)
            event = completion(finish, async_finish)
            return (got[0] if x_scales is None else tuple(got)), None, None, None, None, event

        local_num_experts = checks.check_layout(
            x_data.shape[0], self.group_size, num_tokens_per_rank, is_token_in_rank,
            num_tokens_per_expert, topk_idx, topk_weights)
        send_splits, recv_splits, per_expert_list = self._agree_counts(
            num_tokens_per_rank, num_tokens_per_expert, expert_alignment)
        handle = _HTHandle(is_token_in_rank, self._send_order(is_token_in_rank, send_splits),
                           send_splits, recv_splits)
        if topk_idx is not None:
            fields += [topk_idx, topk_weights]
        got, received = self._send_rows(handle, fields)
        recv_x = tuple(got[:2]) if x_scales is not None else got[0]
        recv_idx = recv_w = None
        if topk_idx is not None:
            recv_idx, recv_w = got[-2:]

        def finish() -> None:
            received()
            if recv_idx is not None:
                self._localise(recv_idx, recv_w, local_num_experts)

        event = completion(finish, async_finish)
        return recv_x, recv_idx, recv_w, per_expert_list, handle, event

    def combine(self, x: torch.Tensor, handle: _HTHandle, topk_weights: torch.Tensor | None = None,
                bias=None, config=None, previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Send each received row back to its source rank and sum a token's copies (unweighted).

        No host sync (the sizes come from the handle).

        Arguments:
            x: bf16 [T', H] contiguous, one row per received token, in ``dispatch``'s receive order.
            handle: the handle ``dispatch`` returned.
            topk_weights: optional float32 [T', k] contiguous, summed back the same way.
            bias: optional bf16 [T, H] contiguous tensor or tuple of up to two, added to the result.
            async_finish: return once the rows are on their way; the results are valid after
                ``event.current_stream_wait()``.
            config, previous_event, allocate_on_comm_stream: accepted, ignored.

        Returns:
            combined_x: bf16 [T, H] (float32 accumulation; tokens sent nowhere are zero).
            combined_topk_weights: float32 [T, k] or None.
            event: a Completion with ``async_finish``, else None.
        """
        check(isinstance(handle, _HTHandle),
              "combine needs the handle returned by this buffer's dispatch")
        t = handle.is_token_in_rank.shape[0]
        checks.check_combine(x, topk_weights, bias, sum(handle.recv_splits), t)
        fields = [x] + ([topk_weights] if topk_weights is not None else [])
        # x and the weights in one exchange
        back, received = self._start_exchange_packed(fields, handle.recv_splits,
                                                     handle.send_splits)
        combined = torch.empty(t, x.shape[1], dtype=x.dtype, device=x.device)
        combined_w = None
        if topk_weights is not None:
            combined_w = torch.zeros(t, topk_weights.shape[1], dtype=torch.float32, device=x.device)

        def finish() -> None:
            received()
            out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
            out.index_add_(0, handle.send_rows, back[0].float())
            for b in (bias if isinstance(bias, tuple) else (bias,)):
                if b is not None:
                    out += b.float()
            combined.copy_(out)
            if combined_w is not None:
                combined_w.index_add_(0, handle.send_rows, back[1])

        return combined, combined_w, completion(finish, async_finish)

    # High-throughput steps.
    def _agree_counts(self, num_tokens_per_rank, num_tokens_per_expert, expert_alignment):
        """Exchange the [R, 1 + E_l + 2] count matrix (counts, then the stamp's digest columns) and
        read it to the host (the one sync).

        Returns (rows sent to each rank, rows received from each rank, aligned selections received
        per local expert), lists of ints."""
        r, stamp = self.group_size, self.pass_stamp
        self.pass_stamp = NO_STAMP  # one dispatch's
        counts, sums = self._stamp_message(stamp, num_tokens_per_rank.device,
                                           local_experts=num_tokens_per_expert.numel() // r)
        counts[:, 0].copy_(num_tokens_per_rank)
        counts[:, 1:-2].copy_(num_tokens_per_expert.view(r, -1))
        got = torch.empty_like(counts)
        # row s: what rank s sends here; its last two columns: rank s's stamp digest d_s, d_s**2
        run_collective(dist.all_to_all_single, got, counts, group=self.group)
        host = torch.cat([counts[:, 0], got[:, 0], got[:, 1:].sum(0)]).tolist()
        if host[-2:] != sums:  # every rank sees it (collectives.STAMP_DIGEST_BITS): gather, raise
            self._check_same_pass(stamp, num_tokens_per_rank.device)
        return host[:r], host[r:2 * r], [align_up(c, expert_alignment) for c in host[2 * r:-2]]

    def _stamp_message(self, stamp: tuple, device: torch.device, *, n: int | None = None,
                       local_experts: int = 0):
        """d = stamp_digest(stamp) as a dispatch sends it, and the column sums every rank sees
        when all stamps are this one: (the count exchange's int64 [R, 1 + local_experts + 2],
        (d, d * d) in the last two columns, the counts written per dispatch; [R * d, R * d * d]),
        or with n, (int64 [4] = (n, d, busiest_expert's count and expert), None) for the
        low-latency N check, the last two written per dispatch. Kept per value, device and size
        (a layer's calls repeat a few stamps; writing the counts in place costs less than a
        concatenation), filled on the device (no host copy, no sync). A dispatch reads the
        message to the host before it returns, so the next one may write it again. Made
        outside torch.inference_mode, as the low-latency workspaces are (a dispatch outside it
        cannot write a tensor made inside it)."""
        key = (stamp, device, n, local_experts)
        message = self._stamp_messages.get(key)
        if message is None:
            if len(self._stamp_messages) >= 256:  # a bound: stamps of old plans are not kept
                self._stamp_messages.clear()
            d, r = stamp_digest(stamp), self.group_size
            with torch.inference_mode(False):
                if n is None:
                    tensor = torch.full((r, 1 + local_experts + 2), d, dtype=torch.int64,
                                        device=device)
                    tensor[:, -1] = d * d
                    message = tensor, [r * d, r * d * d]
                else:
                    tensor = torch.full((4,), d, dtype=torch.int64, device=device)
                    tensor[0] = n
                    message = tensor, None
            self._stamp_messages[key] = message
        return message

    def _check_same_pass(self, stamp: tuple, device: torch.device) -> None:
        """ValueError on every rank naming what differs (check_same_pass): called by every rank
        of the group when the stamps' digests differ, so this gather meets its peers'."""
        got = self._all_gather(torch.tensor(stamp, dtype=torch.int64, device=device))
        check_same_pass(got.tolist())

    def _send_order(self, is_token_in_rank: torch.Tensor, send_splits: list[int]) -> torch.Tensor:
        """Token index of each row to send: grouped by destination rank, token order within one.

        A stable sort puts the True entries of the [R, T] mask first in (rank, token) order; the
        host already knows how many there are, so no device value is read."""
        t = is_token_in_rank.shape[0]
        mask = is_token_in_rank.t().reshape(-1)
        if checks.checks_values(is_token_in_rank):
            per_rank = is_token_in_rank.sum(0).tolist()
            if per_rank != send_splits:
                raise ValueError(f"num_tokens_per_rank {send_splits} does not match "
                                 f"is_token_in_rank (per-rank sums {per_rank})")
        if t == 0:
            return torch.zeros(0, dtype=torch.int64, device=mask.device)
        order = torch.sort((~mask).to(torch.uint8), stable=True).indices[:sum(send_splits)]
        return order % t

    def _localise(self, recv_idx: torch.Tensor, recv_w: torch.Tensor,
                  local_num_experts: int) -> None:
        """Received global ids -> local ids of experts here, -1 (weight 0) elsewhere, in place."""
        recv_idx.sub_(self.rank * local_num_experts)
        elsewhere = (recv_idx < 0) | (recv_idx >= local_num_experts)  # -1 went below 0 too
        recv_idx.masked_fill_(elsewhere, -1)
        recv_w.masked_fill_(elsewhere, 0.0)

    def _send_rows(self, handle: _HTHandle, fields: list[torch.Tensor]
                   ) -> tuple[list[torch.Tensor], Callable[[], None]]:
        """Start sending the handle's rows of each [T, ...] field in one exchange: ([T', ...]
        each, finish)."""
        return self._start_exchange_packed(fields, handle.send_splits, handle.recv_splits,
                                           rows=handle.send_rows)

    # ----------------------------------------------------------------- low-latency mode
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Send one copy of each token per selected expert into a per-expert (masked) layout.

        No host sync: fixed-size messages, positions computed on the device (CUDA-graph
        capturable).

        Arguments:
            x: bf16 [T, H] contiguous, T <= num_max_dispatch_tokens_per_rank; H one of DeepEP's LL
                hidden sizes.
            topk_idx: int64 [T, k] contiguous global expert ids, -1 = none; k <= 11. An id
                repeated within a token's top-k is sent once per slot (as DeepEP does); no
                expert may get more than N (token, slot) pairs from one rank (DeepEP's receive
                capacity): checked where values are (every rank raises ValueError).
            num_max_dispatch_tokens_per_rank: N, identical on every rank.
            num_experts: E, a multiple of the rank count R.
            cumulative_local_expert_recv_stats: optional int32 [E_l] contiguous; recv_count is
                added to it.
            dispatch_wait_recv_cost_stats: optional int64 [R] contiguous, left untouched (no
                timing).
            use_fp8: quantise per 1x128 group as DeepEP does (scale_inv = amax / 448, amax floored
                at 1e-4; ``round_scale`` rounds scale_inv up to a power of two). ``use_ue8m0`` is
                refused.
            async_finish, return_recv_hook: mutually exclusive; either returns once the slab is on
                its way, and the results are valid after the event's ``current_stream_wait()`` or
                the hook's call (under CUDA graph capture: at once, the hook a no-op).

        Returns:
            recv_x: fp8: (float8_e4m3fn [E_l, R*N, H], float32 scales [E_l, R*N, H/128] with
                strides (R*N*H/128, 1, R*N), i.e. column-major in the last two dims); else bf16
                [E_l, R*N, H]. Rows of expert e past recv_count[e] are uninitialised.
            recv_count: int32 [E_l] valid rows per local expert (grouped by source rank,
                token order).
            handle: pass to ``low_latency_combine``.
            event: a Completion with ``async_finish``, else None.
            hook: a Completion with ``return_recv_hook``, else None.

        recv_x, recv_count and the handle live in the buffer, as DeepEP's low-latency results do:
        the buffer holds two sets per size (N, k, H, E_l, use_fp8, device) and dispatches take
        them in turn, so they stay valid until the dispatch after next of the same size (hold at
        most two results at a time; clone what must live longer).
        """
        n = num_max_dispatch_tokens_per_rank
        local_num_experts = self._check_ll_dispatch(
            x, topk_idx, n, num_experts, cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats, use_ue8m0, async_finish, return_recv_hook)
        ws = self._ll_workspace(n, topk_idx.shape[1], x.shape[1], local_num_experts, use_fp8,
                                x.device)
        ll.pack(x, topk_idx, *ws.send_fields, round_scale)
        gathered = _completed
        if self.group_size > 1:  # [R*N, row] bytes: every rank's slab
            gathered = self._start(_all_gather, ws.gathered, ws.slab, group=self.group)

        def finish() -> None:
            gathered()
            ids, scales, data = ws.recv_fields
            route = ll.route(ids, self.rank, local_num_experts,
                             (ws.served, ws.local, ws.pos, ws.recv_row, ws.recv_count))
            ll.scatter_rows(data, ws.recv_bytes, *route[:3], scales, ws.recv_scales)
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(ws.recv_count)

        recv_x = ws.recv if not use_fp8 else (ws.recv, ws.recv_scales)
        handle = _LLHandle(ws.recv_row, ws.served, x.shape[0], n, x.shape[1], num_experts, ws)
        return (recv_x, ws.recv_count, handle,
                *self._ll_completion(finish, x, async_finish, return_recv_hook))

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: _LLHandle,
                            use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None, combine_wait_recv_cost_stats=None):
        """Send expert outputs back and reduce them with the top-k weights on the source rank.

        No host sync (CUDA-graph capturable).

        Arguments:
            x: bf16 [E_l, R*N, H] contiguous, expert outputs in ``low_latency_dispatch``'s
                layout (only the valid rows are read).
            topk_idx: int64 [T, k] contiguous, as dispatched (its values are not read again: the
                handle holds the routing); topk_weights: float32 [T, k] contiguous, T <= N.
            handle: from ``low_latency_dispatch``.
            out: optional bf16 [T, H] contiguous, written and returned.
            use_logfmt, zero_copy: accepted, ignored (combine is exact).
            combine_wait_recv_cost_stats: optional int64 [R] contiguous, left untouched.
            async_finish, return_recv_hook: mutually exclusive; as in ``low_latency_dispatch``
                (out is written when the event or hook completes the call).

        Returns:
            combined_x: bf16 [T, H] = sum over slots j with topk_idx[t, j] >= 0 of
                topk_weights[t, j] * expert output (float32, added in slot order, rounded
                once); event; hook (a Completion where asked for, else None).
        """
        self._check_ll_combine(x, topk_idx, topk_weights, handle, out, combine_wait_recv_cost_stats,
                               async_finish, return_recv_hook)
        n, t, h, ws = (handle.num_max_dispatch_tokens_per_rank, handle.num_tokens, handle.hidden,
                       handle.workspace)
        if out is None:
            out = torch.empty(t, h, dtype=torch.bfloat16, device=x.device)
        if self.group_size == 1:  # its own T rows, summed straight into out
            ll.partial_sums(x.view(-1, h), handle.recv_row[:t], handle.served[:t], topk_weights,
                            out)
            return out, *self._ll_completion(_completed, x, async_finish, return_recv_hook)
        # As DeepEP, each served slot's expert output goes back unweighted (bf16 [R*N, k, H],
        # block s to rank s) and the source weighs and adds its k rows in slot order: a token's
        # sum does not depend on which rank served which slot.
        ll.partial_sums(x.view(-1, h), handle.recv_row.view(-1, 1), handle.served.view(-1, 1),
                        ws.unit_weights.fill_(1.0), ws.slot_rows.view(-1, h))
        sent = self._start(dist.all_to_all_single, ws.back, ws.slot_rows, group=self.group)
        ids = ws.send_fields[0][:t]
        rows, valid = ll.slot_source_rows(ids, n, handle.num_experts // self.group_size), ids >= 0
        # an asynchronous call's caller may reuse its weights before the receiver reads them
        weights = topk_weights.clone() if async_finish or return_recv_hook else topk_weights

        def finish() -> None:
            sent()
            ll.partial_sums(ws.back.view(-1, h), rows, valid, weights, out)

        return out, *self._ll_completion(finish, x, async_finish, return_recv_hook)

    @staticmethod
    def _ll_completion(finish: Callable[[], None], x: torch.Tensor, async_finish: bool,
                       return_recv_hook: bool) -> tuple:
        """(event, hook) of a low-latency call: finish pending in a Completion where the caller
        asked for one, outside CUDA graph capture; otherwise run at once (the hook a no-op)."""
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        done = completion(finish, (async_finish or return_recv_hook) and not capturing)
        hook = (done or _completed) if return_recv_hook else None
        return (done if async_finish else None), hook

    # Low-latency steps.
    def _ll_workspace(self, n: int, k: int, h: int, local_num_experts: int, use_fp8: bool,
                      device: torch.device) -> ll.LLWorkspace:
        """The workspace of this dispatch: two per size, taken in turn (as DeepEP's two
        low-latency buffers), so a dispatch's results live until the dispatch after next. Made
        outside torch.inference_mode even when the first dispatch runs inside it (a tensor made
        there cannot be written by a later dispatch outside it)."""
        key = (n, k, h, local_num_experts, use_fp8, device)
        pair = self._ll_workspaces.get(key)
        if pair is None:
            with torch.inference_mode(False):
                pair = self._ll_workspaces[key] = [
                    ll.LLWorkspace(n, self.group_size, k, h, local_num_experts, use_fp8, device)
                    for _ in range(2)]
        pair.reverse()
        return pair[0]

    # ------------------------------------------------------- checks that need the buffer's state
    def _check_ll_dispatch(self, x, topk_idx, n, num_experts, recv_stats, wait_stats, use_ue8m0,
                           async_finish, return_recv_hook) -> int:
        """Check low_latency_dispatch's arguments (and, where values are checked, that N agrees
        across ranks: a collective); return E_l."""
        if not self.low_latency_mode:
            raise ValueError("low_latency_dispatch needs a buffer built with low_latency_mode=True")
        local_num_experts, check_values = checks.check_ll_dispatch(
            x, topk_idx, n, num_experts, self.group_size, use_ue8m0, async_finish,
            return_recv_hook)
        if (n, x.shape[1], num_experts) not in self._ll_sizes_ok:  # host arithmetic, once
            checks.check_ll_buffer_size(n, x.shape[1], self.group_size, num_experts,
                                        self.num_rdma_bytes, self.ll_sizes)
            self._ll_sizes_ok.add((n, x.shape[1], num_experts))
        checks.check_recv_stats(recv_stats, local_num_experts)
        checks.check_wait_stats("dispatch_wait_recv_cost_stats", wait_stats, self.group_size)
        stamp, self.pass_stamp = self.pass_stamp, NO_STAMP  # one dispatch's
        if check_values:
            self._check_same_n(n, stamp, ll.busiest_expert(topk_idx, num_experts))
        return local_num_experts

    def _check_same_n(self, n: int, stamp: tuple, busiest: torch.Tensor) -> None:
        """Every rank must pass the same N (the message size), be at the same pass of a layer
        call (stamp: this dispatch's PassStamp) and send at most N rows to each expert (busiest:
        ``ll.busiest_expert`` of its ids): gathered and compared, so every rank raises alike."""
        message = self._stamp_message(stamp, busiest.device, n=n)[0]
        message[2:].copy_(busiest)
        got = self._all_gather(message).tolist()
        if len({row[0] for row in got}) > 1:
            raise ValueError(f"num_max_dispatch_tokens_per_rank differs across ranks: "
                             f"{[row[0] for row in got]}")
        ll.check_expert_capacity([row[2:] for row in got], n)
        if len({row[1] for row in got}) > 1:
            self._check_same_pass(stamp, busiest.device)

    def _check_ll_combine(self, x, topk_idx, topk_weights, handle, out, wait_stats, async_finish,
                          return_recv_hook) -> None:
        if not isinstance(handle, _LLHandle):
            raise ValueError("low_latency_combine needs the handle returned by "
                             "low_latency_dispatch")
        checks.check_hook_flags(async_finish, return_recv_hook)
        n, r = handle.num_max_dispatch_tokens_per_rank, self.group_size
        checks.check_ll_combine(
            x, topk_idx, topk_weights, out, x_shape=(handle.num_experts // r, r * n, handle.hidden),
            n=n, num_tokens=handle.num_tokens, topk=handle.served.shape[1])
        checks.check_wait_stats("combine_wait_recv_cost_stats", wait_stats, r)
