"""The cost of the contiguous experts' bound: passes of at most VLLM_FUSED_MOE_CHUNK_SIZE tokens
over what a rank received, against one pass, at skewed and balanced routing.

Run from the repository root on a GPU (it cannot run without one):

    python -m benchmarks.bench_skew_bound          # JSON in benchmarks/results/skew_bound.json
    python -m benchmarks.bench_skew_bound --m 8192 --passes 1 2 4 8

A rank that received M = 8192 tokens after a high-throughput dispatch, DeepSeek-V3/R1 shapes
(K=7168, I=2048, 256 experts of which this rank holds 8: EP=32, top-8), expert_map for them:

  skewed    every token's 8 slots on this rank's 8 experts (what all-zero ids do to the ranks of
            the k experts they route to: every token of the group, all its slots there)
  balanced  what a rank receives with random ids: top-8 of 256 experts by random scores, kept
            when at least one of its slots is on this rank (the others map to -1 here)

For each routing and backend (TritonExperts; DeepGemmExperts where DeepGEMM is installed),
experts.apply on the received a1q [M, K] with workspaces of the declared shapes and the output at
the start of ws13 (where the modular kernel puts it with high-throughput EP), once as one pass
(bound = M: the path of a rank that received no more than the bound) and in 2, 4, 8 passes
(bound = M / passes), all in the same run. Columns: us (triton.testing.do_bench median),
slower (us / us of one pass - 1; target at balanced routing: <= 3%), peak_MiB (first call on
fresh workspaces, allocated in the measured block), declared_MiB (the workspaces
workspace_shapes declares), bits (the output equals one pass's bit for bit).
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks._common import bench_us, print_table, write_json
from vllm_moe_fixes._compat import deep_gemm as dg
from vllm_moe_fixes._memory import peak_memory
from vllm_moe_fixes.fused_moe.contiguous_experts import DeepGemmExperts, TritonExperts
from vllm_moe_fixes.fused_moe.routing import fused_topk
from vllm_moe_fixes.ops.fp8_quant import per_token_group_quant_fp8
from vllm_moe_fixes.sizes import cdiv
from vllm_moe_fixes.testing import random_fp8_moe_weights

K, I, E, E_L, TOPK = 7168, 2048, 256, 8, 8
CHUNK = "VLLM_FUSED_MOE_CHUNK_SIZE"


def received_routing(M: int, skewed: bool, seed: int):
    """topk_ids int64 [M, 8] global ids and float32 weights of M tokens this rank (experts
    0..7) received."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if skewed:
        weights = torch.softmax(torch.randn(M, TOPK, device="cuda", generator=g), dim=-1)
        return torch.arange(TOPK, device="cuda").expand(M, TOPK).contiguous(), weights
    kept_w, kept_ids = [], []
    while sum(len(t) for t in kept_ids) < M:
        weights, ids = fused_topk(torch.randn(8 * M, E, device="cuda", generator=g), TOPK, True)
        here = (ids < E_L).any(dim=1)
        kept_w.append(weights[here])
        kept_ids.append(ids[here])
    return torch.cat(kept_ids)[:M].contiguous(), torch.cat(kept_w)[:M].contiguous()


def bench_routing(name, make_experts, w, emap, M, skewed, passes_list):
    rows = []
    g = torch.Generator(device="cuda").manual_seed(M)
    a1q, a1s = per_token_group_quant_fp8(
        torch.randn(M, K, device="cuda", generator=g).bfloat16(), 128)
    ids, weights = received_routing(M, skewed, seed=M + skewed)
    local_slots = int((ids < E_L).sum())
    one_pass = None
    for passes in passes_list:
        os.environ[CHUNK] = str(cdiv(M, passes))
        experts = make_experts()
        shapes = experts.workspace_shapes(M, I, K, TOPK, E_L, experts_pass_tokens=cdiv(M, passes))
        declared = 2 * sum(torch.Size(s).numel() for s in shapes[:2])
        torch.cuda.empty_cache()
        with peak_memory() as peak:
            ws13 = torch.empty(shapes[0], dtype=torch.bfloat16, device="cuda")
            ws2 = torch.empty(shapes[1], dtype=torch.bfloat16, device="cuda")
            out = ws13.view(-1)[:M * K].view(M, K)

            def apply():
                experts.apply(out, a1q, a1s, w, workspace13=ws13, workspace2=ws2, topk_ids=ids,
                              expert_map=emap, topk_weights=weights,
                              experts_pass_tokens=cdiv(M, passes))
            apply()
        result = out.clone()
        us = bench_us(apply, [()])
        if one_pass is None:
            one_pass = (us, result)
        rows.append(dict(backend=name, routing="skewed" if skewed else "balanced", M=M,
                         local_slots=local_slots, passes=passes, experts_pass_tokens=int(os.environ[
                             CHUNK]), us=us, slower=us / one_pass[0] - 1,
                         peak_MiB=peak.bytes / 2**20, declared_MiB=declared / 2**20,
                         bits=bool(torch.equal(result, one_pass[1]))))
        print_table(rows[-1:], list(rows[-1]))
        del ws13, ws2, out, apply
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, default=8192, help="tokens the rank received")
    parser.add_argument("--passes", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="pass counts to time (1 = one pass, the anchor; must come first)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_skew_bound needs a CUDA GPU")
    if args.passes[0] != 1:
        raise SystemExit("--passes must start with 1 (the one-pass anchor)")
    backends = [("triton", TritonExperts)]
    if dg.is_available():
        backends.append(("deep_gemm", DeepGemmExperts))
    w = random_fp8_moe_weights(E_L, K, I, generator=torch.Generator(device="cuda").manual_seed(0),
                               device="cuda")
    emap = torch.full((E,), -1, dtype=torch.int32, device="cuda")
    emap[:E_L] = torch.arange(E_L, dtype=torch.int32, device="cuda")
    saved = os.environ.get(CHUNK)
    try:
        rows = [r for name, cls in backends for skewed in (True, False)
                for r in bench_routing(name, cls, w, emap, args.m, skewed, args.passes)]
    finally:
        if saved is None:
            os.environ.pop(CHUNK, None)
        else:
            os.environ[CHUNK] = saved
    print()
    print_table(rows, list(rows[0]))
    write_json("skew_bound", dict(shape=dict(K=K, I=I, E=E, E_local=E_L, topk=TOPK),
                                  deep_gemm=dg.is_available(), results=rows))


if __name__ == "__main__":
    main()
