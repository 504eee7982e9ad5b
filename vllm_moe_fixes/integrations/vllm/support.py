"""What the adapters serve inside vLLM, as checks that return the reason for a refusal.

Each ``*_problem`` function returns None when this library's kernels serve the configuration and
otherwise one sentence saying what they do not serve; the plugin then leaves the layer to vLLM's
own kernels and logs that sentence, and the adapters raise it as a ValueError when they are built
directly on such a configuration. ``check_deepep_buffer`` runs this library's DeepEP sizing rules
against the buffer vLLM built.

Served: block-FP8 weights in 128x128 blocks with float32 scales, activations quantised per 1x128
group at run time (no static input scales), SiLU-and-mul on a packed [gate; up] w13, bf16
activations, hidden and intermediate sizes multiples of 128, no bias, LoRA, elastic EP,
micro-batching (DBO) or non-linear expert placement; prepare/finalize: one rank, or vLLM's DeepEP
high-throughput / low-latency all-to-all, or, for data parallel + EP on CPU, this library's
torch.distributed one (``data_parallel.py``).

vLLM's EPLB (``--enable-eplb``) is served as vLLM hands it to the kernel: its router maps each
logical id to a physical one (a replica) and records the load before the kernel is called, so
the layer is an ordinary one of E + R physical experts placed linearly (physical expert p on rank
p // E_l), with num_experts, the expert_map, global_num_experts and the DeepEP buffers all in
physical ids; its rebalance copies new weights into the layer's parameters in place, which the
kernel is handed on every call. Not served with it: elastic EP (``moe_config_problem``).
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
)
from vllm.utils import deep_gemm as vllm_deep_gemm

from vllm_moe_fixes.distributed.deepep_sizing import (
    check_high_throughput_config,
    check_low_latency_config,
)
from vllm_moe_fixes.integrations.vllm import data_parallel
from vllm_moe_fixes.ops import FP8_DTYPE, SCALE_BLOCK

BLOCK_SHAPE = [SCALE_BLOCK, SCALE_BLOCK]


def vllm_rounds_scales_to_ue8m0() -> bool:
    """vLLM's decision whether its block-FP8 MoE rounds activation scales up to powers of two:
    ``is_deep_gemm_e8m0_used()`` (VLLM_USE_DEEP_GEMM_E8M0, on by default, where DeepGEMM and its
    E8M0 GEMM are usable on a Hopper or Blackwell GPU). vLLM's per_token_group_quant_fp8 takes
    it as its default, so the quant of its prepare/finalizes (one rank, DeepEP high-throughput
    and V2: moe_kernel_quantize_input) and its Triton experts' requant follow it; its DeepGEMM
    experts read the same condition (DeepGemmQuantScaleFMT: FLOAT32_CEIL_UE8M0 on Hopper). The
    adapters read it here, when they are built, and set the library's use_ue8m0 where vLLM's
    own classes would round (prepare_finalize.py, experts.py)."""
    return bool(vllm_deep_gemm.is_deep_gemm_e8m0_used())


def quant_config_problem(quant_config: FusedMoEQuantConfig | None) -> str | None:
    """Why ``quant_config`` is not block-FP8 128x128 with dynamic 1x128 activations, or None."""
    if quant_config is None:
        return "the layer is not quantised (no FusedMoEQuantConfig)"
    if quant_config.quant_dtype != FP8_DTYPE or not quant_config.use_fp8_w8a8:
        return f"activations/weights are not FP8 w8a8 (quant_dtype={quant_config.quant_dtype})"
    if quant_config.block_shape != BLOCK_SHAPE:
        return f"block_shape={quant_config.block_shape}, not {BLOCK_SHAPE}"
    if quant_config.per_act_token_quant or quant_config.per_out_ch_quant:
        return "per-token or per-channel scales are asked for, not 1x128 groups / 128x128 blocks"
    if quant_config.a1_scale is not None or quant_config.a2_scale is not None:
        return "the layer has static activation scales (ours quantise activations at run time)"
    # getattr with a default: a field an older vLLM lacks is one it cannot set
    for name in ("w1_bias", "w2_bias", "w1_zp", "w2_zp"):
        if getattr(quant_config, name, None) is not None:
            return f"quant_config.{name} is set (ours have no bias or zero point)"
    for name in ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit"):
        if getattr(quant_config, name, None) is not None:
            return f"quant_config.{name} is set (ours run plain SiLU-and-mul)"
    for name in ("w1_scale", "w2_scale"):
        scale = getattr(quant_config, name)
        if not (isinstance(scale, torch.Tensor) and scale.dtype == torch.float32
                and scale.dim() == 3):
            return (f"quant_config.{name} is not a float32 [E_l, rows/128, cols/128] tensor "
                    f"(got {getattr(scale, 'dtype', type(scale).__name__)})")
    return None


def parallel_config_problem(cfg: FusedMoEParallelConfig, batched: bool) -> str | None:
    """Why the experts of one layout (batched: DeepEP low-latency; else one rank or DeepEP
    high-throughput) do not serve ``cfg``, or None."""
    if batched:
        return None if cfg.use_deepep_ll_kernels else (
            "the batched experts pair with vLLM's deepep_low_latency all-to-all only")
    if cfg.use_deepep_ll_kernels:
        return "deepep_low_latency takes the batched experts"
    if data_parallel.takes_over(cfg):  # DP + EP on CPU: our naive all-to-all, where it holds
        return data_parallel.dp_ep_problem(cfg)
    standard_all2all = cfg.use_deepep_ht_kernels or getattr(cfg, "use_deepep_v2_kernels", False)
    # use_passthrough_all2all is new in vLLM 0.32; before it no backend passed tokens through.
    passthrough = getattr(cfg, "use_passthrough_all2all", False)
    if passthrough or (cfg.use_all2all_kernels and not standard_all2all):
        return (f"all2all_backend={cfg.all2all_backend!r} is not served (ours: one rank, "
                "deepep_high_throughput, deepep_low_latency, deepep_v2)")
    if not cfg.use_all2all_kernels and cfg.dp_size > 1:
        return "data parallelism without expert parallelism (vLLM's all-gather path)"
    return None


def activation_problem(moe: FusedMoEConfig) -> str | None:
    """Why the layer's activation is not the SiLU-and-mul ours run, or None."""
    if moe.activation != MoEActivation.SILU or not moe.is_act_and_mul:
        return f"activation {moe.activation.value} (ours: silu with a gate/up multiply)"
    return None


def sizes_problem(hidden: int, intermediate: int | None = None) -> str | None:
    """Why a hidden size (and intermediate size per partition) are not multiples of the 128
    block every backend of ours runs, or None."""
    if intermediate is None:
        return f"hidden size {hidden} must be a multiple of {SCALE_BLOCK}" \
            if hidden % SCALE_BLOCK else None
    if hidden % SCALE_BLOCK or intermediate % SCALE_BLOCK:
        return (f"hidden size {hidden} and intermediate size per partition {intermediate} must "
                f"be multiples of {SCALE_BLOCK}")
    return None


def moe_config_problem(moe: FusedMoEConfig) -> str | None:
    """Why the layer described by ``moe`` is not served, or None (the quantisation is checked by
    ``quant_config_problem``, the parallel layout by ``parallel_config_problem``)."""
    problem = activation_problem(moe)
    if problem is not None:
        return problem
    if moe.in_dtype != torch.bfloat16:
        return f"activations are {moe.in_dtype} (ours: bfloat16)"
    if getattr(moe, "has_bias", False):
        return "the experts have a bias"
    if getattr(moe, "is_lora_enabled", False):
        return "LoRA is enabled"
    backend = getattr(moe, "moe_backend", "auto")
    if backend != "auto":
        return f"moe_backend={backend!r} asks for one of vLLM's kernels"
    for name in ("swiglu_limit", "swiglu_alpha", "swiglu_beta", "activation_situ_beta",
                 "activation_situ_linear_beta"):
        if getattr(moe, name, None) is not None:
            return f"{name} is set (ours run plain SiLU-and-mul)"
    problem = sizes_problem(moe.hidden_dim, moe.intermediate_size_per_partition)
    if problem is not None:
        return problem
    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None:  # a layer built outside an engine: no micro-batching, linear placement
        return None
    parallel = vllm_config.parallel_config
    if getattr(parallel, "use_ubatching", getattr(parallel, "enable_dbo", False)):
        # The adapters' async pair runs under vLLM's micro-batch contexts on CPU
        # (tests/test_vllm_dbo.py), not yet on a GPU, where vLLM runs each micro-batch on its
        # own CUDA stream and DeepEP's low-latency buffer allows one pending receive.
        return ("micro-batching (DBO): the adapters' async prepare/finalize has not run on a GPU "
                "under vLLM's micro-batch streams yet")
    if getattr(parallel, "enable_elastic_ep", False):
        return ("elastic EP: its scaling rebuilds the kernel with vLLM's own prepare/finalize "
                "around these experts (eep_reconfigure), a pairing not served")
    placement = getattr(parallel, "expert_placement_strategy", "linear")
    if placement != "linear":
        return f"expert_placement_strategy={placement!r} (ours place expert g on rank g // E_l)"
    return None


def check_no_routing_tables(tables) -> None:
    """ValueError unless every one of vLLM's routing tables (global_to_physical,
    physical_to_global, local_expert_global_ids, which vLLM builds for round-robin placement
    only, EPLB or not) is None: ours place expert g on rank g // E_l."""
    if tables is not None and any(t is not None for t in tables):
        raise ValueError("vllm_moe_fixes prepare/finalize: routing tables (round-robin "
                         "placement) are not served; experts must sit linearly (expert g on "
                         "rank g // E_l)")


def check_deepep_buffer(buffer, *, low_latency: bool, num_ranks: int, hidden: int,
                        num_experts: int, max_tokens_per_rank: int | None = None) -> None:
    """Raise ValueError, with the numbers, where the all-to-all buffer vLLM built cannot serve
    this layer by this library's DeepEP rules (``deepep_sizing``): the rank count, hidden size
    and expert split DeepEP v1.2.1 takes, and at least the NVLink / RDMA bytes its hints ask for.

    buffer: a ``deep_ep.Buffer`` (or this library's ``TorchAll2AllBuffer``, which has no NVLink
    buffer to size, and whose high-throughput dispatch runs in either mode: the ``naive``
    backend's buffer is built in low-latency mode, to serve both) over ``num_ranks`` ranks (which
    our prepare/finalize checks when built, with ``buffer_rank_and_size``); max_tokens_per_rank:
    the low-latency dispatch's N.
    """
    nvl_bytes = getattr(buffer, "num_nvl_bytes", None)
    if nvl_bytes is None and not low_latency:  # TorchAll2AllBuffer's high-throughput dispatch
        return
    if bool(getattr(buffer, "low_latency_mode", False)) != low_latency:
        raise ValueError(f"vLLM's DeepEP buffer has low_latency_mode="
                         f"{getattr(buffer, 'low_latency_mode', False)}; this prepare/finalize "
                         f"needs {low_latency}")
    rdma_bytes = getattr(buffer, "num_rdma_bytes", 0)
    if low_latency:
        need = check_low_latency_config(max_tokens_per_rank, hidden, num_ranks, num_experts)
        what = (f"the low-latency dispatch of {max_tokens_per_rank} tokens per rank, "
                f"hidden={hidden}, {num_ranks} ranks, {num_experts} experts")
    else:
        need = check_high_throughput_config(hidden, num_ranks, num_experts, nvl_bytes)
        what = f"high-throughput dispatch of hidden={hidden} over {num_ranks} ranks"
    if rdma_bytes < need:
        raise ValueError(f"vLLM's DeepEP buffer has num_rdma_bytes={rdma_bytes}; DeepEP needs "
                         f"{need} for {what} (its size hint). vLLM sizes the high-throughput "
                         "RDMA buffer from VLLM_DEEPEP_BUFFER_SIZE_MB: raise it")
