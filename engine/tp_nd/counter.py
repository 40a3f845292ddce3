"""Every collective of N-d tensor parallelism, on the grid's groups, through the engine's one route.

The 2D/2.5D/3D layers call these with a grid ``Group`` and a kind (e.g. ``summa.bcast_x``); each is
:mod:`..comm`'s collective under the label ``tp_nd.<kind>``, so it is counted (bytes sent, the
conventions of :mod:`..traffic`) and timed (a ``comm`` span while :func:`comm_spans` is active) where
every collective of the engine is. 1D's DTensor collectives are torch's own: :func:`count_dtensor`
sees them through a torch dispatch mode (as torch's ``CommDebugMode`` does: the functional
collectives DTensor issues, forward and backward) and counts them into the same counter under
``tp_nd.dtensor.<op>``.

:data:`COUNTER` is the ``tp_nd.`` part of ``comm.COUNTER`` (bytes by kind without the prefix, calls,
``total``, ``reset``, ``snapshot``). A group of one rank (``Group.pg`` None) communicates nothing and
is not counted. Over SUMMA's ``q`` broadcast steps, where every rank is the root once, each rank
sends what a ring all-gather would. The bench reports the mean over ranks (and the max).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Dict, Iterator

import torch
import torch.distributed as dist

from .. import comm
from ..comm import simulate_gloo  # noqa: F401 - the planners' name for it
from ..traffic import COUNTER as _ALL
from ..traffic import CounterView, sent_bytes

PREFIX = "tp_nd."
COUNTER = _ALL.view(PREFIX, float)
Counter = CounterView  # the type of COUNTER
comm_spans = comm.spans


def broadcast(t: torch.Tensor, src: int, g, kind: str) -> torch.Tensor:
    """Broadcast ``t`` in place from group rank ``src`` of ``g`` (a ``grid.Group``)."""
    if g.pg is None:
        return t
    return comm.broadcast(t, src, group=g.pg, label=PREFIX + kind)


def reduce(t: torch.Tensor, dst: int, g, kind: str) -> torch.Tensor:
    """Sum ``t`` over ``g`` into group rank ``dst`` (in place there; others' ``t`` is scratch)."""
    if g.pg is None:
        return t
    return comm.reduce(t, dst, group=g.pg, label=PREFIX + kind)


def all_reduce(t: torch.Tensor, g, kind: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if g.pg is None:
        return t
    return comm.all_reduce(t, op=op, group=g.pg, label=PREFIX + kind)


def all_gather(t: torch.Tensor, g, kind: str, dim: int = 0) -> torch.Tensor:
    """Every rank's ``t`` concatenated along ``dim`` in group-rank order."""
    if g.pg is None:
        return t
    t = t.movedim(dim, 0).contiguous() if dim != 0 else t.contiguous()
    out = t.new_empty((g.size * t.shape[0],) + tuple(t.shape[1:]))
    comm.all_gather_into_tensor(out, t, group=g.pg, label=PREFIX + kind)
    return out.movedim(0, dim) if dim != 0 else out


def reduce_scatter(t: torch.Tensor, g, kind: str, dim: int = 0) -> torch.Tensor:
    """The sum over ``g`` of ``t``, cut along ``dim`` into ``g.size`` pieces: this rank's piece."""
    if g.pg is None:
        return t
    t = t.movedim(dim, 0).contiguous() if dim != 0 else t.contiguous()
    out = t.new_empty((t.shape[0] // g.size,) + tuple(t.shape[1:]))
    comm.reduce_scatter_tensor(out, t, group=g.pg, label=PREFIX + kind, own_copy=True)
    return out.movedim(0, dim) if dim != 0 else out


# ---- 1D: DTensor's collectives ------------------------------------------------------------------

def _dtensor_mode():
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class DTensorBytes(TorchDispatchMode):
        """A dispatch mode like torch's ``CommDebugMode`` (without its module tracker): a DTensor
        op is handed back to DTensor (``NotImplemented``), which issues plain ops and functional
        collectives; each collective's bytes (:mod:`..traffic`'s conventions) go to the engine's
        counter under ``tp_nd.dtensor.<op>`` and its count to ``counts``."""

        def __init__(self):
            super().__init__()
            self.counts: Dict[str, int] = defaultdict(int)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **kwargs)
            if any(t is DTensor for t in types):
                return NotImplemented
            name = _count_funcol(func, args)
            if name:
                self.counts[name] += 1
            return func(*args, **kwargs)

    return DTensorBytes()


_FUNCOL_KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
                 "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all", "broadcast": "broadcast"}


def _count_funcol(func, args) -> str:
    """Count one functional collective (``_c10d_functional``'s schemas: the group name last for
    all-reduce and all-to-all, the group size beside it for the gathers); returns its name, or
    ``""`` for any other op."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    packet = getattr(func, "_overloadpacket", None)
    name = getattr(packet, "__name__", "")
    ns = getattr(packet, "_qualified_op_name", "") or ""
    kind = _FUNCOL_KINDS.get(name)
    if "c10d_functional" not in ns or kind is None or not args or not isinstance(args[0], torch.Tensor):
        return ""
    n, root = args[0].numel() * args[0].element_size(), False
    if name == "all_reduce":
        p = _resolve_process_group(args[2]).size()
    elif name == "all_gather_into_tensor":
        p = int(args[1])
    elif name == "reduce_scatter_tensor":
        p = int(args[2])
    elif name == "all_to_all_single":
        p = _resolve_process_group(args[-1]).size()
    else:  # broadcast(tensor, src, group)
        pg = _resolve_process_group(args[2])
        p, root = pg.size(), dist.get_rank(pg) == int(args[1])
    _ALL.add(kind, sent_bytes(kind, n, p, root), PREFIX + "dtensor." + kind)
    return name


@contextlib.contextmanager
def count_dtensor() -> Iterator[object]:
    """Count 1D (DTensor) tensor parallelism's collectives, forward and backward, into the engine's
    counter (``COUNTER`` kinds ``dtensor.*``); yields the mode (``.counts``: calls per collective)."""
    mode = _dtensor_mode()
    with mode:
        yield mode


__all__ = ["COUNTER", "Counter", "comm_spans", "broadcast", "reduce", "all_reduce", "all_gather",
           "reduce_scatter", "count_dtensor", "simulate_gloo"]
