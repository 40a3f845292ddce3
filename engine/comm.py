"""Collectives on the device their process group reduces on, counted and timed: the engine's one
route to them.

NCCL reduces CUDA tensors only, Gloo host (and CUDA) ones, so every collective in the engine goes
through here: a tensor is used as is where the group's backend takes its device, and otherwise
travels to :func:`comm_device` and back, in place (docs/engine.md, "Collectives and their devices").
Every call is counted in :data:`COUNTER` (the bytes this rank sends, by kind and by the caller's
``label``) and, when labelled, timed as a ``comm`` span while :func:`spans` is active; the byte
conventions and the span rule are :mod:`.traffic`'s. Torch's own collectives (DTensor, pipelining,
DDP, FSDP, ZeroRedundancyOptimizer, distributed checkpoint) stay torch's; ``tp_nd.count_dtensor``
counts DTensor's into the same counter.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .traffic import COUNTER, sent_bytes, spans, timed

# the device types each backend reduces on (torch.distributed's own table, by name); "fake" is
# torch's testing FakeProcessGroup (the planners' traces), which moves nothing: any device
_BACKEND_DEVICES = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",), "mpi": ("cpu",), "ucc": ("cpu", "cuda"),
                    "xccl": ("xpu",), "hccl": ("npu",), "fake": ("cpu", "cuda", "meta", "xpu", "npu", "mps", "hpu")}


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def device_types_of(backend: str) -> Sequence[str]:
    """Device types a backend (by name, as ``dist.get_backend`` gives it) reduces on."""
    backend = str(backend)
    if ":" in backend:  # "cpu:gloo,cuda:nccl": one backend per device type
        return tuple(part.split(":", 1)[0] for part in backend.split(","))
    return _BACKEND_DEVICES.get(backend, ("cpu",))


def backend_device_types(group=None) -> Sequence[str]:
    """Device types ``group``'s backend reduces on."""
    return device_types_of(dist.get_backend(group))


def comm_device(group=None) -> torch.device:
    """The device small tensors for ``group``'s collectives are made on: the current CUDA
    device for an NCCL group, else the CPU."""
    return _pick_device(backend_device_types(group))


def _pick_device(types: Sequence[str]) -> torch.device:
    if "cpu" in types:
        return torch.device("cpu")
    kind = types[0]
    mod = getattr(torch, kind, None)
    index = mod.current_device() if mod is not None and hasattr(mod, "current_device") else None
    return torch.device(kind, index)


def _on_group_device(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` itself where the backend takes its device, else a copy on :func:`comm_device`."""
    if t.device.type in backend_device_types(group):
        return t
    return t.to(comm_device(group))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _count(kind: str, n: int, group, label: Optional[str], root: bool = False) -> None:
    """One call of ``kind`` on ``n`` bytes over ``group`` into :data:`COUNTER` (a group of one
    rank sends nothing and is not counted)."""
    p = dist.get_world_size(group)
    if p > 1:
        COUNTER.add(kind, sent_bytes(kind, n, p, root), label or "")


# ---- reductions and gathers --------------------------------------------------------------------

def all_reduce(t: torch.Tensor, op=None, group=None, label: Optional[str] = None) -> torch.Tensor:
    """In-place all-reduce of ``t`` (any device) over ``group``; returns ``t``."""
    if not initialized():
        return t
    op = dist.ReduceOp.SUM if op is None else op
    work = _on_group_device(t, group)
    _count("all_reduce", _nbytes(t), group, label)
    with timed(label):
        dist.all_reduce(work, op=op, group=group)
    if work is not t:
        t.copy_(work)
        release(work)
    return t


def release(t: torch.Tensor) -> None:
    """Free ``t``'s memory now, on this thread: for a temporary that a finished collective was given
    and nothing reads again. gloo's work holds the tensors of its collective until gloo's worker
    thread drops the work, which it does after waking the caller; under CPU contention that is
    later, while the caller allocates on, so the block's free (and the process's peak with it) would
    depend on the scheduler. With the storage emptied here the worker's drop frees nothing."""
    t.untyped_storage().resize_(0)


def any_rank(flag: bool, group=None) -> bool:
    """True when ``flag`` is true on any rank of ``group`` (every rank must call it)."""
    (most,) = reduce_values([1.0 if flag else 0.0], op=dist.ReduceOp.MAX, group=group)
    return most > 0


def reduce_values(values: Sequence[float], op=None, group=None, dtype=torch.float64) -> List[float]:
    """All-reduce a few Python numbers (norms, counts) over ``group``; returns them reduced."""
    if not initialized():
        return [float(v) for v in values]
    t = torch.tensor(list(values), dtype=dtype, device=comm_device(group))
    _count("all_reduce", _nbytes(t), group, None)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return t.tolist()


def reduce(t: torch.Tensor, group_dst: int, op=None, group=None, label: Optional[str] = None) -> torch.Tensor:
    """Reduce ``t`` over ``group`` into group rank ``group_dst``, in place there (the others' ``t``
    is scratch); returns ``t``."""
    work = _on_group_device(t, group)
    _count("reduce", _nbytes(t), group, label, root=dist.get_rank(group) == group_dst)
    with timed(label):
        dist.reduce(work, op=dist.ReduceOp.SUM if op is None else op, group=group, group_dst=group_dst)
    if work is not t:
        t.copy_(work)
        release(work)
    return t


def broadcast(t: torch.Tensor, group_src: int, group=None, label: Optional[str] = None) -> torch.Tensor:
    """Broadcast ``t`` in place from group rank ``group_src`` of ``group``; returns ``t``."""
    work = _on_group_device(t, group)
    _count("broadcast", _nbytes(t), group, label, root=dist.get_rank(group) == group_src)
    with timed(label):
        dist.broadcast(work, group=group, group_src=group_src)
    if work is not t:
        t.copy_(work)
        release(work)
    return t


def all_gather(parts: List[torch.Tensor], t: torch.Tensor, group=None,
               label: Optional[str] = None) -> List[torch.Tensor]:
    """Every rank's ``t`` into ``parts`` (same device as ``t`` on return)."""
    work = _on_group_device(t, group)
    _count("all_gather", _nbytes(t), group, label)
    if work is t:
        with timed(label):
            dist.all_gather(parts, t, group=group)
        return parts
    tmp = [torch.empty_like(work) for _ in parts]
    with timed(label):
        dist.all_gather(tmp, work, group=group)
    for dst, src in zip(parts, tmp):
        dst.copy_(src)
        release(src)
    return parts


def all_gather_into_tensor(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False,
                           label: Optional[str] = None):
    """``torch.distributed.all_gather_into_tensor`` (the flat form); both tensors must already be
    on a device the backend takes (Gemini's chunk buffers are), since an async result cannot be
    copied back here."""
    _check_device((out, inp), group, "all_gather_into_tensor")
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    _count("all_gather", _nbytes(inp), group, label)
    with timed(label):
        return fn(out, inp, group=group, async_op=async_op)


def reduce_scatter_tensor(out: torch.Tensor, inp: torch.Tensor, op=None, group=None,
                          label: Optional[str] = None, own_copy: bool = False) -> None:
    """``torch.distributed.reduce_scatter_tensor``; both tensors on a device the backend takes.

    ``own_copy``: on a gloo group with host tensors, do what gloo does (clone ``inp``, all-reduce
    the clone, copy this rank's piece out: the same bytes and copies) here, so the clone is freed
    on this thread when the call returns; gloo's work would free it whenever its worker thread
    drops the work, a race with what this thread allocates next (:func:`release`)."""
    _check_device((out, inp), group, "reduce_scatter_tensor")
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    _count("reduce_scatter", _nbytes(inp), group, label)
    if own_copy and inp.device.type == "cpu" and "gloo" in str(dist.get_backend(group)):
        with timed(label):
            buf = inp.clone()
            dist.all_reduce(buf, op=dist.ReduceOp.SUM if op is None else op, group=group)
            out.copy_(buf.chunk(dist.get_world_size(group))[dist.get_rank(group)])
            release(buf)
        return
    # under a planner's fake process group: the copy of the input that gloo makes on this thread
    scratch = inp.clone() if _SIMULATE_GLOO else None
    with timed(label):
        fn(out, inp, op=dist.ReduceOp.SUM if op is None else op, group=group)
    del scratch


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, group=None, label: Optional[str] = None,
                      in_splits: Optional[Sequence[int]] = None,
                      out_splits: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``torch.distributed.all_to_all_single`` over dim 0 (one equal slot per rank, or the rows
    ``in_splits[r]`` sent to / ``out_splits[r]`` received from group rank ``r``: an expert-parallel
    dispatch); both tensors on a device the backend takes. Returns ``out``. With splits the bytes
    counted are exactly the rows sent to other ranks."""
    _check_device((out, inp), group, "all_to_all_single")
    if in_splits is None and out_splits is None:
        _count("all_to_all", _nbytes(inp), group, label)
    elif dist.get_world_size(group) > 1:
        row = math.prod(inp.shape[1:]) * inp.element_size()
        p = dist.get_world_size(group)
        rows = inp.shape[0] - in_splits[dist.get_rank(group)] if in_splits is not None else inp.shape[0] * (p - 1) // p
        COUNTER.add("all_to_all", rows * row, label or "")
    with timed(label):
        dist.all_to_all_single(out, inp, output_split_sizes=None if out_splits is None else list(out_splits),
                               input_split_sizes=None if in_splits is None else list(in_splits), group=group)
    return out


# ---- point to point ----------------------------------------------------------------------------

def exchange(sends: Sequence[torch.Tensor], dst: int, src: int, group=None, tags: Optional[Iterable[int]] = None,
             label: Optional[str] = None) -> Tuple[List[torch.Tensor], list]:
    """Start sending each of ``sends`` to global rank ``dst`` and receiving a same-shaped tensor
    from global rank ``src`` per send (one ``batch_isend_irecv``; message ``tags`` default to
    0, 1, ...); returns ``(received tensors, works)``, to be finished with :func:`wait`."""
    sends = [t.contiguous() for t in sends]
    _check_device(sends, group, "exchange")
    recvs = [torch.empty_like(t) for t in sends]
    ops = []
    for t, r, tag in zip(sends, recvs, range(len(sends)) if tags is None else tags):
        ops.append(dist.P2POp(dist.isend, t, dst, group, tag))
        ops.append(dist.P2POp(dist.irecv, r, src, group, tag))
        COUNTER.add("p2p", _nbytes(t), label or "")
    return recvs, dist.batch_isend_irecv(ops)


def wait(works: Iterable, label: Optional[str] = None) -> None:
    """Wait on the works of an async collective (:func:`exchange`'s): a ``comm`` span when labelled."""
    with timed(label):
        for w in works:
            w.wait()


# ---- synchronisation and Python objects (counted as calls; torch places their tensors) --------

def barrier(group=None) -> None:
    _count("barrier", 0, group, None)
    dist.barrier(group=group)


def all_gather_object(out: list, obj, group=None) -> list:
    """Every rank's picklable ``obj`` into ``out`` (one slot per rank of ``group``)."""
    _count("object", 0, group, None)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object_list(objs: list, src: Optional[int] = None, group=None) -> list:
    """``objs`` (picklable) from global rank ``src`` to every rank of ``group``, in place."""
    _count("object", 0, group, None)
    dist.broadcast_object_list(objs, src=src, group=group)
    return objs


def _check_device(tensors, group, what: str) -> None:
    types = backend_device_types(group)
    for t in tensors:
        if t.device.type not in types:
            raise RuntimeError(f"{what}: a {t.device.type} tensor on a {dist.get_backend(group)} group, "
                               f"which reduces on {list(types)}; allocate it on comm_device(group)")


# ---- planners: what gloo allocates inside a collective ------------------------------------------

_SIMULATE_GLOO = False


@contextlib.contextmanager
def simulate_gloo() -> Iterator[None]:
    """For a planner's trace on a fake process group (which moves nothing and allocates nothing):
    allocate what gloo allocates inside a collective on the calling thread, so the trace holds it
    too. gloo's reduce-scatter clones its input (measured: a 3D rank of the small GPT peaks 0.69 MiB
    higher, one such copy, than the trace without it). Not for real runs."""
    global _SIMULATE_GLOO
    old, _SIMULATE_GLOO = _SIMULATE_GLOO, True
    try:
        yield
    finally:
        _SIMULATE_GLOO = old


__all__ = ["COUNTER", "initialized", "device_types_of", "backend_device_types", "comm_device", "all_reduce",
           "any_rank", "reduce_values", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
           "reduce_scatter_tensor", "all_to_all_single", "exchange", "wait", "barrier", "all_gather_object",
           "broadcast_object_list", "release", "simulate_gloo", "spans"]
