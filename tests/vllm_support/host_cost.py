"""Host cost of one MoE layer call through vLLM's FusedMoEKernel with this library's adapters
against our own FusedMoEModularKernel, same problem, same kernels (GPU only). NOT YET RUN.

    python tests/vllm_support/host_cost.py OUT.json [--experts triton|deep_gemm] [--calls 200]

Each variant is warmed up, then called ``calls`` times in a plain launch loop timed by the wall
clock up to one final synchronisation (``loop_us`` per call), and once more between two CUDA
events (``gpu_us``). At M=128 the loop is host-bound when loop_us exceeds gpu_us; the difference is
the host time. vLLM's kernel takes fresh workspace views from its WorkspaceManager on every call;
ours reuses its own. The target: the adapter's loop_us at most 1.1x ours.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _loop_us(fn, calls: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def _gpu_us(fn, calls: int) -> float:
    """GPU time per call, from CUDA events around the same loop."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--experts", choices=("triton", "deep_gemm"), default="triton")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()

    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
        fp8_w8a8_moe_quant_config,
    )
    from vllm.v1.worker.workspace import init_workspace_manager

    from vllm_moe_fixes import fused_moe as ours
    from vllm_moe_fixes.integrations.vllm import experts as adapters
    from vllm_moe_fixes.integrations.vllm import prepare_finalize as pfs
    from vllm_moe_fixes.testing import random_fp8_moe_weights

    init_workspace_manager(torch.device("cuda"))
    E, K, I, k, M = 32, 7168, 2048, 8, args.tokens  # DeepSeek-V3's expert shapes, 32 local
    w = random_fp8_moe_weights(E, K, I, device="cuda")
    x = torch.randn(M, K, device="cuda").bfloat16()
    tw, ti = ours.fused_topk(torch.randn(M, E, device="cuda"), k, renormalize=True)
    cfg = FusedMoEConfig(
        num_experts=E, experts_per_token=k, hidden_dim=K, intermediate_size=I,
        num_local_experts=E, num_logical_experts=E, activation=MoEActivation.SILU,
        device="cuda", routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=torch.bfloat16,
        intermediate_size_per_partition=I)
    qc = fp8_w8a8_moe_quant_config(w1_scale=w.w1_scale, w2_scale=w.w2_scale,
                                   block_shape=[128, 128])
    vllm_cls, our_cls = ((adapters.VllmDeepGemmExperts, ours.DeepGemmExperts)
                         if args.experts == "deep_gemm"
                         else (adapters.VllmTritonExperts, ours.TritonExperts))
    theirs = mk.FusedMoEKernel(pfs.VllmNoEPPrepareAndFinalize(), vllm_cls(cfg, qc))
    mine = ours.FusedMoEModularKernel(ours.NoEPPrepareAndFinalize(), our_cls())
    ids = ti.to(torch.int32)

    def adapter_call():
        theirs.apply(x, w.w1, w.w2, tw, ids, MoEActivation.SILU, E, None, False)

    def our_call():
        mine(x, w.w1, w.w2, tw, ids, w1_scale=w.w1_scale, w2_scale=w.w2_scale,
             global_num_experts=E)

    assert torch.equal(theirs.apply(x, w.w1, w.w2, tw, ids, MoEActivation.SILU, E, None, False),
                       mine(x, w.w1, w.w2, tw, ids, w1_scale=w.w1_scale, w2_scale=w.w2_scale,
                            global_num_experts=E))
    rows = {}
    for name, fn in (("adapter", adapter_call), ("ours", our_call)):
        rows[name] = {"loop_us": _loop_us(fn, args.calls), "gpu_us": _gpu_us(fn, args.calls)}
    rows["ratio_loop"] = rows["adapter"]["loop_us"] / rows["ours"]["loop_us"]
    result = {"problem": dict(M=M, E=E, K=K, I=I, k=k, experts=args.experts,
                              calls=args.calls), "results": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
