"""What the library refuses, with an error naming the cause: a mis-wired rank (an expert offset
or expert map that is not its own), a non-finite routing bias, bad environment values on every
path that reads them, arguments of the wrong type, and one exception type for a missing optional
library."""

import os
import re
import types

import pytest
import torch
from _dist import run_distributed

from vllm_moe_fixes._compat import MissingLibraryError
from vllm_moe_fixes._compat import deep_ep as deep_ep_compat
from vllm_moe_fixes._compat import deep_gemm as deep_gemm_compat
from vllm_moe_fixes.config import load_model_config
from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer
from vllm_moe_fixes.fused_moe.contiguous_experts import TritonExperts
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import (
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
)
from vllm_moe_fixes.fused_moe.grouped_topk import grouped_topk
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.fused_moe.no_ep_prepare_finalize import NoEPPrepareAndFinalize
from vllm_moe_fixes.fused_moe.routing import fused_topk
from vllm_moe_fixes.testing import moe_reference, random_fp8_moe_weights, rel_err
from vllm_moe_fixes.worker import maybe_randomize_inputs

K, I = 128, 128  # the smallest layer every backend takes


def _expert_map(num_experts, first, local_num_experts):
    """int32 [E]: global ids first .. first + E_l - 1 -> local 0 .. E_l - 1, the rest -1."""
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
    expert_map[first:first + local_num_experts] = torch.arange(local_num_experts,
                                                               dtype=torch.int32)
    return expert_map


class _UnreachedBuffer:
    """A DeepEP-API buffer of rank ``rank`` in a group of ``group_size`` (the attributes
    deep_ep.Buffer and TorchAll2AllBuffer both have, or neither when None) whose all-to-all must
    not be reached: a mis-wired prepare raises before it."""

    def __init__(self, rank=None, group_size=None):
        if rank is not None:
            self.rank, self.group_size = rank, group_size

    def _unreached(self, *args, **kwargs):
        raise AssertionError("the all-to-all ran on a mis-wired rank")

    get_dispatch_layout = dispatch = combine = _unreached


def _prepare_args(num_experts, tokens=3, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, K, generator=g).bfloat16()
    weights, ids = fused_topk(torch.randn(tokens, num_experts, generator=g), k, True)
    return x, weights, ids


# ------------------------------------------------------------------ rank_expert_offset, one rank
# The cases on rank 1 of 2 (E=8, E_l=4): offset 0 on every rank, and offset = rank.
@pytest.mark.parametrize("offset", [0, 1, 2, 8])
def test_wrong_rank_expert_offset_against_the_buffer_rank(offset):
    pf = DeepEPHTPrepareAndFinalize(_UnreachedBuffer(rank=1, group_size=2), num_dispatchers=2,
                                    rank_expert_offset=offset)
    x, weights, ids = _prepare_args(8)
    with pytest.raises(ValueError, match=rf"rank_expert_offset={offset} .*rank 1.*\b4\b"):
        pf.prepare(x, weights, ids, 8, _expert_map(8, 4, 4), False)


@pytest.mark.parametrize("offset, map_first", [(0, 4), (4, 0)])
def test_wrong_rank_expert_offset_against_the_expert_map(offset, map_first):
    """A buffer that does not say its rank: the offset must still agree with expert_map, which
    puts this rank's E_l experts at global ids rank_expert_offset ... + E_l - 1."""
    pf = DeepEPHTPrepareAndFinalize(_UnreachedBuffer(), num_dispatchers=2,
                                    rank_expert_offset=offset)
    x, weights, ids = _prepare_args(8)
    with pytest.raises(ValueError, match=rf"expert_map.*rank_expert_offset={offset}"):
        pf.prepare(x, weights, ids, 8, _expert_map(8, map_first, 4), False)


@pytest.mark.parametrize("offset", [1, 6, 8])
def test_offset_that_is_no_rank_start_is_refused_without_the_buffer_rank(offset):
    pf = DeepEPHTPrepareAndFinalize(_UnreachedBuffer(), num_dispatchers=2,
                                    rank_expert_offset=offset)
    x, weights, ids = _prepare_args(8)
    with pytest.raises(ValueError, match=rf"rank_expert_offset={offset} must be rank \* E_l"):
        pf.prepare(x, weights, ids, 8, None, False)


def test_expert_map_of_another_rank_is_refused_even_with_the_right_offset():
    pf = DeepEPHTPrepareAndFinalize(_UnreachedBuffer(rank=1, group_size=2), num_dispatchers=2,
                                    rank_expert_offset=4)
    x, weights, ids = _prepare_args(8)
    with pytest.raises(ValueError, match="expert_map"):
        pf.prepare(x, weights, ids, 8, _expert_map(8, 0, 4), False)
    swapped = _expert_map(8, 4, 4)
    swapped[[4, 5]] = swapped[[5, 4]]  # right experts, local ids out of DeepEP's order
    with pytest.raises(ValueError, match="expert_map"):
        pf.prepare(x, weights, ids, 8, swapped, False)


def test_num_dispatchers_must_match_the_buffer_group():
    """Refused when built, in every DeepEP mode: a rank that counts itself alone would skip
    the agreement its peers wait in."""
    with pytest.raises(ValueError, match="num_dispatchers=4.*2 ranks"):
        DeepEPHTPrepareAndFinalize(_UnreachedBuffer(rank=0, group_size=2), num_dispatchers=4,
                                   rank_expert_offset=0)
    buffer = _UnreachedBuffer(rank=0, group_size=2)
    buffer.low_latency_mode = True
    buffer.low_latency_dispatch = buffer.low_latency_combine = buffer._unreached
    with pytest.raises(ValueError, match="num_dispatchers=1.*2 ranks"):
        DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=1, max_tokens_per_rank=4)


def test_expert_map_is_checked_once_per_map_and_again_after_an_in_place_change(monkeypatch):
    """The map check reads the map (a host synchronisation on CUDA): once per map tensor and
    version, not once per call."""
    pf = DeepEPHTPrepareAndFinalize(_UnreachedBuffer(rank=0, group_size=1), num_dispatchers=1,
                                    rank_expert_offset=0)
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real(t))
    expert_map = _expert_map(8, 0, 8)
    x, weights, ids = _prepare_args(8)
    for _ in range(3):
        with pytest.raises(AssertionError, match="all-to-all ran"):  # checked, then dispatched
            pf.prepare(x, weights, ids, 8, expert_map, False)
    assert reads.count((8,)) == 1, reads
    expert_map[0] = -1  # an in-place change: checked again, and now wrong
    with pytest.raises(ValueError, match="expert_map"):
        pf.prepare(x, weights, ids, 8, expert_map, False)


# --------------------------------------------------------------- rank_expert_offset, two gloo ranks
_E, _E_L, _TOKENS = 8, 4, 6
_OFFSETS = {"zero": lambda rank: 0, "rank": lambda rank: rank,
            "right": lambda rank: rank * _E_L}


def _offset_rank(rank, world, offsets):
    g = torch.Generator().manual_seed(23)
    w1, s1, w2, s2 = random_fp8_moe_weights(_E, K, I, generator=g)
    x = torch.randn(world * _TOKENS, K, generator=g).bfloat16()
    weights, ids = fused_topk(torch.randn(world * _TOKENS, _E, generator=g), 2, True)
    mine = slice(rank * _TOKENS, (rank + 1) * _TOKENS)
    local = slice(rank * _E_L, (rank + 1) * _E_L)
    pf = DeepEPHTPrepareAndFinalize(TorchAll2AllBuffer(None), num_dispatchers=world,
                                    rank_expert_offset=_OFFSETS[offsets](rank))
    kernel = FusedMoEModularKernel(pf, TritonExperts())
    out = kernel(x[mine], w1[local].contiguous(), w2[local].contiguous(), weights[mine],
                 ids[mine], w1_scale=s1[local].contiguous(), w2_scale=s2[local].contiguous(),
                 global_num_experts=_E, expert_map=_expert_map(_E, rank * _E_L, _E_L))
    ref = moe_reference(x[mine], w1, w2, weights[mine], ids[mine], w1_scale=s1, w2_scale=s2)
    return rel_err(out, ref)


@pytest.mark.parametrize("offsets", ["zero", "rank"])
def test_wrong_offsets_on_two_gloo_ranks_raise_instead_of_wrong_results(offsets):
    """Before the fix: rel err 0.62-0.84 against the reference, nothing raised. Rank 1 is the
    mis-wired one; rank 0 (right) then fails in the all-to-all because rank 1 left it."""
    with pytest.raises(RuntimeError, match="^rank 1 failed first:") as err:
        run_distributed(_offset_rank, 2, offsets)
    message = str(err.value)
    assert message.startswith("rank 1 failed first:"), message
    assert "ValueError: rank_expert_offset=" in message.strip().splitlines()[-1]


def test_right_offsets_on_two_gloo_ranks_match_the_reference():
    assert all(err < 0.06 for err in run_distributed(_offset_rank, 2, "right"))


# ----------------------------------------------------------------- e_score_correction_bias
def _grouped(bias):
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    return grouped_topk(logits, 4, renormalize=True, num_expert_group=4, topk_group=2,
                        e_score_correction_bias=bias)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_correction_bias_is_refused(bad):
    """Before the fix a NaN bias silently excluded expert 3 (its choice ranked as -inf)."""
    bias = torch.randn(16, generator=torch.Generator().manual_seed(2)) / 8
    _grouped(bias)  # finite: accepted
    bias[3] = bad
    with pytest.raises(ValueError, match=r"e_score_correction_bias must be finite.*\[3\]"):
        _grouped(bias)


@pytest.mark.gpu
def test_non_finite_correction_bias_on_cuda_is_refused_when_checking(monkeypatch):
    """On CUDA the check reads the bias (a host synchronisation): under VLLM_MOE_CHECK_IDS=1, as
    the layer's id checks."""
    logits = torch.randn(5, 16, device="cuda")
    bias = torch.zeros(16, device="cuda")
    bias[7] = float("nan")
    monkeypatch.setenv("VLLM_MOE_CHECK_IDS", "1")
    with pytest.raises(ValueError, match=r"e_score_correction_bias must be finite.*\[7\]"):
        grouped_topk(logits, 4, renormalize=True, num_expert_group=4, topk_group=2,
                     e_score_correction_bias=bias)
    monkeypatch.setenv("VLLM_MOE_CHECK_IDS", "0")
    grouped_topk(logits, 4, renormalize=True, num_expert_group=4, topk_group=2,
                 e_score_correction_bias=bias)


# ----------------------------------------------------------------- environment values on every path
def _one_rank_layer(num_experts=1, **overrides):
    g = torch.Generator().manual_seed(4)
    w1, s1, w2, s2 = random_fp8_moe_weights(num_experts, K, I, generator=g)
    x = torch.randn(3, K, generator=g).bfloat16()
    weights, ids = fused_topk(torch.randn(3, num_experts, generator=g), 1, True)
    kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(), TritonExperts())
    kwargs = {"w1_scale": s1, "w2_scale": s2, "global_num_experts": num_experts, **overrides}
    return lambda: kernel(x, w1, w2, weights, ids, **kwargs)


def test_bad_check_ids_value_is_refused_for_cpu_inputs(monkeypatch):
    """Before the fix CPU inputs never read VLLM_MOE_CHECK_IDS (they are always checked), so
    VLLM_MOE_CHECK_IDS=2 passed here and failed only at the first GPU call."""
    call = _one_rank_layer()
    monkeypatch.setenv("VLLM_MOE_CHECK_IDS", "2")
    with pytest.raises(ValueError, match="VLLM_MOE_CHECK_IDS='2'"):
        call()
    monkeypatch.setenv("VLLM_MOE_CHECK_IDS", "0")
    assert call().shape == (3, K)


def _dispatch_layout_with_env(rank, world):
    buffer = TorchAll2AllBuffer(None)
    ids = torch.tensor([[0, 1]], dtype=torch.int64)
    buffer.get_dispatch_layout(ids, 2)
    os.environ["VLLM_MOE_CHECK_IDS"] = "2"
    try:
        buffer.get_dispatch_layout(ids, 2)
    except ValueError as e:
        return str(e)
    return None


def test_bad_check_ids_value_is_refused_by_the_torch_buffer_on_cpu():
    message, = run_distributed(_dispatch_layout_with_env, 1)
    assert message is not None and "VLLM_MOE_CHECK_IDS='2'" in message


def test_bad_randomize_value_is_refused_at_dp_size_1(monkeypatch):
    """dp_size=1 never randomises; the variable is still read, so that a typo shows."""
    monkeypatch.setenv("VLLM_RANDOMIZE_DP_DUMMY_INPUTS", "yes")
    ids = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="VLLM_RANDOMIZE_DP_DUMMY_INPUTS='yes'"):
        with maybe_randomize_inputs(ids, vocab_size=10, dp_size=1):
            pass


# ----------------------------------------------------------------- argument types
def test_global_num_experts_true_is_refused():
    """True == 1 == E_l: accepted before the fix."""
    with pytest.raises(ValueError, match="global_num_experts must be an int.*got True"):
        _one_rank_layer(global_num_experts=True)()


@pytest.mark.parametrize("value", ["no", 1, 0, None])
def test_use_fp8_dispatch_must_be_a_bool(value):
    buffer = types.SimpleNamespace(low_latency_mode=True, low_latency_dispatch=lambda *a: None,
                                   low_latency_combine=lambda *a: None)
    with pytest.raises(ValueError, match=f"use_fp8_dispatch must be a bool, got {value!r}"):
        DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=1, max_tokens_per_rank=4,
                                   use_fp8_dispatch=value)


def test_model_file_that_is_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes('{"name": "caf\xe9"}'.encode("latin-1"))
    message = re.escape(f"cannot read model config '{path}'") + ".*UTF-8"
    with pytest.raises(ValueError, match=message):
        load_model_config(str(path))


# ----------------------------------------------------------------- a missing optional library
def test_missing_deep_gemm_and_deep_ep_raise_one_exception_type(monkeypatch):
    monkeypatch.setattr(deep_gemm_compat, "_API", None)
    monkeypatch.setattr(deep_ep_compat, "_import", lambda: None)
    with pytest.raises(MissingLibraryError, match="VLLM_USE_DEEP_GEMM") as gemm:
        deep_gemm_compat.require()
    with pytest.raises(MissingLibraryError, match="VLLM_ALL2ALL_BACKEND") as ep:
        deep_ep_compat.require("deepep_low_latency")
    assert type(gemm.value) is type(ep.value) is MissingLibraryError
    assert isinstance(gemm.value, ImportError)  # what Python raises for a missing module
    assert "VLLM_USE_DEEP_GEMM" in str(gemm.value) and "DeepGEMM" in str(gemm.value)
    assert "VLLM_ALL2ALL_BACKEND" in str(ep.value) and "DeepEP" in str(ep.value)
    assert gemm.value.name == "deep_gemm" and ep.value.name == "deep_ep"
