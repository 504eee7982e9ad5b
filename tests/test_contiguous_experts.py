"""TritonExperts and DeepGemmExperts (fused_moe/contiguous_experts.py) through the kernel: poisoned
workspaces, a fake DeepGEMM through the compatibility module, every Triton launcher of the path
under the interpreter; GPU: the real DeepGEMM."""

import types

import pytest
import torch
from _layer import (
    RecordingNoEP,
    check_close,
    fake_deep_gemm,
    force_triton_launchers,
    make_problem,
    new_kernel,
    reference,
    run,
)

from vllm_moe_fixes._compat import deep_gemm as compat
from vllm_moe_fixes.fused_moe import ActivationFormat, experts_for_format
from vllm_moe_fixes.fused_moe.contiguous_experts import DeepGemmExperts, TritonExperts
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.fused_moe.no_ep_prepare_finalize import NoEPPrepareAndFinalize
from vllm_moe_fixes.ops.grouped_gemm import grouped_fp8_gemm_contiguous_ref
from vllm_moe_fixes.sizes import ROW_ALIGNMENT
from vllm_moe_fixes.testing import calc_diff


@pytest.mark.parametrize("experts_cls", ["triton", "deep_gemm_fake"])
def test_nonlocal_slots_exact_zero_with_poisoned_workspaces(experts_cls, monkeypatch):
    """NaN-filled workspaces: tokens with no local expert come out exactly 0, the others match
    the reference; a zero weight is not what hides the garbage."""
    if experts_cls == "deep_gemm_fake":
        fake_deep_gemm(monkeypatch, skip_minus_one_rows=True)
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


@pytest.mark.parametrize("old_names", [False, True])
def test_deep_gemm_experts_through_compat(monkeypatch, old_names):
    calls = fake_deep_gemm(monkeypatch, old_names=old_names)
    p = make_problem(20, 2, 8, 128, 256, local=[0, 3, 6], seed=5)
    out = run(new_kernel(DeepGemmExperts()), p, 8)
    triton_out = run(new_kernel(TritonExperts()), p, 8)
    assert torch.equal(out, triton_out)  # same path on CPU, only the GEMM call differs
    assert len(calls) == 2 and calls[0][0] is (None if old_names else True)
    assert calls[0][1].dtype == torch.int32


def test_deep_gemm_experts_refuse_another_alignment(monkeypatch):
    fake_deep_gemm(monkeypatch)
    monkeypatch.setattr(compat._API, "alignment", lambda: 64)
    with pytest.raises(RuntimeError, match="aligns expert segments to 64 rows"):
        DeepGemmExperts()


def test_triton_path_under_interpreter(monkeypatch, kernel_device):
    """TritonExperts with every Triton launcher of the contiguous path (layout, permute, grouped
    GEMM, SiLU-quant, un-permute + reduce; interpreted on CPU) on a tiny layer with non-local
    experts."""
    p = make_problem(5, 2, 4, 128, 128, local=[0, 2, 3], device=kernel_device, seed=9)
    want = run(new_kernel(), p, 4)
    force_triton_launchers(monkeypatch)
    got = run(new_kernel(), p, 4)
    assert calc_diff(got, want) < 1e-3  # bf16 ties flip a few FP8 requantisations
    check_close(got, reference(p))


def _fake_psum_deep_gemm(monkeypatch):
    """A fake DeepGEMM whose contiguous GEMM also takes use_psum_layout, as v2.6.1's does: in
    that form it computes the rows [align128(ends[e-1]), ends[e]) of each expert and writes no
    other row (DeepGEMM skips the blocks past an expert's rows). Returns its call log."""
    calls = []

    def contiguous(a, b, d, layout, disable_ue8m0_cast=False, use_psum_layout=False):
        calls.append((use_psum_layout, layout.clone()))
        m_indices = layout
        if use_psum_layout:
            m_indices = torch.full((d.shape[0],), -1, dtype=torch.int32)
            start = 0
            for e, end in enumerate(layout.tolist()):
                m_indices[start:end] = e
                start = -(-end // ROW_ALIGNMENT) * ROW_ALIGNMENT
        rows = m_indices >= 0
        part = torch.empty(int(rows.sum()), d.shape[1], dtype=d.dtype)
        grouped_fp8_gemm_contiguous_ref((a[0][rows], a[1][rows]), b, part, m_indices[rows])
        d[rows] = part

    mod = types.SimpleNamespace(get_m_alignment_for_contiguous_layout=lambda: ROW_ALIGNMENT,
                                m_grouped_fp8_gemm_nt_contiguous=contiguous)
    monkeypatch.setattr(compat, "_API", compat.resolve(mod))
    return calls


def test_deep_gemm_experts_hand_deep_gemm_the_psum_layout(monkeypatch):
    """Where DeepGEMM takes use_psum_layout, both GEMMs get expert_ends (the layout's segment
    ends, [E_l] int32) instead of m_indices; with NaN workspaces (rows the GEMMs leave unwritten
    stay NaN) the output equals the m_indices path's, bit for bit, and non-local tokens are 0."""
    calls = _fake_psum_deep_gemm(monkeypatch)
    E, k, M = 8, 3, 45
    p = make_problem(M, k, E, 128, 256, local=[0, 3, 5, 6], seed=21)
    p["topk_ids"][0] = torch.tensor([1, 2, 4])  # token 0: no local expert
    kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(), DeepGemmExperts())
    ws13, ws2, _ = DeepGemmExperts().workspace_shapes(M, 128, 256, k, 4)
    kernel.workspaces.get(ws13, ws2, torch.device("cpu"), torch.bfloat16)
    kernel.workspaces.ws13.fill_(float("nan"))
    kernel.workspaces.ws2.fill_(float("nan"))
    out = run(kernel, p, E)
    assert [c[0] for c in calls] == [True, True]
    ends = calls[0][1]
    assert ends.dtype == torch.int32 and ends.shape == (4,)
    local = p["expert_map"][p["topk_ids"]].flatten()
    counts = torch.bincount(local[local >= 0].long(), minlength=4)
    padded = -(-counts // ROW_ALIGNMENT) * ROW_ALIGNMENT
    assert torch.equal(ends.long(), torch.cumsum(padded, 0) - padded + counts)
    assert out[0].eq(0).all()
    fake_deep_gemm(monkeypatch)  # the m_indices form only
    assert torch.equal(out, run(new_kernel(DeepGemmExperts()), p, E))


@pytest.mark.parametrize("experts_pass_tokens", [None, 7])
@pytest.mark.parametrize("launchers", ["reference", "triton"])
def test_deferred_input_quant_same_bits(experts_pass_tokens, launchers, monkeypatch):
    """NoEP with defer_input_quant hands the experts bf16 a1 (no scales) and the experts quantise
    it into the permuted rows: the layer's output is bit for bit that of the quantising prepare,
    in one pass and in passes (VLLM_FUSED_MOE_CHUNK_SIZE below M), with every step's torch
    reference and with every Triton launcher (interpreted)."""
    if experts_pass_tokens is not None:
        monkeypatch.setenv("VLLM_FUSED_MOE_CHUNK_SIZE", str(experts_pass_tokens))
    if launchers == "triton":
        if torch.cuda.is_available():
            pytest.skip("interpreter only (CPU tensors); on a GPU the test below runs the kernels")
        force_triton_launchers(monkeypatch)
    p = make_problem(19, 3, 6, 128, 384, local=[0, 2, 3, 5], seed=4)
    p["hidden_states"][2, 7] = float("nan")  # the quant's NaN rule, in both places
    pf = RecordingNoEP()
    deferred = NoEPPrepareAndFinalize(defer_input_quant=True)
    seen = {}
    original = TritonExperts.apply

    def recording_apply(self, output, a1q, a1q_scale, weights, **kw):
        seen["a1q"], seen["scale"] = a1q.dtype, a1q_scale
        original(self, output, a1q, a1q_scale, weights, **kw)
    out_quantised = run(FusedMoEModularKernel(pf, TritonExperts()), p, 6)
    monkeypatch.setattr(TritonExperts, "apply", recording_apply)
    out_deferred = run(FusedMoEModularKernel(deferred, TritonExperts()), p, 6)
    assert seen == {"a1q": torch.bfloat16, "scale": None}
    assert torch.equal(out_deferred, out_quantised) and torch.isfinite(out_deferred).all()


@pytest.mark.gpu
@pytest.mark.deep_gemm
@pytest.mark.parametrize("E,k,M,I,K,use_map", [(8, 8, 512, 2048, 7168, False),
                                               (32, 6, 130, 256, 1024, True)])
def test_gpu_deep_gemm_experts(E, k, M, I, K, use_map, monkeypatch):
    """The real DeepGEMM (needs an SM90/SM100 build): selection, poisoned workspaces, reference."""
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1")
    experts = experts_for_format(ActivationFormat.STANDARD, I, K)
    assert type(experts) is DeepGemmExperts
    local = list(range(0, E, 2)) if use_map else None
    p = make_problem(M, k, E, I, K, local=local, device="cuda", seed=M)
    if use_map:  # token 0: only non-local experts (odd ids)
        p["topk_ids"][0] = torch.arange(1, 2 * k, 2, device="cuda")
    kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(), experts)
    ws13, ws2, _ = experts.workspace_shapes(M, I, K, k, E if local is None else len(local))
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
@pytest.mark.deep_gemm
@pytest.mark.parametrize("M", [3, 1024])
def test_gpu_deep_gemm_psum_layout_and_deferred_quant(M, monkeypatch):
    """The real DeepGEMM at DeepSeek's shapes (K 7168, I 2048, top-8 of 8): the deferred quant
    gives the quantising prepare's bits; the psum layout (what DeepGemmExperts hands v2.6.1) and
    the m_indices layout agree on every token."""
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1")
    p = make_problem(M, 8, 8, 2048, 7168, device="cuda", seed=M)
    deferred = run(FusedMoEModularKernel(NoEPPrepareAndFinalize(defer_input_quant=True),
                                         DeepGemmExperts()), p, 8)
    quantised = run(FusedMoEModularKernel(NoEPPrepareAndFinalize(), DeepGemmExperts()), p, 8)
    assert torch.equal(deferred, quantised)
    assert compat._takes_psum_layout(compat._API.contiguous)  # v2.6.1 takes it
    monkeypatch.setattr(compat, "_takes_psum_layout", lambda fn: False)
    m_indices_form = run(FusedMoEModularKernel(NoEPPrepareAndFinalize(), DeepGemmExperts()), p, 8)
    assert calc_diff(quantised, m_indices_form) < 1e-6
    check_close(quantised, reference(p))
