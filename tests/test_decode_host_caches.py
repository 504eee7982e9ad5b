"""What the eager decode path keeps from one call to the next instead of deciding it again, and
that each kept decision is still taken again where it may change: DeepGEMM's masked GEMM checks
its API and the device's architecture once per device and resolved API (a refusal is raised at
every call, never kept)."""

import types

import pytest
import torch

from vllm_moe_fixes._compat import deep_gemm as compat


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
