"""The device-side steps of the naive low-latency exchange: routing against a loop written out
here, and each Triton kernel against its torch reference (interpreter on the CPU, the GPU where
there is one) on random inputs with poisoned outputs, awkward widths and empty routings."""

import pytest
import torch

from vllm_moe_fixes.distributed import ll_exchange as ll

INT64_ROWS = 2**31  # element counts past this need 64-bit offsets


def _ids(seed, rows, k, num_experts, device="cpu"):
    """int64 [rows, k]: distinct ids per row in [0, num_experts) (as a router picks them), about a
    quarter of them -1, and the last row all -1 (a padding row)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(rows)])
    ids[torch.rand(rows, k, generator=g) < 0.25] = -1
    ids[-1] = -1
    return ids.to(device)


def _route_loop(ids, rank, local_num_experts):
    """Positions numbered pair by pair in (row, slot) order, per local expert."""
    served = torch.zeros(ids.shape, dtype=torch.bool)
    pos = torch.zeros(ids.shape, dtype=torch.int64)
    count = [0] * local_num_experts
    for p in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[p, j]) - rank * local_num_experts
            if 0 <= e < local_num_experts:
                served[p, j], pos[p, j] = True, count[e]
                count[e] += 1
    return served, pos, count


@pytest.mark.parametrize("rank, local_num_experts", [(0, 3), (1, 4), (2, 1)])
def test_route_matches_loop(rank, local_num_experts):
    ids = _ids(rank, 7, 3, 3 * local_num_experts)
    served, local, pos, recv_row, count = ll.route(ids, rank, local_num_experts)
    want_served, want_pos, want_count = _route_loop(ids, rank, local_num_experts)
    assert torch.equal(served, want_served)
    assert torch.equal(pos, want_pos)
    assert torch.equal(local, torch.where(served, ids - rank * local_num_experts, 0))
    assert torch.equal(recv_row, local * ids.shape[0] + pos)
    assert count.dtype == torch.int32 and count.tolist() == want_count


@pytest.mark.parametrize("rows, k, local_num_experts, num_experts, rank", [
    (7, 3, 3, 9, 1), (1, 1, 1, 2, 0), (40, 8, 5, 20, 3), (300, 6, 32, 64, 1), (3, 2, 4, 8, 0)])
def test_route_triton_matches_ref(kernel_device, rows, k, local_num_experts, num_experts, rank):
    ids = _ids(rows * k, rows, k, num_experts, kernel_device)
    slab = torch.full((rows, k + 3), 99, dtype=torch.int64, device=kernel_device)
    slab[:, :k] = ids
    ids = slab[:, :k]  # strided, as the gathered slab's ids are

    def outputs():
        dev = kernel_device
        return (torch.ones(rows, k, dtype=torch.bool, device=dev),
                *(torch.full((rows, k), -7, dtype=torch.int64, device=dev) for _ in range(3)),
                torch.full((local_num_experts,), -7, dtype=torch.int32, device=dev))

    got, want = outputs(), outputs()
    ll.route_triton(ids, rank, local_num_experts, *got)
    ll.route_ref(ids, rank, local_num_experts, *want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert int(want[-1].sum()) == int(want[0].sum())


def test_route_drops_overflowing_duplicates(kernel_device):
    """A token listing one expert in every slot: the expert's slice holds R*N rows, the rest drop,
    marked recv_row -1; pairs for other ranks' experts keep recv_row 0."""
    ids = torch.tensor([[0, 0, 0], [0, 0, 5]], dtype=torch.int64, device=kernel_device)
    for fn in (ll.route_triton, ll.route_ref):
        out = (torch.ones(2, 3, dtype=torch.bool, device=kernel_device),
               *(torch.full((2, 3), 9, dtype=torch.int64, device=kernel_device) for _ in range(3)),
               torch.full((1,), 9, dtype=torch.int32, device=kernel_device))
        fn(ids, 0, 1, *out)
        served, _, pos, recv_row, count = out
        assert served.tolist() == [[True, True, False], [False, False, False]]
        assert pos[served].tolist() == [0, 1] and count.tolist() == [2]
        assert recv_row.tolist() == [[0, 1, -1], [-1, -1, 0]]


def test_busiest_expert_and_capacity():
    ids = torch.tensor([[2, 2, -1], [2, 0, 1], [-1, -1, -1]])
    assert ll.busiest_expert(ids, 4).tolist() == [3, 2]
    assert ll.busiest_expert(ids[:0], 4).tolist() == [0, 0]  # no tokens
    ll.check_expert_capacity([[3, 2], [1, 0]], 3)
    with pytest.raises(ValueError, match=r"num_max_dispatch_tokens_per_rank=2 \(rank 0 sends 3 to "
                                         r"expert 2; rank 1 sends 4 to expert 0\): a token's top-k "
                                         r"repeats an expert"):
        ll.check_expert_capacity([[3, 2], [4, 0], [2, 1]], 2)


def _routing(seed, rows, k, local_num_experts, device):
    served, local, pos, _, _ = ll.route(_ids(seed, rows, k, 2 * local_num_experts, device), 1, local_num_experts)
    return served, local, pos


@pytest.mark.parametrize("rows, k, local_num_experts, width, dtype", [
    (6, 3, 4, 40, torch.uint8),      # awkward width, bytes
    (5, 2, 2, 5, torch.float32),     # scales: column-major destination
    (1, 1, 1, 7, torch.uint8),       # one row
    (4, 2, 3, 1100, torch.uint8),    # wider than one column block
])
def test_scatter_rows_triton_matches_ref(kernel_device, rows, k, local_num_experts, width, dtype):
    served, local, pos = _routing(rows + width, rows, k, local_num_experts, kernel_device)
    g = torch.Generator().manual_seed(width)
    wide = torch.randint(0, 255, (rows, width + 3), generator=g).to(dtype).to(kernel_device)
    src = wide[:, 1:width + 1]  # a strided view, as the slab's fields are
    if dtype == torch.float32:
        make = lambda: torch.full((local_num_experts, width, rows), float("nan"), device=kernel_device).transpose(1, 2)
    else:
        make = lambda: torch.full((local_num_experts, rows, width), 0xAB, dtype=dtype, device=kernel_device)
    got, want = make(), make()
    ll.scatter_rows_triton(src, got, served, local, pos)
    ll.scatter_rows_ref(src, want, served, local, pos)
    assert torch.equal(got.view(torch.uint8) if dtype == torch.uint8 else got.nan_to_num(-1.0),
                       want.view(torch.uint8) if dtype == torch.uint8 else want.nan_to_num(-1.0))
    assert served.any() or rows == 1  # the cases route something here


@pytest.mark.parametrize("rows, k, local_num_experts, width, width2", [(6, 3, 4, 1100, 9), (3, 2, 2, 40, 56)])
def test_scatter_rows_two_planes_one_launch(kernel_device, rows, k, local_num_experts, width, width2):
    """Data bytes and column-major float32 scales in one launch, as the dispatch sends them."""
    served, local, pos = _routing(rows * width2, rows, k, local_num_experts, kernel_device)
    g = torch.Generator().manual_seed(width2)
    src = torch.randint(0, 255, (rows, width), generator=g, dtype=torch.uint8).to(kernel_device)
    src2 = torch.randn(rows, width2 + 2, generator=g).to(kernel_device)[:, 1:width2 + 1]
    make = lambda: torch.full((local_num_experts, rows, width), 0xAB, dtype=torch.uint8, device=kernel_device)
    make2 = lambda: torch.full((local_num_experts, width2, rows), float("nan"), device=kernel_device).transpose(1, 2)
    (got, got2), (want, want2) = (make(), make2()), (make(), make2())
    ll.scatter_rows_triton(src, got, served, local, pos, src2, got2)
    ll.scatter_rows_ref(src, want, served, local, pos, src2, want2)
    assert torch.equal(got, want) and torch.equal(got2.nan_to_num(-1.0), want2.nan_to_num(-1.0))
    p, j = served.nonzero(as_tuple=True)  # and the reference copies what the routing says
    assert p.numel() and torch.equal(want2[local[p, j], pos[p, j]], src2[p])


def test_scatter_rows_nothing_served(kernel_device):
    served = torch.zeros(3, 2, dtype=torch.bool, device=kernel_device)
    zeros = torch.zeros(3, 2, dtype=torch.int64, device=kernel_device)
    dst = torch.full((2, 3, 16), 7, dtype=torch.uint8, device=kernel_device)
    ll.scatter_rows_triton(torch.zeros(3, 16, dtype=torch.uint8, device=kernel_device), dst, served, zeros, zeros)
    assert (dst == 7).all()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, local_num_experts, hidden", [(6, 3, 4, 256), (1, 1, 1, 128), (5, 4, 2, 2176)])
def test_partial_sums_triton_matches_ref(kernel_device, rows, k, local_num_experts, hidden, out_dtype):
    served, local, pos = _routing(rows * k + hidden, rows, k, local_num_experts, kernel_device)
    recv_row = torch.where(served, local * rows + pos, 0)
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(local_num_experts * rows, hidden, generator=g).to(torch.bfloat16).to(kernel_device)
    x[recv_row[~served]] = float("nan")  # rows only unserved slots point at: never read
    w = torch.rand(rows, k, generator=g).to(kernel_device)
    w[~served] = float("nan")
    got = torch.full((rows, hidden), float("nan"), dtype=out_dtype, device=kernel_device)
    want = torch.full((rows, hidden), float("nan"), dtype=out_dtype, device=kernel_device)
    if served.any():
        used = recv_row[served].unique()
        x[used] = torch.randn(used.numel(), hidden, generator=g).to(torch.bfloat16).to(kernel_device)
    ll.partial_sums_triton(x, recv_row, served, w, got)
    ll.partial_sums_ref(x, recv_row, served, w, want)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    if out_dtype == torch.bfloat16:  # the float32 sums rounded once, to nearest even
        sums = torch.empty(rows, hidden, device=kernel_device)
        ll.partial_sums_ref(x, recv_row, served, w, sums)
        assert torch.equal(want, sums.to(torch.bfloat16))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_partial_sums_dropped_slot_is_nan(kernel_device, out_dtype):
    """A slot dropped by route (recv_row -1) makes its whole row NaN; the other rows are exact."""
    rows, k, hidden = 3, 3, 160
    ids = torch.tensor([[0, 0, 0], [1, 1, -1], [1, 0, -1]], device=kernel_device)
    served, _, _, recv_row, _ = ll.route(ids, 0, 2)
    assert (recv_row < 0).sum() == 1  # expert 0 holds 3 rows: its fourth pair, (2, 1), drops
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * rows, hidden, generator=g).to(torch.bfloat16).to(kernel_device)
    w = torch.rand(rows, k, generator=g).to(kernel_device)
    got, want = (torch.zeros(rows, hidden, dtype=out_dtype, device=kernel_device) for _ in range(2))
    ll.partial_sums_triton(x, recv_row, served, w, got)
    ll.partial_sums_ref(x, recv_row, served, w, want)
    assert torch.isnan(got[2]).all() and torch.isnan(want[2]).all()
    assert torch.isfinite(got[:2]).all() and torch.equal(got[:2], want[:2])


@pytest.mark.parametrize("tokens, n, hidden, k, round_scale", [
    (5, 8, 256, 3, False), (5, 8, 640, 2, True), (0, 4, 256, 1, False), (4, 4, 2048, 8, False),
    (1, 1, 384, 11, True)])
def test_pack_fp8_triton_matches_ref(kernel_device, tokens, n, hidden, k, round_scale):
    g = torch.Generator().manual_seed(tokens * 100 + hidden)
    x = torch.randn(tokens, hidden, generator=g) * torch.logspace(-3, 3, hidden // 128).repeat_interleave(128)
    if tokens:
        x[0, :128] = 0  # an all-zero group: amax takes the floor
    x = x.to(torch.bfloat16).to(kernel_device)
    ids = _ids(hidden, max(tokens, 1), k, 16, kernel_device)[:tokens].contiguous()
    scales_at, data_at, row = ll.row_layout(k, hidden, True)

    def fields(slab):
        return (slab[:, :scales_at].view(torch.int64), slab[:, scales_at:data_at].view(torch.float32),
                slab[:, data_at:data_at + hidden].view(torch.float8_e4m3fn))

    got = torch.full((n, row), 0x7F, dtype=torch.uint8, device=kernel_device)
    want = got.clone()
    ll.pack_fp8_triton(x, ids, *fields(got), round_scale)
    ll.pack_fp8_ref(x, ids, *fields(want), round_scale)
    assert torch.equal(got, want)
    if round_scale and tokens:
        s = fields(got)[1][:tokens]
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)


def test_ll_quant_round_scale_is_the_next_power_of_two():
    """scale_inv = 2**ceil(log2(amax * float32(1/448))), also just above a power of two (where a
    float32 log2 would round down onto the power)."""
    amax = torch.tensor([3.5, 3.5 * (1 + 2**-7), 1344.0, 1e-6]).to(torch.bfloat16)
    rows = torch.zeros(4, 128, dtype=torch.bfloat16)
    rows[:, 5] = -amax
    _, s = ll.ll_quant(rows, round_scale=True)
    v = amax.float().clamp(min=ll.LL_AMAX_FLOOR) * (1.0 / 448)  # float32, as the kernel computes it
    want = torch.exp2(torch.ceil(torch.log2(v.double()))).float()
    assert torch.equal(s[:, 0], want)
    assert s[1, 0] == 2 * s[0, 0] or s[0, 0] > 2.0**-7  # the step above the power is taken


def test_pack_and_slab_fields_round_trip():
    x = (torch.randn(3, 256) * 3).to(torch.bfloat16)
    ids = torch.tensor([[0, 5], [-1, 2], [7, 7]])
    for use_fp8 in (True, False):
        slab = torch.full((5, ll.row_layout(2, 256, use_fp8)[2]), 0x7F, dtype=torch.uint8)
        ll.pack(x, ids, *ll.slab_fields(slab, 2, 256, use_fp8), round_scale=False)
        got_ids, scales, data = ll.slab_fields(slab, 2, 256, use_fp8)
        assert slab.shape[1] % ll.ROW_ALIGN == 0
        assert torch.equal(got_ids[:3], ids) and (got_ids[3:] == -1).all()
        if use_fp8:
            q, s = ll.ll_quant(x, False)
            assert torch.equal(data[:3], q.view(torch.uint8)) and torch.equal(scales[:3], s)
        else:
            assert scales is None and torch.equal(data[:3].contiguous().view(torch.bfloat16), x)


# ---------------------------------------------------------------- 64-bit offsets (GPU)
@pytest.mark.gpu
def test_scatter_rows_past_2_31_elements():
    rows, width, local_num_experts = 2**19 + 64, 2048, 2
    assert local_num_experts * rows * width > INT64_ROWS
    src = torch.randint(0, 255, (rows, width), dtype=torch.uint8, device="cuda")
    served = torch.zeros(rows, 1, dtype=torch.bool, device="cuda")
    served[-5:] = True  # the last source rows go to the last rows of the last expert
    local = torch.full((rows, 1), local_num_experts - 1, dtype=torch.int64, device="cuda")
    pos = torch.arange(rows, device="cuda").view(rows, 1)
    dst = torch.zeros(local_num_experts, rows, width, dtype=torch.uint8, device="cuda")
    ll.scatter_rows_triton(src, dst, served, local, pos)
    assert torch.equal(dst[-1, -5:], src[-5:])
    assert not dst[-1, :-5].any() and not dst[0].any()


@pytest.mark.gpu
def test_partial_sums_past_2_31_elements():
    rows, hidden = 2**20 + 64, 2048
    assert rows * hidden > INT64_ROWS
    x = torch.zeros(rows, hidden, dtype=torch.bfloat16, device="cuda")
    x[-3:] = torch.randn(3, hidden, device="cuda").to(torch.bfloat16)
    recv_row = torch.tensor([[rows - 1, rows - 2], [rows - 3, 0]], device="cuda")
    served = torch.tensor([[True, True], [True, False]], device="cuda")
    w = torch.rand(2, 2, device="cuda")
    got = torch.empty(2, hidden, device="cuda")
    want = torch.empty(2, hidden, device="cuda")
    ll.partial_sums_triton(x, recv_row, served, w, got)
    ll.partial_sums_ref(x, recv_row, served, w, want)
    assert torch.equal(got, want) and got.abs().sum() > 0
