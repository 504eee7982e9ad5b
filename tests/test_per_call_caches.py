"""What the eager decode path keeps from one call to the next instead of deciding it again, and
that each kept decision is still taken again where it may change: DeepGEMM's masked GEMM checks
its API and the device's architecture once per device and resolved API (a refusal is raised at
every call, never kept); the modular kernel builds the experts' output view once per workspace
and shape (a new shape or a grown workspace gets its own; one that does not fit is refused at
every call), and plans a chunk (workspace shapes, views, expected_m) once per chunk shape while
its Workspaces keeps its views (a shared one grown by another layer, or another Workspaces
object, makes it plan again)."""

import types
import weakref

import pytest
import torch
from _layer import check_close, make_problem, reference, run
from test_batched_experts import LocalBatchedPrepareAndFinalize

from vllm_moe_fixes._compat import deep_gemm as compat
from vllm_moe_fixes.fused_moe import BatchedTritonExperts, FusedMoEModularKernel
from vllm_moe_fixes.fused_moe.modular_kernel import _experts_output_view
from vllm_moe_fixes.fused_moe.workspaces import Workspaces, views_cached_on


@pytest.fixture
def fake_masked(monkeypatch):
    """A fake DeepGEMM whose masked GEMM records its calls; check_device counted (and refusing
    on the devices listed in state["refuse"])."""
    state = {"calls": [], "checks": [], "refuse": set()}

    def masked(a, b, d, masked_m, expected_m, *, disable_ue8m0_cast=False):
        state["calls"].append((expected_m, disable_ue8m0_cast))

    def check_device(what, device):
        state["checks"].append(device)
        if device in state["refuse"]:
            raise RuntimeError(f"{what} cannot run on CUDA device {device.index}: refused")

    api = types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=masked,
                                m_grouped_fp8_gemm_nt_masked=masked)
    monkeypatch.setattr(compat, "_API", compat.resolve(api))
    monkeypatch.setattr(compat, "check_device", check_device)
    monkeypatch.setattr(compat, "_MASKED_READY", {})
    return state


def _operand(index):
    return (types.SimpleNamespace(device=torch.device("cuda", index)), None)


def test_masked_gemm_checks_once_per_device_and_api(fake_masked):
    for expected_m in (1, 2, 3):
        compat.m_grouped_fp8_gemm_nt_masked(_operand(0), None, None, None, expected_m)
    assert fake_masked["checks"] == [torch.device("cuda", 0)]
    assert fake_masked["calls"] == [(1, True), (2, True), (3, True)]
    compat.m_grouped_fp8_gemm_nt_masked(_operand(1), None, None, None, 4)
    assert fake_masked["checks"] == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_masked_gemm_checks_again_for_another_api(fake_masked, monkeypatch):
    compat.m_grouped_fp8_gemm_nt_masked(_operand(0), None, None, None, 1)
    seen = []
    old_style = types.SimpleNamespace(  # a release whose masked GEMM takes no ue8m0 keyword
        m_grouped_fp8_gemm_nt_contiguous=lambda *a: None,
        m_grouped_gemm_fp8_fp8_bf16_nt_masked=lambda a, b, d, m, expected_m: seen.append(
            expected_m))
    monkeypatch.setattr(compat, "_API", compat.resolve(old_style))
    compat.m_grouped_fp8_gemm_nt_masked(_operand(0), None, None, None, 5)
    assert seen == [5] and len(fake_masked["checks"]) == 2
    monkeypatch.setattr(compat, "_API", compat.resolve(types.SimpleNamespace(
        m_grouped_fp8_gemm_nt_contiguous=lambda *a: None)))  # no masked GEMM at all
    with pytest.raises(RuntimeError, match="no masked grouped FP8 GEMM"):
        compat.m_grouped_fp8_gemm_nt_masked(_operand(0), None, None, None, 1)
    monkeypatch.setattr(compat, "_API", None)
    with pytest.raises(ImportError, match="VLLM_USE_DEEP_GEMM"):
        compat.m_grouped_fp8_gemm_nt_masked(_operand(0), None, None, None, 1)


def test_masked_gemm_refusal_is_raised_at_every_call(fake_masked):
    fake_masked["refuse"].add(torch.device("cuda", 2))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="cannot run on CUDA device 2"):
            compat.m_grouped_fp8_gemm_nt_masked(_operand(2), None, None, None, 1)
    assert fake_masked["calls"] == [] and len(fake_masked["checks"]) == 2


def test_experts_output_view_once_per_workspace_and_shape():
    spaces = Workspaces()
    ws13, ws2 = spaces.get((4, 8), (2, 8), torch.device("cpu"), torch.bfloat16)
    first = views_cached_on(ws13, ws2, _experts_output_view, (2, 8), "X")
    assert views_cached_on(ws13, ws2, _experts_output_view, (2, 8), "X") is first
    other = views_cached_on(ws13, ws2, _experts_output_view, (3, 8), "X")
    assert other is not first and other.shape == (3, 8)
    assert other.data_ptr() == first.data_ptr() == ws13.data_ptr()
    for _ in range(2):  # a refusal is never kept
        with pytest.raises(ValueError, match=r"X.workspace_shapes: out_shape \(5, 8\) does not "
                                             r"fit in workspace13 \(4, 8\)"):
            views_cached_on(ws13, ws2, _experts_output_view, (5, 8), "X")
    grown13, grown2 = spaces.get((16, 8), (2, 8), torch.device("cpu"), torch.bfloat16)
    assert grown13.data_ptr() != ws13.data_ptr()
    again = views_cached_on(grown13, grown2, _experts_output_view, (2, 8), "X")
    assert again.data_ptr() == grown13.data_ptr()


class _OversizedOutput(BatchedTritonExperts):
    """Declares an output one row longer than its workspace13."""

    def workspace_shapes(self, M, I, K, topk, local_num_experts, *, experts_pass_tokens=None):
        ws13, ws2, out = super().workspace_shapes(M, I, K, topk, local_num_experts)
        return ws13, ws2, (out[0] * out[1] * (ws13[2] // K) + 1, K)


def test_kernel_output_view_follows_the_shape_and_refuses_what_does_not_fit():
    E, k = 8, 2
    kernel = FusedMoEModularKernel(LocalBatchedPrepareAndFinalize(64), BatchedTritonExperts())
    for M in (5, 3, 5):  # the same shape twice, another between: each call's own output
        p = make_problem(M, k, E, 128, 256, seed=M)
        check_close(run(kernel, p, E), reference(p))
    oversized = FusedMoEModularKernel(LocalBatchedPrepareAndFinalize(64), _OversizedOutput())
    for _ in range(2):
        with pytest.raises(ValueError, match="_OversizedOutput.workspace_shapes: out_shape"):
            run(oversized, make_problem(3, k, E, 128, 256), E)


class _CountingExperts(BatchedTritonExperts):
    """Counts workspace_shapes calls (one per chunk plan)."""

    def __init__(self):
        self.plans = 0

    def workspace_shapes(self, M, I, K, topk, local_num_experts, *, experts_pass_tokens=None):
        self.plans += 1
        return super().workspace_shapes(M, I, K, topk, local_num_experts)


def test_chunk_plan_once_per_shape_and_again_when_the_workspaces_change():
    E, k = 8, 2
    shared = Workspaces()
    experts = _CountingExperts()
    kernel = FusedMoEModularKernel(LocalBatchedPrepareAndFinalize(64), experts, shared)
    for M in (5, 3, 5):  # T = 64 * k rows per slice whatever M: one plan
        p = make_problem(M, k, E, 128, 256, seed=M)
        check_close(run(kernel, p, E), reference(p))
    assert experts.plans == 1
    other = FusedMoEModularKernel(LocalBatchedPrepareAndFinalize(256), BatchedTritonExperts(),
                                  shared)  # T = 512 rows: the shared buffers grow
    generation, old13 = shared.generation, weakref.ref(shared.ws13)
    p = make_problem(4, k, E, 128, 256, seed=4)
    check_close(run(other, p, E), reference(p))
    assert shared.generation > generation
    assert old13() is None  # the plans kept nothing of the replaced buffer alive
    check_close(run(kernel, p, E), reference(p))
    assert experts.plans == 2  # planned again on the grown buffers
    p = make_problem(6, k, E, 128, 512, seed=6)  # another K: another plan
    check_close(run(kernel, p, E), reference(p))
    assert experts.plans == 3
    kernel.workspaces = Workspaces()
    check_close(run(kernel, p, E), reference(p))
    assert experts.plans == 4 and kernel.workspaces.ws13 is not None
