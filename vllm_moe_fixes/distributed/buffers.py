"""Construction of the all-to-all buffer a backend needs, once per group and sizes.

``make_all2all_buffer`` returns ``TorchAll2AllBuffer`` for ``naive`` and a ``deep_ep.Buffer`` sized
from DeepEP's own hints (``deepep_sizing``) for the two DeepEP modes. Configurations DeepEP cannot
serve are refused before any allocation, with the numbers, by ``deepep_sizing.check_deepep_config``
(the planner's check too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_moe_fixes import envs
from vllm_moe_fixes._validate import check_experts_per_rank, check_positive_int
from vllm_moe_fixes.distributed.deepep_sizing import check_deepep_config

if TYPE_CHECKING:  # torch is imported where a buffer is built: planning needs only the sizing
    import torch.distributed as dist

_BUFFERS: dict[tuple, Any] = {}


def _group_size(group) -> int:
    import torch.distributed as dist
    return dist.get_world_size(group)


def make_all2all_buffer(backend: str | None, group: dist.ProcessGroup | None, *,
                        max_tokens_per_rank: int, hidden: int, num_experts: int):
    """Return the all-to-all buffer for ``backend``, built once per (group, backend, sizes).

    Arguments:
        backend: ``"naive"``, ``"deepep_high_throughput"`` or ``"deepep_low_latency"``; None reads
            ``VLLM_ALL2ALL_BACKEND``.
        group: the expert-parallel process group (None: the default group).
        max_tokens_per_rank: most tokens one rank dispatches per call (sizes the low-latency
            buffer).
        hidden: hidden size H.
        num_experts: global expert count E.

    Returns:
        naive: ``TorchAll2AllBuffer`` (serves both normal and low-latency calls);
        deepep_high_throughput: ``deep_ep.Buffer(num_nvl_bytes=VLLM_DEEPEP_BUFFER_SIZE_MB MiB,
        num_rdma_bytes=0 up to 8 ranks, else DeepEP's RDMA hint)``;
        deepep_low_latency: ``deep_ep.Buffer(low_latency_mode=True, num_rdma_bytes=the hint for
        (max_tokens_per_rank, hidden, ranks, num_experts), num_qps_per_rank=num_experts // ranks)``.

    Raises ``ValueError`` for an unknown backend or a configuration the backend cannot serve, and
    ``ImportError`` (naming VLLM_ALL2ALL_BACKEND and DeepEP) when a DeepEP backend lacks deep_ep.
    """
    if backend is None:
        backend = envs.VLLM_ALL2ALL_BACKEND
    if backend not in envs.ALL2ALL_BACKENDS:
        raise ValueError(f"backend={backend!r} is not known; allowed: "
                         f"{', '.join(envs.ALL2ALL_BACKENDS)}")
    for name, value in (("max_tokens_per_rank", max_tokens_per_rank), ("hidden", hidden),
                        ("num_experts", num_experts)):
        check_positive_int(name, value)
    num_ranks = _group_size(group)
    check_experts_per_rank(num_experts, num_ranks)

    if backend == "naive":
        kwargs = dict(low_latency_mode=True, num_max_dispatch_tokens_per_rank=max_tokens_per_rank,
                      hidden=hidden, num_experts=num_experts)
    else:
        kwargs = check_deepep_config(backend, num_ranks=num_ranks,
                                     max_tokens_per_rank=max_tokens_per_rank, hidden=hidden,
                                     num_experts=num_experts,
                                     nvl_bytes=envs.VLLM_DEEPEP_BUFFER_SIZE_MB * 2**20)
        if backend == "deepep_low_latency":
            kwargs.update(low_latency_mode=True, num_qps_per_rank=num_experts // num_ranks)

    key = (group, backend, tuple(sorted(kwargs.items())))
    buffer = _BUFFERS.get(key)
    if buffer is None:
        if backend == "naive":
            from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer
            buffer = TorchAll2AllBuffer(group, **kwargs)
        else:
            from vllm_moe_fixes._compat.deep_ep import require
            deep_ep = require(backend)
            if group is None:
                import torch.distributed as dist
                group = dist.group.WORLD
            buffer = deep_ep.Buffer(group=group, **kwargs)
        _BUFFERS[key] = buffer
    return buffer


def clear_all2all_buffers() -> None:
    """Forget the cached buffers, so that each is freed with its last reference.

    A ``deep_ep.Buffer`` frees its memory in a collective (barriers across the group's ranks): call
    this on every rank at the same point, while the group is alive, and drop your own references.
    """
    _BUFFERS.clear()
