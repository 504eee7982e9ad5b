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


def _fail_late_or_early(rank, world):
    import time

    import torch.distributed as dist
    if rank == world - 1:
        raise KeyError("the root cause")
    time.sleep(0.5)  # the peer fails first; this rank's collective then fails because of it
    dist.barrier()


def test_the_rank_that_failed_first_is_reported_last_line_first_error():
    with pytest.raises(RuntimeError, match="^rank 2 failed first:") as err:
        run_distributed(_fail_late_or_early, 3)
    message = str(err.value)
    assert message.startswith("rank 2 failed first:\n")
    assert message.strip().splitlines()[-1] == "KeyError: 'the root cause'"
