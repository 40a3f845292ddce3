"""Lazy init: build a model with no memory, then materialise it piece by piece.

Built on torch's meta device: ``with lazy_init(): model = GPT(cfg)`` runs the model's own
constructor under ``torch.device("meta")``, so every parameter and buffer has a shape and
dtype but no storage. :func:`materialize` then gives storage to one module (or one
parameter) at a time — on any device — and fills it either from a ``state_dict_loader``
(``name -> tensor``, e.g. one tensor read from a safetensors shard) or by re-running the
module's own initialisation. Gemini calls it as a parameter enters its chunk; quantized
loading calls it module by module, so no process ever holds the whole full-precision model.

Why not ``nn.Module.to_empty``: it materialises everything at once and breaks tied weights
when applied module by module; here a memo keeps one storage per meta tensor, so a tied
``lm_head.weight is tok_emb.weight`` stays tied.

Re-running init: meta construction runs the constructor but the values are lost, so each
module is re-initialised by the model's own ``init_module(name, module)`` (the model contract,
:mod:`colossal_lab.engine.models.protocol`), or else by torch's default, the module's
``reset_parameters()``. Pass ``init_fn(name, module)`` to take over.
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
    """``root.init_module`` where the model has one, else each module's ``reset_parameters()``."""
    own = getattr(root, "init_module", None)
    if callable(own):
        return own

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
