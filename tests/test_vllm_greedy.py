"""The near-tie rule of the engine and serve tests (tests/vllm_support/greedy.py), without vLLM:
equal sequences pass as "exact", a first difference passes only on a near-tie of the reference
(and says so, with a NearTieAccepted warning), a real difference fails naming the step."""

import os
import sys

import pytest

SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_support")
sys.path.insert(0, SUPPORT)
try:
    from greedy import (
        NEAR_TIE,
        GreedyMismatch,
        NearTieAccepted,
        check_all,
        check_greedy,
        largest_gap_move,
    )
finally:
    sys.path.remove(SUPPORT)

REF = [5, 9, 3, 47, 12]
# the reference's top-2 per step; step 3 ties 47 and 56
TOP = [{5: -0.1, 8: -2.5}, {9: -0.3, 2: -1.6}, {3: -0.9, 4: -0.98}, {47: -0.7692, 56: -0.7692},
       {12: -0.2, 1: -3.0}]


def test_equal_sequences_pass_as_exact():
    assert check_greedy(list(REF), REF, TOP) == "exact"


def test_a_first_difference_on_a_tie_passes_and_says_so():
    ours = [5, 9, 3, 56, 60]  # after the flip, the rest is not compared
    with pytest.warns(NearTieAccepted, match="step 3: gap 0.0000"):
        rule = check_greedy(ours, REF, TOP)
    assert rule == f"near-tie at step 3: gap 0.0000 < {NEAR_TIE}; tokens 47/56"


def test_a_gap_just_below_the_threshold_passes():
    top = [dict(t) for t in TOP]
    top[2] = {3: -0.9, 4: -0.9 - NEAR_TIE * 0.99}
    with pytest.warns(NearTieAccepted, match="step 2"):
        assert check_greedy([5, 9, 4, 1, 1], REF, top).startswith("near-tie at step 2")


@pytest.mark.parametrize("ours, match", [
    ([5, 2, 3, 47, 12], r"step 1: token 2 against the reference's 9, top-2 log-prob gap 1\.3000"),
    ([5, 9, 3, 47, 13], r"step 4: token 13 against the reference's 12, and 13 is not in"),
    ([7, 9, 3, 47, 12], r"step 0: token 7 against the reference's 5, and 7 is not in"),
    ([5, 9, 3, 47], r"4 tokens against the reference's 5"),
])
def test_a_real_difference_fails_naming_the_step(ours, match):
    with pytest.raises(GreedyMismatch, match=match):
        check_greedy(ours, REF, TOP)


def test_the_threshold_is_exclusive():
    top = [dict(t) for t in TOP]
    top[1] = {9: -0.3, 2: -0.3 - 0.25}
    with pytest.raises(GreedyMismatch, match="gap 0.2500 >= 0.25"):
        check_greedy([5, 2, 3, 47, 12], REF, top, threshold=0.25)


def test_missing_reference_steps_are_refused():
    with pytest.raises(ValueError, match="reference_top has 4 steps for 5 reference tokens"):
        check_greedy(REF, REF, TOP[:4])


def test_check_all_names_the_sequence_that_fails(capsys):
    with pytest.warns(NearTieAccepted):
        rules = check_all([REF, [5, 9, 3, 56, 1]], [REF, REF], [TOP, TOP], ["p0", "p1"])
    assert rules == ["exact", f"near-tie at step 3: gap 0.0000 < {NEAR_TIE}; tokens 47/56"]
    assert "p1: [5, 9, 3, 56, 1] against [5, 9, 3, 47, 12]: near-tie" in capsys.readouterr().out
    with pytest.raises(GreedyMismatch, match=r"p1: \[5, 8, 3, 47, 12\] against .*step 1"):
        check_all([REF, [5, 8, 3, 47, 12]], [REF, REF], [TOP, TOP], ["p0", "p1"])
    with pytest.raises(ValueError, match="2 sequences, 1 references"):
        check_all([REF, REF], [REF], [TOP], ["p0"])


def test_largest_gap_move_reads_the_steps_both_runs_agree_on():
    ours = [{5: -0.2, 8: -2.0}, {9: -0.3, 2: -1.5}, {3: -0.9, 7: -1.0}, {56: -0.7692, 47: -0.7692},
            {12: -0.2, 1: -9.0}]
    # step 0 moves 0.6, step 1 0.1, step 2 names another token, step 3 flips (counted), step 4
    # (a move of 6.0) comes after the flip
    assert largest_gap_move([5, 9, 3, 56, 1], ours, REF, TOP) == pytest.approx(0.6)
    assert largest_gap_move(list(REF), TOP, REF, TOP) == 0.0
