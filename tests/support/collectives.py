"""A checking wrapper around torch.distributed's tensor collectives, for tests.

Two rules, checked at every call while installed:

1. every tensor handed to a collective is on a device its group's backend reduces on (NCCL:
   CUDA only; Gloo: CPU or CUDA) — the rule a GPU run enforces by crashing;
2. engine code reaches tensor collectives only through ``colossal_lab.engine.comm``, the one
   place that puts small tensors on the group's device. On a CPU machine rule 1 cannot tell a
   tensor made on the default device from one made on the group's device (both are the CPU),
   so rule 2 is what fails there when engine code calls ``dist.all_reduce(torch.zeros(1))``
   directly, the pattern that crashed on NCCL.

Rule 2 looks at the frame that calls the collective: calls torch makes on its own behalf (DDP,
FSDP2, ZeroRedundancyOptimizer, torch.distributed.checkpoint, object collectives) come from
torch's frames and are torch's to place. Point-to-point sends (pipeline activations) are not
wrapped: torch's PipelineStage makes them on the stage's device and checks their identity.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, List

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import colossal_lab.engine as _engine

_ENGINE = os.path.dirname(os.path.abspath(_engine.__file__)) + os.sep
_COMM = os.path.join(_ENGINE, "comm.py")
_HERE = os.path.abspath(__file__)

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "reduce", "all_to_all_single", "all_to_all", "reduce_scatter",
               "gather", "scatter", "all_gather_single", "reduce_scatter_single")


def _tensors(args, kwargs) -> List[torch.Tensor]:
    out = []
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def _caller() -> str:
    """File of the frame that called the collective (skipping this module's wrappers)."""
    f = sys._getframe(2)
    while f is not None and os.path.abspath(f.f_code.co_filename) == _HERE:
        f = f.f_back
    return os.path.abspath(f.f_code.co_filename) if f is not None else ""


class CollectiveChecker:
    """``with CollectiveChecker() as chk: ...`` then ``chk.violations`` (empty when all is well)."""

    def __init__(self) -> None:
        self.violations: List[str] = []
        self.calls = 0
        self.engine_calls = 0
        self._saved = []

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def checked(*args, **kwargs):
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            self.calls += 1
            try:
                from colossal_lab.engine.comm import backend_device_types

                allowed = backend_device_types(group)
            except Exception:  # a group this rank is not part of: torch raises its own error
                allowed = None
            for t in _tensors(args, kwargs):
                if allowed is not None and t.device.type not in allowed:
                    self.violations.append(f"{name}: {t.device.type} tensor on a {dist.get_backend(group)} group")
            where = _caller()
            if where.startswith(_ENGINE):
                self.engine_calls += 1
                if where != _COMM:
                    self.violations.append(f"{name} called from {os.path.relpath(where, _ENGINE)}, not engine/comm.py")
            return fn(*args, **kwargs)

        checked._collective_check = True
        return checked

    def __enter__(self) -> "CollectiveChecker":
        for mod in (dist, c10d):
            for name in COLLECTIVES:
                fn = getattr(mod, name, None)
                if fn is None or getattr(fn, "_collective_check", False):
                    continue
                self._saved.append((mod, name, fn))
                setattr(mod, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for mod, name, fn in reversed(self._saved):
            setattr(mod, name, fn)
        self._saved.clear()
