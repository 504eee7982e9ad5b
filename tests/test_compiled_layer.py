"""The layer under torch.compile on CPU: dynamo traces the modular kernel and the experts (as vLLM's
default compiled mode traces our adapters), and the compiled call gives the eager call's bits.

The experts' apply becomes one custom op in the graph (fused_moe/interfaces.py): the full-graph
test shows that nothing in the experts breaks the graph, which vLLM's compile (fullgraph=True)
needs."""

import pytest
import torch

from _layer import make_problem, new_kernel, run
from vllm_moe_fixes.fused_moe import BatchedTritonExperts, Fp8MoEWeights, TritonExperts
from vllm_moe_fixes.ops.fp8_quant import quant_batched_fp8, per_token_group_quant_fp8
from vllm_moe_fixes.ops.fp8 import SCALE_BLOCK


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("M,k,E", [(5, 2, 4), (1, 1, 3), (37, 3, 8)])
def test_compiled_layer_equals_eager(M, k, E):
    p = make_problem(M, k, E, 128, 256, seed=M)
    kernel = new_kernel()
    want = run(kernel, p, E)
    compiled = torch.compile(lambda p: run(kernel, p, E), backend="eager")
    got = compiled(p)
    assert torch.equal(got, want)
    p2 = make_problem(M, k, E, 128, 256, seed=M + 100)  # the same graph on other values
    assert torch.equal(compiled(p2), run(kernel, p2, E))


def _experts_call(experts, p, E):
    """What vLLM's kernel does around our experts: quantise, declare, apply into a workspace."""
    x, w1, w2 = p["hidden_states"], p["w1"], p["w2"]
    M, K = x.shape
    I = w2.shape[2]
    a1q, a1s = per_token_group_quant_fp8(x, SCALE_BLOCK)
    ws13_shape, ws2_shape, out_shape = experts.workspace_shapes(M, I, K, p["topk_ids"].shape[1],
                                                                w1.shape[0])
    ws13 = torch.empty(ws13_shape, dtype=torch.bfloat16)
    ws2 = torch.empty(ws2_shape, dtype=torch.bfloat16)
    out = ws13.view(-1)[:M * K].view(out_shape)  # the output aliases workspace13, as in vLLM
    experts.apply(out, a1q, a1s, Fp8MoEWeights(w1, p["w1_scale"], w2, p["w2_scale"]),
                  workspace13=ws13, workspace2=ws2, topk_ids=p["topk_ids"],
                  topk_weights=p["topk_weights"])
    return out.clone()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_contiguous_experts_trace_as_one_graph(backend):
    E = 4
    p = make_problem(9, 2, E, 128, 256, seed=1)
    experts = TritonExperts()
    want = _experts_call(experts, p, E)
    got = torch.compile(lambda p: _experts_call(experts, p, E), backend=backend,
                        fullgraph=True)(p)
    assert torch.equal(got, want)


def test_batched_experts_trace_as_one_graph():
    g = torch.Generator().manual_seed(2)
    E_l, T, K, I = 3, 5, 256, 128
    p = make_problem(1, 1, E_l, I, K, seed=2)
    a1q, a1s = quant_batched_fp8(torch.randn(E_l, T, K, generator=g).bfloat16())
    counts = torch.tensor([5, 0, 2], dtype=torch.int32)
    experts = BatchedTritonExperts()

    def call(a1q, a1s, counts):
        ws13_shape, ws2_shape, out_shape = experts.workspace_shapes(T, I, K, 1, E_l)
        ws13 = torch.empty(ws13_shape, dtype=torch.bfloat16)
        ws2 = torch.empty(ws2_shape, dtype=torch.bfloat16)
        out = torch.full(out_shape, float("nan"), dtype=torch.bfloat16)
        experts.apply(out, a1q, a1s, Fp8MoEWeights(p["w1"], p["w1_scale"], p["w2"],
                                                   p["w2_scale"]),
                      workspace13=ws13, workspace2=ws2, expert_num_tokens=counts)
        return out

    want = call(a1q, a1s, counts)
    got = torch.compile(call, backend="eager", fullgraph=True)(a1q, a1s, counts)
    rows = torch.arange(T) < counts.unsqueeze(1)  # only the valid rows are written
    assert torch.equal(got[rows], want[rows])
