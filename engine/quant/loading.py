"""Load a full-precision safetensors checkpoint straight into an int8 model, tensor by tensor.

The model is built on the meta device and materialised module by module, each linear's weight
quantised as it is read, so peak host memory stays near the int8 model plus one full-precision
tensor (docs/kernels.md, "Int8 inference").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.nn as nn

from ..lazy import default_init, is_lazy, lazy_init, materialize_module, meta_names
from .int8 import (
    Int8Embedding,
    Int8Linear,
    _is_linear,
    cast_unquantized,
    check_dtype,
    check_mode,
    is_plain_embedding,
    quantize_weight,
)

PathLike = Union[str, os.PathLike]


class ShardReader:
    """``name -> tensor`` over a sharded safetensors checkpoint, one tensor per read.

    Each read opens the shard, copies one tensor out and closes (unmaps) it again, so no
    shard's pages stay resident between reads.
    """

    def __init__(self, path: PathLike):
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"load_quantized: no checkpoint at {path}")
        from safetensors import safe_open

        from ..checkpoint_io.safetensors_shards import checkpoint_files

        self._open = safe_open
        self.where: Dict[str, Path] = {}
        for f in checkpoint_files(path):
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    self.where.setdefault(k, f)
        if not self.where:
            raise ValueError(f"load_quantized: checkpoint {path} holds no tensors")

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def __call__(self, name: str) -> Optional[torch.Tensor]:
        f = self.where.get(name)
        if f is None:
            return None
        with self._open(str(f), framework="pt") as h:
            return h.get_tensor(name).clone()  # own memory, not a view of the mapping


def _tied_names(model: nn.Module) -> Dict[str, Tuple[str, ...]]:
    """``{name: every name of that tensor}`` for tensors registered under several names (tied weights, an
    MLM decoder's bias), the name asked for first."""
    groups: Dict[int, List[str]] = {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for n, t in named:
        groups.setdefault(id(t), []).append(n)
    return {n: (n, *[m for m in names if m != n]) for names in groups.values() if len(names) > 1 for n in names}


def _is_conv1d(module: nn.Module) -> bool:
    from ..models.hf.local_linear import is_conv1d

    return is_conv1d(module)


def _build_meta(model) -> nn.Module:
    if isinstance(model, nn.Module):
        if not is_lazy(model):
            raise ValueError("load_quantized: the model already has real weights; pass a config, a "
                             "class/factory, or a model built under colossal_lab.engine.lazy.lazy_init()")
        return model
    build = getattr(model, "build", None)  # a config that knows its model (the contract's ModelConfig)
    if not callable(build) and not callable(model):
        raise TypeError(f"load_quantized: model must be a config with build(), a factory returning an "
                        f"nn.Module, or a meta-device module; got {type(model).__name__}")
    with lazy_init():
        built = build() if callable(build) else model()
    if not isinstance(built, nn.Module):
        raise TypeError(f"load_quantized: {type(model).__name__} built a {type(built).__name__}, not an nn.Module")
    return built


@torch.no_grad()
def load_quantized(model, checkpoint_path: PathLike, mode: str = "int8", *, device: Union[str, torch.device] = "cpu",
                   embeddings: bool = True, skip: Iterable[str] = (), dtype: Optional[torch.dtype] = None,
                   tp_group=None) -> nn.Module:
    """Build ``model`` lazily and fill it from ``checkpoint_path``, quantising as tensors arrive.

    ``model``: a config with ``build()`` (e.g. ``GPTConfig``), a zero-argument factory, or a module
    built under ``lazy_init()``.
    ``dtype``: compute dtype of activations and unquantised tensors (as in ``quantize``; default: as stored).
    ``tp_group``: a ``torch.distributed`` group (or ``True`` for the default group) — shard
    each quantised linear named in the model's plan as it loads (``model.tp_plan()``, or a transformers
    model's own plan: see :mod:`.tp`).
    """
    check_mode(mode)
    check_dtype(dtype)
    device = torch.device(device)
    reader = ShardReader(checkpoint_path)
    model = _build_meta(model)
    skip = set(skip)
    plan, rank, world = {}, 0, 1
    if tp_group is not None:
        from .tp import _group_info, _tp_styles

        plan = _tp_styles(model)
        rank, world, tp_group = _group_info(model, tp_group)
    init = default_init(model)
    memo: Dict[int, torch.Tensor] = {}
    qmemo: Dict[int, tuple] = {}
    persistent = set(model.state_dict().keys())
    aliases = _tied_names(model)

    def load(name: str) -> Optional[torch.Tensor]:
        # a tied tensor is saved under one of its names (save_pretrained keeps one): any of them will do
        t = next((reader(n) for n in aliases.get(name, (name,)) if n in reader), None)
        if t is None and name in persistent:
            raise ValueError(f"load_quantized: checkpoint {checkpoint_path} has no tensor {name!r} "
                             f"(it holds e.g. {sorted(reader.where)[:3]})")
        return t

    for name, module in list(model.named_modules()):
        kind = (Int8Linear if _is_linear(module) else
                Int8Embedding if embeddings and is_plain_embedding(module) else None)
        if kind is None or name in skip:
            materialize_module(module, name, device, load, init, memo)
            continue
        key = id(module.weight)
        if key not in qmemo:
            w = load(f"{name}.weight")
            if tuple(w.shape) != tuple(module.weight.shape):
                raise ValueError(f"load_quantized: {name}.weight is {tuple(w.shape)} in the checkpoint, "
                                 f"the model expects {tuple(module.weight.shape)}")
            qmemo[key] = quantize_weight(w.t() if _is_conv1d(module) else w)  # Conv1D stores (in, out)
            del w
        q, s = qmemo[key]
        if kind is Int8Linear:
            bias = load(f"{name}.bias") if module.bias is not None else None
            if name in plan:
                from .tp import slice_for_tp

                new = slice_for_tp(q, s, bias, plan[name], rank, world, tp_group, name)
            else:
                new = Int8Linear.from_quantized(q, s, bias)
        else:
            new = Int8Embedding(q, s, module.padding_idx)
        model.set_submodule(name, new.to(device))
    if plan:
        from .tp import divide_heads

        divide_heads(model, plan, world, rank)
        model._int8_tp_sharded = True  # shard_int8_tp refuses it
    left = meta_names(model)
    if left:
        raise ValueError(f"load_quantized: tensors left unloaded: {left[:5]}")
    if dtype is not None:
        cast_unquantized(model, dtype)
    return model
