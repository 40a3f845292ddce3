"""Lazy init: build a model with no memory, then materialise it piece by piece.

``with lazy_init(): model = GPT(cfg)`` runs the constructor on the meta device; :func:`materialize`
then gives storage to one module at a time, on any device, from a ``state_dict_loader`` or by
re-running the model's own init (``init_module``, else ``reset_parameters()``). A memo keeps one
storage per meta tensor, so tied weights stay tied (docs/kernels.md, "Lazy init").
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, Optional, Union

import torch
import torch.nn as nn

Loader = Callable[[str], Optional[torch.Tensor]]
InitFn = Callable[[str, nn.Module], None]


@contextlib.contextmanager
def lazy_init() -> Iterator[None]:
    """Every tensor created inside lives on the meta device (shapes only, no memory)."""
    with torch.device("meta"):
        yield


def is_lazy(module: nn.Module) -> bool:
    """True while any parameter or buffer of ``module`` is still on the meta device."""
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def meta_names(module: nn.Module) -> list:
    return [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]


def default_init(root: nn.Module) -> InitFn:
    """``root.init_module`` where the model has one, else transformers' ``root._init_weights(module)``
    (an HF model's own rule, which also recomputes buffers such as rotary tables), else each module's
    ``reset_parameters()``."""
    own = getattr(root, "init_module", None)
    if callable(own):
        return own
    hf_init = getattr(root, "_init_weights", None)
    if callable(hf_init):
        return lambda name, module: hf_init(module)

    def init(name: str, module: nn.Module) -> None:
        if not hasattr(module, "reset_parameters"):
            raise ValueError(f"materialize: no init rule for module {name or '<root>'!r} ({type(module).__name__} has "
                             f"no reset_parameters(), {type(root).__name__} no init_module(name, module)); "
                             "pass init_fn=... or a state_dict_loader")
        module.reset_parameters()

    return init


@torch.no_grad()
def materialize_module(module: nn.Module, name: str, device: torch.device, state_dict_loader: Optional[Loader],
                       init: InitFn, memo: Dict[int, torch.Tensor], dtype: Optional[torch.dtype] = None) -> None:
    """Materialise ``module``'s own (non-recursive) meta tensors; ``name`` is its path in the model."""
    need_init = False
    undo = []  # (table, name, meta tensor): a failed init leaves the module lazy, not garbage
    for kind in ("_parameters", "_buffers"):
        table = getattr(module, kind)
        for tname, t in list(table.items()):
            if t is None or not t.is_meta:
                continue
            full = f"{name}.{tname}" if name else tname
            undo.append((table, tname, t))
            if id(t) in memo:  # tied: reuse the storage made for the first owner
                table[tname] = memo[id(t)]
                continue
            tdtype = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
            src = state_dict_loader(full) if state_dict_loader is not None else None
            if src is not None:
                if tuple(src.shape) != tuple(t.shape):
                    raise ValueError(f"materialize: checkpoint tensor {full!r} has shape {tuple(src.shape)}, "
                                     f"model expects {tuple(t.shape)}")
                new = src.to(device=device, dtype=tdtype, copy=True)
            else:
                new = torch.empty(t.shape, dtype=tdtype, device=device)
                need_init = True
            if kind == "_parameters":
                new = nn.Parameter(new, requires_grad=t.requires_grad)
            memo[id(t)] = new
            table[tname] = new
    if need_init:
        try:
            init(name, module)
        except BaseException:
            for table, tname, t in undo:
                table[tname] = t
                memo.pop(id(t), None)
            raise


def materialize(model: nn.Module, device: Union[str, torch.device] = "cpu",
                state_dict_loader: Optional[Loader] = None, init_fn: Optional[InitFn] = None,
                only: Optional[Callable[[str], bool]] = None, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Give storage to ``model``'s meta tensors, one module at a time; returns ``model``.

    ``state_dict_loader(full_name)`` returns the tensor for a parameter/buffer name (or None to
    fall back to init). A module is initialised by ``init_fn`` (default :func:`default_init`)
    only if some of its own tensors were not loaded. ``only(module_name)`` limits the work to
    some modules (materialise a stage, a chunk, a shard); tied weights stay tied across calls.
    ``dtype`` casts floating tensors.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"materialize: model must be an nn.Module, got {type(model).__name__}")
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError("materialize: device='meta' — pass a real device such as 'cpu' or 'cuda'")
    init = init_fn or default_init(model)
    memo: Dict[int, torch.Tensor] = model.__dict__.setdefault("_lazy_memo", {})
    for mname, module in list(model.named_modules()):
        if only is None or only(mname):
            materialize_module(module, mname, device, state_dict_loader, init, memo)
    if not is_lazy(model):
        model.__dict__.pop("_lazy_memo", None)
    return model
