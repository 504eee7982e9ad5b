"""Run vLLM 0.33's own block-FP8 fused-MoE test with this library's layer in place of vLLM's
Triton fused experts (a pytest plugin for vLLM's source tree).

``tests/kernels/moe/test_block_fp8.py::test_w8a8_block_fp8_fused_moe`` (160 cases: M x N x K x E x
top-k, 20 of the 180 skipped for top-k > E) checks two calls against its torch reference
(``torch_w8a8_block_fp8_moe``: vLLM's per-token-group quant, per-block float32 products,
SiLU-and-mul in bf16, requantisation) with ``torch.testing.assert_close`` at atol = rtol = 0.035
(0.039 at M >= 8192). This plugin leaves the test, its inputs, its reference and its tolerance
untouched and swaps the two calls' targets in the test module's namespace:

- ``fused_experts(a, w1, w2, topk_weights, topk_ids, quant_config=...)`` -> our
  ``FusedMoEModularKernel(NoEPPrepareAndFinalize(use_ue8m0=...), TritonExperts())``;
- ``modular_triton_fused_moe(moe_config, quant_config)`` -> vLLM's own ``FusedMoEKernel`` around our
  adapters ``VllmNoEPPrepareAndFinalize`` + ``VllmTritonExperts`` (what the plugin installs).

Activation scales: where vLLM's ``is_deep_gemm_e8m0_used()`` holds (VLLM_USE_DEEP_GEMM_E8M0, on by
default, with DeepGEMM on a Hopper GPU) vLLM's quant rounds them up to powers of two, and so does
the test's reference, which calls it. Both our calls follow that decision through the library's
option ``use_ue8m0`` (read by ``integrations.vllm.support.vllm_rounds_scales_to_ue8m0``, as the
adapters read it); ``--ours-exact-scales`` keeps our layer's exact scales instead (the adapters
still follow vLLM).

With ``--ours-diagnose``, each assert_close of the first call also prints one ``DIAG`` line: the
tolerance usage max|out - ref| / (atol + rtol |ref|) (> 1 fails) of our layer, and of the same
layer with its GEMMs replaced by the FP8 GEMM promoting every 32 of K (IMPRECISE_ACC=32; both
GEMMs: acc32, the first only: acc32_gemm1; every 64 of K, the first only: acc64_gemm1), by the
exact block product (float64 per 128-K block, ``grouped_fp8_gemm_contiguous_ref``: exact), each with the layer's scales, and of our layer
with the other scales (exact_scales where it follows vLLM's powers of two, else ue8m0), at
K >= 4096. Each output is also kept as it was when its call returned: a DIAG value computed from
an output that changed since (memory written after the call, by a later call) is marked
``changed after its call`` with the usage it had at return. The test's verdict is unchanged.
``--ours-shard i/n`` keeps every n-th case from i, so n processes can share one GPU (the
reference is a launch-bound loop of small matmuls); ``--ours-match REGEX`` keeps the cases whose
name matches.

    cd $VLLM_SRC && PYTHONPATH=$REPO/tests/vllm_support:$REPO:$VLLM_SITE python -m pytest \\
        -p mk_registration -p block_fp8_ours --confcutdir=tests/kernels \\
        tests/kernels/moe/test_block_fp8.py -k test_w8a8_block_fp8_fused_moe

(``mk_registration`` supplies the ``workspace_init`` fixture that ``--confcutdir`` cuts off.)
"""

from __future__ import annotations

import re

import pytest
import torch

_TEST = "test_w8a8_block_fp8_fused_moe"
_VARIANTS = {}  # name -> our layer's output with that GEMM, of the last fused_experts call
_AT_RETURN = {}  # name ("layer" or a variant's) -> a copy of its output when its call returned


def pytest_addoption(parser):
    parser.addoption("--ours-shard", default="0/1", help="i/n: keep cases i, i+n, i+2n, ...")
    parser.addoption("--ours-diagnose", action="store_true",
                     help="print the tolerance usage of our layer and of its variants")
    parser.addoption("--ours-exact-scales", action="store_true",
                     help="run our layer (fused_experts' stand-in) with exact activation scales "
                          "even where vLLM rounds them to powers of two")
    parser.addoption("--ours-match", default="",
                     help="keep only the cases whose name matches this regular expression")


def _our_layer_call(a, w1, w2, topk_weights, topk_ids, quant_config, use_ue8m0):
    from vllm_moe_fixes.fused_moe import (
        FusedMoEModularKernel,
        NoEPPrepareAndFinalize,
        TritonExperts,
    )

    kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(use_ue8m0=use_ue8m0), TritonExperts())
    return kernel(a, w1, w2, topk_weights, topk_ids.to(torch.int32),
                  w1_scale=quant_config.w1_scale, w2_scale=quant_config.w2_scale,
                  global_num_experts=w1.shape[0])


def _with_gemm(launcher, *args):
    """The layer call with experts_steps' contiguous GEMM launcher replaced by `launcher`."""
    from vllm_moe_fixes.fused_moe import experts_steps

    kept = experts_steps.grouped_fp8_gemm_contiguous_triton
    experts_steps.grouped_fp8_gemm_contiguous_triton = launcher
    try:
        return _our_layer_call(*args)
    finally:
        experts_steps.grouped_fp8_gemm_contiguous_triton = kept


def _make_fused_experts(diagnose: bool, exact_scales: bool):
    def fused_experts(a, w1, w2, topk_weights, topk_ids, quant_config=None, **unused):
        if unused:
            raise ValueError(f"fused_experts stand-in: unexpected arguments {sorted(unused)}")
        from vllm_moe_fixes.integrations.vllm.support import vllm_rounds_scales_to_ue8m0

        # As the plugin's adapters: the layer's scales as vLLM decides (vLLM's fused_experts
        # quantises with power-of-two scales where is_deep_gemm_e8m0_used() holds).
        use_ue8m0 = vllm_rounds_scales_to_ue8m0() and not exact_scales
        args = (a, w1, w2, topk_weights, topk_ids, quant_config)
        _VARIANTS.clear()
        _AT_RETURN.clear()

        def kept(name, out):
            """out, with a copy of it as it is now (diagnose: see the DIAG hook)."""
            if diagnose:
                _AT_RETURN[name] = out.clone()
            return out

        if diagnose and a.shape[1] >= 4096:
            from vllm_moe_fixes.ops import grouped_gemm as gg

            def promoting(every, hidden_only):
                def launcher(a_, w_, o_, m_):
                    gemm1 = a_[0].shape[1] == a.shape[1]  # GEMM1 reads the hidden size
                    cfg = dict(IMPRECISE_ACC=every) if gemm1 or not hidden_only else None
                    return gg.grouped_fp8_gemm_contiguous_triton(a_, w_, o_, m_, cfg)
                return launcher

            for name, every, hidden_only in (("acc32", 32, False), ("acc32_gemm1", 32, True),
                                             ("acc64_gemm1", 64, True)):
                _VARIANTS[name] = kept(name, _with_gemm(promoting(every, hidden_only), *args,
                                                        use_ue8m0))
            _VARIANTS["exact"] = kept("exact", _with_gemm(gg.grouped_fp8_gemm_contiguous_ref,
                                                          *args, use_ue8m0))
            other = "exact_scales" if use_ue8m0 else "ue8m0"
            _VARIANTS[other] = kept(other, _our_layer_call(*args, not use_ue8m0))
        return kept("layer", _our_layer_call(*args, use_ue8m0))
    return fused_experts


def _modular_triton_fused_moe(moe_config, quant_config):
    """vLLM's kernel around the plugin's adapters, which follow vLLM's E8M0 decision."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk

    from vllm_moe_fixes.integrations.vllm.experts import VllmTritonExperts
    from vllm_moe_fixes.integrations.vllm.prepare_finalize import VllmNoEPPrepareAndFinalize

    return mk.FusedMoEKernel(VllmNoEPPrepareAndFinalize(),
                             VllmTritonExperts(moe_config, quant_config))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (a NaN equals the same NaN) of two tensors of one dtype and shape."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


def _usage(actual, expected, atol, rtol) -> float:
    d = (actual.float() - expected.float()).abs()
    return float((d / (atol + rtol * expected.float().abs())).max())


def pytest_collection_modifyitems(config, items):
    if config.getoption("--ours-diagnose"):
        try:
            from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used
            print(f"\nDIAG vLLM is_deep_gemm_e8m0_used() = {is_deep_gemm_e8m0_used()} (True: "
                  "vLLM's quant, and so the test's reference, rounds activation scales to "
                  "powers of two, and so do our layer and adapters, use_ue8m0)", flush=True)
        except Exception as exc:  # noqa: BLE001 (a diagnostic line only)
            print(f"\nDIAG is_deep_gemm_e8m0_used() unavailable: {exc!r}", flush=True)
    index, count = (int(v) for v in config.getoption("--ours-shard").split("/"))
    match = re.compile(config.getoption("--ours-match"))
    items[:] = [item for i, item in enumerate(items)
                if i % count == index and match.search(item.name)]
    diagnose = config.getoption("--ours-diagnose")
    for item in items:
        module = item.module
        if getattr(module, "_ours_swapped", False) or not hasattr(module, _TEST):
            continue
        module.fused_experts = _make_fused_experts(diagnose,
                                                   config.getoption("--ours-exact-scales"))
        module.modular_triton_fused_moe = _modular_triton_fused_moe
        module._ours_swapped = True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """With --ours-diagnose: a DIAG line per assert_close of the test (verdict unchanged)."""
    if not item.config.getoption("--ours-diagnose") or not item.name.startswith(_TEST):
        yield
        return
    real = torch.testing.assert_close
    calls = []

    def assert_close(actual, expected, *args, atol=None, rtol=None, **kwargs):
        which = "layer" if not calls else "vllm_kernel_adapters"
        calls.append(which)
        outputs = [(which, actual)] + (list(_VARIANTS.items()) if which == "layer" else [])
        fields = []
        for name, out in outputs:
            field = f"{name} {_usage(out, expected, atol, rtol):.3f}"
            kept = _AT_RETURN.get(name if which == "layer" else None)
            if kept is not None and not _same_bits(out, kept):
                field += (f" (changed after its call: at return "
                          f"{_usage(kept, expected, atol, rtol):.3f})")
            fields.append(field)
        print(f"\nDIAG {item.name} tol {atol}: " + ", ".join(fields), flush=True)
        return real(actual, expected, *args, atol=atol, rtol=rtol, **kwargs)

    torch.testing.assert_close = assert_close
    try:
        yield
    finally:
        torch.testing.assert_close = real
