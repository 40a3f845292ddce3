"""Where a boosted model computes, and moving the user's batches there (docs/engine.md, "Where batches go")."""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist


def default_device() -> torch.device:
    """Where a plugin puts the model: this rank's GPU when running on CUDA, else the CPU (a
    gloo-only process group keeps the model on the CPU even on a GPU machine)."""
    if torch.cuda.is_available():
        if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "gloo":
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it (nested in tuples, lists and dicts) on ``device``.

    Tensors already there are returned as they are (no copy); containers are rebuilt only when
    something in them moved. Host-to-GPU copies are asynchronous (``non_blocking``), which is
    safe: the copy is ordered on the current stream before the kernels that read it.
    """
    if isinstance(obj, torch.Tensor):
        if obj.device == device or (device.index is None and obj.device.type == device.type):
            return obj
        return obj.to(device, non_blocking=device.type == "cuda")
    if isinstance(obj, (list, tuple)):
        moved = [to_device(o, device) for o in obj]
        if all(a is b for a, b in zip(moved, obj)):
            return obj
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*moved)
        return type(obj)(moved)
    if isinstance(obj, dict):
        moved = {k: to_device(v, device) for k, v in obj.items()}
        if all(moved[k] is obj[k] for k in obj):
            return obj
        try:
            return type(obj)(moved)
        except TypeError:
            return moved
    return obj


def module_device(module: torch.nn.Module, fallback: torch.device) -> torch.device:
    """The device of ``module``'s first parameter (or buffer), else ``fallback``."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return fallback


class DeviceDataLoader:
    """A DataLoader whose batches arrive on ``device``; everything else is the inner loader's
    (``len``, ``sampler``, ``dataset``, ``batch_size``, ``sampler.set_epoch``...)."""

    def __init__(self, loader, device: torch.device):
        self.loader = loader
        self.device = device

    def __iter__(self) -> Iterator:
        for batch in self.loader:
            yield to_device(batch, self.device)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        if name in ("loader", "device"):  # not set yet (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __repr__(self) -> str:
        return f"DeviceDataLoader({self.loader!r}, device={self.device})"


__all__ = ["default_device", "to_device", "module_device", "DeviceDataLoader"]
