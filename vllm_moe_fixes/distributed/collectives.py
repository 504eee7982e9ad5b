"""Synchronous torch.distributed collectives that return once the backend has let go of the tensors.

gloo runs a collective on one of its worker threads. The caller's ``wait()`` returns as soon as
the worker marks the work complete, but the worker drops its own references to the work's tensors
a moment later. If Python has dropped its references first (a temporary passed to the
collective), the tensor's Python object is now owned by the work, and the worker must take the
GIL to free it. When that happens while the interpreter is finalizing (the collective was near
the end of a script), Python ends the worker thread with ``pthread_exit`` inside the work's
destructor, a ``noexcept`` frame, and the process aborts: "terminate called without an active
exception", exit status 134. On a loaded machine the worker often runs late (a quarter of the
calls return before it lets go), so a script that ends with an exchange aborts now and then.

``run_collective`` passes the collective fresh aliases of the tensors (same storage, a reference
count this module alone holds) and, for CPU tensors, waits until the backend's references are
gone: the worker then frees nothing that needs the GIL, and nothing of the call is left on the
worker when the caller moves on. CUDA tensors (NCCL) are not waited for: NCCL's watchdog holds a
work until the device finishes it, and waiting would synchronise the host with the device.

The second half keeps the ranks of an expert-parallel layer call in step: CollectiveRefusal
and the verdict a refusing rank carries into the pass count all-reduce (encode_verdict,
raise_verdict), and the PassStamp every torch-buffer dispatch compares across the ranks
(check_same_pass).

torch is imported here; ``vllm_moe_fixes.distributed`` does not import this module.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

# How long run_collective waits for a backend to drop its references before it returns anyway.
# gloo drops them within microseconds of being scheduled; the bound only guards against a
# backend that keeps them (the result is complete either way).
RELEASE_TIMEOUT_S = 10.0


def run_collective(collective: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
    """Call ``collective(*args, **kwargs)``, a synchronous collective such as
    ``dist.all_to_all_single`` or ``dist.all_reduce``, and return once the backend holds none of
    the CPU tensors among ``args``.

    Arguments:
        collective: a torch.distributed collective called without ``async_op`` (it has completed
            when it returns).
        *args: its positional arguments; with a CPU tensor among them, each tensor (any shape
            and dtype) is passed as an alias (``tensor.detach()``: the same storage, written in
            place as usual); CUDA tensors alone are passed as they are.
        **kwargs: its keyword arguments (``group=``, ``op=``...), passed unchanged.
    """
    if not any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args):
        collective(*args, **kwargs)  # nothing to wait for: no aliases needed (host work per call)
        return
    aliases = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    collective(*aliases, **kwargs)
    _wait_released(aliases)


def start_collective(collective: Callable[..., Any], /, *args: Any,
                     **kwargs: Any) -> Callable[[], None]:
    """Start ``collective(*args, async_op=True, **kwargs)`` and return ``wait``: calling it
    completes the collective (``work.wait()``: on CPU the host waits; on CUDA the current stream
    waits for the backend's, no host synchronisation) and, as run_collective, returns once the
    backend holds none of the CPU tensors among ``args``. The tensors must stay untouched until
    ``wait`` returns; ``wait`` may be called more than once."""
    aliases = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    work = collective(*aliases, async_op=True, **kwargs)

    def wait() -> None:
        nonlocal work
        if work is not None:
            work.wait()
            work = None
            _wait_released(aliases)

    return wait


def _wait_released(aliases: list) -> None:
    """Return once the backend holds none of the CPU tensors among ``aliases`` (their only other
    reference is the caller's list), or after RELEASE_TIMEOUT_S."""
    cpu = [a for a in aliases if isinstance(a, torch.Tensor) and a.device.type == "cpu"]
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    # An alias's use count is 1 when only the caller's list refers to it.
    while any(a._use_count() > 1 for a in cpu) and time.monotonic() < deadline:
        time.sleep(0)  # releases the GIL; the worker needs none to drop these references


# --- keeping the ranks of a layer call in step ------------------------------------------------
#
# Every pass of an expert-parallel layer call is a dispatch and a combine, collectives of the whole
# group, so a rank that refuses a call alone, or plans another number of passes, leaves its peers
# waiting in a collective until the backend's timeout. Two things carry what the ranks must agree
# on without a collective of their own: the pass count all-reduce of an eager call (a refusal
# rides in it as a verdict, group_max_tokens) and, in the torch buffers, the count exchange every
# dispatch makes anyway (a PassStamp per pass).

class CollectiveRefusal(ValueError):
    """A layer call refused by one rank of an expert-parallel group, raised on every rank of the
    group in the same call (so that none is left waiting in a collective).

    rank: the refusing rank in the group (the lowest one where several refused); reason: what it
    refused, in words. On the refusing rank the message carries its own full error (also chained
    as __cause__); on its peers, the reason."""

    def __init__(self, message: str, *, rank: int, reason: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.reason = reason


# The layer's arguments a refusal can name, in the order a message is searched for them: a
# refusal travels as one small integer (the argument's place here, and whether it was a
# non-finite value), its words are rebuilt on the peers.
_REFUSED_ARGUMENTS = ("hidden_states", "topk_weights", "topk_ids", "w1_scale", "w2_scale", "w1",
                      "w2", "expert_map", "global_num_experts", "max_tokens_across_ranks",
                      "activation", "apply_router_weight_on_input")
_VERDICT_CODES = 2 * (len(_REFUSED_ARGUMENTS) + 1)  # codes per rank in a verdict


def refusal_code(refusal: BaseException) -> int:
    """A refusal's reason as an int in [0, _VERDICT_CODES): 2 * (1 + index of the first argument
    its message names, 0 if none) + 1 where it is a non-finite value."""
    text = str(refusal)
    words = set(text.replace("[", " ").replace(";", " ").replace(":", " ").split())
    named = next((i + 1 for i, name in enumerate(_REFUSED_ARGUMENTS) if name in words), 0)
    return 2 * named + ("must be finite" in text)


def refusal_reason(code: int) -> str:
    """The words of refusal_code's code."""
    named, non_finite = divmod(code, 2)
    argument = _REFUSED_ARGUMENTS[named - 1] if named else "an argument"
    if non_finite:
        return f"{argument} is not finite (VLLM_MOE_CHECK_FINITE=1)"
    return f"{argument} was refused by the layer's checks"


def encode_verdict(rank: int, group_size: int, refusal: BaseException | None) -> int:
    """This rank's verdict as one int for a MAX all-reduce: 0 when it takes the call; else larger
    for lower ranks, so that the reduced verdict names the lowest refusing rank and its reason."""
    if refusal is None:
        return 0
    return (group_size - rank) * _VERDICT_CODES + refusal_code(refusal)


def raise_verdict(verdict: int, rank: int, group_size: int,
                  refusal: BaseException | None) -> None:
    """After the all-reduce: raise CollectiveRefusal on every rank when any rank refused (the
    reduced `verdict`); return when none did. rank: this rank; refusal: this rank's own error."""
    if not verdict:
        return
    ranks_above, code = divmod(verdict, _VERDICT_CODES)
    refusing, reason = group_size - ranks_above, refusal_reason(code)
    in_step = "every rank of the group raises CollectiveRefusal in this call, so none waits"
    if refusal is not None:  # this rank refused: its own message (lowest rank or not)
        raise CollectiveRefusal(f"rank {rank} refused this layer call: {refusal} ({in_step})",
                                rank=rank, reason=refusal_reason(refusal_code(refusal))) \
            from refusal
    raise CollectiveRefusal(f"rank {refusing} refused this layer call: {reason}; its own error "
                            f"gives the values ({in_step})", rank=refusing, reason=reason)


def chunk_size_mismatch(values: str) -> ValueError:
    """The error of ranks whose dispatch chunks differ (values: which ranks have which)."""
    return ValueError(f"VLLM_FUSED_MOE_CHUNK_SIZE differs across the ranks: tokens per dispatch "
                      f"chunk {values} (a low-latency chunk is also capped by "
                      "max_tokens_per_rank), so their pass counts differ; set it to one value on "
                      "every rank")


class PassStamp(NamedTuple):
    """Which pass of which plan a dispatch belongs to, compared across the ranks in the count
    exchange of every torch-buffer dispatch (all zeros: a dispatch outside a layer call)."""

    index: int                  # this pass, from 0
    passes: int                 # the call's pass count
    dispatch_chunk_tokens: int  # VLLM_FUSED_MOE_CHUNK_SIZE, capped by max_tokens_per_rank
    max_tokens: int             # max_tokens_across_ranks as given or agreed; 0: one captured pass


NO_STAMP = PassStamp(0, 0, 0, 0)

# A stamp travels as a digest of this many bits. The count exchange carries it as two columns, d
# and d * d, whose sums over the ranks it computes anyway (beside the counts); sum d_s = R * d and
# sum d_s**2 = R * d**2 hold together only where every rank's d_s equals d (the digests'
# variance is then zero), and every rank reads the same sums. 24 bits keep R * d**2 inside int64
# for groups of up to 2**15 ranks; two different stamps share a digest with probability 2**-24.
STAMP_DIGEST_BITS = 24


def stamp_digest(stamp: PassStamp) -> int:
    """The stamp's digest, in [0, 2**STAMP_DIGEST_BITS): the same on every host and Python
    (unlike hash()), so that ranks on different machines compare the same numbers."""
    data = ",".join(map(str, stamp)).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=STAMP_DIGEST_BITS // 8).digest(),
                          "little")


def _by_value(values: list[int]) -> str:
    """'4 on ranks [0, 1], 8 on ranks [2]'."""
    groups: dict[int, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return ", ".join(f"{v} on ranks {ranks}" for v, ranks in groups.items())


def check_same_pass(stamps: list[list[int]]) -> None:
    """ValueError on every rank unless every rank's PassStamp (stamps[s]: rank s's) is the same,
    naming the field that differs and its value on each rank. Every rank reads the same stamps,
    so every rank raises in the same dispatch and the group stays in step."""
    first = stamps[0]
    if all(s == first for s in stamps):
        return
    index, passes, tokens, max_tokens = (list(field) for field in zip(*stamps))
    if len(set(tokens)) > 1:
        raise chunk_size_mismatch(_by_value(tokens))
    if len(set(max_tokens)) > 1:
        raise ValueError(
            f"max_tokens_across_ranks differs across the ranks: {_by_value(max_tokens)}, giving "
            f"pass counts {_by_value(passes)} ({tokens[0]} tokens per dispatch chunk); pass the "
            "same value, the largest M of the group's ranks, on every rank")
    raise ValueError(f"the ranks are at different passes of a layer call: pass index "
                     f"{_by_value(index)} of {_by_value(passes)} passes (a call refused on some "
                     "ranks only, or a dispatch outside the layer's passes)")
