"""The modular kernel (NoEP + TritonExperts / DeepGemmExperts) against moe_reference.

On CPU the ops run their torch references, so these tests exercise the whole layer; the GPU
tests (marker gpu) run the Triton kernels. Tolerances: activations are FP8-quantised twice
(input and SiLU output), which costs ~5% relative error; a routing or weight error shows as ~1.
"""

import logging
import types

import pytest
import torch

from vllm_moe_fixes._compat import deep_gemm as compat
from vllm_moe_fixes.fused_moe import contiguous_experts as experts_mod
from vllm_moe_fixes.fused_moe import experts_selection as selection_mod
from vllm_moe_fixes.fused_moe.batched_experts import (
    BatchedDeepGemmExperts,
    BatchedTritonExperts,
    select_batched_experts,
)
from vllm_moe_fixes.fused_moe.contiguous_experts import (
    DeepGemmExperts,
    TritonExperts,
    select_experts,
    workspace_views,
)
from vllm_moe_fixes.fused_moe.modular_kernel import (
    ActivationFormat,
    Experts,
    FusedMoEModularKernel,
    PrepareAndFinalize,
    PrepareResult,
    Workspaces,
)
from vllm_moe_fixes.fused_moe.no_ep_prepare_finalize import NoEPPrepareAndFinalize
from vllm_moe_fixes.fused_moe.routing import fused_topk
from vllm_moe_fixes.ops.fp8_quant import per_token_group_quant_fp8, quant_batched_fp8
from vllm_moe_fixes.ops.grouped_gemm import (
    grouped_fp8_gemm_contiguous_ref,
    grouped_fp8_gemm_contiguous_triton,
    grouped_fp8_gemm_masked_ref,
)
from vllm_moe_fixes.sizes import (
    LAYOUT_INDEX_COLUMNS,
    batched_workspace_shapes,
    contiguous_workspace_shapes,
    expected_rows_per_expert,
    layer_declared_bytes,
)
from vllm_moe_fixes.testing import calc_diff, kernels_per_call, moe_reference, quant_block_fp8, rel_err


def make_problem(M, k, E, N, K, *, local=None, device="cpu", seed=0):
    """Weights of the local experts, routed input; local: global ids held here (None = all)."""
    g = torch.Generator().manual_seed(seed)
    E_l = E if local is None else len(local)
    w1, w1s = quant_block_fp8(torch.randn(E_l, 2 * N, K, generator=g) / K ** 0.5)
    w2, w2s = quant_block_fp8(torch.randn(E_l, K, N, generator=g) / N ** 0.5)
    x = torch.randn(M, K, generator=g).bfloat16()
    weights, ids = fused_topk(torch.randn(M, E, generator=g), k, renormalize=True)
    emap = None
    if local is not None:
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[torch.tensor(local)] = torch.arange(E_l, dtype=torch.int32)
    args = dict(hidden_states=x, w1=w1, w2=w2, topk_weights=weights, topk_ids=ids, w1_scale=w1s,
                w2_scale=w2s, expert_map=emap)
    return {n: (t.to(device) if t is not None else None) for n, t in args.items()}


def run(kernel, p, E, **kw):
    return kernel(p["hidden_states"], p["w1"], p["w2"], p["topk_weights"], p["topk_ids"],
                  w1_scale=p["w1_scale"], w2_scale=p["w2_scale"], global_num_experts=E,
                  expert_map=p["expert_map"], **kw)


def reference(p, **kw):
    return moe_reference(p["hidden_states"], p["w1"], p["w2"], p["topk_weights"], p["topk_ids"],
                         w1_scale=p["w1_scale"], w2_scale=p["w2_scale"],
                         expert_map=p["expert_map"], **kw)


def new_kernel(experts=None):
    return FusedMoEModularKernel(NoEPPrepareAndFinalize(), experts or TritonExperts())


def check_close(out, ref):
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert torch.isfinite(out).all()
    assert calc_diff(out, ref) < 4e-3 and rel_err(out, ref) < 9e-2, (calc_diff(out, ref),
                                                                      rel_err(out, ref))


GRID = [(E, k, M) for E in (1, 8, 32) for k in (1, 2, 6) for M in (1, 7, 130) if k <= E]


@pytest.mark.parametrize("use_map", [False, True])
@pytest.mark.parametrize("E,k,M", GRID)
def test_kernel_matches_reference(E, k, M, use_map):
    N = 256 if (E + k + M) % 2 else 128
    local = list(range(0, E, 2)) if use_map and E > 1 else ([0] if use_map else None)
    p = make_problem(M, k, E, N, 256, local=local, seed=E * 100 + k * 10 + M)
    out = run(new_kernel(), p, E)
    ref = reference(p)
    if ref.abs().sum() == 0:  # every slot non-local (possible for M=1): exact zeros
        assert out.eq(0).all()
    else:
        check_close(out, ref)


def test_int32_and_int64_ids_give_the_same_output():
    p = make_problem(17, 3, 8, 128, 256, local=[1, 2, 5], seed=4)
    out64 = run(new_kernel(), p, 8)
    out32 = run(new_kernel(), dict(p, topk_ids=p["topk_ids"].int()), 8)
    assert torch.equal(out64, out32)
    check_close(out64, reference(p))


def test_minus_one_ids_contribute_nothing():
    """topk_ids -1 (DeepEP's "no expert"): the slot adds nothing, whatever its weight; a token of
    only -1 slots comes out exactly 0."""
    p = make_problem(12, 4, 8, 128, 256, seed=8)
    ids = p["topk_ids"]
    ids[0] = -1
    ids[1:, 2] = -1
    out = run(new_kernel(), p, 8)
    assert out[0].eq(0).all()
    kept = dict(p, topk_ids=ids[1:, [0, 1, 3]].contiguous(),
                topk_weights=p["topk_weights"][1:, [0, 1, 3]].contiguous(),
                hidden_states=p["hidden_states"][1:])
    assert torch.equal(out[1:], run(new_kernel(), kept, 8))  # same bits as dropping the slots
    check_close(out, reference(p))


@pytest.mark.parametrize("chunk,M", [(5, 23), (1, 4), (7, 7), (16, 3)])
def test_chunked_call_matches_one_pass(chunk, M, monkeypatch):
    """VLLM_FUSED_MOE_CHUNK_SIZE caps the tokens per pass; the output matches the reference and
    one pass, and the workspaces are sized for one chunk."""
    p = make_problem(M, 3, 8, 128, 256, local=[0, 3, 4, 6], seed=chunk * 10 + M)
    one_pass = run(new_kernel(), p, 8)
    monkeypatch.setenv("VLLM_FUSED_MOE_CHUNK_SIZE", str(chunk))
    pf = RecordingNoEP()
    kernel = FusedMoEModularKernel(pf, TritonExperts())
    out = run(kernel, p, 8)
    want_chunks = [min(chunk, M - i) for i in range(0, M, chunk)]
    assert pf.chunks == want_chunks
    ws13, ws2, _ = TritonExperts().workspace_shapes(min(chunk, M), 128, 256, 3, 4)
    assert kernel.workspaces.ws13.numel() == ws13[0] * ws13[1]
    assert kernel.workspaces.ws2.numel() == ws2[0] * ws2[1]
    check_close(out, reference(p))
    assert calc_diff(out, one_pass) < 1e-6  # float32 matmuls of other row counts may round apart


def test_expert_parallel_ranks_run_the_agreed_number_of_chunks(monkeypatch):
    """With expert parallelism every rank makes the same number of passes: given the group's
    largest M, a rank with fewer tokens runs empty chunks (M = 0 slices) after its own."""
    monkeypatch.setenv("VLLM_FUSED_MOE_CHUNK_SIZE", "3")
    p = make_problem(7, 2, 8, 128, 256, seed=6)
    pf = RecordingNoEP(num_dispatchers=2)
    out = run(FusedMoEModularKernel(pf, TritonExperts()), p, 8, max_tokens_across_ranks=12)
    assert pf.chunks == [3, 3, 1, 0]
    check_close(out, reference(p))
    pf.chunks = []
    run(FusedMoEModularKernel(pf, TritonExperts()), p, 8)  # no maximum given: one pass
    assert pf.chunks == [7]
    empty = make_problem(0, 2, 8, 128, 256)
    pf.chunks = []
    assert run(FusedMoEModularKernel(pf, TritonExperts()), empty, 8).shape == (0, 256)
    assert pf.chunks == [0]  # an empty rank still takes part in the collectives
    alone = RecordingNoEP()
    run(FusedMoEModularKernel(alone, TritonExperts()), empty, 8)
    assert alone.chunks == []


def test_default_num_chunks():
    class OneRank(NoEPPrepareAndFinalize):
        pass

    class TwoRanks(NoEPPrepareAndFinalize):
        def num_dispatchers(self):
            return 2

    assert OneRank().num_chunks(10, 4, None) == 3 and OneRank().num_chunks(0, 4, None) == 0
    assert OneRank().num_chunks(10, 4, 17) == 5
    assert TwoRanks().num_chunks(10, 4, None) == 1 and TwoRanks().num_chunks(3, 4, 9) == 3


class LocalBatchedPrepareAndFinalize(PrepareAndFinalize):
    """A one-rank batched prepare/finalize (what a low-latency dispatch at world size 1 does):
    each local expert's tokens in a slice of capacity T = max_tokens * topk rows, the weighted
    sum back per token. For tests of the batched experts through the kernel."""

    activation_format = ActivationFormat.BATCHED

    def __init__(self, max_tokens):
        self.max_tokens = max_tokens

    def max_num_tokens_per_rank(self):
        return self.max_tokens

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input):
        M, K = a1.shape
        T = self.max_tokens * topk_ids.shape[1]
        x = torch.zeros(num_experts, T, K, dtype=a1.dtype)
        counts = torch.zeros(num_experts, dtype=torch.int32)
        self.rows = {}
        for m, j in zip(*torch.nonzero(topk_ids >= 0, as_tuple=True)):
            e = int(topk_ids[m, j])
            self.rows[(int(m), int(j))] = (e, int(counts[e]))
            x[e, counts[e]] = a1[m]
            counts[e] += 1
        a1q, a1s = quant_batched_fp8(x)
        return PrepareResult(a1q=a1q, a1q_scale=a1s, expert_num_tokens=counts)

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, *, output_is_reduced=False):
        acc = torch.zeros(output.shape, dtype=torch.float32)
        for (m, j), (e, r) in self.rows.items():
            acc[m] += topk_weights[m, j] * fused_expert_output[e, r].float()
        output.copy_(acc)


def test_batched_experts_through_the_kernel_get_expected_m(monkeypatch):
    """BatchedTritonExperts and (fake) BatchedDeepGemmExperts through a one-rank batched
    prepare/finalize: outputs match the reference; DeepGEMM's masked GEMM gets the capacity
    estimate max_tokens * ranks * topk / E bounded to [1, T], not T."""
    E, k, M, cap = 8, 2, 5, 64  # T = cap * k = 128 rows, as DeepGEMM's masked GEMM needs
    p = make_problem(M, k, E, 128, 256, seed=12)
    out = run(FusedMoEModularKernel(LocalBatchedPrepareAndFinalize(cap), BatchedTritonExperts()),
              p, E)
    check_close(out, reference(p))
    seen = []
    masked = lambda a, b, d, m, expected_m, **kw: (  # noqa: E731
        seen.append(expected_m), grouped_fp8_gemm_masked_ref(a, b, d, m))
    fake = types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=lambda *a, **kw: None,
                                 m_grouped_fp8_gemm_nt_masked=masked)
    monkeypatch.setattr(compat, "_API", compat.resolve(fake))
    out_dg = run(FusedMoEModularKernel(LocalBatchedPrepareAndFinalize(cap),
                                       BatchedDeepGemmExperts()), p, E)
    assert torch.equal(out_dg, out)
    assert seen == [cap * k // E] * 2 == [16, 16]
    assert expected_rows_per_expert(128, 1, 8, 32, 1024) == 32
    assert expected_rows_per_expert(128, 4, 8, 8, 512) == 512  # bounded by T
    assert expected_rows_per_expert(1, 1, 1, 256, 8) == 1
    assert expected_rows_per_expert(None, 1, 8, 32, 77) == 77


def test_apply_router_weight_on_input():
    p = make_problem(33, 1, 8, 128, 256, seed=7)
    out = run(new_kernel(), p, 8, apply_router_weight_on_input=True)
    check_close(out, reference(p, apply_router_weight_on_input=True))


def test_empty_input():
    p = make_problem(0, 2, 8, 128, 256)
    out = run(new_kernel(), p, 8)
    assert out.shape == (0, 256) and out.dtype == torch.bfloat16


def _ws_ptrs(kernel):
    return kernel.workspaces.ws13.data_ptr(), kernel.workspaces.ws2.data_ptr()


def test_workspaces_reused_and_grown():
    kernel = new_kernel()
    p = make_problem(64, 2, 8, 128, 256, seed=1)
    run(kernel, p, 8)
    ptrs, sizes = _ws_ptrs(kernel), (kernel.workspaces.ws13.numel(), kernel.workspaces.ws2.numel())
    # same M, then smaller M: same buffers, no new ones
    for M in (64, 5):
        q = make_problem(M, 2, 8, 128, 256, seed=M)
        check_close(run(kernel, q, 8), reference(q))
        assert _ws_ptrs(kernel) == ptrs
        assert (kernel.workspaces.ws13.numel(), kernel.workspaces.ws2.numel()) == sizes
    # larger M: both grow
    big = make_problem(300, 2, 8, 128, 256, seed=3)
    check_close(run(kernel, big, 8), reference(big))
    assert kernel.workspaces.ws13.numel() > sizes[0] and kernel.workspaces.ws2.numel() > sizes[1]
    # a shared Workspaces serves a second kernel (another layer) without allocating
    other = FusedMoEModularKernel(NoEPPrepareAndFinalize(), TritonExperts(), kernel.workspaces)
    ptrs = _ws_ptrs(kernel)
    run(other, p, 8)
    assert _ws_ptrs(other) == ptrs


def test_workspace_views_are_reused_until_a_buffer_grows():
    """Same request -> the same view objects (and the experts' views cached on them); a growth
    drops them all."""
    ws = Workspaces()
    cpu = torch.device("cpu")
    a = ws.get((4, 8), (2, 8), cpu, torch.bfloat16)
    assert ws.get((4, 8), (2, 8), cpu, torch.bfloat16) is a
    shapes = TritonExperts().workspace_shapes(3, 128, 256, 2, 2)
    w13, w2 = ws.get(shapes[0], shapes[1], cpu, torch.bfloat16)
    v = workspace_views(w13, w2, 6, 2, 256, 128)
    assert workspace_views(w13, w2, 6, 2, 256, 128) is v
    assert v.layout.m_indices.data_ptr() == w2.data_ptr() + (w2.numel() - 8 * w2.shape[0]) * 2
    bigger = TritonExperts().workspace_shapes(300, 128, 256, 2, 2)
    grown = ws.get(bigger[0], bigger[1], cpu, torch.bfloat16)
    assert ws.get(shapes[0], shapes[1], cpu, torch.bfloat16)[1] is not w2
    assert grown[0].data_ptr() == ws.ws13.data_ptr()


def test_sizes_module_is_torch_free_and_matches_the_experts():
    import subprocess
    import sys
    code = ("import sys, vllm_moe_fixes.sizes as s; assert 'torch' not in sys.modules; "
            "print(s.ALIGNMENT)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "128"
    for M, N, K, k, E_l in [(130, 128, 256, 6, 32), (7, 512, 256, 2, 4), (1, 2048, 7168, 8, 32)]:
        assert TritonExperts().workspace_shapes(M, N, K, k, E_l) == \
            contiguous_workspace_shapes(M, N, K, k, E_l)
        assert BatchedTritonExperts().workspace_shapes(M, N, K, k, E_l) == \
            batched_workspace_shapes(M, N, K, E_l)
    # batched: ws13 H [2N] or Y [K] per row; ws2 G' [N/2] + G''s scales [N/64] per row.
    assert batched_workspace_shapes(5, 128, 256, 3) == ((3, 5, 256), (3, 5, 64 + 2), (3, 5, 256))
    assert batched_workspace_shapes(5, 512, 1152, 3) == ((3, 5, 1152), (3, 5, 256 + 8),
                                                           (3, 5, 1152))
    # contiguous: ws13 A [K/2 + K/64] or G' [N/2 + N/64] or the output; ws2 H [2N] or Y [K] + 8.
    m_sum = (130 * 6 + 32 * 127 + 127) // 128 * 128
    assert layer_declared_bytes(130, 128, 256, 6, 32) == \
        2 * (m_sum * (128 + 4) + m_sum * (256 + 8)) + 130 * 256 * 2 + 130 * 256 + 130 * 2 * 4


def test_declared_workspace_shapes():
    ws13, ws2, out = TritonExperts().workspace_shapes(130, 128, 256, 6, 32)
    m_sum = (130 * 6 + 32 * 127 + 127) // 128 * 128
    assert ws13 == (m_sum, 132) and ws2 == (m_sum, 256 + LAYOUT_INDEX_COLUMNS)
    assert out == (130, 256)  # reduced
    assert TritonExperts().workspace_shapes(7, 512, 256, 2, 4)[:2] == ((640, 264), (640, 1032))
    # k = 1: the reduced output [M, K] can need more of ws13 than A or G'
    ws13, _, out = TritonExperts().workspace_shapes(1000, 128, 7168, 1, 2)
    assert ws13[0] * ws13[1] >= 1000 * 7168 and ws13[1] > 7168 // 2 + 7168 // 64
    assert TritonExperts().reduces_output and not BatchedTritonExperts().reduces_output


class RecordingNoEP(NoEPPrepareAndFinalize):
    """Records what finalize receives, and the size of every chunk prepare sees."""

    def __init__(self, num_dispatchers=1):
        self._num_dispatchers = num_dispatchers
        self.chunks = []

    def num_dispatchers(self):
        return self._num_dispatchers

    def prepare(self, a1, *args):
        self.chunks.append(a1.shape[0])
        return super().prepare(a1, *args)

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, *, output_is_reduced=False):
        self.seen = (fused_expert_output is output, output_is_reduced)
        super().finalize(output, fused_expert_output, topk_weights, topk_ids,
                         apply_router_weight_on_input, output_is_reduced=output_is_reduced)


@pytest.mark.parametrize("experts_cls", ["triton", "deep_gemm_fake"])
def test_nonlocal_slots_exact_zero_with_poisoned_workspaces(experts_cls, monkeypatch):
    """NaN-filled workspaces: tokens with no local expert come out exactly 0, the others match
    the reference; a zero weight is not what hides the garbage."""
    if experts_cls == "deep_gemm_fake":
        _fake_deep_gemm(monkeypatch, skip_minus_one_rows=True)
    experts = TritonExperts() if experts_cls == "triton" else DeepGemmExperts()
    pf = RecordingNoEP()
    kernel = FusedMoEModularKernel(pf, experts)
    E, k, M = 16, 6, 40
    p = make_problem(M, k, E, 128, 256, local=[1, 4, 5, 9, 15], seed=11)
    p["topk_ids"][:3] = torch.tensor([0, 2, 3, 6, 7, 8])  # tokens 0-2: no local expert
    p["topk_ids"][3, 1:] = -1  # token 3: one slot, the others "no expert"
    ws13, ws2, _ = experts.workspace_shapes(M, 128, 256, k, 5)
    kernel.workspaces.get(ws13, ws2, torch.device("cpu"), torch.bfloat16)
    kernel.workspaces.ws13.fill_(float("nan"))
    kernel.workspaces.ws2.fill_(float("nan"))
    p["topk_weights"][4, 0] = 0.0
    out = run(kernel, p, E)
    assert pf.seen == (True, True)  # the experts wrote the layer's output, already reduced
    assert out[:3].eq(0).all() and torch.isfinite(out).all()
    check_close(out, reference(p))


def _batched_reference(a_q, a_s, w1, w1s, w2, w2s, counts):
    """float32 reference of the batched experts' valid rows (dequantised input)."""
    out = []
    for e, c in enumerate(counts):
        a = a_q[e, :c].float() * a_s[e, :c].repeat_interleave(128, dim=-1)
        ids = torch.zeros(c, 1, dtype=torch.int64)
        out.append(moe_reference(a, w1[e:e + 1], w2[e:e + 1], torch.ones(c, 1), ids,
                                 w1_scale=w1s[e:e + 1], w2_scale=w2s[e:e + 1]))
    return out


@pytest.mark.parametrize("N,K,T,device", [
    (128, 256, 5, "cpu"), (128, 384, 64, "cpu"), (512, 256, 9, "cpu"), (256, 128, 3, "cpu"),
    pytest.param(128, 7168, 130, "cuda", marks=pytest.mark.gpu),
    pytest.param(2048, 7168, 64, "cuda", marks=pytest.mark.gpu)])
def test_batched_apply_with_exact_poisoned_workspaces(N, K, T, device, monkeypatch):
    """BatchedTritonExperts.apply with workspaces of exactly the declared sizes, NaN-filled, sitting
    between NaN guard bands: every view fits (the guards stay untouched; G' and its scales fill ws2
    to its last byte), and the valid rows match the reference. G''s scales are MN-major per
    expert, right after G'."""
    counts = [3, 0, T, 1]
    e_l = len(counts)
    g = torch.Generator().manual_seed(N + K + T)
    w1, w1s = quant_block_fp8(torch.randn(e_l, 2 * N, K, generator=g) / K ** 0.5)
    w2, w2s = quant_block_fp8(torch.randn(e_l, K, N, generator=g) / N ** 0.5)
    a_q, a_s = quant_batched_fp8(torch.randn(e_l, T, K, generator=g).bfloat16().to(device))
    w1, w1s, w2, w2s = (t.to(device) for t in (w1, w1s, w2, w2s))
    experts = BatchedTritonExperts()
    ws13_shape, ws2_shape, out_shape = experts.workspace_shapes(T, N, K, 1, e_l)
    guard = 64
    bufs = []
    for shape in (ws13_shape, ws2_shape):
        n = torch.Size(shape).numel()
        buf = torch.full((n + 2 * guard,), float("nan"), dtype=torch.bfloat16, device=device)
        bufs.append((buf, buf[guard:guard + n].view(shape)))
    (buf13, ws13), (buf2, ws2) = bufs
    out = ws13.view(-1)[:torch.Size(out_shape).numel()].view(out_shape)
    seen = []
    real_gemm = BatchedTritonExperts.gemm

    def gemm(self, a, w, o, m, expected_m):
        seen.append(a)
        return real_gemm(self, a, w, o, m, expected_m)

    monkeypatch.setattr(BatchedTritonExperts, "gemm", gemm)
    experts.apply(out, a_q, a_s, w1, w2, w1s, w2s, None, None, "silu", ws13, ws2,
                  torch.tensor(counts, dtype=torch.int32, device=device))
    for buf in (buf13, buf2):
        assert buf[:guard].isnan().all() and buf[-guard:].isnan().all()
    g_q, g_s = seen[1]  # GEMM2's input: G' and its scales, filling ws2
    assert g_s.stride() == (T * N // 128, 1, T)
    assert g_q.data_ptr() == ws2.data_ptr() and g_q.data_ptr() + g_q.numel() == g_s.data_ptr()
    assert g_s.data_ptr() + g_s.numel() * 4 == ws2.data_ptr() + ws2.numel() * 2
    refs = _batched_reference(*(t.cpu() for t in (a_q, a_s, w1, w1s, w2, w2s)), counts)
    for e, (c, ref) in enumerate(zip(counts, refs)):
        if c:
            check_close(out[e, :c].cpu(), ref)


def test_quant_batched_fp8_into_given_buffers():
    x = torch.randn(3, 5, 256).bfloat16()
    want_q, want_s = quant_batched_fp8(x)
    assert want_s.shape == (3, 5, 2) and want_s.stride() == (10, 1, 5)
    q = torch.empty(3, 5, 256, dtype=torch.float8_e4m3fn)
    s_mn = torch.full((3, 2, 5), float("nan")).transpose(1, 2)
    got_q, got_s = quant_batched_fp8(x, out_q=q, out_s=s_mn)
    assert got_q.data_ptr() == q.data_ptr() and got_s is s_mn
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got_s, want_s)


def test_bad_arguments():
    kernel = new_kernel()
    p = make_problem(4, 2, 8, 128, 256)

    def bad(match, **changes):
        q = dict(p, **{k: v for k, v in changes.items() if k in p})
        kw = {k: v for k, v in changes.items() if k not in p}
        with pytest.raises(ValueError, match=match):
            run(kernel, q, kw.pop("E", 8), **kw)

    x, w1, w2 = p["hidden_states"], p["w1"], p["w2"]
    bad("hidden_states", hidden_states=x.float())
    bad("hidden_states", hidden_states=x[None])
    bad("contiguous channels", hidden_states=x.t().contiguous().t())
    bad("w1", w1=w1.view(torch.uint8))
    bad("w1", w1=w1[:, :, :128])
    bad("w2", w2=w2[:, :, :64])
    bad("w2", w2=w2[:4])
    bad("w1_scale", w1_scale=p["w1_scale"][:, :1])
    bad("w2_scale", w2_scale=p["w2_scale"].double())
    bad("topk_ids", topk_ids=p["topk_ids"].short())
    bad("topk_ids", topk_ids=p["topk_ids"].float())
    bad("topk_ids", topk_ids=p["topk_ids"][:3])
    bad("topk_weights", topk_weights=p["topk_weights"].bfloat16())
    bad("topk_weights", topk_weights=p["topk_weights"][:, :1])
    bad("global_num_experts", E=16)
    bad("expert_map", expert_map=torch.arange(8))  # int64
    bad("expert_map", expert_map=torch.arange(4, dtype=torch.int32))
    bad("activation", activation="gelu")
    bad("apply_router_weight_on_input needs topk == 1", apply_router_weight_on_input=True)
    bad("must be a torch.Tensor", w1_scale=None)
    bad(r"w1_scale must be float32 \(8, 2, 2\)", w1_scale=torch.ones(8, 3, 2))  # exact shape
    bad("max_tokens_across_ranks", max_tokens_across_ranks=3)
    bad("max_tokens_across_ranks", max_tokens_across_ranks=4.0)
    ids = p["topk_ids"].clone()
    ids[2, 1] = 8
    bad(r"topk_ids must hold expert ids in \[-1, 8\).*topk_ids\[2, 1\] = 8", topk_ids=ids)
    ids[2, 1] = -2
    bad(r"topk_ids\[2, 1\] = -2", topk_ids=ids.int())
    emap = torch.tensor([0, 1, 2, 3, 4, 5, 6, 8], dtype=torch.int32)
    bad(r"expert_map must hold local ids in \[-1, 8\).*expert_map\[7\] = 8", expert_map=emap)


@pytest.mark.parametrize("N,K", [(96, 256), (128, 200), (192, 128), (64, 64)])
def test_sizes_not_multiples_of_128_refused(N, K):
    """No backend runs such a layer: validation says so before anything runs."""
    E, M = 4, 3
    w1 = torch.zeros(E, 2 * N, K).to(torch.float8_e4m3fn)
    w2 = torch.zeros(E, K, N).to(torch.float8_e4m3fn)
    cdiv = lambda a: -(-a // 128)  # noqa: E731
    p = dict(hidden_states=torch.randn(M, K).bfloat16(), w1=w1, w2=w2,
             topk_weights=torch.ones(M, 1), topk_ids=torch.zeros(M, 1, dtype=torch.int64),
             w1_scale=torch.ones(E, cdiv(2 * N), cdiv(K)), w2_scale=torch.ones(E, cdiv(K), cdiv(N)),
             expert_map=None)
    with pytest.raises(ValueError, match=rf"K={K} and intermediate size I={N} must be multiples "
                                         r"of 128"):
        run(new_kernel(), p, E)


def test_format_mismatch_refused():
    class Batched(Experts):
        activation_format = ActivationFormat.BATCHED

        def workspace_shapes(self, *a):
            raise AssertionError

        def apply(self, *a):
            raise AssertionError

    with pytest.raises(ValueError, match="batched"):
        FusedMoEModularKernel(NoEPPrepareAndFinalize(), Batched())
    with pytest.raises(ValueError, match="Experts"):
        FusedMoEModularKernel(NoEPPrepareAndFinalize(), object())


# --- DeepGEMM selection and the compatibility module --------------------------------------------

def _fake_deep_gemm(monkeypatch, *, old_names=False, skip_minus_one_rows=False):
    """Install a fake DeepGEMM API (torch reference GEMM) and return its call log."""
    calls = []

    def contiguous(a, b, d, layout, disable_ue8m0_cast=False):
        calls.append((disable_ue8m0_cast, layout))
        if skip_minus_one_rows:  # like SM90: leave whole -1 blocks untouched (here: all -1 rows)
            keep = d[layout < 0].clone()
        grouped_fp8_gemm_contiguous_ref(a, b, d, layout)
        if skip_minus_one_rows:
            d[layout < 0] = keep

    def old_contiguous(lhs, rhs, out, m_indices):  # positional only, no ue8m0 keyword
        calls.append((None, m_indices))
        grouped_fp8_gemm_contiguous_ref(lhs, rhs, out, m_indices)

    mod = types.SimpleNamespace(get_m_alignment_for_contiguous_layout=lambda: 128)
    if old_names:
        mod.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous = old_contiguous
    else:
        mod.m_grouped_fp8_gemm_nt_contiguous = contiguous
    monkeypatch.setattr(compat, "_API", compat.resolve(mod))
    return calls


@pytest.mark.parametrize("old_names", [False, True])
def test_deep_gemm_experts_through_compat(monkeypatch, old_names):
    calls = _fake_deep_gemm(monkeypatch, old_names=old_names)
    p = make_problem(20, 2, 8, 128, 256, local=[0, 3, 6], seed=5)
    out = run(new_kernel(DeepGemmExperts()), p, 8)
    triton_out = run(new_kernel(TritonExperts()), p, 8)
    assert torch.equal(out, triton_out)  # same path on CPU, only the GEMM call differs
    assert len(calls) == 2 and calls[0][0] is (None if old_names else True)
    assert calls[0][1].dtype == torch.int32


def test_compat_resolve_names():
    def fn_new(a, b, d, grouped_layout, *, disable_ue8m0_cast=False):
        pass

    class PybindLike:  # no signature, keyword visible only in the docstring
        __doc__ = ("m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, expected_m, "
                   "disable_ue8m0_cast: bool = False)")

        def __call__(self, *a, **k):
            pass

    new = types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=fn_new,
                                fp8_m_grouped_gemm_nt_masked=PybindLike(),
                                get_mk_alignment_for_contiguous_layout=lambda: 128)
    api = compat.resolve(new)
    assert api.contiguous is fn_new and api.contiguous_ue8m0_kwarg
    assert api.masked is new.fp8_m_grouped_gemm_nt_masked
    old = types.SimpleNamespace(m_grouped_gemm_fp8_fp8_bf16_nt_contiguous=lambda l, r, o, m: None,
                                m_grouped_gemm_fp8_fp8_bf16_nt_masked=lambda l, r, o, m, e: None,
                                get_m_alignment_for_contiguous_layout=lambda: 64)
    api = compat.resolve(old)
    assert api.contiguous is old.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous
    assert not api.contiguous_ue8m0_kwarg and not api.masked_ue8m0_kwarg
    assert api.alignment() == 64


def test_deep_gemm_experts_refuse_another_alignment(monkeypatch):
    _fake_deep_gemm(monkeypatch)
    monkeypatch.setattr(compat._API, "alignment", lambda: 64)
    with pytest.raises(RuntimeError, match="aligns expert segments to 64 rows"):
        DeepGemmExperts()


def test_compat_without_deep_gemm(monkeypatch):
    monkeypatch.setattr(compat, "_API", None)
    assert not compat.is_available()
    for call in (compat.require, DeepGemmExperts,
                 lambda: compat.m_grouped_fp8_gemm_nt_contiguous(None, None, None, None)):
        with pytest.raises(RuntimeError,
                           match="VLLM_USE_DEEP_GEMM.*DeepGEMM|DeepGEMM.*VLLM_USE_DEEP_GEMM"):
            call()


def test_select_experts(monkeypatch, caplog):
    monkeypatch.delenv("VLLM_USE_DEEP_GEMM", raising=False)
    assert type(select_experts(128, 256)) is TritonExperts
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1")
    monkeypatch.setattr(compat, "_API", None)
    with pytest.raises(RuntimeError, match="VLLM_USE_DEEP_GEMM") as err:
        select_experts(128, 256)
    assert "DeepGEMM" in str(err.value)
    _fake_deep_gemm(monkeypatch)
    assert type(select_experts(128, 256)) is DeepGemmExperts
    monkeypatch.setattr(selection_mod, "_warned_shapes", set())
    with caplog.at_level(logging.WARNING, logger=selection_mod.__name__):
        assert type(select_experts(96, 256)) is TritonExperts
        assert type(select_experts(96, 256)) is TritonExperts
        assert type(select_experts(128, 200)) is TritonExperts
    warnings = [r for r in caplog.records if "multiples of 128" in r.getMessage()]
    assert len(warnings) == 2  # once per shape
    assert all("no backend" in r.getMessage() for r in warnings)


def test_select_batched_experts(monkeypatch, caplog):
    monkeypatch.delenv("VLLM_USE_DEEP_GEMM", raising=False)
    assert type(select_batched_experts(128, 256)) is BatchedTritonExperts
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1")
    monkeypatch.setattr(compat, "_API", None)
    with pytest.raises(RuntimeError, match="VLLM_USE_DEEP_GEMM") as err:
        select_batched_experts(128, 256)
    assert "DeepGEMM" in str(err.value)
    _fake_deep_gemm(monkeypatch)
    assert type(select_batched_experts(128, 256)) is BatchedDeepGemmExperts
    monkeypatch.setattr(selection_mod, "_warned_shapes", set())
    with caplog.at_level(logging.WARNING, logger=selection_mod.__name__):
        assert type(select_batched_experts(96, 256)) is BatchedTritonExperts
        assert type(select_batched_experts(96, 256)) is BatchedTritonExperts
        assert type(select_batched_experts(128, 200)) is BatchedTritonExperts
    warnings = [r for r in caplog.records if "multiples of 128" in r.getMessage()]
    assert len(warnings) == 2  # once per shape
    assert all("no backend" in r.getMessage() for r in warnings)
    from vllm_moe_fixes import fused_moe
    assert fused_moe.select_batched_experts is select_batched_experts
    for bad_args in [("a", "b"), (0, 128), (128, True)]:
        for select in (select_experts, select_batched_experts):
            with pytest.raises(ValueError, match="intermediate_size|hidden_size"):
                select(*bad_args)


def test_triton_path_under_interpreter(monkeypatch, kernel_device):
    """TritonExperts with every Triton launcher of the contiguous path (layout, permute, grouped
    GEMM, SiLU-quant, un-permute + reduce; interpreted on CPU) on a tiny layer with non-local
    experts."""
    p = make_problem(5, 2, 4, 128, 128, local=[0, 2, 3], device=kernel_device, seed=9)
    want = run(new_kernel(), p, 4)
    monkeypatch.setattr(experts_mod, "launchers_for", lambda device: experts_mod.TRITON_LAUNCHERS)
    monkeypatch.setattr(experts_mod, "grouped_fp8_gemm_contiguous_ref",
                        grouped_fp8_gemm_contiguous_triton)
    got = run(new_kernel(), p, 4)
    assert calc_diff(got, want) < 1e-3  # bf16 ties flip a few FP8 requantisations
    check_close(got, reference(p))


# --- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("use_map", [False, True])
@pytest.mark.parametrize("E,k,M,N,K", [(8, 2, 1, 256, 512), (32, 6, 130, 512, 1024),
                                       (8, 8, 2048, 1024, 2048), (64, 6, 777, 256, 2048)])
def test_gpu_kernel_matches_reference(E, k, M, N, K, use_map):
    local = list(range(1, E, 2)) if use_map else None
    p = make_problem(M, k, E, N, K, local=local, device="cuda", seed=M)
    kernel = new_kernel()
    ws13, ws2, _ = TritonExperts().workspace_shapes(M, N, K, k, E if local is None else len(local))
    kernel.workspaces.get(ws13, ws2, torch.device("cuda"), torch.bfloat16)
    kernel.workspaces.ws13.fill_(float("nan"))
    kernel.workspaces.ws2.fill_(float("nan"))
    out = run(kernel, p, E)
    check_close(out, reference(p))


@pytest.mark.gpu
def test_gpu_peak_memory_is_declared_workspaces_plus_output():
    """Counted: ws13 + ws2 (declared, bf16) + returned output [M, K] bf16 + prepare's a1q
    [M, K] fp8 and a1q_scale [M, K/128] f32. Small per-call index vectors and the requantised
    scales are what the 5% covers."""
    E, k, M, N, K = 8, 8, 2048, 1024, 2048
    p = make_problem(M, k, E, N, K, device="cuda", seed=1)
    run(new_kernel(), p, E)  # compile the Triton kernels outside the measurement
    kernel = new_kernel()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = run(kernel, p, E)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ws13, ws2, _ = TritonExperts().workspace_shapes(M, N, K, k, E)
    declared = 2 * (ws13[0] * ws13[1] + ws2[0] * ws2[1])
    expected = layer_declared_bytes(M, N, K, k, E)
    assert expected == declared + out.numel() * 2 + M * K + M * (K // 128) * 4
    assert expected <= peak <= 1.05 * expected, (peak, expected)
    # steady state: a second call allocates only the output, prepare's tensors and small vectors
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run(kernel, p, E)
    assert torch.cuda.max_memory_allocated() - base <= 1.05 * (expected - declared) + 8 * 2**20


@pytest.mark.gpu
def test_gpu_past_2_31_elements():
    """M*k*K = 40000*8*7168 > 2**31: the unreduced output and the permuted layout need 64-bit
    offsets. Checked against the reference overall and on the last tokens."""
    E, k, M, N, K = 8, 8, 40000, 128, 7168
    assert M * k * K > 2 ** 31
    p = make_problem(M, k, E, N, K, device="cuda", seed=2)
    out = run(new_kernel(), p, E)
    ref = reference(p)
    check_close(out, ref)
    check_close(out[-64:], ref[-64:])


@pytest.mark.gpu
@pytest.mark.parametrize("M,use_map,chunk", [(128, False, None), (2048, True, None),
                                             (2048, False, 768)])
def test_gpu_cuda_graph_replay_matches_eager(M, use_map, chunk, monkeypatch):
    """Engines run decode under CUDA graphs: the whole layer (layout, permute, GEMMs, SiLU,
    requantisation, un-permute, finalize) must capture without host syncs, reuse the kernel's
    workspaces, and replay on NEW data copied into the captured inputs (new tokens and routing).
    M = 128 builds the layout in one chunk of slots, M = 2048 (16384 slots) in 128 chunks; with
    VLLM_FUSED_MOE_CHUNK_SIZE=768 the captured call makes three passes."""
    if chunk is not None:
        monkeypatch.setenv("VLLM_FUSED_MOE_CHUNK_SIZE", str(chunk))
    E, k, N, K = 16, 8, 512, 1024
    local = list(range(1, E, 2)) if use_map else None
    p = make_problem(M, k, E, N, K, local=local, device="cuda", seed=M)
    kernel = new_kernel()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the Triton kernels and size the workspaces
        for _ in range(2):
            run(kernel, p, E)
    torch.cuda.current_stream().wait_stream(side)
    ptrs = _ws_ptrs(kernel)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(kernel, p, E)
    assert _ws_ptrs(kernel) == ptrs  # captured against the workspaces the kernel keeps
    for seed in (M + 1, M + 2):
        q = make_problem(M, k, E, N, K, local=local, device="cuda", seed=seed)
        for name in ("hidden_states", "topk_weights", "topk_ids"):  # same weights, new inputs
            p[name].copy_(q[name])
        graph.replay()
        replayed = out.clone()
        eager = run(kernel, p, E)
        assert torch.equal(replayed, eager)  # same kernels on the same data: bit for bit
        check_close(replayed, reference(p))


@pytest.mark.gpu
@pytest.mark.deep_gemm
@pytest.mark.parametrize("E,k,M,N,K,use_map", [(8, 8, 512, 2048, 7168, False),
                                               (32, 6, 130, 256, 1024, True)])
def test_gpu_deep_gemm_experts(E, k, M, N, K, use_map, monkeypatch):
    """The real DeepGEMM (needs an SM90/SM100 build): selection, poisoned workspaces, reference."""
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1")
    experts = select_experts(N, K)
    assert type(experts) is DeepGemmExperts
    local = list(range(0, E, 2)) if use_map else None
    p = make_problem(M, k, E, N, K, local=local, device="cuda", seed=M)
    if use_map:  # token 0: only non-local experts (odd ids)
        p["topk_ids"][0] = torch.arange(1, 2 * k, 2, device="cuda")
    kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(), experts)
    ws13, ws2, _ = experts.workspace_shapes(M, N, K, k, E if local is None else len(local))
    kernel.workspaces.get(ws13, ws2, torch.device("cuda"), torch.bfloat16)
    kernel.workspaces.ws13.fill_(float("nan"))
    kernel.workspaces.ws2.fill_(float("nan"))
    out = run(kernel, p, E)
    ref = reference(p)
    check_close(out, ref)
    assert torch.isfinite(out).all()
    if use_map:
        assert out[0].eq(0).all()
    triton_out = run(new_kernel(), p, E)
    assert calc_diff(out, triton_out) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("M,backend", [(1, "triton"), (128, "triton"), (4096, "triton"),
                                       pytest.param(128, "deep_gemm", marks=pytest.mark.deep_gemm),
                                       pytest.param(4096, "deep_gemm",
                                                    marks=pytest.mark.deep_gemm)])
def test_gpu_contiguous_path_launches_at_most_8_kernels(M, backend):
    """input quant + layout (2) + permute + GEMM1 + SiLU-quant + GEMM2 + un-permute-reduce."""
    E, k, N, K = 8, 8, 256, 512
    p = make_problem(M, k, E, N, K, device="cuda", seed=M)
    kernel = new_kernel(DeepGemmExperts() if backend == "deep_gemm" else None)
    per_call, names = kernels_per_call(lambda: run(kernel, p, E), copies=False)
    assert per_call <= 8, (per_call, names)


@pytest.mark.gpu
def test_gpu_steady_state_call_does_not_synchronise():
    """No .item(), .tolist(), boolean indexing or nonzero on the one-rank path: a second call
    under torch's sync debug mode 'error' raises on any synchronising op."""
    p = make_problem(300, 6, 16, 256, 512, local=list(range(0, 16, 2)), device="cuda", seed=3)
    kernel = new_kernel()
    want = run(kernel, p, 16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = run(kernel, p, 16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out, want)


@pytest.mark.gpu
def test_gpu_id_range_check_is_opt_in(monkeypatch):
    """CUDA ids are range-checked only with VLLM_MOE_CHECK_IDS=1 (it synchronises); unchecked, an
    out-of-range id gets no row, like -1."""
    p = make_problem(20, 2, 8, 128, 256, device="cuda", seed=5)
    p["topk_ids"][3, 1] = 8
    monkeypatch.setenv("VLLM_MOE_CHECK_IDS", "1")
    with pytest.raises(ValueError, match=r"topk_ids\[3, 1\] = 8"):
        run(new_kernel(), p, 8)
    bad_map = dict(p, topk_ids=p["topk_ids"].clamp(max=7),
                   expert_map=torch.tensor([0, 1, 2, 3, 4, 5, 6, 9], dtype=torch.int32,
                                           device="cuda"))
    with pytest.raises(ValueError, match=r"expert_map\[7\] = 9"):
        run(new_kernel(), bad_map, 8)
    monkeypatch.setenv("VLLM_MOE_CHECK_IDS", "0")
    out = run(new_kernel(), p, 8)
    dropped = p["topk_ids"].clone()
    dropped[3, 1] = -1
    assert torch.equal(out, run(new_kernel(), dict(p, topk_ids=dropped), 8))


@pytest.mark.gpu
def test_gpu_chunked_layer_matches_reference(monkeypatch):
    """A prefill-sized call in chunks (4 passes) against the reference and one pass."""
    E, k, M, N, K = 16, 8, 4000, 256, 1024
    p = make_problem(M, k, E, N, K, local=list(range(0, E, 2)), device="cuda", seed=4)
    one_pass = run(new_kernel(), p, E)
    monkeypatch.setenv("VLLM_FUSED_MOE_CHUNK_SIZE", "1024")
    out = run(new_kernel(), p, E)
    check_close(out, reference(p))
    assert calc_diff(out, one_pass) < 1e-6


@pytest.mark.gpu
def test_gpu_chunked_call_peaks_at_one_chunks_workspaces(monkeypatch):
    """M = 20000 tokens in chunks of 4096: the peak is one chunk's workspaces and quantised input
    plus the whole [M, K] output, not the workspaces of 20000 tokens."""
    from vllm_moe_fixes._memory import peak_memory
    E, k, M, N, K, chunk = 8, 8, 20000, 256, 1024, 4096
    monkeypatch.setenv("VLLM_FUSED_MOE_CHUNK_SIZE", str(chunk))
    p = make_problem(M, k, E, N, K, device="cuda", seed=7)
    run(new_kernel(), p, E)  # compile outside the measurement
    torch.cuda.empty_cache()
    with peak_memory() as peak:
        run(new_kernel(), p, E)
    expected = layer_declared_bytes(chunk, N, K, k, E) - 2 * chunk * K + 2 * M * K
    assert expected <= peak.bytes <= 1.05 * expected, (peak.bytes, expected)
    assert peak.bytes < 0.5 * layer_declared_bytes(M, N, K, k, E)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 130])
def test_gpu_no_ep_prepare_matches_public_quant(M):
    """NoEP's prepare launches the quant kernel without the public op's checks: the same bits
    and layout as per_token_group_quant_fp8 (fresh random input, outputs compared in full)."""
    x = torch.randn(M, 7168, device="cuda").to(torch.bfloat16) * 3
    ids = torch.zeros(M, 8, dtype=torch.int32, device="cuda")
    prep = NoEPPrepareAndFinalize().prepare(x, torch.rand(M, 8, device="cuda"), ids, 8, None,
                                            False)
    q, s = per_token_group_quant_fp8(x, 128)
    assert prep.a1q.dtype == q.dtype and prep.a1q.shape == q.shape and prep.a1q.is_contiguous()
    assert prep.a1q_scale.shape == s.shape and prep.a1q_scale.stride() == s.stride()
    assert torch.equal(prep.a1q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(prep.a1q_scale, s)
