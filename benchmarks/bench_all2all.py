"""All-to-all of the naive backend (TorchAll2AllBuffer on NCCL) at DeepEP's test shapes.

    python benchmarks/bench_all2all.py --world-size 2        # one process per GPU, spawned here
    python benchmarks/bench_all2all.py --world-size 2 --smoke  # tiny shapes on gloo/CPU (a check)

High-throughput: 4096 tokens per rank, H=7168, top-8 of --ht-experts (256) experts: FP8 dispatch
(with a fresh layout), BF16 dispatch, and combine. Low-latency: 128 tokens per rank, H=7168,
top-8 of 32 experts: FP8 low_latency_dispatch and low_latency_combine. Bytes are counted as
DeepEP's own tests count them (HT: received rows, FP8 rows as (H + 4H/128) bytes, BF16 as 2H; LL:
one message per (token, expert) selection, FP8 as H + 4H/128 + 16 bytes, combine as 2H). Time is
the median over iterations of the slowest rank (all ranks start together after a barrier).
Results go to benchmarks/results/all2all_ws<N>.json (all2all_ws<N>_e<E>.json for other
--ht-experts), beside DeepEP v1.2.1's figures where known.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._common import print_table, write_json  # noqa: E402
from vllm_moe_fixes.distributed.launch import run_distributed  # noqa: E402

# DeepEP v1.2.1 on 2 x H200 (contracts/deep_ep.md): (time us, GB/s) per operation.
DEEPEP_EP2 = {"ht_dispatch_fp8": (256, 236), "ht_dispatch_bf16": (352, 332), "ht_combine": (396, 295),
              "ll_dispatch_fp8": (37, None), "ll_combine": (43, None)}


def _time_us(fn, iters, device) -> float:
    """Median wall time of fn() in us, slowest rank, ranks aligned by a barrier before each call."""
    times = []
    for i in range(iters + 3):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:  # warm-up calls are not counted
            times.append((time.perf_counter() - t0) * 1e6)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _routing(tokens, experts, k, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    return scores.topk(k, dim=1).indices.to(device), torch.rand(tokens, k, generator=g).to(device)


def _bench(rank, world, args):
    """One rank (in launch.run_distributed's group: NCCL, or gloo with --smoke): the timings,
    identical on every rank (each is the slowest rank's)."""
    from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer
    from vllm_moe_fixes.ops.fp8_quant import per_token_group_quant_fp8

    device = torch.device("cpu") if args.smoke else torch.device("cuda", rank)
    h, k = args.hidden, 8
    ht_tokens, ll_tokens, ll_experts = (4096, 128, 32) if not args.smoke else (64, 8, 8 * world)
    results = {}

    # High-throughput.
    buf = TorchAll2AllBuffer(None)
    ids, w = _routing(ht_tokens, args.ht_experts, k, device, rank)
    x = torch.randn(ht_tokens, h, device=device).to(torch.bfloat16)
    xq = per_token_group_quant_fp8(x, 128)
    layout = buf.get_dispatch_layout(ids, args.ht_experts)[:4]
    kw = dict(num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1],
              num_tokens_per_expert=layout[2], is_token_in_rank=layout[3], topk_idx=ids, topk_weights=w)
    recv, _, _, _, handle, _ = buf.dispatch(x, **kw)
    recv_rows = torch.tensor([recv.shape[0]], device=device)
    dist.all_reduce(recv_rows)
    rows = int(recv_rows) / world  # mean received rows per rank
    for name, fn, row_bytes in (
            ("ht_dispatch_fp8", lambda: buf.dispatch(xq, **kw), h + h // 128 * 4),
            ("ht_dispatch_bf16", lambda: buf.dispatch(x, **kw), 2 * h),
            ("ht_combine", lambda: buf.combine(recv, handle), 2 * h)):
        us = _time_us(fn, args.iters, device)
        results[name] = {"us": us, "GBps": rows * row_bytes / (us * 1e-6) / 1e9}

    # Low-latency.
    ll = TorchAll2AllBuffer(None, low_latency_mode=True, num_max_dispatch_tokens_per_rank=ll_tokens,
                            hidden=h, num_experts=ll_experts)
    ids, w = _routing(ll_tokens, ll_experts, k, device, 100 + rank)
    x = torch.randn(ll_tokens, h, device=device).to(torch.bfloat16)
    recv, _, handle, _, _ = ll.low_latency_dispatch(x, ids, ll_tokens, ll_experts)
    y = torch.randn(recv[0].shape, device=device).to(torch.bfloat16)
    selections = ll_tokens * k
    for name, fn, msg_bytes in (
            ("ll_dispatch_fp8", lambda: ll.low_latency_dispatch(x, ids, ll_tokens, ll_experts), h + h // 128 * 4 + 16),
            ("ll_combine", lambda: ll.low_latency_combine(y, ids, w, handle), 2 * h)):
        us = _time_us(fn, args.iters, device)
        results[name] = {"us": us, "GBps": selections * msg_bytes / (us * 1e-6) / 1e9}
    return results if rank == 0 else None


def _report(results, world, args, path):
    """Print the table and (not --smoke) write the JSON."""
    rows = []
    for name, r in results.items():
        ref = DEEPEP_EP2.get(name) if world == 2 and not args.smoke else None
        rows.append({"op": name, "us": r["us"], "GB/s": r["GBps"],
                     "DeepEP EP2 us": ref[0] if ref else "", "DeepEP EP2 GB/s": (ref[1] or "") if ref else ""})
    print(f"naive all-to-all (TorchAll2AllBuffer), world size {world}, H={args.hidden}, top-8, "
          f"HT experts {args.ht_experts}")
    print_table(rows, ["op", "us", "GB/s", "DeepEP EP2 us", "DeepEP EP2 GB/s"])
    if not args.smoke:
        write_json(path, {"world_size": world, "hidden": args.hidden, "ht_experts": args.ht_experts,
                          "results": results, "deepep_v1_2_1_ep2": DEEPEP_EP2,
                          "deepep_published_h800": {"ht_ep8_dispatch_GBps": 153, "ht_ep8_combine_GBps": 158,
                                                    "ll_ep8_dispatch_us": 77, "ll_ep8_combine_us": 114}})


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ht-experts", type=int, default=256)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on gloo/CPU (checks the script)")
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.ht_experts, args.iters = 2048, 8 * args.world_size, 2
    elif torch.cuda.device_count() < args.world_size:
        p.error(f"--world-size {args.world_size} needs that many GPUs; {torch.cuda.device_count()} visible")
    name = f"all2all_ws{args.world_size}" + ("" if args.ht_experts == 256 else f"_e{args.ht_experts}")
    # One process per GPU (NCCL, spawned; NCCL_NVLS_ENABLE=0 in each) or gloo ranks with --smoke.
    results = run_distributed(_bench, args.world_size, args, backend="gloo" if args.smoke else "nccl")
    _report(results[0], args.world_size, args, name)


if __name__ == "__main__":
    main()
