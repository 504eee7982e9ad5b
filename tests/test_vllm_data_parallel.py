"""The data parallel + EP take-over without an engine: which parallel configs it takes over and
refuses (with the reason), the runner's forward it rebinds, and the plugin's wiring of such a
layer (vLLM's allgather_reducescatter -> our naive backend -> the factory's high-throughput
prepare/finalize over the library's TorchAll2AllBuffer on the EP group's gloo group) inside vLLM's
FusedMoEKernel on 2 gloo ranks: bit-equal to our own modular kernel, with skewed routing that
sends one rank every token of both, taken in passes of VLLM_FUSED_MOE_CHUNK_SIZE (logged with the
workspace bytes). The engine test is tests/test_vllm_dp_ep.py. Skipped without vllm."""

import logging
import types

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("vllm")

from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig  # noqa: E402
from vllm.model_executor.layers.fused_moe.runner import moe_runner  # noqa: E402

from _dist import run_distributed  # noqa: E402
from test_vllm_adapters import block_quant_config, moe_config  # noqa: E402
from vllm_moe_fixes.distributed import TorchAll2AllBuffer  # noqa: E402
from vllm_moe_fixes.distributed.buffers import clear_all2all_buffers  # noqa: E402
from vllm_moe_fixes.fused_moe import (  # noqa: E402
    DeepEPHTPrepareAndFinalize,
    FusedMoEModularKernel,
    TritonExperts,
)
from vllm_moe_fixes.integrations.vllm import data_parallel, plugin  # noqa: E402
from vllm_moe_fixes.integrations.vllm.experts import VllmTritonExperts  # noqa: E402
from vllm_moe_fixes.integrations.vllm.support import parallel_config_problem  # noqa: E402
from vllm_moe_fixes.sizes import contiguous_workspace_shapes  # noqa: E402
from vllm_moe_fixes.testing import Fp8MoEWeights, random_fp8_moe_weights  # noqa: E402

E, K, I, TOPK, CHUNK = 8, 256, 128, 2, 16


def parallel(*, dp=2, tp=1, pcp=1, backend="allgather_reducescatter", use_ep=True, rank=0):
    return FusedMoEParallelConfig(
        tp_size=tp, pcp_size=pcp, dp_size=dp, ep_size=dp * tp if use_ep else 1, tp_rank=0,
        pcp_rank=0, dp_rank=rank, ep_rank=rank, sp_size=tp if dp > 1 and tp > 1 else 1,
        use_ep=use_ep, all2all_backend=backend, enable_eplb=False)


def test_takes_over_data_parallel_ep_on_cpu_and_says_why_not_elsewhere(monkeypatch):
    served = parallel()
    assert data_parallel.takes_over(served) and data_parallel.dp_ep_problem(served) is None
    assert parallel_config_problem(served, batched=False) is None  # the selector serves it
    assert "batched" in parallel_config_problem(served, batched=True)
    assert "tensor parallel 2" in data_parallel.dp_ep_problem(parallel(tp=2))
    assert "tensor parallel 2" in parallel_config_problem(parallel(tp=2), batched=False)
    assert "prefill context parallel 2" in data_parallel.dp_ep_problem(parallel(pcp=2))
    # not this module's: other backends, DP without EP, one rank
    for cfg in (parallel(backend="deepep_high_throughput"), parallel(use_ep=False),
                parallel(dp=1)):
        assert not data_parallel.takes_over(cfg)
    monkeypatch.setattr(data_parallel.current_platform, "is_cpu", lambda: False)
    assert "CPU only" in data_parallel.dp_ep_problem(served)


def test_register_routes_served_layers_through_vllms_opaque_op(monkeypatch):
    vllm_select = moe_runner.MoERunner._select_forward
    monkeypatch.setattr(moe_runner.MoERunner, "_select_forward", vllm_select)  # restored after
    data_parallel.register()
    data_parallel.register()  # once per process: the second call rebinds nothing
    select = moe_runner.MoERunner._select_forward
    assert select is not vllm_select and select.__closure__[0].cell_contents is vllm_select

    def runner(cfg, shared=None):
        return types.SimpleNamespace(moe_config=types.SimpleNamespace(moe_parallel_config=cfg),
                                     _shared_experts=shared)

    assert select(runner(parallel())) is torch.ops.vllm.moe_forward
    assert select(runner(parallel(), shared=object())) is torch.ops.vllm.moe_forward_shared
    assert select(runner(parallel(tp=2))) is vllm_select(runner(parallel(tp=2)))  # not ours
    assert select(runner(parallel(dp=1))) is moe_runner._moe_forward  # vLLM's CPU choice


def test_the_plugin_names_it_naive_and_refuses_where_it_does_not_hold(monkeypatch):
    """The name map answers our naive backend for the config taken over, and the take-over's
    reason, as a ValueError, where it does not hold (before vLLM's EP group is asked for)."""
    import vllm.distributed

    assert plugin._backend_of(parallel()) == "naive"
    monkeypatch.setattr(vllm.distributed, "get_ep_group", lambda: pytest.fail("group asked"))
    with pytest.raises(ValueError, match="data parallel \\+ EP: tensor parallel 2 inside"):
        plugin.prepare_finalize_adapter(moe_config(E, TOPK, E // 4, parallel=parallel(tp=2)))
    monkeypatch.setattr(data_parallel.current_platform, "is_cpu", lambda: False)
    with pytest.raises(ValueError, match="data parallel \\+ EP: allgather_reducescatter on"):
        plugin.prepare_finalize_adapter(moe_config(E, TOPK, E // 2, parallel=parallel()))


def _skewed_problem(rank, world, M):
    """This rank's tokens, all routed to experts of the last rank, and its weight slice."""
    e_l = E // world
    w = random_fp8_moe_weights(E, K, I, generator=torch.Generator().manual_seed(5))
    sl = slice(rank * e_l, (rank + 1) * e_l)
    local = Fp8MoEWeights(*(t[sl].contiguous() for t in w))
    expert_map = torch.full((E,), -1, dtype=torch.int32)
    expert_map[sl] = torch.arange(e_l, dtype=torch.int32)
    g = torch.Generator().manual_seed(40 + rank)
    x = torch.randn(M, K, generator=g).bfloat16()
    last = torch.randperm(e_l, generator=g)[:TOPK] + E - e_l
    ti = last.repeat(M, 1).to(torch.int64)
    tw = torch.softmax(torch.randn(M, TOPK, generator=g), -1)
    return x, tw, ti, local, expert_map


def _in_vllms_kernel(rank, world):
    """vLLM's FusedMoEKernel as the plugin builds it for rank ``rank`` of a DP + EP layer whose EP
    group is this gloo world, against our own modular kernel on the same inputs."""
    import os

    import vllm.distributed

    os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = str(CHUNK)
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    plugin.logger.addHandler(handler)
    plugin.logger.setLevel(logging.INFO)
    ep_group = types.SimpleNamespace(world_size=world, rank_in_group=rank,
                                     cpu_group=dist.group.WORLD)
    vllm.distributed.get_ep_group = lambda: ep_group  # this forked rank's vLLM only
    M = (40, 37)
    x, tw, ti, local, expert_map = _skewed_problem(rank, world, M[rank])
    e_l = E // world
    layer = moe_config(E, TOPK, e_l, parallel=parallel(dp=world, rank=rank))
    kernel = plugin.make_kernel(block_quant_config(local), layer, VllmTritonExperts)
    pf = kernel.prepare_finalize
    wiring = (type(pf).__name__, type(pf.ours.buffer).__name__, pf.ours.buffer.group,
              pf.ours.rank_expert_offset, pf.num_dispatchers())
    shared = plugin.prepare_finalize_adapter(layer).ours.buffer is pf.ours.buffer  # a second layer
    out = kernel.apply(x, local.w1, local.w2, tw, ti, MoEActivation.SILU, E, expert_map, False)
    ours = FusedMoEModularKernel(
        DeepEPHTPrepareAndFinalize(TorchAll2AllBuffer(None), num_dispatchers=world,
                                   rank_expert_offset=rank * e_l, use_ue8m0=pf.ours.use_ue8m0),
        TritonExperts())(
        x, local.w1, local.w2, tw, ti, w1_scale=local.w1_scale, w2_scale=local.w2_scale,
        global_num_experts=E, expert_map=expert_map, max_tokens_across_ranks=max(M))
    clear_all2all_buffers()
    return dict(wiring=wiring == ("VllmDeepEPHTPrepareAndFinalize", "TorchAll2AllBuffer",
                                  dist.group.WORLD, rank * e_l, world),
                shared=shared, equal=torch.equal(out, ours), nonzero=bool(out.abs().sum() > 0),
                received=[m for m in messages if "received" in m])


def test_in_vllms_kernel_equals_ours_and_logs_the_bounded_workspaces():
    results = run_distributed(_in_vllms_kernel, 2)
    for got in results:
        assert got["wiring"] and got["shared"] and got["equal"] and got["nonzero"], got
    assert results[0]["received"] == []  # rank 0 received nothing: no workspaces to log
    (message,) = results[1]["received"]  # rank 1 received all 77 tokens, in passes of CHUNK
    ws13, ws2, out = contiguous_workspace_shapes(77, I, K, TOPK, E // 2)  # one pass, no bound
    unbounded = 2 * (max(ws13[0] * ws13[1], out[0] * out[1]) + ws2[0] * ws2[1])
    got = int(message.split("workspaces ")[1].split(" bytes")[0])
    assert "rank 1 received 77 tokens" in message and "5 pass(es) of at most 16" in message
    assert got < unbounded, (got, unbounded)
