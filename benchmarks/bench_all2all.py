"""Low-latency all-to-all: the naive backend (TorchAll2AllBuffer) against DeepEP's, in one run.

    python -m benchmarks.bench_all2all                   # world size 1 (one GPU)
    python -m benchmarks.bench_all2all --world-size 2    # one process per GPU, spawned here
    python -m benchmarks.bench_all2all --smoke           # tiny shapes on gloo/CPU (a check)

Per rank: T tokens (1, 32, 128) of hidden 7168, top-8 of 32 experts, both buffers sized for
N = 128 tokens per rank. For each backend (naive; DeepEP low-latency when deep_ep imports, built by
make_all2all_buffer) it times the FP8 ``low_latency_dispatch`` alone and ``low_latency_dispatch``
+ ``low_latency_combine``:
  * eager: a launch loop (perf_counter around ``--calls`` calls, one synchronisation at the end),
    best of three loops;
  * graph: one CUDA graph of ``--calls`` calls, replayed ``--reps`` times (host time drops out).
Every measurement starts on all ranks together after a barrier and reports the slowest rank.
Results: benchmarks/results/all2all_ws<R>.json, with naive / DeepEP ratios of dispatch + combine.
"""

import argparse
import time

import torch
import torch.distributed as dist

from benchmarks._common import print_table, write_json
from vllm_moe_fixes.distributed.launch import run_distributed

TOKENS = (1, 32, 128)
SMOKE_TOKENS = (1, 8)


def _slowest_us(seconds: float, calls: int, device) -> float:
    """Per-call microseconds of the slowest rank."""
    t = torch.tensor([seconds / calls * 1e6], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def eager_us(fn, calls: int, device) -> float:
    """Launch loop: wall time of `calls` back-to-back calls, one sync at the end; best of 3."""
    fn()
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return _slowest_us(best, calls, device)


def graph_us(fn, calls: int, reps: int, device) -> float:
    """One CUDA graph of `calls` calls (captured after a warm-up on a side stream), replayed
    `reps` times: time per call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    _sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    _sync(device)
    us = _slowest_us(time.perf_counter() - t0, reps * calls, device)
    del graph
    return us


def _problem(tokens, args, rank, device):
    """x bf16 [T, H], topk ids int64 [T, k] (distinct, from random scores), weights f32 [T, k]."""
    g = torch.Generator().manual_seed(1000 * rank + tokens)
    scores = torch.rand(tokens, args.experts, generator=g)
    ids = scores.topk(args.topk, dim=1).indices
    w = torch.rand(tokens, args.topk, generator=g)
    x = torch.randn(tokens, args.hidden, generator=g).to(torch.bfloat16)
    return x.to(device), ids.to(device), w.to(device)


def _buffers(args, world):
    """{name: low-latency buffer} for the backends this machine has."""
    from vllm_moe_fixes._compat import deep_ep as deep_ep_compat
    from vllm_moe_fixes.distributed.buffers import make_all2all_buffer

    sizes = dict(max_tokens_per_rank=args.max_tokens, hidden=args.hidden, num_experts=args.experts)
    buffers = {"naive": make_all2all_buffer("naive", None, **sizes)}
    if not args.smoke and deep_ep_compat.is_available():
        buffers["deepep"] = make_all2all_buffer("deepep_low_latency", None, **sizes)
    return buffers


def _measure(buffer, tokens, args, rank, world, device) -> dict:
    n, e = args.max_tokens, args.experts
    x, ids, w = _problem(tokens, args, rank, device)
    y = torch.randn(e // world, world * n, args.hidden, device=device).to(torch.bfloat16)

    def dispatch():
        return buffer.low_latency_dispatch(x, ids, n, e, use_fp8=True)

    def dispatch_combine():
        buffer.low_latency_combine(y, ids, w, dispatch()[2])

    row = {"eager dispatch us": eager_us(dispatch, args.calls, device),
           "eager d+c us": eager_us(dispatch_combine, args.calls, device)}
    if device.type == "cuda":
        row["graph dispatch us"] = graph_us(dispatch, args.calls, args.reps, device)
        row["graph d+c us"] = graph_us(dispatch_combine, args.calls, args.reps, device)
    return row


def _bench(rank, world, args):
    """One rank (in launch.run_distributed's group): the rows, identical on every rank."""
    device = torch.device("cpu") if args.smoke else torch.device("cuda", rank)
    rows = []
    for name, buffer in _buffers(args, world).items():
        for tokens in args.tokens:
            rows.append({"backend": name, "tokens": tokens,
                         **_measure(buffer, tokens, args, rank, world, device)})
    return rows if rank == 0 else None


def _ratios(rows) -> list[dict]:
    """naive / DeepEP of dispatch + combine per token count and timing mode."""
    deepep = {r["tokens"]: r for r in rows if r["backend"] == "deepep"}
    out = []
    for naive in (r for r in rows if r["backend"] == "naive" and r["tokens"] in deepep):
        ref = deepep[naive["tokens"]]
        ratio = {f"{mode} d+c naive/DeepEP": naive[f"{mode} d+c us"] / ref[f"{mode} d+c us"]
                 for mode in ("eager", "graph") if f"{mode} d+c us" in naive}
        out.append({"tokens": naive["tokens"], **ratio})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128,
                   help="N, tokens per rank the buffers take")
    p.add_argument("--calls", type=int, default=20, help="calls per timed loop / per graph")
    p.add_argument("--reps", type=int, default=20, help="graph replays")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on gloo/CPU, naive only, eager only")
    args = p.parse_args()
    if args.world_size < 1:
        p.error(f"--world-size {args.world_size} must be >= 1")
    args.tokens = TOKENS
    if args.smoke:
        args.hidden, args.experts, args.max_tokens, args.calls = 2048, 8 * args.world_size, 8, 2
        args.tokens = SMOKE_TOKENS
    elif torch.cuda.device_count() < args.world_size:
        p.error(f"--world-size {args.world_size} needs that many GPUs; "
                f"{torch.cuda.device_count()} visible")
    backend = "gloo" if args.smoke else "nccl"
    rows = run_distributed(_bench, args.world_size, args, backend=backend)[0]

    print(f"low-latency all-to-all, world size {args.world_size}, hidden {args.hidden}, "
          f"top-{args.topk} of {args.experts} experts, N={args.max_tokens} "
          "(us per call, slowest rank)")
    print_table(rows, list(rows[0]))
    ratios = _ratios(rows)
    if ratios:
        print("naive / DeepEP, dispatch + combine (target: <= 3)")
        print_table(ratios, list(ratios[0]))
    if not args.smoke:
        write_json(f"all2all_ws{args.world_size}", {
            "world_size": args.world_size, "hidden": args.hidden, "experts": args.experts,
            "topk": args.topk, "max_tokens_per_rank": args.max_tokens, "calls": args.calls,
            "reps": args.reps, "rows": rows, "naive_over_deepep": ratios})


if __name__ == "__main__":
    main()
