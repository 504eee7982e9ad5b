"""The layer on real DeepEP (v1.2.1) buffers: low-latency at world size 1 on one GPU (2 ranks where
two GPUs are visible), with the batched Triton and DeepGEMM experts, against moe_reference; DeepEP's
own tables, hints and refusals against our mirrors; and the device memory a buffer takes against the
footprint model the planner counts.

Every test needs deep_ep built (``bash benchmarks/device_build.sh``) and a GPU; each multi-process
case runs in fresh NCCL ranks (``run_distributed``), so NVSHMEM starts clean in each.
"""

import gc

import pytest
import torch
from _dist import run_distributed

from vllm_moe_fixes._compat import deep_ep as deep_ep_compat
from vllm_moe_fixes.distributed import deepep_sizing
from vllm_moe_fixes.distributed.buffers import clear_all2all_buffers, make_all2all_buffer
from vllm_moe_fixes.distributed.deepep_sizing import (
    check_low_latency_config,
    deepep_buffer_footprint_bytes,
    deepep_ll_rdma_bytes,
)
from vllm_moe_fixes.fused_moe import BatchedDeepGemmExperts, BatchedTritonExperts
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import DeepEPLLPrepareAndFinalize
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.testing import moe_reference, quant_block_fp8, rel_err

# A hidden size DeepEP's LL kernels compile; MAX_TOKENS * ranks a multiple of 128, as
# BatchedDeepGemmExperts requires (DeepGEMM's masked GEMM stores whole 128-row tiles).
HIDDEN, INTER, MAX_TOKENS, TOPK = 2048, 128, 128, 6
EXPERTS_PER_RANK = 8

pytestmark = [pytest.mark.deep_ep, pytest.mark.gpu]


def _weights(num_experts: int, device) -> tuple:
    """Global w1 [E, 2I, K], w2 [E, K, I] (fp8, 128x128 block scales), the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    w1, s1 = quant_block_fp8(torch.randn(num_experts, 2 * INTER, HIDDEN, generator=g) * 0.05)
    w2, s2 = quant_block_fp8(torch.randn(num_experts, HIDDEN, INTER, generator=g) * 0.05)
    return w1.to(device), s1.to(device), w2.to(device), s2.to(device)


def _tokens(rank: int, tokens: int, num_experts: int, masked: bool, device) -> tuple:
    """x bf16 [T, H], softmax top-k weights f32 [T, k], distinct expert ids int64 [T, k] (the
    last slot of every other token -1 when ``masked``: DeepEP skips such slots)."""
    g = torch.Generator().manual_seed(100 + rank * 7 + tokens)
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    scores = torch.randn(tokens, num_experts, generator=g)
    weights, ids = scores.softmax(-1).topk(TOPK, dim=-1)
    if masked:
        ids[::2, -1] = -1
    return x.to(device), weights.to(device), ids.to(device)


def _ll_layer_worker(rank: int, world: int, experts_kind: str) -> None:
    """Rank ``rank`` of ``world``: the LL layer over a real DeepEP buffer, several token counts,
    FP8 and bf16 dispatch, against the float32 reference over all experts."""
    device = torch.device("cuda", rank)
    num_experts = EXPERTS_PER_RANK * world
    buffer = make_all2all_buffer("deepep_low_latency", None, max_tokens_per_rank=MAX_TOKENS,
                                 hidden=HIDDEN, num_experts=num_experts)
    assert type(buffer).__module__.startswith("deep_ep")
    assert buffer.num_rdma_bytes == deepep_ll_rdma_bytes(MAX_TOKENS, HIDDEN, world, num_experts)
    w1, s1, w2, s2 = _weights(num_experts, device)
    local = slice(rank * EXPERTS_PER_RANK, (rank + 1) * EXPERTS_PER_RANK)
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
    expert_map[local] = torch.arange(EXPERTS_PER_RANK, dtype=torch.int32, device=device)
    experts = BatchedDeepGemmExperts() if experts_kind == "deep_gemm" else BatchedTritonExperts()
    for tokens, masked in ((MAX_TOKENS, False), (1, False), (37, True)):
        x, weights, ids = _tokens(rank, tokens, num_experts, masked, device)
        ref = moe_reference(x, w1, w2, weights, ids, w1_scale=s1, w2_scale=s2)
        for fp8 in (True, False):
            prepare_finalize = DeepEPLLPrepareAndFinalize(
                buffer, num_dispatchers=world, max_tokens_per_rank=MAX_TOKENS, use_fp8_dispatch=fp8)
            kernel = FusedMoEModularKernel(prepare_finalize, experts)
            out = kernel(x, w1[local], w2[local], weights, ids, w1_scale=s1[local],
                         w2_scale=s2[local], global_num_experts=num_experts, expert_map=expert_map)
            torch.cuda.synchronize()
            assert out.shape == x.shape and out.dtype == torch.bfloat16
            err = rel_err(out, ref)
            assert err < 0.06, (tokens, masked, fp8, err)
    clear_all2all_buffers()
    del buffer
    gc.collect()
    torch.cuda.synchronize()


EXPERTS_KINDS = ["triton", pytest.param("deep_gemm", marks=pytest.mark.deep_gemm)]


@pytest.mark.parametrize("experts_kind", EXPERTS_KINDS)
def test_ll_layer_world_size_1(experts_kind):
    run_distributed(_ll_layer_worker, 1, experts_kind, backend="nccl")


@pytest.mark.multi_gpu
@pytest.mark.parametrize("experts_kind", EXPERTS_KINDS)
def test_ll_layer_world_size_2(experts_kind):
    run_distributed(_ll_layer_worker, 2, experts_kind, backend="nccl")


def test_tables_and_hints_match_deep_ep():
    """DeepEP's static methods (no group needed): a tuned config exactly at our CONFIG_RANKS, and
    equal hints there; the low-latency hint at several sizes."""
    buffer_cls = deep_ep_compat.require("deepep_low_latency").Buffer
    has_config = []
    for r in range(1, 257):
        try:
            buffer_cls.get_dispatch_config(r)
            has_config.append(r)
        except AssertionError:
            with pytest.raises(AssertionError):
                buffer_cls.get_combine_config(r)
    assert tuple(has_config) == deepep_sizing.CONFIG_RANKS
    for r in deepep_sizing.CONFIG_RANKS:
        ours = (deepep_sizing.get_dispatch_config(r), deepep_sizing.get_combine_config(r))
        theirs = (buffer_cls.get_dispatch_config(r), buffer_cls.get_combine_config(r))
        for mine, real in zip(ours, theirs):
            for row_bytes in (2 * 2048, 2 * 7168):
                assert mine.get_nvl_buffer_size_hint(row_bytes, r) == \
                    real.get_nvl_buffer_size_hint(row_bytes, r), (r, row_bytes)
                assert mine.get_rdma_buffer_size_hint(row_bytes, r) == \
                    real.get_rdma_buffer_size_hint(row_bytes, r), (r, row_bytes)
    for n, h, e in ((1, 2048, 1), (128, 7168, 32), (128, 7168, 256), (256, 8192, 288)):
        assert deepep_ll_rdma_bytes(n, h, 1, e) == \
            buffer_cls.get_low_latency_rdma_size_hint(n, h, 1, e)


def _refuses_hidden_3072_worker(rank: int, world: int) -> None:
    """DeepEP v1.2.1 compiles no low-latency kernel for hidden 3072: built around our check, its
    dispatch asserts; ours refuses first."""
    import torch.distributed as dist
    n, h, e = 16, 3072, 8
    with pytest.raises(ValueError, match="hidden=3072 is not supported"):
        check_low_latency_config(n, h, world, e)
    deep_ep = deep_ep_compat.require("deepep_low_latency")
    buffer = deep_ep.Buffer(group=dist.group.WORLD, low_latency_mode=True,
                            num_rdma_bytes=deepep_ll_rdma_bytes(n, h, world, e),
                            num_qps_per_rank=e // world)
    x = torch.randn(4, h, device="cuda").to(torch.bfloat16)
    ids = torch.randint(0, e, (4, 2), device="cuda")
    with pytest.raises(Exception, match="Unsupported hidden"):
        buffer.low_latency_dispatch(x, ids, n, e)
    del buffer
    gc.collect()


def test_deep_ep_refuses_ll_hidden_3072():
    run_distributed(_refuses_hidden_3072_worker, 1, backend="nccl")


def _footprint_worker(rank: int, world: int) -> tuple[int, int]:
    """(device bytes creating the LL buffer took, the model's figure) in a fresh process."""
    import torch.distributed as dist
    dist.all_gather_object([None] * world, rank)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    reserved_before = torch.cuda.memory_reserved()
    buffer = make_all2all_buffer("deepep_low_latency", None, max_tokens_per_rank=128, hidden=7168,
                                 num_experts=32)
    torch.cuda.synchronize()
    torch_growth = torch.cuda.memory_reserved() - reserved_before
    taken = free_before - torch.cuda.mem_get_info()[0] - torch_growth
    model = deepep_buffer_footprint_bytes(buffer.num_nvl_bytes, buffer.num_rdma_bytes)
    clear_all2all_buffers()
    del buffer
    gc.collect()
    torch.cuda.synchronize()
    return taken, model


@pytest.mark.gpu_alone
def test_footprint_model_covers_a_real_buffer():
    """The planner's figure for a low-latency buffer (N 128, H 7168, 32 experts, world size 1) is
    not below what creating it takes (within 64 MiB), and not more than twice it."""
    taken, model = run_distributed(_footprint_worker, 1, backend="nccl")[0]
    assert taken <= model + 64 * 2**20, (taken / 2**20, model / 2**20)
    assert model <= 2 * taken, (taken / 2**20, model / 2**20)
