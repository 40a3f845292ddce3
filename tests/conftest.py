"""Shared test set-up: GPU tests skip without CUDA; keep thread counts low on 2 cores; the fixtures
several modules use.

This file's folder (``tests/``) is on ``sys.path``, so tests import their helpers from the
``support`` package beside it (see tests/README.md)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# Triton reads TRITON_INTERPRET once per process, and some test modules import packages that import
# triton at their own import (peft does): on a machine without CUDA the Triton kernels' tests run in the
# interpreter, so it is set here, before any test module is collected.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def cluster(request):
    """A real 2-rank gloo cluster (``cl.launch``) shared by one module's tests: starting one is the
    slow part. A module launches it with other arguments by setting ``CLUSTER_ARGS`` (keyword
    arguments of ``cl.launch``). Stopped when the module's tests are done."""
    import colossal_lab as cl

    c = cl.launch(**{"n": 2, "backend": "gloo", "threads": 1, **getattr(request.module, "CLUSTER_ARGS", {})})
    try:
        yield c
    finally:
        c.stop()
