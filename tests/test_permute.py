"""The expert-contiguous layout: alignment, the dump row, gather/scatter with poisoned buffers."""

import pytest
import torch

from vllm_moe_fixes.ops.permute import (
    ALIGNMENT,
    ContiguousLayout,
    build_contiguous_layout,
    contiguous_num_rows,
    local_expert_ids,
    permute_rows,
    permute_rows_ref,
    permute_rows_triton,
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
    from vllm_moe_fixes import sizes
    assert contiguous_num_rows is sizes.contiguous_num_rows and ALIGNMENT == sizes.ALIGNMENT == 128
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
    assert lay.dest.dtype == lay.src_token.dtype == torch.int64
    local = local_expert_ids(ids, emap)
    assert local.dtype == torch.int64 and local.shape == (M * k,)
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


# --- the Triton gather (interpreted on CPU) against the torch reference ---------------------------

def _gather_inputs(M, K, m_sum, device, seed, mn_major_in=False):
    """Random fp8 bytes (NaN patterns included: compared as bytes) and positive scales."""
    g = torch.Generator().manual_seed(seed)
    a_q = torch.randint(0, 256, (M, K), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    G = K // 128
    a_s = torch.rand(G, M, generator=g).t() if mn_major_in else torch.rand(M, G, generator=g)
    a_s += 0.1
    return a_q.to(device), a_s.to(device)


def _poisoned_outputs(m_sum, K, device):
    out_q = torch.full((m_sum, K), 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    out_s = torch.full((K // 128, m_sum), float("nan"), device=device).t()  # strides (1, M_sum)
    return out_q, out_s


def _synthetic_layout(m_sum, M, used_rows, device, seed):
    """m_indices -1 except at used_rows; src_token random everywhere (padding rows too, so a kernel
    that copies them instead of writing zeros is caught)."""
    g = torch.Generator().manual_seed(seed)
    m_idx = torch.full((m_sum,), -1, dtype=torch.int32)
    m_idx[used_rows] = torch.randint(0, 4, (len(used_rows),), dtype=torch.int32, generator=g)
    src = torch.randint(0, M, (m_sum,), generator=g)
    return ContiguousLayout(m_indices=m_idx.to(device), src_token=src.to(device),
                            dest=torch.zeros(0, dtype=torch.int64, device=device))


def _check_gather(a_q, a_s, lay, launch, **kw):
    m_sum, K = lay.m_indices.numel(), a_q.shape[1]
    want_q, want_s = _poisoned_outputs(m_sum, K, "cpu")
    cpu_lay = ContiguousLayout(*(t.cpu() for t in (lay.m_indices, lay.src_token, lay.dest)))
    permute_rows_ref(a_q.cpu(), a_s.cpu(), cpu_lay, want_q, want_s)
    out_q, out_s = _poisoned_outputs(m_sum, K, a_q.device)
    launch(a_q, a_s, lay, out_q, out_s, **kw)
    assert torch.equal(out_q.view(torch.uint8).cpu(), want_q.view(torch.uint8))
    assert torch.equal(out_s.cpu(), want_s)
    padding = lay.m_indices.cpu() < 0
    assert out_q.view(torch.uint8).cpu()[padding].eq(0).all()
    return out_q, out_s


@pytest.mark.parametrize("case", ["one_row", "all_padding", "odd_rows", "row_major_scales"])
def test_permute_triton_synthetic_layouts(case, kernel_device):
    M, K, m_sum = 5, 384, 128  # K = 3 scale groups: not a power of two
    used = {"one_row": [77], "all_padding": [], "odd_rows": list(range(0, 128, 3)),
            "row_major_scales": list(range(40, 90))}[case]
    a_q, a_s = _gather_inputs(M, K, m_sum, kernel_device, seed=len(used) + K,
                              mn_major_in=case != "row_major_scales")
    lay = _synthetic_layout(m_sum, M, used, kernel_device, seed=len(used))
    _check_gather(a_q, a_s, lay, permute_rows_triton)


@pytest.mark.parametrize("M,k,E,K,use_map", [(1, 1, 1, 128, False), (9, 3, 8, 256, True),
                                             (37, 4, 6, 1152, False)])
def test_permute_triton_real_layouts(M, k, E, K, use_map, kernel_device):
    ids = _routing(M, k, E, seed=M + K, nonlocal_ids=use_map)
    emap, E_l = _half_map(E, seed=E) if use_map else (None, E)
    lay = build_contiguous_layout(ids.to(kernel_device), E_l,
                                  emap.to(kernel_device) if use_map else None)
    a_q, a_s = _gather_inputs(M, K, lay.m_indices.numel(), kernel_device, seed=K)
    out_q, out_s = _check_gather(a_q, a_s, lay, permute_rows_triton)
    assert out_s.stride() == (1, lay.m_indices.numel())
    # and through the public op (Triton on CUDA, the reference on CPU)
    _check_gather(a_q, a_s, lay, permute_rows)


@pytest.mark.parametrize("block_rows,block_k,num_warps", [(1, 128, 1), (4, 256, 2), (16, 512, 4)])
def test_permute_triton_tiles(block_rows, block_k, num_warps, kernel_device):
    """Tiles smaller than K (several column programs, a partial last one for K = 640) and row
    counts that do not divide M_sum's 128."""
    M, K, m_sum = 11, 640, 256
    a_q, a_s = _gather_inputs(M, K, m_sum, kernel_device, seed=block_k)
    lay = _synthetic_layout(m_sum, M, list(range(3, 200, 2)), kernel_device, seed=block_rows)
    _check_gather(a_q, a_s, lay, permute_rows_triton, block_rows=block_rows, block_k=block_k,
                  num_warps=num_warps)


def test_permute_rows_bad_arguments():
    M, K = 4, 256
    lay = build_contiguous_layout(_routing(M, 2, 4, seed=0), 4)
    m_sum = lay.m_indices.numel()
    a_q, a_s = _gather_inputs(M, K, m_sum, "cpu", seed=0)
    out_q, out_s = _poisoned_outputs(m_sum, K, "cpu")
    ok = dict(a_q=a_q, a_s=a_s, layout=lay, out_q=out_q, out_s=out_s)
    for match, change in [
        ("a_q", dict(a_q=a_q.view(torch.uint8))),
        ("a_q", dict(a_q=a_q.t())),
        ("K must be a multiple of 128", dict(a_q=a_q[:, :200], out_q=out_q[:, :200])),
        ("a_s", dict(a_s=a_s.double())),
        ("a_s", dict(a_s=a_s[:3])),
        ("out_q", dict(out_q=out_q[:-1])),
        ("out_q", dict(out_q=out_q.view(torch.uint8))),
        ("out_s", dict(out_s=out_s[:, :1])),
        ("out_s", dict(out_s=out_s.double())),
        ("no rows", dict(a_q=a_q[:0], a_s=a_s[:0])),
    ]:
        with pytest.raises(ValueError, match=match):
            permute_rows(**dict(ok, **change))


@pytest.mark.gpu
def test_gpu_permute_past_2_31_elements():
    """M_sum * K = 300160 * 7168 > 2**31 bytes: the last rows need 64-bit output offsets; the
    source rows sit past 2**31 bytes too (M * K > 2**31)."""
    M, K, m_sum = 300000, 7168, 300160
    assert m_sum * K > 2 ** 31 and M * K > 2 ** 31
    g = torch.Generator(device="cuda").manual_seed(0)
    a_q = torch.randint(0, 256, (M, K), dtype=torch.uint8, device="cuda",
                        generator=g).view(torch.float8_e4m3fn)
    a_s = torch.rand(M, K // 128, device="cuda", generator=g) + 0.1
    src = torch.randint(0, M, (m_sum,), device="cuda", generator=g)
    src[-1000:] = torch.arange(M - 1000, M, device="cuda")  # the last source rows too
    m_idx = torch.randint(-1, 8, (m_sum,), device="cuda", generator=g, dtype=torch.int32)
    lay = ContiguousLayout(m_indices=m_idx, src_token=src, dest=src[:0])
    out_q, out_s = _poisoned_outputs(m_sum, K, "cuda")
    permute_rows(a_q, a_s, lay, out_q, out_s)
    for rows in (slice(-2048, None), slice(0, 2048), slice(m_sum // 2, m_sum // 2 + 2048)):
        want = a_q.view(torch.uint8)[src[rows]] * (m_idx[rows] >= 0).unsqueeze(1).to(torch.uint8)
        assert torch.equal(out_q.view(torch.uint8)[rows], want)
        assert torch.equal(out_s[rows], a_s[src[rows]])


@pytest.mark.gpu
def test_gpu_permute_matches_reference():
    M, k, E, K = 2048, 8, 8, 7168
    lay = build_contiguous_layout(_routing(M, k, E, seed=1).cuda(), E)
    a_q, a_s = _gather_inputs(M, K, lay.m_indices.numel(), "cuda", seed=1)
    _check_gather(a_q, a_s, lay, permute_rows)
