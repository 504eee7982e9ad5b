"""integrations/vllm/data_parallel.py without an engine: which parallel configs it takes over and
refuses (with the reason), the runner's forward it rebinds, and VllmDataParallelPrepareAndFinalize
inside vLLM's FusedMoEKernel on 2 gloo ranks: bit-equal to our own modular kernel, with skewed
routing that sends one rank every token of both, taken in passes of VLLM_FUSED_MOE_CHUNK_SIZE
(logged with the workspace bytes). The engine test is tests/test_vllm_dp_ep.py. Skipped without
vllm."""

import logging
import types

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("vllm")

import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig  # noqa: E402
from vllm.model_executor.layers.fused_moe.runner import moe_runner  # noqa: E402

from _dist import run_distributed  # noqa: E402
from test_vllm_adapters import block_quant_config, moe_config  # noqa: E402
from vllm_moe_fixes.distributed import TorchAll2AllBuffer  # noqa: E402
from vllm_moe_fixes.fused_moe import (  # noqa: E402
    DeepEPHTPrepareAndFinalize,
    FusedMoEModularKernel,
    TritonExperts,
)
from vllm_moe_fixes.integrations.vllm import data_parallel  # noqa: E402
from vllm_moe_fixes.integrations.vllm.experts import VllmTritonExperts  # noqa: E402
from vllm_moe_fixes.integrations.vllm.support import parallel_config_problem  # noqa: E402
from vllm_moe_fixes.sizes import contiguous_workspace_shapes  # noqa: E402
from vllm_moe_fixes.testing import Fp8MoEWeights, random_fp8_moe_weights  # noqa: E402

E, K, I, TOPK, CHUNK = 8, 256, 128, 2, 16


def parallel(*, dp=2, tp=1, pcp=1, backend="allgather_reducescatter", use_ep=True):
    return FusedMoEParallelConfig(
        tp_size=tp, pcp_size=pcp, dp_size=dp, ep_size=dp * tp if use_ep else 1, tp_rank=0,
        pcp_rank=0, dp_rank=0, ep_rank=0, sp_size=tp if dp > 1 and tp > 1 else 1,
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


def test_refuses_an_expert_count_the_group_cannot_split():
    group = types.SimpleNamespace(world_size=3, rank_in_group=0, cpu_group=None)
    with pytest.raises(ValueError, match="num_experts=8 must be local_num_experts=4 x"):
        data_parallel.VllmDataParallelPrepareAndFinalize(group, local_num_experts=4, hidden=K,
                                                         num_experts=E)


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
    import os

    os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = str(CHUNK)
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    data_parallel.logger.addHandler(handler)
    data_parallel.logger.setLevel(logging.INFO)
    group = types.SimpleNamespace(world_size=world, rank_in_group=rank,
                                  cpu_group=dist.group.WORLD)
    M = (40, 37)
    x, tw, ti, local, expert_map = _skewed_problem(rank, world, M[rank])
    e_l = E // world
    qc = block_quant_config(local)
    pf = data_parallel.VllmDataParallelPrepareAndFinalize(group, local_num_experts=e_l,
                                                          hidden=K, num_experts=E)
    kernel = mk.FusedMoEKernel(pf, VllmTritonExperts(moe_config(E, TOPK, e_l), qc))
    out = kernel.apply(x, local.w1, local.w2, tw, ti, MoEActivation.SILU, E, expert_map, False)
    ours = FusedMoEModularKernel(
        DeepEPHTPrepareAndFinalize(TorchAll2AllBuffer(None), num_dispatchers=world,
                                   rank_expert_offset=rank * e_l), TritonExperts())(
        x, local.w1, local.w2, tw, ti, w1_scale=local.w1_scale, w2_scale=local.w2_scale,
        global_num_experts=E, expert_map=expert_map, max_tokens_across_ranks=max(M))
    return torch.equal(out, ours), bool(out.abs().sum() > 0), messages


def test_in_vllms_kernel_equals_ours_and_logs_the_bounded_workspaces():
    results = run_distributed(_in_vllms_kernel, 2)
    for equal, nonzero, _ in results:
        assert equal and nonzero
    assert results[0][2] == []  # rank 0 received nothing: no workspaces to log
    (message,) = results[1][2]  # rank 1 received all 77 tokens, in passes of CHUNK
    ws13, ws2, out = contiguous_workspace_shapes(77, I, K, TOPK, E // 2)  # one pass, no bound
    unbounded = 2 * (max(ws13[0] * ws13[1], out[0] * out[1]) + ws2[0] * ws2[1])
    got = int(message.split("workspaces ")[1].split(" bytes")[0])
    assert "rank 1 received 77 tokens" in message and "5 pass(es) of at most 16" in message
    assert got < unbounded, (got, unbounded)
