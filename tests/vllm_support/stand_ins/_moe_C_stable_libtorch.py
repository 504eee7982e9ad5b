"""Stand-in for vLLM's compiled ``vllm/_moe_C_stable_libtorch`` (see _C_stable_libtorch.py here),
in plain torch:

- ``topk_softmax``: softmax over the experts in float32, top-k chosen by softmax + correction bias
  (when given), weights taken from the softmax, renormalised on request; ``is_padding`` ignored.
- ``moe_align_block_size`` (vLLM's TritonExperts): the routed rows (flat indices into
  ``topk_ids``) grouped by expert in a stable order, each expert's group padded to a multiple of
  ``block_size`` with the index ``topk_ids.numel()``; ``expert_ids`` names each block's expert
  (-1 past the used blocks); with ``expert_map`` the rows of experts it maps to -1 are dropped and
  the blocks name local experts; ``scatter_idx`` (when given) is each row's own index, -1 where
  dropped.
- ``moe_sum``: ``output[m] = sum over k of input[m, k]``, skipping the slots whose expert
  ``expert_map`` maps to -1 where both are given.
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


_LIB.define("moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, "
            "Tensor(a!) sorted_token_ids, Tensor(b!) experts_ids, "
            "Tensor(c!) num_tokens_post_pad, Tensor? expert_map, Tensor(d!)? scatter_idx) -> ()")


def _moe_align_block_size(topk_ids, num_experts, block_size, sorted_ids, expert_ids,
                          num_tokens_post_pad, expert_map, scatter_idx):
    flat = topk_ids.flatten().long()
    valid = (flat >= 0) & (flat < num_experts)
    if expert_map is not None:
        valid &= expert_map[flat.clamp(0, num_experts - 1)] >= 0
    counts = torch.bincount(flat[valid], minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    starts = torch.cumsum(padded, 0) - padded
    sorted_ids.fill_(flat.numel())
    expert_ids.fill_(-1)
    rows = torch.nonzero(valid).flatten()
    order = rows[torch.argsort(flat[rows], stable=True)]
    experts = flat[order]
    rank_in_expert = torch.arange(order.numel(), device=flat.device) - (
        torch.cumsum(counts, 0) - counts)[experts]
    sorted_ids[starts[experts] + rank_in_expert] = order.to(sorted_ids.dtype)
    names = torch.arange(num_experts, device=flat.device)
    if expert_map is not None:
        names = expert_map[:num_experts].long()
    block_expert = torch.repeat_interleave(names, padded // block_size)
    expert_ids[:block_expert.numel()] = block_expert.to(expert_ids.dtype)
    num_tokens_post_pad.fill_(int(padded.sum()))
    if scatter_idx is not None:
        index = torch.arange(flat.numel(), device=flat.device)
        scatter_idx.copy_(torch.where(valid, index, -1).view_as(scatter_idx))


_LIB.define("moe_sum(Tensor input, Tensor(a!) output, Tensor? topk_ids, Tensor? expert_map) -> ()")


def _moe_sum(x, output, topk_ids, expert_map):
    x = x.float()
    if topk_ids is not None and expert_map is not None:
        x = x * (expert_map[topk_ids.long()] >= 0).unsqueeze(-1)
    output.copy_(x.sum(1))


for _name, _fn in (("topk_softmax", _topk_softmax), ("moe_align_block_size", _moe_align_block_size),
                   ("moe_sum", _moe_sum)):
    for _device in ("CUDA", "CPU"):
        _LIB.impl(_name, _fn, _device)
