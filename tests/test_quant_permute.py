"""quant_permute (ops/quant_permute.py): the quant written straight into the contiguous layout, bit
for bit what quantising then permuting gives, with poisoned outputs, at awkward sizes; on a GPU
also a permuted output past 2**31 elements."""

import pytest
import torch

from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, SCALE_BLOCK
from vllm_moe_fixes.ops.fp8_quant import (
    QUANT_EPS,
    per_token_group_quant_fp8_ref,
    per_token_group_quant_fp8_triton,
)
from vllm_moe_fixes.ops.permute import (
    ContiguousLayout,
    build_contiguous_layout,
    contiguous_num_rows,
    permute_rows_triton,
)
from vllm_moe_fixes.ops.quant_permute import (
    quant_permute,
    quant_permute_ref,
    quant_permute_triton,
)

# The inputs hold an inf on purpose (inf / inf in its group's quant, as in the quant's own tests).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _poisoned(m_sum, K, device):
    """fp8 bytes 0x7F (NaN) and NaN scales with the experts' MN-major strides (1, M_sum)."""
    out_q = torch.full((m_sum, K), 0x7F, dtype=torch.uint8, device=device).view(FP8_DTYPE)
    out_s = torch.full((K // SCALE_BLOCK, m_sum), float("nan"), device=device).t()
    return out_q, out_s


def _problem(M, k, E_l, K, device, seed, nonlocal_ids=False, special=False):
    """bf16 x [M, K] (random, scaled per row; with `special` a NaN, an inf and an all-zero group)
    and the layout of distinct top-k ids, ~25% of them -1 when nonlocal_ids."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g).add(0.01) * 10
    if special and M >= 3:
        x[0, 5] = float("nan")
        x[1, 130] = float("inf")
        x[2, :SCALE_BLOCK] = 0.0
    ids = torch.stack([torch.randperm(E_l, generator=g)[:k] for _ in range(M)]) if M else \
        torch.empty(0, k, dtype=torch.int64)
    if nonlocal_ids and M:
        ids[torch.rand(M, k, generator=g) < 0.25] = -1
    lay = build_contiguous_layout(ids.to(device), E_l)
    return x.bfloat16().to(device), lay


def _quant_then_permute(x, lay):
    """Today's two kernels: the quant into [M, K], then the gather (interpreted on CPU)."""
    M, K = x.shape
    a_q = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
    a_s = torch.empty(M, K // SCALE_BLOCK, device=x.device)
    per_token_group_quant_fp8_triton(x, a_q, a_s, SCALE_BLOCK, QUANT_EPS, False)
    out_q, out_s = _poisoned(lay.src_row.numel(), K, x.device)
    permute_rows_triton(a_q, a_s, lay, out_q, out_s)
    return out_q, out_s


def _assert_same_bits(got, want):
    assert torch.equal(got[0].view(torch.uint8).cpu(), want[0].view(torch.uint8).cpu())
    assert torch.equal(got[1].cpu().view(torch.int32), want[1].cpu().view(torch.int32))


@pytest.mark.parametrize("M,k,E_l,K,nonlocal_ids", [
    (1, 1, 1, 128, False),        # one row, the small-M tile
    (1, 4, 8, 384, True),         # three groups: not a power of two
    (5, 3, 4, 1152, False),       # nine groups: a partial second group block, M < 8
    (37, 6, 7, 640, True),        # several token tiles, a partial last one, -1 slots
    (0, 2, 3, 256, False),        # empty: every row is padding
])
def test_quant_permute_bits_equal_quant_then_permute(M, k, E_l, K, nonlocal_ids, kernel_device):
    x, lay = _problem(M, k, E_l, K, kernel_device, seed=M * 7 + K, nonlocal_ids=nonlocal_ids,
                      special=True)
    out_q, out_s = _poisoned(lay.src_row.numel(), K, kernel_device)
    quant_permute_triton(x, lay, out_q, out_s)
    if M:
        _assert_same_bits((out_q, out_s), _quant_then_permute(x, lay))
    want = _poisoned(lay.src_row.numel(), K, "cpu")
    cpu_lay = ContiguousLayout(*(t.cpu() for t in (lay.m_indices, lay.src_row, lay.dest)))
    quant_permute_ref(x.cpu(), cpu_lay, *want)
    _assert_same_bits((out_q, out_s), want)
    # What the rows hold, checked without the permute: each used row is its token's quant,
    # every padding row zeros (the poison is gone everywhere).
    q, s = per_token_group_quant_fp8_ref(x.cpu(), SCALE_BLOCK, QUANT_EPS, False)
    src = lay.src_row.cpu().long()
    used = src >= 0
    assert torch.equal(out_q.view(torch.uint8).cpu()[used], q.view(torch.uint8)[src[used]])
    assert torch.equal(out_s.cpu()[used], s[src[used]])
    assert out_q.view(torch.uint8).cpu()[~used].eq(0).all() and out_s.cpu()[~used].eq(0).all()


def test_quant_permute_public_op(kernel_device):
    x, lay = _problem(9, 2, 3, 256, kernel_device, seed=3)
    out = _poisoned(lay.src_row.numel(), 256, kernel_device)
    quant_permute(x, lay, *out)  # Triton on CUDA, the reference on CPU
    want = _poisoned(lay.src_row.numel(), 256, kernel_device)
    quant_permute_triton(x, lay, *want)
    _assert_same_bits(out, want)


@pytest.mark.parametrize("what", ["x_dtype", "x_strides", "K", "out_q_shape", "out_s_dtype"])
def test_quant_permute_refuses(what):
    x, lay = _problem(4, 2, 2, 256, "cpu", seed=1)
    m_sum = lay.src_row.numel()
    out_q, out_s = _poisoned(m_sum, 256, "cpu")
    if what == "x_dtype":
        x = x.float()
    elif what == "x_strides":
        x = torch.empty(256, 4, dtype=torch.bfloat16).t()
    elif what == "K":
        x = x[:, :200]
    elif what == "out_q_shape":
        out_q = out_q[:-1]
    else:
        out_s = out_s.double()
    with pytest.raises(ValueError, match="x|out_q|out_s"):
        quant_permute(x, lay, out_q, out_s)


@pytest.mark.gpu
def test_gpu_quant_permute_deepseek_sizes():
    """K = 7168, top-8 over 8 local experts, M = 1024 and 3: the same bits as the two kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for M in (1024, 3):
        x, lay = _problem(M, 8, 8, 7168, "cuda", seed=M, special=True)
        out = _poisoned(lay.src_row.numel(), 7168, "cuda")
        quant_permute(x, lay, *out)
        _assert_same_bits(out, _quant_then_permute(x, lay))


@pytest.mark.gpu
def test_gpu_quant_permute_past_2_31_elements():
    """A permuted output of 115712 x 20480 = 2.37e9 fp8 elements (> 2**31; top-7 of 8 experts, so
    the segments do not fill whole 128-row blocks): rows past the 32-bit range hold their tokens'
    quant (int64 offsets), padding rows there are zeros."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    M, k, E_l, K = 16384, 7, 8, 20480
    m_sum = contiguous_num_rows(M * k, E_l)
    assert m_sum * K > 2**31
    need = m_sum * K * 1.1 + 3 * M * K * 2 + (1 << 30)
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    ids = torch.rand(M, E_l, device="cuda", generator=g).argsort(dim=1)[:, :k]
    lay = build_contiguous_layout(ids, E_l)
    out_q = torch.full((m_sum, K), 0x7F, dtype=torch.uint8, device="cuda").view(FP8_DTYPE)
    out_s = torch.full((K // SCALE_BLOCK, m_sum), float("nan"), device="cuda").t()
    quant_permute(x, lay, out_q, out_s)
    q = torch.empty(M, K, dtype=FP8_DTYPE, device="cuda")
    s = torch.empty(M, K // SCALE_BLOCK, device="cuda")
    per_token_group_quant_fp8_triton(x, q, s, SCALE_BLOCK, QUANT_EPS, False)
    high = torch.arange(m_sum, device="cuda") * K >= 2**31  # rows past the int32 range
    src = lay.src_row.long()
    for rows in (high & (src >= 0), (src >= 0) & (torch.arange(m_sum, device="cuda") % 97 == 0)):
        r = rows.nonzero().flatten()
        assert r.numel() > 0
        assert torch.equal(out_q.view(torch.uint8)[r], q.view(torch.uint8)[src[r]])
        assert torch.equal(out_s[r], s[src[r]])
    padding = (src < 0).nonzero().flatten()
    assert out_q.view(torch.uint8)[padding].eq(0).all() and out_s[padding].eq(0).all()
    assert bool((high & (src < 0)).any())  # the tail's padding lies past 2**31 too
