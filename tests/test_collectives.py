"""run_collective: the collective's result, and no reference of the backend left when it returns."""

import torch
import torch.distributed as dist

from _dist import run_distributed
from vllm_moe_fixes.distributed.collectives import run_collective

CALLS = 300


def _released_worker(rank, world):
    """Per call: did the values arrive, and was an alias still held by gloo when run_collective
    returned? A plain dist.all_to_all_single returns with gloo's worker still holding its tensors
    in a tenth to a quarter of the calls on a 2-core machine."""
    seen = []

    def recording_all_to_all(out, inp, **kwargs):
        seen.append((out, inp))
        dist.all_to_all_single(out, inp, **kwargs)

    still_held = wrong = 0
    for i in range(CALLS):
        inp = torch.arange(4 * world, dtype=torch.int64) + 1000 * rank + i
        out = torch.full((4 * world,), -1, dtype=torch.int64)
        run_collective(recording_all_to_all, out, inp, group=dist.group.WORLD)
        alias_out, alias_in = seen[-1]
        still_held += alias_out._use_count() > 1 or alias_in._use_count() > 1
        want = torch.cat([torch.arange(4 * rank, 4 * rank + 4) + 1000 * r + i
                          for r in range(world)])
        wrong += not torch.equal(out, want)
        seen.clear()
    total = torch.tensor([rank + 1])
    run_collective(dist.all_reduce, total, op=dist.ReduceOp.SUM)
    return still_held, wrong, int(total)


def test_run_collective_returns_after_the_backend_lets_go():
    for still_held, wrong, total in run_distributed(_released_worker, 2):
        assert (still_held, wrong, total) == (0, 0, 3)


def test_run_collective_passes_non_tensors_and_kwargs_unchanged():
    calls = []
    run_collective(lambda *a, **k: calls.append((a, k)), [1, 2], "x", group="g")
    assert calls == [(([1, 2], "x"), {"group": "g"})]
