"""The modular kernel against callers and ranks that get something wrong: ranks with
different chunk sizes, a huge max_tokens_across_ranks on one rank, inputs that require grad or
come from inference mode, refused calls, non-finite inputs; and batch invariance (a token's
output does not depend on how the call was chunked).

Multi-rank cases run on gloo ranks whose group times out well before anything else would
(GROUP_TIMEOUT): a rank left waiting in a collective fails the test in seconds, not a hang.
"""

import datetime
import math
import os

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from test_ep_chunking import _counting
from test_ep_kernel import local_slice, make_weights
from test_torch_buffer import make_problem as make_rank_problems

from vllm_moe_fixes import envs
from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer
from vllm_moe_fixes.fused_moe.batched_experts import BatchedTritonExperts
from vllm_moe_fixes.fused_moe.contiguous_experts import TritonExperts
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import (
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
)
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.fused_moe.no_ep_prepare_finalize import NoEPPrepareAndFinalize
from vllm_moe_fixes.fused_moe.routing import fused_topk
from vllm_moe_fixes.fused_moe.workspaces import Workspaces
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE
from vllm_moe_fixes.ops.grouped_gemm import (
    grouped_fp8_gemm_contiguous_ref,
    grouped_fp8_gemm_masked_ref,
)
from vllm_moe_fixes.testing import moe_reference, random_fp8_moe_weights, rel_err

GROUP_TIMEOUT = datetime.timedelta(seconds=30)
E, K_TOP = 8, 2


def _problem(M, *, E=E, k=K_TOP, K=256, I=128, seed=0, device="cpu"):
    """One rank's layer call: every expert local, fresh random tokens and routing."""
    g = torch.Generator().manual_seed(seed)
    w1, w1_scale, w2, w2_scale = random_fp8_moe_weights(E, K, I, generator=g)
    x = torch.randn(M, K, generator=g).bfloat16()
    weights, ids = fused_topk(torch.randn(M, E, generator=g), k, renormalize=True)
    p = dict(hidden_states=x, w1=w1, w2=w2, topk_weights=weights, topk_ids=ids,
             w1_scale=w1_scale, w2_scale=w2_scale)
    return {name: t.to(device) for name, t in p.items()}


def _run(kernel, p, **kw):
    return kernel(p["hidden_states"], p["w1"], p["w2"], p["topk_weights"], p["topk_ids"],
                  w1_scale=p["w1_scale"], w2_scale=p["w2_scale"],
                  global_num_experts=p["w1"].shape[0], **kw)


def _kernel(workspaces=None, pf=None):
    return FusedMoEModularKernel(pf or NoEPPrepareAndFinalize(), TritonExperts(), workspaces)


def _reference(p):
    return moe_reference(p["hidden_states"], p["w1"], p["w2"], p["topk_weights"], p["topk_ids"],
                         w1_scale=p["w1_scale"], w2_scale=p["w2_scale"])


def _close(out, x, w1, s1, w2, s2, ids, weights):
    """out against the float32 reference of all experts (activations FP8-quantised twice, up
    to 0.08 on these problems)."""
    ref = moe_reference(x, w1, w2, weights, ids, w1_scale=s1, w2_scale=s2)
    assert rel_err(out, ref) < 0.09, rel_err(out, ref)


# --- ranks that disagree on the chunk size ------------------------------------------------------

def _chunk_mismatch_worker(rank, world, mode):
    group = dist.new_group(timeout=GROUP_TIMEOUT)
    os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = "4" if rank == 0 else "8"
    e_l = E // world
    if mode == "high_throughput":
        hidden, method = 256, "dispatch"
        buffer = _counting(TorchAll2AllBuffer(group), method)
        pf = DeepEPHTPrepareAndFinalize(buffer, num_dispatchers=world,
                                        rank_expert_offset=rank * e_l)
        experts = TritonExperts()
    else:  # a pass of the low-latency path holds min(chunk size, max_tokens_per_rank) tokens
        hidden, method = 2048, "low_latency_dispatch"
        buffer = _counting(TorchAll2AllBuffer(group, low_latency_mode=True,
                                              num_max_dispatch_tokens_per_rank=8, hidden=hidden,
                                              num_experts=E), method)
        pf = DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=world, max_tokens_per_rank=8)
        experts = BatchedTritonExperts()
    kernel = FusedMoEModularKernel(pf, experts)
    xs, ids, ws = make_rank_problems(40, [13, 9], E, K_TOP, hidden)
    x, idx, w = xs[rank], ids[rank], ws[rank]
    full = make_weights(40, E, hidden, "cpu")
    lw1, ls1, lw2, ls2, expert_map = local_slice(rank, world, E, *full)

    def call(given):
        return kernel(x, lw1, lw2, w, idx, w1_scale=ls1, w2_scale=ls2, global_num_experts=E,
                      expert_map=expert_map, max_tokens_across_ranks=given)

    # Agreed with the count (refused before any dispatch), or, the count given, compared in the
    # first dispatch (the torch buffer's PassStamp): refused there, on both ranks.
    for given, dispatches in ((None, 0), (13, 1)):
        with pytest.raises(ValueError, match=r"VLLM_FUSED_MOE_CHUNK_SIZE.*\b4\b.*\b8\b"):
            call(given)
        assert buffer.calls == dispatches
    os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = "4"
    for given in (None, 13):
        before = buffer.calls
        _close(call(given), x, *full, idx, w)
        assert buffer.calls - before == 4


@pytest.mark.parametrize("mode", ["high_throughput", "low_latency"])
def test_ranks_with_different_chunk_sizes_are_refused(mode):
    run_distributed(_chunk_mismatch_worker, 2, mode)


# --- one rank: max_tokens_across_ranks means nothing --------------------------------------------

class _CountingNoEP(NoEPPrepareAndFinalize):
    """Counts prepare calls; a loop over empty chunks fails after a few instead of running on."""

    def __init__(self):
        self.calls = 0

    def prepare(self, a1, *args):
        self.calls += 1
        assert self.calls <= 10, "the kernel loops over empty chunks"
        return super().prepare(a1, *args)


@pytest.mark.parametrize("M", [0, 7])
def test_huge_max_tokens_across_ranks_on_one_rank_is_ignored(M, monkeypatch):
    monkeypatch.setenv("VLLM_FUSED_MOE_CHUNK_SIZE", "3")
    p = _problem(M, seed=41)
    want = _run(_kernel(), p)
    for given in (M, 10 ** 12):
        pf = _CountingNoEP()
        assert torch.equal(_run(_kernel(pf=pf), p, max_tokens_across_ranks=given), want)
        assert pf.calls == math.ceil(M / 3)


# --- state that outlives a call -----------------------------------------------------------------

@pytest.mark.parametrize("name", ["hidden_states", "topk_weights", "w1_scale"])
def test_inputs_that_require_grad_leave_shared_workspaces_usable(name):
    """The layer runs without autograd: such a call gives the plain call's output (requiring no
    grad), and every later call of any kernel sharing the workspaces is unaffected."""
    p = _problem(9, seed=42)
    shared = Workspaces()
    a, b = _kernel(shared), _kernel(shared)
    want = _run(a, p)
    out = _run(a, dict(p, **{name: p[name].clone().requires_grad_()}))
    assert torch.equal(out, want) and not out.requires_grad
    assert torch.is_grad_enabled()  # the caller's mode, restored
    assert torch.equal(_run(a, p), want) and torch.equal(_run(b, p), want)


def test_inference_mode_calls_leave_shared_workspaces_usable():
    """Workspaces first allocated inside torch.inference_mode serve calls outside it (and calls
    with grad inputs), and the other way round."""
    p = _problem(9, seed=43)
    want = _run(_kernel(), p)
    for first_inside in (True, False):
        shared = Workspaces()
        a, b = _kernel(shared), _kernel(shared)
        with torch.inference_mode(first_inside):
            assert torch.equal(_run(a, p), want)
        with torch.inference_mode(not first_inside):
            assert torch.equal(_run(b, p), want)
        x = p["hidden_states"].clone().requires_grad_()
        assert torch.equal(_run(a, dict(p, hidden_states=x)), want)
        with torch.inference_mode():
            assert torch.equal(_run(b, p), want)


def _inference_mode_ll_worker(rank, world):
    """The naive low-latency buffer's workspaces, first allocated in inference mode."""
    hidden = 2048
    buffer = TorchAll2AllBuffer(None, low_latency_mode=True, num_max_dispatch_tokens_per_rank=8,
                                hidden=hidden, num_experts=E)
    kernel = FusedMoEModularKernel(
        DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=1, max_tokens_per_rank=8),
        BatchedTritonExperts())
    xs, ids, ws = make_rank_problems(44, [6], E, K_TOP, hidden)
    full = make_weights(44, E, hidden, "cpu")
    lw1, ls1, lw2, ls2, expert_map = local_slice(0, 1, E, *full)

    def call():
        return kernel(xs[0], lw1, lw2, ws[0], ids[0], w1_scale=ls1, w2_scale=ls2,
                      global_num_experts=E, expert_map=expert_map)

    with torch.inference_mode():
        inside = call().clone()
    for _ in range(3):  # both of the buffer's workspaces, outside inference mode
        assert torch.equal(call(), inside)
    _close(inside, xs[0], *full, ids[0], ws[0])


def test_inference_mode_low_latency_buffer():
    run_distributed(_inference_mode_ll_worker, 1)


def _nan_at(t, index):
    t = t.clone()
    t[index] = float("nan")
    return t


# Calls the layer refuses, each as (changed arguments, environment, pretend a capture, the
# refusal's message).
REFUSED = {
    "malformed argument": (lambda p: dict(p, hidden_states=p["hidden_states"].float()), {},
                           False, r"hidden_states must be bfloat16 \[M, K\], got torch.float32"),
    "expert id out of range": (lambda p: dict(p, topk_ids=p["topk_ids"].clone().fill_(99)), {},
                               False, r"topk_ids must hold expert ids in \[-1, "),
    "bad environment value": (lambda p: p, {"VLLM_FUSED_MOE_CHUNK_SIZE": "0"}, False,
                              "VLLM_FUSED_MOE_CHUNK_SIZE='0'"),
    "non-finite input": (lambda p: dict(p, hidden_states=_nan_at(p["hidden_states"], (1, 2))),
                         {"VLLM_MOE_CHECK_FINITE": "1"}, False,
                         r"hidden_states must be finite \(VLLM_MOE_CHECK_FINITE=1\)"),
    "checked mode under capture": (lambda p: p, {"VLLM_MOE_CHECK_IDS": "1"}, True,
                                   "VLLM_MOE_CHECK_IDS=1 reads the layer's inputs on the host"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_a_good_call_works_after_each_refused_call(kind, monkeypatch):
    p = _problem(11, seed=45)
    shared = Workspaces()
    a, b = _kernel(shared), _kernel(shared)
    want = _run(a, p)
    change, env, capture, message = REFUSED[kind]
    with monkeypatch.context() as m:
        for name, value in env.items():
            m.setenv(name, value)
        if capture:
            m.setattr(torch.backends.cuda, "is_built", lambda: True)
            m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.raises(ValueError, match=message):
            _run(a, change(p))
    assert torch.equal(_run(a, p), want) and torch.equal(_run(b, p), want)


# --- non-finite inputs --------------------------------------------------------------------------

NON_FINITE = [float("nan"), float("inf"), float("-inf")]
INPUTS = [("hidden_states", (2, 5)), ("topk_weights", (1, 0)), ("w1_scale", (3, 1, 0)),
          ("w2_scale", (3, 0, 0))]


def _with(p, name, index, value):
    t = p[name].clone()
    t[index] = value
    return dict(p, **{name: t})


@pytest.mark.parametrize("value", NON_FINITE)
def test_non_finite_inputs_unchecked_as_documented(value, monkeypatch):
    """Without VLLM_MOE_CHECK_FINITE (vLLM's quant recipe): a NaN in hidden_states or w1_scale is
    requantised into finite FP8 values before the next GEMM, so every output is finite; +-inf
    there, and NaN or +-inf in w2_scale or topk_weights, reaches the output of exactly the
    tokens that use that entry."""
    monkeypatch.delenv("VLLM_MOE_CHECK_FINITE", raising=False)
    p = _problem(12, seed=46)
    p["topk_ids"][:, 0] = torch.arange(12) % E  # expert 3 serves tokens 3 and 11 (at least)
    uses_3 = set((p["topk_ids"] == 3).any(1).nonzero().flatten().tolist())
    for name, index, users in [("hidden_states", (2, 5), {2}), ("w1_scale", (3, 1, 0), uses_3),
                               ("w2_scale", (3, 0, 0), uses_3), ("topk_weights", (1, 0), {1})]:
        out = _run(_kernel(), _with(p, name, index, value))
        bad_rows = set((~torch.isfinite(out)).any(1).nonzero().flatten().tolist())
        requantised = math.isnan(value) and name in ("hidden_states", "w1_scale")
        assert bad_rows == (set() if requantised else users), (name, bad_rows)


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("name,index", INPUTS)
def test_checked_mode_refuses_non_finite_inputs(name, index, value, monkeypatch):
    monkeypatch.setenv("VLLM_MOE_CHECK_FINITE", "1")
    p = _problem(12, seed=47)
    where = ", ".join(map(str, index))
    with pytest.raises(ValueError, match=rf"{name} must be finite \(VLLM_MOE_CHECK_FINITE=1\).*"
                                         rf"{name}\[{where}\] = {value}"):
        _run(_kernel(), _with(p, name, index, value))
    check_ok = _run(_kernel(), p)  # finite inputs pass the check unchanged
    monkeypatch.setenv("VLLM_MOE_CHECK_FINITE", "0")
    assert torch.equal(check_ok, _run(_kernel(), p))


def test_check_finite_variable_is_registered_and_validated(monkeypatch):
    var = envs.REGISTRY["VLLM_MOE_CHECK_FINITE"]
    assert var.default is False
    monkeypatch.setenv("VLLM_MOE_CHECK_FINITE", "2")
    with pytest.raises(ValueError, match="VLLM_MOE_CHECK_FINITE='2'"):
        _run(_kernel(), _problem(3, seed=48))  # read on the CPU path too


# --- batch invariance ---------------------------------------------------------------------------

@pytest.mark.parametrize("M,seed", [(37, 1), (64, 2), (130, 3)])
def test_chunking_does_not_change_a_single_bit(M, seed, monkeypatch):
    """Every token's output is the same bits whatever the chunk size (CPU: the GEMM references
    sum each 128-wide block of FP8 products exactly)."""
    p = _problem(M, E=16, k=6, K=512, I=256, seed=seed)
    one_pass = _run(_kernel(), p)
    for chunk in (1, 5, 32):
        monkeypatch.setenv("VLLM_FUSED_MOE_CHUNK_SIZE", str(chunk))
        assert torch.equal(_run(_kernel(), p), one_pass), chunk
    assert rel_err(one_pass, _reference(p)) < 0.06


def _fp8_operands(g, rows_shape, n, K, E_):
    a = torch.randn(*rows_shape, K, generator=g) * 3
    a_q = a.clamp(-448, 448).to(FP8_DTYPE)
    a_s = torch.rand(*rows_shape, K // 128, generator=g) + 0.01
    w_q = (torch.randn(E_, n, K, generator=g) * 50).to(FP8_DTYPE)
    w_s = torch.rand(E_, n // 128, K // 128, generator=g) + 0.01
    return (a_q, a_s), (w_q, w_s)


def test_gemm_references_give_a_row_the_same_bits_in_any_batch():
    """float32 outputs (more sensitive than bf16): each row computed alone equals its row of the
    whole batch, for the contiguous and the masked reference."""
    g = torch.Generator().manual_seed(49)
    M, N, K = 48, 256, 1024
    (a_q, a_s), w = _fp8_operands(g, (M,), N, K, 3)
    m_indices = torch.randint(-1, 3, (M,), generator=g, dtype=torch.int32)
    whole = grouped_fp8_gemm_contiguous_ref((a_q, a_s), w, torch.empty(M, N), m_indices)
    for i in range(M):
        alone = grouped_fp8_gemm_contiguous_ref((a_q[i:i + 1], a_s[i:i + 1]), w,
                                                torch.empty(1, N), m_indices[i:i + 1])
        assert torch.equal(alone[0], whole[i]), i
    (b_q, b_s), w = _fp8_operands(g, (3, 40), N, K, 3)
    masked = torch.tensor([40, 0, 17], dtype=torch.int32)
    whole = grouped_fp8_gemm_masked_ref((b_q, b_s), w, torch.zeros(3, 40, N), masked)
    for rows in (1, 9):
        part = grouped_fp8_gemm_masked_ref((b_q, b_s), w, torch.zeros(3, 40, N),
                                           masked.clamp(max=rows))
        assert torch.equal(part[0, :rows], whole[0, :rows])
        assert torch.equal(part[2, :rows], whole[2, :rows])


def _ll_batch_invariance_worker(rank, world):
    """The low-latency layer at world size 1: dispatch chunks of four tokens against one chunk."""
    hidden = 2048
    xs, ids, ws = make_rank_problems(50, [9], E, K_TOP, hidden)
    full = make_weights(50, E, hidden, "cpu")
    lw1, ls1, lw2, ls2, expert_map = local_slice(0, 1, E, *full)
    outs = []
    for n in (4, 16):
        buffer = TorchAll2AllBuffer(None, low_latency_mode=True,
                                    num_max_dispatch_tokens_per_rank=n, hidden=hidden,
                                    num_experts=E)
        kernel = FusedMoEModularKernel(
            DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=1, max_tokens_per_rank=n),
            BatchedTritonExperts())
        outs.append(kernel(xs[0], lw1, lw2, ws[0], ids[0], w1_scale=ls1, w2_scale=ls2,
                           global_num_experts=E, expert_map=expert_map))
    assert torch.equal(outs[0], outs[1])
    _close(outs[1], xs[0], *full, ids[0], ws[0])


def test_low_latency_chunking_does_not_change_a_single_bit():
    run_distributed(_ll_batch_invariance_worker, 1)


@pytest.mark.gpu
def test_gpu_chunking_with_triton_experts_is_bit_exact(monkeypatch):
    """On CUDA the Triton kernels use one tile configuration for every row count and treat each
    row alone, so the chunk size changes no bit (DeepGEMM picks its tiles by M: not promised)."""
    p = _problem(300, E=16, k=8, K=1024, I=512, seed=51, device="cuda")
    one_pass = _run(_kernel(), p)
    for chunk in (1, 77):
        monkeypatch.setenv("VLLM_FUSED_MOE_CHUNK_SIZE", str(chunk))
        assert torch.equal(_run(_kernel(), p), one_pass), chunk
