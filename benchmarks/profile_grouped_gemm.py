"""One call each of the Triton grouped GEMM (default config; and promoting per 128 of K) and
DeepGEMM's on one shape, for a profiler (Nsight Compute) to read their counters side by side.

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
        --section ComputeWorkloadAnalysis python -m benchmarks.profile_grouped_gemm

Each GEMM runs twice (the first compiles and warms up); bench_grouped_gemm times them.
"""

import argparse

import torch

from benchmarks.bench_grouped_gemm import make_inputs
from vllm_moe_fixes._compat import deep_gemm as dg
from vllm_moe_fixes.ops.grouped_gemm import grouped_fp8_gemm_contiguous_triton


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=[8, 1024, 4096, 7168],
                        metavar=("GROUPS", "ROWS", "N", "K"))
    groups, rows, N, K = parser.parse_args().shape
    a, w, m_idx = make_inputs(groups, rows, N, K)
    out = torch.empty(groups * rows, N, device="cuda", dtype=torch.bfloat16)
    calls = {"triton": lambda: grouped_fp8_gemm_contiguous_triton(a, w, out, m_idx),
             "triton_promote_128": lambda: grouped_fp8_gemm_contiguous_triton(
                 a, w, out, m_idx, {"IMPRECISE_ACC": 0})}
    if dg.is_available():
        calls["deep_gemm"] = lambda: dg.m_grouped_fp8_gemm_nt_contiguous(a, w, out, m_idx)
    for name, call in calls.items():
        for _ in range(2):
            call()
        torch.cuda.synchronize()
        print(f"ran {name}")


if __name__ == "__main__":
    main()
