"""``vllm-moe-fixes demo``: one MoE layer through the modular kernel on one rank or an
expert-parallel group of processes (NCCL on GPUs, gloo on CPU), checked against moe_reference.
Arguments and environment are validated before anything runs (exit status 2); a wrong result or
an error on any rank is exit status 1."""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from vllm_moe_fixes import envs
from vllm_moe_fixes.cli._common import SEED, UsageError, import_torch, int_at_least
from vllm_moe_fixes.sizes import SCALE_BLOCK

HELP = "one MoE layer through the modular kernel, checked"
DEMO_TOLERANCE = 4e-3
DEMO_EXPERTS = 16  # --experts when neither it nor --model is given


def add_arguments(d: argparse.ArgumentParser) -> None:
    from vllm_moe_fixes.distributed.deepep_sizing import LL_SUPPORTED_HIDDEN

    d.add_argument("--world-size", type=int_at_least(1), default=1, help="EP ranks (processes)")
    d.add_argument("--tokens", type=int_at_least(1), default=64, help="tokens per rank")
    d.add_argument("--hidden", type=int_at_least(SCALE_BLOCK), default=1024,
                   help=f"K, a multiple of {SCALE_BLOCK} (with --low-latency, one of DeepEP's "
                   f"low-latency hidden sizes: {', '.join(map(str, LL_SUPPORTED_HIDDEN))})")
    d.add_argument("--intermediate", type=int_at_least(SCALE_BLOCK), default=256,
                   help=f"I, a multiple of {SCALE_BLOCK}")
    d.add_argument("--experts", type=int_at_least(1), default=None,
                   help=f"E (global; default {DEMO_EXPERTS})")
    d.add_argument("--topk", type=int_at_least(1), default=4, help="k")
    d.add_argument("--model", default=None, help="route as this preset (or JSON model file) "
                   "does: its experts, top-k and router (DeepSeek presets: grouped_topk); "
                   "overrides --experts and --topk")
    d.add_argument("--seed", type=SEED, default=0)
    d.add_argument("--reps", type=int_at_least(0), default=5, help="timed calls after the first")
    d.add_argument("--backend", default=None, choices=envs.ALL2ALL_BACKENDS,
                   help="all-to-all backend for --world-size > 1 (default VLLM_ALL2ALL_BACKEND)")
    d.add_argument("--low-latency", action="store_true", help="low-latency dispatch (batched "
                   "experts) with the naive backend; implied by deepep_low_latency; needs a "
                   "DeepEP low-latency --hidden")
    d.add_argument("--cpu", action="store_true", help="run on CPU even where GPUs exist")


def _demo_problem(args: argparse.Namespace, num_tokens: int):
    """The global problem, identical on every rank: (x bf16 [T, K], (w1q, w1s), (w2q, w2s),
    topk_weights f32 [T, k], topk_ids int64 [T, k]) on the CPU, from args.seed."""
    import torch

    from vllm_moe_fixes.fused_moe.grouped_topk import grouped_topk
    from vllm_moe_fixes.fused_moe.routing import fused_topk
    from vllm_moe_fixes.testing import random_fp8_moe_weights

    K, I, E = args.hidden, args.intermediate, args.experts
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(num_tokens, K, generator=g).to(torch.bfloat16)
    w1q, w1s, w2q, w2s = random_fp8_moe_weights(E, K, I, generator=g)
    logits = torch.randn(num_tokens, E, generator=g)
    cfg = args.routing
    if cfg is not None and (cfg.n_group > 1 or cfg.scoring == "sigmoid"):
        # DeepSeek-V3/R1 routing; the random bias stands in for the trained
        # e_score_correction_bias so that the biased choice is exercised too.
        bias = torch.randn(E, generator=g) / 8
        topk_weights, topk_ids = grouped_topk(
            logits, args.topk, renormalize=True, num_expert_group=cfg.n_group,
            topk_group=cfg.topk_group, scoring_func=cfg.scoring, e_score_correction_bias=bias,
            routed_scaling_factor=cfg.routed_scaling_factor)
    else:
        topk_weights, topk_ids = fused_topk(logits, args.topk, True)
    return x, (w1q, w1s), (w2q, w2s), topk_weights, topk_ids


def _time_calls(fn, device, reps: int):
    """(seconds of a first call, [seconds of each of ``reps`` more], the last result), timed with
    device synchronisation."""
    import torch

    def once():
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start, out

    first, out = once()
    return first, [once()[0] for _ in range(reps)], out


def _run_layer(args: argparse.Namespace, rank: int, world_size: int, device) -> dict:
    """Build and run the layer for one rank; returns its measurements (and the check)."""
    import torch

    from vllm_moe_fixes._memory import peak_memory
    from vllm_moe_fixes.fused_moe.kernel_factory import local_expert_map, make_moe_kernel
    from vllm_moe_fixes.testing import calc_diff, moe_reference

    M, E = args.tokens, args.experts
    x, (gw1q, gw1s), (gw2q, gw2s), weights, ids = _demo_problem(args, M * world_size)
    mine = slice(rank * M, (rank + 1) * M)
    x, weights, ids = x[mine], weights[mine], ids[mine]
    # The reference sees every expert (the global weights) and this rank's tokens.
    ref = moe_reference(x, gw1q, gw2q, weights, ids, w1_scale=gw1s, w2_scale=gw2s)
    local_num_experts = E // world_size
    local = slice(rank * local_num_experts, (rank + 1) * local_num_experts)
    w1q, w1s, w2q, w2s = (t[local].contiguous() for t in (gw1q, gw1s, gw2q, gw2s))
    ep_group = _demo_ep_group(world_size)
    kernel = make_moe_kernel(ep_group, hidden_size=args.hidden, intermediate_size=args.intermediate,
                             num_experts=E, max_tokens_per_rank=M, backend=_demo_backend(args),
                             low_latency=_demo_low_latency(args))
    tensors = [t.to(device) for t in (x, w1q, w2q, weights, ids, w1s, w2s)]
    x, w1q, w2q, weights, ids, w1s, w2s = tensors
    expert_map = local_expert_map(ep_group, E, device)

    def call():
        return kernel(x, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s,
                      global_num_experts=E, expert_map=expert_map)

    with peak_memory(device) as measured:
        first, times, out = _time_calls(call, device, args.reps)
    if measured.bytes is not None:
        peak = f"{measured.bytes / 2**20:.1f} MiB over inputs and weights"
    else:  # the CPU allocator keeps no peak: the process's high-water mark instead
        import resource
        peak = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB process RSS"
    out = out.float().cpu()
    median = sorted(times)[len(times) // 2] * 1e3 if times else None
    return {"rank": rank, "diff": calc_diff(out, ref),
            "max_abs_err": float((out - ref).abs().max()), "first_ms": first * 1e3,
            "median_ms": median,
            "peak": peak, "prepare_finalize": type(kernel.prepare_finalize).__name__,
            "experts": type(kernel.experts).__name__, "all2all": _demo_all2all(args, world_size),
            "ran": _what_ran(kernel.experts, device), "finite": bool(torch.isfinite(out).all())}


def _what_ran(experts, device) -> str:
    """The ops that computed the demo's layer, as printed: the experts class alone does not say
    it (CPU tensors take the torch reference path of every op)."""
    from vllm_moe_fixes.fused_moe.batched_experts import BatchedDeepGemmExperts
    from vllm_moe_fixes.fused_moe.contiguous_experts import DeepGemmExperts

    if device.type != "cuda":
        return "the torch reference of every op (CPU tensors; CUDA tensors run the Triton kernels)"
    gemms = "DeepGEMM's" if isinstance(experts, (DeepGemmExperts, BatchedDeepGemmExperts)) \
        else "Triton"
    return f"the Triton kernels, with {gemms} grouped FP8 GEMMs"


def _demo_ep_group(world_size: int):
    """The demo's expert-parallel group: every process of the run, or None on one rank."""
    if world_size == 1:
        return None
    import torch.distributed as dist
    return dist.group.WORLD


def _demo_all2all(args: argparse.Namespace, world_size: int) -> str:
    """The all-to-all the demo runs, as printed."""
    if world_size == 1:
        return "none"
    mode = "low-latency" if _demo_low_latency(args) else "high-throughput"
    return f"{_demo_backend(args)} ({mode} mode)"


def _demo_backend(args: argparse.Namespace) -> str:
    return args.backend or envs.VLLM_ALL2ALL_BACKEND


def _demo_low_latency(args: argparse.Namespace) -> bool:
    return _demo_backend(args) == "deepep_low_latency" or args.low_latency


def _demo_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    """One rank of ``demo --world-size N`` (run by ``run_distributed``, the group joined): run the
    layer on this rank's GPU (NCCL) or the CPU (gloo) and return its measurements. An exception
    propagates: the launcher prints it and fails the whole run."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank) if nccl else torch.device("cpu")
    return _run_layer(args, rank, world_size, device)


def _apply_demo_model(args: argparse.Namespace) -> None:
    """With --model, the preset's routing: its experts, top-k and router (grouped_topk for
    DeepSeek's sigmoid / grouped routing); the layer keeps --hidden and --intermediate."""
    args.routing = None
    if args.model is None:
        if args.experts is None:
            args.experts, args.experts_from = DEMO_EXPERTS, "the default of --experts"
        else:
            args.experts_from = "from --experts"
        return
    from vllm_moe_fixes.config import load_model_config
    try:
        cfg = load_model_config(args.model)
    except ValueError as e:
        raise UsageError(f"--model: {e}") from None
    args.routing, args.experts, args.topk = cfg, cfg.num_experts, cfg.top_k
    args.experts_from = f"from --model {args.model}"


def _validate_demo(args: argparse.Namespace, use_cuda: bool) -> None:
    """Raise UsageError (exit 2, nothing started) for bad arguments, bad environment values, and
    backends or sizes that cannot run here."""
    from vllm_moe_fixes._compat import deep_ep, deep_gemm
    from vllm_moe_fixes.distributed.deepep_sizing import (
        LL_SUPPORTED_HIDDEN,
        check_low_latency_config,
        deepep_nvl_bytes,
    )

    try:
        envs.current_values()
    except ValueError as e:
        raise UsageError(str(e)) from None
    # The argument types have checked each number's range; these are the rules between them.
    checks = [(args.hidden % SCALE_BLOCK == 0,
               f"--hidden must be a multiple of {SCALE_BLOCK}, got {args.hidden}"),
              (args.intermediate % SCALE_BLOCK == 0,
               f"--intermediate must be a multiple of {SCALE_BLOCK}, got {args.intermediate}"),
              (args.experts % args.world_size == 0,
               f"E={args.experts} experts ({args.experts_from}) must be a multiple of "
               f"--world-size ({args.world_size})"),
              (args.topk <= args.experts,
               f"--topk must be <= E={args.experts} ({args.experts_from}), got {args.topk}")]
    for ok, message in checks:
        if not ok:
            raise UsageError(message)
    backend, n = _demo_backend(args), args.world_size
    if args.low_latency and backend == "deepep_high_throughput":
        raise UsageError("--low-latency needs the naive or deepep_low_latency backend")
    if envs.VLLM_USE_DEEP_GEMM and not deep_gemm.is_available():
        raise UsageError("VLLM_USE_DEEP_GEMM=1 but DeepGEMM is not importable: build it from "
                         "source or set VLLM_USE_DEEP_GEMM=0")
    if n == 1 and args.low_latency:
        raise UsageError("--low-latency selects the expert-parallel low-latency dispatch: it needs "
                         "--world-size >= 2 (one rank runs without an all-to-all)")
    if n == 1:
        return  # no all-to-all: the backend plays no part
    if backend != "naive":
        if not deep_ep.is_available():
            raise UsageError(f"backend {backend} needs DeepEP, which is not importable: build it "
                             "from source or use the naive backend")
        if not use_cuda:
            raise UsageError(f"backend {backend} runs on GPUs only: use the naive backend on CPU")
    if _demo_low_latency(args) and args.hidden not in LL_SUPPORTED_HIDDEN:
        raise UsageError(f"--low-latency needs --hidden to be a DeepEP low-latency hidden size "
                         f"({', '.join(map(str, LL_SUPPORTED_HIDDEN))}), got {args.hidden}")
    try:
        if _demo_low_latency(args):
            check_low_latency_config(args.tokens, args.hidden, n, args.experts)
        elif backend == "deepep_high_throughput":
            deepep_nvl_bytes(args.hidden, n)
    except ValueError as e:
        mode = "low-latency" if _demo_low_latency(args) else "high-throughput"
        raise UsageError(f"{backend} ({mode} mode) cannot run --tokens {args.tokens} --hidden "
                         f"{args.hidden} --experts {args.experts} --world-size {n}: {e}") from None


def run(args: argparse.Namespace) -> int:
    torch = import_torch("demo")
    n = args.world_size
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= n and not args.cpu
    _apply_demo_model(args)
    _validate_demo(args, use_cuda)
    where = (f"{n} GPU(s), NCCL" if n > 1 else "GPU") if use_cuda else (
        f"{n} CPU processes, gloo" if n > 1 else "CPU")
    routing = "" if args.routing is None else f", routed as {args.routing.name}"
    print(f"demo: one MoE layer, K={args.hidden} I={args.intermediate} E={args.experts} "
          f"top-{args.topk}{routing}, {args.tokens} tokens per rank, world size {n} on {where}")
    try:
        if n == 1:
            results = [_run_layer(args, 0, 1, torch.device("cuda" if use_cuda else "cpu"))]
        else:
            from vllm_moe_fixes.distributed.launch import run_distributed
            results = run_distributed(_demo_rank, n, args, backend="nccl" if use_cuda else "gloo")
    except Exception as e:  # noqa: BLE001 -- a failed run is a failed demo: exit 1, with the error
        if n == 1:
            traceback.print_exc()
        # a rank's error carries its whole traceback: its last line says what failed
        lines = str(e).strip().splitlines()
        print(f"demo FAILED: {type(e).__name__}: {lines[-1] if lines else ''}"
              + (" (each failing rank printed its traceback above)" if n > 1 else ""),
              file=sys.stderr)
        print("check vs moe_reference: FAIL (the layer did not run)")
        return 1
    r0 = results[0]
    print(f"  path: {r0['prepare_finalize']} + {r0['experts']}, all-to-all: {r0['all2all']}")
    print(f"  ran: {r0['ran']}")
    worst = max(results, key=lambda r: r["diff"])
    ok = all(r["diff"] < DEMO_TOLERANCE and r["finite"] for r in results)
    for r in results:
        med = "no repeats" if r["median_ms"] is None else \
            f"{r['median_ms']:.2f} ms median of {args.reps}"
        print(f"  rank {r['rank']}: calc_diff {r['diff']:.2e}, max abs err {r['max_abs_err']:.3g}, "
              f"time {r['first_ms']:.1f} ms first call, {med}; peak {r['peak']}")
    print(f"check vs moe_reference: calc_diff {worst['diff']:.2e} "
          f"{'<' if ok else 'NOT <'} {DEMO_TOLERANCE:g}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1

