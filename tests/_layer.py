"""Shared helpers of the layer tests: a routed random problem, the kernel call, the reference,
the tolerance check, a recording prepare/finalize and a fake DeepGEMM.

Tolerances: activations are FP8-quantised twice (input and SiLU output), which costs ~5% relative
error; a routing or weight error shows as ~1.
"""

import types

import torch

from vllm_moe_fixes._compat import deep_gemm as compat
from vllm_moe_fixes.fused_moe import experts_steps
from vllm_moe_fixes.fused_moe.contiguous_experts import TritonExperts
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.fused_moe.no_ep_prepare_finalize import NoEPPrepareAndFinalize
from vllm_moe_fixes.fused_moe.routing import fused_topk
from vllm_moe_fixes.ops.grouped_gemm import grouped_fp8_gemm_contiguous_ref
from vllm_moe_fixes.sizes import ROW_ALIGNMENT
from vllm_moe_fixes.testing import calc_diff, moe_reference, random_fp8_moe_weights, rel_err


def make_problem(M, k, E, I, K, *, local=None, device="cpu", seed=0):
    """Weights of the local experts, routed input; local: global ids held here (None = all)."""
    g = torch.Generator().manual_seed(seed)
    local_num_experts = E if local is None else len(local)
    w1, w1s, w2, w2s = random_fp8_moe_weights(local_num_experts, K, I, generator=g)
    x = torch.randn(M, K, generator=g).bfloat16()
    weights, ids = fused_topk(torch.randn(M, E, generator=g), k, renormalize=True)
    emap = None
    if local is not None:
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[torch.tensor(local)] = torch.arange(local_num_experts, dtype=torch.int32)
    args = dict(hidden_states=x, w1=w1, w2=w2, topk_weights=weights, topk_ids=ids, w1_scale=w1s,
                w2_scale=w2s, expert_map=emap)
    return {n: (t.to(device) if t is not None else None) for n, t in args.items()}


def run(kernel, p, E, **kw):
    return kernel(p["hidden_states"], p["w1"], p["w2"], p["topk_weights"], p["topk_ids"],
                  w1_scale=p["w1_scale"], w2_scale=p["w2_scale"], global_num_experts=E,
                  expert_map=p["expert_map"], **kw)


def reference(p, **kw):
    return moe_reference(p["hidden_states"], p["w1"], p["w2"], p["topk_weights"], p["topk_ids"],
                         w1_scale=p["w1_scale"], w2_scale=p["w2_scale"],
                         expert_map=p["expert_map"], **kw)


def new_kernel(experts=None):
    return FusedMoEModularKernel(NoEPPrepareAndFinalize(), experts or TritonExperts())


def check_close(out, ref):
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert torch.isfinite(out).all()
    assert calc_diff(out, ref) < 4e-3 and rel_err(out, ref) < 9e-2, (calc_diff(out, ref),
                                                                      rel_err(out, ref))


class RecordingNoEP(NoEPPrepareAndFinalize):
    """Records what finalize receives, and the size of every chunk prepare sees."""

    def __init__(self, num_dispatchers=1):
        self._num_dispatchers = num_dispatchers
        self.chunks = []

    def num_dispatchers(self):
        return self._num_dispatchers

    def prepare(self, a1, *args):
        self.chunks.append(a1.shape[0])
        return super().prepare(a1, *args)

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, *, output_is_reduced=False):
        self.seen = (fused_expert_output is output, output_is_reduced)
        super().finalize(output, fused_expert_output, topk_weights, topk_ids,
                         apply_router_weight_on_input, output_is_reduced=output_is_reduced)


def ws_ptrs(kernel):
    return kernel.workspaces.ws13.data_ptr(), kernel.workspaces.ws2.data_ptr()


def fake_deep_gemm(monkeypatch, *, old_names=False, skip_minus_one_rows=False):
    """Install a fake DeepGEMM API (torch reference GEMM) and return its call log."""
    calls = []

    def contiguous(a, b, d, layout, disable_ue8m0_cast=False):
        calls.append((disable_ue8m0_cast, layout))
        if skip_minus_one_rows:  # like SM90: leave whole -1 blocks untouched (here: all -1 rows)
            keep = d[layout < 0].clone()
        grouped_fp8_gemm_contiguous_ref(a, b, d, layout)
        if skip_minus_one_rows:
            d[layout < 0] = keep

    def old_contiguous(lhs, rhs, out, m_indices):  # positional only, no ue8m0 keyword
        calls.append((None, m_indices))
        grouped_fp8_gemm_contiguous_ref(lhs, rhs, out, m_indices)

    mod = types.SimpleNamespace(get_m_alignment_for_contiguous_layout=lambda: ROW_ALIGNMENT)
    if old_names:
        mod.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous = old_contiguous
    else:
        mod.m_grouped_fp8_gemm_nt_contiguous = contiguous
    monkeypatch.setattr(compat, "_API", compat.resolve(mod))
    return calls


def force_triton_launchers(monkeypatch):
    """CPU tensors take the torch reference of each step of the experts: make every step its
    Triton launcher instead (interpreted on CPU), so a test runs the GPU path's code."""
    monkeypatch.setattr(experts_steps, "takes_triton", lambda reads: True)
