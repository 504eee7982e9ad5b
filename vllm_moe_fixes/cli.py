"""``vllm-moe-fixes``: check the install, plan a DP/EP configuration, run one MoE layer, benchmark.

    vllm-moe-fixes check                       versions, GPU, optional libraries, env, backends
    vllm-moe-fixes plan --model deepseek-r1 --dp 32 [--ep N] [--max-tokens T] [--backend B] [--json]
    vllm-moe-fixes demo [--world-size N] [--tokens M] [--seed S]   one layer vs the reference
    vllm-moe-fixes bench [--only AREA] [--plot-only]              benchmarks/ modules + PNG plots

Also ``python -m vllm_moe_fixes``. Exit status: 0 success, 1 a failed demo (a wrong result, or an
error while running the layer on any rank) or benchmark, 2 a bad argument or environment value, or a
backend the environment asks for that cannot run (found before anything runs), 141 the reader of
the output went away (``plan ... | head``): what a shell reports for a command SIGPIPE ended,
without a traceback. Integer arguments are decimal digits only, as environment values are.
Heavy imports (torch, Triton, the kernels) happen inside the subcommand that needs them: without
torch, plan runs, check reports it missing (status 2) and demo and bench refuse (status 2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

from vllm_moe_fixes import envs
from vllm_moe_fixes.sizes import SCALE_BLOCK

DEMO_TOLERANCE = 4e-3
# bench area -> module of the benchmarks package, run as ``python -m benchmarks.<module>``.
BENCH_AREAS = {"quant": "bench_quant", "moe_sum": "bench_moe_sum",
               "grouped_gemm": "bench_grouped_gemm", "experts": "bench_experts",
               "grouped_topk": "bench_grouped_topk", "all2all": "bench_all2all",
               "skew_bound": "bench_skew_bound"}
# Exit status after the output's reader went away: 128 + SIGPIPE, as a shell reports it.
EXIT_BROKEN_PIPE = 141
TORCH_INSTALL = ("pip install torch (on a GPU machine, the CUDA build that matches its driver; "
                 "see the README's set-up)")
DEMO_EXPERTS = 16  # --experts when neither it nor --model is given
# The bench directory's module that draws the results (``python -m <package>.plots DIR``).
PLOTS_MODULE = "plots"


class UsageError(Exception):
    """A problem with the arguments or the environment: printed, exit status 2."""


# ------------------------------------------------------------------------------ argument types
# argparse reports a type's ArgumentTypeError as "argument --flag: <message>", exit status 2.
def int_at_least(minimum: int, maximum: int | None = None):
    """An argparse type: a decimal integer in [minimum, maximum] (digits only, like env values)."""
    allowed = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")

    def parse(text: str) -> int:
        try:
            value = envs.parse_decimal(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    parse.__name__ = allowed  # argparse names the type in some messages
    return parse


_DECIMAL_FLOAT = re.compile(r"\s*(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")


def positive_float(text: str) -> float:
    """An argparse type: a finite decimal number > 0 (no inf, nan, sign or ``_``)."""
    value = float(text) if _DECIMAL_FLOAT.fullmatch(text) else math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


SEED = int_at_least(0, 2**64 - 1)  # the range torch.Generator.manual_seed takes


# ------------------------------------------------------------------------------------------ check
def _version(module_name: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(module_name.replace("_", "-"))
    except metadata.PackageNotFoundError:
        return "version unknown"


def _optional(name: str) -> tuple[bool, str]:
    """(available, description) of an optional library through its _compat module."""
    import importlib
    try:
        compat = importlib.import_module(f"vllm_moe_fixes._compat.{name}")
    except ImportError as e:
        return False, f"cannot tell (vllm_moe_fixes._compat.{name} missing: {e})"
    if compat.is_available():
        mod = sys.modules.get(name)
        return True, f"available ({getattr(mod, '__version__', None) or _version(name)})"
    return False, "not installed"


def _deep_ep_generation() -> str:
    from vllm_moe_fixes._compat import deep_ep as deep_ep_compat
    return deep_ep_compat.describe()


def _import_torch(command: str):
    """The torch module, or UsageError saying that ``command`` needs it and how to install it."""
    try:
        import torch
    except ImportError as e:
        raise UsageError(f"{command} needs torch, which is not installed ({e}): {TORCH_INSTALL}") \
            from None
    return torch


def cmd_check(args: argparse.Namespace) -> int:
    problems = []
    print(f"{'python':<10}{platform.python_version()} ({sys.executable})")
    try:
        import torch
    except ImportError as e:  # check exists to diagnose installs: say it and go on
        torch = None
        print(f"{'torch':<10}not installed ({e})")
        problems.append(f"torch is not installed: no layer can run without it; {TORCH_INSTALL}")
    else:
        print(f"{'torch':<10}{torch.__version__}")
    cuda = torch is not None and torch.cuda.is_available()
    try:
        import triton
        print(f"{'triton':<10}{triton.__version__}")
    except ImportError as e:
        print(f"{'triton':<10}not importable: {e}")
        problems.append("triton does not import: the Triton kernels cannot run on a GPU")
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"{'gpu ' + str(i):<10}{p.name}, sm_{p.major}{p.minor}, "
                  f"{p.total_memory / 2**30:.0f} GiB")
    elif torch is None:
        print(f"{'gpu':<10}unknown (torch, which finds GPUs, is not installed)")
    else:
        print(f"{'gpu':<10}none (CPU tensors run the torch reference of every op)")
    has_ep, ep_text = _optional("deep_ep")
    has_gemm, gemm_text = _optional("deep_gemm")
    print(f"{'deep_ep':<10}{ep_text}" + (f": {_deep_ep_generation()}" if has_ep else ""))
    print(f"{'deep_gemm':<10}{gemm_text}")

    print("\nenvironment variables (effective values):")
    values = {}
    for name, var in envs.REGISTRY.items():
        try:
            values[name] = var.read()
            shown = repr(values[name])
        except ValueError as e:
            shown = f"ERROR: {e}"
            problems.append(str(e))
        print(f"  {name} = {shown}    [{var.allowed}; default {var.default!r}] {var.help}")

    print("\nwhat would run:")
    if "VLLM_USE_DEEP_GEMM" in values:
        if not values["VLLM_USE_DEEP_GEMM"]:
            print("  experts: TritonExperts / BatchedTritonExperts (grouped FP8 GEMM in Triton"
                  + (")" if cuda else "; torch reference on CPU)"))
        elif has_gemm:
            print("  experts: DeepGemmExperts / BatchedDeepGemmExperts (TritonExperts for shapes "
                  f"whose I or K is not a multiple of {SCALE_BLOCK})")
        else:
            print("  experts: none: VLLM_USE_DEEP_GEMM=1 but DeepGEMM is not importable")
            problems.append("VLLM_USE_DEEP_GEMM=1 but DeepGEMM is not importable: build it from "
                            "source or set VLLM_USE_DEEP_GEMM=0")
    backend = values.get("VLLM_ALL2ALL_BACKEND")
    if backend == "naive":
        print("  all-to-all: naive (TorchAll2AllBuffer on torch.distributed: NCCL on GPUs, gloo on "
              "CPU) with the high-throughput prepare/finalize; none on a single rank")
    elif backend is not None:
        from vllm_moe_fixes._compat import deep_ep as deep_ep_compat
        mode = {"deepep_high_throughput": "v1.2.1 high-throughput (deep_ep.Buffer)",
                "deepep_low_latency": "v1.2.1 low-latency (deep_ep.Buffer)",
                "deepep_v2": "V2 (deep_ep.ElasticBuffer)"}[backend]
        try:
            deep_ep_compat.require(backend)  # the generation this backend needs
            print(f"  all-to-all: DeepEP {mode}; none on a single rank")
        except ImportError as e:
            print(f"  all-to-all: none: {e}")
            problems.append(str(e))
    if problems:
        print("\nproblems:", *(f"  - {p}" for p in problems), sep="\n")
        return 2
    print("\nok")
    return 0


# ------------------------------------------------------------------------------------------- plan
def cmd_plan(args: argparse.Namespace) -> int:
    from vllm_moe_fixes.config import load_model_config
    from vllm_moe_fixes.planner import format_plan, make_plan

    try:
        cfg = load_model_config(args.model)
        plan = make_plan(cfg, dp=args.dp, ep=args.ep, max_tokens=args.max_tokens,
                         backend=args.backend, gpu_memory_gib=args.gpu_memory_gib, seed=args.seed)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(json.dumps(plan, indent=1) if args.json else format_plan(plan))
    return 0


# ------------------------------------------------------------------------------------------- demo
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


def cmd_demo(args: argparse.Namespace) -> int:
    torch = _import_torch("demo")
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


# ------------------------------------------------------------------------------------------ bench
def _benchmarks_dir(arg: str | None) -> Path:
    path = Path(arg) if arg else Path(__file__).resolve().parent.parent / "benchmarks"
    if not path.is_dir():
        raise UsageError(f"no benchmarks directory at {path}: bench runs the benchmark modules of "
                         "a source checkout (pass --dir)")
    return path


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    fill = width * done // total if total else width
    print(f"[{'#' * fill}{'-' * (width - fill)}] {done}/{total} {label}", flush=True)


def _plot(bench_dir: Path) -> bool:
    """Run the bench directory's plots module on its results (one PNG per JSON, where matplotlib
    is installed); returns whether it succeeded."""
    if not (bench_dir / f"{PLOTS_MODULE}.py").is_file():
        print(f"  no {PLOTS_MODULE}.py in {bench_dir}: no plots")
        return True
    command = [sys.executable, "-m", f"{bench_dir.name}.{PLOTS_MODULE}",
               str(bench_dir / "results")]
    return subprocess.run(command, cwd=bench_dir.parent, check=False).returncode == 0


def _bench_command(area: str, package: str, num_gpus: int) -> list[str]:
    """The command line of one area's benchmark module (all-to-all over 2 GPUs where there are)."""
    command = [sys.executable, "-m", f"{package}.{BENCH_AREAS[area]}"]
    if area == "all2all" and num_gpus >= 2:
        command += ["--world-size", "2"]
    return command


def cmd_bench(args: argparse.Namespace) -> int:
    bench_dir = _benchmarks_dir(args.dir)
    failed = []
    if not args.plot_only:
        torch = _import_torch("bench")
        if not torch.cuda.is_available():
            raise UsageError("bench needs a CUDA GPU: the benchmarks time the Triton kernels on "
                             "the device (use --plot-only to draw plots from existing results)")
        areas = [args.only] if args.only else list(BENCH_AREAS)
        missing = [a for a in areas if not (bench_dir / f"{BENCH_AREAS[a]}.py").is_file()]
        if args.only and missing:  # the one area asked for must run: refuse before starting
            raise UsageError(f"--only {args.only}: {BENCH_AREAS[args.only]}.py not found in "
                             f"{bench_dir}")
        for a in missing:  # a checkout missing a benchmark: that area failed
            print(f"  {a}: {BENCH_AREAS[a]}.py not found in {bench_dir}: FAILED")
        failed += missing
        areas = [a for a in areas if a not in missing]
        (bench_dir / "results").mkdir(exist_ok=True)
        for i, area in enumerate(areas):
            command = _bench_command(area, bench_dir.name, torch.cuda.device_count())
            _progress(i, len(areas), f"running {' '.join(command[1:])}")
            log = bench_dir / "results" / f"{BENCH_AREAS[area]}.log"
            start = time.perf_counter()
            with open(log, "w") as f:
                rc = subprocess.run(command, cwd=bench_dir.parent, stdout=f,
                                    stderr=subprocess.STDOUT, check=False).returncode
            status = "ok" if rc == 0 else f"FAILED (exit {rc})"
            seconds = time.perf_counter() - start
            print(f"  {BENCH_AREAS[area]}: {status} in {seconds:.0f} s, log {log}")
            if rc:
                failed.append(area)
                print("    " + "\n    ".join(log.read_text().splitlines()[-10:]))
        _progress(len(areas), len(areas), "done")
    sys.stdout.flush()  # the plots module writes to the same stdout
    if not _plot(bench_dir):
        failed.append("plots")
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    from vllm_moe_fixes.distributed.deepep_sizing import LL_SUPPORTED_HIDDEN
    from vllm_moe_fixes.planner import DEFAULT_GPU_MEMORY_GIB

    parser = argparse.ArgumentParser(prog="vllm-moe-fixes", description=(
        "Check the install, plan a DP/EP configuration, run one MoE layer, benchmark."))
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("check", help="versions, GPU, optional libraries, env values, backends")

    p = sub.add_parser("plan", help="expert load, memory and DeepEP buffers of a DP/EP dummy run")
    p.add_argument("--model", required=True, help="preset name or a JSON file of the same fields")
    p.add_argument("--dp", type=int_at_least(1), required=True, help="data-parallel ranks")
    p.add_argument("--ep", type=int_at_least(1), default=None,
                   help="ranks per EP group (default: --dp)")
    p.add_argument("--max-tokens", type=int_at_least(1), default=None,
                   help="dummy tokens per rank (default VLLM_MOE_DP_CHUNK_SIZE)")
    p.add_argument("--backend", default=None, choices=envs.ALL2ALL_BACKENDS,
                   help="all-to-all backend (default VLLM_ALL2ALL_BACKEND)")
    p.add_argument("--gpu-memory-gib", type=positive_float, default=DEFAULT_GPU_MEMORY_GIB,
                   help="memory per GPU for the OOM flag (default %(default)s)")
    p.add_argument("--seed", type=SEED, default=0, help="routing simulation seed")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    d = sub.add_parser("demo", help="one MoE layer through the modular kernel, checked")
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

    b = sub.add_parser("bench", help="run benchmarks/ (GPU) and plot benchmarks/results/*.json")
    b.add_argument("--only", choices=sorted(BENCH_AREAS), default=None)
    b.add_argument("--plot-only", action="store_true", help="only draw plots from existing JSON")
    b.add_argument("--dir", default=None, help="benchmarks package directory (default: the "
                   "checkout's); its modules run with its parent as the working directory")
    return parser


COMMANDS = {"check": cmd_check, "plan": cmd_plan, "demo": cmd_demo, "bench": cmd_bench}


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit raises no second BrokenPipeError."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a non-file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default sys.argv[1:]); returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a bad argument (2), already printed
        return e.code if isinstance(e.code, int) else 2
    try:
        status = COMMANDS[args.command](args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at exit
        return status
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (``| head``): nothing more to say to it
        _silence_stdout()
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
