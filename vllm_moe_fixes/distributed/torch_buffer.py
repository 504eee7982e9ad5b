"""DeepEP's ``Buffer`` API, the subset our expert-parallel paths call, on torch.distributed.

``TorchAll2AllBuffer`` is the ``naive`` all-to-all backend and the vehicle that lets CPU CI run the
expert-parallel code for real (gloo) as well as NCCL on GPUs. It speaks DeepEP v1.2.1's shapes,
dtypes, -1 conventions, return tuples and handle semantics (contracts/deep_ep.md); every exchange is
a ``torch.distributed.all_to_all_single`` of a byte view (gloo has no float8), preceded by one
exchange of the counts. The per-row tensors of one call (x, its scales, top-k ids and weights) are
packed into one byte row and moved in a single exchange; each dispatch path reads its counts to the
host once. Where DeepEP would assert, this raises ``ValueError``.

Differences from DeepEP, by design:
  * Everything is synchronous: ``async_finish`` and ``previous_event`` are accepted and ignored, the
    returned events are ``None``, and a requested receive hook is a no-op callable.
  * Handles are private named tuples: pass them back, do not look inside.
  * ``num_worst_tokens`` and UE8M0 scales are not supported (``ValueError``); ``use_logfmt`` and
    ``zero_copy`` are accepted, combine is exact bf16/float32 either way.
  * Rows of the low-latency receive buffer past ``recv_count`` are left uninitialised, as in DeepEP.
"""

from __future__ import annotations

import math
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from vllm_moe_fixes._validate import check_experts_per_rank, check_positive_int
from vllm_moe_fixes.distributed import deepep_sizing as sizing
from vllm_moe_fixes.ops.fp8 import FP8_MAX

# DeepEP's low-latency cast floors amax at this margin, so an all-zero group gets a finite scale.
LL_AMAX_FLOOR = 1e-4


class _HTHandle(NamedTuple):
    is_token_in_rank: torch.Tensor  # [T, R] bool, as dispatched
    send_rows: torch.Tensor         # [S] int64: token index of each sent row, grouped by destination
    send_splits: list[int]          # rows sent to each rank
    recv_splits: list[int]          # rows received from each rank


class _LLHandle(NamedTuple):
    src_token: torch.Tensor         # [P] int64: token of each sent (token, expert) pair, by destination
    src_slot: torch.Tensor          # [P] int64: its top-k slot
    send_splits: list[int]
    recv_splits: list[int]
    recv_expert: torch.Tensor       # [Q] int64: local expert of each received row
    recv_pos: torch.Tensor          # [Q] int64: its row within that expert's [R*N] slice
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int


class TorchAll2AllBuffer:
    """The all-to-all buffer of the ``naive`` backend (DeepEP ``Buffer`` API, torch.distributed).

    Arguments:
        group: the expert-parallel process group (None: the default group); gloo for CPU tensors,
            NCCL for CUDA tensors.
        low_latency_mode: enable ``low_latency_dispatch``/``low_latency_combine``.
        num_max_dispatch_tokens_per_rank, hidden, num_experts: the sizes the low-latency buffer is
            built for (required with ``low_latency_mode``). A low-latency call needing more bytes than
            DeepEP's hint for these sizes is refused, as DeepEP's ``layout.total_bytes <=
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
            for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                                ("hidden", hidden), ("num_experts", num_experts)):
                check_positive_int(name, value)  # low_latency_mode needs all three
            self.num_rdma_bytes = sizing.deepep_ll_rdma_bytes(
                num_max_dispatch_tokens_per_rank, hidden, self.group_size, num_experts)
        self.ll_sizes = (num_max_dispatch_tokens_per_rank, hidden, num_experts)
        # (weakref to the topk_idx, its version, num_experts) whose values were checked last:
        # get_dispatch_layout + dispatch on the same routing read its range to the host once.
        self._checked_topk: tuple | None = None

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
        """DeepEP's low-latency RDMA size hint in bytes (``deepep.deepep_ll_rdma_bytes``)."""
        return sizing.deepep_ll_rdma_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> sizing.Config:
        """DeepEP's tuned dispatch config (accepted by ``dispatch`` and otherwise unused here)."""
        return sizing.get_dispatch_config(num_ranks, TorchAll2AllBuffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> sizing.Config:
        """DeepEP's tuned combine config (accepted by ``combine`` and otherwise unused here)."""
        return sizing.get_combine_config(num_ranks, TorchAll2AllBuffer.num_sms)

    # ----------------------------------------------------------------- communication primitives
    def _exchange(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """all_to_all_single of the rows of ``send`` (any dtype; moved as bytes)."""
        row_bytes = math.prod(send.shape[1:]) * send.element_size()
        payload = send.contiguous().view(torch.uint8).reshape(send.shape[0], row_bytes)
        out = torch.empty(sum(recv_splits), row_bytes, dtype=torch.uint8, device=send.device)
        if row_bytes:
            dist.all_to_all_single(out, payload, recv_splits, send_splits, group=self.group)
        return out.view(send.dtype).view(out.shape[0], *send.shape[1:])

    def _exchange_packed(self, fields: list[torch.Tensor], send_splits: list[int], recv_splits: list[int],
                         rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Move the rows of several tensors [T, ...] (any dtypes, same T) in ONE all_to_all_single.

        Each row's fields are packed into one uint8 row (``rows``: the row indices to send, in send
        order; None: all rows), exchanged, and sliced back into contiguous tensors [T', ...]."""
        if len(fields) == 1:
            return [self._exchange(fields[0] if rows is None else fields[0][rows], send_splits, recv_splits)]
        t = fields[0].shape[0]
        widths = [math.prod(f.shape[1:]) * f.element_size() for f in fields]
        payload = torch.cat([f.contiguous().view(torch.uint8).reshape(t, w) for f, w in zip(fields, widths)], 1)
        got = self._exchange(payload if rows is None else payload[rows], send_splits, recv_splits)
        out, start = [], 0
        for f, w in zip(fields, widths):
            out.append(got[:, start:start + w].contiguous().view(f.dtype).view(got.shape[0], *f.shape[1:]))
            start += w
        return out

    def _exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """[R, c] int64 (row r goes to rank r) -> [R, c] int64 (row r came from rank r)."""
        out = torch.empty_like(counts)
        dist.all_to_all_single(out, counts.contiguous(), group=self.group)
        return out

    # ----------------------------------------------------------------- high-throughput (normal) mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Count what ``dispatch`` will send (local; no communication).

        Arguments:
            topk_idx: int64 [T, k], global expert ids, -1 = no selection.
            num_experts: global expert count E (a multiple of the rank count).

        Returns:
            num_tokens_per_rank: int32 [R], tokens sent to each rank (once per rank, not per expert).
            num_tokens_per_rdma_rank: int32 [R/8] per 8-rank node, or None up to 8 ranks (DeepEP's
                intranode case).
            num_tokens_per_expert: int32 [E], (token, expert) selections per expert.
            is_token_in_rank: bool [T, R].
            event: None.
        """
        e_local = self._check_topk(topk_idx, num_experts)
        r, dev = self.group_size, topk_idx.device
        valid = topk_idx >= 0
        # -1 slots land in a spare column / bin that is dropped: no boolean indexing, no host sync.
        dest = torch.where(valid, topk_idx // e_local, r)
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
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None, previous_event=None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Send each token once to every rank holding one of its experts.

        Arguments:
            x: [T, H] tensor (bf16; rows of a multiple of 16 bytes), or a tuple (float8_e4m3fn [T, H],
                float32 scales [T, S]).
            handle: a handle from an earlier dispatch with the same routing: reuse its layout (then
                topk_idx/topk_weights must be None).
            num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert:
                ``get_dispatch_layout``'s results (needed without a handle).
            topk_idx: int64 [T, k] global ids (-1 allowed); topk_weights: float32 [T, k].
            expert_alignment: each received per-expert count is rounded up to a multiple of this.
            num_worst_tokens: must be 0 (not supported).
            config, previous_event, async_finish, allocate_on_comm_stream: accepted, ignored.

        Returns:
            recv_x: like x, [T', ...]: the tokens received, grouped by source rank, token order.
            recv_topk_idx: int64 [T', k] LOCAL expert ids (id - rank * E_local) for experts here, else
                -1; recv_topk_weights: float32 [T', k], 0 where the id is -1 (None if not sent).
            num_recv_tokens_per_expert_list: list of E_local ints.
            handle: pass to ``combine`` (or to a cached ``dispatch``).
            event: None.
            With a handle: (recv_x, None, None, None, None, None).
        """
        if num_worst_tokens:
            raise ValueError(f"num_worst_tokens={num_worst_tokens}: not supported by TorchAll2AllBuffer (use 0)")
        if expert_alignment < 1:
            raise ValueError(f"expert_alignment={expert_alignment} must be >= 1")
        x_data, x_scales = x if isinstance(x, tuple) else (x, None)
        self._check_rows(x_data, x_scales)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("dispatch with a cached handle takes no topk_idx/topk_weights")
            if handle.is_token_in_rank.shape[0] != x_data.shape[0]:
                raise ValueError(f"x has {x_data.shape[0]} tokens but the handle was made for "
                                 f"{handle.is_token_in_rank.shape[0]}")
            fields = self._send_rows(handle, [x_data] + ([x_scales] if x_scales is not None else []))
            return (fields[0] if x_scales is None else tuple(fields)), None, None, None, None, None

        for name, value in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                            ("num_tokens_per_expert", num_tokens_per_expert)):
            if value is None:
                raise ValueError(f"dispatch without a handle needs {name} (from get_dispatch_layout)")
        t, r = x_data.shape[0], self.group_size
        if tuple(is_token_in_rank.shape) != (t, r) or is_token_in_rank.dtype != torch.bool:
            raise ValueError(f"is_token_in_rank must be bool [{t}, {r}]; got {is_token_in_rank.dtype} "
                             f"{list(is_token_in_rank.shape)}")
        num_experts = num_tokens_per_expert.numel()
        e_local = check_experts_per_rank(num_experts, r)
        if tuple(num_tokens_per_rank.shape) != (r,):
            raise ValueError(f"num_tokens_per_rank must be [{r}]; got {list(num_tokens_per_rank.shape)}")
        if topk_idx is not None:
            self._check_topk(topk_idx, num_experts)  # no host read if get_dispatch_layout checked it
            if topk_idx.shape[0] != t:
                raise ValueError(f"topk_idx has {topk_idx.shape[0]} tokens, x has {t}")
            if topk_weights is None or topk_weights.shape != topk_idx.shape or topk_weights.dtype != torch.float32:
                raise ValueError(f"topk_weights must be float32 {list(topk_idx.shape)} alongside topk_idx")

        # Counts to every rank: [R, 1 + E_local] = (tokens sent, per-expert selections).
        counts = torch.cat([num_tokens_per_rank.view(r, 1).long(), num_tokens_per_expert.view(r, e_local).long()], 1)
        got = self._exchange_counts(counts)
        per_expert = got[:, 1:].sum(0)
        per_expert = (per_expert + expert_alignment - 1) // expert_alignment * expert_alignment
        host = torch.cat([counts[:, 0], got[:, 0], per_expert]).tolist()  # the one read of the counts
        send_splits, recv_splits, per_expert_list = host[:r], host[r:2 * r], host[2 * r:]
        # Rows grouped by destination rank, token order within a rank.
        _, token = is_token_in_rank.t().nonzero(as_tuple=True)
        if token.numel() != sum(send_splits):
            raise ValueError(f"num_tokens_per_rank {send_splits} does not match is_token_in_rank "
                             f"({token.numel()} rows)")
        handle = _HTHandle(is_token_in_rank, token, send_splits, recv_splits)
        fields = [x_data] + ([x_scales] if x_scales is not None else [])
        if topk_idx is not None:
            fields += [topk_idx, topk_weights]
        got_fields = self._send_rows(handle, fields)
        recv_x = tuple(got_fields[:2]) if x_scales is not None else got_fields[0]

        recv_idx = recv_w = None
        if topk_idx is not None:
            recv_idx, recv_w = got_fields[-2:]
            local = recv_idx - self.rank * e_local
            here = (recv_idx >= 0) & (local >= 0) & (local < e_local)
            recv_idx = torch.where(here, local, torch.full_like(local, -1))
            recv_w = torch.where(here, recv_w, torch.zeros_like(recv_w))
        return recv_x, recv_idx, recv_w, per_expert_list, handle, None

    def combine(self, x: torch.Tensor, handle: _HTHandle, topk_weights: torch.Tensor | None = None,
                bias=None, config=None, previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Send each received row back to its source rank and sum a token's copies (unweighted).

        Arguments:
            x: [T', H] (bf16), one row per received token, in ``dispatch``'s receive order.
            handle: the handle ``dispatch`` returned.
            topk_weights: optional float32 [T', k], summed back the same way.
            bias: optional [T, H] tensor or tuple of up to two, added to the result.
            config, previous_event, async_finish, allocate_on_comm_stream: accepted, ignored.

        Returns:
            combined_x: [T, H], x's dtype (float32 accumulation; tokens sent nowhere are zero).
            combined_topk_weights: float32 [T, k] or None.
            event: None.
        """
        if not isinstance(handle, _HTHandle):
            raise ValueError("combine needs the handle returned by this buffer's dispatch")
        t_recv = sum(handle.recv_splits)
        if x.dim() != 2 or x.shape[0] != t_recv:
            raise ValueError(f"x must be [{t_recv}, H] (the received token count); got {list(x.shape)}")
        if topk_weights is not None and (topk_weights.dim() != 2 or topk_weights.shape[0] != t_recv):
            raise ValueError(f"topk_weights must have {t_recv} rows; got {list(topk_weights.shape)}")
        t = handle.is_token_in_rank.shape[0]
        fields = [x] + ([topk_weights.float()] if topk_weights is not None else [])
        back = self._exchange_packed(fields, handle.recv_splits, handle.send_splits)  # x and weights at once
        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, handle.send_rows, back[0].float())
        if bias is not None:
            for b in bias if isinstance(bias, tuple) else (bias,):
                if b is not None:
                    out += b.float()
        combined_w = None
        if topk_weights is not None:
            combined_w = torch.zeros(t, topk_weights.shape[1], dtype=torch.float32, device=x.device)
            combined_w.index_add_(0, handle.send_rows, back[1])
        return out.to(x.dtype), combined_w, None

    def _send_rows(self, handle: _HTHandle, fields: list[torch.Tensor]) -> list[torch.Tensor]:
        """The handle's rows of each [T, ...] field, sent in one exchange: [T', ...] each."""
        return self._exchange_packed(fields, handle.send_splits, handle.recv_splits, rows=handle.send_rows)

    # ----------------------------------------------------------------- low-latency mode
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Send one copy of each token per selected expert into a per-expert (masked) layout.

        Arguments:
            x: bf16 [T, H], T <= num_max_dispatch_tokens_per_rank; H one of DeepEP's LL hidden sizes.
            topk_idx: int64 [T, k] global expert ids, -1 = none; k <= 11.
            num_max_dispatch_tokens_per_rank: N, identical on every rank.
            num_experts: E, a multiple of the rank count R.
            cumulative_local_expert_recv_stats: optional int32 [E_local]; recv_count is added to it.
            dispatch_wait_recv_cost_stats: accepted, left untouched (no timing here).
            use_fp8: quantise per 1x128 group as DeepEP does (scale_inv = amax / 448, amax floored at
                1e-4; ``round_scale`` rounds scale_inv up to a power of two). ``use_ue8m0`` is refused.
            async_finish, return_recv_hook: mutually exclusive; the hook is a no-op.

        Returns:
            recv_x: fp8: (float8_e4m3fn [E_local, R*N, H], float32 scales [E_local, R*N, H/128] with
                strides (R*N*H/128, 1, R*N), i.e. column-major in the last two dims); else bf16
                [E_local, R*N, H]. Rows of expert e past recv_count[e] are uninitialised.
            recv_count: int32 [E_local] valid rows per local expert (grouped by source rank, token order).
            handle: pass to ``low_latency_combine``.
            event: None.
            hook: a no-op callable with ``return_recv_hook``, else None.
        """
        n, h = num_max_dispatch_tokens_per_rank, x.shape[-1] if x.dim() == 2 else -1
        r = self.group_size
        if not self.low_latency_mode:
            raise ValueError("low_latency_dispatch needs a buffer built with low_latency_mode=True")
        if x.dim() != 2 or x.dtype != torch.bfloat16:
            raise ValueError(f"x must be bf16 [T, H]; got {x.dtype} {list(x.shape)}")
        if use_ue8m0:
            raise ValueError("use_ue8m0=True: UE8M0 scales are not supported by TorchAll2AllBuffer")
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook are mutually exclusive")
        e_local = self._check_topk(topk_idx, num_experts)
        t, k = topk_idx.shape
        if t != x.shape[0]:
            raise ValueError(f"topk_idx has {t} tokens, x has {x.shape[0]}")
        if k > sizing.LL_MAX_TOPK:
            raise ValueError(f"top-k {k} > {sizing.LL_MAX_TOPK}, the most DeepEP's low-latency kernels take")
        if t > n:
            raise ValueError(f"{t} tokens exceed num_max_dispatch_tokens_per_rank={n}")
        need = sizing.check_low_latency_config(n, h, r, num_experts)
        if need > self.num_rdma_bytes:
            bn, bh, be = self.ll_sizes
            raise ValueError(
                f"low-latency buffer too small: (N={n}, H={h}, E={num_experts}) needs {need} bytes, the buffer "
                f"was sized for (N={bn}, H={bh}, E={be}) = {self.num_rdma_bytes} bytes "
                "(DeepEP's layout.total_bytes <= num_rdma_bytes)")

        # One (token, slot) pair per selected expert, sorted by expert: grouped by destination rank,
        # then by local expert, token order within an expert (nonzero lists the pairs in token
        # order, and the sort is stable).
        tok, slot = (topk_idx >= 0).nonzero(as_tuple=True)
        expert = topk_idx[tok, slot]
        order = torch.sort(expert, stable=True).indices
        tok, slot, expert = tok[order], slot[order], expert[order]
        per_expert = torch.zeros(num_experts, dtype=torch.int64, device=x.device) \
            .index_add_(0, expert, torch.ones_like(expert)).view(r, e_local)
        counts = torch.cat([per_expert, torch.full((r, 1), n, dtype=torch.int64, device=x.device)], 1)
        got = self._exchange_counts(counts)  # [R(src), E_local + 1]
        host = torch.cat([got.reshape(-1), per_expert.sum(1)]).tolist()  # the one read of the counts
        got_rows = [host[i * (e_local + 1):(i + 1) * (e_local + 1)] for i in range(r)]
        if any(row[-1] != n for row in got_rows):
            raise ValueError(f"num_max_dispatch_tokens_per_rank differs across ranks: {[row[-1] for row in got_rows]}")
        got = got[:, :-1]
        send_splits = host[r * (e_local + 1):]
        recv_splits = [sum(row[:-1]) for row in got_rows]

        # Where each received row goes: expert e's slice holds source rank 0's rows, then rank 1's...
        flat = got.reshape(-1)  # received blocks in (src, e) order
        block_start = torch.cumsum(flat, 0) - flat
        slice_start = (torch.cumsum(got, 0) - got).reshape(-1)  # offset of src s inside expert e's slice
        block = torch.repeat_interleave(torch.arange(flat.numel(), device=x.device), flat,
                                        output_size=sum(recv_splits))
        recv_expert = block % e_local
        recv_pos = slice_start[block] + torch.arange(block.numel(), device=x.device) - block_start[block]
        handle = _LLHandle(tok, slot, send_splits, recv_splits, recv_expert, recv_pos, n, h, num_experts)

        recv_count = got.sum(0).to(torch.int32)
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += recv_count.to(cumulative_local_expert_recv_stats.dtype)
        hook = (lambda: None) if return_recv_hook else None
        if not use_fp8:
            recv_x = torch.empty(e_local, r * n, h, dtype=torch.bfloat16, device=x.device)
            recv_x[recv_expert, recv_pos] = self._exchange(x[tok], send_splits, recv_splits)
            return recv_x, recv_count, handle, None, hook

        # Quantise each token once (the cast is per row), then send its row once per selected expert.
        q, s = _ll_quant(x, round_scale)
        got_q, got_s = self._exchange_packed([q, s], send_splits, recv_splits, rows=tok)
        recv_q = torch.empty(e_local, r * n, h, dtype=torch.float8_e4m3fn, device=x.device)
        recv_s = torch.empty(e_local, h // 128, r * n, dtype=torch.float32, device=x.device).transpose(1, 2)
        recv_q[recv_expert, recv_pos] = got_q
        recv_s[recv_expert, recv_pos] = got_s
        return (recv_q, recv_s), recv_count, handle, None, hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: _LLHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None, combine_wait_recv_cost_stats=None):
        """Send expert outputs back and reduce them with the top-k weights on the source rank.

        Arguments:
            x: bf16 [E_local, R*N, H], expert outputs in ``low_latency_dispatch``'s layout (only the
                valid rows are read).
            topk_idx: int64 [T, k] as dispatched; topk_weights: float32 [T, k].
            handle: from ``low_latency_dispatch``.
            out: optional bf16 [T, H] written and returned.
            use_logfmt, zero_copy, combine_wait_recv_cost_stats: accepted, ignored (combine is exact).
            async_finish, return_recv_hook: mutually exclusive; the hook is a no-op.

        Returns:
            combined_x: bf16 [T, H] = sum over slots j with topk_idx[t, j] >= 0 of
                topk_weights[t, j] * expert output (float32 accumulation); event: None; hook.
        """
        if not isinstance(handle, _LLHandle):
            raise ValueError("low_latency_combine needs the handle returned by low_latency_dispatch")
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook are mutually exclusive")
        e_local = handle.num_experts // self.group_size
        shape = (e_local, self.group_size * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        if tuple(x.shape) != shape or x.dtype != torch.bfloat16:
            raise ValueError(f"x must be bf16 {list(shape)}; got {x.dtype} {list(x.shape)}")
        if topk_weights.shape != topk_idx.shape or topk_weights.dtype != torch.float32:
            raise ValueError(f"topk_weights must be float32 {list(topk_idx.shape)}; got "
                             f"{topk_weights.dtype} {list(topk_weights.shape)}")
        t = topk_idx.shape[0]
        if out is not None and (tuple(out.shape) != (t, handle.hidden) or out.dtype != torch.bfloat16):
            raise ValueError(f"out must be bf16 [{t}, {handle.hidden}]; got {out.dtype} {list(out.shape)}")
        back = self._exchange(x[handle.recv_expert, handle.recv_pos], handle.recv_splits, handle.send_splits)
        acc = torch.zeros(t, handle.hidden, dtype=torch.float32, device=x.device)
        w = topk_weights[handle.src_token, handle.src_slot].unsqueeze(1)
        acc.index_add_(0, handle.src_token, back.float() * w)
        if out is None:
            out = torch.empty(t, handle.hidden, dtype=torch.bfloat16, device=x.device)
        out.copy_(acc)
        return out, None, ((lambda: None) if return_recv_hook else None)

    # ----------------------------------------------------------------- validation
    def _check_topk(self, topk_idx: torch.Tensor, num_experts: int) -> int:
        """Validate topk_idx against num_experts; return E_local. The value range costs one host
        read (aminmax), skipped when this very tensor, unmodified, was checked last."""
        if topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
            raise ValueError(f"topk_idx must be int64 [T, k]; got {topk_idx.dtype} {list(topk_idx.shape)}")
        e_local = check_experts_per_rank(num_experts, self.group_size)
        last = self._checked_topk
        if last is not None and last[0]() is topk_idx and last[1:] == (topk_idx._version, num_experts):
            return e_local
        if topk_idx.numel():
            lo, hi = torch.stack(torch.aminmax(topk_idx)).tolist()
            if lo < -1 or hi >= num_experts:
                raise ValueError(f"topk_idx values must lie in [-1, {num_experts}); got [{lo}, {hi}]")
        self._checked_topk = (weakref.ref(topk_idx), topk_idx._version, num_experts)
        return e_local

    @staticmethod
    def _check_rows(x: torch.Tensor, scales: torch.Tensor | None) -> None:
        if x.dim() != 2 or (x.shape[1] * x.element_size()) % 16:
            raise ValueError(f"x must be [T, H] with rows of a multiple of 16 bytes; got {x.dtype} {list(x.shape)}")
        if scales is not None:
            if x.dtype != torch.float8_e4m3fn:
                raise ValueError(f"with scales, x must be float8_e4m3fn; got {x.dtype}")
            if scales.dim() != 2 or scales.shape[0] != x.shape[0] or scales.dtype != torch.float32:
                raise ValueError(f"scales must be float32 [{x.shape[0]}, S]; got {scales.dtype} {list(scales.shape)}")


def _ll_quant(rows: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's low-latency FP8 cast of bf16 rows [P, H]: per 1x128 group, amax floored at 1e-4,
    scale = 448 / amax, q = saturate(x * scale) rounded to nearest even, scale_inv = amax * (1/448)
    (round_scale: scale_inv rounded up to a power of two and scale = 1 / scale_inv).
    Returns (float8_e4m3fn [P, H], float32 scale_inv [P, H/128])."""
    p, h = rows.shape
    g = rows.float().view(p, h // 128, 128)
    amax = g.abs().amax(-1).clamp(min=LL_AMAX_FLOOR)
    if round_scale:
        scale_inv = torch.exp2(torch.ceil(torch.log2(amax * (1.0 / FP8_MAX))))
        scale = 1.0 / scale_inv
    else:
        scale_inv = amax * (1.0 / FP8_MAX)
        scale = torch.full_like(amax, FP8_MAX) / amax  # one correctly rounded division, as DeepEP
    q = (g * scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(p, h), scale_inv

