"""Random token ids for an engine's dummy (profile) run under data parallelism.

An engine sizes its memory with a dummy forward pass. With all-zero token ids every token has the
same hidden state, so the router sends every token of every data-parallel (DP) rank to the same
top-k experts: the expert-parallel ranks that own them receive DP x more tokens than any real batch
would bring, and the profile run either runs out of memory or reserves far too much.
``maybe_randomize_inputs`` fills the dummy inputs with random token ids (and random embeddings)
for the duration of the run and then puts back exactly what was there.

The random tensors are generated once per (shape, dtype, device[, vocab size]) from a private
generator (the caller's RNG state is untouched) seeded with ``_SEED + rank``, the torch.distributed
rank when a process group is up: every DP rank draws different ids. (With one seed for all, the DP
ranks would send identical batches, and the expert load would be only as balanced as one rank's
few hundred tokens make it: ~1.3x at DeepSeek-R1's EP 32 with 256 tokens per rank, against ~1.05x
for distinct ids.) They are kept in a small module-level cache of at most ``_CACHE_SIZE`` entries,
least recently used evicted first; an engine's dummy runs use a handful of shapes, so in practice
nothing is regenerated.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator

import torch

from vllm_moe_fixes import envs

_SEED = 0
_CACHE_SIZE = 8
_cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()


def _cached_random(key: tuple, make) -> torch.Tensor:
    """Return the cached tensor for ``key``, creating it with ``make()`` on a miss (LRU, bounded)."""
    tensor = _cache.get(key)
    if tensor is None:
        tensor = make()
        _cache[key] = tensor
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    _cache.move_to_end(key)
    return tensor


def _seed() -> int:
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return _SEED + rank


def _generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _random_ids(like: torch.Tensor, vocab_size: int) -> torch.Tensor:
    seed = _seed()
    key = ("ids", tuple(like.shape), like.dtype, like.device, seed, vocab_size)
    return _cached_random(key, lambda: torch.randint(
        0, vocab_size, like.shape, dtype=like.dtype, device=like.device,
        generator=_generator(like.device, seed)))


def _random_embeds(like: torch.Tensor) -> torch.Tensor:
    seed = _seed()
    key = ("embeds", tuple(like.shape), like.dtype, like.device, seed)
    return _cached_random(key, lambda: torch.randn(
        like.shape, dtype=like.dtype, device=like.device, generator=_generator(like.device, seed)))


def _check_writable(name: str, tensor: torch.Tensor) -> None:
    """Refuse a tensor whose elements share memory (an ``expand``-ed tensor, stride 0): writing
    random values into it, or its saved contents back, cannot be done element by element."""
    if torch._debug_has_internal_overlap(tensor) == 1:  # 1: certainly overlapping
        raise ValueError(f"{name} (shape {tuple(tensor.shape)}, stride {tensor.stride()}) has "
                         "elements that share memory (an expanded tensor?): it is written in "
                         "place, so pass a tensor that owns each element (e.g. .clone())")


def _validate(input_ids, vocab_size, dp_size, inputs_embeds) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (
            torch.int32, torch.int64):
        raise ValueError(f"input_ids must be an int32 or int64 tensor, got "
                         f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}")
    _check_writable("input_ids", input_ids)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be an int > 0, got {vocab_size!r}")
    if vocab_size - 1 > torch.iinfo(input_ids.dtype).max:
        raise ValueError(f"vocab_size={vocab_size} does not fit input_ids' dtype {input_ids.dtype}")
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
    if inputs_embeds is not None and (
            not isinstance(inputs_embeds, torch.Tensor) or not inputs_embeds.is_floating_point()):
        raise ValueError(f"inputs_embeds must be None or a floating-point tensor, got "
                         f"{getattr(inputs_embeds, 'dtype', type(inputs_embeds).__name__)}")
    if inputs_embeds is not None:
        _check_writable("inputs_embeds", inputs_embeds)


@contextlib.contextmanager
def maybe_randomize_inputs(input_ids: torch.Tensor, *, vocab_size: int, dp_size: int,
                           inputs_embeds: torch.Tensor | None = None) -> Iterator[bool]:
    """Fill a dummy run's inputs with random values inside the ``with`` block, then restore them.

    Enabled when ``VLLM_RANDOMIZE_DP_DUMMY_INPUTS`` is on and ``dp_size > 1``; otherwise the
    tensors are not touched at all. When enabled, a copy of the current contents is taken on entry,
    the random values are copied in place, and on exit (also when the block raises) the copy is
    copied back: the caller's tensors keep their storage (no reallocation, CUDA-graph friendly) and
    end up holding exactly what they held before.

    Arguments:
        input_ids: int32/int64 tensor of any shape (typically [num_tokens]), CPU or CUDA, each
            element its own memory; holds ids uniform in [0, vocab_size) inside the block.
        vocab_size: int > 0, the model's vocabulary size.
        dp_size: int >= 1, the data-parallel world size.
        inputs_embeds: optional floating tensor of any shape (typically [num_tokens, hidden]); holds
            standard-normal values inside the block.

    Yields:
        ``True`` when the inputs were randomised, ``False`` when nothing was touched.

    Raises:
        ValueError: an argument of the wrong type, dtype or range, or a tensor whose elements
            share memory (expanded, stride 0), named, checked whether or not randomisation is
            enabled; a bad ``VLLM_RANDOMIZE_DP_DUMMY_INPUTS`` value (from ``vllm_moe_fixes.envs``).
    """
    _validate(input_ids, vocab_size, dp_size, inputs_embeds)
    enabled = envs.VLLM_RANDOMIZE_DP_DUMMY_INPUTS  # read (and validated) at dp_size 1 too
    if dp_size == 1 or not enabled:
        yield False
        return
    pairs = [(input_ids, _random_ids(input_ids, vocab_size))]
    if inputs_embeds is not None:
        pairs.append((inputs_embeds, _random_embeds(inputs_embeds)))
    saved = [target.clone() for target, _ in pairs]
    try:
        for target, random in pairs:
            target.copy_(random)
        yield True
    finally:
        for (target, _), before in zip(pairs, saved):
            target.copy_(before)
