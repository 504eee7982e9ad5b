"""The float32 torch reference of one whole MoE layer: what every layer path is checked against
(tests, the CLI's demo, benchmarks), written without activation quantisation as plain loops over
the local experts."""

from __future__ import annotations

import torch

from vllm_moe_fixes.ops.fp8 import dequant_block_fp8


def moe_reference(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, w1_scale: torch.Tensor,
                  w2_scale: torch.Tensor, expert_map: torch.Tensor | None = None,
                  apply_router_weight_on_input: bool = False) -> torch.Tensor:
    """float32 reference of one MoE layer: no activation quantisation, plain loops over experts.

    Args: as FusedMoEModularKernel.__call__ (hidden_states [M, K] any float dtype; w1 fp8
    [E_l, 2I, K], w2 fp8 [E_l, K, I] with 128x128 block scales; topk_* [M, k]; expert_map int32
    [E] global -> local or -1, or None).

    Returns float32 [M, K] = sum_j w[:, j] * (silu(x Wg^T) * (x Wu^T)) W2^T of expert ids[:, j],
    a slot whose expert is not local contributing zero.
    """
    x = hidden_states.float()
    M, K = x.shape
    local_num_experts, two_i, _ = w1.shape
    I = two_i // 2
    out = torch.zeros(M, K, dtype=torch.float32, device=x.device)
    ids = topk_ids.to(torch.int64)
    weights = topk_weights.float()
    if apply_router_weight_on_input:
        x = x * weights  # k == 1
        weights = torch.ones_like(weights)
    local_ids = ids if expert_map is None else \
        torch.where(ids >= 0, expert_map.to(torch.int64)[ids.clamp(min=0)], -1)
    for e in range(local_num_experts):
        token, slot = (local_ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        w1_e = dequant_block_fp8(w1[e], w1_scale[e])
        w2_e = dequant_block_fp8(w2[e], w2_scale[e])
        h = x[token] @ w1_e.t()
        y = (torch.nn.functional.silu(h[:, :I]) * h[:, I:]) @ w2_e.t()
        out.index_add_(0, token, y * weights[token, slot].unsqueeze(1))
    return out
