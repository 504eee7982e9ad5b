"""The modular kernel (NoEP + TritonExperts / DeepGemmExperts) against moe_reference: routing,
chunks, the router weight on the input, empty calls, the prepare/finalize contract; GPU: the
Triton kernels, memory, CUDA graphs, kernel counts and host syncs.

On CPU the ops run their torch references, so these tests exercise the whole layer; the GPU
tests (marker gpu) run the Triton kernels. Tolerances in tests/_layer.py.
"""

import pytest
import torch
from _layer import RecordingNoEP, check_close, make_problem, new_kernel, reference, run, ws_ptrs

from vllm_moe_fixes.fused_moe.contiguous_experts import DeepGemmExperts, TritonExperts
from vllm_moe_fixes.fused_moe.interfaces import ActivationFormat, Experts
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.fused_moe.no_ep_prepare_finalize import NoEPPrepareAndFinalize
from vllm_moe_fixes.ops.fp8 import SCALE_BLOCK
from vllm_moe_fixes.ops.fp8_quant import per_token_group_quant_fp8
from vllm_moe_fixes.sizes import layer_declared_bytes
from vllm_moe_fixes.testing import calc_diff, kernels_per_call

GRID = [(E, k, M) for E in (1, 8, 32) for k in (1, 2, 6) for M in (1, 7, 130) if k <= E]


@pytest.mark.parametrize("use_map", [False, True])
@pytest.mark.parametrize("E,k,M", GRID)
def test_kernel_matches_reference(E, k, M, use_map):
    I = 256 if (E + k + M) % 2 else 128
    local = list(range(0, E, 2)) if use_map and E > 1 else ([0] if use_map else None)
    p = make_problem(M, k, E, I, 256, local=local, seed=E * 100 + k * 10 + M)
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
    """VLLM_FUSED_MOE_CHUNK_SIZE caps the tokens per dispatch chunk; the output matches the
    reference and one pass, and the workspaces are sized for one chunk."""
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
    assert torch.equal(out, one_pass)  # a row's arithmetic does not depend on the other rows


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
    assert OneRank().num_chunks(10, 4, 17) == 3  # one rank: its own tokens (the maximum unread)
    assert TwoRanks().num_chunks(10, 4, None) == 1 and TwoRanks().num_chunks(3, 4, 9) == 3


def test_apply_router_weight_on_input():
    p = make_problem(33, 1, 8, 128, 256, seed=7)
    out = run(new_kernel(), p, 8, apply_router_weight_on_input=True)
    check_close(out, reference(p, apply_router_weight_on_input=True))


def test_empty_input():
    p = make_problem(0, 2, 8, 128, 256)
    out = run(new_kernel(), p, 8)
    assert out.shape == (0, 256) and out.dtype == torch.bfloat16


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


class UnreducedExperts(TritonExperts):
    """TritonExperts' GEMMs without the reduction: [M, k, K] rows, one per slot (what experts
    gave before reduces_output), for the prepare/finalize contract tests. ws13 holds that output
    first, then TritonExperts' own ws13 (the output is the start of ws13)."""

    reduces_output = False

    def workspace_shapes(self, M, I, K, topk, local_num_experts, *, experts_pass_tokens=None):
        ws13, ws2, _ = TritonExperts().workspace_shapes(M, I, K, 1, local_num_experts)
        return (M * topk * K + ws13[0] * ws13[1],), ws2, (M, topk, K)

    def apply(self, output, a1q, a1q_scale, weights, *, workspace13, workspace2, topk_ids=None,
              expert_map=None, expert_num_tokens=None, topk_weights=None, expected_m=None,
              experts_pass_tokens=None, activation="silu"):
        (M, k), (E_l, K, I) = topk_ids.shape, weights.w2.shape
        ws13, ws2, _ = TritonExperts().workspace_shapes(M, I, K, 1, E_l)
        inner13 = workspace13[output.numel():].view(ws13)
        inner2 = workspace2.view(-1)[:ws2[0] * ws2[1]].view(ws2)
        rows = torch.empty(M, K, dtype=output.dtype)
        for j in range(k):  # slot j alone, unweighted: its row of the [M, k, K] output
            super().apply(rows, a1q, a1q_scale, weights, workspace13=inner13,
                          workspace2=inner2, topk_ids=topk_ids[:, j:j + 1].contiguous(),
                          expert_map=expert_map)
            output[:, j] = rows


class PrepareFinalizeOfTheOldSignature(NoEPPrepareAndFinalize):
    """A prepare/finalize written before finalize took output_is_reduced: it always sums the k
    slots itself."""

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input):
        weighted = fused_expert_output.float() * topk_weights.unsqueeze(-1)
        output.copy_(weighted.sum(1))


def test_finalize_of_the_old_signature_runs_with_experts_that_do_not_reduce():
    """The kernel passes output_is_reduced only to a finalize that takes it: one of the earlier
    signature runs (no TypeError) with unreduced experts, and gives the layer's result."""
    p = make_problem(9, 3, 8, 128, 256, local=[0, 2, 5, 7], seed=21)
    kernel = FusedMoEModularKernel(PrepareFinalizeOfTheOldSignature(), UnreducedExperts())
    out = run(kernel, p, 8)
    check_close(out, reference(p))
    assert calc_diff(out, run(new_kernel(), p, 8)) < 1e-4


def test_finalize_of_the_old_signature_is_refused_with_reducing_experts():
    """It would sum an already reduced output again: refused when the kernel is built, with the
    keyword to add."""
    with pytest.raises(ValueError, match=r"does not take the keyword output_is_reduced.*"
                                         r"\*, output_is_reduced: bool = False"):
        FusedMoEModularKernel(PrepareFinalizeOfTheOldSignature(), TritonExperts())


def test_finalize_taking_the_keyword_gets_it():
    """A finalize with output_is_reduced (by name or through **kwargs) receives the experts'
    reduces_output."""
    class ByKwargs(NoEPPrepareAndFinalize):
        def finalize(self, *args, **kwargs):
            self.kwargs = kwargs
            super().finalize(*args, **kwargs)

    p = make_problem(5, 2, 8, 128, 256, seed=22)
    for experts, reduced in ((TritonExperts(), True), (UnreducedExperts(), False)):
        for pf in (RecordingNoEP(), ByKwargs()):
            out = run(FusedMoEModularKernel(pf, experts), p, 8)
            got = pf.seen[1] if isinstance(pf, RecordingNoEP) else pf.kwargs
            assert got == (reduced if isinstance(pf, RecordingNoEP)
                           else {"output_is_reduced": reduced})
            check_close(out, reference(p))


# --- GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("use_map", [False, True])
@pytest.mark.parametrize("E,k,M,I,K", [(8, 2, 1, 256, 512), (32, 6, 130, 512, 1024),
                                       (8, 8, 2048, 1024, 2048), (64, 6, 777, 256, 2048)])
def test_gpu_kernel_matches_reference(E, k, M, I, K, use_map):
    local = list(range(1, E, 2)) if use_map else None
    p = make_problem(M, k, E, I, K, local=local, device="cuda", seed=M)
    kernel = new_kernel()
    ws13, ws2, _ = TritonExperts().workspace_shapes(M, I, K, k, E if local is None else len(local))
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
    E, k, M, I, K = 8, 8, 2048, 1024, 2048
    p = make_problem(M, k, E, I, K, device="cuda", seed=1)
    run(new_kernel(), p, E)  # compile the Triton kernels outside the measurement
    kernel = new_kernel()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = run(kernel, p, E)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ws13, ws2, _ = TritonExperts().workspace_shapes(M, I, K, k, E)
    declared = 2 * (ws13[0] * ws13[1] + ws2[0] * ws2[1])
    expected = layer_declared_bytes(M, I, K, k, E)
    assert expected == declared + out.numel() * 2 + M * K + M * (K // SCALE_BLOCK) * 4
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
    E, k, M, I, K = 8, 8, 40000, 128, 7168
    assert M * k * K > 2 ** 31
    p = make_problem(M, k, E, I, K, device="cuda", seed=2)
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
    E, k, I, K = 16, 8, 512, 1024
    local = list(range(1, E, 2)) if use_map else None
    p = make_problem(M, k, E, I, K, local=local, device="cuda", seed=M)
    kernel = new_kernel()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the Triton kernels and size the workspaces
        for _ in range(2):
            run(kernel, p, E)
    torch.cuda.current_stream().wait_stream(side)
    ptrs = ws_ptrs(kernel)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(kernel, p, E)
    assert ws_ptrs(kernel) == ptrs  # captured against the workspaces the kernel keeps
    for seed in (M + 1, M + 2):
        q = make_problem(M, k, E, I, K, local=local, device="cuda", seed=seed)
        for name in ("hidden_states", "topk_weights", "topk_ids"):  # same weights, new inputs
            p[name].copy_(q[name])
        graph.replay()
        replayed = out.clone()
        eager = run(kernel, p, E)
        assert torch.equal(replayed, eager)  # same kernels on the same data: bit for bit
        check_close(replayed, reference(p))


@pytest.mark.gpu
@pytest.mark.parametrize("M,backend", [(1, "triton"), (128, "triton"), (4096, "triton"),
                                       pytest.param(128, "deep_gemm", marks=pytest.mark.deep_gemm),
                                       pytest.param(4096, "deep_gemm",
                                                    marks=pytest.mark.deep_gemm)])
def test_gpu_contiguous_path_launches_at_most_8_kernels(M, backend):
    """input quant + layout (2) + permute + GEMM1 + SiLU-quant + GEMM2 + un-permute-reduce."""
    E, k, I, K = 8, 8, 256, 512
    p = make_problem(M, k, E, I, K, device="cuda", seed=M)
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
    E, k, M, I, K = 16, 8, 4000, 256, 1024
    p = make_problem(M, k, E, I, K, local=list(range(0, E, 2)), device="cuda", seed=4)
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
    E, k, M, I, K, chunk = 8, 8, 20000, 256, 1024, 4096
    monkeypatch.setenv("VLLM_FUSED_MOE_CHUNK_SIZE", str(chunk))
    p = make_problem(M, k, E, I, K, device="cuda", seed=7)
    run(new_kernel(), p, E)  # compile outside the measurement
    torch.cuda.empty_cache()
    with peak_memory() as peak:
        run(new_kernel(), p, E)
    expected = layer_declared_bytes(chunk, I, K, k, E) - 2 * chunk * K + 2 * M * K
    assert expected <= peak.bytes <= 1.05 * expected, (peak.bytes, expected)
    assert peak.bytes < 0.5 * layer_declared_bytes(M, I, K, k, E)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 130])
def test_gpu_no_ep_prepare_matches_public_quant(M):
    """NoEP's prepare launches the quant kernel without the public op's checks: the same bits
    and layout as per_token_group_quant_fp8 (fresh random input, outputs compared in full)."""
    x = torch.randn(M, 7168, device="cuda").to(torch.bfloat16) * 3
    ids = torch.zeros(M, 8, dtype=torch.int32, device="cuda")
    prep = NoEPPrepareAndFinalize().prepare(x, torch.rand(M, 8, device="cuda"), ids, 8, None,
                                            False)
    q, s = per_token_group_quant_fp8(x, SCALE_BLOCK)
    assert prep.a1q.dtype == q.dtype and prep.a1q.shape == q.shape and prep.a1q.is_contiguous()
    assert prep.a1q_scale.shape == s.shape and prep.a1q_scale.stride() == s.stride()
    assert torch.equal(prep.a1q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(prep.a1q_scale, s)
