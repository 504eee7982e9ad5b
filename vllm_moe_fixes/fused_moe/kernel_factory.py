"""One MoE layer's backend wired from the environment: buffer + prepare/finalize + experts.

`make_moe_kernel` builds `make_prepare_finalize(...)` and the experts of the activation format it
produces (`experts_for_format`), split as vLLM splits it: the prepare/finalize follows the
all-to-all backend, the experts follow that format and VLLM_USE_DEEP_GEMM.

    ep_group  all-to-all (VLLM_ALL2ALL_BACKEND)             prepare/finalize       format
    None      none (the variable is not read)               NoEP...                standard
    a group   naive or deepep_high_throughput               DeepEPHT...            standard
    a group   deepep_low_latency, or naive + low_latency    DeepEPLL...            batched
    a group   deepep_v2 (DeepEP V2's buffer)                DeepEPV2...            standard

The table is `prepare_finalize_wiring` (backend -> prepare/finalize class and arguments) and
`experts_selection` (format + VLLM_USE_DEEP_GEMM -> experts class). The vLLM plugin asks the
same two, with vLLM's all-to-all buffer and numbers as inputs, and maps only names.

With a group of R ranks, rank r holds the E_l = E / R experts [r*E_l, (r+1)*E_l) (DeepEP's
placement): give the kernel those experts' weights and `local_expert_map(ep_group, E)`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from vllm_moe_fixes import envs
from vllm_moe_fixes._compat import deep_ep
from vllm_moe_fixes._validate import check_experts_per_rank, check_positive_int
from vllm_moe_fixes.distributed.buffers import (
    all2all_backend,
    group_rank_and_size,
    make_all2all_buffer,
)
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import (
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
    DeepEPV2PrepareAndFinalize,
)
from vllm_moe_fixes.fused_moe.experts_selection import experts_for_format
from vllm_moe_fixes.fused_moe.interfaces import PrepareAndFinalize
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.fused_moe.no_ep_prepare_finalize import NoEPPrepareAndFinalize
from vllm_moe_fixes.fused_moe.workspaces import Workspaces


def make_moe_kernel(ep_group: dist.ProcessGroup | None, *, hidden_size: int,
                    intermediate_size: int, num_experts: int,
                    max_tokens_per_rank: int | None = None, backend: str | None = None,
                    low_latency: bool | None = None,
                    workspaces: Workspaces | None = None) -> FusedMoEModularKernel:
    """The modular kernel of one MoE layer with the backends the environment asks for.

    Args:
        ep_group: the expert-parallel process group (every rank of it calls this, in the same
            order), or None: one rank, no all-to-all (NoEPPrepareAndFinalize).
        hidden_size: K, an int >= 1 (a multiple of 128 for any backend to run the layer).
        intermediate_size: I, an int >= 1 (w1 is [E_l, 2I, K], w2 is [E_l, K, I]).
        num_experts: E, the global expert count, a multiple of the group's rank count R.
        max_tokens_per_rank: N, the most tokens one rank passes to a dispatch (sizes the
            low-latency buffer; longer calls run in chunks); None: VLLM_MOE_DP_CHUNK_SIZE.
        backend: "naive", "deepep_high_throughput", "deepep_low_latency" or "deepep_v2";
            None: VLLM_ALL2ALL_BACKEND.
        low_latency: the low-latency (batched) dispatch; None: backend == "deepep_low_latency".
            The naive backend serves both modes; each DeepEP v1 backend only its own. deepep_v2
            has one dispatch (standard format): low_latency=True runs it without a host read
            (do_cpu_sync=False: R*N rows, CUDA-graph capturable), else with the exact size.
        workspaces: a Workspaces shared with other layers' kernels; None: the kernel's own.
        Without a group there is no dispatch: max_tokens_per_rank, backend and low_latency are
        not read.

    Returns a FusedMoEModularKernel (see `make_prepare_finalize` and `experts_for_format`).

    Raises ValueError for bad arguments, a mode the backend does not serve or a configuration
    DeepEP cannot serve (`make_all2all_buffer`); MissingLibraryError, an ImportError (a DeepEP
    backend without DeepEP, VLLM_USE_DEEP_GEMM=1 without DeepGEMM), names the variable to change.
    """
    check_positive_int("intermediate_size", intermediate_size)
    pf = make_prepare_finalize(ep_group, hidden_size=hidden_size, num_experts=num_experts,
                               max_tokens_per_rank=max_tokens_per_rank, backend=backend,
                               low_latency=low_latency)
    experts = experts_for_format(pf.activation_format, intermediate_size, hidden_size)
    if ep_group is None:
        pf.defer_input_quant_to(experts)
    return FusedMoEModularKernel(pf, experts, workspaces)


def make_prepare_finalize(ep_group: dist.ProcessGroup | None, *, hidden_size: int,
                          num_experts: int, max_tokens_per_rank: int | None = None,
                          backend: str | None = None,
                          low_latency: bool | None = None) -> PrepareAndFinalize:
    """The prepare/finalize of `make_moe_kernel` (same arguments): NoEPPrepareAndFinalize without
    a group; else the class `prepare_finalize_wiring` picks, over `make_all2all_buffer`'s buffer
    for (ep_group, backend, N, K, E), built once per group and sizes."""
    check_positive_int("hidden_size", hidden_size)
    check_positive_int("num_experts", num_experts)
    if ep_group is None:
        return NoEPPrepareAndFinalize()
    rank, num_ranks = group_rank_and_size(ep_group, "ep_group")
    backend = all2all_backend(backend)
    if max_tokens_per_rank is None:
        max_tokens_per_rank = envs.VLLM_MOE_DP_CHUNK_SIZE
    wiring = prepare_finalize_wiring(backend, num_ranks=num_ranks, rank=rank,
                                     num_experts=num_experts,
                                     max_tokens_per_rank=max_tokens_per_rank,
                                     low_latency=low_latency)
    buffer = make_all2all_buffer(backend, ep_group, max_tokens_per_rank=max_tokens_per_rank,
                                 hidden=hidden_size, num_experts=num_experts)
    return wiring.build(buffer)


class PrepareFinalizeWiring(NamedTuple):
    """One prepare/finalize as `prepare_finalize_wiring` decides it: its class and the keyword
    arguments it takes after the buffer. `build(buffer)` makes it; an engine adapter that wraps
    the class takes the same arguments."""

    cls: type[PrepareAndFinalize]
    kwargs: dict[str, Any]

    def build(self, buffer=None) -> PrepareAndFinalize:
        """``cls(buffer, **kwargs)``; NoEPPrepareAndFinalize takes no buffer."""
        if self.cls is NoEPPrepareAndFinalize:
            return self.cls(**self.kwargs)
        return self.cls(buffer, **self.kwargs)


def prepare_finalize_wiring(backend: str | None, *, num_ranks: int = 1, rank: int = 0,
                            num_experts: int, max_tokens_per_rank: int | None = None,
                            low_latency: bool | None = None,
                            buffer=None) -> PrepareFinalizeWiring:
    """Which prepare/finalize serves an all-to-all backend, and with which arguments: the one
    wiring table of this library and of its engine integrations.

    Args:
        backend: None (no all-to-all: one rank, or expert parallelism inside tensor
            parallelism), "naive", "deepep_high_throughput", "deepep_low_latency" or "deepep_v2".
        num_ranks: R, the ranks of the expert-parallel group; rank: this rank in it.
        num_experts: E, global, a multiple of R (rank r holds experts [r*E_l, (r+1)*E_l)).
        max_tokens_per_rank: N, the most tokens one rank passes to a dispatch (low-latency and
            V2; None for V2: the buffer's own).
        low_latency: as in `make_moe_kernel` (for deepep_v2: True dispatches without the CPU
            sync, capturable); None: backend == "deepep_low_latency".
        buffer: the buffer the prepare/finalize will run over, where the caller has it (an
            engine's all-to-all manager's): deepep_v2 takes the ids in the dtype of the buffer
            (DeepEP V2's ``topk_idx_t``, int64 for the torch stand-in).

    Raises ValueError for a backend or mode that does not exist, or E not a multiple of R.
    """
    if backend is None:
        return PrepareFinalizeWiring(NoEPPrepareAndFinalize, {})
    low_latency = _check_mode(all2all_backend(backend), low_latency)
    local_num_experts = check_experts_per_rank(num_experts, num_ranks)
    placed = dict(num_dispatchers=num_ranks, rank_expert_offset=rank * local_num_experts)
    if backend == "deepep_v2":
        return PrepareFinalizeWiring(DeepEPV2PrepareAndFinalize, dict(
            placed, max_tokens_per_rank=max_tokens_per_rank, do_cpu_sync=not low_latency,
            topk_idx_dtype=_v2_ids_dtype(buffer)))
    if low_latency:
        return PrepareFinalizeWiring(DeepEPLLPrepareAndFinalize, dict(
            num_dispatchers=num_ranks, max_tokens_per_rank=max_tokens_per_rank))
    return PrepareFinalizeWiring(DeepEPHTPrepareAndFinalize, placed)


def _v2_ids_dtype(buffer) -> torch.dtype:
    """The dtype DeepEP V2 takes ids in (``deep_ep.topk_idx_t``, a build option); int64 for a
    buffer that is not DeepEP V2's ElasticBuffer (the torch stand-in's)."""
    if deep_ep.installed_version() == 2:
        module = deep_ep.require("deepep_v2")
        if buffer is None or isinstance(buffer, module.ElasticBuffer):
            return module.topk_idx_t
    return torch.int64


def local_expert_map(ep_group: dist.ProcessGroup | None, num_experts: int,
                     device: torch.device | str | None = None) -> torch.Tensor | None:
    """int32 [E]: global expert id -> id among this rank's E_l = E / R experts, -1 for the experts
    of other ranks (rank r holds [r*E_l, (r+1)*E_l)); None without a group (every expert local).
    """
    check_positive_int("num_experts", num_experts)
    if ep_group is None:
        return None
    rank, num_ranks = group_rank_and_size(ep_group, "ep_group")
    local_num_experts = check_experts_per_rank(num_experts, num_ranks)
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
    first = rank * local_num_experts
    expert_map[first:first + local_num_experts] = torch.arange(
        local_num_experts, dtype=torch.int32, device=device)
    return expert_map


def _check_mode(backend: str, low_latency: bool | None) -> bool:
    """Whether the dispatch is low-latency; ValueError for a mode the (known) backend lacks."""
    if low_latency is None:
        return backend == "deepep_low_latency"
    if not isinstance(low_latency, bool):
        raise ValueError(f"low_latency must be None or a bool, got {low_latency!r}")
    if backend not in ("naive", "deepep_v2") and low_latency != (backend == "deepep_low_latency"):
        mode = "low-latency" if backend == "deepep_low_latency" else "high-throughput"
        raise ValueError(f"low_latency={low_latency} but backend {backend} serves only the "
                         f"{mode} dispatch; the naive and deepep_v2 backends serve both")
    return low_latency
