"""Two-batch overlap: the layer call with and without FusedMoEModularKernel(micro_batches=n), in
one run, the non-overlapped call the anchor.

    python -m benchmarks.bench_overlap                  # gloo/CPU: 2 and 4 ranks, torch buffers
    python -m benchmarks.bench_overlap --worlds 2 --tokens 128 --reps 2   # a quick look
    python -m benchmarks.bench_overlap --gpu-delayed    # one GPU, world 1, simulated link
    python -m benchmarks.bench_overlap --deep-ep        # one GPU, world 1, real DeepEP LL

Every overlapped kernel keeps its splitting rule (modular_kernel.micro_batches_for: a call splits
only where each micro-batch keeps MIN_MICRO_BATCH_TOKENS tokens): ``split`` is the micro-batch
count the kernel ran, and cost and hidden share are the rule's. Where the rule ran fewer than n,
the forced_* columns are the same kernel forced to split into n (min_micro_batch_tokens=1): what
the rule saved.

gloo (CPU): every rank runs the high-throughput layer (the naive backend's TorchAll2AllBuffer,
TritonExperts on their CPU path) on M tokens (128, 1024, 8192), K 256, I 128, top-2 of 4 experts
per rank, max_tokens_across_ranks = M (all ranks alike). Two settings of the link:
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

--gpu-delayed (one GPU, world 1, NCCL): the same high-throughput layer at DeepSeek-V3's shapes
(K 7168, I 2048, top-8 of 8 local experts, FP8 weights) with the experts the GPU layer uses
(DeepGemmExperts where DeepGEMM imports, else TritonExperts; --experts picks), over the
TorchAll2AllBuffer on NCCL (at world 1 a copy) and over DelayedAll2AllBuffer, whose link's time is
a host-to-device copy on a link stream of its own (the copy engine, no SM): the caller's stream
waits for it and the host does not (delayed_buffer's docstring says why). Calibrated as above
(half the anchor's time at M 1024). Each call is timed by CUDA events, the GPU idle before it;
medians of --reps rounds, variants interleaved. No host-side wait to book, so the hidden share
comes from the times:
      hidden = 1 - (overlapped delayed - overlapped plain) / L: the link time the overlapped call
        did not hide, its own cost taken out; anchor_hidden, the same of the anchor (about 0);
      wall_hidden = (anchor delayed - overlapped delayed) / L, cost included.

--deep-ep (one GPU, world 1, NCCL): the low-latency layer over a real deep_ep.Buffer (hidden 7168,
BatchedTritonExperts, N 128 per pass) with and without micro_batches=2, CUDA-event timed medians:
cost_pct with the rule (chunks of N = 128 tokens stay unsplit: split 1), forced_cost_pct split
into two micro-batches of 64 whatever the rule. At world 1 DeepEP's transfer is a copy on the GPU,
so this measures the overlap's cost; what it hides needs two or more GPUs.

Results: benchmarks/results/overlap_gloo.json, overlap_gpu.json, overlap_deep_ep_ws1.json.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks._common import print_table, write_json
from vllm_moe_fixes import envs
from vllm_moe_fixes.distributed.delayed_buffer import DelayedAll2AllBuffer
from vllm_moe_fixes.distributed.launch import run_distributed
from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer
from vllm_moe_fixes.fused_moe.contiguous_experts import TritonExperts
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import (
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
)
from vllm_moe_fixes.fused_moe.kernel_factory import local_expert_map
from vllm_moe_fixes.fused_moe.modular_kernel import (
    MIN_MICRO_BATCH_TOKENS,
    FusedMoEModularKernel,
    micro_batches_for,
)
from vllm_moe_fixes.testing import random_fp8_moe_weights

TOKENS = (128, 1024, 8192)
GLOO_SHAPE = dict(K=256, I=128, experts_per_rank=4, topk=2)
GPU_SHAPE = dict(K=7168, I=2048, experts_per_rank=8, topk=8)  # DeepSeek-V3's K, I and top-k
CALIBRATION_M = 1024


def _problem(rank: int, world: int, m: int, shape: dict, device) -> tuple[list, dict]:
    """This rank's layer arguments (its experts' weights, m tokens routed over all experts),
    drawn on ``device``."""
    num_experts = shape["experts_per_rank"] * world
    g = torch.Generator(device=device).manual_seed(1 + rank)
    weights = random_fp8_moe_weights(shape["experts_per_rank"], shape["K"], shape["I"],
                                     generator=g, device=device)
    x = torch.randn(m, shape["K"], generator=g, device=device).to(torch.bfloat16)
    scores = torch.randn(m, num_experts, generator=g, device=device)
    topk_weights, ids = scores.softmax(-1).topk(shape["topk"], dim=-1)
    kwargs = dict(w1_scale=weights.w1_scale, w2_scale=weights.w2_scale,
                  global_num_experts=num_experts, max_tokens_across_ranks=m,
                  expert_map=local_expert_map(dist.group.WORLD, num_experts, device))
    return [x, weights.w1, weights.w2, topk_weights, ids], kwargs


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


def _gpu_rounds(variants: dict, reps: int) -> dict:
    """{name: [GPU seconds of each of reps calls]}, CUDA events around each call with the GPU
    idle before it, variants interleaved (one rank)."""
    times = {name: [] for name in variants}
    for call in variants.values():  # warm-up: JIT compiles, plans, workspaces
        call()
    for _ in range(reps):
        for name, call in variants.items():
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            torch.cuda.synchronize()
            start.record()
            call()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e-3)
    return times


def _kernels(rank: int, world: int, buffer, shape: dict, splits, make_experts, *,
             forced: bool = False) -> dict:
    """{micro_batches: kernel} over ``buffer`` for 1 and each of splits; forced: split every
    call into micro_batches (min_micro_batch_tokens=1) instead of the kernel's rule."""
    def kernel(micro_batches):
        pf = DeepEPHTPrepareAndFinalize(buffer, num_dispatchers=world,
                                        rank_expert_offset=rank * shape["experts_per_rank"])
        return FusedMoEModularKernel(pf, make_experts(), micro_batches=micro_batches,
                                     min_micro_batch_tokens=1 if forced else
                                     MIN_MICRO_BATCH_TOKENS)
    return {n: kernel(n) for n in ((*splits,) if forced else (1, *splits))}


def _link_shares(buffer, call) -> tuple[float, float]:
    """(simulated link seconds of one call, seconds its waits spent on the link), the slowest
    rank's each."""
    buffer.bytes_sent, buffer.waited_seconds = 0, 0.0
    call()
    return (_slowest(buffer.bytes_sent * buffer.seconds_per_byte),
            _slowest(buffer.waited_seconds))


def _bytes_of_call(rank: int, world: int, shape: dict, make_experts, args, kwargs) -> int:
    """The bytes one anchor call sends (the slowest rank's where world > 1)."""
    probe = DelayedAll2AllBuffer(seconds_per_byte=0.0)  # counts the bytes of a call
    _kernels(rank, world, probe, shape, (), make_experts)[1](*args, **kwargs)
    return probe.bytes_sent


def _splits_run(splits, m: int) -> dict:
    """{n: the micro-batches the kernel's rule runs for a call of m tokens (one chunk)}."""
    return {n: micro_batches_for(n, m, envs.VLLM_FUSED_MOE_CHUNK_SIZE, MIN_MICRO_BATCH_TOKENS)
            for n in splits}


def _gloo_worker(rank: int, world: int, tokens, splits, reps: int, link_share: float) -> list:
    torch.set_num_threads(1)  # the ranks share the host's cores
    os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = str(max(tokens))  # one chunk per call
    shape = GLOO_SHAPE
    plain = _kernels(rank, world, TorchAll2AllBuffer(), shape, splits, TritonExperts)
    args, kwargs = _problem(rank, world, CALIBRATION_M, shape, "cpu")
    anchor = statistics.median(_rounds({1: lambda: plain[1](*args, **kwargs)}, reps)[1])
    spb = link_share * anchor / _slowest(
        _bytes_of_call(rank, world, shape, TritonExperts, args, kwargs))
    delayed_buffer = DelayedAll2AllBuffer(seconds_per_byte=spb)
    delayed = _kernels(rank, world, delayed_buffer, shape, splits, TritonExperts)
    forced = {"none": _kernels(rank, world, TorchAll2AllBuffer(), shape, splits, TritonExperts,
                               forced=True),
              "delayed": _kernels(rank, world, delayed_buffer, shape, splits, TritonExperts,
                                  forced=True)}
    rows = []
    for m in tokens:
        args, kwargs = _problem(rank, world, m, shape, "cpu")
        split = _splits_run(splits, m)
        variants = _variants(plain, delayed, forced, split, args, kwargs)
        rounds = _rounds(variants, reps)
        got = {name: statistics.median(ts) for name, ts in rounds.items()}
        shares = {name: [_link_shares(delayed_buffer, variants[name]) for _ in range(reps)]
                  for name in variants if "delayed" in name}
        link = statistics.median(s[0] for s in shares[("delayed", 1)])

        def hidden(name):
            return (1 - statistics.median(waited for _, waited in shares[name]) / link) * 100

        def cost(name, n):
            return (got[(*name, n)] / got[("none", 1)] - 1) * 100

        for n in splits:
            row = dict(world=world, M=m, micro_batches=n, split=split[n],
                       anchor_ms=got[("none", 1)] * 1e3, overlap_ms=got[("none", n)] * 1e3,
                       cost_pct=cost(("none",), n),
                       cost_min_pct=(min(rounds[("none", n)]) / min(rounds[("none", 1)]) - 1)
                       * 100,
                       delayed_anchor_ms=got[("delayed", 1)] * 1e3,
                       delayed_overlap_ms=got[("delayed", n)] * 1e3, link_ms=link * 1e3,
                       hidden_pct=hidden(("delayed", n)), anchor_hidden_pct=hidden(("delayed", 1)),
                       wall_hidden_pct=(got[("delayed", 1)] - got[("delayed", n)]) / link * 100,
                       bound_pct=(1 - 1 / n) * 100, seconds_per_byte=spb)
            if split[n] < n:
                row |= dict(forced_cost_pct=cost(("none", "forced"), n),
                            forced_hidden_pct=hidden(("delayed", "forced", n)))
            rows.append(row)
    return rows


def _variants(plain, delayed, forced, split, args, kwargs) -> dict:
    """One M's timed calls: ("none" | "delayed", n) for every split n, and (link, "forced", n)
    where the kernel's rule ran fewer micro-batches (split[n] < n)."""
    kernels = {("none", n): k for n, k in plain.items()}
    kernels |= {("delayed", n): k for n, k in delayed.items()}
    kernels |= {(link, "forced", n): forced[link][n] for link in forced for n in split
                if split[n] < n}
    return {name: (lambda k=k: k(*args, **kwargs)) for name, k in kernels.items()}


def _gpu_experts(choice: str):
    """The experts class of --experts: deep_gemm, triton, or auto (DeepGEMM where it imports)."""
    from vllm_moe_fixes._compat import deep_gemm
    from vllm_moe_fixes.fused_moe.contiguous_experts import DeepGemmExperts
    if choice == "deep_gemm" or (choice == "auto" and deep_gemm.is_available()):
        return DeepGemmExperts
    return TritonExperts


def _gpu_delayed_worker(rank: int, world: int, tokens, splits, reps: int, link_share: float,
                        experts_choice: str) -> dict:
    os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = str(max(tokens))  # one chunk per call
    shape, device, experts = GPU_SHAPE, torch.device("cuda", rank), _gpu_experts(experts_choice)
    plain_buffer = TorchAll2AllBuffer()
    plain = _kernels(rank, world, plain_buffer, shape, splits, experts)
    args, kwargs = _problem(rank, world, CALIBRATION_M, shape, device)
    anchor = statistics.median(_gpu_rounds({1: lambda: plain[1](*args, **kwargs)}, reps)[1])
    spb = link_share * anchor / _bytes_of_call(rank, world, shape, experts, args, kwargs)
    delayed_buffer = DelayedAll2AllBuffer(seconds_per_byte=spb)
    delayed = _kernels(rank, world, delayed_buffer, shape, splits, experts)
    forced = {"none": _kernels(rank, world, plain_buffer, shape, splits, experts, forced=True),
              "delayed": _kernels(rank, world, delayed_buffer, shape, splits, experts,
                                  forced=True)}
    rows = []
    for m in tokens:
        args, kwargs = _problem(rank, world, m, shape, device)
        split = _splits_run(splits, m)
        variants = _variants(plain, delayed, forced, split, args, kwargs)
        got = {name: statistics.median(ts) for name, ts in _gpu_rounds(variants, reps).items()}
        delayed_buffer.bytes_sent = 0
        variants[("delayed", 1)]()
        link = delayed_buffer.bytes_sent * spb

        def hidden(delayed_name, plain_name):
            return (1 - (got[delayed_name] - got[plain_name]) / link) * 100

        for n in splits:
            row = dict(world=world, M=m, micro_batches=n, split=split[n],
                       anchor_ms=got[("none", 1)] * 1e3, overlap_ms=got[("none", n)] * 1e3,
                       cost_pct=(got[("none", n)] / got[("none", 1)] - 1) * 100,
                       delayed_anchor_ms=got[("delayed", 1)] * 1e3,
                       delayed_overlap_ms=got[("delayed", n)] * 1e3, link_ms=link * 1e3,
                       hidden_pct=hidden(("delayed", n), ("none", n)),
                       anchor_hidden_pct=hidden(("delayed", 1), ("none", 1)),
                       wall_hidden_pct=(got[("delayed", 1)] - got[("delayed", n)]) / link * 100,
                       bound_pct=(1 - 1 / n) * 100)
            if split[n] < n:
                row |= dict(forced_cost_pct=(got[("none", "forced", n)] / got[("none", 1)] - 1)
                            * 100,
                            forced_hidden_pct=hidden(("delayed", "forced", n),
                                                     ("none", "forced", n)))
            rows.append(row)
        print_table(rows[-len(splits):], COLUMNS)  # in the log should a later M not finish
    return dict(rows=rows, seconds_per_byte=spb, experts=experts.__name__)


def _deep_ep_worker(rank: int, world: int, tokens, reps: int) -> list:
    from vllm_moe_fixes.distributed.buffers import make_all2all_buffer
    from vllm_moe_fixes.fused_moe.batched_experts import BatchedTritonExperts
    shape = dict(GLOO_SHAPE, K=7168)
    n = 128
    device = torch.device("cuda", rank)
    buffer = make_all2all_buffer("deepep_low_latency", None, max_tokens_per_rank=n,
                                 hidden=shape["K"],
                                 num_experts=shape["experts_per_rank"] * world)
    def kernel(**kwargs):
        pf = DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=world, max_tokens_per_rank=n)
        return FusedMoEModularKernel(pf, BatchedTritonExperts(), **kwargs)

    # the rule's call (chunks of n tokens: split where n // 2 >= MIN_MICRO_BATCH_TOKENS) and the
    # call split whatever the rule
    kernels = {"plain": kernel(), "rule": kernel(micro_batches=2),
               "forced": kernel(micro_batches=2, min_micro_batch_tokens=1)}
    rows = []
    for m in tokens:
        args, kwargs = _problem(rank, world, m, shape, device)
        ms = {name: statistics.median(ts) * 1e3 for name, ts in _gpu_rounds(
            {name: (lambda k=k: k(*args, **kwargs)) for name, k in kernels.items()},
            reps).items()}
        rows.append(dict(world=world, M=m, micro_batches=2,
                         split=micro_batches_for(2, m, n, MIN_MICRO_BATCH_TOKENS),
                         anchor_ms=ms["plain"], overlap_ms=ms["rule"],
                         cost_pct=(ms["rule"] / ms["plain"] - 1) * 100,
                         forced_cost_pct=(ms["forced"] / ms["plain"] - 1) * 100))
    return rows


COLUMNS = ["world", "M", "micro_batches", "split", "anchor_ms", "overlap_ms", "cost_pct",
           "forced_cost_pct", "link_ms", "hidden_pct", "forced_hidden_pct", "anchor_hidden_pct",
           "wall_hidden_pct", "bound_pct"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--link-share", type=float, default=0.5)
    parser.add_argument("--deep-ep", action="store_true")
    parser.add_argument("--gpu-delayed", action="store_true")
    parser.add_argument("--experts", choices=["auto", "deep_gemm", "triton"], default="auto",
                        help="--gpu-delayed's experts (auto: DeepGEMM where it imports)")
    args = parser.parse_args()
    if args.deep_ep:
        rows = run_distributed(_deep_ep_worker, 1, args.tokens, args.reps, backend="nccl")[0]
        print_table(rows, list(rows[0]))
        write_json("overlap_deep_ep_ws1", dict(rows=rows, reps=args.reps))
        return
    if args.gpu_delayed:
        got = run_distributed(_gpu_delayed_worker, 1, args.tokens, args.micro_batches, args.reps,
                              args.link_share, args.experts, backend="nccl")[0]
        print_table(got["rows"], COLUMNS)
        write_json("overlap_gpu", dict(
            got, reps=args.reps, link_share=args.link_share, shape=GPU_SHAPE,
            min_micro_batch_tokens=MIN_MICRO_BATCH_TOKENS,
            note="world 1, NCCL, DeepEPHTPrepareAndFinalize over TorchAll2AllBuffer (plain) and "
                 "DelayedAll2AllBuffer (its link a host-to-device copy on a stream of its own); "
                 "split: the micro-batches the kernel's rule ran; cost_pct: overlapped vs plain "
                 "call without delay; hidden_pct: 1 - (delayed - plain, both overlapped) / link "
                 "time (anchor_hidden_pct: the plain call's own, the check); wall_hidden_pct: "
                 "(anchor delayed - overlapped delayed) / link time; forced_*: split into "
                 "micro_batches whatever the rule; bound_pct: 1 - 1/micro_batches. CUDA-event "
                 "medians"))
        return
    rows = []
    for world in args.worlds:
        rows += run_distributed(_gloo_worker, world, args.tokens, args.micro_batches,
                                args.reps, args.link_share)[0]
    print_table(rows, COLUMNS[:7] + ["cost_min_pct"] + COLUMNS[7:])
    write_json("overlap_gloo", dict(
        rows=rows, reps=args.reps, link_share=args.link_share, shape=GLOO_SHAPE,
        min_micro_batch_tokens=MIN_MICRO_BATCH_TOKENS,
        note="split: the micro-batches the kernel's rule ran; cost_pct / cost_min_pct: "
             "overlapped vs plain call over the plain TorchAll2AllBuffer (medians / fastest "
             "rounds); hidden_pct: 1 - (time the overlapped call waited on "
             "DelayedAll2AllBuffer's simulated link) / the plain call's link time "
             "(anchor_hidden_pct: the plain call's own, the check); wall_hidden_pct: (plain - "
             "overlapped) / link time, wall clock; forced_*: split into micro_batches whatever "
             "the rule; bound_pct: 1 - 1/micro_batches. One 2-core host shared with other "
             "jobs: wall-clock rounds vary by 10-30%"))


if __name__ == "__main__":
    main()
