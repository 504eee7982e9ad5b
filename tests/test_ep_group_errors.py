"""A bad input on one rank is a named error on every rank within seconds, never a hang.

Each case runs an expert-parallel layer on gloo ranks (2 and 4) in a process group of its own,
under a hard timeout: a case that has not answered within CASE_TIMEOUT_S is killed (the whole
process group) and fails as a hang. The ranks catch every error of their calls and return what
they saw (the error's classes, message, `rank` attribute and seconds), so the assertions run in
the test process against the intended behaviour:

- ranks that disagree on the pass count (different max_tokens_across_ranks, high-throughput and
  V2; one rank's VLLM_FUSED_MOE_CHUNK_SIZE changed between two calls that pass
  max_tokens_across_ranks) get a ValueError naming what differs, with both values, on every rank;
- a call refused on one rank only (NaN with VLLM_MOE_CHECK_FINITE=1, an out-of-range id) raises
  a CollectiveRefusal (a ValueError subclass: the name is this file's proposal) on every rank of
  the group in the same call, whose `rank` attribute and message name the refusing rank and whose
  message gives its reason; the callers catch it and their next call runs, in step, to the right
  result;
- max_tokens_across_ranks=10**8 at low-latency N=16 (6.25 M passes) is refused before any
  collective on every rank, naming max_tokens_across_ranks.

Every case is CPU-sized (a few tokens, hidden 256 or 2048, 8 experts); fixed, the file runs in
seconds per case.
"""

import multiprocessing
import os
import re
import signal
import tempfile
import time

import pytest
import torch
from _dist import run_distributed
from test_ep_kernel import check, local_slice, make_weights
from test_torch_buffer import make_problem

from vllm_moe_fixes.distributed import TorchAll2AllBuffer, TorchElasticBuffer, torch_buffer
from vllm_moe_fixes.distributed.collectives import STAMP_DIGEST_BITS, PassStamp, stamp_digest
from vllm_moe_fixes.fused_moe import (
    BatchedTritonExperts,
    DeepEPHTPrepareAndFinalize,
    DeepEPLLPrepareAndFinalize,
    DeepEPV2PrepareAndFinalize,
    FusedMoEModularKernel,
    TritonExperts,
)

CASE_TIMEOUT_S = 10   # a case that has not answered by then hangs: killed and failed
ANSWER_WITHIN_S = 5   # each rank's error must come within this of its call's start
CHUNK = 4             # tokens per dispatch chunk
E, K_TOP = 8, 2       # experts, top-k
H_STANDARD, H_LL = 256, 2048  # hidden sizes: high-throughput and V2; low-latency
REFUSING_RANK = 1

WORLDS = pytest.mark.parametrize("world", [2, 4])


# --- running a case under a hard timeout ----------------------------------------------------

def _case_process(worker, world, tmp, conn) -> None:
    """In a session of its own (killable as one process group): the ranks, then their answers."""
    os.setsid()
    tempfile.tempdir = tmp  # run_distributed's files land where the test process removes them
    try:
        conn.send(("ranks", run_distributed(worker, world)))
    except BaseException as exc:  # a rank failed outside its calls: report it as text
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()
        os._exit(0)


def run_bounded(worker, world: int, timeout_s: float = CASE_TIMEOUT_S) -> list:
    """worker(rank, world) on `world` gloo ranks; the per-rank return values, or a test failure
    naming the hang when the ranks have not all returned within timeout_s."""
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="collective_safety_") as tmp:
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_case_process, args=(worker, world, tmp, writer))
        proc.start()
        writer.close()
        answered = reader.poll(timeout_s)
        if not answered:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.join()
        if not answered:
            pytest.fail(f"{worker.__name__} on {world} ranks: no answer within "
                        f"{timeout_s} s (a rank waits in a collective its peers left)")
        kind, value = reader.recv()
    if kind == "failed":
        pytest.fail(f"{worker.__name__} on {world} ranks failed outside its calls: {value}")
    return value


def outcome(call) -> dict:
    """What one layer call did on this rank: its error (class names, message, `rank` attribute)
    or None, and the seconds it took."""
    start = time.monotonic()
    try:
        call()
    except Exception as exc:
        return {"error": [c.__name__ for c in type(exc).__mro__], "message": str(exc),
                "rank": getattr(exc, "rank", None), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def assert_value_error_on_every_rank(outcomes, *patterns) -> None:
    """Every rank's call raised a ValueError (or subclass) in time whose message matches each
    regular expression."""
    for rank, got in enumerate(outcomes):
        assert got["error"] is not None, f"rank {rank}: the call returned (no error)"
        assert "ValueError" in got["error"], f"rank {rank}: {got['error'][0]}: {got['message']}"
        assert got["seconds"] < ANSWER_WITHIN_S, f"rank {rank}: {got['seconds']:.1f} s"
        for pattern in patterns:
            assert re.search(pattern, got["message"]), (rank, pattern, got["message"])


def assert_refused_on_every_rank(outcomes, refusing_rank: int, reason: str) -> None:
    """Every rank raised CollectiveRefusal naming refusing_rank (attribute and message) and the
    reason (a regular expression)."""
    assert_value_error_on_every_rank(outcomes, rf"\brank {refusing_rank}\b", reason)
    for rank, got in enumerate(outcomes):
        assert "CollectiveRefusal" in got["error"], (rank, got["error"][0], got["message"])
        assert got["rank"] == refusing_rank, (rank, got["rank"])


# --- the layers -------------------------------------------------------------------------------

def _weights(rank, world, hidden, seed):
    """(full weights (w1, s1, w2, s2), this rank's slice (lw1, ls1, lw2, ls2, expert_map))."""
    full = make_weights(seed, E, hidden, "cpu")
    return full, local_slice(rank, world, E, *full)


def _call(kernel, x, idx, w, local, **kwargs):
    lw1, ls1, lw2, ls2, expert_map = local
    return kernel(x, lw1, lw2, w, idx, w1_scale=ls1, w2_scale=ls2, global_num_experts=E,
                  expert_map=expert_map, **kwargs)


def _ht_kernel(rank, world):
    pf = DeepEPHTPrepareAndFinalize(TorchAll2AllBuffer(None), num_dispatchers=world,
                                    rank_expert_offset=rank * (E // world))
    return FusedMoEModularKernel(pf, TritonExperts())


def _v2_kernel(rank, world):
    buffer = TorchElasticBuffer(None, num_max_tokens_per_rank=CHUNK, hidden=H_STANDARD,
                                num_topk=K_TOP, use_fp8_dispatch=True)
    pf = DeepEPV2PrepareAndFinalize(buffer, num_dispatchers=world,
                                    rank_expert_offset=rank * (E // world),
                                    max_tokens_per_rank=CHUNK)
    return FusedMoEModularKernel(pf, TritonExperts())


def _ll_kernel(rank, world, max_tokens_per_rank):
    buffer = TorchAll2AllBuffer(None, low_latency_mode=True,
                                num_max_dispatch_tokens_per_rank=max_tokens_per_rank,
                                hidden=H_LL, num_experts=E)
    pf = DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=world,
                                    max_tokens_per_rank=max_tokens_per_rank)
    return FusedMoEModularKernel(pf, BatchedTritonExperts())


# --- ranks that disagree on the pass count ----------------------------------------------------

def _different_max_tokens(rank, world, make_kernel):
    """The last rank passes max_tokens_across_ranks = 2 * CHUNK (two passes), the others CHUNK
    (one pass); every rank holds 3 tokens, so each value is right on its own rank."""
    os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = str(CHUNK)  # this forked rank's environment only
    xs, ids, ws = make_problem(40, [3] * world, E, K_TOP, H_STANDARD)
    _, local = _weights(rank, world, H_STANDARD, 40)
    kernel = make_kernel(rank, world)
    given = 2 * CHUNK if rank == world - 1 else CHUNK
    return [outcome(lambda: _call(kernel, xs[rank], ids[rank], ws[rank], local,
                                  max_tokens_across_ranks=given))]


def _different_max_tokens_ht(rank, world):
    return _different_max_tokens(rank, world, _ht_kernel)


def _different_max_tokens_v2(rank, world):
    return _different_max_tokens(rank, world, _v2_kernel)


@WORLDS
@pytest.mark.parametrize("worker", [_different_max_tokens_ht, _different_max_tokens_v2],
                         ids=["high_throughput", "v2"])
def test_different_max_tokens_across_ranks_is_an_error_on_every_rank(worker, world):
    (got,) = zip(*run_bounded(worker, world))
    assert_value_error_on_every_rank(got, "max_tokens_across_ranks", rf"\b{CHUNK}\b",
                                     rf"\b{2 * CHUNK}\b")


def _chunk_size_changed_on_one_rank(rank, world):
    """Two calls with max_tokens_across_ranks = 2 * CHUNK: the first at CHUNK tokens per dispatch
    chunk on every rank (two passes), the second after REFUSING_RANK alone halved its chunk size
    (four passes there, two elsewhere)."""
    os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = str(CHUNK)
    xs, ids, ws = make_problem(41, [2 * CHUNK - 1] * world, E, K_TOP, H_STANDARD)
    full, local = _weights(rank, world, H_STANDARD, 41)
    kernel = _ht_kernel(rank, world)
    x, idx, w = xs[rank], ids[rank], ws[rank]

    def first():
        check(_call(kernel, x, idx, w, local, max_tokens_across_ranks=2 * CHUNK), x, *full,
              idx, w)

    results = [outcome(first)]
    if rank == REFUSING_RANK:
        os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = str(CHUNK // 2)
    results.append(outcome(lambda: _call(kernel, x, idx, w, local,
                                         max_tokens_across_ranks=2 * CHUNK)))
    return results


@WORLDS
def test_chunk_size_changed_on_one_rank_is_an_error_on_every_rank(world):
    first, second = zip(*run_bounded(_chunk_size_changed_on_one_rank, world))
    assert all(got["error"] is None for got in first), first
    assert_value_error_on_every_rank(second, "VLLM_FUSED_MOE_CHUNK_SIZE", rf"\b{CHUNK}\b",
                                     rf"\b{CHUNK // 2}\b")


# --- a call refused on one rank only, whose callers go on --------------------------------------

def _refused_then_next_call(rank, world, make_kernel, hidden, spoil):
    """Call 1 with this rank's inputs spoiled by `spoil` on REFUSING_RANK only; every rank
    catches its error and makes call 2 with clean inputs, checked against the reference."""
    xs, ids, ws = make_problem(42, [3] * world, E, K_TOP, hidden)
    full, local = _weights(rank, world, hidden, 42)
    kernel = make_kernel(rank, world)
    x, idx, w = xs[rank], ids[rank], ws[rank]
    bad_x, bad_idx = x.clone(), idx.clone()
    if rank == REFUSING_RANK:
        spoil(bad_x, bad_idx)
    results = [outcome(lambda: _call(kernel, bad_x, bad_idx, w, local))]
    results.append(outcome(lambda: check(_call(kernel, x, idx, w, local), x, *full, idx, w)))
    return results


def _nan_hidden_states(x, idx):
    x[0, 5] = float("nan")


def _out_of_range_id(x, idx):
    idx[0, 0] = E


def _nan_refused_ht(rank, world):
    os.environ["VLLM_MOE_CHECK_FINITE"] = "1"
    return _refused_then_next_call(rank, world, _ht_kernel, H_STANDARD, _nan_hidden_states)


def _bad_id_refused_ll(rank, world):
    return _refused_then_next_call(rank, world, lambda r, w: _ll_kernel(r, w, CHUNK), H_LL,
                                   _out_of_range_id)


@WORLDS
@pytest.mark.parametrize("worker, reason", [(_nan_refused_ht, "finite"),
                                            (_bad_id_refused_ll, "topk_ids")],
                         ids=["nan_high_throughput", "bad_id_low_latency"])
def test_refusal_on_one_rank_is_raised_on_every_rank_and_the_next_call_runs(worker, reason,
                                                                            world):
    refused, following = zip(*run_bounded(worker, world))
    assert_refused_on_every_rank(refused, REFUSING_RANK, reason)
    assert all(got["error"] is None for got in following), following


# --- a bound no buffer or chunk could serve -----------------------------------------------------

def _max_tokens_beyond_any_bound(rank, world):
    """Low-latency N=16, max_tokens_across_ranks=10**8 on every rank (6.25 M passes), then a
    call with the right value."""
    xs, ids, ws = make_problem(43, [3] * world, E, K_TOP, H_LL)
    full, local = _weights(rank, world, H_LL, 43)
    kernel = _ll_kernel(rank, world, 16)
    x, idx, w = xs[rank], ids[rank], ws[rank]
    return [outcome(lambda: _call(kernel, x, idx, w, local, max_tokens_across_ranks=10**8)),
            outcome(lambda: check(_call(kernel, x, idx, w, local, max_tokens_across_ranks=3),
                                  x, *full, idx, w))]


@WORLDS
def test_max_tokens_no_pass_count_could_serve_is_refused_on_every_rank(world):
    refused, following = zip(*run_bounded(_max_tokens_beyond_any_bound, world))
    assert_value_error_on_every_rank(refused, "max_tokens_across_ranks", "100000000")
    assert all(got["error"] is None for got in following), following


# --- the stamp's digest in the count exchange ----------------------------------------------------

def _stamps_whose_digests_sum_alike(rank, world):
    """Four ranks at passes 1, 2, 3 and 2 of a plan, their digests patched to the pass index: the
    digests' sum is 4 times the own digest of ranks 1 and 3, so a check of the sum alone would let
    those go on while their peers gather (a hang). Then all at pass 2: the dispatch runs."""
    torch_buffer.stamp_digest = lambda stamp: stamp.index  # this forked rank's module only
    xs, ids, ws = make_problem(41, [3] * world, E, K_TOP, H_STANDARD)
    buffer = TorchAll2AllBuffer(None)

    def dispatch():
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids[rank], E)
        buffer.dispatch(xs[rank], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=ids[rank],
                        topk_weights=ws[rank])
    outcomes = []
    for index in ((1, 2, 3, 2)[rank], 2):
        buffer.pass_stamp = PassStamp(index, 4, CHUNK, 4 * CHUNK)
        outcomes.append(outcome(dispatch))
    return outcomes


def test_stamps_that_differ_are_seen_by_every_rank_whatever_their_digests_sum_to():
    differ, same = zip(*run_bounded(_stamps_whose_digests_sum_alike, 4))
    assert_value_error_on_every_rank(differ, "different passes",
                                     r"pass index 1 on ranks \[0\], 2 on ranks \[1, 3\]")
    assert all(got["error"] is None for got in same), same


def test_stamp_digest_is_the_same_on_every_host():
    """Not hash(): a fixed function of the stamp's fields, within its bits, different for
    neighbouring passes."""
    digests = [stamp_digest(PassStamp(i, 3, 8192, 20000)) for i in range(3)]
    assert digests[0] == 0x71D297  # pinned: ranks on other hosts and Pythons compute this
    assert all(0 <= d < 2**STAMP_DIGEST_BITS for d in digests)
    assert len(set(digests)) == 3


# --- the harness itself -------------------------------------------------------------------------

def _hang_on_rank_1(rank, world):
    if rank == 1:
        time.sleep(10 * CASE_TIMEOUT_S)
    return rank


def test_a_hang_fails_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="no answer within 3 s"):
        run_bounded(_hang_on_rank_1, 2, timeout_s=3)
    assert time.monotonic() - start < 15


def _answers(rank, world):
    return [outcome(lambda: torch.zeros(1)), outcome(lambda: int("x"))]


def test_answers_come_back_per_rank():
    calls = run_bounded(_answers, 2)
    assert [c[0]["error"] for c in calls] == [None, None]
    assert [c[1]["error"][:2] for c in calls] == [["ValueError", "Exception"]] * 2
