"""The whole MoE layer (NoEP + TritonExperts / DeepGemmExperts) against a naive version.

Run from the repository root on a GPU:

    python benchmarks/bench_experts.py                 # table + benchmarks/results/experts.json
    python benchmarks/bench_experts.py --m 128 512     # a subset of token counts
    python benchmarks/bench_experts.py --skip-layer    # only the permute (gather) table

DeepSeek-V3 shapes on one rank: K=7168, I=2048, E_l=8 local experts, top-8 routing spread over
them. For each M: the median time (triton.testing.do_bench), useful TFLOP/s (2 * M * k * 3 * I * K
/ time), and peak memory above the inputs and weights for

  modular: FusedMoEModularKernel, first call on a fresh kernel (workspaces allocated inside it);
           "expected" = declared workspaces (ws13 + ws2) + output [M, K] bf16 + prepare's a1q
           [M, K] fp8 + a1q_scale [M, K/128] f32; the ratio peak / expected should be 1.00-1.05.
  naive:   the same ops, but every intermediate a new tensor (permuted input, GEMM1 out, SiLU out,
           requantised input, GEMM2 out, un-permuted rows, weighted rows, sum).
The two outputs are compared (calc_diff) so the naive version is a correct baseline.
Columns for the modular layer: `us` eager (do_bench), `graph_us` per call under CUDA-graph replay
(how engines run decode: host time drops out), `host_us` host time per eager call (when it exceeds
graph_us the eager number measures the host, not the GPU).

First, a table of `permute_rows` alone at the layer's M_sum rows: the torch reference
(index_select + masked_fill + index_select) against the Triton gather for a few tiles
(rows x bytes per program, warps); GB/s counts the bytes written plus the used rows read.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import bench_us, graph_us, host_us, print_table, write_json  # noqa: E402
from vllm_moe_fixes._compat import deep_gemm as dg  # noqa: E402
from vllm_moe_fixes.fused_moe.contiguous_experts import DeepGemmExperts, TritonExperts  # noqa: E402
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel  # noqa: E402
from vllm_moe_fixes.fused_moe.no_ep_prepare_finalize import NoEPPrepareAndFinalize  # noqa: E402
from vllm_moe_fixes.fused_moe.routing import fused_topk, quant_block_fp8  # noqa: E402
from vllm_moe_fixes.ops.activation import silu_and_mul  # noqa: E402
from vllm_moe_fixes.ops.fp8_quant import per_token_group_quant_fp8  # noqa: E402
from vllm_moe_fixes.ops.moe_sum import moe_sum  # noqa: E402
from vllm_moe_fixes.ops.permute import (  # noqa: E402
    build_contiguous_layout,
    permute_rows_ref,
    permute_rows_triton,
)
from vllm_moe_fixes.ops.reference import calc_diff  # noqa: E402
from vllm_moe_fixes.sizes import layer_declared_bytes  # noqa: E402

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
        expected = layer_declared_bytes(M, I, K, TOPK, E_L)
        us_mod = bench_us(lambda: modular(kernel), [()])
        us_naive = bench_us(lambda: naive_layer(x, w1, w2, w1s, w2s, weights, ids, gemm), [()])
        us_graph = graph_us(lambda: modular(kernel), [()], calls=max(1, 2048 // M))
        us_host = host_us(lambda: modular(kernel), [()], calls=50 if M <= 512 else 10)
        flop = 2 * M * TOPK * 3 * I * K
        rows.append(dict(backend=name, M=M, us=us_mod, graph_us=us_graph, host_us=us_host,
                         naive_us=us_naive,
                         tflops=flop / us_mod / 1e6, naive_tflops=flop / us_naive / 1e6,
                         peak_MiB=peak_mod / 2**20, expected_MiB=expected / 2**20,
                         declared_ws_MiB=declared / 2**20, peak_over_expected=peak_mod / expected,
                         naive_peak_MiB=peak_naive / 2**20,
                         saved_MiB=(peak_naive - peak_mod) / 2**20,
                         diff_vs_naive=calc_diff(out_mod, out_naive)))
        print_table(rows[-1:], list(rows[-1]))
    return rows


PERMUTE_TILES = [(8, 1024, 4), (4, 2048, 4), (16, 1024, 8), (2, 4096, 8), (1, 8192, 8)]


def bench_permute(m_values):
    """permute_rows at the layer's shapes: torch reference vs the Triton gather per tile."""
    rows = []
    for M in m_values:
        g = torch.Generator(device="cuda").manual_seed(M)
        a_q, a_s = per_token_group_quant_fp8(torch.randn(M, K, device="cuda", generator=g), 128)
        _, ids = fused_topk(torch.randn(M, E_L, device="cuda", generator=g), TOPK, True)
        lay = build_contiguous_layout(ids, E_L)
        m_sum = lay.m_indices.numel()
        out_q = torch.empty(m_sum, K, dtype=FP8, device="cuda")
        out_s = torch.empty(K // 128, m_sum, device="cuda").t()
        nbytes = m_sum * K + M * TOPK * K + 2 * m_sum * (K // 128) * 4
        ref_us = bench_us(lambda: permute_rows_ref(a_q, a_s, lay, out_q, out_s), [()])
        row = dict(M=M, M_sum=m_sum, ref_us=ref_us, ref_GBps=nbytes / ref_us / 1e3)
        want = out_q.view(torch.uint8).clone()
        for r, kb, w in PERMUTE_TILES:
            out_q.view(torch.uint8).fill_(0x7F)
            launch = lambda: permute_rows_triton(a_q, a_s, lay, out_q, out_s,  # noqa: E731
                                                 block_rows=r, block_k=kb, num_warps=w)
            launch()
            assert torch.equal(out_q.view(torch.uint8), want), (r, kb, w)
            us = bench_us(launch, [()])
            row[f"us[{r}x{kb}w{w}]"] = us
            row[f"GBps[{r}x{kb}w{w}]"] = nbytes / us / 1e3
        rows.append(row)
        print_table(rows[-1:], list(row))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[128, 512, 2048, 8192])
    parser.add_argument("--skip-layer", action="store_true", help="only the permute table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_experts.py needs a CUDA GPU")
    permute = bench_permute(args.m)
    write_json("permute", dict(shape=dict(K=K, E_local=E_L, topk=TOPK), results=permute))
    if args.skip_layer:
        return
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
