"""Expert-parallel prepare/finalize over DeepEP V2's ``ElasticBuffer`` (or TorchElasticBuffer).

V2 has one dispatch for prefill and decode (DeepEP main at dd758caf, ``deep_ep/buffers/
elastic.py``). Of its two receive layouts this uses the per-token one (``do_expand=False``),
which is our STANDARD format as it stands: each token once per destination rank, its k ids
local to that rank (-1 elsewhere). The contiguous experts (``TritonExperts``,
``DeepGemmExperts``) then build the 128-aligned expert-contiguous layout on the device as they
do for one rank, and reduce each token's slots with its weights:

    a1 [M, K] bf16 --quant--> (fp8 [M, K], f32 [M, K/128])
        --dispatch--> (fp8 [M', K], f32 [M', K/128] row-major), local ids [M', k], weights
        ids -> global (+ rank_expert_offset) where >= 0 and the row is valid, else -1
        weights -> 0 where the id is -1 (V2 leaves them undefined there)
    experts -> [M', K] reduced, or [M', k, K] --weighted moe_sum--> [M', K]
        --combine (unweighted sum over ranks)--> output [M, K]

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

from vllm_moe_fixes._validate import check_experts_per_rank, check_positive_int
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import (
    PlacedExpertsPrepareAndFinalize,
    weighted_input,
)
from vllm_moe_fixes.fused_moe.modular_kernel import ActivationFormat, PrepareResult
from vllm_moe_fixes.ops.fp8 import SCALE_BLOCK
from vllm_moe_fixes.ops.fp8_quant import per_token_group_quant_fp8


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
    """

    activation_format = ActivationFormat.STANDARD
    _needs = ("dispatch", "combine", "get_buffer_size_hint")

    def __init__(self, buffer, *, num_dispatchers: int, rank_expert_offset: int,
                 max_tokens_per_rank: int | None = None, do_cpu_sync: bool = True,
                 topk_idx_dtype: torch.dtype = torch.int64) -> None:
        super().__init__(buffer, num_dispatchers, rank_expert_offset)
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

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input) -> PrepareResult:
        """a1 bf16 [M, K] (M <= max_tokens_per_rank, may be 0), topk_weights f32 [M, k],
        topk_ids int32/int64 [M, k] global ids.

        Returns a1q fp8 [M', K] and row-major f32 scales [M', K/128] of the rows received,
        topk_ids [M', k] (topk_idx_dtype) GLOBAL ids of experts on this rank (-1 elsewhere and on
        rows past the valid ones) and topk_weights f32 [M', k] (0 at -1). With do_cpu_sync the
        aligned per-local-expert counts are kept in ``num_recv_tokens_per_expert`` (else []).
        V2 places expert g on rank g // E_l: rank_expert_offset and expert_map are checked
        against that placement as DeepEPHTPrepareAndFinalize checks them.
        """
        n = self.max_tokens_per_rank_
        if a1.shape[0] > n:
            raise ValueError(f"{a1.shape[0]} tokens exceed max_tokens_per_rank={n}")
        local_num_experts = check_experts_per_rank(num_experts, self._num_dispatchers)
        self._check_wiring(num_experts, local_num_experts, expert_map)
        a1 = weighted_input(a1, topk_weights, apply_router_weight_on_input)
        a1q, a1s = per_token_group_quant_fp8(a1, SCALE_BLOCK)
        ids = topk_ids.to(self.topk_idx_dtype).contiguous()
        (recv_q, recv_s), recv_ids, recv_w, handle, _ = self.buffer.dispatch(
            (a1q, a1s), topk_idx=ids, topk_weights=topk_weights.float().contiguous(),
            num_experts=num_experts, num_max_tokens_per_rank=n, do_cpu_sync=self.do_cpu_sync)
        self._pending = handle
        self.num_recv_tokens_per_expert = handle.num_recv_tokens_per_expert_list
        here = recv_ids >= 0
        if not self.do_cpu_sync:  # rows past the received total hold whatever was there
            total = handle.psum_num_recv_tokens_per_scaleup_rank[-1]
            rows = torch.arange(recv_ids.shape[0], device=recv_ids.device)
            here &= (rows < total).unsqueeze(1)
        global_ids = torch.where(here, recv_ids + self.rank_expert_offset, -1)
        weights = torch.where(here, recv_w, 0.0)
        return PrepareResult(a1q=recv_q, a1q_scale=recv_s, topk_ids=global_ids,
                             topk_weights=weights)
