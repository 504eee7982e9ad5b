"""The layer's activation-scale option use_ue8m0 (PrepareAndFinalize.use_ue8m0): scales rounded up
to powers of two in every activation quant of a layer call, exact scales (unchanged bits) when
off. The fused quant + permute kernel against the torch reference (Triton interpreted on CPU, and
on a GPU), the experts' and prepare/finalizes' quants, the whole layer against a reference built
from the ops' torch references, and the kernel's refusal of experts that cannot follow."""

import pytest
import torch

from test_quant_permute import _assert_same_bits, _poisoned, _problem
from vllm_moe_fixes.fused_moe import (
    BatchedTritonExperts,
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
    DeepEPV2PrepareAndFinalize,
    Experts,
    FusedMoEModularKernel,
    NoEPPrepareAndFinalize,
    TritonExperts,
)
from vllm_moe_fixes.fused_moe import experts_steps
from vllm_moe_fixes.fused_moe.routing import fused_topk
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, SCALE_BLOCK
from vllm_moe_fixes.ops.fp8_quant import (
    QUANT_EPS,
    per_token_group_quant_fp8_ref,
    quant_batched_fp8,
)
from vllm_moe_fixes.ops.grouped_gemm import grouped_fp8_gemm_contiguous_ref
from vllm_moe_fixes.ops.moe_sum import moe_sum_ref
from vllm_moe_fixes.ops.permute import ContiguousLayout, permute_rows_ref
from vllm_moe_fixes.ops.quant_permute import quant_permute, quant_permute_triton
from vllm_moe_fixes.ops.silu_mul_quant import silu_and_mul_quant_fp8_ref
from vllm_moe_fixes.testing import random_fp8_moe_weights

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _powers_of_two(s: torch.Tensor) -> bool:
    """Every finite non-zero float32 in s has a zero mantissa."""
    bits = s[torch.isfinite(s) & (s != 0)].contiguous().view(torch.int32)
    return bool((bits & 0x7FFFFF).eq(0).all())


# ------------------------------------------------------------------ the quant + permute kernel

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M,k,E_l,K,nonlocal_ids", [
    (1, 1, 1, 128, False),        # one row, the small-M tile
    (1, 4, 8, 384, True),         # three groups
    (5, 3, 4, 1152, False),       # nine groups, M < 8
    (37, 6, 7, 640, True),        # several token tiles, a partial last one, -1 slots
    (0, 2, 3, 256, False),        # empty: every row is padding
])
def test_quant_permute_ue8m0_bits_equal_the_reference(device, M, k, E_l, K, nonlocal_ids):
    x, lay = _problem(M, k, E_l, K, device, seed=M * 11 + K, nonlocal_ids=nonlocal_ids,
                      special=True)
    m_sum = lay.src_row.numel()
    got = _poisoned(m_sum, K, device)
    quant_permute_triton(x, lay, *got, True)
    cpu_lay = ContiguousLayout(*(t.cpu() for t in (lay.m_indices, lay.src_row, lay.dest)))
    want = _poisoned(m_sum, K, "cpu")
    q, s = per_token_group_quant_fp8_ref(x.cpu(), SCALE_BLOCK, QUANT_EPS, True)
    permute_rows_ref(q, s, cpu_lay, *want)
    _assert_same_bits(got, want)
    assert _powers_of_two(got[1].cpu())
    if M:  # the option changes the bits: exact scales are not powers of two here
        exact = _poisoned(m_sum, K, device)
        quant_permute_triton(x, lay, *exact, False)
        assert not torch.equal(exact[1].cpu(), got[1].cpu())
        public = _poisoned(m_sum, K, device)
        quant_permute(x, lay, *public, use_ue8m0=True)
        _assert_same_bits(public, want)


def test_quant_permute_refuses_a_non_bool_use_ue8m0():
    x, lay = _problem(3, 2, 2, 256, "cpu", seed=2)
    with pytest.raises(ValueError, match="use_ue8m0"):
        quant_permute(x, lay, *_poisoned(lay.src_row.numel(), 256, "cpu"), use_ue8m0=1)


# ------------------------------------------------------------------ the layer

def _layer_reference(x, w, tw, ti, use_ue8m0):
    """The layer from the ops' torch references, one slot at a time: quant (use_ue8m0), GEMM1,
    SiLU-and-mul + requant (use_ue8m0), GEMM2, the weighted sum over the k slots in slot order."""
    x, tw, ti = x.cpu(), tw.cpu(), ti.cpu()
    w1, w1s, w2, w2s = (t.cpu() for t in w)
    M, K = x.shape
    k = ti.shape[1]
    a_q, a_s = per_token_group_quant_fp8_ref(x, SCALE_BLOCK, QUANT_EPS, use_ue8m0)
    rows = torch.zeros(M, k, K, dtype=torch.bfloat16)
    for t in range(M):
        for j in range(k):
            e = torch.tensor([int(ti[t, j])])
            h = torch.empty(1, w1.shape[1], dtype=torch.bfloat16)
            grouped_fp8_gemm_contiguous_ref((a_q[t:t + 1], a_s[t:t + 1]), (w1, w1s), h, e)
            g = silu_and_mul_quant_fp8_ref(h, use_ue8m0)
            y = torch.empty(1, K, dtype=torch.bfloat16)
            grouped_fp8_gemm_contiguous_ref(g, (w2, w2s), y, e)
            rows[t, j] = y[0]
    return moe_sum_ref(rows, tw).to(torch.bfloat16)


def _routed(M, E, k, K, I, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w = random_fp8_moe_weights(E, K, I, generator=g)
    x = (torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g).add(0.05)).bfloat16()
    tw, ti = fused_topk(torch.randn(M, E, generator=g), k, renormalize=True)
    return [t.to(device) for t in w], x.to(device), tw.to(device), ti.to(device)


def _call(kernel, w, x, tw, ti):
    return kernel(x, w[0], w[2], tw, ti, w1_scale=w[1], w2_scale=w[3],
                  global_num_experts=w[0].shape[0])


@pytest.mark.parametrize("path", ["references", "triton"])
@pytest.mark.parametrize("defer", [False, True], ids=["prepare_quant", "deferred_quant"])
@pytest.mark.parametrize("M,E,k", [(1, 4, 2), (13, 5, 3)])
def test_layer_with_use_ue8m0_equals_the_reference(monkeypatch, path, defer, M, E, k):
    """On CPU: each step's torch reference, or (triton) each step's Triton launcher interpreted
    but the GEMMs' (the reference's block sums, which the Triton GEMM's FP8 accumulation does
    not reproduce bit for bit). Bit for bit the reference with power-of-two scales, another
    output than exact scales give; use_ue8m0=False: the exact-scale reference (unchanged bits)."""
    if path == "triton":
        monkeypatch.setattr(experts_steps, "takes_triton", lambda reads: True)
        monkeypatch.setattr(experts_steps, "grouped_fp8_gemm_contiguous_triton",
                            lambda a, w_, out, m_indices: grouped_fp8_gemm_contiguous_ref(
                                a, w_, out, m_indices))
    K, I = 384, 256
    w, x, tw, ti = _routed(M, E, k, K, I, seed=M + 10 * E)
    outs = {}
    for use_ue8m0 in (True, False):
        pf = NoEPPrepareAndFinalize(defer_input_quant=defer, use_ue8m0=use_ue8m0)
        outs[use_ue8m0] = _call(FusedMoEModularKernel(pf, TritonExperts()), w, x, tw, ti)
        assert torch.equal(outs[use_ue8m0], _layer_reference(x, w, tw, ti, use_ue8m0))
    assert outs[True].abs().sum() > 0 and not torch.equal(outs[True], outs[False])


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 200])
def test_gpu_layer_deferred_and_prepared_ue8m0_quant_agree(M):
    """On the GPU: the deferred quant (quant_permute's kernel) and the prepare's quant + permute
    give the same layer bits with use_ue8m0, and differ from exact scales."""
    w, x, tw, ti = _routed(M, 8, 4, 1024, 512, seed=M, device="cuda")
    out = {}
    for defer, use_ue8m0 in ((True, True), (False, True), (True, False)):
        pf = NoEPPrepareAndFinalize(defer_input_quant=defer, use_ue8m0=use_ue8m0)
        out[defer, use_ue8m0] = _call(FusedMoEModularKernel(pf, TritonExperts()), w, x, tw, ti)
    assert torch.equal(out[True, True], out[False, True])
    assert not torch.equal(out[True, True], out[True, False])


def test_batched_experts_requant_follows_use_ue8m0():
    """BatchedTritonExperts.apply (the masked GEMM's and the requant's references on CPU): the
    valid rows of each expert are the references' with the requant's scales as use_ue8m0 says
    (workspaces poisoned)."""
    E_l, T, K, I = 3, 5, 256, 256
    g = torch.Generator().manual_seed(4)
    w1, w1s, w2, w2s = random_fp8_moe_weights(E_l, K, I, generator=g)
    a_q, a_s = quant_batched_fp8(torch.randn(E_l, T, K, generator=g).bfloat16())
    counts = torch.tensor([5, 0, 2], dtype=torch.int32)
    from vllm_moe_fixes.fused_moe.interfaces import Fp8MoEWeights
    from vllm_moe_fixes.sizes import batched_workspace_shapes
    ws13_shape, ws2_shape, out_shape = batched_workspace_shapes(T, I, K, E_l)
    outs = {}
    for use_ue8m0 in (True, False):
        ws13 = torch.full(ws13_shape, float("nan"), dtype=torch.bfloat16)
        ws2 = torch.full(ws2_shape, float("nan"), dtype=torch.bfloat16)
        out = ws13.view(-1)[:E_l * T * K].view(out_shape)  # the experts' output: ws13's start
        BatchedTritonExperts().apply(out, a_q, a_s, Fp8MoEWeights(w1, w1s, w2, w2s),
                                     workspace13=ws13, workspace2=ws2, expert_num_tokens=counts,
                                     use_ue8m0=use_ue8m0)
        outs[use_ue8m0] = out.clone()
        for e, n in enumerate(counts.tolist()):
            for t in range(n):
                h = torch.empty(1, 2 * I, dtype=torch.bfloat16)
                sel = torch.tensor([e])
                grouped_fp8_gemm_contiguous_ref((a_q[e, t:t + 1], a_s[e, t:t + 1]), (w1, w1s),
                                                h, sel)
                y = torch.empty(1, K, dtype=torch.bfloat16)
                grouped_fp8_gemm_contiguous_ref(silu_and_mul_quant_fp8_ref(h, use_ue8m0),
                                                (w2, w2s), y, sel)
                assert torch.equal(outs[use_ue8m0][e, t], y[0])
    assert not torch.equal(outs[True][0, :5], outs[False][0, :5])


# ------------------------------------------------------------------ prepare/finalizes

class _RecordingBuffer:
    """Stands in for a DeepEP buffer: records what the dispatch was handed, returns it as
    received (one rank)."""

    low_latency_mode = True

    def __init__(self):
        self.sent = {}

    def get_dispatch_layout(self, ids, num_experts):
        return None, None, None, None, None

    def dispatch(self, x, **kw):
        self.sent = dict(x=x, **kw)
        ids, w = kw["topk_idx"], kw["topk_weights"]
        if "num_tokens_per_rank" in kw:  # high-throughput
            return x, ids, w, [], "handle", None
        handle = type("H", (), {"num_recv_tokens_per_expert_list": [],
                                "psum_num_recv_tokens_per_scaleup_rank": None})()
        return x, ids, w, handle, None

    def combine(self, *a, **kw):
        raise AssertionError

    def get_buffer_size_hint(self, *a, **kw):
        return 0

    def low_latency_dispatch(self, a1, ids, n, num_experts, **kw):
        self.sent = dict(x=a1, **kw)
        E_l = num_experts
        recv = torch.zeros(E_l, n, a1.shape[1], dtype=torch.bfloat16)
        recv[:, :a1.shape[0]] = a1
        counts = torch.full((E_l,), a1.shape[0], dtype=torch.int32)
        if kw["use_fp8"]:
            recv = (recv.to(FP8_DTYPE), torch.ones(E_l, n, a1.shape[1] // SCALE_BLOCK))
        return recv, counts, "handle", None, None

    def low_latency_combine(self, *a, **kw):
        raise AssertionError


@pytest.mark.parametrize("kind", ["ht", "v2"])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_standard_dispatch_quant_follows_use_ue8m0(kind, use_ue8m0):
    buffer = _RecordingBuffer()
    args = dict(num_dispatchers=1, rank_expert_offset=0, use_ue8m0=use_ue8m0)
    pf = DeepEPHTPrepareAndFinalize(buffer, **args) if kind == "ht" else \
        DeepEPV2PrepareAndFinalize(buffer, max_tokens_per_rank=16, **args)
    _, x, tw, ti = _routed(7, 4, 2, 384, 128, seed=9)
    pf.prepare(x, tw, ti, 4, None, False)
    q, s = buffer.sent["x"]
    want_q, want_s = per_token_group_quant_fp8_ref(x, SCALE_BLOCK, QUANT_EPS, use_ue8m0)
    _assert_same_bits((q, s), (want_q, want_s))


@pytest.mark.parametrize("use_fp8_dispatch", [True, False])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_low_latency_quant_follows_use_ue8m0(use_fp8_dispatch, use_ue8m0):
    """FP8 dispatch: DeepEP's cast rounds (round_scale) exactly when use_ue8m0; bf16 dispatch:
    the received slices' quant rounds."""
    buffer = _RecordingBuffer()
    pf = DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=1, max_tokens_per_rank=4,
                                    use_fp8_dispatch=use_fp8_dispatch, use_ue8m0=use_ue8m0)
    _, x, tw, ti = _routed(3, 4, 2, 256, 128, seed=8)
    res = pf.prepare(x, tw, ti, 4, None, False)
    assert buffer.sent["round_scale"] is (use_fp8_dispatch and use_ue8m0)
    if not use_fp8_dispatch:
        want_q, want_s = per_token_group_quant_fp8_ref(x, SCALE_BLOCK, QUANT_EPS, use_ue8m0)
        for e in range(4):
            _assert_same_bits((res.a1q[e, :3], res.a1q_scale[e, :3]), (want_q, want_s))


@pytest.mark.parametrize("build", [
    lambda v: NoEPPrepareAndFinalize(use_ue8m0=v),
    lambda v: DeepEPHTPrepareAndFinalize(_RecordingBuffer(), num_dispatchers=1,
                                         rank_expert_offset=0, use_ue8m0=v),
    lambda v: DeepEPLLPrepareAndFinalize(_RecordingBuffer(), num_dispatchers=1,
                                         max_tokens_per_rank=4, use_ue8m0=v),
], ids=["no_ep", "ht", "ll"])
def test_prepare_finalizes_default_off_and_refuse_a_non_bool(build):
    assert build(False).use_ue8m0 is False
    with pytest.raises(ValueError, match="use_ue8m0"):
        build("yes")


def test_kernel_refuses_experts_that_cannot_follow_and_keeps_serving_them_off():
    class ExpertsWithoutTheKeyword(TritonExperts):
        """Experts written before use_ue8m0: apply takes the keywords it had."""

        def apply(self, output, a1q, a1q_scale, weights, *, workspace13, workspace2,
                  topk_ids=None, expert_map=None, expert_num_tokens=None, topk_weights=None,
                  expected_m=None, experts_pass_tokens=None, activation="silu"):
            TritonExperts.apply(self, output, a1q, a1q_scale, weights,
                                workspace13=workspace13, workspace2=workspace2,
                                topk_ids=topk_ids, expert_map=expert_map,
                                topk_weights=topk_weights, experts_pass_tokens=experts_pass_tokens)

    with pytest.raises(ValueError, match="use_ue8m0"):
        FusedMoEModularKernel(NoEPPrepareAndFinalize(use_ue8m0=True), ExpertsWithoutTheKeyword())
    w, x, tw, ti = _routed(6, 4, 2, 256, 128, seed=3)
    old = _call(FusedMoEModularKernel(NoEPPrepareAndFinalize(), ExpertsWithoutTheKeyword()),
                w, x, tw, ti)
    assert torch.equal(old, _layer_reference(x, w, tw, ti, False))
    assert issubclass(ExpertsWithoutTheKeyword, Experts)


def test_compiled_op_carries_use_ue8m0():
    """The experts' custom op (their apply under torch.compile) passes use_ue8m0 on."""
    from vllm_moe_fixes.sizes import contiguous_workspace_shapes
    w, x, tw, ti = _routed(5, 4, 2, 256, 128, seed=6)
    ws13_shape, ws2_shape, _ = contiguous_workspace_shapes(5, 128, 256, 2, 4, None)
    outs = []
    for via_op in (False, True):
        ws13 = torch.full(ws13_shape, float("nan"), dtype=torch.bfloat16)
        ws2 = torch.full(ws2_shape, float("nan"), dtype=torch.bfloat16)
        out = torch.full((5, 256), float("nan"), dtype=torch.bfloat16)
        args = dict(workspace13=ws13, workspace2=ws2, topk_ids=ti, topk_weights=tw)
        if via_op:
            torch.ops.vllm_moe_fixes.experts_apply(
                "vllm_moe_fixes.fused_moe.contiguous_experts:TritonExperts", out, x, None,
                w[0], w[1], w[2], w[3], ws13, ws2, ti, None, None, tw, None, None, "silu", True)
        else:
            from vllm_moe_fixes.fused_moe.interfaces import Fp8MoEWeights
            TritonExperts().apply(out, x, None, Fp8MoEWeights(*w), use_ue8m0=True, **args)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], _layer_reference(x, w, tw, ti, True))
