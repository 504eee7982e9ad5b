"""The DeepGEMM compatibility module (_compat/deep_gemm.py): the API names of old and new releases,
the errors without DeepGEMM, and the architecture check (float32 scales run on SM90 only; SM100
(UE8M0 scales) and other GPUs are refused once per device, at the experts' construction and in
the GEMM wrappers)."""

import types

import pytest
import torch

from vllm_moe_fixes._compat import deep_gemm as compat
from vllm_moe_fixes.fused_moe import BatchedDeepGemmExperts, DeepGemmExperts


@pytest.fixture
def fake_gpu(monkeypatch):
    """A fake DeepGEMM on a fake CUDA device whose capability the test sets; returns a dict of
    the capability and the number of capability queries."""
    state = {"capability": (9, 0), "queries": 0, "gemm_calls": 0}

    def capability(index):
        state["queries"] += 1
        return state["capability"]

    def gemm(*args, disable_ue8m0_cast=False):
        state["gemm_calls"] += 1

    mod = types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=gemm,
                                m_grouped_fp8_gemm_nt_masked=gemm,
                                get_mk_alignment_for_contiguous_layout=lambda: 128)
    monkeypatch.setattr(compat, "_API", compat.resolve(mod))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Fake GPU")
    compat._arch_refusal.cache_clear()
    yield state
    compat._arch_refusal.cache_clear()


def _cuda_operand(index=0):
    return (types.SimpleNamespace(device=torch.device("cuda", index)), None)


@pytest.mark.parametrize("cls", [DeepGemmExperts, BatchedDeepGemmExperts])
def test_sm100_refused_at_construction(fake_gpu, cls):
    fake_gpu["capability"] = (10, 0)
    with pytest.raises(RuntimeError, match=rf"{cls.__name__} cannot run on CUDA device 0: on "
                                           r"sm_100 \(Fake GPU\) DeepGEMM wants UE8M0-packed "
                                           r"scales.*VLLM_USE_DEEP_GEMM=0"):
        cls()


def test_other_archs_refused_sm90_accepted(fake_gpu):
    fake_gpu["capability"] = (8, 0)
    with pytest.raises(RuntimeError,
                       match=r"SM90 \(float32 scales\) only, not on sm_80.*VLLM_USE_DEEP_GEMM"):
        DeepGemmExperts()
    compat._arch_refusal.cache_clear()
    fake_gpu["capability"] = (9, 0)
    DeepGemmExperts()
    BatchedDeepGemmExperts()


def test_gemm_wrappers_check_the_operands_device_once(fake_gpu):
    compat.m_grouped_fp8_gemm_nt_contiguous(_cuda_operand(), None, None, None)
    compat.m_grouped_fp8_gemm_nt_masked(_cuda_operand(), None, None, None, 1)
    compat.m_grouped_fp8_gemm_nt_contiguous(_cuda_operand(), None, None, None)
    assert fake_gpu["gemm_calls"] == 3 and fake_gpu["queries"] == 1  # cached per device
    fake_gpu["capability"] = (10, 0)
    with pytest.raises(RuntimeError,
                       match="BatchedDeepGemmExperts cannot run on CUDA device 1: on sm_100"):
        compat.m_grouped_fp8_gemm_nt_masked(_cuda_operand(1), None, None, None, 1)
    assert fake_gpu["gemm_calls"] == 3 and fake_gpu["queries"] == 2


def test_cpu_operands_and_no_cuda_are_not_checked(fake_gpu, monkeypatch):
    fake_gpu["capability"] = (10, 0)
    cpu = (types.SimpleNamespace(device=torch.device("cpu")), None)
    compat.m_grouped_fp8_gemm_nt_contiguous(cpu, None, None, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    DeepGemmExperts()
    assert fake_gpu["queries"] == 0


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


def test_compat_without_deep_gemm(monkeypatch):
    monkeypatch.setattr(compat, "_API", None)
    assert not compat.is_available()
    for call in (compat.require, DeepGemmExperts,
                 lambda: compat.m_grouped_fp8_gemm_nt_contiguous(None, None, None, None)):
        with pytest.raises(ImportError,  # MissingLibraryError, as for a missing DeepEP
                           match="VLLM_USE_DEEP_GEMM.*DeepGEMM|DeepGEMM.*VLLM_USE_DEEP_GEMM"):
            call()


def test_pdl_set_for_the_block_and_restored(monkeypatch):
    """pdl_set_to sets DeepGEMM's process-wide PDL inside the block and restores the process's
    setting after (also on an exception); None or the same value changes nothing."""
    state = {"pdl": True, "sets": []}

    def set_pdl(value):
        state["sets"].append(value)
        state["pdl"] = value
    mod = types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=lambda *a, **k: None,
                                get_pdl=lambda: state["pdl"], set_pdl=set_pdl)
    monkeypatch.setattr(compat, "_API", compat.resolve(mod))
    with compat.pdl_set_to(False):
        assert compat.get_pdl() is False
    assert state["pdl"] is True and state["sets"] == [False, True]
    with pytest.raises(KeyError, match="inside"), compat.pdl_set_to(False):
        raise KeyError("inside")
    assert state["pdl"] is True
    state["sets"].clear()
    for value in (None, True):
        with compat.pdl_set_to(value):
            pass
    assert state["sets"] == []


def test_expected_m_reaches_the_psum_call(monkeypatch):
    """expected_m goes to DeepGEMM as expected_m_for_psum_layout in the psum form only, and only
    where the build takes it."""
    seen = []

    def new(a, b, d, layout, use_psum_layout=False, expected_m_for_psum_layout=None):
        seen.append((use_psum_layout, expected_m_for_psum_layout))

    def older(a, b, d, layout, use_psum_layout=False):
        seen.append((use_psum_layout, None))
    ends = torch.tensor([3], dtype=torch.int32)
    monkeypatch.setattr(compat, "check_device", lambda what, device: None)
    for fn, want in ((new, 37), (older, None)):
        compat._takes_psum_layout.cache_clear()
        monkeypatch.setattr(compat, "_API", compat.resolve(
            types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=fn)))
        compat.m_grouped_fp8_gemm_nt_contiguous(_cuda_operand(), None, None, None, ends,
                                                expected_m=37)
        compat.m_grouped_fp8_gemm_nt_contiguous(_cuda_operand(), None, None, ends[:0].view(-1),
                                                None, expected_m=37)
        assert seen == [(True, want), (False, None)]
        seen.clear()
