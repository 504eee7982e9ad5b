"""vLLM's FusedMoEKernel running this library's prepare/finalize and experts (the adapters of
vllm_moe_fixes.integrations.vllm) against our own FusedMoEModularKernel: bit for bit on CPU, where
both take the same torch references. Also the adapters' mappings (N = 2I, finalize's reduction,
ids) and their refusals. Skipped where vllm does not import."""

import math

import pytest
import torch

pytest.importorskip("vllm")

import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (  # noqa: E402
    FusedMoEConfig,
    FusedMoEParallelConfig,
    RoutingMethodType,
    fp8_w8a8_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (  # noqa: E402
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNaiveBatched,
    TopKWeightAndReduceNoOP,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (  # noqa: E402
    kFp8Dynamic128Sym,
    kFp8DynamicTensorSym,
    kFp8Static128BlockSym,
    kFp8StaticTensorSym,
)

from vllm_moe_fixes.fused_moe import (  # noqa: E402
    FusedMoEModularKernel,
    NoEPPrepareAndFinalize,
    TritonExperts,
    fused_topk,
)
from vllm_moe_fixes.integrations.vllm import (  # noqa: E402
    VllmBatchedTritonExperts,
    VllmDeepEPLLPrepareAndFinalize,
    VllmNoEPPrepareAndFinalize,
    VllmTritonExperts,
)
from vllm_moe_fixes.integrations.vllm.support import vllm_rounds_scales_to_ue8m0  # noqa: E402
from vllm_moe_fixes.testing import random_fp8_moe_weights  # noqa: E402

K, I = 256, 128


def our_no_ep() -> NoEPPrepareAndFinalize:
    """Our one-rank prepare/finalize as the adapter builds it: activation scales as vLLM decides
    (power-of-two where DeepGEMM's E8M0 is usable, as on a GPU machine; exact on CPU)."""
    return NoEPPrepareAndFinalize(use_ue8m0=vllm_rounds_scales_to_ue8m0())


def exact_scales_in_vllm() -> None:
    """vLLM's E8M0 decision off in this process (a rank's). vLLM's low-latency path rounds the
    experts' requant only (its dispatch keeps exact scales), a mix our kernel's one decision does
    not build, so the low-latency comparisons with our kernel run with exact scales."""
    from vllm.utils import deep_gemm
    deep_gemm.is_deep_gemm_e8m0_used = lambda: False


def init_workspace_manager() -> None:
    """vLLM's process-wide WorkspaceManager, once. vLLM's kernel takes its workspaces from it on
    every platform but the CPU (an engine's model runner makes it; a test has to): on a GPU
    machine on the GPU, as the engine does, whatever device a test's inputs are on."""
    from vllm.platforms import current_platform
    from vllm.v1.worker import workspace
    if current_platform.is_cpu() or workspace.is_workspace_manager_initialized():
        return
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    workspace.init_workspace_manager(device)


def init_one_rank_vllm(device):
    """Inside the current vLLM config: vLLM's world of one rank (gloo on the CPU, NCCL on a GPU)
    and its workspace manager; returns the block-FP8 ``Fp8Config`` of the layers the tests build."""
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    parallel_state.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo" if device == "cpu" else "nccl")
    parallel_state.initialize_model_parallel(1, 1)
    init_workspace_manager()  # vLLM's kernel takes its workspaces from it off the CPU
    return Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
                     weight_block_size=[128, 128])


@pytest.fixture(autouse=True)
def workspace_manager():
    init_workspace_manager()


def moe_config(E, k, local_experts=None, parallel=None, **changes):
    fields = dict(
        num_experts=E, experts_per_token=k, hidden_dim=K, intermediate_size=I,
        num_local_experts=local_experts or E, num_logical_experts=E,
        activation=MoEActivation.SILU, device="cpu", routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=parallel or FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16, intermediate_size_per_partition=I)
    return FusedMoEConfig(**{**fields, **changes})


def block_quant_config(w):
    return fp8_w8a8_moe_quant_config(w1_scale=w.w1_scale, w2_scale=w.w2_scale,
                                     block_shape=[128, 128])


def problem(M, E, k, seed, E_l=None):
    g = torch.Generator().manual_seed(seed)
    w = random_fp8_moe_weights(E_l or E, K, I, generator=g)
    x = torch.randn(M, K, generator=g).bfloat16()
    tw, ti = fused_topk(torch.randn(M, E, generator=g), k, renormalize=True)
    return w, x, tw, ti


def vllm_kernel(w, E, k, E_l=None):
    return mk.FusedMoEKernel(VllmNoEPPrepareAndFinalize(),
                             VllmTritonExperts(moe_config(E, k, E_l), block_quant_config(w)))


@pytest.mark.parametrize("M,E,k,ids_dtype", [(1, 8, 2, torch.int32), (37, 8, 2, torch.int64),
                                             (130, 16, 4, torch.int32), (5, 8, 1, torch.int64)])
def test_vllm_kernel_with_adapters_equals_ours(M, E, k, ids_dtype):
    w, x, tw, ti = problem(M, E, k, seed=M + E)
    ti = ti.to(ids_dtype)
    out = vllm_kernel(w, E, k).apply(x, w.w1, w.w2, tw, ti, MoEActivation.SILU, E, None, False)
    ours = FusedMoEModularKernel(our_no_ep(), TritonExperts())(
        x, w.w1, w.w2, tw, ti, w1_scale=w.w1_scale, w2_scale=w.w2_scale, global_num_experts=E)
    assert out.dtype == torch.bfloat16 and out.shape == (M, K)
    assert out.abs().sum() > 0
    assert torch.equal(out, ours)


def test_expert_map_and_router_weight_on_input_equal_ours():
    """Expert parallelism inside tensor parallelism (vLLM's no-all-to-all EP): 4 of 8 experts
    local, global ids mapped by expert_map; and k = 1 with the weight applied on the input."""
    E, E_l, M = 8, 4, 23
    expert_map = torch.full((E,), -1, dtype=torch.int32)
    expert_map[4:] = torch.arange(E_l, dtype=torch.int32)
    for k, on_input in ((3, False), (1, True)):
        w, x, tw, ti = problem(M, E, k, seed=k, E_l=E_l)
        ti = ti.to(torch.int32)
        out = vllm_kernel(w, E, k, E_l).apply(x, w.w1, w.w2, tw, ti, MoEActivation.SILU, E,
                                              expert_map, on_input)
        ours = FusedMoEModularKernel(our_no_ep(), TritonExperts())(
            x, w.w1, w.w2, tw, ti, w1_scale=w.w1_scale, w2_scale=w.w2_scale,
            global_num_experts=E, expert_map=expert_map, apply_router_weight_on_input=on_input)
        assert out.abs().sum() > 0
        assert torch.equal(out, ours)


def test_one_rank_adapter_leaves_the_input_quant_to_our_contiguous_experts():
    """Built into vLLM's kernel with our contiguous experts, the one-rank adapter defers the
    quant (they ask for bf16 input through expects_unquantized_inputs, vLLM passes that to
    prepare): prepare hands a1 on, no scales, and the layer's output keeps its bits. Paired
    with other experts it quantises, and a defer_input_quant that disagrees with it is
    refused."""
    M, E, k = 11, 8, 2
    w, x, tw, ti = problem(M, E, k, seed=21)
    qc = block_quant_config(w)
    kernel = vllm_kernel(w, E, k)
    pf, ex = kernel.prepare_finalize, kernel.fused_experts
    assert ex.expects_unquantized_inputs and pf.ours.defer_input_quant
    a1q, a1q_scale, *rest = pf.prepare(x, tw, ti, E, None, False, qc, True)
    assert a1q is x and a1q_scale is None and rest == [None, None, None]
    with pytest.raises(ValueError, match="defer_input_quant=False.*leaves the input quant"):
        pf.prepare(x, tw, ti, E, None, False, qc, False)
    out = kernel.apply(x, w.w1, w.w2, tw, ti, MoEActivation.SILU, E, None, False)
    ours = FusedMoEModularKernel(our_no_ep(), TritonExperts())(
        x, w.w1, w.w2, tw, ti, w1_scale=w.w1_scale, w2_scale=w.w2_scale, global_num_experts=E)
    assert out.abs().sum() > 0 and torch.equal(out, ours)
    # experts that take FP8 input only (ours batched; vLLM's own) leave the quant to prepare
    other = VllmNoEPPrepareAndFinalize()
    batched = VllmBatchedTritonExperts(moe_config(E, k), qc, max_num_tokens=16,
                                       num_dispatchers=1)
    for experts in (batched, object()):
        other.post_init_setup(experts)
        assert not other.ours.defer_input_quant
    assert not batched.expects_unquantized_inputs
    a1q, a1q_scale, *_ = other.prepare(x, tw, ti, E, None, False, qc, False)
    assert a1q.dtype == torch.float8_e4m3fn and a1q_scale.shape == (M, K // 128)


def test_experts_caches_follow_new_weights_shapes_and_chunk_size(monkeypatch):
    """What the experts adapter keeps between calls (the weights checked once per set, the
    workspace shapes by size) follows a layer whose weights, scales or token count change, and a
    new VLLM_FUSED_MOE_CHUNK_SIZE: each call equals our kernel on the same inputs."""
    E, k = 8, 2
    g = torch.Generator().manual_seed(31)
    w = random_fp8_moe_weights(E, K, I, generator=g)
    qc = block_quant_config(w)
    ex = VllmTritonExperts(moe_config(E, k), qc)
    kernel = mk.FusedMoEKernel(VllmNoEPPrepareAndFinalize(), ex)
    ours = FusedMoEModularKernel(our_no_ep(), TritonExperts())

    def check(w, M):
        x = torch.randn(M, K, generator=g).bfloat16()
        tw, ti = fused_topk(torch.randn(M, E, generator=g), k, renormalize=True)
        got = kernel.apply(x, w.w1, w.w2, tw, ti, MoEActivation.SILU, E, None, False)
        want = ours(x, w.w1, w.w2, tw, ti, w1_scale=w.w1_scale, w2_scale=w.w2_scale,
                    global_num_experts=E)
        assert want.abs().sum() > 0 and torch.equal(got, want)

    check(w, 9)
    other = random_fp8_moe_weights(E, K, I, generator=g)  # new weights, the same scales
    check(type(w)(other.w1, w.w1_scale, other.w2, w.w2_scale), 9)
    # new scales in the quant config vLLM hands the experts (the weights it had before)
    ex.quant_config = block_quant_config(other)
    check(type(w)(w.w1, other.w1_scale, w.w2, other.w2_scale), 9)
    with pytest.raises(ValueError, match="w1_scale"):  # scales checked again: a wrong shape
        ex.quant_config = fp8_w8a8_moe_quant_config(
            w1_scale=other.w1_scale[:, :1], w2_scale=other.w2_scale, block_shape=[128, 128])
        check(type(w)(w.w1, other.w1_scale[:, :1], w.w2, other.w2_scale), 9)
    ex.quant_config = qc
    check(w, 30)  # another token count: other workspace shapes
    assert len({shapes for shapes in ex._shapes.values()}) == 2
    monkeypatch.setenv("VLLM_FUSED_MOE_CHUNK_SIZE", "8")  # 30 tokens now in 4 passes
    check(w, 30)
    assert ex.workspace_shapes(30, 2 * I, K, k, E, E, None, MoEActivation.SILU) == \
        TritonExperts().workspace_shapes(30, I, K, k, E, experts_pass_tokens=8)


def test_moe_problem_size_is_vllms():
    """The standard-layout experts' moe_problem_size answers what vLLM's generic one does, and
    refuses ids with another row count than a1."""
    M, E, k = 7, 8, 3
    w, x, tw, ti = problem(M, E, k, seed=4)
    ex = VllmTritonExperts(moe_config(E, k), block_quant_config(w))
    want = mk.FusedMoEExpertsModular.moe_problem_size(ex, x, w.w1, w.w2, ti)
    assert ex.moe_problem_size(x, w.w1, w.w2, ti) == want == (E, M, 2 * I, K, k)
    with pytest.raises(ValueError, match="a row per token"):
        ex.moe_problem_size(x, w.w1, w.w2, ti[:-1])


def test_workspace_shapes_take_vllms_n_as_2i():
    w, *_ = problem(4, 8, 2, seed=0)
    ex = VllmTritonExperts(moe_config(8, 2), block_quant_config(w))
    got = ex.workspace_shapes(64, 2 * I, K, 2, 8, 8, None, MoEActivation.SILU)
    assert got == TritonExperts().workspace_shapes(64, I, K, 2, 8)
    assert got[2] == (64, K)  # the layer's output shape: vLLM lets the experts write it


def test_finalize_maps_weight_and_reduce_impl():
    """NoOP: the experts reduced (output copied unless it is the same tensor); Contiguous and
    Delegate: [M*k, K] rows summed with the weights in float32; others refused."""
    M, k = 6, 3
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(M * k, K, generator=g).bfloat16()
    tw = torch.rand(M, k, generator=g)
    ti = torch.randint(0, 8, (M, k), generator=g, dtype=torch.int32)
    want = (rows.float().view(M, k, K) * tw[..., None]).sum(1).bfloat16()
    pf = VllmNoEPPrepareAndFinalize()
    for impl in (TopKWeightAndReduceContiguous(), TopKWeightAndReduceDelegate()):
        out = torch.full((M, K), float("nan"), dtype=torch.bfloat16)
        pf.finalize(out, rows.clone(), tw, ti, False, impl)
        assert torch.equal(out, want)
    reduced = rows[:M].clone()
    out = torch.full((M, K), float("nan"), dtype=torch.bfloat16)
    pf.finalize(out, reduced, tw, ti, False, TopKWeightAndReduceNoOP())
    assert torch.equal(out, reduced)
    with pytest.raises(ValueError, match="NaiveBatched"):
        pf.finalize(out, rows, tw, ti, False, TopKWeightAndReduceNaiveBatched(rank=0))


def test_supports_declare_what_the_experts_serve():
    std = mk.FusedMoEActivationFormat.Standard
    batched = mk.FusedMoEActivationFormat.BatchedExperts
    cfg = moe_config(8, 2)
    block = (kFp8Static128BlockSym, kFp8Dynamic128Sym)
    ok, reason = VllmTritonExperts.is_supported_config(VllmTritonExperts, cfg, *block, std)
    assert ok, reason
    for keys in ((kFp8StaticTensorSym, kFp8DynamicTensorSym), (None, None)):
        ok, reason = VllmTritonExperts.is_supported_config(VllmTritonExperts, cfg, *keys, std)
        assert not ok and "quantization scheme" in reason
    ok, reason = VllmTritonExperts.is_supported_config(VllmTritonExperts, cfg, *block, batched)
    assert not ok
    gelu = moe_config(8, 2)
    gelu.activation = MoEActivation.GELU
    ok, reason = VllmTritonExperts.is_supported_config(VllmTritonExperts, gelu, *block, std)
    assert not ok and "activation" in reason
    # the batched experts serve vLLM's deepep_low_latency all-to-all only
    ok, reason = VllmBatchedTritonExperts.is_supported_config(VllmBatchedTritonExperts, cfg,
                                                              *block, batched)
    assert not ok and "parallel config" in reason
    assert not VllmTritonExperts._supports_shape(K + 64)


@pytest.mark.parametrize("change,match", [
    (dict(has_bias=True), "bias"),
    (dict(in_dtype=torch.float16), "float16"),
    (dict(moe_backend="triton"), "moe_backend"),
    (dict(intermediate_size=192, intermediate_size_per_partition=192), "multiples of 128"),
])
def test_unserved_reason_names_what_is_not_served(change, match):
    from vllm.config import VllmConfig, set_current_vllm_config
    with set_current_vllm_config(VllmConfig()):
        assert VllmTritonExperts.unserved_reason(moe_config(8, 2)) is None
        cfg = moe_config(8, 2, **change)
        assert match in VllmTritonExperts.unserved_reason(cfg)


def test_refusals_raise_before_running():
    w, x, tw, ti = problem(4, 8, 2, seed=3)
    per_tensor = fp8_w8a8_moe_quant_config(w1_scale=torch.ones(8), w2_scale=torch.ones(8))
    with pytest.raises(ValueError, match="block_shape"):
        VllmTritonExperts(moe_config(8, 2), per_tensor)
    qc = block_quant_config(w)
    pf = VllmNoEPPrepareAndFinalize()
    with pytest.raises(ValueError, match="defer_input_quant"):
        pf.prepare(x, tw, ti, 8, None, False, qc, True)
    with pytest.raises(ValueError, match="bfloat16"):
        pf.prepare(x.half(), tw, ti, 8, None, False, qc, False)
    with pytest.raises(ValueError, match="static activation scales"):
        pf.prepare(x, tw, ti, 8, None, False, fp8_w8a8_moe_quant_config(
            w1_scale=w.w1_scale, w2_scale=w.w2_scale, a1_scale=torch.ones(1),
            block_shape=[128, 128]), False)
    ex = VllmTritonExperts(moe_config(8, 2), qc)
    a1q, a1s, *_ = pf.prepare(x, tw, ti, 8, None, False, qc, False)
    ws = [torch.empty(s, dtype=torch.bfloat16) for s in ex.workspace_shapes(
        4, 2 * I, K, 2, 8, 8, None, MoEActivation.SILU)]
    # what vLLM fixes per layer is refused when the experts are built, not on each call
    with pytest.raises(ValueError, match="activation gelu"):
        VllmTritonExperts(moe_config(8, 2, activation=MoEActivation.GELU), qc)
    with pytest.raises(ValueError, match="static activation scales"):
        VllmTritonExperts(moe_config(8, 2), fp8_w8a8_moe_quant_config(
            w1_scale=w.w1_scale, w2_scale=w.w2_scale, a2_scale=torch.ones(1),
            block_shape=[128, 128]))
    with pytest.raises(ValueError, match="w1_scale"):  # weights of another layer's shape
        w4 = random_fp8_moe_weights(4, K, I)
        ex.apply(ws[2], a1q, w4.w1, w4.w2, tw, ti, MoEActivation.SILU, 8, None, a1s, None,
                 ws[0], ws[1], None, False)


def test_low_latency_refuses_routing_tables_and_a_small_buffer():
    from vllm_moe_fixes.distributed.deepep_sizing import deepep_ll_rdma_bytes

    class Buffer:  # what check_deepep_buffer reads of a deep_ep.Buffer
        group_size, low_latency_mode, num_nvl_bytes = 1, True, 0
        num_rdma_bytes = deepep_ll_rdma_bytes(128, 2048, 1, 8) - 1

        def low_latency_dispatch(self):
            pass

        def low_latency_combine(self):
            pass

    args = dict(max_tokens_per_rank=128, num_dispatchers=1, hidden=2048, num_experts=8)
    with pytest.raises(ValueError, match="routing tables"):
        VllmDeepEPLLPrepareAndFinalize(Buffer(), **args, global_to_physical=torch.arange(8))
    with pytest.raises(ValueError, match="num_rdma_bytes"):
        VllmDeepEPLLPrepareAndFinalize(Buffer(), **args)
    Buffer.num_rdma_bytes += 1
    VllmDeepEPLLPrepareAndFinalize(Buffer(), **args)
    with pytest.raises(ValueError, match="hidden=256"):  # no low-latency kernel for it
        VllmDeepEPLLPrepareAndFinalize(Buffer(), **{**args, "hidden": 256})
    # the rank count, read from the buffer in one place (buffer_rank_and_size)
    with pytest.raises(ValueError, match="num_dispatchers=2 but the buffer's group has 1 ranks"):
        VllmDeepEPLLPrepareAndFinalize(Buffer(), **{**args, "num_dispatchers": 2})


def _low_latency_parallel_config():
    """Rank 0 of 2 (DP = EP = 2) with vLLM's deepep_low_latency all-to-all: the batched layout."""
    return FusedMoEParallelConfig(
        tp_size=1, pcp_size=1, dp_size=2, ep_size=2, tp_rank=0, pcp_rank=0, dp_rank=0,
        ep_rank=0, sp_size=1, use_ep=True, all2all_backend="deepep_low_latency",
        enable_eplb=False)


@pytest.mark.parametrize("cls_name", ["VllmTritonExperts", "VllmDeepGemmExperts",
                                      "VllmBatchedTritonExperts", "VllmBatchedDeepGemmExperts"])
def test_every_adapter_answers_each_capability_question(cls_name, monkeypatch):
    """Every question vLLM's selector asks an experts class (is_supported_config, each
    _supports_*) and the plugin's unserved_reason, for each of the four adapters on a layer of
    its layout: an answer, never an exception. On a CPU the DeepGEMM classes answer False for the
    device, also when the platform claims CUDA and DeepGEMM does not import."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_moe_fixes.integrations.vllm import experts as adapters
    cls = getattr(adapters, cls_name)
    fmt = cls.activation_format()
    parallel = _low_latency_parallel_config() if cls.batched else None
    cfg = moe_config(8, 2, local_experts=4 if cls.batched else None, parallel=parallel,
                     max_num_tokens=64)  # 2 ranks x 64 = 128 rows per expert slice
    block = (kFp8Static128BlockSym, kFp8Dynamic128Sym)
    on_cpu = not torch.cuda.is_available()
    served, reason = cls.is_supported_config(cls, cfg, *block, fmt)
    if cls._needs_deep_gemm and on_cpu:
        assert not served and "current device" in reason
    else:
        assert served, reason
    assert cls._supports_current_device() is (served or not cls._needs_deep_gemm)
    assert cls._supports_no_act_and_mul() is False
    assert cls._supports_quant_scheme(*block) is True
    assert cls._supports_quant_scheme(kFp8StaticTensorSym, kFp8DynamicTensorSym) is False
    assert cls._supports_activation(MoEActivation.SILU) is True
    assert cls._supports_activation(MoEActivation.GELU) is False
    assert cls._supports_shape(K) is True and cls._supports_shape(K + 64) is False
    assert cls._supports_parallel_config(cfg.moe_parallel_config) is True
    other_layout = FusedMoEParallelConfig.make_no_parallel() if cls.batched \
        else _low_latency_parallel_config()
    assert cls._supports_parallel_config(other_layout) is False
    with set_current_vllm_config(VllmConfig()):
        assert cls.unserved_reason(cfg) is None
        assert "bias" in cls.unserved_reason(moe_config(8, 2, parallel=parallel, has_bias=True))
        if cls is adapters.VllmBatchedDeepGemmExperts:  # DeepGEMM's masked GEMM: 128-row slices
            odd = moe_config(8, 2, local_experts=4, parallel=parallel, max_num_tokens=48)
            assert "96 rows per expert slice is not a multiple of 128" in cls.unserved_reason(odd)
    if cls._needs_deep_gemm and on_cpu:  # a platform that says CUDA, DeepGEMM not importable
        monkeypatch.setattr(adapters.current_platform, "is_cuda", lambda: True)
        assert cls._supports_current_device() is False


@pytest.mark.parametrize("batched", [False, True])
def test_experts_compute_on_the_inputs_device_whatever_device_vllms_workspaces_are_on(batched):
    """vLLM's kernel takes the experts' workspaces (and the output, a view of them) from its
    WorkspaceManager, made for one device: off a CPU platform, CPU inputs get workspaces on
    that device (a GPU machine: CUDA). The adapter computes on the inputs' device in workspaces
    of its own and copies the output into vLLM's; 'meta' buffers stand in for the other device
    here: the result equals the call with CPU buffers, written into a CPU output."""
    E, k = 8, 2
    if batched:
        cfg = moe_config(E, k, local_experts=4, parallel=_low_latency_parallel_config(),
                         max_num_tokens=16)
        w = random_fp8_moe_weights(4, K, I, generator=torch.Generator().manual_seed(2))
        ex = VllmBatchedTritonExperts(cfg, block_quant_config(w), max_num_tokens=16,
                                      num_dispatchers=2)
        g = torch.Generator().manual_seed(3)
        a1q = torch.randn(4, 32, K, generator=g).to(torch.float8_e4m3fn)
        a1s = torch.rand(4, 32, K // 128, generator=g) + 0.5
        meta = mk.ExpertTokensMetadata(expert_num_tokens=torch.tensor([5, 0, 32, 1],
                                                                      dtype=torch.int32),
                                       expert_num_tokens_cpu=None)
        tw, ti = torch.rand(16, k, generator=g), torch.randint(0, E, (16, k), generator=g)
        shape_args = (32, 2 * I, K, k, E, 4, meta, MoEActivation.SILU)
    else:
        w, x, tw, ti = problem(9, E, k, seed=4)
        ex = VllmTritonExperts(moe_config(E, k), block_quant_config(w))
        a1q, a1s, *_ = VllmNoEPPrepareAndFinalize().prepare(x, tw, ti, E, None, False,
                                                            block_quant_config(w), False)
        meta, shape_args = None, (9, 2 * I, K, k, E, E, None, MoEActivation.SILU)
    ws13_shape, ws2_shape, out_shape = ex.workspace_shapes(*shape_args)

    def call(device, out):
        ws = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in (ws13_shape, ws2_shape)]
        ex.apply(out, a1q, w.w1, w.w2, tw, ti, MoEActivation.SILU, E, None, a1s, None, *ws, meta,
                 False)
        return out

    want = call("cpu", torch.full(out_shape, float("nan"), dtype=torch.bfloat16))
    got = call("meta", torch.full(out_shape, float("nan"), dtype=torch.bfloat16))
    if batched:  # the valid rows of each expert slice (the rest is undefined)
        rows = [slice(0, int(n)) for n in meta.expert_num_tokens]
        want = torch.cat([want[e, r] for e, r in enumerate(rows)])
        got = torch.cat([got[e, r] for e, r in enumerate(rows)])
    assert want.abs().sum() > 0
    assert torch.equal(got, want)
    elsewhere = call("meta", torch.empty(out_shape, dtype=torch.bfloat16, device="meta"))
    assert elsewhere.device.type == "meta"  # written by a copy, no error


def test_experts_reuse_their_views_when_vllm_hands_fresh_views_of_the_same_workspace():
    """vLLM's WorkspaceManager hands fresh views of one buffer on every call; our experts keep
    the views they carve on the workspace objects, so the adapter passes them the first views
    it got of the same memory and shapes. A new buffer (vLLM's grew) replaces the old views."""
    E, k = 8, 2
    w, x, tw, ti = problem(9, E, k, seed=6)
    ex = VllmTritonExperts(moe_config(E, k), block_quant_config(w))
    ex._workspaces_kept_by_vllm = True  # as on a GPU platform (vLLM allocates per call on CPU)
    a1q, a1s, *_ = VllmNoEPPrepareAndFinalize().prepare(x, tw, ti, E, None, False,
                                                        block_quant_config(w), False)
    shapes = ex.workspace_shapes(9, 2 * I, K, k, E, E, None, MoEActivation.SILU)
    handed = []
    ours_apply = ex.experts.apply
    ex.experts.apply = lambda *a, **kw: (handed.append((kw["workspace13"], kw["workspace2"])),
                                         ours_apply(*a, **kw))

    def call(buffer):  # what vLLM's get_simultaneous returns: fresh views of one buffer
        n13, n2 = (math.prod(s) for s in shapes[:2])
        ws13, ws2 = buffer[:n13].view(shapes[0]), buffer[n13:n13 + n2].view(shapes[1])
        out = torch.full(shapes[2], float("nan"), dtype=torch.bfloat16)
        ex.apply(out, a1q, w.w1, w.w2, tw, ti, MoEActivation.SILU, E, None, a1s, None, ws13, ws2,
                 None, False)
        return out

    size = sum(math.prod(s) for s in shapes[:2])
    first = torch.empty(size, dtype=torch.bfloat16)
    outs = [call(first), call(first)]
    assert handed[0][0] is handed[1][0] and handed[0][1] is handed[1][1]
    bigger = torch.empty(2 * size, dtype=torch.bfloat16)
    outs.append(call(bigger))
    assert handed[2][0].data_ptr() == bigger.data_ptr()
    assert all(v[0].untyped_storage().data_ptr() == bigger.data_ptr()
               for v in ex._workspace_views.values())  # the first buffer's views let go
    assert outs[0].abs().sum() > 0
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


class _PlatformNotCpu:
    """vLLM's current_platform as its FusedMoEKernel sees it on a GPU machine (not the CPU: the
    workspaces come from its WorkspaceManager), everything else passed through."""

    def __init__(self, platform):
        self._platform = platform

    def __getattr__(self, name):
        return getattr(self._platform, name)

    @staticmethod
    def is_cpu() -> bool:
        return False


def test_vllm_kernel_through_its_workspace_manager_equals_ours_over_many_calls(monkeypatch):
    """vLLM's FusedMoEKernel as on a GPU platform: both workspaces are fresh views of one buffer
    of its WorkspaceManager (poisoned before every call), which the adapter maps to the first
    views it got of the same memory and shapes. One layer called with M below, at and above
    VLLM_FUSED_MOE_CHUNK_SIZE (one pass, several passes whose views start at another offset of
    the same memory, a short last pass), top-1 and top-k, the router weight on the input, the
    buffer growing in between: bit-equal to our own kernel on the same inputs every call."""
    from vllm.v1.worker import workspace

    monkeypatch.setenv("VLLM_FUSED_MOE_CHUNK_SIZE", "48")
    monkeypatch.setattr(mk, "current_platform", _PlatformNotCpu(mk.current_platform))
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)  # none on a CPU machine
    manager = workspace.WorkspaceManager(torch.device("cpu"))
    monkeypatch.setattr(workspace, "_manager", manager)
    E = 8
    g = torch.Generator().manual_seed(11)
    w = random_fp8_moe_weights(E, K, I, generator=g)
    experts = VllmTritonExperts(moe_config(E, 1), block_quant_config(w))
    experts._workspaces_kept_by_vllm = True  # as on a GPU platform
    kernel = mk.FusedMoEKernel(VllmNoEPPrepareAndFinalize(), experts)
    ours = FusedMoEModularKernel(our_no_ep(), TritonExperts())
    calls = [(40, 1, False), (97, 1, False), (48, 2, False), (97, 1, False), (96, 1, True),
             (45, 2, False), (200, 2, False), (97, 1, False), (49, 1, True), (1, 2, False)]
    for M, k, on_input in calls:
        x = torch.randn(M, K, generator=g).bfloat16()
        tw, ti = fused_topk(torch.randn(M, E, generator=g), k, renormalize=k > 1)
        ti = ti.to(torch.int32)
        want = ours(x, w.w1, w.w2, tw, ti, w1_scale=w.w1_scale, w2_scale=w.w2_scale,
                    global_num_experts=E, apply_router_weight_on_input=on_input)
        for buffer in manager._current_workspaces:
            if buffer is not None:
                buffer.fill_(0xFF)  # bf16 NaN in every element of both workspaces
        got = kernel.apply(x, w.w1, w.w2, tw, ti, MoEActivation.SILU, E, None, on_input)
        assert want.abs().sum() > 0 and not got.isnan().any(), (M, k, on_input)
        assert torch.equal(got, want), (M, k, on_input)
    assert len(experts._workspace_views) > 1  # several calls reused views of the same memory
