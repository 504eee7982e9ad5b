"""select_experts / select_batched_experts (fused_moe/experts_selection.py): VLLM_USE_DEEP_GEMM
picks the DeepGEMM class of the layout's pair, a missing DeepGEMM names the variable, sizes no
backend runs warn once per shape, bad sizes raise."""

import logging

import pytest
from _layer import fake_deep_gemm

from vllm_moe_fixes import fused_moe
from vllm_moe_fixes._compat import deep_gemm as compat
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
)

LAYOUTS = [(select_experts, TritonExperts, DeepGemmExperts),
           (select_batched_experts, BatchedTritonExperts, BatchedDeepGemmExperts)]


@pytest.mark.parametrize("select, triton_cls, deep_gemm_cls", LAYOUTS)
def test_select(select, triton_cls, deep_gemm_cls, monkeypatch, caplog):
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
    assert getattr(fused_moe, select.__name__) is select
    for bad_args in [("a", "b"), (0, 128), (128, True)]:
        with pytest.raises(ValueError, match="intermediate_size|hidden_size"):
            select(*bad_args)
