"""The low-latency layer with FP8 dispatch at the grid of vLLM's DeepEP low-latency test, on two
gloo ranks, and where its error comes from.

vLLM's test (tests/kernels/moe/test_deepep_moe.py, ``test_low_latency_deep_ep_moe``) runs 2 ranks,
E = 32 experts, top-6, 64 tokens per rank per dispatch, hidden size k = 2560, intermediate size n
in {128, 512, 1024} and m in {1, 2, 3, 32, 45, 64, 222} tokens on every rank (the same tokens on
both). Its inputs: tokens randn / 10 in bf16, ids uniform (a token may list an expert twice),
router weights randn (unnormalised, of either sign). Its reference emulates the FP8 dispatch by
quantising and dequantising the tokens per 1x128 group (vLLM's recipe, rounded back to bf16), then
runs every slot in float32 with dequantised weights and no quantisation of the intermediate; it
passes at ``assert_close(atol=6e-2, rtol=6e-2)``. Its FP8 case draws weights randn / 100 (here
128x128-block quantised): layer outputs are about 1e-3, far inside the 6e-2 floor. Its bf16 case
draws weights randn / 10 and runs unquantised experts; through our block-FP8 experts (the same
weights block-quantised) outputs reach 4-10 and, at n >= 512, leave vLLM's tolerance (the issue's
4 of 14).

Where that error comes from (measured on these inputs against float64 with the same FP8 weights
and the same dispatch cast, no rounding of the intermediate): the FP8 rounding of the SiLU-and-mul
output before GEMM2, which every block-FP8 GEMM2 needs and vLLM's reference does not model. A
float64 pipeline whose only rounding is that one lands at rel-L2 0.0232-0.0235 and 1.46-2.64x
vLLM's tolerance; ours at 0.0235-0.0239 and 1.45-2.60x; ours without that rounding at 0.0042 and
0.21-0.35x. Our pipeline matches one written here with its rounding points (DeepEP's cast, bf16
GEMM outputs, SiLU-and-mul in bf16, vLLM's requant recipe, float32 combine) within rel-L2 1e-4.
A reference with other rounding before the requant (vLLM's, whose dispatch emulation rounds the
dequantised tokens to bf16) differs from ours by about 0.017: an FP8 rounding turns an upstream
difference d (relative) into about sqrt(d * ulp) after it.

So the checks here: at vLLM's grid points that failed, ours against the reference with our
rounding points at vLLM's tolerance and a tight rel-L2; ours within 5% of the floor the FP8
intermediate sets; and vLLM's own FP8 case, with its reference and tolerance, as it is.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import run_distributed

from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer
from vllm_moe_fixes.fused_moe.batched_experts import BatchedTritonExperts
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import DeepEPLLPrepareAndFinalize
from vllm_moe_fixes.fused_moe.kernel_factory import local_expert_map
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, FP8_MAX, SCALE_BLOCK
from vllm_moe_fixes.testing import quant_block_fp8

WORLD, E, TOPK, TOKENS_PER_RANK, K = 2, 32, 6, 64, 2560
VLLM_ATOL = VLLM_RTOL = 6e-2
FLOOR_MARGIN = 1.05  # ours vs the ideal FP8-intermediate pipeline, rel-L2 (measured 1.016-1.019)

# (m, n, weight scale): vLLM's grid points that leave its tolerance with the weights of its bf16
# case (randn / 10), and its FP8 case (randn / 100) at its largest point (4 dispatch chunks).
FAILING = [(3, 1024), (45, 512), (64, 1024), (222, 1024)]
VLLM_FP8_CASE = (222, 1024)
POINTS = [(m, n, 10.0) for m, n in FAILING] + [(*VLLM_FP8_CASE, 100.0)]


def _problem(m, n, w_div, seed=7):
    """vLLM's inputs: block-FP8 w1 [E, 2n, K], w2 [E, K, n] (randn / w_div), tokens bf16 [m, K],
    ids [m, 6] uniform, router weights randn [m, 6]."""
    g = torch.Generator().manual_seed(seed)
    w1, s1 = quant_block_fp8(torch.randn(E, 2 * n, K, generator=g) / w_div)
    w2, s2 = quant_block_fp8(torch.randn(E, K, n, generator=g) / w_div)
    x = (torch.randn(m, K, generator=g) / 10).bfloat16()
    ids = torch.randint(0, E, (m, TOPK), generator=g)
    weights = torch.randn(m, TOPK, generator=g)
    return x, ids, weights, w1, s1, w2, s2


def _layer_worker(rank, world):
    """Every point through DeepEPLL (FP8 dispatch) + BatchedTritonExperts over one buffer."""
    buffer = TorchAll2AllBuffer(dist.group.WORLD, low_latency_mode=True,
                                num_max_dispatch_tokens_per_rank=TOKENS_PER_RANK, hidden=K,
                                num_experts=E)
    pf = DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=world,
                                    max_tokens_per_rank=TOKENS_PER_RANK, use_fp8_dispatch=True)
    kernel = FusedMoEModularKernel(pf, BatchedTritonExperts())
    expert_map = local_expert_map(dist.group.WORLD, E)
    here = slice(rank * E // world, (rank + 1) * E // world)
    outs = []
    for point in POINTS:
        x, ids, weights, w1, s1, w2, s2 = _problem(*point)
        outs.append(kernel(x, w1[here].contiguous(), w2[here].contiguous(), weights, ids,
                           w1_scale=s1[here].contiguous(), w2_scale=s2[here].contiguous(),
                           global_num_experts=E, expert_map=expert_map))
    return outs


@pytest.fixture(scope="module")
def layer_outputs():
    """{point: rank 0's output}; both ranks hold the same tokens, so their outputs are equal."""
    per_rank = run_distributed(_layer_worker, WORLD)
    for a, b in zip(*per_rank):
        assert torch.equal(a, b)
    return dict(zip(POINTS, per_rank[0]))


# ----------------------------------------------------------------------------- references
def _groups(x):
    return x.unflatten(-1, (x.shape[-1] // SCALE_BLOCK, SCALE_BLOCK))


def _deepep_cast(x):
    """DeepEP's low-latency cast: per 1x128 group amax floored at 1e-4, q = e4m3(x * (448 /
    amax)) rounded to nearest even, scale amax / 448: (q float32 [.., K], scale [.., K/128])."""
    g = _groups(x.float())
    amax = g.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    # tensor / tensor: one rounded division (a number over a tensor is a reciprocal times the
    # number in torch, two roundings, which flips ties such as 84 between 80 and 88)
    q = (g * (torch.full_like(amax, FP8_MAX) / amax)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.float().flatten(-2), (amax * (1.0 / FP8_MAX)).squeeze(-1)


def _quant_groups(a):
    """vLLM's per-token-group recipe: scale = amax / 448 (amax floored at 1e-10), q = e4m3(a /
    scale): (q in a's dtype, scale [.., K/128])."""
    g = _groups(a)
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) / torch.tensor(FP8_MAX)
    return (g / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(a.dtype).flatten(-2), \
        scale.squeeze(-1)


def _block_gemm(q, s, w, ws):
    """Our GEMMs' arithmetic: FP8 rows q [R, C] (scales s [R, C/128]) times w [N, C] (block
    scales ws [N/128, C/128]) transposed: each 128-wide block's products summed exactly (float64
    holds any sum of 128 e4m3 products), rounded to float32, scaled and added in block order."""
    acc = torch.zeros(q.shape[0], w.shape[0])
    ws = ws.repeat_interleave(SCALE_BLOCK, 0)
    for b in range(q.shape[1] // SCALE_BLOCK):
        cols = slice(b * SCALE_BLOCK, (b + 1) * SCALE_BLOCK)
        part = (q[:, cols].double() @ w[:, cols].double().t()).float()
        acc += part * (s[:, b:b + 1] * ws[:, b])
    return acc


def _vllm_requant(a):
    """_quant_groups dequantised, in a's dtype."""
    q, scale = _quant_groups(a)
    return (_groups(q) * scale.unsqueeze(-1)).flatten(-2)


def _dequant(w, s):
    return w.float() * s.repeat_interleave(SCALE_BLOCK, -2).repeat_interleave(SCALE_BLOCK, -1)


def _slots(x, ids, weights, w1, s1, w2, s2, expert_fn):
    """sum over slots of weight * expert_fn(rows, w1_e, w2_e), accumulated per slot in the rows'
    dtype (float32 or float64), a token listing an expert twice counting it twice."""
    out = None  # [M, width of expert_fn's rows]
    token = torch.arange(ids.shape[0]).repeat_interleave(TOPK)
    flat, w = ids.flatten(), weights.flatten().to(x.dtype)
    for e in range(E):
        sel = (flat == e).nonzero().squeeze(1)
        if sel.numel():
            y = expert_fn(x[token[sel]], _dequant(w1[e], s1[e]).to(x.dtype),
                          _dequant(w2[e], s2[e]).to(x.dtype))
            out = x.new_zeros(x.shape[0], y.shape[1]) if out is None else out
            out.index_add_(0, token[sel], y * w[sel, None])
    return out


def ours_reference(x, ids, weights, w1, s1, w2, s2):
    """Our layer's rounding points, written out: DeepEP's cast, GEMM1 (``_block_gemm``) rounded
    to bf16, SiLU then the product in bf16, vLLM's requant, GEMM2 rounded to bf16, the weighted
    slots summed in float32 and rounded to bf16 once."""
    q, s = _deepep_cast(x)
    out = torch.zeros(x.shape)
    token = torch.arange(ids.shape[0]).repeat_interleave(TOPK)
    flat, w = ids.flatten(), weights.flatten()
    for e in range(E):
        sel = (flat == e).nonzero().squeeze(1)
        if sel.numel():
            rows = token[sel]
            gate, up = _block_gemm(q[rows], s[rows], w1[e], s1[e]).bfloat16().chunk(2, dim=-1)
            act_q, act_s = _quant_groups((F.silu(gate) * up).float())
            y = _block_gemm(act_q, act_s, w2[e], s2[e]).bfloat16().float()
            out.index_add_(0, rows, y * w[sel, None])
    return out.bfloat16()


def float64_references(x, ids, weights, w1, s1, w2, s2):
    """(exact, ideal) in float64 after DeepEP's cast: exact rounds nothing else; ideal rounds only
    the SiLU-and-mul output to FP8 (vLLM's recipe), the one rounding a block-FP8 GEMM2 needs."""
    def expert(rows, w1_e, w2_e):
        gate, up = (rows @ w1_e.t()).chunk(2, dim=-1)
        act = F.silu(gate) * up
        return torch.cat([act @ w2_e.t(), _vllm_requant(act) @ w2_e.t()], -1)
    q, s = _deepep_cast(x)
    rows = (_groups(q) * s.unsqueeze(-1)).flatten(-2).double()
    both = _slots(rows, ids, weights, w1, s1, w2, s2, expert)
    return both[:, :K], both[:, K:]


def vllm_reference(x, ids, weights, w1, s1, w2, s2):
    """vLLM's reference: the dispatch emulated by vLLM's quant recipe, dequantised and rounded
    to bf16; every slot in float32, no intermediate quantisation; rounded to bf16."""
    a = _vllm_requant(x.float()).bfloat16().float()

    def expert(rows, w1_e, w2_e):
        gate, up = (rows @ w1_e.t()).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ w2_e.t()
    return _slots(a, ids, weights, w1, s1, w2, s2, expert).bfloat16()


def _rel_l2(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def _tolerance_ratio(out, ref) -> float:
    """max |out - ref| / (atol + rtol |ref|) at vLLM's tolerance: <= 1 passes assert_close."""
    out, ref = out.double(), ref.double()
    return float(((out - ref).abs() / (VLLM_ATOL + VLLM_RTOL * ref.abs())).max())


# ----------------------------------------------------------------------------- checks
@pytest.mark.parametrize("m,n", FAILING)
def test_ll_fp8_dispatch_at_vllm_tolerance_against_our_rounding_points(layer_outputs, m, n):
    out = layer_outputs[(m, n, 10.0)]
    ref = ours_reference(*_problem(m, n, 10.0))
    torch.testing.assert_close(out.float(), ref.float(), atol=VLLM_ATOL, rtol=VLLM_RTOL)
    assert _rel_l2(out, ref) < 1e-3


@pytest.mark.parametrize("m,n", FAILING)
def test_ll_fp8_dispatch_error_is_the_fp8_intermediates(layer_outputs, m, n):
    """Against float64 without rounding of the intermediate, ours is within 5% of the pipeline
    whose only rounding is the FP8 intermediate, and that pipeline itself leaves vLLM's tolerance
    here: the tolerance of a test of unquantised experts, not a defect of ours."""
    out = layer_outputs[(m, n, 10.0)]
    exact, ideal = float64_references(*_problem(m, n, 10.0))
    floor = _rel_l2(ideal, exact)
    assert floor < _rel_l2(out, exact) * FLOOR_MARGIN and _rel_l2(out, exact) < floor * FLOOR_MARGIN
    assert _tolerance_ratio(ideal, exact) > 1.0


def test_vllm_fp8_case_with_vllms_reference_and_tolerance(layer_outputs):
    """vLLM's FP8 case (weights randn / 100) at its largest point, 4 dispatch chunks per rank."""
    out = layer_outputs[(*VLLM_FP8_CASE, 100.0)]
    ref = vllm_reference(*_problem(*VLLM_FP8_CASE, 100.0))
    torch.testing.assert_close(out.float(), ref.float(), atol=VLLM_ATOL, rtol=VLLM_RTOL)


def test_the_checks_catch_a_small_error(layer_outputs):
    """A 3% error of the output (a misplaced scale gives more) fails both checks."""
    m, n = FAILING[1]
    out = (layer_outputs[(m, n, 10.0)].double() * 1.03).bfloat16()
    problem = _problem(m, n, 10.0)
    assert _rel_l2(out, ours_reference(*problem)) > 1e-3
    exact, ideal = float64_references(*problem)
    assert _rel_l2(out, exact) > _rel_l2(ideal, exact) * FLOOR_MARGIN
