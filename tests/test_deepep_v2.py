"""DeepEP V2's API on torch.distributed (TorchElasticBuffer) and the V2 prepare/finalize, on gloo
ranks (2 and 4).

The buffer is checked against what V2's own reference dispatch/combine compute
(deep_ep/utils/refs.py at DeepEP main dd758ca: each token once per destination rank, local ids,
-1 elsewhere; combine an unweighted sum plus bias); the layer through
DeepEPV2PrepareAndFinalize + TritonExperts against moe_reference (float32) and, tightly, the
one-rank NoEP kernel on the same FP8 arithmetic, with and without the CPU sync.
"""

import pytest
import torch
from _dist import device_for, run_distributed
from test_torch_buffer import make_problem

from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer
from vllm_moe_fixes.distributed.torch_elastic_buffer import TorchElasticBuffer
from vllm_moe_fixes.fused_moe.contiguous_experts import TritonExperts
from vllm_moe_fixes.fused_moe.deepep_prepare_finalize import DeepEPV2PrepareAndFinalize
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.fused_moe.no_ep_prepare_finalize import NoEPPrepareAndFinalize
from vllm_moe_fixes.testing import moe_reference, random_fp8_moe_weights, rel_err

H = 256      # hidden size (a multiple of 128: our scale groups; of 32: V2's FP8 rows)
INTER = 128  # intermediate size I
N = 16       # num_max_tokens_per_rank


def _expected(xs, ids, ws, rank, e_local):
    """V2's reference dispatch, as rank receives it: every source's tokens with an expert here,
    source rank by source rank in token order; ids local or -1; the full weight rows."""
    rows, idx, w, src = [], [], [], []
    for s, (x, i, wt) in enumerate(zip(xs, ids, ws)):
        here = (i >= rank * e_local) & (i < (rank + 1) * e_local)
        sel = here.any(1)
        rows.append(x[sel])
        idx.append(torch.where(here[sel], i[sel] - rank * e_local, -1))
        w.append(wt[sel])
        src.append(torch.full((int(sel.sum()),), s))
    return torch.cat(rows), torch.cat(idx), torch.cat(w), torch.cat(src)


CASES = [  # (seed, tokens per rank as a function of the world size, E, k, routing mode)
    (20, lambda r: [5 + 3 * i for i in range(r)], 8, 1, "uneven"),
    (21, lambda r: [9] + [0] * (r - 1), 32, 6, "uneven"),       # ranks with no tokens
    (22, lambda r: [6] * r, 32, 6, "one_rank"),                  # all on the last rank's experts
    (23, lambda r: [0] * r, 8, 2, "uneven"),                     # nothing anywhere
    (24, lambda r: [0] * r, 8, 1, "uneven"),  # nothing, and received rows of 524 bytes
]


def _buffer_worker(rank, world):
    dev = device_for(rank)
    buf = TorchElasticBuffer(None, num_max_tokens_per_rank=N, hidden=H, num_topk=6,
                             use_fp8_dispatch=True)
    assert buf.num_bytes % 2**21 == 0 and buf.get_logical_domain_size() == (1, world)
    for seed, tokens, E, k, mode in CASES:
        xs, ids, ws = make_problem(seed, tokens(world), E, k, H, mode, dev)
        x, idx, w = xs[rank], ids[rank], ws[rank]
        e_local = E // world
        want_x, want_idx, want_w, want_src = _expected(xs, ids, ws, rank, e_local)
        stats = torch.full((e_local,), 5, dtype=torch.int32)
        recv, ridx, rw, handle, event = buf.dispatch(
            x, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=4,
            cumulative_local_expert_recv_stats=stats)
        assert event is None and torch.equal(recv, want_x) and torch.equal(ridx, want_idx)
        here = want_idx >= 0
        assert torch.equal(rw[here], want_w[here])  # V2 leaves the -1 slots undefined
        counts = [int((want_idx == e).sum()) for e in range(e_local)]
        assert stats.tolist() == [c + 5 for c in counts]
        aligned = [(c + 3) // 4 * 4 for c in counts]
        assert handle.num_recv_tokens_per_expert_list == aligned
        assert handle.psum_num_recv_tokens_per_expert.tolist() == \
            torch.tensor(aligned).cumsum(0).tolist()
        per_src = torch.bincount(want_src, minlength=world)
        assert handle.psum_num_recv_tokens_per_scaleup_rank.tolist() == per_src.cumsum(0).tolist()
        assert torch.equal(handle.topk_idx, idx)
        assert handle.topk_idx.data_ptr() != idx.data_ptr() or idx.numel() == 0  # a copy

        # FP8 with column-major scales, no CPU sync: R*N rows, the valid prefix first.
        q = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
        s = torch.rand(x.shape[0], H // 128, device=dev) + 0.5
        (rq, rs), ridx2, rw2, h2, _ = buf.dispatch(
            (q, s), topk_idx=idx, topk_weights=w, num_experts=E, do_cpu_sync=False,
            use_tma_aligned_col_major_sf=True)
        v = want_x.shape[0]
        assert rq.shape == (world * N, H) and h2.num_recv_tokens == world * N
        assert int(h2.psum_num_recv_tokens_per_scaleup_rank[-1]) == v
        assert h2.num_recv_tokens_per_expert_list == []
        assert rs.shape == (world * N, H // 128) and rs.stride() == (1, -(-world * N // 4) * 4)
        want_q = want_x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(rq[:v].view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(ridx2[:v], want_idx) and (ridx2[v:] >= 2**40).all()
        assert torch.isnan(rw2[v:]).all() and torch.isnan(rq[v:].float()).all()

        # A cached dispatch moves new data along the same routes.
        x2 = (x.float() * 2).to(torch.bfloat16)
        recv3, ridx3, rw3, h3, _ = buf.dispatch(x2, handle=handle)
        assert h3 is handle and rw3 is None and torch.equal(ridx3, ridx)
        assert torch.equal(recv3, (want_x.float() * 2).to(torch.bfloat16))

        # combine: rank r scales what it received by r + 1; the sum over ranks, plus bias.
        y = (recv.float() * (rank + 1)).to(torch.bfloat16)
        bias = torch.randn(x.shape[0], H).to(torch.bfloat16)
        out, cw, event = buf.combine(y, handle, topk_weights=rw, bias=bias)
        want = bias.float().clone()
        for r in range(world):
            dest = ((idx >= r * e_local) & (idx < (r + 1) * e_local)).any(1, keepdim=True)
            want += dest * (x.float() * (r + 1)).to(torch.bfloat16).float()
        torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)
        assert out.dtype == torch.bfloat16 and event is None
        assert torch.equal(cw, torch.where(idx >= 0, w, 0.0))  # from each slot's owner
        y2 = torch.zeros(world * N, H, dtype=torch.bfloat16)
        y2[:v] = y
        y2[v:] = float("nan")  # rows past the valid ones are not read
        out2, _, _ = buf.combine(y2, h2)
        torch.testing.assert_close(out2.float(), want - bias.float(), rtol=1e-2, atol=1e-2)

    # What V2 asserts, refused with the rule (local checks: every rank raises before talking).
    xs, ids, ws = make_problem(0, [3] * world, 8, 2, H, "uneven", dev)
    x, idx, w = xs[rank], ids[rank], ws[rank]
    with pytest.raises(ValueError, match="exceed num_max_tokens_per_rank=2"):
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=8, num_max_tokens_per_rank=2)
    with pytest.raises(ValueError, match="ElasticBuffer too small"):
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=8, num_max_tokens_per_rank=10**5)
    with pytest.raises(ValueError, match="expanded layout is not supported"):
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=8, do_expand=True)
    with pytest.raises(ValueError, match="num_experts is needed"):
        buf.dispatch(x, topk_idx=idx, topk_weights=w)
    with pytest.raises(ValueError, match=r"top-k 33 must lie in \[1, 32\]"):
        buf.dispatch(x, topk_idx=torch.zeros(3, 33, dtype=torch.int64), num_experts=8)
    with pytest.raises(ValueError, match="topk_idx must be int64"):
        buf.dispatch(x, topk_idx=idx.int(), topk_weights=w, num_experts=8)
    with pytest.raises(ValueError, match="at most 2048 experts"):
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=4096)
    with pytest.raises(ValueError, match="topk_idx=None"):
        buf.dispatch(x, topk_idx=idx, handle=handle)
    with pytest.raises(ValueError, match="do_cpu_sync=True cannot"):
        buf.dispatch(x2, handle=handle, do_cpu_sync=True)
    with pytest.raises(ValueError, match="must match the handle"):
        buf.dispatch(x2, handle=handle, num_experts=64)
    with pytest.raises(ValueError, match="received rows"):
        buf.combine(torch.zeros(99, H, dtype=torch.bfloat16), handle)
    with pytest.raises(ValueError, match="needs the handle"):
        buf.combine(y, None)
    with pytest.raises(ValueError, match="multiple of 2 MiB"):
        TorchElasticBuffer(None, num_bytes=2**20)
    with pytest.raises(ValueError, match="explicitly_destroy"):
        buf.destroy()


@pytest.mark.parametrize("world", [2, 4])
def test_elastic_buffer(world):
    run_distributed(_buffer_worker, world)


def _layer_worker(rank, world):
    dev = device_for(rank)
    buf = TorchElasticBuffer(None, num_max_tokens_per_rank=N, hidden=H, num_topk=6,
                             use_fp8_dispatch=True)
    for seed, tokens, E, k, mode in CASES:
        xs, ids, ws = make_problem(seed, tokens(world), E, k, H, mode, dev)
        x, idx, w = xs[rank], ids[rank], ws[rank]
        full = random_fp8_moe_weights(E, H, INTER, generator=torch.Generator().manual_seed(seed))
        e_l = E // world
        local = [t[rank * e_l:(rank + 1) * e_l].contiguous() for t in full]
        expert_map = torch.full((E,), -1, dtype=torch.int32)
        expert_map[rank * e_l:(rank + 1) * e_l] = torch.arange(e_l, dtype=torch.int32)
        ref = moe_reference(x, full.w1, full.w2, w, idx, w1_scale=full.w1_scale,
                            w2_scale=full.w2_scale)
        noep = FusedMoEModularKernel(NoEPPrepareAndFinalize(), TritonExperts())
        tight = noep(x, full.w1, full.w2, w, idx, w1_scale=full.w1_scale,
                     w2_scale=full.w2_scale, global_num_experts=E) if x.shape[0] else None
        for sync in (True, False):
            pf = DeepEPV2PrepareAndFinalize(buf, num_dispatchers=world,
                                            rank_expert_offset=rank * e_l, do_cpu_sync=sync)
            kernel = FusedMoEModularKernel(pf, TritonExperts())
            out = kernel(x, local[0], local[2], w, idx, w1_scale=local[1], w2_scale=local[3],
                         global_num_experts=E, expert_map=expert_map)
            assert out.shape == x.shape and out.dtype == torch.bfloat16
            assert torch.isfinite(out).all()
            if x.shape[0] == 0:
                continue
            assert rel_err(out, ref) < 0.06, rel_err(out, ref)
            assert (out[(idx < 0).all(1)] == 0).all()
            torch.testing.assert_close(out.float(), tight.float(), rtol=2e-2, atol=2e-2)
        if k == 1 and x.shape[0]:  # the router weight on the input
            out = kernel(x, local[0], local[2], w, idx, w1_scale=local[1], w2_scale=local[3],
                         global_num_experts=E, expert_map=expert_map,
                         apply_router_weight_on_input=True)
            ref_in = moe_reference(x, full.w1, full.w2, w, idx, w1_scale=full.w1_scale,
                                   w2_scale=full.w2_scale, apply_router_weight_on_input=True)
            assert rel_err(out, ref_in) < 0.06
    # More tokens than N: the kernel runs chunks of N, the same number on every rank.
    xs, ids, ws = make_problem(30, [2 * N + 3 - rank] * world, 8, 2, H, "uneven", dev)
    full = random_fp8_moe_weights(8, H, INTER, generator=torch.Generator().manual_seed(30))
    e_l = 8 // world
    local = [t[rank * e_l:(rank + 1) * e_l].contiguous() for t in full]
    expert_map = torch.full((8,), -1, dtype=torch.int32)
    expert_map[rank * e_l:(rank + 1) * e_l] = torch.arange(e_l, dtype=torch.int32)
    pf = DeepEPV2PrepareAndFinalize(buf, num_dispatchers=world, rank_expert_offset=rank * e_l)
    out = FusedMoEModularKernel(pf, TritonExperts())(
        xs[rank], local[0], local[2], ws[rank], ids[rank], w1_scale=local[1], w2_scale=local[3],
        global_num_experts=8, expert_map=expert_map)
    ref = moe_reference(xs[rank], full.w1, full.w2, ws[rank], ids[rank], w1_scale=full.w1_scale,
                        w2_scale=full.w2_scale)
    assert rel_err(out, ref) < 0.06


@pytest.mark.parametrize("world", [2, 4])
def test_v2_layer(world):
    run_distributed(_layer_worker, world)


class _FakeElastic:
    """One rank's V2 buffer returning fixed received rows: ids local or -1, NaN weights at the
    -1 slots (V2 leaves them undefined), and R*N rows without the CPU sync."""

    num_max_tokens_per_rank = 4

    def __init__(self, rows):
        self.rows = rows

    def get_buffer_size_hint(self, *args, **kwargs):
        return 2**21

    def dispatch(self, x, *, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank,
                 do_cpu_sync, async_with_compute_stream=False):
        q, s = x
        ids = torch.tensor([[0, -1], [-1, 1], [1, 0]] + [[0, 0]] * (self.rows - 3))
        w = torch.tensor([[0.5, float("nan")], [float("nan"), 0.25], [1.0, 2.0]]
                         + [[float("nan")] * 2] * (self.rows - 3))

        class Handle:
            num_recv_tokens_per_expert_list = [] if not do_cpu_sync else [2, 2]
            psum_num_recv_tokens_per_scaleup_rank = torch.tensor([3], dtype=torch.int32)

        data = torch.zeros(self.rows, q.shape[1], dtype=q.dtype)
        return (data, torch.ones(self.rows, s.shape[1])), ids, w, Handle(), None

    def combine(self, x, handle, async_with_compute_stream=False):
        return x[:1], None, None


@pytest.mark.parametrize("sync, rows", [(True, 3), (False, 8)])
def test_prepare_masks_undefined_slots_and_rows(sync, rows):
    # Rank 3 of 4 (E=8, E_l=2): its local ids 0, 1 are global 6, 7.
    pf = DeepEPV2PrepareAndFinalize(_FakeElastic(rows), num_dispatchers=4, rank_expert_offset=6,
                                    do_cpu_sync=sync)
    a1 = torch.randn(2, 128).to(torch.bfloat16)
    prep = pf.prepare(a1, torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int32), 8, None, False)
    want_ids = [[6, -1], [-1, 7], [7, 6]] + [[-1, -1]] * (rows - 3)
    want_w = [[0.5, 0.0], [0.0, 0.25], [1.0, 2.0]] + [[0.0, 0.0]] * (rows - 3)
    assert prep.topk_ids.tolist() == want_ids and prep.topk_weights.tolist() == want_w
    assert pf.num_recv_tokens_per_expert == ([2, 2] if sync else [])


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank_expert_offset=-1), "rank_expert_offset=-1"),
    (dict(max_tokens_per_rank=0), "max_tokens_per_rank=0"),
    (dict(do_cpu_sync=1), "do_cpu_sync=1 must be a bool"),
    (dict(num_dispatchers=0), "num_dispatchers=0"),
    (dict(topk_idx_dtype=torch.float32), "topk_idx_dtype=torch.float32 must be"),
])
def test_prepare_finalize_arguments(kwargs, match):
    args = dict(num_dispatchers=1, rank_expert_offset=0) | kwargs
    with pytest.raises(ValueError, match=match):
        DeepEPV2PrepareAndFinalize(_FakeElastic(3), **args)
    with pytest.raises(ValueError, match="get_buffer_size_hint"):  # a V1 buffer is refused
        DeepEPV2PrepareAndFinalize(object(), num_dispatchers=1, rank_expert_offset=0)
    pf = DeepEPV2PrepareAndFinalize(_FakeElastic(3), num_dispatchers=1, rank_expert_offset=0)
    with pytest.raises(ValueError, match="exceed max_tokens_per_rank=4"):
        pf.prepare(torch.zeros(5, 128, dtype=torch.bfloat16), torch.ones(5, 1),
                   torch.zeros(5, 1, dtype=torch.int64), 8, None, False)


@pytest.mark.parametrize("buffer", [TorchAll2AllBuffer.__new__(TorchAll2AllBuffer), object()],
                         ids=["v1_stand_in", "object"])
def test_a_wrong_buffer_is_told_what_v2_takes(buffer):
    """V2 takes an ElasticBuffer or its stand-in; the message names those, not V1's buffers
    (it said 'must be a deep_ep.Buffer or TorchAll2AllBuffer ...; got TorchAll2AllBuffer')."""
    with pytest.raises(ValueError, match=r"^buffer must be a deep_ep.ElasticBuffer \(DeepEP V2\)") \
            as refused:
        DeepEPV2PrepareAndFinalize(buffer, num_dispatchers=1, rank_expert_offset=0)
    wanted, _, got = str(refused.value).rpartition("got ")
    assert "ElasticBuffer" in wanted and "TorchElasticBuffer" in wanted, str(refused.value)
    assert "TorchAll2AllBuffer" not in wanted and "deep_ep.Buffer" not in wanted
    assert got == type(buffer).__name__


class _RankedFakeElastic(_FakeElastic):
    """_FakeElastic as rank ``rank_idx`` of ``num_ranks`` (V2's attribute names)."""

    def __init__(self, rank_idx, num_ranks):
        super().__init__(3)
        self.rank_idx, self.num_ranks = rank_idx, num_ranks


@pytest.mark.parametrize("offset, num_dispatchers, expert_map_first, match", [
    (0, 4, None, r"rank_expert_offset=0 does not match the buffer: this is rank 3"),
    (3, 4, None, r"rank_expert_offset=3 does not match the buffer"),  # offset = rank
    (6, 4, 4, r"expert_map disagrees with rank_expert_offset=6"),
])
def test_mis_wired_rank_is_refused_before_the_dispatch(offset, num_dispatchers,
                                                        expert_map_first, match):
    """The V2 prepare checks its wiring as the high-throughput one does: a wrong offset or map
    would hand the experts another rank's global ids and give wrong sums without an error."""
    pf = DeepEPV2PrepareAndFinalize(_RankedFakeElastic(3, 4), num_dispatchers=num_dispatchers,
                                    rank_expert_offset=offset)
    expert_map = None
    if expert_map_first is not None:
        expert_map = torch.full((8,), -1, dtype=torch.int32)
        expert_map[expert_map_first:expert_map_first + 2] = torch.arange(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        pf.prepare(torch.randn(2, 128).to(torch.bfloat16), torch.ones(2, 2),
                   torch.zeros(2, 2, dtype=torch.int32), 8, expert_map, False)


def test_num_dispatchers_other_than_the_buffer_group_is_refused():
    with pytest.raises(ValueError, match=r"num_dispatchers=2 but the buffer's group has 4 ranks"):
        DeepEPV2PrepareAndFinalize(_RankedFakeElastic(3, 4), num_dispatchers=2,
                                   rank_expert_offset=6)
