"""Shared test set-up: GPU tests skip without CUDA; keep thread counts low on 2 cores."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
