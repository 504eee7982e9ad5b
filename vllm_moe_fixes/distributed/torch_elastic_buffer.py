"""DeepEP V2's ``ElasticBuffer`` API, the expert-parallel subset, on torch.distributed.

``TorchElasticBuffer`` lets CPU CI (gloo) and NCCL GPUs run the V2 prepare/finalize without
DeepEP. It speaks V2's ``dispatch`` / ``combine`` signatures, shapes, dtypes, -1 convention and
handle (``TorchEPHandle``, the attributes of V2's ``EPHandle`` that callers read), read from
DeepEP main at dd758caf (``deep_ep/buffers/elastic.py``, ``csrc/elastic/buffer.hpp``,
``deep_ep/utils/refs.py``, ``tests/elastic/test_ep.py``):

    dispatch(x, topk_idx=, topk_weights=, num_experts=, num_max_tokens_per_rank=, ...)
        -> (recv_x, recv_topk_idx, recv_topk_weights, handle, event)
        each token once per destination rank (not once per expert); recv_topk_idx int64
        [T', k]: LOCAL expert id (global id - rank * E_l) where the expert lives here, else -1;
        recv_topk_weights float32 [T', k], undefined where the id is -1 (DeepEP's reference sends
        the whole row); the receive order is DeepEP's own (its test sorts by source token).
        do_cpu_sync=True (the default without a handle): exactly T' rows. do_cpu_sync=False:
        R*N rows, of which the first handle.psum_num_recv_tokens_per_scaleup_rank[-1] are valid.
    combine(x [T', H] bf16, handle, topk_weights=None, bias=None)
        -> (combined_x [T, H] bf16, combined_topk_weights [T, k] or None, event)
        an UNWEIGHTED sum of a token's rows over the ranks (+ bias): the caller applies the
        weights and reduces each rank's slots first; topk_weights come back from the rank that
        owns each slot's expert.

The exchange itself is ``TorchAll2AllBuffer``'s high-throughput one (one count all-to-all read
on the host, one packed row all-to-all; its combine), so this module only adapts the API. It
checks what V2 asserts (ValueError naming the argument and rule), including that the buffer's
``num_bytes`` holds the call's layouts (``deepep_v2_sizing``), as V2's dispatch and combine do.

Differences from DeepEP, by design:
  * ``async_with_compute_stream=True`` returns once the rows are on their way, with a
    ``torch_buffer.Completion`` as the event: the results (padding, layouts and counts included)
    are valid after ``event.current_stream_wait()``. Otherwise ``event`` is None. Stream and SM
    arguments are accepted and ignored.
  * The receive counts are always read on the host (the exchange needs them), also with
    do_cpu_sync=False, which only changes the shapes: this buffer is not CUDA-graph capturable.
    Rows past the valid prefix hold poison (NaN data and weights, ids 2**40), as uninitialised
    memory would.
  * ``do_expand`` (V2's expert-contiguous "expanded" layout) is refused; V2's other
    constructor options (deterministic sorting, CPU bytes, QPs, timeouts) and its Engram, PP and
    AGRS calls are not offered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vllm_moe_fixes._validate import check, check_experts_per_rank, check_positive_int
from vllm_moe_fixes.distributed import deepep_v2_sizing as v2
from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer, completion
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, empty_mn_major_scales

# Id written into the rows past the valid prefix of a no-sync dispatch: far out of any range.
_POISON_ID = 2**40


@dataclass
class TorchEPHandle:
    """What a dispatch leaves for ``combine`` and for a cached dispatch (V2's ``EPHandle``).

    The public fields are V2's: do_expand (always False), num_experts, expert_alignment,
    num_max_tokens_per_rank, topk_idx (int64 [T, k], a copy with do_handle_copy),
    num_recv_tokens (rows of recv_x), num_recv_tokens_per_expert_list (aligned counts per local
    expert; empty without CPU sync), psum_num_recv_tokens_per_scaleup_rank (int32 [scale-up ranks]
    inclusive prefix sum of the tokens received from each scale-up peer; the last entry is
    the received total), psum_num_recv_tokens_per_expert (int32 [E_l]
    inclusive prefix sum of the aligned counts).
    """

    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    topk_idx: torch.Tensor
    num_recv_tokens: int
    num_recv_tokens_per_expert_list: list[int]
    psum_num_recv_tokens_per_scaleup_rank: torch.Tensor
    psum_num_recv_tokens_per_expert: torch.Tensor
    recv_topk_idx: torch.Tensor  # int64 [num_recv_tokens, k], as dispatched
    exchange: object             # TorchAll2AllBuffer's handle
    num_valid: int               # received rows (the valid prefix)


class TorchElasticBuffer:
    """The V2-API all-to-all buffer on torch.distributed (gloo for CPU, NCCL for CUDA tensors).

    Arguments (V2's constructor, the subset that sizes the buffer):
        group: the expert-parallel process group (None: the default group).
        num_bytes: buffer bytes; None: V2's hint for the MoE settings below.
        num_max_tokens_per_rank: default N of ``dispatch`` (and of the hint).
        hidden, num_topk, use_fp8_dispatch: the hint's settings (num_topk 0 sizes for 32).
        allow_hybrid_mode, allow_multiple_reduction: V2's flags (enter the layouts only).
        explicitly_destroy: ``destroy()`` must then be called (it only marks the buffer dead).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, num_bytes: int | None = None, *,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, explicitly_destroy: bool = False) -> None:
        if not dist.is_initialized():
            raise ValueError("TorchElasticBuffer needs torch.distributed to be initialised")
        self.group = group
        self.rank_idx = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.explicitly_destroy = explicitly_destroy
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        if num_bytes is None:
            num_bytes = self.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden,
                                                  num_topk, use_fp8_dispatch, allow_hybrid_mode,
                                                  allow_multiple_reduction)
        check_positive_int("num_bytes", num_bytes)
        if num_bytes % v2.ELASTIC_ALIGNMENT:
            raise ValueError(f"num_bytes={num_bytes} must be a multiple of 2 MiB "
                             f"({v2.ELASTIC_ALIGNMENT}), as DeepEP V2 requires")
        self.num_bytes = num_bytes
        self.num_scaleout_ranks, self.num_scaleup_ranks, self._nvlink = v2.domains(
            self.num_ranks, None, allow_hybrid_mode)
        self._exchange = TorchAll2AllBuffer(group)
        self._alive = True

    @property
    def pass_stamp(self):
        """The next dispatch's PassStamp, compared across the ranks in its count exchange
        (TorchAll2AllBuffer's, which this buffer's dispatch runs)."""
        return self._exchange.pass_stamp

    @pass_stamp.setter
    def pass_stamp(self, stamp) -> None:
        self._exchange.pass_stamp = stamp

    # ----------------------------------------------------------------- V2's static helpers
    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup | None, num_max_tokens_per_rank: int,
                             hidden: int, num_topk: int = 0, use_fp8_dispatch: bool = False,
                             allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """V2's hint in bytes for ``group``'s size (``deepep_v2_sizing.elastic_buffer_size_hint``,
        NVLink domains of up to 8 ranks)."""
        return v2.elastic_buffer_size_hint(
            num_max_tokens_per_rank, hidden, num_ranks=dist.get_world_size(group),
            num_topk=num_topk, use_fp8_dispatch=use_fp8_dispatch,
            allow_hybrid_mode=allow_hybrid_mode, allow_multiple_reduction=allow_multiple_reduction)

    def get_logical_domain_size(self) -> tuple[int, int]:
        """(scale-out ranks, scale-up ranks)."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def destroy(self) -> None:
        """Release the buffer (needs ``explicitly_destroy=True``, as in V2)."""
        check(self.explicitly_destroy, "destroy() needs a buffer built with "
              "explicitly_destroy=True")
        self._alive = False

    # ----------------------------------------------------------------- dispatch / combine
    def dispatch(self, x, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None,
                 cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                 num_experts: int | None = None, num_max_tokens_per_rank: int | None = None,
                 expert_alignment: int | None = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event=None, previous_event_before_epilogue=None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: TorchEPHandle | None = None, do_handle_copy: bool = True,
                 do_cpu_sync: bool | None = None, do_expand: bool = False,
                 do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        """Send each token once to every rank holding one of its experts.

        Arguments:
            x: bf16 [T, H] contiguous, or (float8_e4m3fn [T, H] contiguous, float32 scales
                [T, S]); rows of a multiple of 16 bytes; T <= N.
            topk_idx: int64 [T, k] contiguous global ids (-1: none), k <= 32; None with a handle.
            topk_weights: float32 [T, k] contiguous, or None (then recv_topk_weights is None).
            cumulative_local_expert_recv_stats: optional int32 [E_l]; the received selections
                per local expert are added to it.
            num_experts: E (a multiple of R; from the handle when one is given).
            num_max_tokens_per_rank: N, the same on every rank (default: the constructor's).
            expert_alignment: each per-expert count in the handle is rounded up to it (default 1).
            handle: a handle of an earlier dispatch with the same routing (cached dispatch).
            do_handle_copy: the handle keeps a copy of topk_idx (else topk_idx itself).
            do_cpu_sync: exact receive size (default True without a handle, must not be True
                with one); False: R*N rows, valid prefix handle.psum_...scaleup_rank[-1].
            do_expand, do_zero_padding: must be False (the expanded layout is not served).
            use_tma_aligned_col_major_sf: received scales [T', S] with strides (1, align(T', 4))
                instead of row-major.
            async_with_compute_stream: return once the rows are on their way (the count
                exchange has completed); the results are valid after
                ``event.current_stream_wait()``.
            num_sms, num_qps, previous_event*, allocate_on_comm_stream: accepted, ignored.

        Returns:
            recv_x: like x, [T', H] (and scales [T', S]); recv_topk_idx: int64 [T', k] local ids,
            -1 elsewhere; recv_topk_weights: float32 [T', k] or None; handle: TorchEPHandle;
            event: a Completion with async_with_compute_stream, else None.
        """
        check(self._alive, "dispatch on a destroyed buffer")
        check(not do_expand and not do_zero_padding, "do_expand / do_zero_padding: the expanded "
              "layout is not supported by TorchElasticBuffer (use do_expand=False)")
        x_data, x_scales = x if isinstance(x, tuple) else (x, None)
        if handle is not None:
            return self._cached_dispatch(x, x_data, topk_idx, topk_weights, num_experts,
                                         num_max_tokens_per_rank, expert_alignment, handle,
                                         do_cpu_sync, use_tma_aligned_col_major_sf,
                                         async_with_compute_stream)
        n, local_num_experts, alignment = self._check_dispatch(
            x_data, x_scales, topk_idx, topk_weights, cumulative_local_expert_recv_stats,
            num_experts, num_max_tokens_per_rank, expert_alignment)
        sync = True if do_cpu_sync is None else do_cpu_sync
        ex = self._exchange
        per_rank, per_rdma, per_expert, in_rank, _ = ex.get_dispatch_layout(topk_idx, num_experts)
        weights = topk_weights if topk_weights is not None else torch.zeros(
            topk_idx.shape, dtype=torch.float32, device=topk_idx.device)
        recv_x, recv_idx, recv_w, counts, ex_handle, received = ex.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
            topk_weights=weights, expert_alignment=alignment, async_finish=True)
        valid = recv_idx.shape[0]
        rows = valid if sync else self.num_ranks * n
        then = [received]  # run in order once the rows are here
        if cumulative_local_expert_recv_stats is not None:
            stats = cumulative_local_expert_recv_stats
            then.append(lambda: stats.add_(self._local_counts(recv_idx, local_num_experts)))
        padded_idx = self._pad(recv_idx, rows, _POISON_ID, then)
        recv_x = self._received(recv_x, rows, use_tma_aligned_col_major_sf, then)
        recv_w = self._pad(recv_w, rows, float("nan"), then) if topk_weights is not None else None
        handle = TorchEPHandle(
            do_expand=False, num_experts=num_experts, expert_alignment=alignment,
            num_max_tokens_per_rank=n,
            topk_idx=topk_idx.clone() if do_handle_copy else topk_idx,
            num_recv_tokens=rows, num_recv_tokens_per_expert_list=counts if sync else [],
            psum_num_recv_tokens_per_scaleup_rank=self._psum(
                ex_handle.recv_splits, self.num_scaleup_ranks, topk_idx.device),
            psum_num_recv_tokens_per_expert=self._psum(counts, len(counts), topk_idx.device),
            recv_topk_idx=padded_idx, exchange=ex_handle, num_valid=valid)
        event = completion(_in_order(then), async_with_compute_stream)
        return recv_x, padded_idx, recv_w, handle, event

    def combine(self, x: torch.Tensor, handle: TorchEPHandle,
                topk_weights: torch.Tensor | None = None, bias=None, num_sms: int = 0,
                num_qps: int = 0, previous_event=None, previous_event_before_epilogue=None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        """Sum each token's rows back on its source rank (unweighted), plus bias.

        Arguments:
            x: bf16 [handle.num_recv_tokens, H] contiguous, one row per received token in the
                dispatch's receive order (rows past the valid prefix are not read).
            handle: the handle ``dispatch`` returned.
            topk_weights: optional float32 [handle.num_recv_tokens, k] contiguous: each slot's
                weight comes back from the rank owning its expert (0 where the id is -1).
            bias: optional bf16 [T, H] contiguous, or a tuple of two, added to the result.
            async_with_compute_stream: return once the rows are on their way; the results are
                valid after ``event.current_stream_wait()``.
            num_sms, num_qps, previous_event*, allocate_on_comm_stream: accepted, ignored.

        Returns:
            combined_x: bf16 [T, H] (float32 sums, rounded once; tokens sent nowhere get bias
            or 0); combined_topk_weights: float32 [T, k] or None; event: a Completion with
            async_with_compute_stream, else None.
        """
        check(self._alive, "combine on a destroyed buffer")
        check(isinstance(handle, TorchEPHandle),
              "combine needs the handle this buffer's dispatch returned")
        rows, v = handle.num_recv_tokens, handle.num_valid
        check(isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] == rows,
              f"x must be [{rows}, H] (the dispatch's received rows); got "
              f"{getattr(x, 'shape', type(x).__name__)}")
        k = handle.topk_idx.shape[1]
        if topk_weights is not None:
            check(isinstance(topk_weights, torch.Tensor) and topk_weights.shape == (rows, k),
                  f"topk_weights must be [{rows}, {k}]; got "
                  f"{getattr(topk_weights, 'shape', type(topk_weights).__name__)}")
            # masked_fill keeps the rows' strides (torch.where of zero rows may give stride 0)
            topk_weights = topk_weights[:v].masked_fill(handle.recv_topk_idx[:v] < 0, 0.0)
        self._check_bytes("combine", v2.combine_buffer_bytes(
            handle.num_max_tokens_per_rank, x.shape[1], num_topk=k,
            allow_multiple_reduction=self.allow_multiple_reduction, **self._topology()))
        combined, combined_w, received = self._exchange.combine(
            x[:v], handle.exchange, topk_weights=topk_weights, bias=bias,
            async_finish=async_with_compute_stream)
        return combined, combined_w, received

    # ----------------------------------------------------------------- steps
    def _cached_dispatch(self, x, x_data, topk_idx, topk_weights, num_experts, n, alignment,
                         handle, do_cpu_sync, col_major_sf, asynchronous):
        """A dispatch reusing ``handle``'s layout: (recv_x, recv_topk_idx, None, handle, None)."""
        check(isinstance(handle, TorchEPHandle), "handle must be one this buffer's dispatch "
              "returned")
        check(topk_idx is None, "a dispatch with a cached handle takes topk_idx=None (the "
              "handle's is reused)")
        check(topk_weights is None, "a cached dispatch takes no topk_weights in "
              "TorchElasticBuffer")
        check(not do_cpu_sync, "do_cpu_sync=True cannot go with a cached handle")
        given = (num_experts, alignment, n)
        kept = (handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank)
        check(all(g is None or g == h for g, h in zip(given, kept)),
              f"(num_experts, expert_alignment, num_max_tokens_per_rank) = {given} must match "
              f"the handle's {kept}")
        recv_x, _, _, _, _, received = self._exchange.dispatch(x, handle=handle.exchange,
                                                               async_finish=True)
        then = [received]
        recv_x = self._received(recv_x, handle.num_recv_tokens, col_major_sf, then)
        return recv_x, handle.recv_topk_idx, None, handle, completion(_in_order(then), asynchronous)

    def _received(self, recv_x, rows: int, col_major_sf: bool, then: list):
        """recv_x padded to ``rows`` rows (poison past the valid ones), scales laid out; the
        copies of what arrives are appended to ``then``."""
        if not isinstance(recv_x, tuple):
            return self._pad(recv_x, rows, float("nan"), then)
        data, scales = self._pad(recv_x[0], rows, float("nan"), then), self._pad(
            recv_x[1], rows, float("nan"), then)
        if col_major_sf:
            received, scales = scales, empty_mn_major_scales(scales.shape, scales.device)
            then.append(lambda: scales.copy_(received))
        return data, scales

    @staticmethod
    def _pad(t: torch.Tensor, rows: int, fill, then: list) -> torch.Tensor:
        """t [r, ...] extended to [rows, ...] with ``fill`` (t itself when r == rows); the copy
        of t's rows, to run once they hold what arrives, is appended to ``then``."""
        if t.shape[0] == rows:
            return t
        out = torch.empty(rows, *t.shape[1:], dtype=t.dtype, device=t.device)
        then.append(lambda: out[:t.shape[0]].copy_(t))
        if t.dtype == FP8_DTYPE:
            out[t.shape[0]:].view(torch.uint8).fill_(0x7F)  # NaN
        else:
            out[t.shape[0]:] = fill
        return out

    @staticmethod
    def _psum(counts: list[int], bins: int, device: torch.device) -> torch.Tensor:
        """int32 [bins]: inclusive prefix sum of ``counts`` folded onto ``bins`` (entry i sums
        counts i, i + bins, ...: a rank's scale-up peer index)."""
        folded = torch.tensor(counts, dtype=torch.int32).view(-1, bins).sum(0, dtype=torch.int32)
        return folded.cumsum(0, dtype=torch.int32).to(device)

    @staticmethod
    def _local_counts(recv_idx: torch.Tensor, local_num_experts: int) -> torch.Tensor:
        """int32 [E_l]: received selections per local expert (-1 slots dropped)."""
        ids = torch.where(recv_idx >= 0, recv_idx, local_num_experts).reshape(-1)
        counts = torch.bincount(ids, minlength=local_num_experts + 1)[:local_num_experts]
        return counts.to(torch.int32)

    def _topology(self) -> dict:
        return dict(scaleout=self.num_scaleout_ranks, scaleup=self.num_scaleup_ranks,
                    nvlink=self._nvlink)

    def _check_bytes(self, what: str, need: int) -> None:
        """V2 asserts its layout for the call fits ``num_bytes``."""
        if need > self.num_bytes:
            raise ValueError(f"ElasticBuffer too small: this {what} needs {need} bytes, the "
                             f"buffer has num_bytes={self.num_bytes} (size it with "
                             "get_buffer_size_hint for the largest N, hidden and top-k)")

    def _check_dispatch(self, x, scales, topk_idx, topk_weights, stats, num_experts, n,
                        alignment) -> tuple[int, int, int]:
        """Check a dispatch without a handle; return (N, E_l, expert_alignment)."""
        check(isinstance(x, torch.Tensor) and x.dim() == 2 and x.is_contiguous(),
              f"x must be a contiguous [T, H] tensor; got {getattr(x, 'shape', type(x))}")
        check(isinstance(topk_idx, torch.Tensor) and topk_idx.dtype == torch.int64
              and topk_idx.dim() == 2 and topk_idx.shape[0] == x.shape[0]
              and topk_idx.is_contiguous(),
              f"topk_idx must be int64 [{x.shape[0]}, k] contiguous (needed without a handle); "
              f"got {getattr(topk_idx, 'dtype', None)} {getattr(topk_idx, 'shape', None)}")
        k = topk_idx.shape[1]
        check(1 <= k <= v2.MAX_TOPK, f"top-k {k} must lie in [1, {v2.MAX_TOPK}] (DeepEP V2)")
        if topk_weights is not None:
            check(isinstance(topk_weights, torch.Tensor) and topk_weights.dtype == torch.float32
                  and topk_weights.shape == topk_idx.shape and topk_weights.is_contiguous(),
                  f"topk_weights must be float32 {list(topk_idx.shape)} contiguous; got "
                  f"{getattr(topk_weights, 'dtype', None)} {getattr(topk_weights, 'shape', None)}")
        check(num_experts is not None, "num_experts is needed without a handle")
        local_num_experts = check_experts_per_rank(num_experts, self.num_ranks)
        check(num_experts <= v2.MAX_EXPERTS and local_num_experts <= v2.MAX_EXPERTS_PER_RANK,
              f"num_experts={num_experts} ({local_num_experts} per rank): DeepEP V2 takes at most "
              f"{v2.MAX_EXPERTS} experts and {v2.MAX_EXPERTS_PER_RANK} per rank")
        n = self.num_max_tokens_per_rank if n is None else n
        check_positive_int("num_max_tokens_per_rank", n)
        check(x.shape[0] <= n, f"{x.shape[0]} tokens exceed num_max_tokens_per_rank={n}")
        alignment = 1 if alignment is None else alignment
        check_positive_int("expert_alignment", alignment)
        if stats is not None:
            check(isinstance(stats, torch.Tensor) and stats.dtype == torch.int32
                  and stats.shape == (local_num_experts,),
                  f"cumulative_local_expert_recv_stats must be int32 [{local_num_experts}]; got "
                  f"{getattr(stats, 'shape', type(stats))}")
        elem, packs = x.element_size(), 0 if scales is None else scales.shape[1]
        self._check_bytes("dispatch", v2.dispatch_buffer_bytes(
            n, x.shape[1], elem_bytes=elem, num_sf_packs=packs, num_topk=k,
            **self._topology()))
        return n, local_num_experts, alignment


def _in_order(steps: list[Callable[[], object]]) -> Callable[[], None]:
    """One call running ``steps`` in order."""
    def run() -> None:
        for step in steps:
            step()
    return run
