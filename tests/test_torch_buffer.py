"""TorchAll2AllBuffer against plain computations of the same global problem, on gloo ranks.

Every rank builds the whole problem (all ranks' tokens and routing) from one seed, so each can
compute what it should receive and what should come back without extra communication.
"""

import pytest
import torch
from _dist import device_for, run_distributed

from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer

H_HT = 256      # any hidden works in normal mode
H_LL = 2048     # smallest hidden DeepEP's low-latency kernels support


def make_problem(seed, tokens, num_experts, k, hidden, mode="uneven", device="cpu"):
    """Per rank: bf16 x [T_r, H], int64 topk_idx [T_r, k] (distinct ids, some -1), f32 weights.

    mode: "uneven" (experts drawn with skewed probabilities), "one_rank" (every selection on the
    experts of the last rank).
    """
    g = torch.Generator().manual_seed(seed)
    world = len(tokens)
    e_local = num_experts // world
    xs, ids, ws = [], [], []
    for t in tokens:
        xs.append((torch.randn(t, hidden, generator=g) * 2).to(torch.bfloat16))
        if mode == "one_rank":
            lo, hi = num_experts - e_local, num_experts
        else:
            lo, hi = 0, num_experts
        prob = torch.linspace(1.0, 4.0, hi - lo)  # skewed load
        picks = min(k, hi - lo)  # one rank's experts may be fewer than k: pad with -1
        idx = torch.full((t, k), -1, dtype=torch.int64)
        for row in idx:
            row[:picks] = torch.multinomial(prob, picks, replacement=False, generator=g) + lo
        idx[torch.rand(t, k, generator=g) < 0.15] = -1
        ws.append(torch.rand(t, k, generator=g) + 0.1)
        ids.append(idx)
    return ([x.to(device) for x in xs], [i.to(device) for i in ids], [w.to(device) for w in ws])


def _expected_ht(xs, ids, ws, rank, e_local):
    """Rows rank receives: each source's tokens with an expert here, grouped by source."""
    rows, idx, w = [], [], []
    for x, i, wt in zip(xs, ids, ws):
        here = (i >= rank * e_local) & (i < (rank + 1) * e_local)
        sel = here.any(1)
        rows.append(x[sel])
        idx.append(torch.where(here[sel], i[sel] - rank * e_local, -1))
        w.append(torch.where(here[sel], wt[sel], 0.0))
    return torch.cat(rows), torch.cat(idx), torch.cat(w)


HT_CASES = [  # (seed, tokens per rank as a function of world, E, k, mode)
    (0, lambda r: [5 + 3 * i for i in range(r)], 8, 1, "uneven"),
    (1, lambda r: [7] + [0] * (r - 1), 32, 6, "uneven"),      # ranks with no tokens
    (2, lambda r: [4 + i for i in range(r)], 32, 6, "one_rank"),
    (6, lambda r: [0] * r, 8, 2, "uneven"),                    # nothing anywhere
]


def _ht_worker(rank, world):
    dev = device_for(rank)
    buf = TorchAll2AllBuffer(None)
    for seed, tokens, E, k, mode in HT_CASES:
        xs, ids, ws = make_problem(seed, tokens(world), E, k, H_HT, mode, dev)
        x, idx, w = xs[rank], ids[rank], ws[rank]
        e_local = E // world
        per_rank, per_rdma, per_expert, in_rank, event = buf.get_dispatch_layout(idx, E)
        want_in_rank = torch.stack([((idx >= r * e_local) & (idx < (r + 1) * e_local)).any(1)
                                    for r in range(world)], 1) if len(idx) else torch.zeros(0, world, dtype=torch.bool)
        assert torch.equal(in_rank.cpu(), want_in_rank.cpu())
        assert per_rank.dtype == torch.int32 and per_rank.tolist() == want_in_rank.sum(0).tolist()
        assert per_rdma is None and event is None
        assert per_expert.dtype == torch.int32
        assert per_expert.tolist() == torch.bincount(idx[idx >= 0], minlength=E).tolist()

        layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                      is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        recv, ridx, rw, counts, handle, event = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
        want_x, want_idx, want_w = _expected_ht(xs, ids, ws, rank, e_local)
        assert recv.dtype == torch.bfloat16 and torch.equal(recv, want_x)
        assert torch.equal(ridx, want_idx) and torch.equal(rw, want_w)
        assert counts == [int((want_idx == e).sum()) for e in range(e_local)]
        _, _, _, aligned, _, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, expert_alignment=4, **layout)
        assert aligned == [(c + 3) // 4 * 4 for c in counts]

        # FP8 tuple through the cached handle: (recv_x, None, None, None, None, event).
        q = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
        s = torch.rand(x.shape[0], H_HT // 128, device=dev)
        out = buf.dispatch((q, s), handle=handle)
        assert out[1:] == (None, None, None, None, None)
        rq, rs = out[0]
        want_q, _, _ = _expected_ht([xs_r.float().clamp(-448, 448).to(torch.float8_e4m3fn).float() for xs_r in xs],
                                    ids, ws, rank, e_local)
        assert rq.dtype == torch.float8_e4m3fn and torch.equal(rq.float(), want_q)
        assert rs.shape == (recv.shape[0], H_HT // 128) and rs.dtype == torch.float32

        # combine: unweighted sum of each token's copies; rank r scales what it received by r + 1.
        y = (recv.float() * (rank + 1)).to(torch.bfloat16)
        combined, cw, event = buf.combine(y, handle, topk_weights=rw)
        want = torch.zeros(x.shape[0], H_HT, device=dev)
        for r in range(world):
            want += in_rank[:, r:r + 1] * (x.float() * (r + 1)).to(torch.bfloat16).float()
        torch.testing.assert_close(combined.float(), want, rtol=1e-2, atol=1e-2)
        assert combined.dtype == torch.bfloat16 and event is None
        torch.testing.assert_close(cw, torch.where(idx >= 0, w, 0.0))
        bias = torch.ones(x.shape[0], H_HT, dtype=torch.bfloat16, device=dev)
        combined_b, _, _ = buf.combine(y, handle, bias=bias)
        torch.testing.assert_close(combined_b.float(), want + 1, rtol=1e-2, atol=1e-2)

    # Error paths (local checks: every rank raises before communicating).
    xs, ids, ws = make_problem(0, [3] * world, 8, 2, H_HT, "uneven", dev)
    x, idx, w = xs[rank], ids[rank], ws[rank]
    with pytest.raises(ValueError, match="topk_idx values"):
        buf.get_dispatch_layout(torch.full((2, 1), 99, dtype=torch.int64, device=dev), 32)
    with pytest.raises(ValueError, match="topk_idx must be int64"):
        buf.get_dispatch_layout(idx.int(), 32)
    with pytest.raises(ValueError, match="multiple of the rank count"):
        buf.get_dispatch_layout(idx, 32 * world + 1)
    # dispatch checks the range of CPU ids itself, whatever get_dispatch_layout saw.
    idx2 = idx.clone()
    lay = buf.get_dispatch_layout(idx2, 8)
    idx2[0, 0] = 8
    with pytest.raises(ValueError, match=r"topk_idx values must lie in \[-1, 8\)"):
        buf.dispatch(x, topk_idx=idx2, topk_weights=w, num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1],
                     is_token_in_rank=lay[3], num_tokens_per_expert=lay[2])
    with pytest.raises(ValueError, match="needs num_tokens_per_rank"):
        buf.dispatch(x, topk_idx=idx, topk_weights=w)
    with pytest.raises(ValueError, match="no topk_idx"):
        buf.dispatch(x, handle=handle, topk_idx=idx)
    with pytest.raises(ValueError, match="num_worst_tokens"):
        buf.dispatch(x, handle=handle, num_worst_tokens=64)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        buf.dispatch(x[:, :4].contiguous(), handle=handle)
    with pytest.raises(ValueError, match="x must be a contiguous"):
        buf.dispatch(x.t(), handle=handle)
    # What DeepEP's asserts refuse in normal mode.
    with pytest.raises(ValueError, match="topk_idx must be int64 with 2 dims, contiguous"):
        buf.get_dispatch_layout(torch.zeros(2, 3, dtype=torch.int64, device=dev).t(), 8)
    with pytest.raises(ValueError, match="topk_idx and topk_weights go together"):
        buf.dispatch(x, topk_idx=idx, **{k_: v for k_, v in zip(
            ("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert", "is_token_in_rank"),
            lay[:4])})
    with pytest.raises(ValueError, match="num_tokens_per_rank must be int32"):
        buf.dispatch(x, num_tokens_per_rank=lay[0].long(), is_token_in_rank=lay[3], num_tokens_per_expert=lay[2])
    with pytest.raises(ValueError, match="x must be bf16 with 2 dims, contiguous; got torch.float32"):
        buf.combine(y.float(), handle)
    with pytest.raises(ValueError, match="topk_weights must be float32"):
        buf.combine(y, handle, topk_weights=torch.ones(y.shape[0], 2, dtype=torch.float64, device=dev))
    with pytest.raises(ValueError, match="bias must be bf16"):
        buf.combine(y, handle, bias=torch.zeros(x.shape[0], H_HT, device=dev))
    with pytest.raises(ValueError, match="bias takes at most two"):
        buf.combine(y, handle, bias=(None, None, None))
    with pytest.raises(ValueError, match="received token count"):
        buf.combine(y[:0] if y.shape[0] else torch.zeros(1, H_HT, dtype=torch.bfloat16), handle)
    with pytest.raises(ValueError, match="low_latency_mode"):
        buf.low_latency_dispatch(torch.zeros(1, H_LL, dtype=torch.bfloat16, device=dev),
                                 torch.zeros(1, 1, dtype=torch.int64, device=dev), 4, 8 * world)


LL_CASES = [  # (seed, tokens per rank, N, E, k, mode)
    (7, lambda r: [0] * r, 4, 8, 2, "uneven"),                  # nothing anywhere
    (3, lambda r: [3 + i for i in range(r)], 8, 8, 1, "uneven"),
    (4, lambda r: [0] + [4] * (r - 1), 4, 32, 6, "uneven"),     # rank 0 sends nothing
    (5, lambda r: [4] * r, 4, 32, 6, "one_rank"),
]


def _ll_expected(xs, ids, rank, e_local):
    """Per local expert e: rows of (src, token) pairs selecting it, by source then token."""
    slices = []
    for e in range(rank * e_local, (rank + 1) * e_local):
        slices.append(torch.cat([x[(i == e).any(1)] for x, i in zip(xs, ids)]))
    return slices


def _deepep_ll_cast(rows):
    """DeepEP's low-latency FP8 cast, written out independently of the buffer: per 1x128 group of a
    bf16 row, amax = max(max |x|, 1e-4) in float32, scale = 448 / amax (one IEEE division),
    q = clamp(x * scale, +-448) to e4m3 (round to nearest even), scale_inv = amax * float32(1/448)."""
    p, h = rows.shape
    g = rows.float().reshape(p, h // 128, 128)
    amax = torch.maximum(g.abs().amax(-1), torch.tensor(1e-4, dtype=torch.float32, device=rows.device))
    scale = torch.div(torch.full_like(amax, 448.0), amax)
    inv448 = torch.tensor(1.0 / 448.0, dtype=torch.float32, device=rows.device)
    q = torch.clamp(g * scale[..., None], -448.0, 448.0).to(torch.float8_e4m3fn)
    return q.reshape(p, h), amax * inv448


def _ll_worker(rank, world):
    dev = device_for(rank)
    buf = TorchAll2AllBuffer(None, low_latency_mode=True, num_max_dispatch_tokens_per_rank=8,
                             hidden=H_LL, num_experts=32)
    for seed, tokens, n, E, k, mode in LL_CASES:
        xs, ids, ws = make_problem(seed, tokens(world), E, k, H_LL, mode, dev)
        x, idx, w = xs[rank], ids[rank], ws[rank]
        e_local = E // world
        want = _ll_expected(xs, ids, rank, e_local)
        stats = torch.zeros(e_local, dtype=torch.int32, device=dev)

        (rq, rs), count, _, event, hook = buf.low_latency_dispatch(
            x, idx, n, E, cumulative_local_expert_recv_stats=stats)
        assert event is None and hook is None
        assert rq.shape == (e_local, world * n, H_LL) and rq.dtype == torch.float8_e4m3fn
        assert rs.shape == (e_local, world * n, H_LL // 128) and rs.dtype == torch.float32
        assert rs.stride() == (world * n * H_LL // 128, 1, world * n)  # column-major in the last two
        assert count.dtype == torch.int32 and count.tolist() == [len(s) for s in want]
        assert torch.equal(stats, count)
        for e, rows in enumerate(want):
            c = len(rows)
            wq, ws_ = _deepep_ll_cast(rows)
            assert torch.equal(rq[e, :c].view(torch.uint8), wq.view(torch.uint8))
            assert torch.equal(rs[e, :c], ws_)
            deq = rq[e, :c].float() * rs[e, :c].repeat_interleave(128, 1)
            torch.testing.assert_close(deq, rows.float(), rtol=0.07, atol=1e-3)

        # bf16 dispatch, then combine applies the weights: expert g returns x * (g + 1) / E.
        rb, count_b, handle_b, _, hook = buf.low_latency_dispatch(x, idx, n, E, use_fp8=False,
                                                                  return_recv_hook=True)
        hook()
        assert rb.dtype == torch.bfloat16 and torch.equal(count_b, count)
        y = torch.full_like(rb, float("nan"))  # rows past count must never be read
        for e, rows in enumerate(want):
            assert torch.equal(rb[e, :len(rows)], rows)
            y[e, :len(rows)] = (rows.float() * (rank * e_local + e + 1) / E).to(torch.bfloat16)
        out = torch.full_like(x, float("nan"))
        combined, event, hook = buf.low_latency_combine(y, idx, w, handle_b, out=out)
        assert combined is out and event is None and hook is None
        ref = torch.zeros(x.shape[0], H_LL, device=dev)
        for j in range(k):
            gid = idx[:, j]
            f = ((x.float() * (gid.clamp(min=0) + 1).unsqueeze(1) / E).to(torch.bfloat16)).float()
            ref += torch.where((gid >= 0).unsqueeze(1), f * w[:, j:j + 1], 0.0)
        torch.testing.assert_close(combined.float(), ref, rtol=1e-2, atol=1e-2)
        combined2, _, _ = buf.low_latency_combine(y, idx, w, handle_b)  # allocates its output
        assert torch.equal(combined2, combined)

    # round_scale: power-of-two scales
    (rq, rs), count, _, _, _ = buf.low_latency_dispatch(x, idx, n, E, round_scale=True)
    for e in range(e_local):
        s = rs[e, :int(count[e])]
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)

    # Errors DeepEP would assert on (all local: every rank raises before communicating).
    one = torch.zeros(1, 1, dtype=torch.int64, device=dev)
    xb = torch.ones(1, H_LL, dtype=torch.bfloat16, device=dev)
    with pytest.raises(ValueError, match="too small.*needs .* bytes"):
        buf.low_latency_dispatch(xb, one, 16, 32)            # N larger than the buffer's
    with pytest.raises(ValueError, match="too small"):
        buf.low_latency_dispatch(xb, one, 8, 64)             # more experts than sized for
    with pytest.raises(ValueError, match="hidden=1024 is not supported"):
        buf.low_latency_dispatch(torch.ones(1, 1024, dtype=torch.bfloat16, device=dev), one, 4, 32)
    with pytest.raises(ValueError, match="exceed num_max_dispatch_tokens_per_rank=1"):
        buf.low_latency_dispatch(xb.expand(2, -1).contiguous(), one.expand(2, -1).contiguous(), 1, 32)
    with pytest.raises(ValueError, match="not divisible|multiple of the rank count"):
        buf.low_latency_dispatch(xb, one, 4, 32 + 1 if world > 1 else 0)
    with pytest.raises(ValueError, match="top-k 12"):
        buf.low_latency_dispatch(xb, one.expand(1, 12).contiguous() * 0 + torch.arange(12, device=dev), 4, 32)
    with pytest.raises(ValueError, match="must be bf16"):
        buf.low_latency_dispatch(xb.float(), one, 4, 32)
    with pytest.raises(ValueError, match="ue8m0"):
        buf.low_latency_dispatch(xb, one, 4, 32, round_scale=True, use_ue8m0=True)
    with pytest.raises(ValueError, match="mutually exclusive"):
        buf.low_latency_dispatch(xb, one, 4, 32, async_finish=True, return_recv_hook=True)
    with pytest.raises(ValueError, match=r"x must be \[.*\(\[E_local, R\*N, H\]\)"):
        buf.low_latency_combine(y[:, :1].contiguous(), idx, w, handle_b)
    # What DeepEP's asserts refuse: non-contiguous tensors, non-bf16 expert outputs, weights with
    # more rows than N, stats of the wrong dtype or size.
    with pytest.raises(ValueError, match="x must be bf16 with 2 dims, contiguous"):
        buf.low_latency_dispatch(torch.ones(H_LL, 2, dtype=torch.bfloat16, device=dev).t(), one.expand(2, -1), 4, 32)
    with pytest.raises(ValueError, match="topk_idx must be int64 with 2 dims, contiguous"):
        buf.low_latency_dispatch(xb.expand(2, -1).contiguous(), one.expand(2, -1), 4, 32)
    with pytest.raises(ValueError, match="cumulative_local_expert_recv_stats must be int32"):
        buf.low_latency_dispatch(xb, one, 4, 32, cumulative_local_expert_recv_stats=torch.zeros(
            32 // world, dtype=torch.int64, device=dev))
    with pytest.raises(ValueError, match=r"cumulative_local_expert_recv_stats must be \[\d+\]"):
        buf.low_latency_dispatch(xb, one, 4, 32, cumulative_local_expert_recv_stats=torch.zeros(
            1 + 32 // world, dtype=torch.int32, device=dev))
    with pytest.raises(ValueError, match="dispatch_wait_recv_cost_stats must be int64"):
        buf.low_latency_dispatch(xb, one, 4, 32, dispatch_wait_recv_cost_stats=torch.zeros(world, device=dev))
    with pytest.raises(ValueError, match="x must be bf16 with 3 dims, contiguous; got torch.float32"):
        buf.low_latency_combine(y.float(), idx, w, handle_b)
    with pytest.raises(ValueError, match="x must be bf16 with 3 dims, contiguous; got .*non-contiguous"):
        buf.low_latency_combine(y.transpose(0, 1).contiguous().transpose(0, 1), idx, w, handle_b)
    with pytest.raises(ValueError, match="topk_weights must be float32 with 2 dims, contiguous"):
        buf.low_latency_combine(y, idx, w.t().contiguous().t(), handle_b)
    with pytest.raises(ValueError, match=f"at most num_max_dispatch_tokens_per_rank={n}"):
        buf.low_latency_combine(y, idx.new_zeros(n + 1, k), w.new_zeros(n + 1, k), handle_b)
    with pytest.raises(ValueError, match="out must be bf16 with 2 dims, contiguous"):
        buf.low_latency_combine(y, idx, w, handle_b, out=torch.empty(H_LL, x.shape[0], dtype=torch.bfloat16,
                                                                      device=dev).t())
    with pytest.raises(ValueError, match="out must be"):
        buf.low_latency_combine(y, idx, w, handle_b, out=torch.empty(x.shape[0] + 1, H_LL, dtype=torch.bfloat16,
                                                                      device=dev))
    with pytest.raises(ValueError, match="handle returned by low_latency_dispatch"):
        buf.low_latency_combine(y, idx, w, None)
    # N must agree across ranks: every rank sees the mismatch in the count exchange.
    if world > 1:
        with pytest.raises(ValueError, match="differs across ranks"):
            buf.low_latency_dispatch(xb, one, 4 + 4 * (rank % 2), 32)


@pytest.mark.parametrize("world", [2, 4])
def test_high_throughput_gloo(world):
    run_distributed(_ht_worker, world)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_low_latency_gloo(world):
    run_distributed(_ll_worker, world)


def _ll_two_results_worker(rank, world):
    """Two dispatch results held at once (the buffer's two workspaces) combine as if alone; the
    third dispatch of the same size reuses the first one's workspace."""
    dev = device_for(rank)
    n, E, k = 8, 32, 4
    buf = TorchAll2AllBuffer(None, low_latency_mode=True, num_max_dispatch_tokens_per_rank=n,
                             hidden=H_LL, num_experts=E)
    results = []
    for seed in (11, 12):
        xs, ids, ws = make_problem(seed, [5] * world, E, k, H_LL, "uneven", dev)
        x, idx, w = xs[rank], ids[rank], ws[rank]
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, n, E, use_fp8=False)
        y = torch.randn(recv.shape, generator=torch.Generator().manual_seed(seed)).to(recv)
        alone = buf.low_latency_combine(y, idx, w, handle)[0]
        results.append((recv.clone(), count.clone(), handle, recv, x, idx, w, y, alone))
    for kept, kept_count, handle, recv, x, idx, w, y, alone in results:
        assert torch.equal(buf.low_latency_combine(y, idx, w, handle)[0], alone)
        assert torch.equal(handle.workspace.recv_count, kept_count)
        # Rows past an expert's count are uninitialised (as in DeepEP): compare the valid ones.
        for e, c in enumerate(kept_count.tolist()):
            assert torch.equal(recv[e, :c], kept[e, :c])
    third = buf.low_latency_dispatch(results[0][4], results[0][5], n, E, use_fp8=False)[0]
    assert third is results[0][3]


@pytest.mark.parametrize("world", [1, 2])
def test_low_latency_two_results_held(world):
    run_distributed(_ll_two_results_worker, world)


def _ll_repeated_expert_worker(rank, world):
    """Zero ids with k = 3 (a dummy run's routing): each slot is one row for expert 0, as in DeepEP.
    Up to N rows from each rank: every slot counted in the combine. More from one rank than
    DeepEP's N rows per (expert, source rank): every rank refuses, naming the rank."""
    n, E, k = 16, 4, 3
    buf = TorchAll2AllBuffer(None, low_latency_mode=True, num_max_dispatch_tokens_per_rank=n,
                             hidden=H_LL, num_experts=E)
    g = torch.Generator().manual_seed(rank)
    for tokens, refused in ((5, False), (5 + 3 * rank, True)):  # 15 pairs a rank; 24 on rank 1
        x = torch.randn(tokens, H_LL, generator=g).to(torch.bfloat16)
        idx = torch.zeros(tokens, k, dtype=torch.int64)
        w = torch.rand(tokens, k, generator=g)
        if refused:
            with pytest.raises(ValueError, match=r"num_max_dispatch_tokens_per_rank=16 \(rank 1 "
                                                 r"sends 24 to expert 0\): a token's top-k repeats"):
                buf.low_latency_dispatch(x, idx, n, E, use_fp8=False)
            continue
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, n, E, use_fp8=False)
        assert count.tolist() == ([world * tokens * k, 0] if rank == 0 else [0, 0])
        out = torch.full_like(x, float("nan"))
        buf.low_latency_combine(recv, idx, w, handle, out=out)
        want = (x.float() * w.sum(1, keepdim=True))
        torch.testing.assert_close(out.float(), want, rtol=2**-7, atol=1e-2)


def test_low_latency_repeated_expert():
    run_distributed(_ll_repeated_expert_worker, 2)


def _ht_inference_mode_worker(rank, world):
    """The count exchange's cached message, first made inside torch.inference_mode (as vLLM runs
    a forward), serves a dispatch outside it: the same rows arrive."""
    buf = TorchAll2AllBuffer(None)
    xs, ids, ws = make_problem(7, [5] * world, 4 * world, 2, H_HT)
    x, idx, w = xs[rank], ids[rank], ws[rank]

    def call():
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4 * world)
        return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)[:3]

    with torch.inference_mode():
        inside = [t.clone() for t in call()]
    outside = call()
    assert all(torch.equal(a, b) for a, b in zip(outside, inside))
    assert inside[0].shape[0] > 0


def test_high_throughput_inference_mode_then_outside():
    run_distributed(_ht_inference_mode_worker, 2)


def test_needs_distributed_and_sizes():
    with pytest.raises(ValueError, match="initialised"):
        TorchAll2AllBuffer(None)


def test_static_helpers():
    assert TorchAll2AllBuffer.get_low_latency_rdma_size_hint(128, 7168, 2, 256) == 1_908_410_496
    cfg = TorchAll2AllBuffer.get_dispatch_config(2)
    assert (cfg.num_max_nvl_chunked_send_tokens, cfg.num_max_nvl_chunked_recv_tokens) == (24, 256)
    with pytest.raises(ValueError, match="tuned"):
        TorchAll2AllBuffer.get_combine_config(3)
    with pytest.raises(ValueError, match="even"):
        TorchAll2AllBuffer.set_num_sms(3)


def _sizes_worker(rank, world):
    with pytest.raises(ValueError, match="positive"):
        TorchAll2AllBuffer(None, low_latency_mode=True, num_max_dispatch_tokens_per_rank=8)


def test_low_latency_needs_sizes():
    run_distributed(_sizes_worker, 2)


def _nccl_worker(rank, world):
    _ht_worker(rank, world)
    _ll_worker(rank, world)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("world", sorted({2, min(4, torch.cuda.device_count())} if torch.cuda.is_available() else {2}))
def test_nccl(world):
    run_distributed(_nccl_worker, world, backend="nccl")
