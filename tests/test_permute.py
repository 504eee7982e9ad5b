"""The expert-contiguous layout (two Triton kernels vs the stable-sort reference), the gather into
it and the fused un-permute + weighted top-k sum, with poisoned buffers."""

import pytest
import torch

from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, SCALE_BLOCK
from vllm_moe_fixes.ops.moe_sum import moe_sum
from vllm_moe_fixes.ops.permute import (
    ContiguousLayout,
    build_contiguous_layout,
    build_contiguous_layout_ref,
    build_contiguous_layout_triton,
    carve_layout,
    contiguous_num_rows,
    layout_index_numel,
    layout_num_chunks,
    local_expert_ids,
    permute_rows,
    permute_rows_ref,
    permute_rows_triton,
    unpermute_reduce,
    unpermute_reduce_ref,
    unpermute_reduce_triton,
)
from vllm_moe_fixes.sizes import ROW_ALIGNMENT

POISON = -123456789


def _routing(M, k, E, seed, nonlocal_ids=False, dtype=torch.int64):
    """Distinct experts per token (as top-k gives), -1 ids in ~20% of slots when nonlocal_ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(torch.int64)
    ids = ids.reshape(M, k)
    if nonlocal_ids and M * k:
        ids[torch.rand(M, k, generator=g) < 0.2] = -1  # already dispatched away (EP)
    return ids.to(dtype)


def _map(E, local_num_experts, seed):
    """expert_map with E_l local experts at random global ids, -1 elsewhere."""
    g = torch.Generator().manual_seed(seed)
    emap = torch.full((E,), -1, dtype=torch.int32)
    local = torch.randperm(E, generator=g)[:local_num_experts]
    emap[local] = torch.arange(local_num_experts, dtype=torch.int32)
    return emap


def test_num_rows():
    from vllm_moe_fixes import sizes
    assert contiguous_num_rows is sizes.contiguous_num_rows and ROW_ALIGNMENT == 128
    assert contiguous_num_rows(1, 1) == 128
    assert contiguous_num_rows(2, 1) == 256  # 2 + 127 = 129 -> 256
    assert contiguous_num_rows(6 * 130, 32) == 4864


@pytest.mark.parametrize("slots,local_num_experts", [(0, 1), (1, 1), (2400, 3), (8 * 8192, 8),
                                                     (8 * 32768, 8), (8 * 300, 256),
                                                     (8 * 16384, 384)])
def test_index_vectors_fit_the_workspace_columns(slots, local_num_experts):
    """The counts [n_chunks, E_l] never exceed M_sum entries, so 4 int32 per M_sum row (the
    workspace's LAYOUT_INDEX_COLUMNS) always hold the index vectors."""
    from vllm_moe_fixes.sizes import LAYOUT_INDEX_COLUMNS
    m_sum = contiguous_num_rows(slots, local_num_experts)
    assert layout_num_chunks(slots, local_num_experts) * local_num_experts <= m_sum
    assert layout_index_numel(slots, local_num_experts) * 2 <= m_sum * LAYOUT_INDEX_COLUMNS


@pytest.mark.parametrize("M,k,E,use_map,neg", [(1, 1, 1, False, False), (7, 2, 8, True, False),
                                               (130, 6, 32, True, True), (300, 2, 4, False, True),
                                               (5, 3, 8, True, True)])
def test_layout_ref_invariants(M, k, E, use_map, neg):
    """The reference itself: distinct rows, aligned segments in slot order, padding -1."""
    ids = _routing(M, k, E, seed=M * 31 + k, nonlocal_ids=neg)
    local_num_experts = max(E // 2, 1) if use_map else E
    emap = _map(E, local_num_experts, seed=E) if use_map else None
    lay = build_contiguous_layout_ref(ids, local_num_experts, emap)
    m_sum = contiguous_num_rows(M * k, local_num_experts)
    for t in (lay.m_indices, lay.src_row, lay.dest):
        assert t.dtype == torch.int32
    assert lay.m_indices.shape == lay.src_row.shape == (m_sum,) and lay.dest.shape == (M * k,)
    local = local_expert_ids(ids, emap, local_num_experts)
    is_local = local >= 0
    dest = lay.dest.long()
    assert dest[~is_local].eq(-1).all()
    assert dest[is_local].unique().numel() == int(is_local.sum())
    assert torch.equal(lay.m_indices[dest[is_local]].long(), local[is_local])
    tokens = torch.arange(M * k) // k
    assert torch.equal(lay.src_row[dest[is_local]].long(), tokens[is_local])
    for e in range(local_num_experts):
        rows = dest[local == e]
        if rows.numel():  # slot order within the expert, segment starts aligned
            assert rows[0] % ROW_ALIGNMENT == 0
            assert torch.equal(rows, rows[0] + torch.arange(rows.numel()))
    padding = lay.m_indices < 0
    assert int((~padding).sum()) == int(is_local.sum())
    assert lay.src_row[padding].eq(-1).all() and lay.src_row[~padding].ge(0).all()
    # expert_ends: DeepGEMM's psum layout, expert e's rows are [align128(end[e-1]), end[e]).
    ends = lay.expert_ends.long()
    assert lay.expert_ends.dtype == torch.int32 and ends.shape == (local_num_experts,)
    start = 0
    for e in range(local_num_experts):
        count = int((local == e).sum())
        assert int(ends[e]) == start + count
        assert lay.m_indices[start:start + count].eq(e).all()
        start = -(-int(ends[e]) // ROW_ALIGNMENT) * ROW_ALIGNMENT
    assert lay.m_indices[start:].eq(-1).all()  # nothing past the last expert's rows


def _check_layout_kernels(ids, local_num_experts, emap):
    """Triton layout (CUDA, or interpreted on CPU) into a poisoned buffer == the reference."""
    device = ids.device
    num_slots = ids.numel()
    buf = torch.full((layout_index_numel(num_slots, local_num_experts) + 64,), POISON,
                     dtype=torch.int32, device=device)
    lay, counts = carve_layout(buf, num_slots, local_num_experts)
    build_contiguous_layout_triton(ids, local_num_experts, emap, lay, counts)
    ref = build_contiguous_layout_ref(ids.cpu(), local_num_experts,
                                      None if emap is None else emap.cpu())
    for name in ("m_indices", "src_row", "dest", "expert_ends"):
        assert torch.equal(getattr(lay, name).cpu(), getattr(ref, name)), name
    assert buf[-64:].eq(POISON).all()  # nothing past the declared size


@pytest.mark.parametrize("local_num_experts", [1, 3, 8, 33, 256])
@pytest.mark.parametrize("M", [0, 1, 7, 300])
def test_layout_kernels_match_reference(M, local_num_experts, kernel_device):
    """Random ids incl. -1 and ids of non-local experts (a map with E_l of E = 2 E_l + 1 experts
    local), int64 and int32."""
    k = min(8, local_num_experts) if local_num_experts > 1 else 1
    E = 2 * local_num_experts + 1
    g = torch.Generator().manual_seed(M * 1000 + local_num_experts)
    ids = torch.randint(-1, E, (M, k), generator=g)
    emap = _map(E, local_num_experts, seed=local_num_experts)
    _check_layout_kernels(ids.to(kernel_device), local_num_experts, emap.to(kernel_device))
    ids_local = torch.randint(-1, local_num_experts, (M, k), generator=g).int()
    _check_layout_kernels(ids_local.to(kernel_device), local_num_experts, None)


def test_layout_kernels_strided_ids_and_out_of_range(kernel_device):
    """A non-contiguous [M, k] view; ids past E and map entries past E_l get no row."""
    E, local_num_experts, M, k = 12, 5, 40, 3
    g = torch.Generator().manual_seed(0)
    wide = torch.randint(-3, E + 4, (M, 2 * k), generator=g)
    emap = _map(E, local_num_experts, seed=1)
    emap[0] = local_num_experts + 2  # out of range: treated as not local
    _check_layout_kernels(wide[:, ::2].to(kernel_device), local_num_experts, emap.to(kernel_device))


def test_layout_kernels_many_chunks(kernel_device):
    """Enough slots for several chunks (earlier-chunk offsets) and a skewed routing (one expert
    holds most slots, some experts none)."""
    M, k, local_num_experts = 700, 4, 6
    g = torch.Generator().manual_seed(2)
    ids = torch.where(torch.rand(M, k, generator=g) < 0.7, 2, torch.randint(-1, 4, (M, k),
                                                                              generator=g))
    assert layout_num_chunks(M * k, local_num_experts) > 1
    _check_layout_kernels(ids.to(kernel_device), local_num_experts, None)


def test_build_contiguous_layout_public(kernel_device):
    ids = _routing(9, 3, 8, seed=3, nonlocal_ids=True).to(kernel_device)
    emap = _map(8, 4, seed=4).to(kernel_device)
    buf = torch.full((layout_index_numel(27, 4),), POISON, dtype=torch.int32, device=kernel_device)
    lay = build_contiguous_layout(ids, 4, emap, out=buf)
    assert lay.m_indices.data_ptr() == buf.data_ptr()  # views of out: no allocation
    ref = build_contiguous_layout_ref(ids.cpu(), 4, emap.cpu())
    assert torch.equal(lay.dest.cpu(), ref.dest) and torch.equal(lay.m_indices.cpu(), ref.m_indices)
    fresh = build_contiguous_layout(ids.int(), 4, emap)
    assert torch.equal(fresh.src_row.cpu(), ref.src_row)


def test_build_contiguous_layout_bad_arguments():
    ids = _routing(4, 2, 8, seed=0)
    for match, call in [
        ("topk_ids", lambda: build_contiguous_layout(ids.float(), 8)),
        ("topk_ids", lambda: build_contiguous_layout(ids.view(-1), 8)),
        ("local_num_experts", lambda: build_contiguous_layout(ids, 0)),
        ("expert_map", lambda: build_contiguous_layout(ids, 8, torch.arange(8))),
        ("out must be", lambda: build_contiguous_layout(
            ids, 8, out=torch.empty(3, dtype=torch.int32))),
        (r"topk_ids\[2, 1\] = 8", lambda: build_contiguous_layout(
            torch.tensor([[0, 1], [2, 3], [4, 8]]), 8)),
        (r"topk_ids\[0, 0\] = -2", lambda: build_contiguous_layout(torch.tensor([[-2]]), 8)),
        (r"expert_map\[3\] = 4", lambda: build_contiguous_layout(
            ids, 4, torch.tensor([0, 1, 2, 4, -1, -1, -1, 3], dtype=torch.int32))),
    ]:
        with pytest.raises(ValueError, match=match):
            call()


# --- the Triton gather (interpreted on CPU) against the torch reference ---------------------------

def _gather_inputs(M, K, device, seed, mn_major_in=False):
    """Random fp8 bytes (NaN patterns included: compared as bytes) and positive scales."""
    g = torch.Generator().manual_seed(seed)
    a_q = torch.randint(0, 256, (M, K), dtype=torch.uint8, generator=g).view(FP8_DTYPE)
    G = K // SCALE_BLOCK
    a_s = torch.rand(G, M, generator=g).t() if mn_major_in else torch.rand(M, G, generator=g)
    a_s += 0.1
    return a_q.to(device), a_s.to(device)


def _poisoned_outputs(m_sum, K, device):
    out_q = torch.full((m_sum, K), 0x7F, dtype=torch.uint8, device=device).view(FP8_DTYPE)
    # strides (1, M_sum)
    out_s = torch.full((K // SCALE_BLOCK, m_sum), float("nan"), device=device).t()
    return out_q, out_s


def _synthetic_layout(m_sum, M, used_rows, device, seed):
    """src_row -1 except at used_rows, where it names a random token."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((m_sum,), -1, dtype=torch.int32)
    src[used_rows] = torch.randint(0, M, (len(used_rows),), dtype=torch.int32, generator=g)
    m_idx = torch.where(src >= 0, 0, -1).int()
    return ContiguousLayout(m_indices=m_idx.to(device), src_row=src.to(device),
                            dest=torch.zeros(0, dtype=torch.int32, device=device))


def _check_gather(a_q, a_s, lay, launch, **kw):
    m_sum, K = lay.src_row.numel(), a_q.shape[1]
    want_q, want_s = _poisoned_outputs(m_sum, K, "cpu")
    cpu_lay = ContiguousLayout(*(t.cpu() for t in (lay.m_indices, lay.src_row, lay.dest)))
    permute_rows_ref(a_q.cpu(), a_s.cpu(), cpu_lay, want_q, want_s)
    out_q, out_s = _poisoned_outputs(m_sum, K, a_q.device)
    launch(a_q, a_s, lay, out_q, out_s, **kw)
    assert torch.equal(out_q.view(torch.uint8).cpu(), want_q.view(torch.uint8))
    assert torch.equal(out_s.cpu(), want_s)
    padding = lay.src_row.cpu() < 0
    assert out_q.view(torch.uint8).cpu()[padding].eq(0).all() and out_s.cpu()[padding].eq(0).all()
    used = ~padding
    src = lay.src_row.cpu()[used].long()
    assert torch.equal(out_q.view(torch.uint8).cpu()[used], a_q.view(torch.uint8).cpu()[src])
    assert torch.equal(out_s.cpu()[used], a_s.cpu()[src])
    return out_q, out_s


@pytest.mark.parametrize("case", ["one_row", "all_padding", "odd_rows", "row_major_scales"])
def test_permute_triton_synthetic_layouts(case, kernel_device):
    M, K, m_sum = 5, 384, 128  # K = 3 scale groups: not a power of two
    used = {"one_row": [77], "all_padding": [], "odd_rows": list(range(0, 128, 3)),
            "row_major_scales": list(range(40, 90))}[case]
    a_q, a_s = _gather_inputs(M, K, kernel_device, seed=len(used) + K,
                              mn_major_in=case != "row_major_scales")
    lay = _synthetic_layout(m_sum, M, used, kernel_device, seed=len(used))
    _check_gather(a_q, a_s, lay, permute_rows_triton)


@pytest.mark.parametrize("M,k,E,K,use_map", [(1, 1, 1, 128, False), (9, 3, 8, 256, True),
                                             (37, 4, 6, 1152, False)])
def test_permute_real_layouts(M, k, E, K, use_map, kernel_device):
    ids = _routing(M, k, E, seed=M + K, nonlocal_ids=use_map)
    local_num_experts = max(E // 2, 1) if use_map else E
    emap = _map(E, local_num_experts, seed=E).to(kernel_device) if use_map else None
    lay = build_contiguous_layout(ids.to(kernel_device), local_num_experts, emap)
    a_q, a_s = _gather_inputs(M, K, kernel_device, seed=K)
    out_q, out_s = _check_gather(a_q, a_s, lay, permute_rows_triton)
    assert out_s.stride() == (1, lay.m_indices.numel())
    _check_gather(a_q, a_s, lay, permute_rows)  # the public op: Triton on CUDA, ref on CPU


@pytest.mark.parametrize("block_rows,block_k,num_warps", [(1, 128, 1), (4, 256, 2), (16, 512, 4)])
def test_permute_triton_tiles(block_rows, block_k, num_warps, kernel_device):
    """Tiles smaller than K (several column programs, a partial last one for K = 640) and row
    counts that do not divide M_sum's 128."""
    M, K, m_sum = 11, 640, 256
    a_q, a_s = _gather_inputs(M, K, kernel_device, seed=block_k)
    lay = _synthetic_layout(m_sum, M, list(range(3, 200, 2)), kernel_device, seed=block_rows)
    _check_gather(a_q, a_s, lay, permute_rows_triton, block_rows=block_rows, block_k=block_k,
                  num_warps=num_warps)


def test_permute_rows_bad_arguments():
    M, K = 4, 256
    lay = build_contiguous_layout(_routing(M, 2, 4, seed=0), 4)
    m_sum = lay.m_indices.numel()
    a_q, a_s = _gather_inputs(M, K, "cpu", seed=0)
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
    ]:
        with pytest.raises(ValueError, match=match):
            permute_rows(**dict(ok, **change))


# --- un-permute + weighted top-k sum -------------------------------------------------------------

def _reduce_inputs(M, k, K, local_num_experts, seed, device, nonlocal_ids=True):
    """GEMM2-like rows y [M_sum, K] (NaN on padding and on no row that any slot reads), a real
    layout's dest, weights with some exact zeros whose rows hold NaN."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1 if nonlocal_ids else 0, local_num_experts, (M, k), generator=g)
    lay = build_contiguous_layout_ref(ids, local_num_experts, None)
    m_sum = lay.m_indices.numel()
    y = (torch.randn(m_sum, K, generator=g) * 3).bfloat16()
    y[lay.m_indices < 0] = float("nan")  # padding rows are never read
    w = torch.rand(M, k, generator=g)
    zero = torch.rand(M, k, generator=g) < 0.15
    w[zero] = 0.0
    w[0, 0] = -0.0  # a negative zero weight adds +0, as moe_sum_ref's where() gives
    dest = lay.dest.clone()
    rows = dest[zero.view(-1) & (dest >= 0)].long()
    y[rows] = float("nan")  # zero-weight slots are not read either
    w = w.t().contiguous().t() if seed % 2 else w  # column-major weights too
    return y.to(device), dest.to(device), w.to(device)


def _unreduced(y, dest, M):
    rows = y.float().index_select(0, dest.long().clamp(min=0)).bfloat16()
    rows[dest < 0] = 0
    return rows.view(M, -1, y.shape[1])


@pytest.mark.parametrize("M,k,K,local_num_experts", [(1, 1, 128, 1), (7, 3, 384, 4),
                                                     (64, 8, 256, 8), (5, 6, 4352, 3)])
@pytest.mark.parametrize("weighted", [True, False])
def test_unpermute_reduce_matches_unpermute_then_moe_sum(M, k, K, local_num_experts, weighted,
                                                         kernel_device):
    """Bit for bit what gathering [M, k, K] (zeros for slots without a row) and ops.moe_sum give;
    poisoned output; NaN in every row that must not be read."""
    y, dest, w = _reduce_inputs(M, k, K, local_num_experts, seed=M * k + K, device=kernel_device)
    weights = w if weighted else None
    if not weighted:  # plain sum: zero-weight slots are read, so no NaN may sit in their rows
        y = torch.nan_to_num(y, nan=0.5)
    want = torch.empty(M, K, dtype=torch.bfloat16)
    unpermute_reduce_ref(y.cpu(), dest.cpu(), None if weights is None else weights.cpu(), want)
    via_moe_sum = moe_sum(_unreduced(y.cpu(), dest.cpu(), M),
                          topk_weights=None if weights is None else weights.cpu())
    assert torch.equal(want, via_moe_sum)
    if not weighted or (dest >= 0).any():
        assert torch.isfinite(want).all()
    for launch in (unpermute_reduce_triton, unpermute_reduce):
        out = torch.full((M, K), float("nan"), dtype=torch.bfloat16, device=kernel_device)
        launch(y, dest, weights, out)
        assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("block_k", [128, 256, 1024])
def test_unpermute_reduce_triton_tiles_and_strided_out(block_k, kernel_device):
    M, k, K = 9, 4, 640  # K not a multiple of the tile: a partial last column program
    y, dest, w = _reduce_inputs(M, k, K, 3, seed=block_k, device=kernel_device)
    want = torch.empty(M, K, dtype=torch.bfloat16)
    unpermute_reduce_ref(y.cpu(), dest.cpu(), w.cpu(), want)
    wide = torch.full((M, K + 128), float("nan"), dtype=torch.bfloat16, device=kernel_device)
    unpermute_reduce_triton(y, dest, w, wide[:, :K], block_k=block_k)
    assert torch.equal(wide[:, :K].cpu(), want) and wide[:, K:].isnan().all()


def test_unpermute_reduce_every_slot_without_row(kernel_device):
    dest = torch.full((6,), -1, dtype=torch.int32, device=kernel_device)
    y = torch.full((128, 128), float("nan"), dtype=torch.bfloat16, device=kernel_device)
    out = torch.full((3, 128), float("nan"), dtype=torch.bfloat16, device=kernel_device)
    unpermute_reduce(y, dest, torch.rand(3, 2, device=kernel_device), out)
    assert out.eq(0).all()


def test_unpermute_reduce_bad_arguments():
    y, dest, w = _reduce_inputs(4, 2, 256, 2, seed=0, device="cpu")
    out = torch.empty(4, 256, dtype=torch.bfloat16)
    for match, args in [
        ("y must be", (y.float(), dest, w, out)),
        ("out must be", (y, dest, w, out[:, :128])),
        ("out must be", (y, dest, w, out.float())),
        ("dest must be", (y, dest.long(), w, out)),
        ("dest must be", (y, dest[:-1], w, out)),
        ("topk_weights must be", (y, dest, w.double(), out)),
        ("topk_weights must be", (y, dest, w[:, :1], out)),
    ]:
        with pytest.raises(ValueError, match=match):
            unpermute_reduce(*args)


# --- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_permute_past_2_31_elements():
    """M_sum * K = 300160 * 7168 > 2**31 bytes: the last rows need 64-bit output offsets; the
    source rows sit past 2**31 bytes too (M * K > 2**31)."""
    M, K, m_sum = 300000, 7168, 300160
    assert m_sum * K > 2 ** 31 and M * K > 2 ** 31
    g = torch.Generator(device="cuda").manual_seed(0)
    a_q = torch.randint(0, 256, (M, K), dtype=torch.uint8, device="cuda",
                        generator=g).view(FP8_DTYPE)
    a_s = torch.rand(M, K // SCALE_BLOCK, device="cuda", generator=g) + 0.1
    src = torch.randint(-1, M, (m_sum,), device="cuda", generator=g, dtype=torch.int32)
    src[-1000:] = torch.arange(M - 1000, M, device="cuda", dtype=torch.int32)
    lay = ContiguousLayout(m_indices=src.clamp(max=0), src_row=src, dest=src[:0])
    out_q, out_s = _poisoned_outputs(m_sum, K, "cuda")
    permute_rows(a_q, a_s, lay, out_q, out_s)
    for rows in (slice(-2048, None), slice(0, 2048), slice(m_sum // 2, m_sum // 2 + 2048)):
        s = src[rows].long()
        used = (s >= 0).unsqueeze(1)
        want = a_q.view(torch.uint8)[s.clamp(min=0)] * used.to(torch.uint8)
        assert torch.equal(out_q.view(torch.uint8)[rows], want)
        assert torch.equal(out_s[rows], a_s[s.clamp(min=0)] * used)


@pytest.mark.gpu
def test_gpu_unpermute_reduce_past_2_31_elements():
    """y [M_sum, K] and out [M, K] both past 2**31 elements (M * K = 300000 * 7168): 64-bit row
    offsets on both sides; the last tokens checked against the reference."""
    M, k, K = 300000, 2, 7168
    m_sum = 310000
    assert M * K > 2 ** 31 and m_sum * K > 2 ** 31
    g = torch.Generator(device="cuda").manual_seed(1)
    y = torch.randn(m_sum, K, device="cuda", generator=g, dtype=torch.bfloat16)
    dest = torch.randint(-1, m_sum, (M * k,), device="cuda", generator=g, dtype=torch.int32)
    dest[-2 * 1000:] = torch.arange(m_sum - 2000, m_sum, device="cuda", dtype=torch.int32)
    w = torch.rand(M, k, device="cuda", generator=g)
    out = torch.full((M, K), float("nan"), dtype=torch.bfloat16, device="cuda")
    unpermute_reduce(y, dest, w, out)
    for rows in (slice(M - 1500, M), slice(0, 500)):
        want = torch.empty(rows.stop - rows.start, K, dtype=torch.bfloat16, device="cuda")
        unpermute_reduce_ref(y, dest.view(M, k)[rows].reshape(-1), w[rows], want)
        assert torch.equal(out[rows], want)


@pytest.mark.gpu
@pytest.mark.parametrize("M,k,E,local_num_experts", [(8192, 8, 8, 8), (32768, 8, 256, 32),
                                                     (4096, 8, 384, 384)])
def test_gpu_layout_matches_reference(M, k, E, local_num_experts):
    """Large slot counts (up to 256 chunks), many local experts, int32 ids."""
    g = torch.Generator(device="cuda").manual_seed(M)
    ids = torch.randint(-1, E, (M, k), device="cuda", generator=g, dtype=torch.int32)
    emap = _map(E, local_num_experts, seed=E).cuda() if E != local_num_experts else None
    _check_layout_kernels(ids, local_num_experts, emap)


@pytest.mark.gpu
def test_gpu_permute_matches_reference():
    M, k, E, K = 2048, 8, 8, 7168
    lay = build_contiguous_layout(_routing(M, k, E, seed=1).cuda(), E)
    a_q, a_s = _gather_inputs(M, K, "cuda", seed=1)
    _check_gather(a_q, a_s, lay, permute_rows)
