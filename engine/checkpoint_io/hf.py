"""Save and load a transformers model's checkpoint in transformers' own layout, from any plugin.

``save_hf`` writes what ``AutoModel*.from_pretrained(dir)`` loads unchanged: ``config.json`` and
``generation_config.json`` through the model's own config objects (``save_pretrained``), safetensors
files under the unwrapped model's names, ``model.safetensors.index.json`` when there is more than one
file, tied weights once (the names transformers' ``save_pretrained`` leaves out). The whole model is
never on one rank: every rank walks the tensors in one order, making each whole (a collective only where
it is sharded), and the writer (world rank 0) holds at most one file's tensors plus the tensor in hand
(Gemini: the chunk in hand), writing each file as soon as it is complete. The directory is swapped in
atomically (``atomic.atomic_dir``): a crash leaves the previous checkpoint.

``load_hf`` reads an HF directory (index or ``model.safetensors``) or one ``.safetensors`` file; each
rank reads through ``safe_open(...).get_slice`` only the bytes its layout keeps (views: ``hf_layout``).
Strict: a missing or unexpected name, a shape that differs, a file that is not safetensors, a path that
does not exist all raise, naming what is wrong, before any tensor is changed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import torch.distributed as dist

from .. import comm
from .atomic import atomic_dir, recover
from .hf_files import HFReader, ShardWriter, plan_files
from .hf_layout import check_shapes, tied_aliases
from .hf_stages import StagesView, save_stages

HF_CONFIG_FILES = ("config.json", "generation_config.json")


def _writer() -> bool:
    return not comm.initialized() or dist.get_rank() == 0


def _write_configs(hf, directory: Path) -> List[str]:
    """transformers' own writers: what ``from_pretrained`` reads back. The config records the class
    (``architectures``) as ``save_pretrained`` does. Returns the files written."""
    config = getattr(hf, "config", None)
    if config is None:
        return []
    config.architectures = [type(hf).__name__]
    config.save_pretrained(str(directory))
    gen = getattr(hf, "generation_config", None)
    if gen is not None and getattr(hf, "can_generate", lambda: False)():
        gen.save_pretrained(str(directory))
    return [f for f in HF_CONFIG_FILES if (directory / f).exists()]


def save_hf(view, path, size_per_shard: float = 1024, shard: bool = True) -> Optional[List[str]]:
    """Write ``view``'s model as an HF checkpoint directory ``path`` (collective); ``size_per_shard`` in
    MB bounds each file (``shard=False``: one ``model.safetensors``). Returns the files written (writer
    rank; None elsewhere)."""
    if str(path).endswith(".safetensors"):
        raise ValueError(f"save_model(path={str(path)!r}): a transformers model is saved as a directory "
                         "(config.json + safetensors), which from_pretrained loads; pass a directory path")
    if size_per_shard <= 0:
        raise ValueError(f"save_model(size_per_shard={size_per_shard}): must be a positive number of MB")
    if isinstance(view, StagesView):  # a pipeline: each stage writes its own files (hf_stages.py)
        if not shard:
            raise ValueError("save_model(shard=False) under pp_size > 1: each pipeline stage writes its own "
                             "files, so the checkpoint cannot be one file; pass shard=True")
        return save_stages(view, path, size_per_shard, _write_configs)
    aliases = tied_aliases(view.hf)
    entries = [(n, s, d) for n, s, d in view.entries() if n not in aliases]
    sizes = [(n, _numel(s) * d.itemsize) for n, s, d in entries]
    plan = plan_files(sizes, int(size_per_shard * 1024 * 1024)) if shard else [[n for n, _ in sizes]]
    keep = {n for n, _ in sizes}
    files = None
    with atomic_dir(path, collective=True) as tmp:
        writer = ShardWriter(tmp, plan, write=_writer())
        for name, t in view.iter_full(keep):
            writer.add(name, t)
        files = writer.finish()
        if _writer():
            files += _write_configs(view.hf, tmp)
    return files if _writer() else None


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _aliases(view) -> Dict[str, str]:
    """Tied names of the whole model (a pipeline's view knows every stage's names)."""
    return view.aliases() if hasattr(view, "aliases") else tied_aliases(view.hf)


def resolve_sources(view, reader: HFReader, path, strict: bool = True) -> Dict[str, str]:
    """``{model name: name in the files}`` for this rank's tensors: each name as saved, or a tied alias read
    from its partner; missing (this rank's) and unexpected (the whole model's) names raise (``strict``)."""
    aliases = _aliases(view)
    partners: Dict[str, List[str]] = {}
    for a, s in aliases.items():
        partners.setdefault(a, []).append(s)
        partners.setdefault(s, []).append(a)
    have = set(reader.names())
    source, missing = {}, []
    for n, _, _ in view.entries():
        found = n if n in have else next((p for p in partners.get(n, []) if p in have), None)
        if found is None:
            missing.append(n)
        else:
            source[n] = found
    known = set(view.all_names() if hasattr(view, "all_names") else (n for n, _, _ in view.entries())) | set(aliases)
    unexpected = sorted(have - known)
    if strict and (missing or unexpected):
        raise RuntimeError(f"load_model({str(path)!r}): the checkpoint does not match {type(view.hf).__name__}: "
                           f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}, unexpected keys "
                           f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}; pass strict=False to skip them")
    return source


def load_hf(view, path, strict: bool = True) -> HFReader:
    """Load an HF checkpoint into ``view``'s model, each rank reading only its own part. Each rank checks
    its own tensors against the file headers and its plan of reads against its shards; then the ranks
    agree (one all-gather), so a problem any rank found is raised by every rank before anything is
    copied (the ranks of a pipeline check different tensors)."""
    if _writer():
        recover(path)  # a swap a crash interrupted (atomic.py)
    if comm.initialized():
        comm.barrier()
    reader = source = error = None
    try:
        reader = HFReader(path)
        source = resolve_sources(view, reader, path, strict)
        check_shapes(reader, source, view.entries(), path)
        bad = view.check_reads(source) if hasattr(view, "check_reads") else []
        if bad:
            raise RuntimeError(f"load_model({str(path)!r}): this loader cannot read the shards of this layout: "
                               + "; ".join(bad[:6]))
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        error = exc
    agree(error)
    view.load(reader, source, set())
    if comm.initialized():
        comm.barrier()
    return reader


_KINDS = {k.__name__: k for k in (FileNotFoundError, ValueError, RuntimeError, KeyError)}


def agree(error: Optional[BaseException]) -> None:
    """Raise on every rank if any rank found a problem: the distinct messages, in rank order, as one error
    of the first one's type (one all-gather; nothing when no process group runs)."""
    if not comm.initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    found = [None] * dist.get_world_size()
    comm.all_gather_object(found, None if error is None else (type(error).__name__, str(error)))
    found = [f for f in found if f is not None]
    if not found:
        return
    text = " | ".join(dict.fromkeys(m for _, m in found))
    raise _KINDS.get(found[0][0], RuntimeError)(text) from error


def hf_module(model):
    """The transformers model inside ``model`` (a boosted wrapper, DDP, or the model), or None."""
    from ..models.hf import is_hf_model
    from .checkpoint_io_base import unwrap_model

    m = unwrap_model(model)
    for _ in range(4):
        if is_hf_model(m):
            return m
        m = getattr(m, "module", None)
        if m is None:
            return None
    return None
