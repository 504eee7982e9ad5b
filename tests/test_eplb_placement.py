"""ExpertPlacement: tables, validation, and routing to replicas (against a loop reference); the
eplb package's public names."""

import importlib

import pytest
import torch

import vllm_moe_fixes.eplb as eplb
from vllm_moe_fixes.eplb import ExpertPlacement, route_reference

# world 2, E 6, R 2: experts 0 and 3 have a second replica on rank 1.
P2L = [0, 1, 2, 3, 4, 5, 0, 3]


def test_tables_of_a_placement():
    p = ExpertPlacement.from_physical_to_logical(torch.tensor(P2L), 2)
    assert (p.num_physical, p.num_logical, p.num_redundant, p.num_local) == (8, 6, 2, 4)
    assert p.logical_to_physical.tolist() == [[0, 6], [1, -1], [2, -1], [3, 7], [4, -1], [5, -1]]
    assert p.replica_count.tolist() == [2, 1, 1, 2, 1, 1]
    assert p.local_physical_experts(1).tolist() == [4, 5, 6, 7]
    assert p.local_logical_experts(1).tolist() == [4, 5, 0, 3]
    # Every table entry points back at its logical expert.
    for e, row in enumerate(p.logical_to_physical.tolist()):
        assert [P2L[q] for q in row if q >= 0] == [e] * p.replica_count[e]


def test_identity_places_replicas_round_robin():
    p = ExpertPlacement.identity(6, 4, num_redundant=6)
    assert p.physical_to_logical.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]
    assert p.replica_count.tolist() == [2] * 6
    assert ExpertPlacement.identity(8, 2) == ExpertPlacement.from_physical_to_logical(
        torch.arange(8), 2)
    assert ExpertPlacement.identity(8, 2) != ExpertPlacement.identity(8, 4)


@pytest.mark.parametrize("p2l, world, kw, match", [
    ([0, 1, 2], 2, {}, "num_physical=3 must be divisible by world_size=2"),
    ([0, 2, 2, 3], 2, {}, r"lacks logical experts \[1\]"),
    ([0, 1, 2, 3], 2, {"num_logical": 5}, r"lacks logical experts \[4\]"),
    ([0, 1, -1, 3], 2, {}, r"ids in \[-1, 3\], outside \[0, 4\)"),
    ([0.0, 1.0], 1, {}, "must hold integers, got torch.float32"),
    ([[0, 1]], 1, {}, r"1-D \[num_physical\] tensor, got shape \(1, 2\)"),
    ([0, 1], 0, {}, "world_size=0 must be a positive int"),
])
def test_bad_placements(p2l, world, kw, match):
    with pytest.raises(ValueError, match=match):
        ExpertPlacement.from_physical_to_logical(torch.tensor(p2l), world, **kw)


def test_bad_identity_and_rank():
    with pytest.raises(ValueError, match="num_redundant=-1 must be an int >= 0"):
        ExpertPlacement.identity(4, 2, num_redundant=-1)
    with pytest.raises(ValueError, match="num_physical=5 must be divisible by world_size=2"):
        ExpertPlacement.identity(4, 2, num_redundant=1)
    with pytest.raises(ValueError, match=r"rank=2 must be an int in \[0, world_size=2\)"):
        ExpertPlacement.identity(4, 2).local_physical_experts(2)


@pytest.mark.parametrize("rows, topk", [(0, 3), (1, 1), (7, 3), (33, 8)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_route_matches_reference(rows, topk, dtype):
    g = torch.Generator().manual_seed(rows * 10 + topk)
    p2l = torch.cat([torch.randperm(6, generator=g), torch.randint(0, 6, (6,), generator=g)])
    p = ExpertPlacement.from_physical_to_logical(p2l, 3)
    ids = torch.randint(-1, 6, (rows, topk), generator=g, dtype=dtype)
    out = p.route(ids)
    assert out.dtype == dtype and out.shape == ids.shape
    assert torch.equal(out, route_reference(p, ids))
    assert torch.equal(out < 0, ids < 0)  # -1 stays -1, nothing else becomes -1
    valid = ids >= 0
    assert torch.equal(p2l[out[valid].long()], ids[valid].long())  # a replica of its expert
    assert torch.equal(p.route(ids), out)  # deterministic


def _replica_loads(p, physical):
    return torch.bincount(physical[physical >= 0].flatten().long(), minlength=p.num_physical)


@pytest.mark.parametrize("ids", ["zeros", "same_topk", "random"])
def test_route_spreads_evenly(ids):
    """Each logical expert's token-slots split over its replicas within one of each other."""
    p = ExpertPlacement.from_physical_to_logical(
        torch.tensor([0, 1, 2, 3, 4, 5, 0, 0, 0, 3, 3, 1]), 4)
    g = torch.Generator().manual_seed(1)
    topk_ids = {"zeros": torch.zeros(37, 4, dtype=torch.int64),
                # every token picks the same experts (slot s holds expert s)
                "same_topk": torch.arange(4).repeat(37, 1),
                "random": torch.randint(0, 6, (37, 4), generator=g)}[ids]
    loads = _replica_loads(p, p.route(topk_ids))
    for e, row in enumerate(p.logical_to_physical.tolist()):
        per_replica = loads[[q for q in row if q >= 0]]
        assert per_replica.max() - per_replica.min() <= 1, (e, per_replica)
        assert per_replica.sum() == (topk_ids == e).sum()


def test_route_without_redundancy_is_the_identity():
    p = ExpertPlacement.identity(5, 1)
    ids = torch.randint(-1, 5, (9, 2), generator=torch.Generator().manual_seed(3))
    assert torch.equal(p.route(ids), ids)


def test_to_device_keeps_the_placement():
    p = ExpertPlacement.from_physical_to_logical(torch.tensor(P2L), 2)
    q = p.to("cpu")
    assert q == p and q.logical_to_physical.device.type == "cpu"


@pytest.mark.gpu
def test_route_on_gpu_in_a_cuda_graph():
    p = ExpertPlacement.identity(16, 4, num_redundant=8).to("cuda")
    ids = torch.randint(-1, 16, (65, 8), device="cuda", dtype=torch.int32)
    expected = route_reference(p.to("cpu"), ids.cpu())
    p.route(ids)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = p.route(ids)
    out.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), expected)


def test_the_package_exports_every_modules_public_names():
    """vllm_moe_fixes.eplb's __all__ is the union of its modules' __all__, each name the
    module's own object."""
    names = set()
    for module in ("placement", "load_stats", "balanced_layer", "weight_move", "rebalance",
                   "simulate"):
        mod = importlib.import_module(f"vllm_moe_fixes.eplb.{module}")
        names |= set(mod.__all__)
        assert all(getattr(eplb, n) is getattr(mod, n) for n in mod.__all__), module
    assert sorted(eplb.__all__) == sorted(names) and len(eplb.__all__) == len(names)
