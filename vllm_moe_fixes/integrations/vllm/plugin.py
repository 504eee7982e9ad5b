"""The ``vllm.general_plugins`` hook: with VLLM_MOE_FIXES=1, vLLM's block-FP8 FusedMoE layers run
this library's prepare/finalize and experts.

vLLM has no registry for out-of-tree MoE kernels: ``Fp8MoEMethod`` (``quantization/fp8.py``)
imports ``select_fp8_moe_backend`` and ``make_fp8_moe_kernel`` by name, so ``register`` rebinds
those two names in that module:

    Fp8MoEMethod.__init__ -> select_fp8_moe_backend(config, weight_key, activation_key, ...)
        served (support.py)  -> (TRITON or BATCHED_TRITON, our experts adapter class): vLLM then
                                leaves the checkpoint's weights in our layout [E_l, 2I, K]
        otherwise            -> vLLM's own selector, unchanged (the reason is logged once)
    process_weights_after_loading -> make_fp8_moe_kernel(quant_config, moe_config, experts_cls, ..)
        our experts class    -> FusedMoEKernel(our P/F adapter for vLLM's parallel config, experts)
        otherwise            -> vLLM's own function, unchanged

vLLM's configuration decides the wiring: no all-to-all -> ``VllmNoEPPrepareAndFinalize``;
``--all2all-backend deepep_high_throughput`` / ``deepep_low_latency`` -> our DeepEP adapters over
the ``deep_ep.Buffer`` vLLM's all2all manager built (checked against DeepEP's rules here, before
the first forward); ``deepep_v2`` -> our V2 adapter over its ``deep_ep.ElasticBuffer``. This
library's VLLM_USE_DEEP_GEMM (default 0) picks DeepGEMM or Triton experts. Other quantisation methods that import the selector (modelopt, compressed-tensors,
online FP8) keep vLLM's kernels. vLLM 0.26 passes ``layer=`` to ``make_fp8_moe_kernel``: extra
keywords pass through to vLLM's function.
"""

from __future__ import annotations

import logging

from vllm_moe_fixes import envs

# A child of vLLM's logger, so that vLLM's handler and format print it.
logger = logging.getLogger("vllm.plugins.vllm_moe_fixes")

_logged_reasons: set[str] = set()


def register() -> None:
    """The entry point vLLM calls in every process (``vllm.general_plugins``): with
    VLLM_MOE_FIXES unset or 0 it does nothing; with 1 it rebinds the FP8 MoE selector and kernel
    builder of ``vllm.model_executor.layers.quantization.fp8`` (once per process)."""
    if not envs.VLLM_MOE_FIXES:
        return
    from vllm_moe_fixes.integrations.vllm.versions import check_installed_vllm
    check_installed_vllm(logger)  # refuses a vLLM older than the supported range, warns past it
    from vllm.model_executor.layers.quantization import fp8 as fp8_method

    if getattr(fp8_method.select_fp8_moe_backend, "_vllm_moe_fixes", False):
        return
    fp8_method.select_fp8_moe_backend = _wrap_selector(fp8_method.select_fp8_moe_backend)
    fp8_method.make_fp8_moe_kernel = _wrap_kernel_builder(fp8_method.make_fp8_moe_kernel)
    from vllm_moe_fixes.integrations.vllm import data_parallel
    data_parallel.register()  # DP + EP on CPU: the layers' forward as vLLM's opaque custom op
    logger.info("vllm_moe_fixes: block-FP8 FusedMoE layers will run vllm_moe_fixes kernels "
                "where they serve the layer (VLLM_MOE_FIXES=1)")


def _log_unserved_once(reason: str) -> None:
    if reason not in _logged_reasons:
        _logged_reasons.add(reason)
        logger.info("vllm_moe_fixes does not serve this FusedMoE layer (%s): vLLM's own FP8 MoE "
                    "kernels run it", reason)


def experts_class_for(config, weight_key, activation_key):
    """(our experts adapter class, None) for a layer this library serves, else (None, reason).

    Arguments: vLLM's ``FusedMoEConfig`` and the layer's weight / activation ``QuantKey``.
    With VLLM_USE_DEEP_GEMM=1 and DeepGEMM not usable here, raises what our own selector raises
    (MissingLibraryError, an ImportError, naming VLLM_USE_DEEP_GEMM and DeepGEMM; RuntimeError on
    a GPU other than SM90) instead of silently running Triton.
    """
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk

    from vllm_moe_fixes.integrations.vllm import experts as adapters

    batched = config.moe_parallel_config.use_batched_activation_format
    pair = ((adapters.VllmBatchedTritonExperts, adapters.VllmBatchedDeepGemmExperts) if batched
            else (adapters.VllmTritonExperts, adapters.VllmDeepGemmExperts))
    cls = pair[1] if envs.VLLM_USE_DEEP_GEMM else pair[0]
    if envs.VLLM_USE_DEEP_GEMM:
        cls._ours()  # our DeepGEMM experts raise their error where DeepGEMM cannot run
    fmt = (mk.FusedMoEActivationFormat.BatchedExperts if batched
           else mk.FusedMoEActivationFormat.Standard)
    ok, reason = cls.is_supported_config(cls, config, weight_key, activation_key, fmt)
    if not ok:
        return None, f"{cls.__name__}: {reason}"
    reason = cls.unserved_reason(config)
    if reason is not None:
        return None, f"{cls.__name__}: {reason}"
    return cls, None


def _wrap_selector(vllm_select):
    def select_fp8_moe_backend(config, weight_key, activation_key, *args, **kwargs):
        """vLLM's ``select_fp8_moe_backend``, answering (TRITON or BATCHED_TRITON, our experts
        class) for the layers this library serves."""
        from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend

        cls, reason = experts_class_for(config, weight_key, activation_key)
        if cls is None:
            _log_unserved_once(reason)
            return vllm_select(config, weight_key, activation_key, *args, **kwargs)
        backend = Fp8MoeBackend.BATCHED_TRITON if cls.batched else Fp8MoeBackend.TRITON
        return backend, cls

    select_fp8_moe_backend._vllm_moe_fixes = True
    return select_fp8_moe_backend


def _wrap_kernel_builder(vllm_make):
    def make_fp8_moe_kernel(moe_quant_config, moe_config, experts_cls, fp8_backend,
                            routing_tables=None, **kwargs):
        """vLLM's ``make_fp8_moe_kernel``; for our experts classes, vLLM's ``FusedMoEKernel`` of
        our prepare/finalize adapter and experts adapter."""
        from vllm_moe_fixes.integrations.vllm import experts as adapters

        if not (isinstance(experts_cls, type) and issubclass(experts_cls, adapters.VllmExperts)):
            return vllm_make(moe_quant_config=moe_quant_config, moe_config=moe_config,
                             experts_cls=experts_cls, fp8_backend=fp8_backend,
                             routing_tables=routing_tables, **kwargs)
        return make_kernel(moe_quant_config, moe_config, experts_cls, routing_tables)

    make_fp8_moe_kernel._vllm_moe_fixes = True
    return make_fp8_moe_kernel


def make_kernel(moe_quant_config, moe_config, experts_cls, routing_tables=None):
    """vLLM's ``FusedMoEKernel(prepare_finalize, experts)`` with this library's classes for one
    layer, the prepare/finalize chosen by vLLM's parallel config; logs which classes it got.

    Arguments: vLLM's ``FusedMoEQuantConfig`` and ``FusedMoEConfig`` of the layer, one of our
    experts adapter classes, and vLLM's routing tables (None; EPLB / round-robin ones raise).
    """
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk

    pf = make_prepare_finalize(moe_config, routing_tables)
    if experts_cls.batched:
        experts = experts_cls(moe_config, moe_quant_config,
                              max_num_tokens=pf.max_num_tokens_per_rank(),
                              num_dispatchers=pf.num_dispatchers())
    else:
        experts = experts_cls(moe_config, moe_quant_config)
    kernel = mk.FusedMoEKernel(pf, experts)
    logger.info("vllm_moe_fixes: FusedMoE layer (%d experts, %d local, hidden %d, intermediate "
                "%d, top-%d) runs vllm_moe_fixes %s + %s", moe_config.num_experts,
                moe_config.num_local_experts, moe_config.hidden_dim,
                moe_config.intermediate_size_per_partition, moe_config.experts_per_token,
                type(pf).__name__, type(experts).__name__)
    return kernel


def make_prepare_finalize(moe_config, routing_tables=None):
    """Our prepare/finalize adapter for the all-to-all vLLM's parallel config asks for: none
    (one rank, or expert parallelism inside tensor parallelism), DeepEP high-throughput or
    low-latency over the buffer of vLLM's EP-group all2all manager."""
    from vllm_moe_fixes.integrations.vllm import prepare_finalize as pfs

    cfg = moe_config.moe_parallel_config
    if not cfg.use_all2all_kernels:
        return pfs.VllmNoEPPrepareAndFinalize()
    from vllm_moe_fixes.integrations.vllm import data_parallel  # DP + EP on CPU: its module
    if data_parallel.takes_over(cfg):
        return data_parallel.make_data_parallel_prepare_finalize(moe_config)
    from vllm.distributed import get_ep_group

    manager = get_ep_group().device_communicator.all2all_manager
    if cfg.use_deepep_ht_kernels:
        return pfs.VllmDeepEPHTPrepareAndFinalize(
            manager.get_handle({}), num_dispatchers=manager.world_size,
            rank_expert_offset=manager.rank * moe_config.num_local_experts,
            hidden=moe_config.hidden_dim, num_experts=moe_config.num_experts)
    if cfg.use_deepep_ll_kernels:
        tables = routing_tables if routing_tables is not None else (None, None, None)
        buffer = manager.get_handle(dict(
            max_num_tokens_per_dp_rank=moe_config.max_num_tokens,
            token_hidden_size=moe_config.hidden_dim, num_ep_ranks=manager.world_size,
            num_global_experts=moe_config.num_experts,
            num_local_experts=moe_config.num_experts // manager.world_size))
        return pfs.VllmDeepEPLLPrepareAndFinalize(
            buffer, max_tokens_per_rank=moe_config.max_num_tokens,
            num_dispatchers=manager.world_size, hidden=moe_config.hidden_dim,
            num_experts=moe_config.num_experts, global_to_physical=tables[0],
            physical_to_global=tables[1], local_expert_global_ids=tables[2])
    if getattr(cfg, "use_deepep_v2_kernels", False):  # vLLM 0.32 and later
        buffer = manager.get_handle(dict(
            num_max_tokens_per_rank=moe_config.max_num_tokens, hidden=moe_config.hidden_dim,
            num_topk=moe_config.experts_per_token, num_experts=moe_config.num_experts,
            use_fp8_dispatch=True))
        return pfs.VllmDeepEPV2PrepareAndFinalize(
            buffer, num_dispatchers=manager.world_size,
            rank_expert_offset=manager.rank * moe_config.num_local_experts,
            max_tokens_per_rank=moe_config.max_num_tokens, do_cpu_sync=_engine_runs_eagerly())
    raise ValueError(f"all2all_backend={cfg.all2all_backend!r} has no vllm_moe_fixes "
                     "prepare/finalize (the selector leaves such layers to vLLM)")


def _engine_runs_eagerly() -> bool:
    """True unless vLLM's current config (set by vLLM around the layer's build, as its own
    deepep_v2 path reads it) captures CUDA graphs (enforce_eager False): DeepEP V2 then
    dispatches without the CPU sync, which a capture cannot take. Without a model config, True."""
    from vllm.config import get_current_vllm_config

    model_config = getattr(get_current_vllm_config(), "model_config", None)
    return model_config is None or bool(model_config.enforce_eager)
