"""Tests for fused_moe/grouped_topk.py: DeepSeek-V3 routing against an independent per-token loop,
the Triton launcher (interpreter on CPU) against the torch path, ties, errors, the planner's
routing simulation, a whole DeepSeek-shaped layer, and GPU checks (marker gpu)."""

import math

import numpy as np
import pytest
import torch

from vllm_moe_fixes.config import PRESETS, MoEModelConfig
from vllm_moe_fixes.fused_moe.contiguous_experts import TritonExperts
from vllm_moe_fixes.fused_moe.grouped_topk import (
    grouped_topk,
    grouped_topk_ref,
    grouped_topk_triton,
)
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.fused_moe.no_ep_prepare_finalize import NoEPPrepareAndFinalize
from vllm_moe_fixes.planner import SimulatedRouter
from vllm_moe_fixes.testing import calc_diff, moe_reference, random_fp8_moe_weights, rel_err


# ----------------------------------------------------------------------------------------------
# An independent implementation: one token at a time, numpy float64 scores, Python sorting.
# ----------------------------------------------------------------------------------------------
def _route_token(logits, k, G, TG, bias, scoring):
    """(ids, unnormalised float32 weights) of one token (logits float64 [E])."""
    if scoring == "softmax":
        e = np.exp(logits - logits.max())
        score = (e / e.sum()).astype(np.float32)
    else:
        score = (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    choice = score if bias is None else score + bias  # float32 + float32
    choice = np.where(np.isnan(choice), np.float32(-np.inf), choice)
    S = len(logits) // G
    group_score = [np.float32(sum(sorted(choice[g * S:(g + 1) * S], reverse=True)[:2],
                                  np.float32(0))) for g in range(G)]
    if G == 1:
        kept = [0]
    else:
        kept = sorted(range(G), key=lambda g: (-group_score[g], g))[:TG]
    candidates = [e for g in kept for e in range(g * S, (g + 1) * S)]
    ids = sorted(candidates, key=lambda e: (-choice[e], e))[:k]
    return ids, score[ids]


def expected_routing(logits, k, *, num_expert_group, topk_group, renormalize, bias=None,
                     scoring="sigmoid", scale=1.0):
    """(weights float32 [M, k], ids int64 [M, k]) by `_route_token`, row by row."""
    x = logits.detach().cpu().double().numpy()
    b = None if bias is None else bias.cpu().numpy()
    all_ids, all_w = [], []
    for row in x:
        ids, w = _route_token(row, k, num_expert_group, topk_group, b, scoring)
        if renormalize:
            total = np.float32(0)
            for v in w:
                total = np.float32(total + v)
            w = w / np.float32(total + np.float32(1e-20))
        all_ids.append(ids)
        all_w.append(w * np.float32(scale))
    return (torch.tensor(np.array(all_w, dtype=np.float32).reshape(len(x), k)),
            torch.tensor(np.array(all_ids, dtype=np.int64).reshape(len(x), k)))


def make_inputs(M, E, *, dtype=torch.float32, bias=True, ties=False, seed=0, device="cpu"):
    """Router logits [M, E] (quantised to multiples of 1/2 in [-2, 2] when ties) and a bias."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        logits = torch.randint(-4, 5, (M, E), generator=g).float() / 2
        b = torch.randint(-2, 3, (E,), generator=g).float() / 8
    else:
        logits = torch.randn(M, E, generator=g) * 2
        b = torch.randn(E, generator=g) / 8
    return logits.to(dtype).to(device), (b.to(device) if bias else None)


def route_kwargs(G, TG, *, renormalize=True, bias=None, scoring="sigmoid", scale=1.0):
    return dict(renormalize=renormalize, num_expert_group=G, topk_group=TG, scoring_func=scoring,
                e_score_correction_bias=bias, routed_scaling_factor=scale)


def run_launcher(logits, k, strided_out=False, **kw):
    """The launcher into NaN / -1 poisoned outputs (every other column of wider buffers when
    strided_out); the buffers' other columns must stay poisoned."""
    M, device = logits.shape[0], logits.device
    cols = 2 * k if strided_out else k
    w_buf = torch.full((M, cols), float("nan"), device=device)
    i_buf = torch.full((M, cols), -1, dtype=torch.int64, device=device)
    w, i = (w_buf[:, ::2], i_buf[:, ::2]) if strided_out else (w_buf, i_buf)
    grouped_topk_triton(logits, w, i, **kw)
    if strided_out:
        assert w_buf[:, 1::2].isnan().all() and (i_buf[:, 1::2] == -1).all()
    return w, i


def assert_same_routing(got, want):
    (gw, gi), (ww, wi) = got, want
    assert gw.dtype == torch.float32 and gi.dtype == torch.int64 and gi.shape == wi.shape
    assert torch.equal(gi.cpu(), wi.cpu())
    torch.testing.assert_close(gw.cpu(), ww.cpu(), rtol=1e-6, atol=1e-30)  # a few float32 ulps


# ----------------------------------------------------------------------------------------------
# Torch path against the independent loop
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("M,E,G,TG,k", [(1, 16, 4, 2, 4), (37, 64, 8, 3, 8), (9, 256, 8, 4, 8),
                                        (5, 160, 8, 3, 6), (6, 64, 1, 1, 6), (0, 16, 4, 2, 4)])
@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("ties", [False, True])
def test_torch_path_matches_independent_loop(M, E, G, TG, k, scoring, ties):
    logits, bias = make_inputs(M, E, dtype=torch.bfloat16, ties=ties, seed=M + E)
    kw = route_kwargs(G, TG, bias=bias, scoring=scoring, scale=2.5)
    got = grouped_topk(logits, k, **kw)
    assert_same_routing(got, expected_routing(logits, k, num_expert_group=G, topk_group=TG,
                                              renormalize=True, bias=bias, scoring=scoring,
                                              scale=2.5))


@pytest.mark.parametrize("renormalize", [False, True])
def test_weights_are_unbiased_scores_renormalised_then_scaled(renormalize):
    logits, _ = make_inputs(23, 32, seed=3)
    bias = torch.zeros(32)
    bias[5] = 10.0  # expert 5 wins every token's choice, its weight stays sigmoid(logit)
    w, ids = grouped_topk(logits, 4, **route_kwargs(4, 2, renormalize=renormalize, bias=bias,
                                                    scale=2.5))
    assert (ids[:, 0] == 5).all()
    raw = torch.sigmoid(logits.double()).float().gather(1, ids)
    if renormalize:
        torch.testing.assert_close(w.sum(1), torch.full((23,), 2.5))
        raw = raw / raw.sum(1, keepdim=True)
    torch.testing.assert_close(w, raw * 2.5)


def test_group_score_is_the_sum_of_the_two_best():
    # Group 0 holds the single best expert; group 1 the better pair. DeepSeek-V3 keeps group 1.
    logits = torch.tensor([[3.0, -3.0, 1.5, 1.5, -3.0, -3.0, -3.0, -3.0]])
    _, ids = grouped_topk(logits, 2, **route_kwargs(4, 1))
    assert ids.tolist() == [[2, 3]]  # equal scores: lower expert id first
    _, ids = grouped_topk(logits, 2, **route_kwargs(4, 2))
    assert ids.tolist() == [[0, 2]]


def test_ties_lowest_index_wins():
    logits = torch.zeros(3, 64)
    w, ids = grouped_topk(logits, 8, **route_kwargs(8, 3))
    assert ids.tolist() == [list(range(8))] * 3  # group 0 first, then its experts in order
    torch.testing.assert_close(w, torch.full((3, 8), 1 / 8))
    logits[:, 40:48] = 1.0  # group 5 is now the best; among the equal rest, groups 0 and 1
    _, ids = grouped_topk(logits, 10, **route_kwargs(8, 3))
    assert ids.tolist() == [list(range(40, 48)) + [0, 1]] * 3


def test_nan_logits_rank_last(kernel_device):
    logits, bias = make_inputs(4, 16, seed=4)
    logits[:, :3] = float("nan")
    logits[1] = float("nan")
    want = expected_routing(logits, 4, num_expert_group=4, topk_group=2, renormalize=False,
                            bias=bias)
    w, ids = grouped_topk(logits, 4, **route_kwargs(4, 2, renormalize=False, bias=bias))
    assert torch.equal(ids, want[1])
    assert not torch.isin(ids[[0, 2, 3]], torch.arange(3)).any()
    assert ((ids >= 0) & (ids < 16)).all()
    kw = route_kwargs(4, 2, renormalize=False, bias=bias.to(kernel_device))
    _, ids2 = run_launcher(logits.to(kernel_device), 4, **kw)
    assert torch.equal(ids2.cpu(), ids)


# ----------------------------------------------------------------------------------------------
# The Triton launcher (interpreter on CPU) against the torch path
# ----------------------------------------------------------------------------------------------
LAUNCH_CASES = [  # M, E, G, TG, k
    (1, 16, 4, 1, 2), (7, 16, 4, 2, 4), (0, 16, 4, 2, 4), (33, 64, 8, 4, 8), (5, 64, 8, 1, 8),
    (3, 64, 8, 8, 16), (6, 64, 4, 3, 5), (2, 256, 8, 4, 8), (3, 160, 8, 3, 6), (4, 64, 1, 1, 6),
    (2, 512, 16, 4, 8),
]


@pytest.mark.parametrize("M,E,G,TG,k", LAUNCH_CASES)
@pytest.mark.parametrize("ties", [False, True])
def test_launcher_matches_torch_path(M, E, G, TG, k, ties, kernel_device):
    logits, bias = make_inputs(M, E, dtype=torch.bfloat16, ties=ties, seed=k + E,
                               device=kernel_device)
    kw = route_kwargs(G, TG, bias=bias, scale=2.5)
    assert_same_routing(run_launcher(logits, k, strided_out=True, **kw),
                        grouped_topk_ref(logits, k, **kw))


@pytest.mark.parametrize("E,G,TG", [(16, 4, tg) for tg in range(1, 5)]
                         + [(64, 8, tg) for tg in range(1, 9)])
def test_launcher_every_topk_group(E, G, TG, kernel_device):
    logits, bias = make_inputs(9, E, ties=TG % 2 == 0, seed=TG, device=kernel_device)
    k = min(TG * E // G, 5)
    kw = route_kwargs(G, TG, bias=bias)
    got = run_launcher(logits, k, **kw)
    assert_same_routing(got, grouped_topk_ref(logits, k, **kw))
    assert_same_routing(got, expected_routing(logits, k, num_expert_group=G, topk_group=TG,
                                              renormalize=True, bias=bias))


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_launcher_options(scoring, renormalize, with_bias, kernel_device):
    logits, bias = make_inputs(11, 32, bias=with_bias, seed=7, device=kernel_device)
    kw = route_kwargs(4, 2, renormalize=renormalize, bias=bias, scoring=scoring, scale=1.5)
    assert_same_routing(run_launcher(logits, 5, **kw), grouped_topk_ref(logits, 5, **kw))


@pytest.mark.parametrize("block_m", [1, 2, 8])
def test_launcher_strided_logits_and_block_sizes(block_m, kernel_device):
    # logits: a transposed [E, M] buffer seen as [M, E], float16; bias: every other element.
    base, _ = make_inputs(64, 13, dtype=torch.float16, seed=8, device=kernel_device)
    logits = base.t()
    bias = (torch.randn(128, generator=torch.Generator().manual_seed(8)) / 8)[::2]
    kw = route_kwargs(8, 2, bias=bias.to(kernel_device))
    w = torch.full((13, 4), float("nan"), device=kernel_device)
    i = torch.full((13, 4), -1, dtype=torch.int64, device=kernel_device)
    grouped_topk_triton(logits, w, i, block_m=block_m, **kw)
    assert_same_routing((w, i), grouped_topk_ref(logits, 4, **kw))


# ----------------------------------------------------------------------------------------------
# The API: outputs, empty input, errors
# ----------------------------------------------------------------------------------------------
def test_api_cpu_outputs_and_empty():
    logits, bias = make_inputs(5, 16, seed=9)
    w, ids = grouped_topk(logits, 3, **route_kwargs(4, 2, bias=bias))
    assert w.shape == ids.shape == (5, 3) and w.dtype == torch.float32 and ids.dtype == torch.int64
    w, ids = grouped_topk(torch.empty(0, 16), 3, **route_kwargs(4, 2))
    assert w.shape == ids.shape == (0, 3)


def test_bad_arguments():
    logits = torch.randn(4, 16)
    good = dict(topk=4, renormalize=True, num_expert_group=4, topk_group=2,
                scoring_func="sigmoid", e_score_correction_bias=torch.zeros(16),
                routed_scaling_factor=2.5)

    def bad(match, gating=logits, **changes):
        args = {**good, **changes}
        with pytest.raises(ValueError, match=match):
            grouped_topk(gating, args.pop("topk"), **args)

    bad("gating_output", gating=logits.double())
    bad("gating_output", gating=logits.to(torch.int32))
    bad("gating_output", gating=logits[0])
    bad("gating_output", gating=[[0.0] * 16])
    bad("gating_output", gating=torch.randn(4, 16, device="meta"))
    bad("E=1024", gating=torch.randn(2, 1024), num_expert_group=8)
    bad("not divisible by num_expert_group", num_expert_group=3)
    bad("at least 2", num_expert_group=16, topk_group=1, topk=1)
    bad("num_expert_group", num_expert_group=0)
    bad("topk_group", topk_group=5)
    bad("topk_group", topk_group=0)
    bad("topk=9 exceeds the 8 experts", topk=9)
    bad("topk", topk=0)
    bad("topk", topk=2.0)
    bad("renormalize", renormalize=1)
    bad("scoring_func", scoring_func="relu")
    bad("routed_scaling_factor", routed_scaling_factor=0.0)
    bad("routed_scaling_factor", routed_scaling_factor=float("inf"))
    bad("routed_scaling_factor", routed_scaling_factor=True)
    for b in (torch.zeros(15), torch.zeros(16, dtype=torch.bfloat16), torch.zeros(1, 16),
              torch.zeros(16, device="meta"), [0.0] * 16):
        bad("e_score_correction_bias", e_score_correction_bias=b)


# ----------------------------------------------------------------------------------------------
# The planner's numpy routing simulation chooses the same experts
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [
    MoEModelConfig("small-grouped", hidden_size=64, moe_intermediate_size=128, num_experts=16,
                   top_k=4, vocab_size=1000, num_layers=2, scoring="sigmoid", n_group=4,
                   topk_group=2),
    PRESETS["deepseek-v3"],
], ids=lambda c: c.name)
def test_planner_simulation_chooses_the_same_experts(cfg):
    router = SimulatedRouter(cfg, seed=3)
    logits = torch.randn(256, cfg.num_experts, generator=torch.Generator().manual_seed(5))
    simulated = np.sort(router.route_logits(logits.numpy()), axis=1)
    _, ids = grouped_topk(logits, cfg.top_k, **route_kwargs(cfg.n_group, cfg.topk_group))
    assert np.array_equal(simulated, np.sort(ids.numpy(), axis=1))


# ----------------------------------------------------------------------------------------------
# A DeepSeek-shaped layer: grouped_topk + the modular kernel against moe_reference
# ----------------------------------------------------------------------------------------------
def test_deepseek_shaped_layer_against_reference():
    M, K, I, E, G, TG, k, scale = 21, 256, 128, 32, 4, 2, 4, 2.5
    g = torch.Generator().manual_seed(11)
    w1, w1s, w2, w2s = random_fp8_moe_weights(E, K, I, generator=g)
    x = torch.randn(M, K, generator=g).bfloat16()
    logits = torch.randn(M, E, generator=g).bfloat16()
    bias = torch.randn(E, generator=g) / 8

    weights, ids = grouped_topk(logits, k, **route_kwargs(G, TG, bias=bias, scale=scale))
    kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(), TritonExperts())
    out = kernel(x, w1, w2, weights, ids, w1_scale=w1s, w2_scale=w2s, global_num_experts=E)

    want_w, want_ids = expected_routing(logits, k, num_expert_group=G, topk_group=TG,
                                        renormalize=True, bias=bias, scale=scale)
    ref = moe_reference(x, w1, w2, want_w, want_ids, w1_scale=w1s, w2_scale=w2s)
    assert calc_diff(out, ref) < 4e-3 and rel_err(out, ref) < 9e-2, (calc_diff(out, ref),
                                                                      rel_err(out, ref))


# ----------------------------------------------------------------------------------------------
# GPU: the kernel against the torch path on the same CUDA tensors and against the CPU path
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("M,E,G,TG,k", [(1, 256, 8, 4, 8), (4097, 256, 8, 4, 8),
                                        (65536, 256, 8, 4, 8), (1000, 160, 8, 3, 6),
                                        (777, 512, 16, 4, 8), (513, 64, 1, 1, 6),
                                        (3000, 64, 8, 1, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_gpu_bit_exact_ids(M, E, G, TG, k, dtype, ties, scoring):
    logits, bias = make_inputs(M, E, dtype=dtype, ties=ties, seed=M, device="cuda")
    kw = route_kwargs(G, TG, bias=bias, scoring=scoring, scale=2.5)
    got = grouped_topk(logits, k, **kw)
    assert_same_routing(got, grouped_topk_ref(logits, k, **kw))
    cpu_kw = route_kwargs(G, TG, bias=None if bias is None else bias.cpu(), scoring=scoring,
                          scale=2.5)
    assert_same_routing(got, grouped_topk(logits.cpu(), k, **cpu_kw))


@pytest.mark.gpu
@pytest.mark.parametrize("block_m,num_warps", [(1, 1), (2, 4), (8, 8)])
def test_gpu_launch_configs(block_m, num_warps):
    logits, bias = make_inputs(3001, 256, dtype=torch.bfloat16, seed=5, device="cuda")
    kw = route_kwargs(8, 4, bias=bias, scale=2.5)
    w, i = run_launcher(logits, 8, strided_out=True, **kw)
    assert_same_routing((w, i), grouped_topk_ref(logits, 8, **kw))
    w = torch.full((3001, 8), float("nan"), device="cuda")
    i = torch.full((3001, 8), -1, dtype=torch.int64, device="cuda")
    grouped_topk_triton(logits, w, i, block_m=block_m, num_warps=num_warps, **kw)
    assert_same_routing((w, i), grouped_topk_ref(logits, 8, **kw))


@pytest.mark.gpu
def test_gpu_past_int32_elements():
    E, tail = 256, 1024
    M = 2**31 // E + 1  # bf16 logits [M, 256]: 4 GiB, M * E > 2**31
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(M, E, generator=g, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(E, generator=g, device="cuda") / 8
    kw = route_kwargs(8, 4, bias=bias, scale=2.5)
    w, ids = grouped_topk(logits, 8, **kw)
    for rows in (slice(0, tail), slice(M - tail, M)):
        assert_same_routing((w[rows], ids[rows]), grouped_topk_ref(logits[rows], 8, **kw))
    assert math.prod(logits.shape) > 2**31
