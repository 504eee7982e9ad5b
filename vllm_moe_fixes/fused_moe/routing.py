"""Softmax top-k routing, and a plain float32 reference of a whole MoE layer.

DeepSeek-V3/R1 route differently (sigmoid scores, a correction bias, expert groups): that is
`grouped_topk`, in grouped_topk.py.
"""

from __future__ import annotations

import torch

# quant_block_fp8 lives in ops/reference.py; re-exported here (README and cli import it from here).
from vllm_moe_fixes.ops.reference import dequant_block_fp8, quant_block_fp8

__all__ = ["fused_topk", "moe_reference", "quant_block_fp8"]


def fused_topk(gating_output: torch.Tensor, topk: int,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: the k most probable experts of every token.

    Args:
        gating_output: [M, E] router logits, any floating dtype.
        topk: k, 1 <= k <= E.
        renormalize: rescale each token's k weights to sum to 1.

    Returns:
        topk_weights: float32 [M, k], softmax probabilities (in float32) of the chosen experts,
            largest first.
        topk_ids: int64 [M, k], the chosen expert ids.
    """
    if not isinstance(gating_output, torch.Tensor) or gating_output.dim() != 2 \
            or not gating_output.is_floating_point():
        raise ValueError(f"gating_output must be a floating [M, E] tensor, got "
                         f"{getattr(gating_output, 'dtype', type(gating_output))} "
                         f"{tuple(getattr(gating_output, 'shape', ()))}")
    E = gating_output.shape[1]
    if not isinstance(topk, int) or not 1 <= topk <= E:
        raise ValueError(f"topk must be an int in [1, E={E}], got {topk!r}")
    probs = torch.softmax(gating_output.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, topk, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int64)


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
    E_l, two_n, _ = w1.shape
    N = two_n // 2
    out = torch.zeros(M, K, dtype=torch.float32, device=x.device)
    ids = topk_ids.to(torch.int64)
    weights = topk_weights.float()
    if apply_router_weight_on_input:
        x = x * weights  # k == 1
        weights = torch.ones_like(weights)
    local_ids = ids if expert_map is None else \
        torch.where(ids >= 0, expert_map.to(torch.int64)[ids.clamp(min=0)], -1)
    for e in range(E_l):
        token, slot = (local_ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        w1_e = dequant_block_fp8(w1[e], w1_scale[e])
        w2_e = dequant_block_fp8(w2[e], w2_scale[e])
        h = x[token] @ w1_e.t()
        y = (torch.nn.functional.silu(h[:, :N]) * h[:, N:]) @ w2_e.t()
        out.index_add_(0, token, y * weights[token, slot].unsqueeze(1))
    return out
