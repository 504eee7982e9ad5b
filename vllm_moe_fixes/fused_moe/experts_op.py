"""The experts' apply as one torch custom op, for code that torch.compile traces.

Dynamo traces Python. An experts' apply launches Triton or DeepGEMM kernels on CUDA tensors and
runs torch references on CPU ones, whose shapes follow the routing (a boolean mask, a range
check read on the host): a full graph cannot hold those. Under `torch.compiler.is_compiling()`
the experts hand their apply to the op `vllm_moe_fixes::experts_apply` instead: the graph holds
one opaque call that writes `output` and the two workspaces, and at run time the op calls the
eager apply of an experts object of the same class. So a compiled experts is its class: our
experts classes hold no state, and a class that is to run compiled must be importable by its
module and qualified name and build without arguments.
"""

from __future__ import annotations

import importlib

import torch

from vllm_moe_fixes.fused_moe.interfaces import Fp8MoEWeights

_INSTANCES: dict[str, object] = {}  # "module:qualname" -> the experts object the op runs


def _experts_named(name: str):
    experts = _INSTANCES.get(name)
    if experts is None:
        module, qualname = name.split(":")
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        experts = _INSTANCES[name] = cls()
    return experts


@torch.library.custom_op("vllm_moe_fixes::experts_apply",
                         mutates_args=("output", "workspace13", "workspace2"))
def _experts_apply(experts: str, output: torch.Tensor, a1q: torch.Tensor,
                   a1q_scale: torch.Tensor, w1: torch.Tensor, w1_scale: torch.Tensor,
                   w2: torch.Tensor, w2_scale: torch.Tensor, workspace13: torch.Tensor,
                   workspace2: torch.Tensor, topk_ids: torch.Tensor | None,
                   expert_map: torch.Tensor | None, expert_num_tokens: torch.Tensor | None,
                   topk_weights: torch.Tensor | None, expected_m: int | None,
                   tokens_per_pass: int | None, activation: str) -> None:
    _experts_named(experts).apply(
        output, a1q, a1q_scale, Fp8MoEWeights(w1, w1_scale, w2, w2_scale),
        workspace13=workspace13, workspace2=workspace2, topk_ids=topk_ids,
        expert_map=expert_map, expert_num_tokens=expert_num_tokens, topk_weights=topk_weights,
        expected_m=expected_m, tokens_per_pass=tokens_per_pass, activation=activation)


@_experts_apply.register_fake
def _(experts, output, a1q, a1q_scale, w1, w1_scale, w2, w2_scale, workspace13, workspace2,
      topk_ids, expert_map, expert_num_tokens, topk_weights, expected_m, tokens_per_pass,
      activation) -> None:
    return None  # writes its mutable arguments only


def apply_in_graph(experts, *, weights: Fp8MoEWeights, **arguments) -> None:
    """experts.apply(weights=weights, **arguments) as one call of the custom op (module
    docstring); the weights record travels as its four tensors (an op's schema takes tensors)."""
    cls = type(experts)
    _experts_apply(f"{cls.__module__}:{cls.__qualname__}", **weights._asdict(), **arguments)
