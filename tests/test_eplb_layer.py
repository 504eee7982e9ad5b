"""BalancedMoELayer: with redundant experts the layer's output equals the un-replicated layer's,
bit for bit on CPU, on one rank (NoEP) and on 2 and 4 gloo ranks (HT and LL over the naive torch
buffer, the V2 torch stand-in), for contiguous and batched experts. Across ranks the bits are the
same wherever a token's slots are served on the same ranks as without replicas (replicas on the
expert's own rank, or top-1), and always for LL (its combine adds a token's k rows in slot
order on the source rank, as DeepEP's); with replicas elsewhere and k > 1, the HT and V2 combines
group a token's rows by rank differently, and the outputs agree to the rounding of those partial
sums.

Replicas hold the same weights: a physical expert is a copy of its logical expert
(``physical_weights``); the gloo test gathers every rank's physical weights and compares each
replica's bytes with every other replica of the same logical expert.
"""

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed

from vllm_moe_fixes.distributed.torch_elastic_buffer import TorchElasticBuffer
from vllm_moe_fixes.eplb import BalancedMoELayer, ExpertLoadStats, ExpertPlacement, physical_weights
from vllm_moe_fixes.fused_moe import (
    DeepEPV2PrepareAndFinalize,
    Fp8MoEWeights,
    FusedMoEModularKernel,
    TritonExperts,
    local_expert_map,
    make_moe_kernel,
)
from vllm_moe_fixes.fused_moe.routing import fused_topk
from vllm_moe_fixes.testing import random_fp8_moe_weights

E, R, K, I, TOPK, N = 8, 4, 2048, 128, 3, 16


def logical_weights(seed=0):
    return Fp8MoEWeights(*random_fp8_moe_weights(E, K, I,
                                                 generator=torch.Generator().manual_seed(seed)))


def random_placement(world, seed=1):
    """E logical experts on E + R slots, shuffled, with R replicas of random experts."""
    g = torch.Generator().manual_seed(seed)
    p2l = torch.cat([torch.arange(E), torch.randint(0, E, (R,), generator=g)])
    return ExpertPlacement.from_physical_to_logical(p2l[torch.randperm(E + R, generator=g)],
                                                    world)


def tokens(seed, M, skew, topk=TOPK):
    """x bf16 [M, K], weights f32 [M, k], int64 ids [M, k]: router top-k, or every id 0
    ("zeros"); some ids -1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).bfloat16()
    w, ids = fused_topk(torch.randn(M, E, generator=g), topk, renormalize=True)
    ids = ids.long()
    if skew == "zeros":
        ids.zero_()
    ids[torch.rand(M, topk, generator=g) < 0.1] = -1
    return x, w, ids


def bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def run_plain(kernel, logical, x, w, ids, rank, world):
    """The un-replicated layer: rank r holds logical experts [r*E/W, (r+1)*E/W)."""
    local = E // world
    sl = slice(rank * local, (rank + 1) * local)
    emap = local_expert_map(dist.group.WORLD, E) if world > 1 else None
    return kernel(x, logical.w1[sl], logical.w2[sl], w, ids, w1_scale=logical.w1_scale[sl],
                  w2_scale=logical.w2_scale[sl], global_num_experts=E, expert_map=emap)


@pytest.mark.parametrize("M, skew", [(1, "router"), (13, "router"), (13, "zeros"), (0, "router")])
def test_one_rank_equals_unreplicated(M, skew):
    logical = logical_weights()
    placement = random_placement(1)
    x, w, ids = tokens(M + 7, M, skew)
    plain = make_moe_kernel(None, hidden_size=K, intermediate_size=I, num_experts=E)
    want = run_plain(plain, logical, x, w, ids, 0, 1)
    stats = ExpertLoadStats(2, E, 4)
    layer = BalancedMoELayer(
        make_moe_kernel(None, hidden_size=K, intermediate_size=I, num_experts=E + R), placement,
        physical_weights(logical, placement, 0), load_stats=stats, layer_index=1)
    assert torch.equal(layer(x, w, ids), want)
    assert torch.equal(stats.load(1), torch.bincount(ids[ids >= 0], minlength=E))


def _kernels(kind, world, num_experts):
    group = dist.group.WORLD
    if kind == "v2":
        buffer = TorchElasticBuffer(None, num_max_tokens_per_rank=N, hidden=K, num_topk=TOPK,
                                    use_fp8_dispatch=True)
        pf = DeepEPV2PrepareAndFinalize(buffer, num_dispatchers=world, rank_expert_offset=(
            dist.get_rank() * num_experts // world))
        return FusedMoEModularKernel(pf, TritonExperts())
    return make_moe_kernel(group, hidden_size=K, intermediate_size=I, num_experts=num_experts,
                           max_tokens_per_rank=N, backend="naive", low_latency=kind == "ll")


def _check_replicas_equal(placement, weights, logical):
    """Every replica's bytes equal every other replica of its logical expert (and the logical
    expert's own weights), across all ranks."""
    for mine, full in zip(weights, logical):
        gathered = [torch.empty_like(bits(mine)) for _ in range(placement.world_size)]
        dist.all_gather(gathered, bits(mine).contiguous())
        slots = torch.cat(gathered)
        for e, row in enumerate(placement.logical_to_physical.tolist()):
            replicas = [slots[p] for p in row if p >= 0]
            assert all(torch.equal(r, replicas[0]) for r in replicas)
            assert torch.equal(replicas[0], bits(full)[e])


def same_rank_placement(world):
    """Each rank holds the un-replicated layer's logical experts plus replicas of the first
    R / world of them: every (token, slot) is served on the same rank as without replicas."""
    block = E // world
    return ExpertPlacement.from_physical_to_logical(torch.cat([
        torch.cat([torch.arange(r * block, (r + 1) * block),
                   torch.arange(r * block, r * block + R // world)]) for r in range(world)]),
        world)


def _check_same(got, want, exact):
    """Bit for bit where each token's slots are summed on the same ranks as without replicas,
    and always for the low-latency combine (it adds a token's k rows in slot order on the source
    rank, as DeepEP's); else within the rounding of the per-rank partial sums that the
    high-throughput combine (DeepEP's too) adds up: which rank serves a slot changes how a
    token's k rows are grouped."""
    if exact:
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    else:
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-8 * scale)


def _layer_worker(rank, world):
    logical = logical_weights()
    # LL's un-replicated layer needs M * k <= N under zero ids (every slot on one expert).
    problems = [(rank, 5 + 3 * rank, "router", TOPK), (rank + 10, 2 + rank, "zeros", TOPK),
                (rank + 20, 7, "zeros", 1), (rank + 30, 6, "router", 1)]
    for placement, same_ranks in ((random_placement(world), False),
                                  (same_rank_placement(world), True)):
        mine = physical_weights(logical, placement, rank)
        _check_replicas_equal(placement, mine, logical)
        for kind in ("ht", "ll", "v2"):
            layer = BalancedMoELayer(_kernels(kind, world, E + R), placement, mine, rank=rank)
            plain = _kernels(kind, world, E)
            for seed, M, skew, topk in problems:
                x, w, ids = tokens(seed, M, skew, topk)
                want = run_plain(plain, logical, x, w, ids, rank, world)
                _check_same(layer(x, w, ids), want, exact=same_ranks or topk == 1 or kind == "ll")


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_equal_unreplicated(world):
    run_distributed(_layer_worker, world)


def test_bad_layers():
    logical = logical_weights()
    placement = random_placement(1)
    kernel = make_moe_kernel(None, hidden_size=K, intermediate_size=I, num_experts=E + R)
    mine = physical_weights(logical, placement, 0)
    with pytest.raises(ValueError, match=r"placement.world_size=2 but the kernel dispatches "
                                         r"over 1 ranks"):
        BalancedMoELayer(kernel, random_placement(2), mine)
    with pytest.raises(ValueError, match="weights hold 11 experts but rank 0 has 12"):
        BalancedMoELayer(kernel, placement, Fp8MoEWeights(*(t[1:] for t in mine)))
    with pytest.raises(ValueError, match="load_stats counts 5 experts, the placement 8"):
        BalancedMoELayer(kernel, placement, mine, load_stats=ExpertLoadStats(1, 5, 1))
    layer = BalancedMoELayer(kernel, placement, mine)
    x, w, ids = tokens(0, 3, "router")
    ids[0, 0] = E
    with pytest.raises(ValueError, match=r"topk_ids must be logical ids in \[-1, 8\), got"):
        layer(x, w, ids)

