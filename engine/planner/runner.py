"""Where the planners run code on ranks: a *runner* is anything with ``run(fn, *args) -> list``
(one result per rank, in rank order) and ``n`` (its rank count). ``cl.Cluster`` is one; so is
:class:`InProcess`, for code already running on every rank of a process group.

The engine cannot launch ranks itself (launching belongs to the notebook front), so a search that
needs ranks and was given none asks the launcher the front registers with :func:`set_launcher`
(``colossal_lab`` does so on import): ``launcher(n)`` returns a runner with ``stop()``.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Protocol


class Runner(Protocol):
    n: int

    def run(self, fn: Callable, *args) -> List[Any]: ...


class InProcess:
    """``run`` for code already running on every rank (``HybridParallelPlugin.auto`` in a
    ``%%colossal`` cell or a torchrun script): each rank runs ``fn`` itself and every rank gets
    every rank's result, so all of them choose the same answer."""

    def __init__(self):
        import torch.distributed as dist

        self.n = dist.get_world_size()

    def run(self, fn, *args):
        from .. import comm

        out: List[Any] = [None] * self.n
        comm.all_gather_object(out, fn(*args))
        return out


_launcher: Optional[Callable[[int], Any]] = None


def set_launcher(launcher: Optional[Callable[[int], Any]]) -> None:
    """Register ``launcher(n) -> runner`` (with ``stop()``), used when a search needs ranks and
    was handed none."""
    global _launcher
    _launcher = launcher


def launch(n: int):
    """A fresh runner of ``n`` ranks from the registered launcher."""
    if _launcher is None:
        raise RuntimeError(f"no launcher registered to start {n} ranks; pass cluster= (a runner: anything with "
                           "run(fn, *args)), e.g. cl.launch(n=...)")
    return _launcher(n)
