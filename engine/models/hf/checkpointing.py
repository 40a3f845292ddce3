"""Activation checkpointing of a transformers model's decoder (encoder) layers, one layer at a time.

The model contract's ``enable_activation_checkpointing(layers=None)`` for a ``PreTrainedModel`` (which has
no such method): every layer (``None``), or the listed layer indices, recompute in backward; ``[]``
recomputes nothing and a call replaces the previous choice. A chosen layer's *call* (its hooks included,
so the planner's probes see the recompute) runs under torch's non-reentrant
``torch.utils.checkpoint.checkpoint``: the layer's class becomes a subclass of its own that only adds
that ``__call__``, so no module is wrapped and parameter names, tensor-parallel plans and pipeline stages
see the model as it is. The base model's own ``gradient_checkpointing`` flag is set as transformers'
``gradient_checkpointing_enable()`` sets it, so its forward keeps no KV cache while training (a cache
updated again by the recompute would be wrong); cache arguments a layer is handed are dropped as
transformers' ``GradientCheckpointingLayer`` drops them. The layers are the pipeline layout's
(:mod:`.pipeline`), so a pipeline stage switches its own layers, and the indices are the unsplit model's.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Union

import torch
import torch.nn as nn

from .pipeline import num_layers, owned_layers

_CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
_CLASSES: Dict[type, type] = {}


def _recompute_call(self, *args, **kwargs):
    """A layer's call, recomputed in backward while training (``__call__`` of the recomputing subclass)."""
    if not (self.training and torch.is_grad_enabled()):
        return nn.Module.__call__(self, *args, **kwargs)
    from torch.utils.checkpoint import checkpoint

    kwargs = {k: (None if k in _CACHE_ARGS else False if k == "use_cache" else v) for k, v in kwargs.items()}
    return checkpoint(nn.Module.__call__, self, *args, use_reentrant=False, **kwargs)


def _recomputing(cls: type) -> type:
    """``cls`` with :func:`_recompute_call` as its ``__call__`` (one subclass per class, same names)."""
    if getattr(cls, "_cl_recomputes", False):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": _recompute_call, "_cl_recomputes": True,
                                                    "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _CLASSES[cls]


def _plain(cls: type) -> type:
    return cls.__bases__[0] if getattr(cls, "_cl_recomputes", False) else cls


def _indices(model: nn.Module, layers) -> Optional[set]:
    if layers is None:
        return None
    if isinstance(layers, (str, int)):
        raise TypeError(f"enable_activation_checkpointing(layers={layers!r}): pass a list, e.g. layers=[{layers!r}]")
    n, out = num_layers(model), set()
    for e in layers:
        i = int(e) if isinstance(e, str) and e.isdigit() else e
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n:
            raise ValueError(f"enable_activation_checkpointing: {e!r} is not a layer index in [0, {n}) of "
                             f"{type(model).__name__} (transformers layers recompute whole, no 'i.part' entries)")
        out.add(i)
    return out


def enable_activation_checkpointing(model: nn.Module, layers: Optional[Iterable[Union[int, str]]] = None) -> None:
    """Recompute every layer of ``model`` (a transformers model or a pipeline stage of one) in backward, or
    the listed layer indices; the rest keep their activations."""
    chosen = _indices(model, layers)
    owned = owned_layers(model)
    for i, _, layer in owned:
        on = chosen is None or i in chosen
        layer.__class__ = _recomputing(type(layer)) if on else _plain(type(layer))
    any_on = bool(recomputed(model))
    layer_ids = {id(m) for _, _, m in owned}
    for m in model.modules():  # the base model's flag (not the layers': they recompute by their class)
        if id(m) not in layer_ids and isinstance(getattr(m, "gradient_checkpointing", None), bool) \
                and "gradient_checkpointing" in vars(m):
            m.gradient_checkpointing = any_on


def recomputed(model: nn.Module) -> List[int]:
    """Indices of the layers of ``model`` that recompute in backward now."""
    return [i for i, _, m in owned_layers(model) if getattr(type(m), "_cl_recomputes", False)]
