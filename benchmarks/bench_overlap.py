"""Two-batch overlap: the layer call with and without FusedMoEModularKernel(micro_batches=n), in
one run, the non-overlapped call the anchor.

    python -m benchmarks.bench_overlap                  # gloo/CPU: 2 and 4 ranks, torch buffers
    python -m benchmarks.bench_overlap --worlds 2 --tokens 128 --reps 2   # a quick look
    python -m benchmarks.bench_overlap --deep-ep        # one GPU, world 1, real DeepEP LL

gloo (CPU): every rank runs the high-throughput layer (the naive backend's TorchAll2AllBuffer,
TritonExperts on their CPU path) on M tokens (128, 1024, 8192), K 256, I 128, top-2 of 4 experts
per rank. Two settings of the link:
  * none: the plain TorchAll2AllBuffer (gloo on one host: a transfer costs little). The overlapped
    call's extra time over the anchor is the overlap's cost when there is nothing to hide.
  * delayed: DelayedAll2AllBuffer, every data exchange taking seconds-per-byte times the bytes a
    rank sends on a serial link. The delay is set once per world size, so that the anchor's
    transfers at M 1024 take --link-share (0.5) of the anchor's time without delay; the same
    delay serves every M. The share of the simulated link time L hidden:
      hidden = 1 - (time the overlapped call's waits spent on the link) / L, both per call and
        the slowest rank's (the buffer books both): what the caller did not wait for. The
        anchor's own share (anchor_hidden, about 0) is the check;
      wall_hidden = (anchor - overlapped) / L, both delayed, wall clock: what the option saves,
        its own cost or gain without delay included (noisy on a shared host).
    With n micro-batches at most 1 - 1/n of L can hide (bound): the first dispatch and the last
    combine have nothing to hide behind. cost = overlapped / anchor - 1 without delay, from the
    medians; cost_min, from the fastest rounds (less of the host's other load).
Each variant is timed --reps times, the variants interleaved in every round; a round's time is
the slowest rank's (all ranks start together after a barrier); the median round is reported.

--deep-ep (one GPU, world 1, NCCL): the low-latency layer over a real deep_ep.Buffer (hidden 7168,
BatchedTritonExperts, N 128 per pass) with and without micro_batches=2, CUDA-event timed medians.
At world 1 DeepEP's transfer is a copy on the GPU, so this measures the overlap's cost; what it
hides needs two or more GPUs.

Results: benchmarks/results/overlap_gloo.json, overlap_deep_ep_ws1.json.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks._common import print_table, write_json
from vllm_moe_fixes.distributed.delayed_buffer import DelayedAll2AllBuffer
from vllm_moe_fixes.distributed.launch import run_distributed
from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer
from vllm_moe_fixes.fused_moe.contiguous_experts import TritonExperts
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import (
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
)
from vllm_moe_fixes.fused_moe.kernel_factory import local_expert_map
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.testing import random_fp8_moe_weights

TOKENS = (128, 1024, 8192)
K, I, E_LOCAL, TOPK = 256, 128, 4, 2
CALIBRATION_M = 1024


def _problem(rank: int, world: int, m: int, hidden: int, device):
    """This rank's layer arguments (its experts' weights, m tokens routed over all experts)."""
    num_experts = E_LOCAL * world
    g = torch.Generator().manual_seed(1 + rank)
    weights = random_fp8_moe_weights(E_LOCAL, hidden, I, generator=g)
    x = torch.randn(m, hidden, generator=g).to(torch.bfloat16)
    scores = torch.randn(m, num_experts, generator=g)
    topk_weights, ids = scores.softmax(-1).topk(TOPK, dim=-1)
    args = (x, weights.w1, weights.w2, topk_weights, ids)
    kwargs = dict(w1_scale=weights.w1_scale, w2_scale=weights.w2_scale,
                  global_num_experts=num_experts,
                  expert_map=local_expert_map(dist.group.WORLD, num_experts, x.device))
    return [a.to(device) for a in args], {k: v.to(device) if isinstance(v, torch.Tensor) else v
                                          for k, v in kwargs.items()}


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _rounds(variants: dict, reps: int) -> dict:
    """{name: [seconds per call of each of reps rounds] (slowest rank)}, variants interleaved."""
    times = {name: [] for name in variants}
    for name, call in variants.items():  # warm-up: plans, workspaces, buffers
        call()
    for _ in range(reps):
        for name, call in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            call()
            times[name].append(_slowest(time.perf_counter() - t0))
    return times


def _kernels(rank: int, world: int, buffer, splits) -> dict:
    def kernel(micro_batches):
        pf = DeepEPHTPrepareAndFinalize(buffer, num_dispatchers=world,
                                        rank_expert_offset=rank * E_LOCAL)
        return FusedMoEModularKernel(pf, TritonExperts(), micro_batches=micro_batches)
    return {n: kernel(n) for n in (1, *splits)}


def _link_shares(buffer, call) -> tuple[float, float]:
    """(simulated link seconds of one call, seconds its waits spent on the link), the slowest
    rank's each."""
    buffer.bytes_sent, buffer.waited_seconds = 0, 0.0
    call()
    return (_slowest(buffer.bytes_sent * buffer.seconds_per_byte),
            _slowest(buffer.waited_seconds))


def _gloo_worker(rank: int, world: int, tokens, splits, reps: int, link_share: float) -> list:
    torch.set_num_threads(1)  # the ranks share the host's cores
    os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = str(max(tokens))  # one chunk per call
    plain = _kernels(rank, world, TorchAll2AllBuffer(), splits)
    probe = DelayedAll2AllBuffer(seconds_per_byte=0.0)  # counts the bytes of a call
    args, kwargs = _problem(rank, world, CALIBRATION_M, K, "cpu")
    anchor = statistics.median(_rounds({1: lambda: plain[1](*args, **kwargs)}, reps)[1])
    probe_kernel = _kernels(rank, world, probe, ())[1]
    probe_kernel(*args, **kwargs)
    spb = link_share * anchor / _slowest(probe.bytes_sent)
    delayed_buffer = DelayedAll2AllBuffer(seconds_per_byte=spb)
    delayed = _kernels(rank, world, delayed_buffer, splits)
    rows = []
    for m in tokens:
        args, kwargs = _problem(rank, world, m, K, "cpu")
        variants = {(link_kind, n): (lambda k=kernels[n]: k(*args, **kwargs))
                    for link_kind, kernels in (("none", plain), ("delayed", delayed))
                    for n in kernels}
        rounds = _rounds(variants, reps)
        got = {name: statistics.median(ts) for name, ts in rounds.items()}
        shares = {n: [_link_shares(delayed_buffer, variants[("delayed", n)])
                      for _ in range(reps)] for n in delayed}
        link = statistics.median(s[0] for s in shares[1])

        def hidden(n):
            return (1 - statistics.median(waited for _, waited in shares[n]) / link) * 100

        for n in splits:
            rows.append(dict(
                world=world, M=m, micro_batches=n, anchor_ms=got[("none", 1)] * 1e3,
                overlap_ms=got[("none", n)] * 1e3,
                cost_pct=(got[("none", n)] / got[("none", 1)] - 1) * 100,
                cost_min_pct=(min(rounds[("none", n)]) / min(rounds[("none", 1)]) - 1) * 100,
                delayed_anchor_ms=got[("delayed", 1)] * 1e3,
                delayed_overlap_ms=got[("delayed", n)] * 1e3, link_ms=link * 1e3,
                hidden_pct=hidden(n), anchor_hidden_pct=hidden(1),
                wall_hidden_pct=(got[("delayed", 1)] - got[("delayed", n)]) / link * 100,
                bound_pct=(1 - 1 / n) * 100, seconds_per_byte=spb))
    return rows


def _deep_ep_worker(rank: int, world: int, tokens, reps: int) -> list:
    from vllm_moe_fixes.distributed.buffers import make_all2all_buffer
    from vllm_moe_fixes.fused_moe.batched_experts import BatchedTritonExperts
    hidden, n = 7168, 128
    device = torch.device("cuda", rank)
    buffer = make_all2all_buffer("deepep_low_latency", None, max_tokens_per_rank=n,
                                 hidden=hidden, num_experts=E_LOCAL * world)
    kernels = {mb: FusedMoEModularKernel(
        DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=world, max_tokens_per_rank=n),
        BatchedTritonExperts(), micro_batches=mb) for mb in (1, 2)}
    rows = []
    for m in tokens:
        args, kwargs = _problem(rank, world, m, hidden, device)
        ms = {}
        for mb, kernel in kernels.items():
            kernel(*args, **kwargs)
        for mb, kernel in kernels.items():
            times = []
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                kernel(*args, **kwargs)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            ms[mb] = statistics.median(times)
        rows.append(dict(world=world, M=m, micro_batches=2, anchor_ms=ms[1], overlap_ms=ms[2],
                         cost_pct=(ms[2] / ms[1] - 1) * 100))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--link-share", type=float, default=0.5)
    parser.add_argument("--deep-ep", action="store_true")
    args = parser.parse_args()
    if args.deep_ep:
        rows = run_distributed(_deep_ep_worker, 1, args.tokens, args.reps, backend="nccl")[0]
        columns = ["world", "M", "micro_batches", "anchor_ms", "overlap_ms", "cost_pct"]
        print_table(rows, columns)
        write_json("overlap_deep_ep_ws1", dict(rows=rows, reps=args.reps))
        return
    rows = []
    for world in args.worlds:
        rows += run_distributed(_gloo_worker, world, args.tokens, args.micro_batches,
                                args.reps, args.link_share)[0]
    print_table(rows, ["world", "M", "micro_batches", "anchor_ms", "overlap_ms", "cost_pct",
                       "cost_min_pct", "link_ms", "hidden_pct", "anchor_hidden_pct",
                       "wall_hidden_pct", "bound_pct"])
    write_json("overlap_gloo", dict(
        rows=rows, reps=args.reps, link_share=args.link_share,
        shape=dict(K=K, I=I, experts_per_rank=E_LOCAL, topk=TOPK),
        note="cost_pct / cost_min_pct: overlapped vs plain call over the plain "
             "TorchAll2AllBuffer (medians / fastest rounds); hidden_pct: 1 - (time the "
             "overlapped call waited on DelayedAll2AllBuffer's simulated link) / the plain "
             "call's link time (anchor_hidden_pct: the plain call's own, the check); "
             "wall_hidden_pct: (plain - overlapped) / link time, wall clock; bound_pct: 1 - "
             "1/micro_batches. One 2-core host shared with other jobs: wall-clock rounds vary "
             "by 10-30%"))


if __name__ == "__main__":
    main()
