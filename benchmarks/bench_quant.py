"""Benchmark per_token_group_quant_fp8 (group 128, bf16 input) and the fused
silu_and_mul_quant_fp8 on the GPU.

Run from the repo root:  python -m benchmarks.bench_quant [--only quant|fused] [--sweep]

Quant: for each M in 1, 256, 4096, 16384, 65536 (K = 7168) it times, in the same run:
  us / GB/s            the public op, eager (do_bench; includes host time when the host is slower
                       than the kernel, which is the case at small M)
  graph_us / graph_GB/s  the public op under CUDA-graph replay (16 calls per graph, per call):
                       the kernel plus launch gaps, no host time; how engines run decode
  tma_us, tma_graph_us the same with the TMA-aligned column-major scales DeepGEMM wants
  launcher_us          the Triton launcher alone, eager (no validation or allocation)
  host_us, launcher_host_us  host time per call of the public op / the launcher (launch loop:
                       back-to-back calls, GPU left behind): Python + the launch path
  jit_us, jit_host_us  the kernel launched through Triton's `kernel[grid](...)` on every call
                       (the launch path before the cached launcher; do_bench / launch loop)
  torch_ref_us         the torch eager reference on the GPU
  torch_cast_us, torch_cast_host_us  a torch op that launches one kernel from C++ (the bf16 -> fp8
                       cast into the same output, q.copy_(x)): the host floor of an op that, like
                       vLLM's CUDA quant, is dispatched through torch (do_bench / launch loop)
  copy_us              (graph replay) a device-to-device copy moving the same number of bytes
                       (half read, half written: the bandwidth ceiling)
Bytes = input (M*K*2) + FP8 output (M*K) + scales (M*K/128*4). Writes
benchmarks/results/bench_quant.json.

Fused (SiLU-and-mul + requant between the expert GEMMs, 2N = 4096 as DeepSeek's I = 2048): the
contiguous layout at M_sum = 1024, 8192 + 8*128 and 65536 + 8*128 rows (M = 128, 1024, 8192
tokens, top-8, 8 experts, 128-row padding), and the batched layout [32, 128, 4096] with the
valid rows of 1, 32 and 128 tokens spread by top-8 routing. For each it times the fused op and
the two unfused ops (silu_and_mul, then per_token_group_quant_fp8 into MN-major scales; batched:
over the whole slices plus a copy of the scales, the way the unfused experts run them), eager
(do_bench), under graph replay, and their host time (launch loop). Bytes = x (rows*2I*2) +
q (rows*I) + scales (rows*I/128*4) over the valid rows. Writes
benchmarks/results/bench_silu_mul_quant.json.

--host-breakdown also times, at M = 1, each piece of the public op's host path on its own (launch
loop, per call: checks, the two allocations, the launch key, the device and stream queries, the
compiled kernel's launcher with data pointers and with tensors, Triton's JIT entry) and the small-M
kernel under a few launch configs (graph replay); writes benchmarks/results/bench_quant_host.json.

--sweep also times a grid of launch configs of each launcher (block_m x groups_per_prog x
num_warps; for the quant also the float32 grid rounding), prints the best and writes
benchmarks/results/bench_quant_sweep.json and bench_silu_mul_quant_sweep.json.
"""

import argparse
import functools
import itertools

import torch

from benchmarks._common import (
    bench_us,
    copy_us,
    gbps,
    graph_us,
    host_us,
    print_best,
    print_table,
    require_cuda,
    rotating,
    write_json,
)
from vllm_moe_fixes.ops import fp8_quant as fq
from vllm_moe_fixes.ops import triton_utils as tu
from vllm_moe_fixes.ops.activation import silu_and_mul
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, SCALE_BLOCK, empty_mn_major_scales
from vllm_moe_fixes.ops.fp8_quant import (
    QUANT_BLOCK_M,
    QUANT_EPS,
    QUANT_GROUPS_PER_PROG,
    QUANT_NUM_WARPS,
    QUANT_SMALL_M_BLOCK_M,
    QUANT_SMALL_M_NUM_WARPS,
    _per_token_group_quant_fp8_kernel,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_ref,
    per_token_group_quant_fp8_triton,
)
from vllm_moe_fixes.ops.silu_mul_quant import (
    FUSED_BLOCK_M,
    FUSED_GROUPS_PER_PROG,
    FUSED_NUM_WARPS,
    silu_and_mul_quant_fp8,
    silu_and_mul_quant_fp8_triton,
)
from vllm_moe_fixes.sizes import ROW_ALIGNMENT, cdiv

K = 7168
MS = (1, 256, 4096, 16384, 65536)
# vLLM 0.33's CUDA per_token_group_fp8_quant, do_bench on the same H200 (recorded Dec 1-2):
# its compiled ops cannot be carried to the device, so the anchor is the recorded figure.
VLLM_CUDA_US = {1: 5.2, 256: 8.3}
DEFAULT = {"block_m": QUANT_BLOCK_M, "groups_per_prog": QUANT_GROUPS_PER_PROG,
           "num_warps": QUANT_NUM_WARPS}
SMALL_M = {"block_m": QUANT_SMALL_M_BLOCK_M, "groups_per_prog": QUANT_GROUPS_PER_PROG,
           "num_warps": QUANT_SMALL_M_NUM_WARPS}


def _bytes(M):
    return M * K * 2 + M * K + M * (K // SCALE_BLOCK) * 4


def _inputs(M):
    def make(_):
        x = torch.randn((M, K), dtype=torch.bfloat16, device="cuda")
        q = torch.empty((M, K), dtype=FP8_DTYPE, device="cuda")
        s = torch.empty((M, K // SCALE_BLOCK), dtype=torch.float32, device="cuda")
        return x, q, s
    return rotating(make, _bytes(M))


def _row_major(x, q, s):
    return per_token_group_quant_fp8(x, SCALE_BLOCK, out_q=q)


def _tma(x, q, s):
    return per_token_group_quant_fp8(x, SCALE_BLOCK, column_major_scales=True,
                                     tma_aligned_scales=True, out_q=q)


def _launcher(x, q, s):
    per_token_group_quant_fp8_triton(x, q, s, SCALE_BLOCK, QUANT_EPS, False)


def _jit_launch(x, q, s):
    """The kernel launched through Triton's JIT entry on every call, with the large-M config at
    every M: the launch path and config before the cached launcher and the small-M config."""
    M, num_groups = s.shape
    grid = (cdiv(M, QUANT_BLOCK_M), cdiv(num_groups, QUANT_GROUPS_PER_PROG))
    _per_token_group_quant_fp8_kernel[grid](
        x, q, s, M, num_groups, x.stride(0), s.stride(0), s.stride(1), QUANT_EPS,
        GROUP=SCALE_BLOCK, BLOCK_M=QUANT_BLOCK_M, GROUPS_PER_PROG=QUANT_GROUPS_PER_PROG,
        UE8M0=False, ROUND_IN_FP32=False, num_warps=QUANT_NUM_WARPS)


def _torch_cast(x, q, s):
    q.copy_(x)


def _quant(sweep_configs, ms):
    """The quant table for the M in `ms` (and sweep rows when sweep_configs)."""
    rows, sweep = [], []
    for M in ms:
        sets = _inputs(M)
        nbytes = _bytes(M)
        t_row = bench_us(_row_major, sets)
        g_row = graph_us(_row_major, sets)
        t_tma = bench_us(_tma, sets)
        g_tma = graph_us(_tma, sets)
        t_launch = bench_us(_launcher, sets)
        t_jit = bench_us(_jit_launch, sets)
        t_ref = bench_us(
            lambda x, q, s: per_token_group_quant_fp8_ref(x, SCALE_BLOCK, QUANT_EPS, False),
            sets[:2], rep=50)
        t_copy = copy_us(nbytes)
        t_cast = bench_us(_torch_cast, sets)
        rows.append({
            "M": M, "K": K, "config": str(DEFAULT if M >= QUANT_BLOCK_M else SMALL_M),
            "us": t_row, "GB/s": gbps(nbytes, t_row),
            "graph_us": g_row, "graph_GB/s": gbps(nbytes, g_row),
            "tma_us": t_tma, "tma_graph_us": g_tma, "tma_graph_GB/s": gbps(nbytes, g_tma),
            "launcher_us": t_launch, "jit_us": t_jit,
            "host_us": host_us(_row_major, sets), "launcher_host_us": host_us(_launcher, sets),
            "jit_host_us": host_us(_jit_launch, sets),
            "tma_host_us": host_us(_tma, sets), "vllm_cuda_us_recorded": VLLM_CUDA_US.get(M),
            "torch_ref_us": t_ref, "x_vs_torch": t_ref / g_row,
            "torch_cast_us": t_cast, "torch_cast_host_us": host_us(_torch_cast, sets),
            "copy_us": t_copy, "copy_GB/s": gbps(nbytes, t_copy), "frac_of_copy": t_copy / g_row,
        })
        if sweep_configs:
            sweep += _sweep(M, sets, nbytes)
        del sets
        torch.cuda.empty_cache()
    print_table(rows, list(rows[0]))
    write_json("bench_quant", {"group_size": SCALE_BLOCK, "dtype": "bfloat16", "rows": rows})
    if sweep_configs:
        _report_sweep(sweep)


# ---------------------------------------------------------------- fused SiLU-and-mul + quant

TWO_I = 4096  # 2 * I, DeepSeek-V3's I = 2048
# tokens: M_sum (top-8 over 8 experts; 128 tokens fill every segment exactly)
CONTIGUOUS_ROWS = {128: 1024, 1024: 8192 + 8 * ROW_ALIGNMENT, 8192: 65536 + 8 * ROW_ALIGNMENT}
BATCHED_E, BATCHED_T, TOPK = 32, 128, 8


def _fused_bytes(rows):
    n = TWO_I // 2
    return rows * TWO_I * 2 + rows * n + rows * (n // SCALE_BLOCK) * 4


def _contiguous_inputs(rows):
    def make(_):
        x = torch.randn((rows, TWO_I), dtype=torch.bfloat16, device="cuda")
        q = torch.empty((rows, TWO_I // 2), dtype=FP8_DTYPE, device="cuda")
        s = empty_mn_major_scales((rows, TWO_I // 2 // SCALE_BLOCK), "cuda")
        g = torch.empty((rows, TWO_I // 2), dtype=torch.bfloat16, device="cuda")
        return x, q, s, g, None
    return rotating(make, _fused_bytes(rows))


def _batched_counts(tokens, seed):
    """Valid rows per expert when `tokens` tokens each pick TOPK of BATCHED_E experts."""
    gen = torch.Generator().manual_seed(seed)
    picks = torch.rand((tokens, BATCHED_E), generator=gen).topk(TOPK, dim=1).indices
    return torch.bincount(picks.flatten(), minlength=BATCHED_E).to(torch.int32)


def _batched_inputs(tokens):
    shape = (BATCHED_E, BATCHED_T)

    def make(i):
        x = torch.randn((*shape, TWO_I), dtype=torch.bfloat16, device="cuda")
        q = torch.empty((*shape, TWO_I // 2), dtype=FP8_DTYPE, device="cuda")
        s = empty_mn_major_scales((*shape, TWO_I // 2 // SCALE_BLOCK), "cuda")
        g = torch.empty((*shape, TWO_I // 2), dtype=torch.bfloat16, device="cuda")
        return x, q, s, g, _batched_counts(tokens, i).cuda()
    return rotating(make, _fused_bytes(BATCHED_E * BATCHED_T))


def _fused(x, q, s, g, counts):
    silu_and_mul_quant_fp8(x, out_q=q, out_s=s, expert_num_tokens=counts)


def _unfused(x, q, s, g, counts):
    """silu_and_mul then the quant, as the unfused experts run them (batched: over the whole
    [E * T] rows, row-major scales copied into the per-expert MN-major view)."""
    n = x.shape[-1] // 2
    silu_and_mul(x.view(-1, 2 * n), out=g.view(-1, n))
    if x.dim() == 2:
        per_token_group_quant_fp8(g, SCALE_BLOCK, column_major_scales=True, tma_aligned_scales=True,
                                  out_q=q, out_s=s)
    else:
        _, flat_s = per_token_group_quant_fp8(g.view(-1, n), SCALE_BLOCK, out_q=q.view(-1, n))
        s.copy_(flat_s.view(s.shape))


def _fused_row(layout, tokens, rows, valid_rows, sets):
    nbytes = _fused_bytes(valid_rows)
    t_fused, t_unfused = bench_us(_fused, sets), bench_us(_unfused, sets)
    g_fused, g_unfused = graph_us(_fused, sets), graph_us(_unfused, sets)
    return {
        "layout": layout, "tokens": tokens, "rows": rows, "valid_rows": valid_rows,
        "2N": TWO_I, "fused_us": t_fused, "unfused_us": t_unfused,
        "fused_graph_us": g_fused, "unfused_graph_us": g_unfused,
        "fused_graph_GB/s": gbps(nbytes, g_fused), "speedup_graph": g_unfused / g_fused,
        "fused_host_us": host_us(_fused, sets), "unfused_host_us": host_us(_unfused, sets),
    }


def _fused_table(sweep_configs):
    rows, sweep = [], []
    for tokens, m_sum in CONTIGUOUS_ROWS.items():
        sets = _contiguous_inputs(m_sum)
        rows.append(_fused_row("contiguous", tokens, m_sum, m_sum, sets))
        if sweep_configs:
            sweep += _fused_sweep(f"contiguous/{tokens}", sets, _fused_bytes(m_sum))
        del sets
        torch.cuda.empty_cache()
    for tokens in (1, 32, 128):
        sets = _batched_inputs(tokens)
        valid = int(sets[0][4].sum())
        rows.append(_fused_row("batched", tokens, BATCHED_E * BATCHED_T, valid, sets))
        if sweep_configs:
            sweep += _fused_sweep(f"batched/{tokens}", sets, _fused_bytes(valid))
        del sets
        torch.cuda.empty_cache()
    print_table(rows, list(rows[0]))
    write_json("bench_silu_mul_quant", {"group_size": SCALE_BLOCK, "dtype": "bfloat16",
                                        "config": {"block_m": FUSED_BLOCK_M,
                                                   "groups_per_prog": FUSED_GROUPS_PER_PROG,
                                                   "num_warps": FUSED_NUM_WARPS},
                                        "rows": rows})
    if sweep_configs:
        print_best(sweep, "\nFused sweep, best 8 per case:", key="case")
        write_json("bench_silu_mul_quant_sweep", {"rows": sweep})


def _fused_sweep(case, sets, nbytes):
    out = []
    for bm, gp, w in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (2, 4, 8)):
        def launch(x, q, s, g, counts, bm=bm, gp=gp, w=w):
            silu_and_mul_quant_fp8_triton(x, q, s, counts, False, block_m=bm, groups_per_prog=gp,
                                          num_warps=w)
        us = graph_us(launch, sets)
        out.append({"case": case, "block_m": bm, "groups_per_prog": gp, "num_warps": w,
                    "us": us, "GB/s": gbps(nbytes, us)})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("quant", "fused"), help="run one of the two tables")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of launch configs")
    parser.add_argument("--host-breakdown", action="store_true",
                        help="also the host cost of each piece of a call at M = 1")
    parser.add_argument("--ms", default=",".join(map(str, MS)),
                        help=f"comma-separated M of the quant table (default {MS})")
    args = parser.parse_args()
    require_cuda("bench_quant")
    if args.only != "fused":
        _quant(args.sweep, [int(m) for m in args.ms.split(",")])
    if args.host_breakdown:
        _host_breakdown()
    if args.only != "quant":
        _fused_table(args.sweep)


def _sweep(M, sets, nbytes):
    configs = [{"block_m": bm, "groups_per_prog": g, "num_warps": w, "round_in_fp32": False}
               for bm, g, w in itertools.product((1, 2, 4, 8, 16), (2, 4, 8), (2, 4, 8))]
    configs.append(dict(DEFAULT, round_in_fp32=True))
    out = []
    for cfg in configs:
        launch = functools.partial(per_token_group_quant_fp8_triton, group_size=SCALE_BLOCK,
                                   eps=QUANT_EPS, use_ue8m0=False, **cfg)
        us = graph_us(launch, sets)  # the kernel alone: small M is host-bound in do_bench
        out.append({"M": M, **cfg, "us": us, "GB/s": gbps(nbytes, us)})
    return out


def _host_breakdown(M=1):
    """Host time per call of each piece of the public op at M rows (see the module docstring)."""
    x, q, s = _inputs(M)[0]
    launcher = fq._launch_quant
    grid = (M, cdiv(K // SCALE_BLOCK, QUANT_GROUPS_PER_PROG), 1)
    tensors = (x, q, s)
    scalars = (M, K // SCALE_BLOCK, x.stride(0), *s.stride(), QUANT_EPS, SCALE_BLOCK,
               QUANT_SMALL_M_BLOCK_M, QUANT_GROUPS_PER_PROG, False, False)
    compiled = fq._per_token_group_quant_fp8_kernel[grid](*tensors, *scalars,
                                                          num_warps=QUANT_SMALL_M_NUM_WARPS)
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    direct = tu._direct_launch(compiled)
    ptrs = tuple(t.data_ptr() for t in tensors)
    device = torch._C._cuda_getDevice()
    stream = torch._C._cuda_getCurrentRawStream

    def run_ptrs():
        run(*grid, stream(device), function, metadata, None, None, None, *ptrs, *scalars)

    def run_tensors():
        run(*grid, stream(device), function, metadata, None, None, None, *tensors, *scalars)

    def run_direct():
        direct(*grid, stream(device), *ptrs, *scalars)

    def key():
        p = tuple(map(tu._DATA_PTR, tensors))
        return (device, 4, *map(tu._DTYPE, tensors), *map(tu._LOW_BITS, p), *scalars)

    pieces = {
        "public op, out_q given": lambda: _row_major(x, q, s),
        "public op, outputs allocated": lambda: per_token_group_quant_fp8(x, SCALE_BLOCK),
        "public op, TMA-aligned scales": lambda: _tma(x, q, s),
        "per_token_group_quant_fp8_triton": lambda: _launcher(x, q, s),
        "KernelLauncher call": lambda: launcher(grid, QUANT_SMALL_M_NUM_WARPS, tensors, scalars),
        f"C launch, no wrapper ({direct.__name__})": run_direct,
        "compiled launcher, data pointers": run_ptrs,
        "compiled launcher, tensors": run_tensors,
        "Triton JIT kernel[grid]": lambda: _jit_launch(x, q, s),
        "torch q.copy_(x) (one C++ launch)": lambda: q.copy_(x),
        "_check_arguments": lambda: fq._check_arguments(x, SCALE_BLOCK, QUANT_EPS, FP8_DTYPE,
                                                        False),
        "values buffer (allocated)": lambda: fq._values_buffer(x, None),
        "values buffer (out_q checks)": lambda: fq._values_buffer(x, q),
        "scales buffer, row-major": lambda: fq._scales_buffer(x, 56, None, False, False),
        "scales buffer, TMA-aligned": lambda: fq._scales_buffer(x, 56, None, True, True),
        "one uint8 buffer + 2 views": lambda: _one_buffer(x),
        "launch key (by value)": key,
        "by-value dict lookup": lambda: launcher._by_value.get(key()),
        "torch._C._cuda_getDevice()": torch._C._cuda_getDevice,
        "torch.cuda.current_device()": torch.cuda.current_device,
        "_cuda_getCurrentRawStream": lambda: stream(device),
        "_hooked()": tu._hooked,
        "empty Python call": lambda: None,
    }
    rows = [{"piece": name, "host_us": host_us(fn, [()], calls=1000)}
            for name, fn in pieces.items()]
    print_table(rows, ["piece", "host_us"])
    configs = []
    for gp, warps in itertools.product((2, 4, 8), (2, 4)):
        def launch(x, q, s, gp=gp, warps=warps):
            per_token_group_quant_fp8_triton(x, q, s, SCALE_BLOCK, QUANT_EPS, False,
                                             block_m=1, groups_per_prog=gp, num_warps=warps)
        configs.append({"M": M, "groups_per_prog": gp, "num_warps": warps,
                        "graph_us": graph_us(launch, [(x, q, s)])})
    print_table(configs, list(configs[0]))
    write_json("bench_quant_host", {"M": M, "K": K, "pieces": rows, "kernel_configs": configs,
                                    "c_launch": direct.__name__})


def _one_buffer(x):
    """The values and the scales of x as views of one uint8 allocation."""
    M, K_ = x.shape
    buf = torch.empty(M * K_ + M * (K_ // SCALE_BLOCK) * 4, dtype=torch.uint8, device=x.device)
    return buf[:M * K_].view(FP8_DTYPE).view(M, K_), buf[M * K_:].view(torch.float32).view(M, -1)


def _report_sweep(sweep):
    print_best(sweep, "\nSweep (row-major scales), best 8 per M:")
    # A config that is good everywhere: smallest worst-case slowdown against each M's best.
    fastest = {M: min(r["us"] for r in sweep if r["M"] == M) for M in {r["M"] for r in sweep}}
    keys = ("block_m", "groups_per_prog", "num_warps", "round_in_fp32")
    score = {}
    for r in sweep:
        k = tuple(r[c] for c in keys)
        score[k] = max(score.get(k, 0.0), r["us"] / fastest[r["M"]])
    ranked = sorted(score.items(), key=lambda kv: kv[1])[:8]
    print("\nBest configs over all M (worst-case time / per-M best):")
    print_table([{**dict(zip(keys, k)), "worst_ratio": v} for k, v in ranked],
                [*keys, "worst_ratio"])
    write_json("bench_quant_sweep", {"rows": sweep})


if __name__ == "__main__":
    main()
