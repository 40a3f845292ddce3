"""The multi-process test helper itself: real gloo collectives, errors carry rank + traceback."""

import pytest
import torch
import torch.distributed as dist
from support.dist import run_distributed


def _allreduce(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_one(rank, world):
    if rank == 1:
        raise ValueError("rank one is unhappy")
    return rank


def test_all_reduce_two_ranks():
    assert run_distributed(_allreduce, 2) == [3.0, 3.0]


def test_error_names_the_rank():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1.*rank one is unhappy"):
        run_distributed(_raise_on_one, 2)
