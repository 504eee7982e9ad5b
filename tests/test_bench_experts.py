"""benchmarks/bench_experts.py's anchor (the unfused torch path) computes what the layer does."""

import torch

from benchmarks.bench_experts import anchor_layer
from vllm_moe_fixes.fused_moe import FusedMoEModularKernel, NoEPPrepareAndFinalize, TritonExperts
from vllm_moe_fixes.fused_moe.routing import fused_topk
from vllm_moe_fixes.testing import random_fp8_moe_weights


def test_anchor_matches_the_layer_bit_for_bit_on_cpu():
    """On CPU every op of both paths is a torch reference, so the unfused anchor and the fused
    layer give the same bits: the benchmark's diff column measures only the GPU kernels."""
    g = torch.Generator().manual_seed(0)
    E, k, M, N, K = 8, 8, 40, 128, 256
    w1, w1s, w2, w2s = random_fp8_moe_weights(E, K, N, generator=g)
    x = torch.randn(M, K, generator=g).bfloat16()
    weights, ids = fused_topk(torch.randn(M, E, generator=g), k, renormalize=True)
    kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(), TritonExperts())
    out = kernel(x, w1, w2, weights, ids, w1_scale=w1s, w2_scale=w2s, global_num_experts=E)
    anchor = anchor_layer(x, (w1, w1s, w2, w2s), weights, ids, TritonExperts().gemm)
    assert torch.equal(out, anchor)
