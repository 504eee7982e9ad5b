"""The support code of the vLLM plugin's GPU checks (tests/vllm_support), on CPU: the stand-ins for
vLLM's compiled ops compute what this library's references compute, and the harness registration
puts our classes in a registry of vLLM's harness's shape and builds our prepare/finalize. (The GPU
runs themselves are not covered here.)"""

import os
import subprocess
import sys
import types

import pytest

SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_support")

# Runs in a fresh interpreter: the stand-ins define the _C / _moe_C op namespaces, which vLLM's
# own compiled library defines wherever vllm is imported.
STAND_IN_CHECK = r"""
import runpy, sys, torch
runpy.run_path(sys.argv[1] + "/stand_ins/_C_stable_libtorch.py")
runpy.run_path(sys.argv[1] + "/stand_ins/_moe_C_stable_libtorch.py")
from vllm_moe_fixes.fused_moe import fused_topk
from vllm_moe_fixes.ops import FP8_MAX, per_token_group_quant_fp8
g = torch.Generator().manual_seed(0)
x = (torch.randn(37, 512, generator=g) * 3).bfloat16()
q = torch.empty(37, 512, dtype=torch.float8_e4m3fn)
s = torch.empty(4, 37).t()  # column-major scales, as vLLM asks for them
torch.ops._C.per_token_group_fp8_quant(x, q, s, 128, 1e-10, -FP8_MAX, FP8_MAX, False, True, False)
want_q, want_s = per_token_group_quant_fp8(x, 128)
assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
logits = torch.randn(37, 16, generator=g)
w, ids = torch.empty(37, 4), torch.empty(37, 4, dtype=torch.int32)
torch.ops._moe_C.topk_softmax(w, ids, torch.empty(37, 4, dtype=torch.int32), logits, True,
                              None, None)
want_w, want_ids = fused_topk(logits, 4, renormalize=True)
assert torch.equal(ids.long(), want_ids.long()) and torch.allclose(w, want_w, rtol=1e-6)
assert torch.ops._C.cutlass_scaled_mm_supports_block_fp8(90) is False
print("ok")
"""


def test_stand_ins_for_vllms_compiled_ops_match_our_references():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", STAND_IN_CHECK, SUPPORT], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_harness_registration_adds_our_classes_and_builds_our_prepare_finalize():
    pytest.importorskip("vllm")
    sys.path.insert(0, SUPPORT)
    try:
        import mk_registration
    finally:
        sys.path.remove(SUPPORT)
    from vllm_moe_fixes.integrations.vllm import (
        VllmBatchedTritonExperts,
        VllmNoEPPrepareAndFinalize,
        VllmTritonExperts,
    )
    experts, pfs = [], []
    harness = types.ModuleType("fake_mk_objects")
    harness.standard_format, harness.batched_format = "standard", "batched"

    def register_experts(kind, activation_format, supported_dtypes,
                         blocked_quantization_support, supports_chunking, supports_expert_map,
                         needs_matching_quant=False, needs_deep_gemm=False):
        experts.append((kind, activation_format, supports_expert_map, needs_deep_gemm))

    def register_prepare_and_finalize(kind, activation_format, supported_dtypes,
                                      blocked_quantization_support, backend):
        pfs.append((kind, activation_format, backend))

    harness.register_experts = register_experts
    harness.register_prepare_and_finalize = register_prepare_and_finalize
    harness.make_prepare_finalize = lambda kind, backend, moe, quant_config: "vllm's"
    sys.modules[harness.__name__] = harness
    try:
        mk_registration.register(harness)
        mk_registration.register(harness)  # once only
        built = harness.make_prepare_finalize(VllmNoEPPrepareAndFinalize, None, None, None)
        other = harness.make_prepare_finalize(object, None, None, None)
    finally:
        del sys.modules[harness.__name__]
    assert (VllmTritonExperts, "standard", True, False) in experts
    assert (VllmBatchedTritonExperts, "batched", False, False) in experts
    assert len(experts) in (2, 4)  # the DeepGEMM pair only where DeepGEMM runs
    assert pfs == [(VllmNoEPPrepareAndFinalize, "standard", None)]
    assert isinstance(built, VllmNoEPPrepareAndFinalize) and other == "vllm's"


def test_harness_case_filter_keeps_only_block_fp8_cases_for_our_classes():
    sys.path.insert(0, SUPPORT)
    try:
        import mk_registration
    finally:
        sys.path.remove(SUPPORT)

    class Ours:
        __module__ = "vllm_moe_fixes.integrations.vllm.experts"

    class Theirs:
        __module__ = "vllm.model_executor.layers.fused_moe.experts.triton_moe"

    class Config:  # the harness's case: its own verdict, then ours on top
        def __init__(self, experts, quant):
            self.prepare_finalize_type, self.fused_experts_type = Theirs, experts
            self.quant_config = quant

        def is_valid(self):
            return True, None

    def quant(block_shape, per_token=False):
        return types.SimpleNamespace(block_shape=block_shape, per_act_token_quant=per_token,
                                     per_out_ch_quant=False)

    common = types.SimpleNamespace(Config=Config)
    mk_registration.only_block_fp8(common)
    mk_registration.only_block_fp8(common)  # once only
    assert Config(Ours, quant([128, 128])).is_valid() == (True, None)
    for q in (None, quant(None), quant(None, per_token=True), quant([64, 128])):
        assert Config(Ours, q).is_valid()[0] is False
        assert Config(Theirs, q).is_valid() == (True, None)
