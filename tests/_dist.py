"""Run a function on every rank of a fresh process group (gloo on CPU, NCCL one process per GPU).

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes that join a group on a
free local port and call ``fn(rank, world_size, *args)``; a failure on any rank fails the caller
with a rank's traceback (every failing rank prints its own to stderr). ``fn`` must be a
module-level function. gloo ranks are forked (fast); NCCL ranks are spawned (CUDA cannot be
forked), which costs seconds: run several cases per call.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, backend: str, fn, args) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120),
                            **({"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}))
    try:
        try:
            fn(rank, world_size, *args)
        except BaseException as exc:  # pytest's Failed is not an Exception: spawn would lose it
            # spawn reports one rank's error (often a peer's "connection closed"): print every one.
            print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            raise RuntimeError(f"rank {rank}: {traceback.format_exc()}") from exc
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, backend: str = "gloo") -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; raise if any fails."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    # fork is several times faster than spawn (no re-import of torch); CUDA needs spawn.
    method = "spawn" if backend == "nccl" else "fork"
    mp.start_processes(_worker, args=(world_size, free_port(), backend, fn, args), nprocs=world_size,
                       join=True, start_method=method)


def device_for(rank: int) -> torch.device:
    """The tensor device of ``rank``: its GPU when NCCL runs, else the CPU."""
    return torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
