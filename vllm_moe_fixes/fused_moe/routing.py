"""Softmax top-k routing.

DeepSeek-V3/R1 route differently (sigmoid scores, a correction bias, expert groups): that is
`grouped_topk`, in grouped_topk.py.
"""

from __future__ import annotations

import torch

__all__ = ["fused_topk"]


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
