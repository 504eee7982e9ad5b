"""Shared helpers of the benchmarks (modules run from the repo root, e.g.
`python -m benchmarks.bench_quant`; import these as `from benchmarks._common import ...`).

API (keep it small):
    bench_us(fn, arg_sets, warmup=25, rep=100) -> float
        Median time of fn(*args) in microseconds (triton.testing.do_bench, return_mode="median",
        which triton 3.6 and 3.9 both accept; do_bench also flushes L2 before every call).
        fn is called with the argument tuples of `arg_sets` in rotation.
    graph_us(fn, arg_sets, calls=16, warmup=5, rep=100) -> float
        Time per call under CUDA-graph replay (how engines run decode): one graph of `calls`
        calls of fn, rotating through arg_sets, is captured once; its replay is timed like
        bench_us and divided by `calls`. Host time drops out; launch gaps between kernels stay.
    host_us(fn, arg_sets, calls=200) -> float
        Host time per call: wall time of `calls` back-to-back calls with the GPU left to run
        behind (no sync inside the timed loop; best of 5). When it exceeds the kernel time,
        eager timings (bench_us) measure the host, not the GPU.
    rotating(make, nbytes, budget=256 << 20, max_sets=16) -> list
        [make(0), make(1), ...]: enough independent input sets (each of about `nbytes`) to
        cover `budget` bytes, so small shapes are not timed from a warm L2 (H200 L2: 50 MB).
    gbps(nbytes, us) -> float            bytes moved / time, in GB/s (1e9 bytes).
    copy_us(nbytes) -> float
        The copy ceiling: graph_us of one device copy of nbytes // 2 bytes (nbytes moved: read +
        write), for comparing a kernel that moves nbytes. Its buffers are freed on return.
    print_table(rows, columns) -> None   rows: list of dicts; columns: keys to print, in order.
    print_best(rows, title, n=8, key="M", by="us") -> None
        A sweep's summary: title, then for every value of rows' `key` (first-seen order) the `n`
        rows with the smallest `by`, as a print_table of all their columns.
    require_cuda(benchmark) -> None      exit "<benchmark> needs a CUDA GPU" (status 1, no
                                         traceback) where torch sees no GPU; call after parsing
                                         the arguments, so that --help works anywhere.
    write_json(name, payload) -> Path    benchmarks/results/<name>.json: payload plus
                                         "environment" (GPU name, torch/triton versions, UTC date,
                                         git commit when available).
"""

import itertools
import json
import time
from pathlib import Path

import torch
import triton
import triton.testing

from vllm_moe_fixes.sizes import cdiv
from vllm_moe_fixes.testing import run_environment as environment

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def require_cuda(benchmark: str) -> None:
    if not torch.cuda.is_available():
        raise SystemExit(f"{benchmark} needs a CUDA GPU")


def bench_us(fn, arg_sets, warmup=25, rep=100) -> float:
    cycle = itertools.cycle(arg_sets)
    ms = triton.testing.do_bench(lambda: fn(*next(cycle)), warmup=warmup, rep=rep,
                                 return_mode="median")
    return ms * 1e3


def graph_us(fn, arg_sets, calls=16, warmup=5, rep=100) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for args in arg_sets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*arg_sets[i % len(arg_sets)])
    ms = triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")
    del graph
    return ms * 1e3 / calls


def host_us(fn, arg_sets, calls=200) -> float:
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(calls):
            fn(*arg_sets[i % len(arg_sets)])
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def rotating(make, nbytes, budget=256 << 20, max_sets=16) -> list:
    n = max(1, min(max_sets, cdiv(budget, max(nbytes, 1))))
    return [make(i) for i in range(n)]


def gbps(nbytes, us) -> float:
    return nbytes / (us * 1e-6) / 1e9


def copy_us(nbytes) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = graph_us(dst.copy_, [(src,)])
    del src, dst
    return t


def print_best(rows, title, n=8, key="M", by="us") -> None:
    print(title)
    for value in dict.fromkeys(r[key] for r in rows):
        best = sorted((r for r in rows if r[key] == value), key=lambda r: r[by])[:n]
        print_table(best, list(best[0]))


def print_table(rows, columns) -> None:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) and abs(v) < 10 else (
            f"{v:.1f}" if isinstance(v, float) else str(v))
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c)
              for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def write_json(name, payload) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=2) + "\n")
    print(f"wrote {path}")
    return path
