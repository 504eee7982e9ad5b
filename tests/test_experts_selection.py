"""experts_for_format (fused_moe/experts_selection.py): VLLM_USE_DEEP_GEMM picks the DeepGEMM
class of the format's pair, a missing DeepGEMM names the variable, sizes no backend runs warn once
per shape, bad formats and sizes raise."""

import logging

import pytest
from _layer import fake_deep_gemm

from vllm_moe_fixes import fused_moe
from vllm_moe_fixes._compat import deep_gemm as compat
from vllm_moe_fixes.fused_moe import experts_selection as selection_mod
from vllm_moe_fixes.fused_moe import (
    ActivationFormat,
    BatchedDeepGemmExperts,
    BatchedTritonExperts,
    DeepGemmExperts,
    TritonExperts,
    experts_for_format,
)

LAYOUTS = [(ActivationFormat.STANDARD, TritonExperts, DeepGemmExperts),
           (ActivationFormat.BATCHED, BatchedTritonExperts, BatchedDeepGemmExperts)]


@pytest.mark.parametrize("fmt, triton_cls, deep_gemm_cls", LAYOUTS)
def test_select(fmt, triton_cls, deep_gemm_cls, monkeypatch, caplog):
    def select(*sizes):
        return experts_for_format(fmt, *sizes)

    monkeypatch.delenv("VLLM_USE_DEEP_GEMM", raising=False)
    assert type(select(128, 256)) is triton_cls
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1")
    monkeypatch.setattr(compat, "_API", None)
    with pytest.raises(ImportError, match="VLLM_USE_DEEP_GEMM") as err:
        select(128, 256)
    assert "DeepGEMM" in str(err.value)
    fake_deep_gemm(monkeypatch)
    assert type(select(128, 256)) is deep_gemm_cls
    monkeypatch.setattr(selection_mod, "_warned_shapes", set())
    with caplog.at_level(logging.WARNING, logger=selection_mod.__name__):
        assert type(select(96, 256)) is triton_cls
        assert type(select(96, 256)) is triton_cls
        assert type(select(128, 200)) is triton_cls
    warnings = [r for r in caplog.records if "multiples of 128" in r.getMessage()]
    assert len(warnings) == 2  # once per shape
    assert all("no backend" in r.getMessage() for r in warnings)
    assert fused_moe.experts_for_format is selection_mod.experts_for_format
    for bad_args, match in [(("a", "b"), "intermediate_size='a' must be a positive int"),
                            ((0, 128), "intermediate_size=0 must be a positive int"),
                            ((128, True), "hidden_size=True must be a positive int")]:
        with pytest.raises(ValueError, match=match):
            select(*bad_args)


@pytest.mark.parametrize("fmt", ["standard", None, 0])
def test_a_format_that_is_not_an_activation_format_is_refused(fmt):
    with pytest.raises(ValueError, match="activation_format must be an ActivationFormat, got "):
        experts_for_format(fmt, 128, 256)
