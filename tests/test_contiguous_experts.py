"""TritonExperts and DeepGemmExperts (fused_moe/contiguous_experts.py) through the kernel: poisoned
workspaces, a fake DeepGEMM through the compatibility module, every Triton launcher of the path
under the interpreter; GPU: the real DeepGEMM."""

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
from vllm_moe_fixes.fused_moe.contiguous_experts import (
    DeepGemmExperts,
    TritonExperts,
    select_experts,
)
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.fused_moe.no_ep_prepare_finalize import NoEPPrepareAndFinalize
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


@pytest.mark.gpu
@pytest.mark.deep_gemm
@pytest.mark.parametrize("E,k,M,I,K,use_map", [(8, 8, 512, 2048, 7168, False),
                                               (32, 6, 130, 256, 1024, True)])
def test_gpu_deep_gemm_experts(E, k, M, I, K, use_map, monkeypatch):
    """The real DeepGEMM (needs an SM90/SM100 build): selection, poisoned workspaces, reference."""
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1")
    experts = select_experts(I, K)
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
