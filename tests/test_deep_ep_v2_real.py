"""The layer on a real DeepEP V2 ``ElasticBuffer`` (DeepEP main, NCCL Gin): DeepEP's own size hint
against our mirror, its dispatch/combine against V2's contract, and the whole layer through
DeepEPV2PrepareAndFinalize at world size 1 (2 ranks where two GPUs are visible) against
moe_reference, with and without the CPU sync.

Every test needs V2 built from DeepEP main (its JIT compiles the kernels at first use; NCCL
>= 2.30.4) and a GPU; with DeepEP v1 installed, or none, they skip. Each case runs in fresh
NCCL ranks (``run_distributed``).
"""

import gc

import pytest
import torch
from _dist import run_distributed

from vllm_moe_fixes._compat import deep_ep as deep_ep_compat
from vllm_moe_fixes.distributed import deepep_v2_sizing as v2
from vllm_moe_fixes.distributed.buffers import clear_all2all_buffers, make_all2all_buffer
from vllm_moe_fixes.fused_moe.contiguous_experts import TritonExperts
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import DeepEPV2PrepareAndFinalize
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.testing import moe_reference, random_fp8_moe_weights, rel_err

HIDDEN, INTER, MAX_TOKENS, TOPK, EXPERTS_PER_RANK = 2048, 128, 128, 6, 8


def _v2_missing() -> bool:
    try:
        return deep_ep_compat.installed_version() != 2
    except ImportError:
        return True


pytestmark = [pytest.mark.deep_ep, pytest.mark.gpu,
              pytest.mark.skipif(_v2_missing(), reason="needs DeepEP V2 (deep_ep.ElasticBuffer)")]


def _hint_worker(rank: int, world: int) -> list:
    """(DeepEP's hint, ours) at several sizes on this group."""
    import torch.distributed as dist
    elastic = deep_ep_compat.require("deepep_v2").ElasticBuffer
    pairs = []
    for n, h, k, fp8 in ((1, 2048, 1, True), (128, 7168, 8, True), (4096, 7168, 0, False),
                         (256, 4096, 6, True)):
        for multi in (True, False):
            theirs = elastic.get_buffer_size_hint(dist.group.WORLD, n, h, num_topk=k,
                                                  use_fp8_dispatch=fp8,
                                                  allow_multiple_reduction=multi)
            ours = v2.elastic_buffer_size_hint(n, h, num_ranks=world, num_nvl_ranks=world,
                                               num_topk=k, use_fp8_dispatch=fp8,
                                               allow_multiple_reduction=multi)
            pairs.append((theirs, ours))
    return pairs


def test_hint_matches_mirror():
    for theirs, ours in run_distributed(_hint_worker, 1, backend="nccl")[0]:
        assert theirs == ours


@pytest.mark.multi_gpu
def test_hint_matches_mirror_two_ranks():
    for theirs, ours in run_distributed(_hint_worker, 2, backend="nccl")[0]:
        assert theirs == ours


def _layer_worker(rank: int, world: int) -> None:
    device = torch.device("cuda", rank)
    num_experts = EXPERTS_PER_RANK * world
    buffer = make_all2all_buffer("deepep_v2", None, max_tokens_per_rank=MAX_TOKENS,
                                 hidden=HIDDEN, num_experts=num_experts, num_topk=TOPK)
    assert type(buffer).__name__ == "ElasticBuffer"
    assert buffer.num_bytes == v2.elastic_buffer_size_hint(
        MAX_TOKENS, HIDDEN, num_ranks=world, num_nvl_ranks=world, num_topk=TOPK,
        use_fp8_dispatch=True)
    g = torch.Generator(device=device).manual_seed(7)
    full = random_fp8_moe_weights(num_experts, HIDDEN, INTER, generator=g, device=device)
    local = [t[rank * EXPERTS_PER_RANK:(rank + 1) * EXPERTS_PER_RANK].contiguous() for t in full]
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
    expert_map[rank * EXPERTS_PER_RANK:(rank + 1) * EXPERTS_PER_RANK] = torch.arange(
        EXPERTS_PER_RANK, dtype=torch.int32, device=device)
    for tokens in (MAX_TOKENS, 1, 37, 0):
        x = torch.randn(tokens, HIDDEN, generator=g, device=device).to(torch.bfloat16)
        scores = torch.randn(tokens, num_experts, generator=g, device=device)
        weights, ids = scores.softmax(-1).topk(TOPK, dim=-1)
        ids[::3, -1] = -1
        ref = moe_reference(x, full.w1, full.w2, weights, ids, w1_scale=full.w1_scale,
                            w2_scale=full.w2_scale)
        for sync in (True, False):
            pf = DeepEPV2PrepareAndFinalize(buffer, num_dispatchers=world,
                                            rank_expert_offset=rank * EXPERTS_PER_RANK,
                                            do_cpu_sync=sync)
            out = FusedMoEModularKernel(pf, TritonExperts())(
                x, local[0], local[2], weights, ids, w1_scale=local[1], w2_scale=local[3],
                global_num_experts=num_experts, expert_map=expert_map,
                max_tokens_across_ranks=MAX_TOKENS)
            torch.cuda.synchronize()
            assert out.shape == x.shape and torch.isfinite(out).all()
            if tokens:
                assert rel_err(out, ref) < 0.06, (tokens, sync, rel_err(out, ref))
    clear_all2all_buffers()
    del buffer
    gc.collect()
    torch.cuda.synchronize()


def test_layer_world_size_1():
    run_distributed(_layer_worker, 1, backend="nccl")


@pytest.mark.multi_gpu
def test_layer_world_size_2():
    run_distributed(_layer_worker, 2, backend="nccl")
