"""Run a function on every rank of a fresh local process group (gloo on CPU, NCCL one GPU per rank).

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes that join a group through
a file store in a fresh temporary directory (no TCP port to pick, so no race with another process
taking it) and call ``fn(rank, world_size, *args)``; it returns the list of the ranks' return
values (``result[r]`` is rank r's; ``None`` where fn returned None). Return values travel by pickle
through a temporary file per rank, so return small, picklable, preferably CPU objects.

A failure on any rank fails the caller: every failing rank prints its own traceback to stderr, and
the call raises a ``RuntimeError`` carrying the traceback of the rank that failed first (the
others' errors, such as a peer's "connection closed", follow from it), ending in its error line.
``fn`` must be a module-level function. gloo ranks are forked (fast); NCCL ranks are spawned (CUDA
cannot be forked), which costs seconds: run several cases per call. Every rank destroys its
group before it returns. A forked rank then ends with ``os._exit`` (multiprocessing's fork
start), without interpreter finalization, so a gloo worker thread still releasing a tensor cannot
abort it at exit (see ``collectives``). Each child sets
``NCCL_NVLS_ENABLE=0`` (NVLink multicast off) in its own environment; the caller's is untouched.

Not imported by ``vllm_moe_fixes.distributed`` (which must stay torch-free); torch is imported here.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import tempfile
import time
import traceback


def _worker(rank: int, world_size: int, backend: str, fn, args, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ["NCCL_NVLS_ENABLE"] = "0"  # this child's environment only
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    device = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"file://{os.path.join(out_dir, 'store')}",
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120), **device)
    try:
        try:
            result = fn(rank, world_size, *args)
        except BaseException as exc:  # pytest's Failed is not an Exception: spawn would lose it
            text = traceback.format_exc()
            print(f"rank {rank} failed:\n{text}", file=sys.stderr, flush=True)
            # CLOCK_MONOTONIC is one clock for every process of the machine: the launcher
            # orders the ranks' failures by it.
            with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
                f.write(f"{time.monotonic()!r}\n{text}")
            raise RuntimeError(f"rank {rank}: {text}") from exc
        if result is not None:
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
                pickle.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _first_failure(out_dir: str, world_size: int) -> tuple[int, str] | None:
    """(rank, traceback) of the rank whose recorded error is the earliest, or None if none is."""
    failures = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.err")
        if os.path.exists(path):
            with open(path) as f:
                when, text = f.read().split("\n", 1)
            failures.append((float(when), rank, text))
    return min(failures)[1:] if failures else None


def run_distributed(fn, world_size: int, *args, backend: str = "gloo") -> list:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` new ranks; raise if any fails.

    Arguments:
        fn: a module-level function ``fn(rank, world_size, *args)``, called with the group joined.
        world_size: int >= 1, the number of ranks (processes).
        *args: passed to every rank (pickled for NCCL's spawned ranks).
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (one GPU per rank: needs ``world_size``
            visible GPUs).

    Returns ``[fn's return value on rank r for r in range(world_size)]``. Raises ``RuntimeError``
    with the first failing rank's traceback when a rank fails, and ``ValueError``
    for a bad ``world_size`` or ``backend`` (before any process starts).
    """
    import torch
    import torch.multiprocessing as mp

    from vllm_moe_fixes._validate import check, check_positive_int

    check_positive_int("world_size", world_size)
    check(backend in ("gloo", "nccl"), f"backend={backend!r} must be 'gloo' or 'nccl'")
    if backend == "nccl":
        visible = torch.cuda.device_count()
        check(visible >= world_size, f"backend='nccl' runs one rank per GPU: world_size="
                                     f"{world_size} needs that many GPUs, {visible} visible")

    # fork is several times faster than spawn (no re-import of torch); CUDA needs spawn.
    method = "spawn" if backend == "nccl" else "fork"
    with tempfile.TemporaryDirectory(prefix="vllm_moe_fixes_ranks_") as out_dir:
        try:
            mp.start_processes(_worker, args=(world_size, backend, fn, args, out_dir),
                               nprocs=world_size, join=True, start_method=method)
        except Exception as exc:  # a rank raised or died: name the one that failed first
            first = _first_failure(out_dir, world_size)
            if first is None:  # no rank recorded an error (killed by a signal, say)
                raise
            rank, text = first
            raise RuntimeError(f"rank {rank} failed first:\n{text}") from exc
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            else:
                results.append(None)
        return results
