"""Device memory that creating a DeepEP buffer takes, against DeepEP's size hints and our model.

    python -m benchmarks.deepep_footprint            # every case this machine's GPUs allow
    python -m benchmarks.deepep_footprint --quick    # three low-latency cases at world size 1

Each case runs in fresh processes (NVSHMEM initialises once per process, so its fixed cost shows
only in a fresh one): NCCL group of the case's world size, one warm-up all_gather_object (so NCCL's
own buffers are in place), then torch.cuda.mem_get_info before and after
``make_all2all_buffer(backend, ...)`` builds the ``deep_ep.Buffer``. The device bytes that went
(less any growth of torch's caching allocator) are the buffer's footprint. Low-latency cases run at
world size 1 and, where 2 GPUs are visible, 2; high-throughput (intranode) at 2 with two NVLink
buffer sizes.

The table prints, per case: DeepEP's byte counts (num_nvl_bytes, num_rdma_bytes = its hint), the
measured footprint, ``deepep_sizing.deepep_buffer_footprint_bytes`` (the model the planner uses)
and their difference, and ``implied_fixed``: the measurement less the parts the model takes as
known (32 MiB workspace, NVLink buffer in 2 MiB pages, RDMA buffer rounded up to NVSHMEM's 512 MiB
heap steps), i.e. what NVSHMEM_FIXED_BYTES would have to be for this case. A constant
implied_fixed across cases confirms the model; a step between two RDMA sizes locates the heap's
own reserve. Results: benchmarks/results/deepep_footprint.json.
"""

from __future__ import annotations

import argparse
import os

from vllm_moe_fixes.distributed.deepep_sizing import (
    CUDA_MALLOC_GRANULE,
    DEEPEP_WORKSPACE_BYTES,
    NVSHMEM_HEAP_GRANULARITY,
    deepep_buffer_footprint_bytes,
)
from vllm_moe_fixes.sizes import align_up

MiB = 2**20
# (N tokens per rank, hidden, experts): low-latency RDMA hints from 0.1 MiB to 3.6 GiB, several on
# either side of the first 512 MiB heap step (497.7, 511.9, 540.3 MiB).
LL_CASES = [(4, 2048, 2), (128, 2048, 8), (128, 7168, 32), (128, 7168, 64), (128, 7168, 70),
            (128, 7168, 72), (128, 7168, 76), (128, 7168, 128), (128, 7168, 144),
            (128, 7168, 256), (256, 7168, 256)]
QUICK_LL_CASES = [(4, 2048, 2), (128, 7168, 32), (128, 7168, 256)]
# High-throughput (intranode, 2 ranks): VLLM_DEEPEP_BUFFER_SIZE_MB values.
HT_BUFFER_MB = (256, 1024)


def _measure(rank: int, world: int, backend: str, n: int, hidden: int, experts: int,
             buffer_mb: int) -> dict:
    """One rank of one case: the device bytes creating the buffer took."""
    import gc

    import torch
    import torch.distributed as dist

    from vllm_moe_fixes.distributed.buffers import clear_all2all_buffers, make_all2all_buffer

    if buffer_mb:  # high-throughput cases size the NVLink buffer; low-latency ones keep the default
        os.environ["VLLM_DEEPEP_BUFFER_SIZE_MB"] = str(buffer_mb)
    dist.all_gather_object([None] * world, rank)  # NCCL's buffers and torch's first block, before
    torch.cuda.synchronize()
    free_before, total = torch.cuda.mem_get_info()
    reserved_before = torch.cuda.memory_reserved()
    buffer = make_all2all_buffer(backend, None, max_tokens_per_rank=n, hidden=hidden,
                                 num_experts=experts)
    torch.cuda.synchronize()
    dist.barrier()
    free_after, _ = torch.cuda.mem_get_info()
    torch_growth = torch.cuda.memory_reserved() - reserved_before
    result = {"taken_bytes": free_before - free_after - torch_growth,
              "torch_growth_bytes": torch_growth, "num_nvl_bytes": buffer.num_nvl_bytes,
              "num_rdma_bytes": buffer.num_rdma_bytes,
              "gpu_total_bytes": total}
    # Free the buffer on every rank together (its destructor synchronises the group), not at exit.
    clear_all2all_buffers()
    del buffer
    gc.collect()
    torch.cuda.synchronize()
    dist.barrier()
    return result


def _case(backend: str, world: int, n: int, hidden: int, experts: int, buffer_mb: int) -> dict:
    from vllm_moe_fixes.distributed.launch import run_distributed

    row = {"backend": backend.removeprefix("deepep_"), "ws": world, "N": n, "H": hidden,
           "E": experts, "nvl_MiB_env": buffer_mb if backend == "deepep_high_throughput" else 0}
    try:
        ranks = run_distributed(_measure, world, backend, n, hidden, experts, buffer_mb,
                                backend="nccl")
    except Exception as e:  # noqa: BLE001 -- a case that cannot be built is reported, not fatal
        return {**row, "error": str(e).strip().splitlines()[-1][:200]}
    worst = max(ranks, key=lambda r: r["taken_bytes"])
    nvl, rdma, taken = worst["num_nvl_bytes"], worst["num_rdma_bytes"], worst["taken_bytes"]
    model = deepep_buffer_footprint_bytes(nvl, rdma)
    known = deepep_buffer_footprint_bytes(nvl, 0)  # the workspace and the NVLink buffer
    heap = align_up(rdma, NVSHMEM_HEAP_GRANULARITY)
    return {**row, "nvl_bytes": nvl, "rdma_bytes": rdma, "rdma_MiB": rdma / MiB,
            "measured_MiB": taken / MiB, "model_MiB": model / MiB,
            "diff_MiB": (taken - model) / MiB,
            "implied_fixed_MiB": (taken - known - heap) / MiB if rdma else None,
            "torch_growth_MiB": worst["torch_growth_bytes"] / MiB,
            "per_rank_taken_bytes": [r["taken_bytes"] for r in ranks]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="three low-latency cases at world size 1")
    args = parser.parse_args(argv)

    import torch

    from benchmarks._common import print_table, write_json
    from vllm_moe_fixes._compat import deep_ep

    if not torch.cuda.is_available() or not deep_ep.is_available():
        raise SystemExit("needs a CUDA GPU and DeepEP (bash benchmarks/device_build.sh)")
    gpus = torch.cuda.device_count()
    cases = [("deepep_low_latency", 1, *c, 0) for c in (QUICK_LL_CASES if args.quick else LL_CASES)]
    if gpus >= 2 and not args.quick:
        cases += [("deepep_low_latency", 2, 128, 7168, e, 0) for e in (32, 256)]
        cases += [("deepep_high_throughput", 2, 128, 7168, 32, mb) for mb in HT_BUFFER_MB]
    rows = []
    for case in cases:
        rows.append(_case(*case))
        print(rows[-1], flush=True)
    print()
    print_table(rows, ["backend", "ws", "N", "H", "E", "nvl_MiB_env", "rdma_MiB", "measured_MiB",
                       "model_MiB", "diff_MiB", "implied_fixed_MiB", "torch_growth_MiB", "error"])
    write_json("deepep_footprint", {
        "model": {"workspace_bytes": DEEPEP_WORKSPACE_BYTES,
                  "heap_granularity": NVSHMEM_HEAP_GRANULARITY,
                  "cuda_malloc_granule": CUDA_MALLOC_GRANULE},
        "gpus": gpus, "rows": rows})


if __name__ == "__main__":
    main()
