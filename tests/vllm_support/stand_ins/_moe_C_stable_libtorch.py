"""Stand-in for vLLM's compiled ``vllm/_moe_C_stable_libtorch`` (see _C_stable_libtorch.py here):
``_moe_C::topk_softmax`` in plain torch: softmax over the experts in float32, top-k chosen by
softmax + correction bias (when given), weights taken from the softmax, renormalised on request;
``is_padding`` is accepted and ignored. NOT YET RUN.
"""

import torch

_LIB = torch.library.Library("_moe_C", "DEF")
_LIB.define("topk_softmax(Tensor(a!) topk_weights, Tensor(b!) topk_ids, "
            "Tensor(c!) token_expert_indices, Tensor gating_output, bool renormalize, "
            "Tensor? e_score_correction_bias, Tensor? is_padding) -> ()")


def _topk_softmax(topk_weights, topk_ids, token_expert_indices, gating_output, renormalize,
                  bias, _is_padding):
    scores = torch.softmax(gating_output.float(), dim=-1)
    choose = scores if bias is None else scores + bias.float()
    ids = choose.topk(topk_ids.shape[-1], dim=-1).indices
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    topk_weights.copy_(weights)
    topk_ids.copy_(ids)
    rows = torch.arange(ids.shape[0], device=ids.device, dtype=token_expert_indices.dtype)
    token_expert_indices.copy_(rows[:, None] + ids.shape[0] * torch.arange(
        ids.shape[1], device=ids.device, dtype=token_expert_indices.dtype))


for _device in ("CUDA", "CPU"):
    _LIB.impl("topk_softmax", _topk_softmax, _device)
