"""Bad arguments to cl.launch fail with one clear sentence before any process starts."""

import pytest

# Jupyter-side packages this module needs: absent (a bare GPU image), it skips.
pytest.importorskip("psutil")
pytest.importorskip("ipyparallel")

import psutil
import pytest
import torch

import colossal_lab as cl


def _children():
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.parametrize("kw, match", [
    (dict(n=0), r"n=0: the number of ranks must be at least 1"),
    (dict(n=-3), r"n=-3: the number of ranks must be at least 1"),
    (dict(n="2"), r"n='2': the number of ranks must be a whole number"),
    (dict(n=2.0), r"n=2.0: the number of ranks must be a whole number"),
    (dict(n=2, backend="mpi2"), r"backend='mpi2' is not known: use one of auto, gloo, nccl"),
    (dict(n=2, launcher="kubernetes"),
     r"launcher='kubernetes' is not an ipyparallel engine launcher: use one of .*local.*mpi.*slurm.*ssh"),
    (dict(n=2, timeout=0), r"timeout=0: the collective timeout must be a positive number"),
    (dict(n=2, threads=0), r"threads=0: threads per rank must be a whole number"),
])
def test_bad_arguments(kw, match):
    before = _children()
    with pytest.raises(ValueError, match=match):
        cl.launch(**kw)
    assert _children() == before


def test_nccl_needs_enough_gpus():
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    before = _children()
    with pytest.raises(ValueError,
                       match=rf"backend='nccl' with n={gpus + 1} needs {gpus + 1} GPUs but this machine has {gpus}"):
        cl.launch(n=gpus + 1, backend="nccl")
    assert _children() == before


def test_no_current_cluster_message():
    from colossal_lab import cluster

    if cluster._current is None:
        with pytest.raises(RuntimeError, match=r"no colossal-lab cluster is running: start one with cl.launch"):
            cl.current_cluster()
