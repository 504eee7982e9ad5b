"""The expert-contiguous layout: alignment, the dump row, gather/scatter with poisoned buffers."""

import pytest
import torch

from vllm_moe_fixes.ops.permute import (
    ALIGNMENT,
    build_contiguous_layout,
    contiguous_num_rows,
    local_expert_ids,
    permute_rows,
    unpermute_rows,
)


def _routing(M, k, E, seed, nonlocal_ids=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(torch.int64)
    if nonlocal_ids and M * k:
        ids[torch.rand(M, k, generator=g) < 0.2] = -1  # already dispatched away (EP)
    return ids.reshape(M, k)


def _half_map(E, seed):
    g = torch.Generator().manual_seed(seed)
    emap = torch.full((E,), -1, dtype=torch.int32)
    local = torch.randperm(E, generator=g)[: max(E // 2, 1)]
    emap[local] = torch.arange(local.numel(), dtype=torch.int32)
    return emap, local.numel()


def test_num_rows():
    assert contiguous_num_rows(1, 1) == 128
    assert contiguous_num_rows(2, 1) == 256  # 2 + 127 = 129 -> 256
    assert contiguous_num_rows(6 * 130, 32) == 4864


@pytest.mark.parametrize("M,k,E,use_map,neg", [(1, 1, 1, False, False), (7, 2, 8, True, False),
                                               (130, 6, 32, True, True), (300, 2, 4, False, True),
                                               (5, 3, 8, True, True)])
def test_layout_invariants(M, k, E, use_map, neg):
    ids = _routing(M, k, E, seed=M * 31 + k, nonlocal_ids=neg)
    emap, E_l = _half_map(E, seed=E) if use_map else (None, E)
    lay = build_contiguous_layout(ids, E_l, emap)
    m_sum = contiguous_num_rows(M * k, E_l)
    assert lay.m_indices.dtype == torch.int32 and lay.m_indices.shape == (m_sum,)
    assert lay.dest.shape == (M * k,) and lay.src_token.shape == (m_sum,)
    local = local_expert_ids(ids, emap)
    is_local = local >= 0
    dest = lay.dest
    # Local slots: distinct rows holding their expert and token, in slot order within an expert.
    assert dest[is_local].unique().numel() == int(is_local.sum())
    assert torch.equal(lay.m_indices[dest[is_local]].long(), local[is_local])
    tokens = torch.arange(M * k) // k
    assert torch.equal(lay.src_token[dest[is_local]], tokens[is_local])
    # Non-local slots read the dump row, which is padding.
    if (~is_local).any():
        assert (dest[~is_local] == m_sum - 1).all()
        assert lay.m_indices[-ALIGNMENT:].eq(-1).all()
    for e in range(E_l):
        rows = dest[local == e]
        if rows.numel():
            assert rows[0] % ALIGNMENT == 0 and torch.equal(rows, rows[0] + torch.arange(rows.numel()))
            assert int((lay.m_indices == e).sum()) == rows.numel()
    assert int((lay.m_indices >= 0).sum()) == int(is_local.sum())


def test_dump_row_is_padding_in_the_worst_case():
    # All but one slot local, every expert's count one past a multiple of 128: maximal padding.
    E_l = 4
    ids = torch.arange(E_l).repeat_interleave(129).reshape(-1, 1)
    ids = torch.cat([ids, torch.tensor([[E_l]])])  # one slot for a non-local expert
    emap = torch.cat([torch.arange(E_l, dtype=torch.int32), torch.tensor([-1], dtype=torch.int32)])
    lay = build_contiguous_layout(ids, E_l, emap)
    m_sum = lay.m_indices.numel()
    assert int(lay.dest[-1]) == m_sum - 1 and int(lay.m_indices[-1]) == -1
    assert int(lay.dest[:-1].max()) < m_sum - ALIGNMENT


def test_permute_and_unpermute_with_poisoned_buffers():
    M, k, E, K = 9, 3, 8, 256
    ids = _routing(M, k, E, seed=3, nonlocal_ids=True)
    emap, E_l = _half_map(E, seed=4)
    lay = build_contiguous_layout(ids, E_l, emap)
    m_sum = lay.m_indices.numel()
    g = torch.Generator().manual_seed(5)
    a_q = (torch.randn(M, K, generator=g) * 50).to(torch.float8_e4m3fn)
    a_s = torch.rand(K // 128, M, generator=g).t() + 0.1  # column-major input scales
    out_q = torch.full((m_sum, K), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # NaN
    out_s = torch.full((K // 128, m_sum), float("nan")).t()
    permute_rows(a_q, a_s, lay, out_q, out_s)
    valid = lay.m_indices >= 0
    assert torch.equal(out_q[valid].float(), a_q[lay.src_token[valid]].float())
    assert out_q[~valid].float().eq(0).all()
    assert out_s.stride() == (1, m_sum) and torch.isfinite(out_s).all()
    assert torch.equal(out_s[valid], a_s[lay.src_token[valid]])

    y = torch.randn(m_sum, K, generator=g).bfloat16()
    y[~valid] = float("nan")  # whatever a GEMM leaves in padding rows
    out = torch.full((M, k, K), float("nan"), dtype=torch.bfloat16)
    unpermute_rows(y, lay, out)
    local = local_expert_ids(ids, emap).view(M, k)
    assert torch.equal(out[local >= 0], y[lay.dest.view(M, k)[local >= 0]])
    assert out[local < 0].eq(0).all()


def test_every_slot_nonlocal():
    ids = torch.tensor([[0, 1], [1, 0]])
    emap = torch.tensor([-1, -1, 0], dtype=torch.int32)
    lay = build_contiguous_layout(ids, 1, emap)
    assert lay.m_indices.eq(-1).all()
    y = torch.randn(lay.m_indices.numel(), 128).bfloat16()
    out = torch.full((2, 2, 128), float("nan"), dtype=torch.bfloat16)
    unpermute_rows(y, lay, out)
    assert out.eq(0).all()
