"""The files of a Hugging Face checkpoint: reading slices of them, writing them in bounded shards.

Built on safetensors' ``safe_open`` (the header gives every tensor's name, shape and dtype without
reading data; ``get_slice(name)[...]`` reads only the bytes of the requested rows/columns) and on
transformers' ``save_pretrained`` layout: ``model.safetensors`` for one file, else
``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json`` (``metadata.total_size``,
``metadata.total_parameters``, ``weight_map``), each file with metadata ``{"format": "pt"}``.
:class:`HFReader` counts the bytes it returns, which is what ``bench/hf_checkpoint.py`` reports.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

PathLike = Union[str, os.PathLike]
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
Runs = List[Tuple[int, int]]  # contiguous [start, stop) runs of one dimension's indices
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class HFReader:
    """Name -> file of an HF checkpoint (a directory with an index or ``model.safetensors``, or one
    ``.safetensors`` file); reads whole tensors, boxes of runs, or flat ranges."""

    def __init__(self, path: PathLike):
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"load_model({str(path)!r}): no such file or directory")
        if path.is_dir():
            if (path / INDEX).exists():
                weight_map = json.loads((path / INDEX).read_text())["weight_map"]
                files = {n: path / f for n, f in weight_map.items()}
            elif (path / SINGLE).exists():
                files = None
                path = path / SINGLE
            else:
                raise FileNotFoundError(f"load_model({str(path)!r}): the directory holds neither {INDEX} nor "
                                        f"{SINGLE} (what transformers' save_pretrained writes)")
        else:
            files = None
        self.path = path
        self._handles: Dict[Path, object] = {}
        if files is None:
            files = {n: path for n in self._open(path).keys()}
        self.files = files
        self.bytes_read = 0

    def _open(self, f: Path):
        if f not in self._handles:
            if not f.exists():
                raise FileNotFoundError(f"load_model: {f} is named by the index but does not exist")
            try:
                self._handles[f] = safe_open(str(f), framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                raise ValueError(f"load_model: {f} is not a safetensors file ({exc})") from None
        return self._handles[f]

    def names(self) -> List[str]:
        return list(self.files)

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._open(self.files[name]).get_slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        t = self._open(self.files[name]).get_tensor(name)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def read_runs(self, name: str, runs: Sequence[Runs]) -> torch.Tensor:
        """The box of ``runs`` (one list of ``[start, stop)`` per dimension), each run read with
        ``get_slice`` and the pieces concatenated: a strided shard is several runs on its dimension."""
        sl = self._open(self.files[name]).get_slice(name)
        if not runs:
            return self.read(name)
        if any(not r for r in runs):  # an empty shard (torch.chunk gave this rank nothing)
            return torch.empty([sum(b - a for a, b in r) for r in runs], dtype=_DTYPES[sl.get_dtype()])
        out = _box(sl, list(runs), ())
        self.bytes_read += out.numel() * out.element_size()
        return out

    def read_flat(self, name: str, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)`` of the row-major flattened tensor: the covering rows of dimension 0 are
        read (at most one partial row too many at each end), then trimmed."""
        shape = self.shape(name)
        if len(shape) == 0:
            return self.read(name).reshape(-1)[a:b]
        row = 1
        for n in shape[1:]:
            row *= n
        r0, r1 = a // row, -(-b // row)
        t = self.read_runs(name, [[(r0, r1)]] + [[(0, n)] for n in shape[1:]]).reshape(-1)
        return t[a - r0 * row:b - r0 * row]


def _box(sl, runs: List[Runs], prefix: tuple) -> torch.Tensor:
    d = len(prefix)
    if d == len(runs):
        return sl[prefix]
    parts = [_box(sl, runs, prefix + (slice(a, b),)) for a, b in runs[d]]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=d)


def plan_files(sizes: Sequence[Tuple[str, int]], max_shard_bytes: int) -> List[List[str]]:
    """Greedy, order-preserving split of ``(name, nbytes)`` into files of at most ``max_shard_bytes``
    (a tensor larger than that gets a file of its own), as transformers' ``max_shard_size`` does."""
    files: List[List[str]] = [[]]
    size = 0
    for name, n in sizes:
        if files[-1] and size + n > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += n
    return files


class ShardWriter:
    """Takes tensors in plan order and writes each file as soon as its last tensor arrived, so at
    most one file's tensors are held. ``write=False`` (a rank that does not write) only checks order."""

    def __init__(self, directory: Optional[Path], plan: List[List[str]], write: bool,
                 names: Optional[List[str]] = None):
        self.dir, self.plan, self.write = directory, plan, write
        self.names = list(names) if names is not None else file_names(len(plan))
        self._file, self._held, self.total_size, self.total_params = 0, {}, 0, 0
        self.peak_held = 0  # bytes held at most (the bound the docs state)

    def add(self, name: str, t: torch.Tensor) -> None:
        want = self.plan[self._file][len(self._held)]
        if name != want:
            raise RuntimeError(f"save_model: tensors arrived out of plan order ({name!r}, expected {want!r})")
        if self.write:
            t = t.detach().to("cpu", copy=True).contiguous()  # never a view of a live chunk/parameter
            self._held[name] = t
            self.total_size += t.numel() * t.element_size()
            self.total_params += t.numel()
            self.peak_held = max(self.peak_held, sum(x.numel() * x.element_size() for x in self._held.values()))
        else:
            self._held[name] = None
        if len(self._held) == len(self.plan[self._file]):
            if self.write:
                save_file(self._held, str(self.dir / self.names[self._file]), metadata={"format": "pt"})
            self._held = {}
            self._file += 1

    def finish_files(self) -> None:
        if self._file != len(self.plan):
            raise RuntimeError(f"save_model: {len(self.plan) - self._file} file(s) never completed")

    def finish(self) -> List[str]:
        self.finish_files()
        if self.write and len(self.plan) > 1:
            write_index(self.dir, self.plan, self.names, self.total_size, self.total_params)
            return self.names + [INDEX]
        return list(self.names)


def file_names(n: int) -> List[str]:
    """transformers' names for ``n`` files: ``model.safetensors``, or ``model-0000i-of-0000N.safetensors``."""
    return [SINGLE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def write_index(directory: Path, plan: List[List[str]], names: List[str], total_size: int, total_params: int) -> None:
    """``model.safetensors.index.json`` as ``save_pretrained`` writes it, for files ``names`` holding ``plan``."""
    weight_map = {n: names[i] for i, file in enumerate(plan) for n in file}
    index = {"metadata": {"total_parameters": total_params, "total_size": total_size}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

