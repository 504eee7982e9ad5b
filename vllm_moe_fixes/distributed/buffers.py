"""Construction of the all-to-all buffer a backend needs, once per group and sizes.

``make_all2all_buffer`` returns ``TorchAll2AllBuffer`` for ``naive``, a ``deep_ep.Buffer`` sized
from DeepEP v1.2.1's own hints (``deepep_sizing``) for its two modes, and a
``deep_ep.ElasticBuffer`` sized by DeepEP V2's ``ElasticBuffer.get_buffer_size_hint`` for
``deepep_v2``. Configurations DeepEP cannot serve are refused before any allocation, with the
numbers, by ``deepep_sizing.check_deepep_config`` / ``deepep_v2_sizing.check_elastic_config``
(the planner's checks too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_moe_fixes import envs
from vllm_moe_fixes._validate import check_experts_per_rank, check_positive_int
from vllm_moe_fixes.distributed.deepep_sizing import check_deepep_config
from vllm_moe_fixes.distributed.deepep_v2_sizing import check_elastic_config

if TYPE_CHECKING:  # torch is imported where a buffer is built: planning needs only the sizing
    import torch.distributed as dist

_BUFFERS: dict[tuple, Any] = {}


def all2all_backend(backend: str | None) -> str:
    """``backend``, checked to be one of ``envs.ALL2ALL_BACKENDS``; None: VLLM_ALL2ALL_BACKEND
    (which its parser checks)."""
    if backend is None:
        return envs.VLLM_ALL2ALL_BACKEND
    if backend not in envs.ALL2ALL_BACKENDS:
        raise ValueError(f"backend={backend!r} is not known; allowed: "
                         f"{', '.join(envs.ALL2ALL_BACKENDS)}")
    return backend


def group_rank_and_size(group, name: str = "group") -> tuple[int, int]:
    """(this rank, rank count) of a torch.distributed process group (None: the default group),
    in the order run_distributed passes them to its function; ValueError naming ``name`` unless
    torch.distributed is initialised and group is one."""
    import torch.distributed as dist
    if not (dist.is_initialized() and (group is None or isinstance(group, dist.ProcessGroup))):
        raise ValueError(f"{name} must be None or a torch.distributed ProcessGroup (with the "
                         f"process group initialised), got {type(group).__name__}")
    return dist.get_rank(group), dist.get_world_size(group)


def make_all2all_buffer(backend: str | None, group: dist.ProcessGroup | None, *,
                        max_tokens_per_rank: int, hidden: int, num_experts: int,
                        num_topk: int = 0):
    """Return the all-to-all buffer for ``backend``, built once per (group, backend, sizes).

    Arguments:
        backend: ``"naive"``, ``"deepep_high_throughput"``, ``"deepep_low_latency"`` or
            ``"deepep_v2"``; None reads ``VLLM_ALL2ALL_BACKEND``.
        group: the expert-parallel process group (None: the default group).
        max_tokens_per_rank: most tokens one rank dispatches per call (sizes the low-latency
            buffer).
        hidden: hidden size H.
        num_experts: global expert count E.
        num_topk: k, for the deepep_v2 hint (0: size for V2's largest top-k, 32); the other
            backends do not read it.

    Returns:
        naive: ``TorchAll2AllBuffer`` (serves both normal and low-latency calls);
        deepep_high_throughput: ``deep_ep.Buffer(num_nvl_bytes=VLLM_DEEPEP_BUFFER_SIZE_MB MiB,
        num_rdma_bytes=0 up to 8 ranks, else DeepEP's RDMA hint)``;
        deepep_low_latency: ``deep_ep.Buffer(low_latency_mode=True, num_rdma_bytes=the hint for
        (max_tokens_per_rank, hidden, ranks, num_experts), num_qps_per_rank=num_experts // ranks)``;
        deepep_v2: ``deep_ep.ElasticBuffer(group, num_bytes=ElasticBuffer.get_buffer_size_hint(
        group, max_tokens_per_rank, hidden, num_topk=num_topk, use_fp8_dispatch=True),
        num_max_tokens_per_rank=max_tokens_per_rank)`` (V2 reads the topology from NCCL).

    Raises ``ValueError`` for an unknown backend or a configuration the backend cannot serve, and
    ``ImportError`` (naming VLLM_ALL2ALL_BACKEND and DeepEP) when a DeepEP backend lacks deep_ep
    or finds the other DeepEP generation installed (``_compat.deep_ep.require``).
    """
    backend = all2all_backend(backend)
    for name, value in (("max_tokens_per_rank", max_tokens_per_rank), ("hidden", hidden),
                        ("num_experts", num_experts)):
        check_positive_int(name, value)
    num_ranks = group_rank_and_size(group)[1]
    check_experts_per_rank(num_experts, num_ranks)

    if backend == "naive":
        kwargs = dict(low_latency_mode=True, num_max_dispatch_tokens_per_rank=max_tokens_per_rank,
                      hidden=hidden, num_experts=num_experts)
    elif backend == "deepep_v2":
        # V2's limits; the group as one NVLink domain, so that only V2's own hint, which reads
        # the real domains from NCCL, decides the bytes.
        check_elastic_config(num_ranks=num_ranks, max_tokens_per_rank=max_tokens_per_rank,
                             hidden=hidden, num_experts=num_experts, num_topk=num_topk,
                             num_nvl_ranks=num_ranks)
        kwargs = dict(num_max_tokens_per_rank=max_tokens_per_rank, hidden=hidden,
                      num_topk=num_topk)
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
        buffer = _BUFFERS[key] = _build(backend, group, kwargs)
    return buffer


def _build(backend: str, group, kwargs: dict):
    """The buffer of a checked configuration (see make_all2all_buffer)."""
    if backend == "naive":
        from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer
        return TorchAll2AllBuffer(group, **kwargs)
    from vllm_moe_fixes._compat.deep_ep import require
    deep_ep = require(backend)
    if group is None:
        import torch.distributed as dist
        group = dist.group.WORLD
    if backend == "deepep_v2":
        return _elastic_buffer(deep_ep.ElasticBuffer, group, **kwargs)
    return deep_ep.Buffer(group=group, **kwargs)


def _elastic_buffer(elastic, group, *, num_max_tokens_per_rank: int, hidden: int,
                    num_topk: int):
    """DeepEP V2's buffer for FP8 dispatch and bf16 combine, sized by V2's own hint."""
    num_bytes = elastic.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden,
                                             num_topk=num_topk, use_fp8_dispatch=True)
    return elastic(group, num_bytes=num_bytes, num_max_tokens_per_rank=num_max_tokens_per_rank)


def clear_all2all_buffers() -> None:
    """Forget the cached buffers, so that each is freed with its last reference.

    A ``deep_ep.Buffer`` or ``ElasticBuffer`` frees its memory in a collective (barriers across
    the group's ranks): call this on every rank at the same point, while the group is alive, and
    drop your own references.
    """
    _BUFFERS.clear()
