"""The support code of the vLLM plugin's GPU checks (tests/vllm_support), on CPU: the stand-ins for
vLLM's compiled ops compute what this library's references compute, and the harness registration
puts our classes in registries of vLLM 0.33's harness's shape and swaps our prepare/finalize into
its kernel factory. (The GPU runs themselves are not covered here.)"""

import os
import subprocess
import sys
import types

import pytest
from _vllm_support import SUPPORT, import_support

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
h = torch.randn(37, 512, generator=g).bfloat16()
out = torch.empty(37, 256, dtype=torch.bfloat16)
torch.ops._C.silu_and_mul(out, h)
want = (torch.nn.functional.silu(h[:, :256].float()) * h[:, 256:].float()).bfloat16()
assert torch.equal(out, want)
q2, s2 = torch.empty(37, 256, dtype=torch.float8_e4m3fn), torch.empty(37, 2)
torch.ops._C.silu_and_mul_per_block_quant(q2, h, s2, 128, None, False)
want_q, want_s = per_token_group_quant_fp8(
    torch.nn.functional.silu(h[:, :256].float()) * h[:, 256:].float(), 128)
assert torch.equal(q2.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s2, want_s)
# moe_align_block_size: 13 tokens x top-3 over 8 experts (expert 5 unused), blocks of 4
topk_ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(13)]).int()
topk_ids[topk_ids == 5] = 6
topk_ids[0] = torch.tensor([6, 1, 0])
for expert_map in (None, torch.tensor([0, -1, 1, -1, 2, -1, 3, -1], dtype=torch.int32)):
    sorted_ids = torch.full((200,), -7, dtype=torch.int32)
    expert_ids = torch.full((50,), -7, dtype=torch.int32)
    post_pad, scatter = torch.empty(1, dtype=torch.int32), torch.empty(39, 1, dtype=torch.int32)
    torch.ops._moe_C.moe_align_block_size(topk_ids, 8, 4, sorted_ids, expert_ids, post_pad,
                                          expert_map, scatter)
    flat = topk_ids.flatten().long()
    keep = torch.ones(39, dtype=torch.bool) if expert_map is None else expert_map[flat] >= 0
    total, seen = 0, []
    for e in range(8):
        n = int((flat[keep] == e).sum())
        if n == 0:
            continue
        padded = -(-n // 4) * 4
        block = sorted_ids[total:total + padded]
        assert torch.equal(block[:n].long(), torch.nonzero((flat == e) & keep).flatten())
        assert bool((block[n:] == 39).all())
        name = e if expert_map is None else int(expert_map[e])
        assert bool((expert_ids[total // 4:(total + padded) // 4] == name).all())
        seen += block[:n].tolist()
        total += padded
    assert int(post_pad) == total and sorted(seen) == torch.nonzero(keep).flatten().tolist()
    assert bool((expert_ids[total // 4:] == -1).all()) and bool((sorted_ids[total:] == 39).all())
    assert torch.equal(scatter.flatten().long(), torch.where(keep, torch.arange(39), -1))
x = torch.randn(13, 3, 64, generator=g)
summed = torch.empty(13, 64)
torch.ops._moe_C.moe_sum(x, summed, None, None)
assert torch.allclose(summed, x.sum(1))
em = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1], dtype=torch.int32)
torch.ops._moe_C.moe_sum(x, summed, topk_ids, em)
assert torch.allclose(summed, (x * (em[topk_ids.long()] >= 0).unsqueeze(-1)).sum(1))
print("ok")
"""


# The stand-in for vLLM's compiled _C.persistent_masked_m_silu_mul_quant (the op between the two
# masked GEMMs of vLLM's BatchedDeepGemmExperts, which bench_decode's anchor runs), called as
# vLLM 0.33's batched_deep_gemm_moe calls it: the op's recipe on each expert's valid rows, the
# other rows left alone.
MASKED_SILU_CHECK = r"""
import runpy, sys, torch
runpy.run_path(sys.argv[1] + "/stand_ins/_C_stable_libtorch.py")
E, T, H, G = 3, 8, 384, 3  # H / 128 = G groups; expert 1 receives nothing, expert 2 all T rows
g = torch.Generator().manual_seed(0)
y = (torch.randn(E, T, 2 * H, generator=g) * 4).bfloat16()
y[0, 1, 5:9] = 0  # a few zeros in a group
y[0, 2, H:H + 128] = 0  # a whole group of zero products
counts = torch.tensor([5, 0, T], dtype=torch.int32)


def recipe(rows, ue8m0):
    # silu rounded to bf16, the product rounded to bf16, 1x128 groups, amax / 448 (eps 1e-10)
    gate, up = rows[:, :H], rows[:, H:]
    a = (torch.nn.functional.silu(gate) * up).float().view(-1, G, 128)
    s = a.abs().amax(-1).clamp(min=1e-10) / 448.0
    if ue8m0:  # floored at 1e-10 first, as our per_token_group_quant_fp8 (vLLM's quant recipe)
        s = torch.exp2(torch.ceil(torch.log2(s.clamp(min=1e-10))))
    q = (a / s.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(-1, H), s


for ue8m0 in (False, True):
    y_q = torch.full((E, T, H), 7.0).to(torch.float8_e4m3fn)  # poison: 7.0 where not written
    # MN-major scales, strides (T*G, 1, T), as vLLM's scales_shape_stride_dtype allocates them
    y_s = torch.empty_strided((E, T, G), (T * G, 1, T), dtype=torch.float32).fill_(-3.0)
    torch.ops._C.persistent_masked_m_silu_mul_quant(y, counts, y_q, y_s, ue8m0)
    for e in range(E):
        n = int(counts[e])
        want_q, want_s = recipe(y[e, :n], ue8m0)
        assert torch.equal(y_q[e, :n].view(torch.uint8), want_q.view(torch.uint8)), (e, ue8m0)
        assert torch.equal(y_s[e, :n], want_s), (e, ue8m0)
        assert bool((y_q[e, n:].float() == 7.0).all()) and bool((y_s[e, n:] == -3.0).all())
    assert y_s.stride() == (T * G, 1, T)
print("ok")
"""


def _run_in_fresh_interpreter(check: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", check, SUPPORT], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_stand_ins_for_vllms_compiled_ops_match_our_references():
    _run_in_fresh_interpreter(STAND_IN_CHECK)


def test_masked_silu_mul_quant_stand_in_writes_the_recipe_on_valid_rows_only():
    _run_in_fresh_interpreter(MASKED_SILU_CHECK)


def test_harness_registration_adds_our_classes_and_swaps_in_our_prepare_finalize():
    """Against registries and a kernel factory of vLLM 0.33's harness's shape."""
    pytest.importorskip("vllm")
    mk_registration = import_support("mk_registration")
    from vllm_moe_fixes.integrations.vllm import (
        VllmBatchedTritonExperts,
        VllmNoEPPrepareAndFinalize,
        VllmTritonExperts,
    )
    experts, pfs = [], []
    harness = types.SimpleNamespace(standard_format="standard", batched_format="batched")

    def register_experts(kind, activation_format, supported_dtypes,
                         blocked_quantization_support, needs_matching_quant=False,
                         needs_deep_gemm=False, needs_aiter=False):
        experts.append((kind, activation_format, needs_deep_gemm))

    def register_prepare_and_finalize(kind, activation_format, supported_dtypes,
                                      blocked_quantization_support, backend,
                                      force_multigpu=False, supports_apply_weight_on_input=True):
        pfs.append((kind, activation_format, backend))

    harness.register_experts = register_experts
    harness.register_prepare_and_finalize = register_prepare_and_finalize
    mk_registration.register(harness)
    mk_registration.register(harness)  # once only
    assert (VllmTritonExperts, "standard", False) in experts
    assert (VllmBatchedTritonExperts, "batched", False) in experts
    assert len(experts) in (2, 4)  # the DeepGEMM pair only where DeepGEMM runs
    assert pfs == [(VllmNoEPPrepareAndFinalize, "standard", None)]

    class Kernel:  # vLLM's FusedMoEKernel: built from both parts, by keyword
        def __init__(self, prepare_finalize, fused_experts):
            self.prepare_finalize, self.fused_experts = prepare_finalize, fused_experts

    class Config:
        def __init__(self, pf_type):
            self.prepare_finalize_type = pf_type

        def is_valid(self):
            return True, None

    vllms_pf = object()
    common = types.SimpleNamespace(
        Config=Config,
        make_modular_kernel=lambda config, vllm_config, quant: Kernel(vllms_pf, "experts"))
    mk_registration.patch_common(common)
    mk_registration.patch_common(common)  # once only
    ours = common.make_modular_kernel(Config(VllmNoEPPrepareAndFinalize), None, None)
    theirs = common.make_modular_kernel(Config(object), None, None)
    assert isinstance(ours.prepare_finalize, VllmNoEPPrepareAndFinalize)
    assert ours.fused_experts == "experts" == theirs.fused_experts
    assert theirs.prepare_finalize is vllms_pf


def test_harness_case_filter_keeps_only_block_fp8_cases_for_our_classes():
    mk_registration = import_support("mk_registration")

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

    mk_registration.only_block_fp8(Config)
    assert Config(Ours, quant([128, 128])).is_valid() == (True, None)
    for q in (None, quant(None), quant(None, per_token=True), quant([64, 128])):
        assert Config(Ours, q).is_valid()[0] is False
        assert Config(Theirs, q).is_valid() == (True, None)
