"""The whole modular kernel through the expert-parallel paths, on gloo ranks (NCCL on GPUs).

Each rank builds the same global problem (every rank's tokens and routing, all experts' weights)
from one seed, runs its share through FusedMoEModularKernel with DeepEPHT (standard format,
TritonExperts) or DeepEPLL (batched format, BatchedTritonExperts) over a TorchAll2AllBuffer,
and compares its output with a single-process computation of its tokens over all experts:
``moe_reference`` (float32, unquantised activations) and, for the high-throughput path, the
single-rank NoEP kernel (the same FP8 arithmetic, so a tight tolerance).
"""

import pytest
import torch
import torch.distributed as dist
from _dist import device_for, run_distributed
from test_torch_buffer import make_problem

from vllm_moe_fixes._compat import deep_gemm as deep_gemm_compat
from vllm_moe_fixes.distributed.buffers import make_all2all_buffer
from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer
from vllm_moe_fixes.fused_moe.batched_experts import (
    BatchedDeepGemmExperts,
    BatchedTritonExperts,
)
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import (
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
)
from vllm_moe_fixes.fused_moe.contiguous_experts import TritonExperts
from vllm_moe_fixes.fused_moe.kernel_factory import local_expert_map, make_moe_kernel
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.fused_moe.no_ep_prepare_finalize import NoEPPrepareAndFinalize
from vllm_moe_fixes.ops.fp8_quant import quant_batched_fp8
from vllm_moe_fixes.testing import Fp8MoEWeights, moe_reference, rel_err

INTER = 128  # intermediate size I


def make_weights(seed, num_experts, hidden, device):
    """fp8 w1 [E, 2I, K], w2 [E, K, I] with float32 128x128 block scales."""
    g = torch.Generator().manual_seed(seed)

    def one(rows, cols):
        w = (torch.randn(num_experts, rows, cols, generator=g) * 0.3).to(torch.float8_e4m3fn)
        s = torch.rand(num_experts, rows // 128, cols // 128, generator=g) * 0.05 + 0.01
        return w.to(device), s.to(device)

    return one(2 * INTER, hidden) + one(hidden, INTER)


def local_slice(rank, world, num_experts, w1, s1, w2, s2):
    """This rank's experts of the full weights (rank r holds [r*E_l, (r+1)*E_l)) and the
    expert_map of the group (make_moe_kernel's placement)."""
    local_num_experts = num_experts // world
    sl = slice(rank * local_num_experts, (rank + 1) * local_num_experts)
    expert_map = local_expert_map(dist.group.WORLD, num_experts, w1.device)
    return w1[sl].contiguous(), s1[sl].contiguous(), w2[sl].contiguous(), s2[sl].contiguous(), expert_map


def check(out, x, w1, s1, w2, s2, ids, weights, tight=None, on_input=False):
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    if x.shape[0] == 0:
        return
    ref = moe_reference(x, w1, w2, weights, ids, w1_scale=s1, w2_scale=s2,
                        apply_router_weight_on_input=on_input)
    assert rel_err(out, ref) < 0.06, rel_err(out, ref)
    # A token whose every slot is -1 gets exact zeros.
    none = (ids < 0).all(1)
    assert (out[none] == 0).all()
    if tight is not None:
        torch.testing.assert_close(out.float(), tight.float(), rtol=2e-2, atol=2e-2)


# (seed, tokens per rank as a function of the world size, E, k, routing mode)
CASES = [
    (10, lambda r: [5 + 2 * i for i in range(r)], 8, 1, "uneven"),
    (11, lambda r: [9] + [0] * (r - 1), 32, 6, "uneven"),          # ranks with no tokens
    (12, lambda r: [6] * r, 32, 6, "one_rank"),                     # all on the last rank's experts
    (13, lambda r: [3 + i for i in range(r)], 8, 6, "uneven") ,
]


def _rank_problems(rank, world, hidden):
    """Each CASES problem as this rank sees it: (all ranks' ids, E, k, x, idx, w, the full
    weights (w1, s1, w2, s2), this rank's slice (lw1, ls1, lw2, ls2, expert_map))."""
    dev = device_for(rank)
    for seed, tokens, E, k, mode in CASES:
        xs, ids, ws = make_problem(seed, tokens(world), E, k, hidden, mode, dev)
        full = make_weights(seed, E, hidden, dev)
        yield ids, E, k, xs[rank], ids[rank], ws[rank], full, local_slice(rank, world, E, *full)


def _ht_cases(rank, world, hidden=256):
    for ids, E, k, x, idx, w, (w1, s1, w2, s2), (lw1, ls1, lw2, ls2, expert_map) in \
            _rank_problems(rank, world, hidden):
        kernel = make_moe_kernel(dist.group.WORLD, backend="naive", hidden_size=hidden,
                                 intermediate_size=INTER, num_experts=E)
        pf = kernel.prepare_finalize
        assert type(pf) is DeepEPHTPrepareAndFinalize and type(kernel.experts) is TritonExperts
        out = kernel(x, lw1, lw2, w, idx, w1_scale=ls1, w2_scale=ls2, global_num_experts=E,
                     expert_map=expert_map)
        tight = None
        if x.shape[0]:
            noep = FusedMoEModularKernel(NoEPPrepareAndFinalize(), TritonExperts())
            tight = noep(x, w1, w2, w, idx, w1_scale=s1, w2_scale=s2, global_num_experts=E)
        check(out, x, w1, s1, w2, s2, idx, w, tight)
        assert sum(pf.num_recv_tokens_per_expert) == int(
            sum(((i >= rank * (E // world)) & (i < (rank + 1) * (E // world))).sum() for i in ids))
        if k == 1 and x.shape[0]:  # router weight on the input
            out = kernel(x, lw1, lw2, w, idx, w1_scale=ls1, w2_scale=ls2, global_num_experts=E,
                         expert_map=expert_map, apply_router_weight_on_input=True)
            check(out, x, w1, s1, w2, s2, idx, w, on_input=True)


def _ll_cases(rank, world, hidden=2048, max_tokens=20):
    buffer = TorchAll2AllBuffer(None, low_latency_mode=True, num_max_dispatch_tokens_per_rank=max_tokens,
                                hidden=hidden, num_experts=32)
    for _, E, k, x, idx, w, (w1, s1, w2, s2), (lw1, ls1, lw2, ls2, expert_map) in \
            _rank_problems(rank, world, hidden):
        for fp8 in (True, False):
            pf = DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=world, max_tokens_per_rank=max_tokens,
                                            use_fp8_dispatch=fp8)
            kernel = FusedMoEModularKernel(pf, BatchedTritonExperts())
            out = kernel(x, lw1, lw2, w, idx, w1_scale=ls1, w2_scale=ls2, global_num_experts=E,
                         expert_map=expert_map)
            check(out, x, w1, s1, w2, s2, idx, w)
        if k == 1 and x.shape[0]:
            out = kernel(x, lw1, lw2, w, idx, w1_scale=ls1, w2_scale=ls2, global_num_experts=E,
                         expert_map=expert_map, apply_router_weight_on_input=True)
            check(out, x, w1, s1, w2, s2, idx, w, on_input=True)

    # Errors: N larger than the buffer was sized for (100 * 8 experts > 20 * 32); a kernel pairing
    # mismatched formats.
    pf = DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=world, max_tokens_per_rank=100)
    kernel = FusedMoEModularKernel(pf, BatchedTritonExperts())
    lw1, ls1, lw2, ls2, expert_map = local_slice(rank, world, E, w1, s1, w2, s2)
    with pytest.raises(ValueError, match="low-latency buffer too small"):
        kernel(x[:1], lw1, lw2, w[:1], idx[:1], w1_scale=ls1, w2_scale=ls2, global_num_experts=E,
               expert_map=expert_map)
    pf = DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=world, max_tokens_per_rank=1)
    with pytest.raises(ValueError, match="exceed max_tokens_per_rank=1"):
        pf.prepare(x[:2], w[:2], idx[:2], E, None, False)
    with pytest.raises(ValueError, match="activation format"):
        FusedMoEModularKernel(pf, TritonExperts())
    with pytest.raises(ValueError, match="activation format"):
        FusedMoEModularKernel(DeepEPHTPrepareAndFinalize(buffer, num_dispatchers=world, rank_expert_offset=0),
                              BatchedTritonExperts())


def _worker(rank, world):
    _ht_cases(rank, world)
    _ll_cases(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_ep_kernel_gloo(world):
    run_distributed(_worker, world)


def test_ep_kernel_gloo_world8():
    run_distributed(_worker, 8)


class _StubBuffer:
    """Has the methods the prepare/finalize classes look for; never called."""

    low_latency_mode = True

    def __getattr__(self, name):
        if name in ("get_dispatch_layout", "dispatch", "combine", "low_latency_dispatch",
                    "low_latency_combine"):
            return lambda *a, **k: None
        raise AttributeError(name)


def test_constructor_errors():
    stub = _StubBuffer()
    with pytest.raises(ValueError, match="buffer must be a deep_ep.Buffer or TorchAll2AllBuffer.*got NoneType"):
        DeepEPHTPrepareAndFinalize(None, num_dispatchers=2, rank_expert_offset=0)
    with pytest.raises(ValueError, match="buffer must be .*low_latency_dispatch.*got NoneType"):
        DeepEPLLPrepareAndFinalize(None, num_dispatchers=2, max_tokens_per_rank=4)
    with pytest.raises(ValueError, match="num_dispatchers=0"):
        DeepEPHTPrepareAndFinalize(stub, num_dispatchers=0, rank_expert_offset=0)
    with pytest.raises(ValueError, match="rank_expert_offset=-1"):
        DeepEPHTPrepareAndFinalize(stub, num_dispatchers=2, rank_expert_offset=-1)
    with pytest.raises(ValueError, match="rank_expert_offset=True"):
        DeepEPHTPrepareAndFinalize(stub, num_dispatchers=2, rank_expert_offset=True)
    with pytest.raises(ValueError, match="max_tokens_per_rank=0"):
        DeepEPLLPrepareAndFinalize(stub, num_dispatchers=2, max_tokens_per_rank=0)
    normal = _StubBuffer()
    normal.low_latency_mode = False
    with pytest.raises(ValueError, match="low_latency_mode=True"):
        DeepEPLLPrepareAndFinalize(normal, num_dispatchers=2, max_tokens_per_rank=4)
    with pytest.raises(ValueError, match="without a preceding prepare"):
        DeepEPLLPrepareAndFinalize(stub, num_dispatchers=2, max_tokens_per_rank=4).finalize(
            None, None, torch.zeros(1, 1), None, False)
    with pytest.raises(ValueError, match="without a preceding prepare"):
        DeepEPHTPrepareAndFinalize(stub, num_dispatchers=2, rank_expert_offset=0).finalize(
            None, None, None, None, False)
    pf = DeepEPHTPrepareAndFinalize(stub, num_dispatchers=3, rank_expert_offset=0)
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by the number of ranks 3"):
        pf.prepare(torch.zeros(1, 128, dtype=torch.bfloat16), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int64),
                   8, None, False)


# ---------------------------------------------------------------- GPUs (NCCL; real DeepEP where built)
def _gpu_world_sizes():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return sorted({2, min(4, n)}) if n >= 2 else [2]


@pytest.mark.multi_gpu
@pytest.mark.parametrize("world", _gpu_world_sizes())
def test_ep_kernel_nccl(world):
    run_distributed(_worker, world, backend="nccl")


def _deep_ep_worker(rank, world):
    """The same layer through real DeepEP buffers built by make_all2all_buffer."""
    dev = device_for(rank)
    hidden, max_tokens, E = 2048, 16, 32
    group = dist.group.WORLD
    ht = make_all2all_buffer("deepep_high_throughput", group, max_tokens_per_rank=max_tokens,
                             hidden=hidden, num_experts=E)
    ll = make_all2all_buffer("deepep_low_latency", group, max_tokens_per_rank=max_tokens,
                             hidden=hidden, num_experts=E)
    for seed, tokens, _, k, mode in CASES:
        xs, ids, ws = make_problem(seed, [min(t, max_tokens) for t in tokens(world)], E, k, hidden, mode, dev)
        x, idx, w = xs[rank], ids[rank], ws[rank]
        w1, s1, w2, s2 = make_weights(seed, E, hidden, dev)
        lw1, ls1, lw2, ls2, expert_map = local_slice(rank, world, E, w1, s1, w2, s2)
        kw = dict(w1_scale=ls1, w2_scale=ls2, global_num_experts=E, expert_map=expert_map)
        for backend, buffer in (("deepep_high_throughput", ht), ("deepep_low_latency", ll)):
            kernel = make_moe_kernel(group, backend=backend, hidden_size=hidden,
                                     intermediate_size=INTER, num_experts=E,
                                     max_tokens_per_rank=max_tokens)
            assert kernel.prepare_finalize.buffer is buffer  # built once per group and sizes
            check(kernel(x, lw1, lw2, w, idx, **kw), x, w1, s1, w2, s2, idx, w)
        torch.cuda.synchronize()


@pytest.mark.deep_ep
@pytest.mark.multi_gpu
def test_ep_kernel_real_deep_ep():
    run_distributed(_deep_ep_worker, 2, backend="nccl")


def _poison_worker(rank, world):
    """HT finalize: slots whose id is -1 come out as exact zeros even over NaN garbage."""
    buffer = TorchAll2AllBuffer(None)
    E, k, K = 4 * world, 3, 128
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(5, K, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(5)])
    ids[:, 0] = -1
    w = torch.rand(5, k, generator=g)
    pf = DeepEPHTPrepareAndFinalize(buffer, num_dispatchers=world, rank_expert_offset=rank * 4)
    prep = pf.prepare(x, w, ids, E, None, False)
    assert prep.a1q.dtype == torch.float8_e4m3fn and prep.a1q_scale.shape == (prep.a1q.shape[0], 1)
    fused = torch.full((prep.a1q.shape[0], k, K), float("nan"), dtype=torch.bfloat16)
    fused[prep.topk_ids >= 0] = 1.0
    out = torch.full_like(x, float("nan"))
    pf.finalize(out, fused, prep.topk_weights, prep.topk_ids, False)
    # Each token gets 1.0 * its weight from every valid slot, wherever the expert lives.
    want = torch.where(ids >= 0, w, 0.0).sum(1, keepdim=True).expand(-1, K)
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)


def test_ht_finalize_zeroes_masked_slots():
    run_distributed(_poison_worker, 2)


# ---------------------------------------------------------------- batched experts alone
def _batched_case(device, counts=(0, 3, 8, 1), T=8, K=256, seed=7):
    g = torch.Generator().manual_seed(seed)
    e_l = len(counts)
    w1, s1, w2, s2 = make_weights(seed, e_l, K, device)
    a = (torch.randn(e_l, T, K, generator=g) * 2).to(torch.bfloat16).to(device)
    a_q, a_s = quant_batched_fp8(a)
    return a, (a_q, a_s), (w1, s1, w2, s2), torch.tensor(counts, dtype=torch.int32, device=device)


def _apply_batched(experts, a_q, a_s, w1, s1, w2, s2, counts):
    e_l, T, K = a_q.shape
    ws13_shape, ws2_shape, out_shape = experts.workspace_shapes(T, w2.shape[2], K, 1, e_l)
    ws13 = torch.full(ws13_shape, float("nan"), dtype=torch.bfloat16, device=a_q.device)
    ws2 = torch.full(ws2_shape, float("nan"), dtype=torch.bfloat16, device=a_q.device)
    out = ws13.view(-1)[:torch.Size(out_shape).numel()].view(out_shape)
    experts.apply(out, a_q, a_s, Fp8MoEWeights(w1, s1, w2, s2), workspace13=ws13, workspace2=ws2,
                  expert_num_tokens=counts)
    return out


def test_batched_experts_valid_rows(kernel_device):
    a, (a_q, a_s), (w1, s1, w2, s2), counts = _batched_case(kernel_device)
    assert a_s.stride() == (8 * 2, 1, 8)  # MN-major per expert: [E_l, T, K/128], T contiguous
    out = _apply_batched(BatchedTritonExperts(), a_q, a_s, w1, s1, w2, s2, counts)
    for e, c in enumerate(counts.tolist()):
        if c == 0:
            continue
        ids = torch.zeros(c, 1, dtype=torch.int64, device=a.device)
        ref = moe_reference(a[e, :c], w1[e:e + 1], w2[e:e + 1], torch.ones(c, 1, device=a.device), ids,
                            w1_scale=s1[e:e + 1], w2_scale=s2[e:e + 1])
        assert torch.isfinite(out[e, :c]).all()
        assert rel_err(out[e, :c], ref) < 0.06


def test_batched_experts_errors():
    a, (a_q, a_s), (w1, s1, w2, s2), counts = _batched_case("cpu")
    with pytest.raises(ValueError, match="expert_num_tokens"):
        _apply_batched(BatchedTritonExperts(), a_q, a_s, w1, s1, w2, s2, None)
    with pytest.raises(ValueError, match="activation"):
        BatchedTritonExperts().apply(None, a_q, a_s, Fp8MoEWeights(w1, s1, w2, s2), workspace13=None,
                                     workspace2=None, expert_num_tokens=counts, activation="gelu")


def test_batched_deep_gemm_refuses_slices_its_tiles_overrun():
    """DeepGEMM's masked GEMM stores whole 128-row tiles: a slice of T=16 rows is refused before
    any launch (on the H200 such a call wrote over the next expert's rows)."""
    _, (a_q, a_s), (w1, s1, w2, s2), counts = _batched_case("cpu", T=16)
    experts = object.__new__(BatchedDeepGemmExperts)  # the check needs no DeepGEMM
    with pytest.raises(ValueError, match="multiple of 128, got T=16"):
        _apply_batched(experts, a_q, a_s, w1, s1, w2, s2, counts)


@pytest.mark.skipif(deep_gemm_compat.is_available(), reason="deep_gemm is installed here")
def test_batched_deep_gemm_needs_deep_gemm():
    with pytest.raises(ImportError, match="VLLM_USE_DEEP_GEMM"):
        BatchedDeepGemmExperts()


@pytest.mark.gpu
@pytest.mark.deep_gemm
def test_batched_deep_gemm_matches_triton():
    counts = (0, 37, 128, 5)
    a, (a_q, a_s), (w1, s1, w2, s2), counts = _batched_case("cuda", counts=counts, T=128, K=512)
    want = _apply_batched(BatchedTritonExperts(), a_q, a_s, w1, s1, w2, s2, counts)
    got = _apply_batched(BatchedDeepGemmExperts(), a_q, a_s, w1, s1, w2, s2, counts)
    for e, c in enumerate(counts.tolist()):
        torch.testing.assert_close(got[e, :c].float(), want[e, :c].float(), rtol=2e-2, atol=2e-2)
