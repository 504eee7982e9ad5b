"""Stand-in for vLLM's compiled ``vllm/_C_stable_libtorch`` on a GPU machine without vLLM's .so
files (copied there by tests/vllm_support/install_stand_ins.py; never part of the package).

Defines, with ``torch.library``, the ``_C`` ops that vLLM's Python tree calls on the paths the
plugin's GPU checks take, in plain torch: ``per_token_group_fp8_quant`` (1x128 groups, amax /
fp8_max scales, optionally rounded up to powers of two); ``silu_and_mul`` (the harness's reference,
``SiluAndMul``); ``silu_and_mul_per_block_quant`` (vLLM's TritonExperts with block FP8: SiLU(gate)
* up in float32, then that quantisation); and the CUTLASS capability queries asked at import (all
answer False, so vLLM never picks a CUTLASS kernel). The schemas take the arguments in the order
vLLM 0.33's ``_custom_ops`` passes them.

``persistent_masked_m_silu_mul_quant`` (vLLM's BatchedDeepGemmExperts between its two masked
GEMMs) is not plain torch: on CUDA it runs this library's fused Triton kernel
(``silu_and_mul_quant_fp8_triton``, the launcher our own batched experts call), whose numbers
are the op's recipe (see _persistent_masked_m_silu_mul_quant), so a benchmark of vLLM's LL path
pays one cached Triton launch for this op, as ours does, instead of a slow torch composition.
"""

import torch

from vllm_moe_fixes.ops.silu_mul_quant import silu_and_mul_quant_fp8, silu_and_mul_quant_fp8_triton

_LIB = torch.library.Library("_C", "DEF")

_LIB.define("per_token_group_fp8_quant(Tensor input, Tensor(a!) output_q, Tensor(b!) output_s, "
            "int group_size, float eps, float fp8_min, float fp8_max, bool scale_ue8m0, "
            "bool dummy_is_scale_transposed, bool dummy_is_tma_aligned) -> ()")


# A benchmark that times a vLLM path through this op may set CUDA_QUANT to a one-launch kernel of
# the same recipe for CUDA inputs (called with this op's arguments but the two layout flags, the
# scales' strides being out_s's own): vLLM's CUDA kernel is one launch, the torch below is several.
CUDA_QUANT = None


def _per_token_group_fp8_quant(x, out_q, out_s, group_size, eps, fp8_min, fp8_max, ue8m0,
                               _transposed, _tma_aligned):
    if CUDA_QUANT is not None and x.is_cuda:
        CUDA_QUANT(x, out_q, out_s, group_size, eps, fp8_min, fp8_max, ue8m0)
        return
    groups = x.float().unflatten(-1, (x.shape[-1] // group_size, group_size))
    scale = groups.abs().amax(-1).clamp(min=eps) / fp8_max
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (groups / scale[..., None]).clamp(fp8_min, fp8_max).flatten(-2)
    out_q.copy_(q.to(out_q.dtype))
    out_s.copy_(scale)  # out_s may be a column-major view: copy_ follows its strides


_LIB.define("silu_and_mul(Tensor(a!) out, Tensor input) -> ()")


def _silu_gate_times_up(x):
    gate, up = x.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _silu_and_mul(out, x):
    out.copy_(_silu_gate_times_up(x))


_LIB.define("silu_and_mul_per_block_quant(Tensor(a!) out, Tensor input, Tensor(b!) scales, "
            "int group_size, Tensor? scale_ub, bool is_scale_transposed) -> ()")


def _silu_and_mul_per_block_quant(out, x, scales, group_size, scale_ub, _transposed):
    if scale_ub is not None:
        raise NotImplementedError("silu_and_mul_per_block_quant stand-in: scale_ub")
    fp8_max = torch.finfo(out.dtype).max
    _per_token_group_fp8_quant(_silu_gate_times_up(x), out, scales, group_size, 1e-10, -fp8_max,
                               fp8_max, False, False, False)


_LIB.define("persistent_masked_m_silu_mul_quant(Tensor input, Tensor counts, Tensor(a!) y_q, "
            "Tensor(b!) y_s, bool use_ue8m0) -> ()")


def _persistent_masked_m_silu_mul_quant(x, counts, y_q, y_s, use_ue8m0):
    """x bf16 [E, T, 2H] (gate | up), counts int32 [E]: for the rows t < counts[e] of each
    expert, y_q fp8 [E, T, H] and y_s float32 [E, T, H/128] (any strides; vLLM passes MN-major
    ones) get SiLU(gate) rounded to bf16, times up rounded to bf16, quantised per 1x128 group
    with scale max(amax, 1e-10) / 448 (use_ue8m0: floored at 1e-10, then rounded up to a power
    of two); other rows are left alone. That is the rounding of vLLM 0.33's own reference for
    this op (tests/kernels/moe/test_silu_mul_fp8_quant_deep_gemm.py), except that the scale is
    computed in float32 where that reference rounds it through bf16 (vLLM's test compares with
    float32 tolerances), and that reference has no ue8m0 floor (a group below 4.5e-8, all zeros
    in practice, gets a smaller power of two there; its values are 0 either way). H200 runs take
    use_ue8m0=False. CUDA: our fused Triton kernel; CPU: our torch references composed."""
    if x.is_cuda:
        silu_and_mul_quant_fp8_triton(x, y_q, y_s, counts, use_ue8m0)
    else:
        silu_and_mul_quant_fp8(x, out_q=y_q, out_s=y_s, expert_num_tokens=counts,
                               use_ue8m0=use_ue8m0)


for _name, _fn in (("per_token_group_fp8_quant", _per_token_group_fp8_quant),
                   ("silu_and_mul", _silu_and_mul),
                   ("silu_and_mul_per_block_quant", _silu_and_mul_per_block_quant),
                   ("persistent_masked_m_silu_mul_quant", _persistent_masked_m_silu_mul_quant)):
    for _device in ("CUDA", "CPU"):
        _LIB.impl(_name, _fn, _device)

for _name in ("cutlass_scaled_mm_supports_fp4", "cutlass_scaled_mm_supports_fp8",
              "cutlass_scaled_mm_supports_block_fp8", "cutlass_group_gemm_supported",
              "mxfp4_experts_quant_supported"):
    _LIB.define(f"{_name}(int cuda_device_capability) -> bool")
    _LIB.impl(_name, lambda capability: False, "CompositeExplicitAutograd")
