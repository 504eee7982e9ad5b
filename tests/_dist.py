"""Test helpers for multi-rank tests: the launcher lives in vllm_moe_fixes.distributed.launch.

``run_distributed(fn, world_size, *args, backend=...)`` (gloo ranks forked, NCCL ranks spawned,
every failing rank prints its traceback, returns the per-rank return values) is re-exported from
there; ``device_for`` is test-only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vllm_moe_fixes.distributed.launch import run_distributed

__all__ = ["device_for", "run_distributed"]


def device_for(rank: int) -> torch.device:
    """The tensor device of ``rank``: its GPU when NCCL runs, else the CPU."""
    return torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
