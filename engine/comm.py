"""Collectives on the device their process group reduces on: the engine's one route to them.

NCCL reduces CUDA tensors only, Gloo host (and CUDA) ones, so every tensor collective in the engine
goes through here: a tensor is used as is where the group's backend takes its device, and otherwise
travels to :func:`comm_device` and back, in place (docs/engine.md, "Collectives and their devices").
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist

# the device types each backend reduces on (torch.distributed's own table, by name)
_BACKEND_DEVICES = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",), "mpi": ("cpu",), "ucc": ("cpu", "cuda"),
                    "xccl": ("xpu",), "hccl": ("npu",)}


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


def all_reduce(t: torch.Tensor, op=None, group=None) -> torch.Tensor:
    """In-place all-reduce of ``t`` (any device) over ``group``; returns ``t``."""
    if not initialized():
        return t
    op = dist.ReduceOp.SUM if op is None else op
    work = _on_group_device(t, group)
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
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return t.tolist()


def all_gather(parts: List[torch.Tensor], t: torch.Tensor, group=None) -> List[torch.Tensor]:
    """Every rank's ``t`` into ``parts`` (same device as ``t`` on return)."""
    work = _on_group_device(t, group)
    if work is t:
        dist.all_gather(parts, t, group=group)
        return parts
    tmp = [torch.empty_like(work) for _ in parts]
    dist.all_gather(tmp, work, group=group)
    for dst, src in zip(parts, tmp):
        dst.copy_(src)
        release(src)
    return parts


def all_gather_into_tensor(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """``torch.distributed.all_gather_into_tensor`` (the flat form); both tensors must already be
    on a device the backend takes (Gemini's chunk buffers are), since an async result cannot be
    copied back here."""
    _check_device((out, inp), group, "all_gather_into_tensor")
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def reduce_scatter_tensor(out: torch.Tensor, inp: torch.Tensor, op=None, group=None) -> None:
    """``torch.distributed.reduce_scatter_tensor``; both tensors on a device the backend takes."""
    _check_device((out, inp), group, "reduce_scatter_tensor")
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=dist.ReduceOp.SUM if op is None else op, group=group)


def _check_device(tensors, group, what: str) -> None:
    types = backend_device_types(group)
    for t in tensors:
        if t.device.type not in types:
            raise RuntimeError(f"{what}: a {t.device.type} tensor on a {dist.get_backend(group)} group, "
                               f"which reduces on {list(types)}; allocate it on comm_device(group)")


__all__ = ["initialized", "device_types_of", "backend_device_types", "comm_device", "all_reduce", "any_rank",
           "reduce_values", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "release"]
