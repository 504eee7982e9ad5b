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

The plugin decides no wiring: it maps vLLM's names onto the library's factory
(``fused_moe.kernel_factory``, ``fused_moe.experts_selection``), which decides for this library
and for vLLM alike. vLLM's parallel config -> our backend name (no all-to-all,
``deepep_high_throughput``, ``deepep_low_latency``, ``deepep_v2``; ``naive`` for the
data-parallel EP layers on CPU that ``data_parallel.py`` takes over); the factory's
``prepare_finalize_wiring`` -> our prepare/finalize class and its arguments, over the buffer
vLLM's all2all manager built (our DeepEP adapters check it against DeepEP's rules before the
first forward) or, for ``naive``, our ``TorchAll2AllBuffer`` on the gloo group of vLLM's EP
group; ``experts_for_format`` -> our experts class (layout, VLLM_USE_DEEP_GEMM); then our class
-> its adapter (``ADAPTER_OF_PREPARE_FINALIZE``, ``ADAPTER_OF_EXPERTS``). Other quantisation
methods that import the selector (modelopt, compressed-tensors, online FP8) keep vLLM's kernels.
vLLM 0.26 passes ``layer=`` to ``make_fp8_moe_kernel``: extra keywords pass through to vLLM's
function.
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
    The library's factory picks our experts class (``experts_for_format``: the layout vLLM's
    parallel config implies, VLLM_USE_DEEP_GEMM); this maps it to its adapter. With
    VLLM_USE_DEEP_GEMM=1 and DeepGEMM not usable here, raises what the factory raises
    (MissingLibraryError, an ImportError, naming VLLM_USE_DEEP_GEMM and DeepGEMM; RuntimeError on
    a GPU other than SM90) instead of silently running Triton.
    """
    from vllm_moe_fixes.fused_moe import ActivationFormat, experts_for_format
    from vllm_moe_fixes.integrations.vllm.experts import ADAPTER_OF_EXPERTS
    from vllm_moe_fixes.integrations.vllm.versions import uses_batched_activation_format

    batched = uses_batched_activation_format(config)
    ours = experts_for_format(
        ActivationFormat.BATCHED if batched else ActivationFormat.STANDARD,
        config.intermediate_size_per_partition, config.hidden_dim)
    cls = ADAPTER_OF_EXPERTS[type(ours)]
    ok, reason = cls.is_supported_config(cls, config, weight_key, activation_key,
                                         cls.activation_format())
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
    experts adapter classes, and vLLM's routing tables (None, also under EPLB; round-robin
    placement's raise).
    """
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk

    pf = prepare_finalize_adapter(moe_config, routing_tables)
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


def prepare_finalize_adapter(moe_config, routing_tables=None):
    """Our prepare/finalize adapter for the all-to-all vLLM's parallel config asks for: the
    library's factory (``prepare_finalize_wiring``) picks the class and its arguments from our
    backend name, the buffer and vLLM's numbers; this maps the names (``_backend_of``,
    ``ADAPTER_OF_PREPARE_FINALIZE``) and supplies the buffer (``_all2all_buffer``). vLLM's
    routing tables (built for round-robin placement only) are refused: ours place expert g on
    rank g // E_l (under EPLB, physical expert p on rank p // E_l)."""
    from vllm_moe_fixes.fused_moe import kernel_factory
    from vllm_moe_fixes.integrations.vllm.prepare_finalize import ADAPTER_OF_PREPARE_FINALIZE
    from vllm_moe_fixes.integrations.vllm.support import check_no_routing_tables

    check_no_routing_tables(routing_tables)
    cfg = moe_config.moe_parallel_config
    if not cfg.use_all2all_kernels:
        wiring = kernel_factory.prepare_finalize_wiring(None, num_experts=moe_config.num_experts)
        return ADAPTER_OF_PREPARE_FINALIZE[wiring.cls].for_vllm_layer(moe_config, None,
                                                                      **wiring.kwargs)
    from vllm.distributed import get_ep_group

    backend = _backend_of(cfg)
    ep_group = get_ep_group()
    buffer = _all2all_buffer(backend, moe_config, ep_group)
    wiring = kernel_factory.prepare_finalize_wiring(
        backend, num_ranks=ep_group.world_size, rank=ep_group.rank_in_group,
        num_experts=moe_config.num_experts, max_tokens_per_rank=moe_config.max_num_tokens,
        low_latency=not _engine_runs_eagerly() if backend == "deepep_v2" else None,
        buffer=buffer)
    return ADAPTER_OF_PREPARE_FINALIZE[wiring.cls].for_vllm_layer(moe_config, buffer,
                                                                  **wiring.kwargs)


# vLLM's all2all flags (FusedMoEParallelConfig) -> our backend names.
_BACKEND_OF_FLAG = (("use_deepep_ht_kernels", "deepep_high_throughput"),
                    ("use_deepep_ll_kernels", "deepep_low_latency"),
                    ("use_deepep_v2_kernels", "deepep_v2"))  # vLLM 0.32 and later


def _backend_of(cfg) -> str:
    """Our backend name for vLLM's all2all flags, or ``naive`` (our torch.distributed
    all-to-all) for the data-parallel EP config ``data_parallel`` takes over; ValueError for a
    config we have no name for, or where that take-over does not hold (with its reason)."""
    from vllm_moe_fixes.integrations.vllm import data_parallel

    for flag, backend in _BACKEND_OF_FLAG:
        if getattr(cfg, flag, False):
            return backend
    if data_parallel.takes_over(cfg):
        problem = data_parallel.dp_ep_problem(cfg)
        if problem is not None:
            raise ValueError(f"vllm_moe_fixes data parallel + EP: {problem}")
        return "naive"
    raise ValueError(f"all2all_backend={cfg.all2all_backend!r} has no vllm_moe_fixes "
                     "prepare/finalize (the selector leaves such layers to vLLM)")


def _all2all_buffer(backend: str, moe_config, ep_group):
    """The buffer our prepare/finalize runs over, on vLLM's EP group (``GroupCoordinator``):
    for ``naive``, the library's ``TorchAll2AllBuffer`` on the group's gloo group
    (``make_all2all_buffer``: one per group and sizes, the layers share it); for DeepEP, the
    one vLLM's all2all manager builds, asked as vLLM's own DeepEP paths ask it."""
    if backend == "naive":
        from vllm_moe_fixes.distributed import make_all2all_buffer

        return make_all2all_buffer(backend, ep_group.cpu_group,
                                   max_tokens_per_rank=moe_config.max_num_tokens,
                                   hidden=moe_config.hidden_dim,
                                   num_experts=moe_config.num_experts)
    manager = ep_group.device_communicator.all2all_manager
    return manager.get_handle(_buffer_request(backend, moe_config, ep_group.world_size))


def _buffer_request(backend: str, moe_config, num_ranks: int) -> dict:
    """The arguments vLLM's all2all manager takes in ``get_handle`` for ``backend``'s buffer
    (as vLLM's own DeepEP paths ask it)."""
    if backend == "deepep_low_latency":
        return dict(max_num_tokens_per_dp_rank=moe_config.max_num_tokens,
                    token_hidden_size=moe_config.hidden_dim, num_ep_ranks=num_ranks,
                    num_global_experts=moe_config.num_experts,
                    num_local_experts=moe_config.num_experts // num_ranks)
    if backend == "deepep_v2":
        return dict(num_max_tokens_per_rank=moe_config.max_num_tokens,
                    hidden=moe_config.hidden_dim, num_topk=moe_config.experts_per_token,
                    num_experts=moe_config.num_experts, use_fp8_dispatch=True)
    return {}


def _engine_runs_eagerly() -> bool:
    """True unless vLLM's current config (set by vLLM around the layer's build, as its own
    deepep_v2 path reads it) captures CUDA graphs (enforce_eager False): DeepEP V2 then
    dispatches without the CPU sync, which a capture cannot take. Without a model config, True."""
    from vllm.config import get_current_vllm_config

    model_config = getattr(get_current_vllm_config(), "model_config", None)
    return model_config is None or bool(model_config.enforce_eager)
