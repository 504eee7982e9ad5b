"""Run vLLM 0.33's own block-FP8 fused-MoE test with this library's layer in place of vLLM's
Triton fused experts (a pytest plugin for vLLM's source tree).

``tests/kernels/moe/test_block_fp8.py::test_w8a8_block_fp8_fused_moe`` (160 cases: M x N x K x E x
top-k, 20 of the 180 skipped for top-k > E) checks two calls against its torch reference
(``torch_w8a8_block_fp8_moe``: vLLM's per-token-group quant, per-block float32 products,
SiLU-and-mul in bf16, requantisation) with ``torch.testing.assert_close`` at atol = rtol = 0.035
(0.039 at M >= 8192). This plugin leaves the test, its inputs, its reference and its tolerance
untouched and swaps the two calls' targets in the test module's namespace:

- ``fused_experts(a, w1, w2, topk_weights, topk_ids, quant_config=...)`` -> our
  ``FusedMoEModularKernel(NoEPPrepareAndFinalize(), TritonExperts())``;
- ``modular_triton_fused_moe(moe_config, quant_config)`` -> vLLM's own ``FusedMoEKernel`` around our
  adapters ``VllmNoEPPrepareAndFinalize`` + ``VllmTritonExperts`` (what the plugin installs).

With ``--ours-diagnose``, each assert_close of the first call also prints one ``DIAG`` line: the
tolerance usage max|out - ref| / (atol + rtol |ref|) (> 1 fails) of our layer, and of the same
layer with its GEMMs replaced by the FP8 GEMM promoting every 32 of K (IMPRECISE_ACC=32; both
GEMMs: acc32, the first only: acc32_gemm1) and by the exact block product (float64 per 128-K
block, ``grouped_fp8_gemm_contiguous_ref``), at K >= 4096. The test's verdict is unchanged.
``--ours-shard i/n`` keeps every n-th case from i, so n processes can share one GPU (the
reference is a launch-bound loop of small matmuls).

    cd $VLLM_SRC && PYTHONPATH=$REPO/tests/vllm_support:$REPO:$VLLM_SITE python -m pytest \\
        -p mk_registration -p block_fp8_ours --confcutdir=tests/kernels \\
        tests/kernels/moe/test_block_fp8.py -k test_w8a8_block_fp8_fused_moe

(``mk_registration`` supplies the ``workspace_init`` fixture that ``--confcutdir`` cuts off.)
"""

from __future__ import annotations

import pytest
import torch

_TEST = "test_w8a8_block_fp8_fused_moe"
_VARIANTS = {}  # name -> our layer's output with that GEMM, of the last fused_experts call


def pytest_addoption(parser):
    parser.addoption("--ours-shard", default="0/1", help="i/n: keep cases i, i+n, i+2n, ...")
    parser.addoption("--ours-diagnose", action="store_true",
                     help="print the tolerance usage of our layer and of two GEMM variants")


def _our_layer_call(a, w1, w2, topk_weights, topk_ids, quant_config):
    from vllm_moe_fixes.fused_moe import (
        FusedMoEModularKernel,
        NoEPPrepareAndFinalize,
        TritonExperts,
    )

    kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(), TritonExperts())
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


def _make_fused_experts(diagnose: bool):
    def fused_experts(a, w1, w2, topk_weights, topk_ids, quant_config=None, **unused):
        if unused:
            raise ValueError(f"fused_experts stand-in: unexpected arguments {sorted(unused)}")
        args = (a, w1, w2, topk_weights, topk_ids, quant_config)
        _VARIANTS.clear()
        if diagnose and a.shape[1] >= 4096:
            from vllm_moe_fixes.ops import grouped_gemm as gg

            def promoting(hidden_only):
                def launcher(a_, w_, o_, m_):
                    gemm1 = a_[0].shape[1] == a.shape[1]  # GEMM1 reads the hidden size
                    cfg = dict(IMPRECISE_ACC=32) if gemm1 or not hidden_only else None
                    return gg.grouped_fp8_gemm_contiguous_triton(a_, w_, o_, m_, cfg)
                return launcher

            _VARIANTS["acc32"] = _with_gemm(promoting(False), *args)
            _VARIANTS["acc32_gemm1"] = _with_gemm(promoting(True), *args)
            _VARIANTS["exact"] = _with_gemm(gg.grouped_fp8_gemm_contiguous_ref, *args)
        return _our_layer_call(*args)
    return fused_experts


def modular_triton_fused_moe(moe_config, quant_config):
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk

    from vllm_moe_fixes.integrations.vllm.experts import VllmTritonExperts
    from vllm_moe_fixes.integrations.vllm.prepare_finalize import VllmNoEPPrepareAndFinalize

    return mk.FusedMoEKernel(VllmNoEPPrepareAndFinalize(),
                             VllmTritonExperts(moe_config, quant_config))


def _usage(actual, expected, atol, rtol) -> float:
    d = (actual.float() - expected.float()).abs()
    return float((d / (atol + rtol * expected.float().abs())).max())


def pytest_collection_modifyitems(config, items):
    index, count = (int(v) for v in config.getoption("--ours-shard").split("/"))
    items[:] = [item for i, item in enumerate(items) if i % count == index]
    diagnose = config.getoption("--ours-diagnose")
    for item in items:
        module = item.module
        if getattr(module, "_ours_swapped", False) or not hasattr(module, _TEST):
            continue
        module.fused_experts = _make_fused_experts(diagnose)
        module.modular_triton_fused_moe = modular_triton_fused_moe
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
        fields = [f"{which} {_usage(actual, expected, atol, rtol):.3f}"]
        if which == "layer":
            fields += [f"{k} {_usage(v, expected, atol, rtol):.3f}"
                       for k, v in _VARIANTS.items()]
        print(f"\nDIAG {item.name} tol {atol}: " + ", ".join(fields), flush=True)
        return real(actual, expected, *args, atol=atol, rtol=rtol, **kwargs)

    torch.testing.assert_close = assert_close
    try:
        yield
    finally:
        torch.testing.assert_close = real
