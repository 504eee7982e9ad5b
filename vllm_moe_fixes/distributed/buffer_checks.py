"""The argument checks of ``TorchAll2AllBuffer``: what DeepEP v1.2.1's asserts refuse, as
``ValueError`` naming the argument and the rule.

The buffer calls them at the top of each public method, with the sizes it knows (rank count,
what a handle recorded); the handles' own types are checked by the buffer. Value checks (ids in
range, counts against masks) read the device: ``checks_values`` says when they run. The checks
of every call format their messages only on failure: a message with values is built under its
``if``, and ``check(cond, msg)`` takes only constant strings (its argument is built every call).
"""

from __future__ import annotations

import torch

from vllm_moe_fixes import envs
from vllm_moe_fixes._validate import check, check_experts_per_rank
from vllm_moe_fixes.distributed import deepep_sizing as sizing
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE

_DTYPE_NAMES = {torch.bfloat16: "bf16"}


def checks_values(t: torch.Tensor) -> bool:
    """Whether to check the values of ``t``: always on the CPU, on CUDA only when asked (a read of
    a device value waits for the device)."""
    return envs.values_checked_on(t.device)


def describe(t) -> str:
    """``t``'s dtype and shape (and non-contiguity) for a message, or its type's name."""
    return f"{t.dtype} {list(t.shape)}{'' if t.is_contiguous() else ' (non-contiguous)'}" \
        if isinstance(t, torch.Tensor) else repr(type(t).__name__)


def check_tensor(name: str, t, dtype: torch.dtype | tuple, dim: int,
                 contiguous: bool = True) -> None:
    """ValueError naming ``name`` unless t is a tensor of that dtype (one of them) and dim
    (and contiguous, as DeepEP's kernels require)."""
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    ok = isinstance(t, torch.Tensor) and t.dtype in dtypes and t.dim() == dim and \
        (t.is_contiguous() or not contiguous)
    if not ok:
        want = " or ".join(_DTYPE_NAMES.get(d, str(d).removeprefix("torch.")) for d in dtypes)
        layout = ", contiguous" if contiguous else ""
        raise ValueError(f"{name} must be {want} with {dim} dims{layout}; got {describe(t)}")


def check_topk(topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
               check_values: bool | None = None) -> int:
    """topk_idx int64 [T, k] contiguous with values in [-1, num_experts) (read where
    ``check_values``, default ``checks_values(topk_idx)``, allows); returns E_l."""
    check_tensor("topk_idx", topk_idx, torch.int64, 2)
    local_num_experts = check_experts_per_rank(num_experts, num_ranks)
    if check_values is None:
        check_values = checks_values(topk_idx)
    if check_values and topk_idx.numel():
        lo, hi = torch.stack(torch.aminmax(topk_idx)).tolist()
        if lo < -1 or hi >= num_experts:
            raise ValueError(f"topk_idx values must lie in [-1, {num_experts}); "
                             f"got [{lo}, {hi}]")
    return local_num_experts


# ------------------------------------------------------------------ high-throughput (normal) mode
def check_rows(x, scales) -> None:
    """dispatch's x: contiguous [T, H] with rows of a multiple of 16 bytes; with scales, x is
    float8_e4m3fn and scales float32 [T, S]."""
    if not (isinstance(x, torch.Tensor) and x.dim() == 2 and x.is_contiguous()):
        raise ValueError(f"x must be a contiguous [T, H] tensor; got {describe(x)}")
    if (x.shape[1] * x.element_size()) % 16:
        raise ValueError(f"x must be [T, H] with rows of a multiple of 16 bytes; "
                         f"got {describe(x)}")
    if scales is not None:
        if x.dtype != FP8_DTYPE:
            raise ValueError(f"with scales, x must be float8_e4m3fn; got {x.dtype}")
        check_tensor("x scales", scales, torch.float32, 2, contiguous=False)
        if scales.shape[0] != x.shape[0]:
            raise ValueError(f"x scales must have {x.shape[0]} rows (one per token); got "
                             f"{list(scales.shape)}")


def check_cached_dispatch(x, topk_idx, topk_weights, num_tokens: int) -> None:
    """A dispatch with a handle made for ``num_tokens`` tokens: no routing, the same tokens."""
    check(topk_idx is None and topk_weights is None,
          "dispatch with a cached handle takes no topk_idx/topk_weights")
    if x.shape[0] != num_tokens:
        raise ValueError(f"x has {x.shape[0]} tokens but the handle was made for {num_tokens}")


def check_layout(t: int, num_ranks: int, num_tokens_per_rank, is_token_in_rank,
                 num_tokens_per_expert, topk_idx, topk_weights) -> int:
    """A dispatch of t tokens without a handle: get_dispatch_layout's results and the routing;
    returns E_l."""
    r = num_ranks
    for name, value in (("num_tokens_per_rank", num_tokens_per_rank),
                        ("is_token_in_rank", is_token_in_rank),
                        ("num_tokens_per_expert", num_tokens_per_expert)):
        if value is None:
            raise ValueError(f"dispatch without a handle needs {name} (from "
                             f"get_dispatch_layout)")
    check_tensor("is_token_in_rank", is_token_in_rank, torch.bool, 2)
    if tuple(is_token_in_rank.shape) != (t, r):
        raise ValueError(f"is_token_in_rank must be [{t}, {r}] (tokens, ranks); got "
                         f"{list(is_token_in_rank.shape)}")
    check_tensor("num_tokens_per_rank", num_tokens_per_rank, torch.int32, 1)
    if num_tokens_per_rank.shape[0] != r:
        raise ValueError(f"num_tokens_per_rank must be [{r}]; got "
                         f"{list(num_tokens_per_rank.shape)}")
    check_tensor("num_tokens_per_expert", num_tokens_per_expert, torch.int32, 1)
    local_num_experts = check_experts_per_rank(num_tokens_per_expert.numel(), r)
    most = sizing.NUM_MAX_LOCAL_EXPERTS
    if local_num_experts > most:
        raise ValueError(f"num_tokens_per_expert gives {local_num_experts} experts per rank; "
                         f"DeepEP's dispatch takes at most {most}")
    check((topk_idx is None) == (topk_weights is None),
          "topk_idx and topk_weights go together: pass both or neither")
    if topk_idx is not None:
        check_topk(topk_idx, num_tokens_per_expert.numel(), r)
        if topk_idx.shape[0] != t:
            raise ValueError(f"topk_idx has {topk_idx.shape[0]} tokens, x has {t}")
        check_tensor("topk_weights", topk_weights, torch.float32, 2)
        if topk_weights.shape != topk_idx.shape:
            raise ValueError(f"topk_weights must be {list(topk_idx.shape)} like topk_idx; got "
                             f"{list(topk_weights.shape)}")
    return local_num_experts


def check_combine(x, topk_weights, bias, num_recv_tokens: int, num_tokens: int) -> None:
    """combine's x bf16 [T', H] and optional weights [T', k] of the T' = num_recv_tokens rows
    received, bias of the T = num_tokens dispatched tokens."""
    t_recv, t = num_recv_tokens, num_tokens
    check_tensor("x", x, torch.bfloat16, 2)
    if x.shape[0] != t_recv:
        raise ValueError(f"x must be [{t_recv}, H] (the received token count); got "
                         f"{list(x.shape)}")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, torch.float32, 2)
        if topk_weights.shape[0] != t_recv:
            raise ValueError(f"topk_weights must have {t_recv} rows; got "
                             f"{list(topk_weights.shape)}")
    biases = bias if isinstance(bias, tuple) else (bias,)
    if len(biases) > 2:
        raise ValueError(f"bias takes at most two tensors; got {len(biases)}")
    for b in biases:
        if b is not None:
            check_tensor("bias", b, x.dtype, 2)
            if tuple(b.shape) != (t, x.shape[1]):
                raise ValueError(f"bias must be [{t}, {x.shape[1]}]; got {list(b.shape)}")


# ------------------------------------------------------------------------------ low-latency mode
def check_ll_dispatch(x, topk_idx, n: int, num_experts: int, num_ranks: int, use_ue8m0: bool,
                      async_finish: bool, return_recv_hook: bool) -> tuple[int, bool]:
    """low_latency_dispatch's tensors and flags against N = n and DeepEP's limits; returns (E_l,
    whether values are checked)."""
    check_tensor("x", x, torch.bfloat16, 2)
    if use_ue8m0:
        raise ValueError("use_ue8m0=True: UE8M0 scales are not supported by "
                         "TorchAll2AllBuffer")
    check_hook_flags(async_finish, return_recv_hook)
    check_values = checks_values(x)
    local_num_experts = check_topk(topk_idx, num_experts, num_ranks, check_values)
    t, k = topk_idx.shape
    if t != x.shape[0]:
        raise ValueError(f"topk_idx has {t} tokens, x has {x.shape[0]}")
    if k > sizing.LL_MAX_TOPK:
        raise ValueError(f"top-k {k} > {sizing.LL_MAX_TOPK}, the most DeepEP's low-latency "
                         "kernels take")
    if t > n:
        raise ValueError(f"{t} tokens exceed num_max_dispatch_tokens_per_rank={n}")
    return local_num_experts, check_values


def check_hook_flags(async_finish: bool, return_recv_hook: bool) -> None:
    """DeepEP's low-latency calls take at most one of the two."""
    if async_finish and return_recv_hook:
        raise ValueError("async_finish and return_recv_hook are mutually exclusive")


def check_ll_buffer_size(n: int, h: int, num_ranks: int, num_experts: int, num_rdma_bytes: int,
                         built_for: tuple) -> None:
    """DeepEP's low-latency limits for (N, H, E) and a buffer of num_rdma_bytes built for
    ``built_for`` = (N, H, E): DeepEP's ``layout.total_bytes <= num_rdma_bytes``."""
    need = sizing.check_low_latency_config(n, h, num_ranks, num_experts)
    if need > num_rdma_bytes:
        bn, bh, be = built_for
        raise ValueError(
            f"low-latency buffer too small: (N={n}, H={h}, E={num_experts}) needs {need} "
            f"bytes, the buffer was sized for (N={bn}, H={bh}, E={be}) = "
            f"{num_rdma_bytes} bytes (DeepEP's layout.total_bytes <= num_rdma_bytes)")


def check_recv_stats(stats, local_num_experts: int) -> None:
    """cumulative_local_expert_recv_stats: None or int32 [E_l] contiguous."""
    if stats is not None:
        name = "cumulative_local_expert_recv_stats"
        check_tensor(name, stats, torch.int32, 1)
        if stats.shape[0] != local_num_experts:
            raise ValueError(f"{name} must be [{local_num_experts}] (E_local); got "
                             f"{list(stats.shape)}")


def check_wait_stats(name: str, stats, num_ranks: int) -> None:
    """A wait-cost statistics tensor: None or int64 [R] contiguous."""
    if stats is not None:
        check_tensor(name, stats, torch.int64, 1)
        if stats.shape[0] != num_ranks:
            raise ValueError(f"{name} must be [{num_ranks}] (one per rank); got "
                             f"{list(stats.shape)}")


def check_ll_combine(x, topk_idx, topk_weights, out, *, x_shape: tuple[int, int, int], n: int,
                     num_tokens: int, topk: int) -> None:
    """low_latency_combine's tensors against its dispatch: x bf16 ``x_shape`` = [E_l, R*N, H],
    topk_idx int64 [T, k] and topk_weights float32 [T, k] as dispatched (T = num_tokens <= N,
    k = topk), out None or bf16 [T, H]."""
    t, h = num_tokens, x_shape[2]
    check_tensor("x", x, torch.bfloat16, 3)
    if x.shape != x_shape:
        raise ValueError(f"x must be {list(x_shape)} ([E_local, R*N, H]); got {list(x.shape)}")
    check_tensor("topk_idx", topk_idx, torch.int64, 2)
    check_tensor("topk_weights", topk_weights, torch.float32, 2)
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(f"topk_weights must be {list(topk_idx.shape)} like topk_idx; got "
                         f"{list(topk_weights.shape)}")
    if topk_weights.shape[0] > n:
        raise ValueError(f"topk_weights has {topk_weights.shape[0]} rows; at most "
                         f"num_max_dispatch_tokens_per_rank={n}")
    if topk_idx.shape != (t, topk):
        raise ValueError(f"topk_idx must be [{t}, {topk}] as dispatched; got "
                         f"{list(topk_idx.shape)}")
    if out is not None:
        check_tensor("out", out, torch.bfloat16, 2)
        if out.shape != (t, h):
            raise ValueError(f"out must be [{t}, {h}]; got {list(out.shape)}")
