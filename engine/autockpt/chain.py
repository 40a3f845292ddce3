"""The chain of layers a model's checkpointing is chosen over, and how a choice is switched on
(the model contract's ``enable_activation_checkpointing(layers=...)``, or a Sequential's children)."""
from __future__ import annotations

from typing import Callable, List, Tuple

import torch.nn as nn

from ..models.protocol import check_checkpointing, checkpointing_method
from .profile import Entry


def _unwrap(m: nn.Module) -> nn.Module:
    return getattr(m, "_checkpoint_wrapped_module", m)


def _find_layers(model: nn.Module) -> List[Tuple[int, str, nn.Module]]:
    """(index, name, module) of the chain's layers, in order (a transformers model's, or a pipeline stage's
    of one, from its adapter)."""
    from ..models import hf

    if hf.is_hf_model(model):
        from ..models.hf.pipeline import owned_layers

        return owned_layers(model)
    if isinstance(model, nn.Sequential):
        return [(i, str(i), _unwrap(m)) for i, m in enumerate(model)]
    want = model.num_layers() if callable(getattr(model, "num_layers", None)) else None
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m)]
    if not found:
        raise ValueError(f"plan_checkpointing: {type(model).__name__} has no layers to checkpoint: it is not an "
                         "nn.Sequential and holds no nn.ModuleList/ModuleDict of layers")
    exact = [f for f in found if len(f[1]) == want]
    name, holder = (exact or sorted(found, key=lambda f: -len(f[1])))[0]
    items = holder.items() if isinstance(holder, nn.ModuleDict) else enumerate(holder)
    out = []
    for pos, (key, m) in enumerate(items):
        index = int(key) if isinstance(key, int) or str(key).isdigit() else pos
        out.append((index, f"{name}.{key}", _unwrap(m)))
    return out


def _parts_of(model: nn.Module, layers) -> Tuple[str, ...]:
    fn = getattr(model, "checkpoint_parts", None)
    if not callable(fn):
        return ()
    parts = tuple(fn())
    for _, name, m in layers:
        for p in parts:
            try:
                m.get_submodule(p)
            except AttributeError:
                raise ValueError(f"plan_checkpointing: {type(model).__name__}.checkpoint_parts() lists {p!r}, but "
                                 f"layer {name} has no sub-module {p!r}") from None
    return parts


def _setter(model: nn.Module) -> Callable[[List[Entry]], None]:
    """A function applying ``layers`` (entries as for ``enable_activation_checkpointing``)."""
    own = checkpointing_method(model)
    if own is not None:
        check_checkpointing(model, "plan_checkpointing", layers=True)
        return lambda entries: own(layers=list(entries))
    if isinstance(model, nn.Sequential):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        def set_seq(entries):
            bad = [e for e in entries if not isinstance(e, int) or isinstance(e, bool) or not 0 <= e < len(model)]
            if bad:
                raise ValueError(f"apply: layers {bad} are not indices of this Sequential's {len(model)} children")
            for i in range(len(model)):
                inner = _unwrap(model[i])
                model[i] = checkpoint_wrapper(inner) if i in entries else inner
        return set_seq
    raise ValueError(f"plan_checkpointing: {type(model).__name__} has no enable_activation_checkpointing(layers=...) "
                     "(the model contract) and is not an nn.Sequential; "
                     "implement it or wrap the layers in nn.Sequential")
