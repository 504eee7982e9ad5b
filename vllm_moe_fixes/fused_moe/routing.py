"""Softmax top-k routing, and a plain float32 reference of a whole MoE layer."""

from __future__ import annotations

import torch

from vllm_moe_fixes.ops.reference import dequant_block_fp8

BLOCK = 128


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


def quant_block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., R, C] (R, C multiples of 128) -> (float8_e4m3fn [..., R, C], float32
    [..., R/128, C/128]) with 128x128 block scales amax/448 (DeepGEMM's per-block recipe; amax
    floored at 1e-4). For making test and benchmark weights."""
    R, C = w.shape[-2:]
    if R % BLOCK or C % BLOCK:
        raise ValueError(f"w's last two dimensions must be multiples of {BLOCK}, got {(R, C)}")
    blocks = w.float().unflatten(-1, (C // BLOCK, BLOCK)).unflatten(-3, (R // BLOCK, BLOCK))
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=1e-4)
    q = (blocks * (448.0 / amax)).to(torch.float8_e4m3fn).flatten(-2).flatten(-3, -2)
    return q, (amax / 448.0).squeeze(-1).squeeze(-2)


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
