"""The contiguous experts take what a rank received in passes of at most VLLM_FUSED_MOE_CHUNK_SIZE
tokens, so a rank's MoE memory is bounded whatever the routing.

With all-zero dummy ids every token of an expert-parallel group routes to the same k experts, so
one rank receives every token. These tests route that way (each token's ids are 0..k-1, what
zero ids give) and check: the passes give the bits of one pass; the experts' workspaces are the
declared bounded ones, and the memory the experts allocate does not grow with the tokens
received; over gloo ranks (2 and 4) the rank that receives every token gets the reference's
output, bit for bit the one-pass output, with less memory than one pass takes. The batched
(low-latency) layout is bounded by its capacity: zero and random ids use the same workspaces.

CPU memory is measured from torch's own allocation records (the profiler's memory events, in time
order), on the torch path: its reference ops allocate float32 temporaries per pass, which the GPU
kernels do not. Under the Triton interpreter (the GPU path's kernels) apply allocates nothing.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from _dist import device_for, run_distributed
from _layer import force_triton_launchers
from test_ep_kernel import check, local_slice, make_weights
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer
from vllm_moe_fixes.fused_moe import contiguous_experts as experts_mod
from vllm_moe_fixes.fused_moe.batched_experts import BatchedTritonExperts
from vllm_moe_fixes.fused_moe.contiguous_experts import DeepGemmExperts, TritonExperts
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import (
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
)
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.fused_moe.routing import fused_topk
from vllm_moe_fixes.ops.fp8_quant import per_token_group_quant_fp8
from vllm_moe_fixes.sizes import (
    LAYOUT_INDEX_COLUMNS,
    batched_workspace_shapes,
    contiguous_num_rows,
    contiguous_workspace_shapes,
)
from vllm_moe_fixes.testing import Fp8MoEWeights, random_fp8_moe_weights

CHUNK = "VLLM_FUSED_MOE_CHUNK_SIZE"


@contextlib.contextmanager
def tracked_cpu_peak():
    """The most CPU bytes allocated at once inside the block beyond what was held on entry, from
    the profiler's memory events (every allocation and free of torch's CPU allocator, in time
    order). The context value is a dict whose "bytes" is set when the block ends."""
    result = {"bytes": None}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    live = top = 0
    events = prof.profiler.kineto_results.events()
    for event in sorted(events, key=lambda e: e.start_ns()):
        if event.name() == "[memory]" and event.device_type() == DeviceType.CPU:
            live += event.nbytes()
            top = max(top, live)
    result["bytes"] = top


def _declared_bytes(shapes) -> int:
    ws13, ws2, _ = shapes
    return 2 * (torch.Size(ws13).numel() + torch.Size(ws2).numel())


def _received(M, K, k, E_l, seed, *, zero_ids, with_map=False, device="cpu"):
    """What a rank received: a1q fp8 [M, K] and its scales, topk_ids [M, k] (zero ids: 0..k-1 for
    every token; else random among 2 * E_l experts of which this rank holds the even ones, -1
    for some), float32 topk_weights, and the expert_map."""
    g = torch.Generator().manual_seed(seed)
    a1q, a1s = per_token_group_quant_fp8(torch.randn(M, K, generator=g).bfloat16(), 128)
    E = 2 * E_l if with_map else E_l
    weights, ids = fused_topk(torch.randn(M, E, generator=g), k, renormalize=True)
    if zero_ids:
        ids = torch.arange(k).expand(M, k).contiguous()
    else:
        ids[torch.rand(M, k, generator=g) < 0.1] = -1
    emap = None
    if with_map:
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[0::2] = torch.arange(E_l, dtype=torch.int32)
    move = (lambda t: None if t is None else t.to(device))
    return move(a1q), move(a1s), move(ids), move(weights), move(emap)


def _apply(experts, w, received, I, K, *, bound, out_in_ws13=True, guard=64, device="cpu"):
    """experts.apply on the received tokens in passes of at most `bound` tokens, with
    workspaces of exactly the declared shapes, NaN-filled between NaN guard bands; returns
    (output, guards untouched)."""
    a1q, a1s, ids, weights, emap = received
    M, k = ids.shape
    E_l = w[0].shape[0]
    shapes = experts.workspace_shapes(M, I, K, k, E_l, experts_pass_tokens=bound)
    bufs = []
    for shape in shapes[:2]:
        n = torch.Size(shape).numel()
        buf = torch.full((n + 2 * guard,), float("nan"), dtype=torch.bfloat16, device=device)
        bufs.append((buf, buf[guard:guard + n].view(shape)))
    (buf13, ws13), (buf2, ws2) = bufs
    if out_in_ws13:  # where the modular kernel puts it with high-throughput EP
        out = ws13.view(-1)[:M * K].view(M, K)
    else:  # the layer's own output (no combine after the experts)
        out = torch.full((M, K), float("nan"), dtype=torch.bfloat16, device=device)
    experts.apply(out, a1q, a1s, Fp8MoEWeights(*w), workspace13=ws13, workspace2=ws2,
                  topk_ids=ids, expert_map=emap, topk_weights=weights, experts_pass_tokens=bound)
    guards_ok = all(b[:guard].isnan().all() and b[-guard:].isnan().all() for b in (buf13, buf2))
    return out.clone(), guards_ok


def _count_passes(monkeypatch):
    calls = []
    real = experts_mod.ContiguousExperts._apply_pass

    def counted(self, output, *args, **kwargs):
        calls.append(output.shape[0])
        return real(self, output, *args, **kwargs)

    monkeypatch.setattr(experts_mod.ContiguousExperts, "_apply_pass", counted)
    return calls


# ----------------------------------------------------------------------------------- the sizes
def test_declared_shapes_are_one_pass_plus_the_output():
    """Up to the bound: the one-pass shapes. Past it: ws2 of one pass whatever M; ws13 holds the
    [M, K] output and then one pass's A / G' (less than one M_sum row of slack)."""
    I, K, k, E_l, T = 2048, 7168, 8, 8, 8192
    for M in (1, 100, T):
        assert contiguous_workspace_shapes(M, I, K, k, E_l, T) == \
            contiguous_workspace_shapes(M, I, K, k, E_l)
    one = contiguous_workspace_shapes(T, I, K, k, E_l)
    m_sum = contiguous_num_rows(T * k, E_l)
    scratch = max(K // 2 + K // 64, I // 2 + I // 64)
    for M in (T + 1, 4 * T, 262144):  # 262144: DeepSeek-R1 at DP=32 with zero ids
        ws13, ws2, out = contiguous_workspace_shapes(M, I, K, k, E_l, T)
        assert ws2 == one[1] == (m_sum, max(2 * I, K) + LAYOUT_INDEX_COLUMNS) and out == (M, K)
        assert ws13[0] == m_sum
        assert 0 <= ws13[0] * ws13[1] - (M * K + m_sum * scratch) < m_sum
    # Zero ids at DP=32: 28.0 GiB of ws2 and 14.4 GiB of ws13 in one pass; bounded: 0.9 + 3.9 GiB.
    unbounded = contiguous_workspace_shapes(262144, I, K, k, E_l)
    bounded = contiguous_workspace_shapes(262144, I, K, k, E_l, T)
    assert round(2 * torch.Size(unbounded[1]).numel() / 2**30, 1) == 28.0
    assert round(2 * torch.Size(unbounded[0]).numel() / 2**30, 1) == 14.4
    assert _declared_bytes(bounded) < 5 * 2**30 < _declared_bytes(unbounded) / 8


def test_experts_declare_the_bound_they_are_given(monkeypatch):
    monkeypatch.setenv(CHUNK, "7")  # not read below the kernel: the bound is a parameter
    assert TritonExperts().workspace_shapes(1000, 128, 256, 2, 4, experts_pass_tokens=64) == \
        contiguous_workspace_shapes(1000, 128, 256, 2, 4, 64)
    for one_pass in (1000, None):
        assert TritonExperts().workspace_shapes(1000, 128, 256, 2, 4,
                                                experts_pass_tokens=one_pass) == \
            contiguous_workspace_shapes(1000, 128, 256, 2, 4)


# ------------------------------------------------------------------------------------ the bits
@pytest.mark.parametrize("M, bound, E_l, k, with_map, zero_ids", [
    (96, 16, 2, 2, False, True),    # 6 passes of 16 tokens, every token on the same 2 experts
    (100, 16, 4, 3, True, True),    # 7 passes, the last of 4 tokens; non-local experts
    (37, 36, 1, 1, False, True),    # 2 passes, the last of 1 token
    (100, 16, 4, 3, True, False),   # random routing with non-local experts and -1 ids
    (77, 12, 2, 2, False, False),
])
def test_passes_give_the_bits_of_one_pass_torch_path(M, bound, E_l, k, with_map, zero_ids,
                                                     monkeypatch):
    """The CPU references: passes give the bits of one pass (the reference GEMM sums each K
    block's FP8 products exactly, so a row's result does not depend on the other rows). Output
    at ws13's start or the layer's own; workspaces of exactly the declared size, NaN-poisoned
    between guard bands that stay untouched."""
    I, K = 128, 256
    g = torch.Generator().manual_seed(M)
    w = random_fp8_moe_weights(2 * E_l if with_map else E_l, K, I, generator=g)
    if with_map:
        w = tuple(t[0::2].contiguous() for t in w)  # the even experts live here
    received = _received(M, K, k, E_l, seed=M, zero_ids=zero_ids, with_map=with_map)
    calls = _count_passes(monkeypatch)
    one_pass, ok = _apply(TritonExperts(), w, received, I, K, bound=M)
    assert ok and calls == [M]
    for out_in_ws13 in (True, False):
        calls.clear()
        passes, ok = _apply(TritonExperts(), w, received, I, K, bound=bound,
                            out_in_ws13=out_in_ws13)
        assert ok and calls == [min(bound, M - s) for s in range(0, M, bound)]
        assert torch.isfinite(passes).all()
        assert torch.equal(passes, one_pass)


def test_passes_give_the_bits_of_one_pass_and_allocate_nothing_under_the_interpreter(
        monkeypatch, kernel_device):
    """Every Triton launcher of the contiguous path (interpreted on CPU), random routing with
    non-local experts and -1 ids: 2 passes give the bits of one pass, and apply allocates
    nothing (tracked) in either: its memory is the declared workspaces."""
    force_triton_launchers(monkeypatch)
    I, K, E_l, k, M = 128, 128, 1, 2, 24
    g = torch.Generator().manual_seed(5)
    w = tuple(t[0::2].contiguous() for t in random_fp8_moe_weights(2, K, I, generator=g))
    w = tuple(t.to(kernel_device) for t in w)
    received = _received(M, K, k, E_l, seed=5, zero_ids=False, with_map=True,
                         device=kernel_device)
    outs = []
    for bound in (M, 12):
        experts = TritonExperts()
        shapes = experts.workspace_shapes(M, I, K, k, E_l, experts_pass_tokens=bound)
        ws13 = torch.empty(shapes[0], dtype=torch.bfloat16, device=kernel_device)
        ws2 = torch.empty(shapes[1], dtype=torch.bfloat16, device=kernel_device)
        out = ws13.view(-1)[:M * K].view(M, K)
        a1q, a1s, ids, weights, emap = received
        with tracked_cpu_peak() as peak:
            experts.apply(out, a1q, a1s, Fp8MoEWeights(*w), workspace13=ws13, workspace2=ws2,
                          topk_ids=ids, expert_map=emap, topk_weights=weights,
                          experts_pass_tokens=bound)
        assert peak["bytes"] < 4096, peak  # a few index scalars at most
        outs.append(out.clone())
    assert torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------------------------- the memory
def test_apply_memory_does_not_grow_with_the_tokens_received(monkeypatch):
    """Torch path, zero ids, the workspaces allocated beforehand: what apply itself allocates
    (the reference ops' temporaries of one pass) is the same for 1, 3 and 6 passes of 64
    tokens; in one pass it grows with the tokens."""
    I, K, E_l, k, T = 128, 256, 2, 2, 64
    w = random_fp8_moe_weights(E_l, K, I, generator=torch.Generator().manual_seed(1))

    def apply_peak(M, bound):
        experts = TritonExperts()
        a1q, a1s, ids, weights, emap = _received(M, K, k, E_l, seed=M, zero_ids=True)
        shapes = experts.workspace_shapes(M, I, K, k, E_l, experts_pass_tokens=bound)
        ws13 = torch.empty(shapes[0], dtype=torch.bfloat16)
        ws2 = torch.empty(shapes[1], dtype=torch.bfloat16)
        out = ws13.view(-1)[:M * K].view(M, K)
        with tracked_cpu_peak() as peak:
            experts.apply(out, a1q, a1s, w, workspace13=ws13, workspace2=ws2, topk_ids=ids,
                          expert_map=emap, topk_weights=weights, experts_pass_tokens=bound)
        return peak["bytes"]

    bounded = [apply_peak(M, T) for M in (T, 3 * T, 6 * T)]
    assert max(bounded) <= 1.05 * min(bounded), bounded
    unbounded = apply_peak(6 * T, 6 * T)
    assert unbounded > 2 * bounded[0], (unbounded, bounded)


# ------------------------------------------------------------------ a rank that receives it all
TOKENS = 256  # per rank, and the bound: every rank's call is one pass of the caller's chunks


def _zero_ids_problem(rank, world, hidden, seed):
    """E = 2 * world experts, 2 per rank; every token's ids are 0 and 1 (what zero ids give), so
    rank 0 receives every token of the group."""
    E, k = 2 * world, 2
    full = make_weights(seed, E, hidden, device_for(rank))
    g = torch.Generator().manual_seed(seed * 10 + rank)
    x = torch.randn(TOKENS, hidden, generator=g).bfloat16()
    ids = torch.arange(k).expand(TOKENS, k).contiguous()
    weights = torch.rand(TOKENS, k, generator=g) + 0.1
    return E, k, full, x, ids, weights


def _ht_rank(rank, world):
    """High-throughput dispatch over TorchAll2AllBuffer: bounded (passes of TOKENS) and one
    pass, same inputs."""
    hidden = 256
    E, k, full, x, ids, weights = _zero_ids_problem(rank, world, hidden, seed=40)
    lw1, ls1, lw2, ls2, emap = local_slice(rank, world, E, *full)
    runs = {}
    for bound in (TOKENS, world * TOKENS):
        os.environ[CHUNK] = str(bound)  # this forked rank's environment only
        pf = DeepEPHTPrepareAndFinalize(TorchAll2AllBuffer(None), num_dispatchers=world,
                                        rank_expert_offset=rank * 2)
        kernel = FusedMoEModularKernel(pf, TritonExperts())
        with tracked_cpu_peak() as peak:
            out = kernel(x, lw1, lw2, weights, ids, w1_scale=ls1, w2_scale=ls2,
                         global_num_experts=E, expert_map=emap)
        check(out, x, *full, ids, weights)
        runs[bound] = (out, peak["bytes"], sum(pf.num_recv_tokens_per_expert),
                       kernel.workspaces.ws13.numel() if kernel.workspaces.ws13 is not None
                       else 0, kernel.workspaces.ws2.numel() if kernel.workspaces.ws2 is not None
                       else 0)
    (out_b, peak_b, recv_slots, ws13_b, ws2_b), (out_1, peak_1, _, ws13_1, ws2_1) = \
        runs[TOKENS], runs[world * TOKENS]
    assert torch.equal(out_b, out_1)
    if rank == 0:
        received = world * TOKENS
        assert recv_slots == received * k  # every token of the group, both slots here
        bounded = contiguous_workspace_shapes(received, 128, hidden, k, 2, TOKENS)
        one_pass = contiguous_workspace_shapes(received, 128, hidden, k, 2)
        assert (ws13_b, ws2_b) == tuple(torch.Size(s).numel() for s in bounded[:2])
        assert (ws13_1, ws2_1) == tuple(torch.Size(s).numel() for s in one_pass[:2])
        # ws2 is one pass's of TOKENS tokens at any world size
        assert bounded[1] == contiguous_workspace_shapes(TOKENS, 128, hidden, k, 2)[1]
        saved = _declared_bytes(one_pass) - _declared_bytes(bounded)
        assert saved > 0 and peak_b <= peak_1 - saved, (peak_b, peak_1, saved)
    return peak_b


def _ll_rank(rank, world):
    """Low-latency dispatch: zero and random ids use the same workspaces, sized by capacity."""
    hidden, n = 2048, 8  # a DeepEP low-latency hidden size; n tokens per rank per dispatch
    E, k, full, x, ids, weights = _zero_ids_problem(rank, world, hidden, seed=41)
    x, ids, weights = x[:n], ids[:n], weights[:n]
    lw1, ls1, lw2, ls2, emap = local_slice(rank, world, E, *full)
    buffer = TorchAll2AllBuffer(None, low_latency_mode=True, num_max_dispatch_tokens_per_rank=n,
                                hidden=hidden, num_experts=E)
    sizes = []
    g = torch.Generator().manual_seed(rank)
    random_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
    for routing in (ids, random_ids):
        pf = DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=world, max_tokens_per_rank=n)
        kernel = FusedMoEModularKernel(pf, BatchedTritonExperts())
        out = kernel(x, lw1, lw2, weights, routing, w1_scale=ls1, w2_scale=ls2,
                     global_num_experts=E, expert_map=emap)
        check(out, x, *full, routing, weights)
        sizes.append((kernel.workspaces.ws13.numel(), kernel.workspaces.ws2.numel()))
    declared = batched_workspace_shapes(world * n, 128, hidden, 2)
    assert sizes[0] == sizes[1] == tuple(torch.Size(s).numel() for s in declared[:2])


def _worker(rank, world):
    _ll_rank(rank, world)
    return _ht_rank(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_that_receives_every_token_stays_bounded(world):
    run_distributed(_worker, world)


# ---------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", pytest.param("deep_gemm",
                                                            marks=pytest.mark.deep_gemm)])
@pytest.mark.parametrize("zero_ids", [True, False])
def test_gpu_passes_bit_exact_and_peak_is_the_declared_workspaces(backend, zero_ids,
                                                                  monkeypatch):
    """A rank that received 8 passes' worth of tokens (DeepSeek's K and I, 8 local experts): 8
    passes give the bits of one pass; with the workspaces allocated in the measured block, the
    peak (max_memory_allocated) is the declared bounded workspaces, and the one-pass
    declaration is larger by the 7 passes' A, H, G', Y it no longer holds. The passes make no
    host synchronisation (torch's sync debug mode "error")."""
    from vllm_moe_fixes._memory import peak_memory
    I, K, E_l, k, T = 2048, 7168, 8, 8, 1024
    M = 8 * T
    experts_cls = DeepGemmExperts if backend == "deep_gemm" else TritonExperts
    w = random_fp8_moe_weights(2 * E_l, K, I, generator=torch.Generator(device="cuda")
                               .manual_seed(0), device="cuda")
    w = tuple(t[0::2].contiguous() for t in w)
    received = _received(M, K, k, E_l, seed=3, zero_ids=zero_ids, with_map=True, device="cuda")
    a1q, a1s, ids, weights, emap = received
    outs = []
    for bound in (M, T):
        experts = experts_cls()
        shapes = experts.workspace_shapes(M, I, K, k, E_l, experts_pass_tokens=bound)
        experts_out = None
        for measured in (False, True):  # the first call compiles the kernels
            torch.cuda.empty_cache()
            with peak_memory() as peak:
                ws13 = torch.empty(shapes[0], dtype=torch.bfloat16, device="cuda")
                ws2 = torch.empty(shapes[1], dtype=torch.bfloat16, device="cuda")
                experts_out = ws13.view(-1)[:M * K].view(M, K)
                experts.apply(experts_out, a1q, a1s, Fp8MoEWeights(*w), workspace13=ws13,
                              workspace2=ws2, topk_ids=ids, expert_map=emap,
                              topk_weights=weights, experts_pass_tokens=bound)
            if measured:
                declared = _declared_bytes(shapes)
                assert declared <= peak.bytes <= 1.01 * declared + 2 * 2**20, (peak.bytes,
                                                                              declared)
            outs.append(experts_out.clone())
            del ws13, ws2, experts_out
        if bound == T:
            one_pass = contiguous_workspace_shapes(M, I, K, k, E_l)
            assert _declared_bytes(one_pass) > 3 * _declared_bytes(shapes)
            ws13 = torch.empty(shapes[0], dtype=torch.bfloat16, device="cuda")
            ws2 = torch.empty(shapes[1], dtype=torch.bfloat16, device="cuda")
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # the passes read nothing on the host
            try:
                experts.apply(ws13.view(-1)[:M * K].view(M, K), a1q, a1s, Fp8MoEWeights(*w),
                              workspace13=ws13, workspace2=ws2, topk_ids=ids, expert_map=emap,
                              topk_weights=weights, experts_pass_tokens=bound)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(outs[1], outs[3])
