"""Hugging Face-style sharded safetensors: ``model-00001-of-0000N.safetensors`` + index JSON.

Why this layout: it is what ``transformers``/``safetensors`` users already load (a plain
``safetensors.torch.load_file`` on any shard works; ``model.safetensors.index.json`` maps each
tensor name to its shard). safetensors itself writes single files only, so the split and the
index are ours. Writers here do no atomicity of their own: callers write into a directory from
:func:`~colossal_lab.engine.checkpoint_io.atomic.atomic_dir`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch
from safetensors.torch import load_file, save_file

from .atomic import recover

PathLike = Union[str, os.PathLike]

SINGLE_FILE = "{prefix}.safetensors"
SHARD_FILE = "{prefix}-{i:05d}-of-{n:05d}.safetensors"
INDEX_FILE = "{prefix}.safetensors.index.json"


def _prepare(state_dict: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """CPU, contiguous, and no two entries sharing storage (safetensors refuses shared storage;
    tied weights are written twice, which any loader handles)."""
    out: Dict[str, torch.Tensor] = {}
    seen = set()
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"save_state_dict_shards: {name!r} is a {type(t).__name__}, not a tensor")
        if hasattr(t, "full_tensor"):  # a DTensor that slipped through: gather it
            t = t.full_tensor()
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.nbytes and ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def shard_plan(state_dict: Mapping[str, torch.Tensor], max_shard_bytes: int) -> List[List[str]]:
    """Greedy, order-preserving split of names into shards of at most ``max_shard_bytes``
    (a single tensor larger than the limit gets a shard of its own)."""
    shards: List[List[str]] = [[]]
    size = 0
    for name, t in state_dict.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def save_state_dict_shards(state_dict: Mapping[str, torch.Tensor], path: PathLike,
                           size_per_shard: float = 1024, shard: bool = True, prefix: str = "model",
                           metadata: Optional[Dict[str, str]] = None) -> List[str]:
    """Write ``state_dict`` into directory ``path``; returns the file names written.

    ``size_per_shard`` is in MB (Colossal-AI's unit). ``shard=False`` writes one
    ``{prefix}.safetensors``. With more than one shard an index JSON is written too.
    """
    if size_per_shard <= 0:
        raise ValueError(f"size_per_shard={size_per_shard}: must be a positive number of MB")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = _prepare(state_dict)
    meta = {"format": "pt", **(metadata or {})}
    plan = shard_plan(sd, int(size_per_shard * 1024 * 1024)) if shard else [list(sd)]
    if len(plan) == 1:
        name = SINGLE_FILE.format(prefix=prefix)
        save_file(sd, str(path / name), metadata=meta)
        return [name]
    files, weight_map, total = [], {}, 0
    for i, names in enumerate(plan, start=1):
        fname = SHARD_FILE.format(prefix=prefix, i=i, n=len(plan))
        save_file({k: sd[k] for k in names}, str(path / fname), metadata=meta)
        files.append(fname)
        for k in names:
            weight_map[k] = fname
            total += sd[k].numel() * sd[k].element_size()
    index = {"metadata": {"total_size": total, **(metadata or {})}, "weight_map": weight_map}
    (path / INDEX_FILE.format(prefix=prefix)).write_text(json.dumps(index, indent=2, sort_keys=True))
    files.append(INDEX_FILE.format(prefix=prefix))
    return files


def checkpoint_files(path: PathLike, prefix: str = "model") -> List[Path]:
    """The safetensors files of a checkpoint: a file path, a directory with an index, or a
    directory with ``{prefix}.safetensors``."""
    path = recover(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}")
    index = path / INDEX_FILE.format(prefix=prefix)
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    single = path / SINGLE_FILE.format(prefix=prefix)
    if single.exists():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"{path} holds no *.safetensors files (nor {index.name})")
    return found


def iter_state_dict_shards(path: PathLike, prefix: str = "model",
                           device: str = "cpu") -> Iterator[Tuple[Path, Dict[str, torch.Tensor]]]:
    """Yield ``(file, tensors)`` one shard at a time, so a loader can stream large models."""
    for f in checkpoint_files(path, prefix):
        yield f, load_file(str(f), device=device)


def load_state_dict_shards(path: PathLike, prefix: str = "model", device: str = "cpu") -> Dict[str, torch.Tensor]:
    """The whole state dict of a checkpoint written by :func:`save_state_dict_shards`."""
    out: Dict[str, torch.Tensor] = {}
    for _, tensors in iter_state_dict_shards(path, prefix, device):
        out.update(tensors)
    return out
