"""The whole MoE layer (NoEP + TritonExperts / DeepGemmExperts) against a naive version.

Run from the repository root on a GPU:

    python benchmarks/bench_experts.py                 # table + benchmarks/results/experts.json
    python benchmarks/bench_experts.py --m 128 512     # a subset of token counts

DeepSeek-V3 shapes on one rank: K=7168, I=2048, E_l=8 local experts, top-8 routing spread over
them. For each M: the median time (triton.testing.do_bench), useful TFLOP/s (2 * M * k * 3 * I * K
/ time), and peak memory above the inputs and weights for

  modular: FusedMoEModularKernel, first call on a fresh kernel (workspaces allocated inside it);
           "expected" = declared workspaces (ws13 + ws2) + output [M, K] bf16 + prepare's a1q
           [M, K] fp8 + a1q_scale [M, K/128] f32; the ratio peak / expected should be 1.00-1.05.
  naive:   the same ops, but every intermediate a new tensor (permuted input, GEMM1 out, SiLU out,
           requantised input, GEMM2 out, un-permuted rows, weighted rows, sum).
The two outputs are compared (calc_diff) so the naive version is a correct baseline.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import bench_us, print_table, write_json  # noqa: E402
from vllm_moe_fixes._compat import deep_gemm as dg  # noqa: E402
from vllm_moe_fixes.fused_moe.experts import DeepGemmExperts, TritonExperts  # noqa: E402
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel  # noqa: E402
from vllm_moe_fixes.fused_moe.prepare_finalize import NoEPPrepareAndFinalize  # noqa: E402
from vllm_moe_fixes.fused_moe.routing import fused_topk, quant_block_fp8  # noqa: E402
from vllm_moe_fixes.ops.activation import silu_and_mul  # noqa: E402
from vllm_moe_fixes.ops.fp8_quant import per_token_group_quant_fp8  # noqa: E402
from vllm_moe_fixes.ops.moe_sum import moe_sum  # noqa: E402
from vllm_moe_fixes.ops.permute import build_contiguous_layout  # noqa: E402

K, I, E_L, TOPK = 7168, 2048, 8, 8
FP8 = torch.float8_e4m3fn


def naive_layer(x, w1, w2, w1s, w2s, weights, ids, gemm):
    """Same arithmetic as the modular kernel, every intermediate freshly allocated."""
    M, k = ids.shape
    a_q, a_s = per_token_group_quant_fp8(x, 128)
    lay = build_contiguous_layout(ids, w1.shape[0])
    valid = (lay.m_indices >= 0).unsqueeze(1).to(torch.uint8)
    a_p = (a_q.view(torch.uint8)[lay.src_token] * valid).view(FP8)
    a_ps = a_s[lay.src_token].t().contiguous().t()  # MN-major copy
    h = torch.empty(a_p.shape[0], w1.shape[1], dtype=torch.bfloat16, device=x.device)
    gemm((a_p, a_ps), (w1, w1s), h, lay.m_indices)
    g_q, g_s = per_token_group_quant_fp8(silu_and_mul(h), 128, column_major_scales=True,
                                         tma_aligned_scales=True)
    y = torch.empty(a_p.shape[0], K, dtype=torch.bfloat16, device=x.device)
    gemm((g_q, g_s), (w2, w2s), y, lay.m_indices)
    rows = y[lay.dest].view(M, k, K)
    return moe_sum(rows * weights.unsqueeze(-1).to(rows.dtype))


def peak_bytes(fn) -> tuple[int, torch.Tensor]:
    """Peak allocated bytes above what was allocated before fn() (and fn's result)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out


def calc_diff(x, y) -> float:
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def bench_backend(name, make_experts, gemm, w, m_values):
    w1, w1s, w2, w2s = w
    rows = []
    for M in m_values:
        g = torch.Generator(device="cuda").manual_seed(M)
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        weights, ids = fused_topk(torch.randn(M, E_L, device="cuda", generator=g), TOPK, True)
        experts = make_experts()
        kw = dict(w1_scale=w1s, w2_scale=w2s, global_num_experts=E_L)

        def modular(kernel):
            return kernel(x, w1, w2, weights, ids, **kw)

        modular(FusedMoEModularKernel(NoEPPrepareAndFinalize(), experts))  # compile / JIT
        naive_layer(x, w1, w2, w1s, w2s, weights, ids, gemm)
        kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(), experts)
        peak_mod, out_mod = peak_bytes(lambda: modular(kernel))
        peak_naive, out_naive = peak_bytes(lambda: naive_layer(x, w1, w2, w1s, w2s, weights, ids,
                                                               gemm))
        ws13, ws2, _ = experts.workspace_shapes(M, I, K, TOPK, E_L)
        declared = 2 * (ws13[0] * ws13[1] + ws2[0] * ws2[1])
        expected = declared + M * K * 2 + M * K + M * (K // 128) * 4
        us_mod = bench_us(lambda: modular(kernel), [()])
        us_naive = bench_us(lambda: naive_layer(x, w1, w2, w1s, w2s, weights, ids, gemm), [()])
        flop = 2 * M * TOPK * 3 * I * K
        rows.append(dict(backend=name, M=M, us=us_mod, naive_us=us_naive,
                         tflops=flop / us_mod / 1e6, naive_tflops=flop / us_naive / 1e6,
                         peak_MiB=peak_mod / 2**20, expected_MiB=expected / 2**20,
                         declared_ws_MiB=declared / 2**20, peak_over_expected=peak_mod / expected,
                         naive_peak_MiB=peak_naive / 2**20,
                         saved_MiB=(peak_naive - peak_mod) / 2**20,
                         diff_vs_naive=calc_diff(out_mod, out_naive)))
        print_table(rows[-1:], list(rows[-1]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[128, 512, 2048, 8192])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_experts.py needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    w1, w1s = quant_block_fp8(torch.randn(E_L, 2 * I, K, device="cuda", generator=g) / K ** 0.5)
    w2, w2s = quant_block_fp8(torch.randn(E_L, K, I, device="cuda", generator=g) / I ** 0.5)
    w = (w1, w1s, w2, w2s)
    results = bench_backend("triton", TritonExperts, TritonExperts().gemm, w, args.m)
    if dg.is_available():
        results += bench_backend("deep_gemm", DeepGemmExperts, dg.m_grouped_fp8_gemm_nt_contiguous,
                                 w, args.m)
    print()
    print_table(results, list(results[0]))
    write_json("experts", dict(shape=dict(K=K, I=I, E_local=E_L, topk=TOPK),
                               deep_gemm=dg.is_available(), results=results))


if __name__ == "__main__":
    main()
