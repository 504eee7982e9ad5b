"""``vllm-moe-fixes bench``: run the benchmark modules of a source checkout's ``benchmarks/`` (on
a GPU), one log per area, and draw ``benchmarks/results/*.json`` as plots."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from vllm_moe_fixes.cli._common import UsageError, import_torch

HELP = "run benchmarks/ (GPU) and plot benchmarks/results/*.json"
# bench area -> module of the benchmarks package, run as ``python -m benchmarks.<module>``.
BENCH_AREAS = {"quant": "bench_quant", "moe_sum": "bench_moe_sum",
               "grouped_gemm": "bench_grouped_gemm", "experts": "bench_experts",
               "grouped_topk": "bench_grouped_topk", "all2all": "bench_all2all",
               "skew_bound": "bench_skew_bound"}
# The bench directory's module that draws the results (``python -m <package>.plots DIR``).
PLOTS_MODULE = "plots"


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--only", choices=sorted(BENCH_AREAS), default=None)
    b.add_argument("--plot-only", action="store_true", help="only draw plots from existing JSON")
    b.add_argument("--dir", default=None, help="benchmarks package directory (default: the "
                   "checkout's); its modules run with its parent as the working directory")


def _benchmarks_dir(arg: str | None) -> Path:
    path = Path(arg) if arg else Path(__file__).resolve().parents[2] / "benchmarks"
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


def run(args: argparse.Namespace) -> int:
    bench_dir = _benchmarks_dir(args.dir)
    failed = []
    if not args.plot_only:
        torch = import_torch("bench")
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

