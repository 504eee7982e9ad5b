"""make_moe_kernel and its parts: which prepare/finalize and experts each environment gives, the
buffer they share, the local expert map, and the refusals (one-rank gloo group; the multi-rank
layer runs through it in test_ep_kernel and test_cli's demo)."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from vllm_moe_fixes import fused_moe
from vllm_moe_fixes._compat import deep_ep as deep_ep_compat
from vllm_moe_fixes._compat import deep_gemm as deep_gemm_compat
from vllm_moe_fixes.distributed.buffers import clear_all2all_buffers
from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer
from vllm_moe_fixes.fused_moe import (
    BatchedTritonExperts,
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
    FusedMoEModularKernel,
    NoEPPrepareAndFinalize,
    TritonExperts,
    local_expert_map,
    make_moe_kernel,
    make_prepare_finalize,
)
from vllm_moe_fixes.testing import moe_reference, random_fp8_moe_weights, rel_err

SIZES = dict(hidden_size=2048, intermediate_size=128, num_experts=8)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("VLLM_ALL2ALL_BACKEND", "VLLM_USE_DEEP_GEMM", "VLLM_MOE_DP_CHUNK_SIZE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def group(tmp_path):
    """A one-rank gloo group (the default group), meeting through a file store."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield dist.group.WORLD
    clear_all2all_buffers()
    dist.destroy_process_group()


def test_without_a_group_no_all_to_all_and_the_backend_is_not_read(monkeypatch):
    monkeypatch.setenv("VLLM_ALL2ALL_BACKEND", "not-a-backend")
    kernel = make_moe_kernel(None, **SIZES)
    assert type(kernel.prepare_finalize) is NoEPPrepareAndFinalize
    assert type(kernel.experts) is TritonExperts
    # one rank, contiguous experts: they quantise the input where they permute it
    assert kernel.prepare_finalize.defer_input_quant
    assert local_expert_map(None, 8) is None


def test_a_deferred_input_quant_needs_experts_that_take_unquantised_input():
    class QuantisedInputExperts(TritonExperts):
        takes_unquantized_input = False

    FusedMoEModularKernel(NoEPPrepareAndFinalize(defer_input_quant=True), TritonExperts())
    with pytest.raises(ValueError, match="defers the input quant"):
        FusedMoEModularKernel(NoEPPrepareAndFinalize(defer_input_quant=True),
                              QuantisedInputExperts())


@pytest.mark.parametrize("env, low_latency, pf_type, experts_type", [
    ({}, None, DeepEPHTPrepareAndFinalize, TritonExperts),
    ({"VLLM_ALL2ALL_BACKEND": "naive"}, True, DeepEPLLPrepareAndFinalize, BatchedTritonExperts),
    ({"VLLM_ALL2ALL_BACKEND": "naive"}, False, DeepEPHTPrepareAndFinalize, TritonExperts),
])
def test_naive_backend_modes(group, monkeypatch, env, low_latency, pf_type, experts_type):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("VLLM_MOE_DP_CHUNK_SIZE", "24")
    kernel = make_moe_kernel(group, low_latency=low_latency, **SIZES)
    pf = kernel.prepare_finalize
    assert type(pf) is pf_type and type(kernel.experts) is experts_type
    assert isinstance(pf.buffer, TorchAll2AllBuffer) and pf.num_dispatchers() == 1
    assert pf.buffer.ll_sizes == (24, 2048, 8)  # N from VLLM_MOE_DP_CHUNK_SIZE
    if pf_type is DeepEPLLPrepareAndFinalize:
        assert pf.max_num_tokens_per_rank() == 24
    else:
        assert pf.rank_expert_offset == 0
    # one buffer per group and sizes, shared by the layers' kernels
    assert make_prepare_finalize(group, hidden_size=2048, num_experts=8,
                                 low_latency=low_latency).buffer is pf.buffer


@pytest.mark.parametrize("low_latency", [False, True])
def test_the_wired_layer_matches_the_reference(group, low_latency):
    M, K, I, E, k = 12, 2048, 128, 8, 2
    g = torch.Generator().manual_seed(5)
    x = torch.randn(M, K, generator=g).bfloat16()
    w1, w1_scale, w2, w2_scale = random_fp8_moe_weights(E, K, I, generator=g)
    topk_weights, topk_ids = fused_moe.fused_topk(torch.randn(M, E, generator=g), k, True)
    kernel = make_moe_kernel(group, max_tokens_per_rank=16, backend="naive",
                             low_latency=low_latency, hidden_size=K, intermediate_size=I,
                             num_experts=E)
    expert_map = local_expert_map(group, E)
    assert expert_map.tolist() == list(range(E)) and expert_map.dtype == torch.int32
    out = kernel(x, w1, w2, topk_weights, topk_ids, w1_scale=w1_scale, w2_scale=w2_scale,
                 global_num_experts=E, expert_map=expert_map)
    ref = moe_reference(x, w1, w2, topk_weights, topk_ids, w1_scale=w1_scale, w2_scale=w2_scale)
    assert rel_err(out, ref) < 0.06


@pytest.mark.parametrize("changes, match", [
    ({"hidden_size": 0}, "hidden_size=0 must be a positive int"),
    ({"intermediate_size": True}, "intermediate_size=True must be a positive int"),
    ({"num_experts": 2.0}, "num_experts=2.0 must be a positive int"),
    ({"backend": "nccl"}, "backend='nccl' is not known"),
    ({"backend": "deepep_high_throughput", "low_latency": True},
     "serves only the high-throughput dispatch"),
    ({"backend": "deepep_low_latency", "low_latency": False},
     "serves only the low-latency dispatch"),
    ({"low_latency": "yes"}, "low_latency must be None or a bool"),
    ({"max_tokens_per_rank": 0}, "max_tokens_per_rank=0 must be a positive int"),
])
def test_bad_arguments(group, changes, match):
    with pytest.raises(ValueError, match=match):
        make_moe_kernel(group, **{**SIZES, **changes})


def test_bad_group():
    with pytest.raises(ValueError, match="ep_group must be None or a torch.distributed"):
        make_moe_kernel("world", **SIZES)
    with pytest.raises(ValueError, match="ep_group must be None or a torch.distributed"):
        local_expert_map(1, 8)


def test_experts_not_divisible_by_ranks_is_refused(tmp_path):
    """Two ranks would be needed for the rule to bite; the rank count comes from the group, so a
    group of 3 ranks is faked."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with mock.patch.object(dist, "get_world_size", lambda g=None: 3), \
                mock.patch.object(dist, "get_rank", lambda g=None: 0):
            with pytest.raises(ValueError, match="num_experts=8 is not divisible"):
                make_moe_kernel(dist.group.WORLD, **SIZES)
            with pytest.raises(ValueError, match="num_experts=8 is not divisible"):
                local_expert_map(dist.group.WORLD, 8)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(deep_ep_compat.is_available() and deep_gemm_compat.is_available(),
                    reason="DeepEP and DeepGEMM are both installed")
def test_missing_libraries_name_the_variable(group, monkeypatch):
    if not deep_ep_compat.is_available():
        monkeypatch.setenv("VLLM_ALL2ALL_BACKEND", "deepep_low_latency")
        with pytest.raises(ImportError, match="VLLM_ALL2ALL_BACKEND=deepep_low_latency"):
            make_moe_kernel(group, **SIZES)
        monkeypatch.delenv("VLLM_ALL2ALL_BACKEND")
    if not deep_gemm_compat.is_available():
        monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1")
        with pytest.raises(ImportError, match="VLLM_USE_DEEP_GEMM"):
            make_moe_kernel(None, **SIZES)
