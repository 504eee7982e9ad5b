"""The near-tie rule every engine and serve test compares greedy tokens with.

Two vLLM runs of one model that differ in rounding (FP8 activations against bf16, another batch,
another rank count, compiled against eager) may pick different tokens where the reference's top
two log-probs are nearly tied: at step 6 of the engine test's first prompt on the Qwen3-MoE tiny
checkpoint, our compiled FP8 run ties tokens 47 and 56 (both -0.7692) and takes 47, where vLLM's
bf16 run puts 56 0.125 above 47. ``check_greedy`` accepts a sequence that equals the
reference's, or whose first difference is such a near-tie, and says which rule it used:

    rule = check_greedy(tokens, reference_tokens, reference_top_logprobs, threshold=NEAR_TIE)
    # "exact" or "near-tie at step 6: gap 0.1250 < 0.3; tokens 56/47"

After the first difference the sequences feed different tokens back, so the rest is not compared.
A pass on a near-tie also raises a ``NearTieAccepted`` warning, which pytest lists in its summary.
The reference's per-step top-2 log-probs come from ``SamplingParams(logprobs=2)`` or the OpenAI
API's ``logprobs: 2``, as ``[{token id: logprob}]`` per step.
"""

from __future__ import annotations

import warnings

# The largest top-2 log-prob gap of the reference at which a first differing token is accepted.
# vLLM computes log-probs from bf16 logits; the tiny checkpoints' top logits lie in [8, 16), where
# one bf16 step is 1/16, so every gap is a multiple of 0.0625. How far the other run moves a gap
# (``largest_gap_move``, printed by every engine and serve test) sets each threshold: a gap up to
# the largest move seen may flip; no larger move has been seen.
# Two runs of one FP8 checkpoint that differ in batching, rank count or compiled/eager mode (the
# serve tests): moves of up to 0.19 (TP 2 + EP compiled against one rank eager) and 0.25 (DP 2 + EP
# compiled against one rank eager); 0.3 accepts gaps up to 0.25.
NEAR_TIE = 0.3
# Our block-FP8 run against vLLM's bf16 run of the dequantised weights (the engine test): FP8
# rounding of the activations moved gaps by up to 0.31 (eager) and 0.44 (compiled); 0.5 accepts
# gaps up to 0.4375. A wrong kernel is caught by that test's log-prob bounds; this rule only lets
# a flip through.
NEAR_TIE_FP8_VS_BF16 = 0.5


class NearTieAccepted(UserWarning):
    """A greedy comparison passed on a near-tie (the message names step, gap and tokens)."""


class GreedyMismatch(AssertionError):
    """A greedy sequence differs from the reference's where the reference had no near-tie."""


def check_greedy(tokens: list[int], reference: list[int],
                 reference_top: list[dict[int, float]], threshold: float = NEAR_TIE) -> str:
    """"exact", or "near-tie at step S: gap G < T; tokens R/O" where ``tokens`` first differs
    from ``reference`` at step S and there the reference's log-prob of its own token R exceeds
    that of ours O by G < T (O among the reference's top-2 at S); otherwise GreedyMismatch naming
    the step, the two tokens and the gap. Lengths must match up to the first difference.

    Args:
        tokens / reference: greedy token ids, ours and the reference run's.
        reference_top: per step of ``reference``, {token id: log-prob} of its top-2 (at least).
        threshold: the largest gap accepted (NEAR_TIE).
    """
    if len(reference_top) < len(reference):
        raise ValueError(f"reference_top has {len(reference_top)} steps for "
                         f"{len(reference)} reference tokens")
    for step, (ours, theirs) in enumerate(zip(tokens, reference)):
        if ours != theirs:
            return _near_tie(step, ours, theirs, reference_top[step], threshold)
    if len(tokens) != len(reference):
        raise GreedyMismatch(f"{len(tokens)} tokens against the reference's {len(reference)}, "
                             "equal where both have one")
    return "exact"


def _near_tie(step: int, ours: int, theirs: int, top: dict[int, float], threshold: float) -> str:
    """The near-tie rule's message for a first difference at ``step``, or GreedyMismatch."""
    top = {int(t): lp for t, lp in top.items()}
    if ours not in top:
        raise GreedyMismatch(f"step {step}: token {ours} against the reference's {theirs}, "
                             f"and {ours} is not in the reference's top-2 {top}")
    gap = top[theirs] - top[ours]
    if not gap < threshold:
        raise GreedyMismatch(f"step {step}: token {ours} against the reference's {theirs}, "
                             f"top-2 log-prob gap {gap:.4f} >= {threshold} (no near-tie)")
    rule = f"near-tie at step {step}: gap {gap:.4f} < {threshold}; tokens {theirs}/{ours}"
    warnings.warn(rule, NearTieAccepted, stacklevel=3)
    return rule


def check_all(got: list[list[int]], reference: list[list[int]],
              reference_top: list[list[dict[int, float]]], labels: list,
              threshold: float = NEAR_TIE) -> list[str]:
    """``check_greedy`` of each sequence of ``got`` against the same one of ``reference``;
    prints one line per sequence (its label, both sequences and the rule) and returns the rules.
    A mismatch raises GreedyMismatch naming the label."""
    if not len(got) == len(reference) == len(reference_top) == len(labels):
        raise ValueError(f"{len(got)} sequences, {len(reference)} references, "
                         f"{len(reference_top)} top-2 lists, {len(labels)} labels")
    rules = []
    for label, ours, ref, top in zip(labels, got, reference, reference_top):
        try:
            rule = check_greedy(ours, ref, top, threshold)
        except GreedyMismatch as e:
            raise GreedyMismatch(f"{label}: {ours} against {ref}: {e}") from None
        print(f"{label}: {ours} against {ref}: {rule}")
        rules.append(rule)
    return rules


def largest_gap_move(tokens: list[int], top: list[dict[int, float]], reference: list[int],
                     reference_top: list[dict[int, float]]) -> float:
    """How far the other run moved the reference's top-2 gap, largest over the steps where both
    runs still agree and name the same two tokens (0.0 where there is none): the measure that
    NEAR_TIE and NEAR_TIE_FP8_VS_BF16 are set from."""
    moves = [0.0]
    for step, (ours, theirs) in enumerate(zip(tokens, reference)):
        mine = {int(t): lp for t, lp in top[step].items()}
        ref = {int(t): lp for t, lp in reference_top[step].items()}
        if len(mine) == len(ref) == 2 and set(mine) == set(ref):
            first, second = sorted(ref, key=ref.get, reverse=True)
            moves.append(abs((ref[first] - ref[second]) - (mine[first] - mine[second])))
        if ours != theirs:
            break
    return max(moves)
