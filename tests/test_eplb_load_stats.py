"""ExpertLoadStats: device counts over a sliding window, against a per-step bincount reference."""

import pytest
import torch
from _dist import run_distributed

from vllm_moe_fixes.eplb import ExpertLoadStats


def _steps(seed, steps, layers, E, device="cpu"):
    """Random ids per (step, layer), some -1, awkward token counts (0 and 1 among them)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(-1, E, (int(torch.randint(0, 9, (1,), generator=g)), 3),
                           generator=g).to(device) for _ in range(layers)] for _ in range(steps)]


def _reference(ids, window, E):
    """int64 [layers, E]: the counts of the last `window` steps."""
    kept = ids[-window:]
    return torch.stack([sum(torch.bincount(step[layer][step[layer] >= 0].cpu(), minlength=E)
                            for step in kept) for layer in range(len(ids[0]))])


def _record(stats, ids):
    for i, step in enumerate(ids):
        if i:
            stats.step()
        for layer, layer_ids in enumerate(step):
            stats.record(layer, layer_ids)


@pytest.mark.parametrize("steps", [1, 3, 7])
def test_window_counts(steps):
    layers, E, window = 2, 5, 3
    ids = _steps(steps, steps, layers, E)
    stats = ExpertLoadStats(layers, E, window)
    stats.counts.fill_(99)  # poisoned: the constructor's zeros are not trusted below
    stats.reset()
    _record(stats, ids)
    want = _reference(ids, window, E)
    assert torch.equal(stats.window_load(), want)
    assert torch.equal(stats.load(1), want[1])


def test_all_zero_ids_count_on_expert_zero():
    stats = ExpertLoadStats(1, 4, 2)
    stats.record(0, torch.zeros(6, 8, dtype=torch.int32))
    assert stats.load(0).tolist() == [48, 0, 0, 0]


def test_bad_arguments():
    with pytest.raises(ValueError, match="window=0 must be a positive int"):
        ExpertLoadStats(1, 4, 0)
    stats = ExpertLoadStats(2, 4, 1)
    with pytest.raises(ValueError, match=r"layer=2 must be an int in \[0, num_layers=2\)"):
        stats.record(2, torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"layer=-1 must be an int"):
        stats.load(-1)


def _group_worker(rank, world):
    stats = ExpertLoadStats(1, 3, 2)
    stats.record(0, torch.full((rank + 1, 2), rank % 3))
    want = torch.zeros(3, dtype=torch.int64)
    for r in range(world):
        want[r % 3] += 2 * (r + 1)
    assert torch.equal(stats.group_load()[0], want)


def test_group_load_sums_the_ranks():
    run_distributed(_group_worker, 2)


@pytest.mark.gpu
def test_record_and_step_in_a_cuda_graph():
    """No host sync: record and step captured once, replayed over new ids in the same buffers."""
    layers, E, window, steps = 2, 16, 3, 5
    ids = _steps(0, steps, layers, E, device="cuda")
    static = [torch.zeros(8, 3, dtype=torch.int64, device="cuda") for _ in range(layers)]
    stats = ExpertLoadStats(layers, E, window, device="cuda")

    def one_step():
        stats.step()
        for layer in range(layers):
            stats.record(layer, static[layer])

    one_step()  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        one_step()
    stats.reset()
    padded = []
    for step in ids:
        for layer in range(layers):
            static[layer].fill_(-1)
            static[layer][:step[layer].shape[0]] = step[layer]
        padded.append([s.clone() for s in static])
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(stats.window_load().cpu(), _reference(padded, window, E))
