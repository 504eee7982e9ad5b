"""maybe_randomize_inputs: random ids inside the block, the exact prior contents after it."""

import pytest
import torch

from vllm_moe_fixes.worker import dummy_run
from vllm_moe_fixes.worker.dummy_run import maybe_randomize_inputs

VOCAB = 1000


@pytest.fixture
def enabled(monkeypatch):
    monkeypatch.setenv("VLLM_RANDOMIZE_DP_DUMMY_INPUTS", "1")
    dummy_run._cache.clear()
    yield
    dummy_run._cache.clear()


def _nonzero_ids(n=37, dtype=torch.int64):
    # Poison-like prior contents: non-zero, outside the vocabulary, so they cannot be "random" ones.
    return torch.arange(n, dtype=dtype) * 7 + VOCAB + 3


def test_enabled_randomises_then_restores_exactly(enabled):
    ids = _nonzero_ids()
    before, ptr = ids.clone(), ids.data_ptr()
    with maybe_randomize_inputs(ids, vocab_size=VOCAB, dp_size=4) as randomised:
        assert randomised is True
        assert ids.data_ptr() == ptr
        assert ((ids >= 0) & (ids < VOCAB)).all()
        assert len(ids.unique()) > 10  # random, not a constant fill
    assert ids.data_ptr() == ptr
    assert torch.equal(ids, before)


def test_embeds_randomised_and_restored(enabled):
    ids = _nonzero_ids(64, torch.int32)
    embeds = torch.full((64, 16), 3.5, dtype=torch.bfloat16)
    ptrs = (ids.data_ptr(), embeds.data_ptr())
    with maybe_randomize_inputs(ids, vocab_size=VOCAB, dp_size=2, inputs_embeds=embeds):
        e = embeds.float()
        assert abs(e.mean()) < 0.2 and 0.8 < e.std() < 1.2  # unit normal
        assert ids.dtype == torch.int32 and ids.max() < VOCAB
    assert (ids.data_ptr(), embeds.data_ptr()) == ptrs
    assert torch.equal(ids, _nonzero_ids(64, torch.int32))
    assert (embeds == 3.5).all()


def test_restores_on_exception(enabled):
    ids = _nonzero_ids()
    embeds = torch.randn(37, 8, generator=torch.Generator().manual_seed(1))
    ids_before, embeds_before = ids.clone(), embeds.clone()
    with pytest.raises(RuntimeError, match="boom"), maybe_randomize_inputs(
            ids, vocab_size=VOCAB, dp_size=8, inputs_embeds=embeds):
        assert not torch.equal(ids, ids_before)
        raise RuntimeError("boom")
    assert torch.equal(ids, ids_before)
    assert torch.equal(embeds, embeds_before)


def test_changes_inside_block_are_overwritten_by_saved_copy(enabled):
    ids = _nonzero_ids()
    before = ids.clone()
    with maybe_randomize_inputs(ids, vocab_size=VOCAB, dp_size=2):
        ids.fill_(0)  # the dummy run may scribble on its inputs
    assert torch.equal(ids, before)


@pytest.mark.parametrize("env, dp_size", [("0", 4), ("1", 1), (None, 4)])
def test_disabled_touches_nothing(monkeypatch, env, dp_size):
    if env is None:
        monkeypatch.delenv("VLLM_RANDOMIZE_DP_DUMMY_INPUTS", raising=False)
    else:
        monkeypatch.setenv("VLLM_RANDOMIZE_DP_DUMMY_INPUTS", env)
    dummy_run._cache.clear()
    ids = _nonzero_ids()
    embeds = torch.ones(37, 4)
    before = ids.clone()
    with maybe_randomize_inputs(ids, vocab_size=VOCAB, dp_size=dp_size,
                                inputs_embeds=embeds) as randomised:
        assert randomised is False
        assert torch.equal(ids, before) and (embeds == 1).all()
    assert torch.equal(ids, before)
    assert not dummy_run._cache  # nothing generated


def test_random_tensor_generated_once_and_reused(enabled, monkeypatch):
    calls = []
    real = torch.randint

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "randint", counting)
    ids = _nonzero_ids()
    seen = []
    for _ in range(3):
        with maybe_randomize_inputs(ids, vocab_size=VOCAB, dp_size=2):
            seen.append(ids.clone())
    assert len(calls) == 1
    assert all(torch.equal(s, seen[0]) for s in seen)
    # Another shape or dtype is another entry.
    other = _nonzero_ids(12, torch.int32)
    with maybe_randomize_inputs(other, vocab_size=VOCAB, dp_size=2):
        pass
    assert len(calls) == 2


def test_cache_is_bounded(enabled):
    for n in range(1, dummy_run._CACHE_SIZE + 5):
        with maybe_randomize_inputs(torch.zeros(n, dtype=torch.int64), vocab_size=VOCAB, dp_size=2):
            pass
    assert len(dummy_run._cache) == dummy_run._CACHE_SIZE


def test_does_not_touch_global_rng(enabled):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    with maybe_randomize_inputs(_nonzero_ids(), vocab_size=VOCAB, dp_size=2):
        pass
    assert torch.equal(torch.rand(3), expected)


def test_bad_env_value_raises(monkeypatch):
    monkeypatch.setenv("VLLM_RANDOMIZE_DP_DUMMY_INPUTS", "maybe")
    with pytest.raises(ValueError, match="VLLM_RANDOMIZE_DP_DUMMY_INPUTS"), \
            maybe_randomize_inputs(_nonzero_ids(), vocab_size=VOCAB, dp_size=2):
        pass


@pytest.mark.parametrize("kwargs, match", [
    ({"input_ids": torch.zeros(4)}, "input_ids"),
    ({"input_ids": [1, 2]}, "input_ids"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"vocab_size": 2.5}, "vocab_size"),
    ({"input_ids": torch.zeros(4, dtype=torch.int32), "vocab_size": 2**40}, "vocab_size"),
    ({"dp_size": 0}, "dp_size"),
    ({"dp_size": True}, "dp_size"),
    ({"inputs_embeds": torch.zeros(4, dtype=torch.int64)}, "inputs_embeds"),
    ({"input_ids": torch.zeros(4, dtype=torch.bool)}, "input_ids must be an int32 or int64"),
    ({"vocab_size": True}, "vocab_size"),
    ({"dp_size": 2.0}, "dp_size"),
    # Expanded (stride 0): refused before anything is written, naming the tensor and the reason.
    ({"input_ids": torch.zeros(1, dtype=torch.int64).expand(8)},
     r"input_ids \(shape \(8,\), stride \(0,\)\) has elements that share memory"),
    ({"input_ids": torch.zeros(2, 1, dtype=torch.int32).expand(2, 4)},
     r"input_ids .* share memory"),
    ({"inputs_embeds": torch.zeros(1, 16).expand(4, 16)}, r"inputs_embeds .* share memory"),
])
def test_bad_arguments(enabled, kwargs, match):
    args = {"input_ids": torch.zeros(4, dtype=torch.int64), "vocab_size": VOCAB, "dp_size": 2, **kwargs}
    ids = args.pop("input_ids")
    with pytest.raises(ValueError, match=match), maybe_randomize_inputs(ids, **args):
        pytest.fail("the block must not run")


def test_strided_but_not_overlapping_ids_are_accepted(enabled):
    base = _nonzero_ids(20)
    before = base.clone()
    ids = base[::2]  # every other element: strided, no element shared
    with maybe_randomize_inputs(ids, vocab_size=VOCAB, dp_size=2):
        assert bool((ids < VOCAB).all()) and torch.equal(base[1::2], before[1::2])
    assert torch.equal(base, before)


@pytest.mark.gpu
def test_cuda_in_place(enabled):
    ids = _nonzero_ids(4096).cuda()
    embeds = torch.full((4096, 64), 2.0, device="cuda", dtype=torch.bfloat16)
    before, ptrs = ids.clone(), (ids.data_ptr(), embeds.data_ptr())
    with maybe_randomize_inputs(ids, vocab_size=VOCAB, dp_size=2, inputs_embeds=embeds):
        assert ids.max().item() < VOCAB and ids.is_cuda
    torch.cuda.synchronize()
    assert (ids.data_ptr(), embeds.data_ptr()) == ptrs
    assert torch.equal(ids, before) and (embeds == 2).all()


def test_ranks_draw_different_ids(enabled, monkeypatch):
    seen = []
    for rank in (0, 1):
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, r=rank: r)
        ids = _nonzero_ids(256)
        with maybe_randomize_inputs(ids, vocab_size=VOCAB, dp_size=2):
            seen.append(ids.clone())
    assert not torch.equal(seen[0], seen[1])
