"""The argument checks of `FusedMoEModularKernel.__call__` (`check_layer_call`), and the weight
rules the vLLM adapter also checks (`check_weights`, `check_weight_scales`).

Each raises ValueError naming the argument, the value and the rule. Each rule is written once, as
the condition of the statement that raises its error, and its message (formatting shapes and
dtypes costs more host time than the tests themselves) is built only when it fails: the rules
run on every layer call.
"""

from __future__ import annotations

import weakref

import torch

from vllm_moe_fixes import envs
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, SCALE_BLOCK
from vllm_moe_fixes.ops.permute import check_routing_ranges

_ID_DTYPES = (torch.int32, torch.int64)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_layer_call(x, w1, w2, topk_weights, topk_ids, *, w1_scale, w2_scale,
                     global_num_experts, expert_map, activation, apply_router_weight_on_input,
                     max_tokens_across_ranks) -> None:
    """Every rule of the layer's arguments (FusedMoEModularKernel.__call__ documents them), in
    this order; ids and expert_map values only for CPU tensors or with VLLM_MOE_CHECK_IDS=1.
    The rules are inline, in one function, because each function call costs host time on every
    layer call."""
    tensors = (x, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{_TENSOR_NAMES[i]} must be a torch.Tensor, got {type(t)}")
    if activation != "silu":
        raise ValueError(f"activation must be 'silu', got {activation!r}")
    if not (x.dim() == 2 and x.dtype == torch.bfloat16):
        raise ValueError(f"hidden_states must be bfloat16 [M, K], got {x.dtype} {_shape(x)}")
    M, K = x.shape
    if K > 1 and x.stride(1) != 1:
        raise ValueError(f"hidden_states must have contiguous channels (stride(1) == 1), "
                         f"got strides {x.stride()}")
    local_num_experts, I = check_weights(w1, w2, K)
    check_weight_scales(w1_scale, w2_scale, local_num_experts, I, K)
    if not (topk_ids.dim() == 2 and topk_ids.shape[0] == M and topk_ids.dtype in _ID_DTYPES):
        raise ValueError(f"topk_ids must be int32 or int64 [M={M}, k], got {topk_ids.dtype} "
                         f"{_shape(topk_ids)}")
    topk = topk_ids.shape[1]
    if topk < 1:
        raise ValueError("topk_ids must have k >= 1 columns")
    if not (topk_weights.dtype == torch.float32 and topk_weights.shape == (M, topk)):
        raise ValueError(f"topk_weights must be float32 {(M, topk)}, got {topk_weights.dtype} "
                         f"{_shape(topk_weights)}")
    if not (type(global_num_experts) is int and global_num_experts >= local_num_experts):
        raise ValueError(f"global_num_experts must be an int >= E_l={local_num_experts}, got "
                         f"{global_num_experts!r}")
    if expert_map is None:
        if global_num_experts != local_num_experts:
            raise ValueError(f"without expert_map every expert is local: global_num_experts="
                             f"{global_num_experts} must equal E_l={local_num_experts}")
    elif not (isinstance(expert_map, torch.Tensor) and expert_map.dtype == torch.int32
              and expert_map.shape == (global_num_experts,)):
        raise ValueError(
            f"expert_map must be int32 [{global_num_experts}], got "
            f"{getattr(expert_map, 'dtype', type(expert_map))} "
            f"{_shape(expert_map) if isinstance(expert_map, torch.Tensor) else ''}")
    if apply_router_weight_on_input and topk != 1:
        raise ValueError(f"apply_router_weight_on_input needs topk == 1, got topk={topk}")
    device = x.device
    if not (w1.device == device and w2.device == device and topk_weights.device == device
            and topk_ids.device == device and w1_scale.device == device
            and w2_scale.device == device and (expert_map is None or expert_map.device == device)):
        devices = {t.device for t in (*tensors, expert_map) if t is not None}
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if max_tokens_across_ranks is not None and not (
            type(max_tokens_across_ranks) is int and max_tokens_across_ranks >= M):
        raise ValueError(f"max_tokens_across_ranks must be None or an int (not a bool) >= M={M}, "
                         f"got {max_tokens_across_ranks!r}")
    if envs.values_checked_on(device):
        check_routing_ranges(topk_ids, global_num_experts, expert_map, local_num_experts)


_TENSOR_NAMES = ("hidden_states", "w1", "w2", "topk_weights", "topk_ids", "w1_scale", "w2_scale")


def check_weights(w1: torch.Tensor, w2: torch.Tensor, K: int) -> tuple[int, int]:
    """w1 fp8 [E_l, 2I, K] and w2 fp8 [E_l, K, I], contiguous, K and I multiples of SCALE_BLOCK;
    returns (local_num_experts, I)."""
    if not (w1.dim() == 3 and w1.dtype == FP8_DTYPE):
        raise ValueError(f"w1 must be float8_e4m3fn [E_l, 2I, K], got {w1.dtype} {_shape(w1)}")
    local_num_experts, two_i, k_w1 = w1.shape
    if not (local_num_experts > 0 and two_i > 0 and two_i % 2 == 0 and k_w1 == K):
        raise ValueError(f"w1 must be [E_l, 2I, K={K}] with E_l > 0 and an even 2I > 0, got "
                         f"{_shape(w1)}")
    I = two_i // 2
    if K % SCALE_BLOCK or I % SCALE_BLOCK:
        raise ValueError(f"hidden size K={K} and intermediate size I={I} must be multiples of "
                         f"{SCALE_BLOCK} (the {SCALE_BLOCK}x{SCALE_BLOCK} weight blocks and "
                         f"1x{SCALE_BLOCK} activation groups every backend uses)")
    if not (w2.dtype == FP8_DTYPE and w2.shape == (local_num_experts, K, I)):
        raise ValueError(f"w2 must be float8_e4m3fn [E_l, K, I] = {(local_num_experts, K, I)}, "
                         f"got {w2.dtype} {_shape(w2)}")
    if not (w1.is_contiguous() and w2.is_contiguous()):
        raise ValueError("w1 and w2 must be contiguous")
    return local_num_experts, I


def check_weight_scales(w1_scale: torch.Tensor, w2_scale: torch.Tensor, local_num_experts: int,
                        I: int, K: int) -> None:
    """float32 [E_l, 2I/128, K/128] and [E_l, K/128, I/128]: one scale per weight block."""
    blocks_k, blocks_i = K // SCALE_BLOCK, I // SCALE_BLOCK
    w1_want = (local_num_experts, 2 * blocks_i, blocks_k)
    if not (w1_scale.dtype == torch.float32 and w1_scale.shape == w1_want):
        raise _scale_error("w1_scale", w1_scale, w1_want)
    w2_want = (local_num_experts, blocks_k, blocks_i)
    if not (w2_scale.dtype == torch.float32 and w2_scale.shape == w2_want):
        raise _scale_error("w2_scale", w2_scale, w2_want)


def _scale_error(name: str, scale: torch.Tensor, want: tuple[int, int, int]) -> ValueError:
    return ValueError(f"{name} must be float32 {want} ({SCALE_BLOCK}x{SCALE_BLOCK} blocks), got "
                      f"{scale.dtype} {_shape(scale)}")


def _finite(t: torch.Tensor) -> torch.Tensor:
    """Bool mask of t's finite entries. float8_e4m3fn has no inf and NaN is its one pattern with
    all exponent and mantissa bits set (0x7F / 0xFF); torch.isfinite does not take FP8."""
    if t.dtype == FP8_DTYPE:
        return (t.view(torch.uint8) & 0x7F) != 0x7F
    return torch.isfinite(t)


def check_finite(**tensors: torch.Tensor) -> None:
    """ValueError naming the first NaN or +-inf entry of the named tensors (the layer's checked
    mode, VLLM_MOE_CHECK_FINITE=1): one host read of the tensors' values, a synchronisation on
    CUDA."""
    finite = [_finite(t) for t in tensors.values()]
    if bool(torch.stack([f.all() for f in finite]).all()):
        return
    for (name, t), ok in zip(tensors.items(), finite):
        if not bool(ok.all()):
            where = tuple(int(i) for i in (~ok).nonzero()[0])
            raise ValueError(f"{name} must be finite (VLLM_MOE_CHECK_FINITE=1); "
                             f"{name}{list(where)} = {float(t[where])}")


# id(weight) -> (a weak reference to it, the version (torch's in-place write counter) at which it
# was found finite). An entry leaves when its tensor dies, before the id can be reused; a plain
# dict keyed by id costs a fifth of torch's WeakIdKeyDictionary per lookup.
_finite_at_version: dict[int, tuple[weakref.ref, int]] = {}


def check_weights_finite(**weights: torch.Tensor) -> None:
    """check_finite for weights and their scales, read once per tensor and version: a later call
    with the same tensors, not written in place since, reads nothing (as the DeepEP
    prepare/finalize reads an expert_map). NaN in FP8 weights is found too (torch.isfinite does
    not take FP8). Inference tensors carry no version: they are read at every call. Writes
    through ``.data`` are not counted by torch, so a weight reloaded that way after its check
    is not read again."""
    for name, t in weights.items():
        try:
            version = t._version
        except RuntimeError:  # an inference tensor: torch keeps no version counter
            version = None
        key = id(t)
        entry = _finite_at_version.get(key)
        if version is not None and entry is not None and entry[1] == version \
                and entry[0]() is t:
            continue
        check_finite(**{name: t})
        if version is not None:
            forget = lambda _, key=key: _finite_at_version.pop(key, None)  # noqa: E731
            _finite_at_version[key] = (weakref.ref(t, forget), version)
