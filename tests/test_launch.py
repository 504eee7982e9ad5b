"""run_distributed: results per rank, and bad arguments refused before any process starts."""

import pytest

from _dist import run_distributed


def _rank_square(rank, world, offset):
    return rank * rank + offset


def test_results_in_rank_order():
    assert run_distributed(_rank_square, 3, 10) == [10, 11, 14]


@pytest.mark.parametrize("kwargs, match", [
    ({"world_size": 0}, "world_size=0 must be a positive int"),
    ({"world_size": True}, "world_size=True must be a positive int"),
    ({"world_size": 2.0}, "world_size=2.0 must be a positive int"),
    ({"world_size": 2, "backend": "mpi"}, "backend='mpi' must be 'gloo' or 'nccl'"),
    ({"world_size": 1024, "backend": "nccl"}, "world_size=1024 needs that many GPUs"),
])
def test_bad_arguments_refused(kwargs, match):
    world_size = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=match):
        run_distributed(_rank_square, world_size, 0, **kwargs)
