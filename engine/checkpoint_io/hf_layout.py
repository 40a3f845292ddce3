"""Where an HF model's tensors live on this rank, under transformers' own names.

A *view* answers three questions for the HF checkpoint code (``hf.py``): which tensors the model
has (name, global shape, dtype, in an order every rank shares), each one whole (a collective where
it is sharded), and how to fill this rank's part from an :class:`~.hf_files.HFReader`.
:class:`ModuleView` serves every layout whose tensors are module attributes (one process, DDP's
``module.``, ZeRO-1, FSDP2's ZeRO-2 DTensors over dp, tensor-parallel DTensors over tp, activation
checkpointing's ``_checkpoint_wrapped_module.`` infix); Gemini's chunks have their own view
(``engine/gemini/hf_view.py``). A DTensor's local shard is read as the boxes of indices torch's
``Shard`` (``torch.chunk`` split, uneven last shard) and ``_StridedShard`` (``split_factor`` parts, each
chunked: GPT-2's packed q|k|v) give this rank, so no rank reads another rank's bytes.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn

from .hf_files import HFReader, Runs

_CKPT_INFIX = "_checkpoint_wrapped_module."


def tied_aliases(hf: nn.Module, names: Optional[Set[str]] = None) -> Dict[str, str]:
    """``{alias: name written}`` of tied tensors: transformers 5's ``all_tied_weights_keys`` (target ->
    source: what ``save_pretrained`` leaves out and ``from_pretrained`` re-ties), plus any parameter
    registered under several names (later names -> the first), as transformers < 5 dedupes them.
    ``names``: the tensor names of the whole model where ``hf`` holds only part of it (a pipeline stage:
    the embedding on the first, its tied head on the last); by default ``hf``'s own."""
    aliases = dict(getattr(hf, "all_tied_weights_keys", None) or {})
    seen: Dict[int, str] = {}
    for n, p in hf.named_parameters(remove_duplicate=False):
        first = seen.setdefault(id(p), n)
        if first != n and n not in aliases:
            aliases[n] = first
    if names is None:
        names = {n.replace(_CKPT_INFIX, "") for n in hf.state_dict(keep_vars=True)}
    return {a: s for a, s in aliases.items() if a in names and s in names and a != s}


def _runs(idx: torch.Tensor) -> Runs:
    """Contiguous ``[start, stop)`` runs of a sorted index vector."""
    out: Runs = []
    for i in idx.tolist():
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def local_runs(t) -> List[Runs]:
    """Per dimension, the global index runs of this rank's local shard of DTensor ``t``."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard  # not a Shard subclass in torch 2.13

    mesh, coord = t.device_mesh, t.device_mesh.get_coordinate()
    idx = [torch.arange(n) for n in t.shape]
    for mi, p in enumerate(t.placements):
        if not isinstance(p, (Shard, _StridedShard)):
            continue
        n, r = mesh.size(mi), coord[mi]
        parts = idx[p.dim].chunk(getattr(p, "split_factor", 1))  # _StridedShard: its parts, each chunked
        pieces = [part.chunk(n) for part in parts]
        idx[p.dim] = torch.cat([ch[r] if r < len(ch) else part[:0] for ch, part in zip(pieces, parts)])
    return [_runs(i) for i in idx]


def _is_dtensor(t) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


class ModuleView:
    """The tensors of ``hf`` (an HF ``PreTrainedModel``, possibly sharded in place by tp or FSDP2)."""

    def __init__(self, hf: nn.Module):
        self.hf = hf
        self._reshard()
        self.tensors: Dict[str, torch.Tensor] = {n.replace(_CKPT_INFIX, ""): t
                                                 for n, t in hf.state_dict(keep_vars=True).items()}

    def _reshard(self) -> None:
        """FSDP2 leaves parameters gathered after a forward without backward (reshard_after_forward
        False): put them back to their sharded DTensors, which are what this view reads and writes."""
        for m in self.hf.modules():
            if hasattr(m, "reshard") and type(m).__name__.startswith("FSDP"):
                m.reshard()

    def entries(self) -> List[Tuple[str, Tuple[int, ...], torch.dtype]]:
        return [(n, tuple(t.shape), t.dtype) for n, t in self.tensors.items()]

    def iter_full(self, keep: Set[str]) -> Iterator[Tuple[str, torch.Tensor]]:
        for n, t in self.tensors.items():
            if n in keep:  # every rank walks the same names: full_tensor() is a collective
                yield n, (t.full_tensor() if _is_dtensor(t) else t).detach()

    def check_reads(self, source: Dict[str, str]) -> List[str]:
        """This rank's plan of reads against its own shards, before any byte is read: for each DTensor, the
        box its placements give this rank must have the local shard's shape (else a placement this loader
        does not know). Returns the problems found (``hf.load_hf`` makes every rank agree on them)."""
        bad = []
        for n, t in self.tensors.items():
            if n in source and _is_dtensor(t):
                want = tuple(sum(b - a for a, b in r) for r in local_runs(t))
                if want != tuple(t.to_local().shape):
                    bad.append(f"{n}: this rank's shard has shape {tuple(t.to_local().shape)}, its placements "
                               f"{tuple(t.placements)} give a slice of shape {want}")
        return bad

    @torch.no_grad()
    def load(self, reader: HFReader, source: Dict[str, str], done: Set[int]) -> None:
        """Fill each tensor (once per storage: ties) from ``source[name]`` in the files."""
        for n, t in self.tensors.items():
            if n not in source or id(t) in done:
                continue
            done.add(id(t))
            if _is_dtensor(t):
                local = t.to_local()
                data = reader.read_runs(source[n], local_runs(t))
            else:
                local, data = t, reader.read(source[n])
            if tuple(data.shape) != tuple(local.shape):  # check_reads ruled this out on every rank first
                raise RuntimeError(f"load_model: {n!r}: this rank's part has shape {tuple(local.shape)} but "
                                   f"{tuple(data.shape)} was read for it; the layout is not one this loader knows")
            local.copy_(data.to(dtype=local.dtype))


def check_shapes(reader: HFReader, source: Dict[str, str], entries: Sequence[Tuple[str, tuple, torch.dtype]],
                 path) -> None:
    """Every tensor's shape in the files (their headers: nothing is read) against the model's."""
    bad = [(n, reader.shape(source[n]), s) for n, s, _ in entries if n in source and reader.shape(source[n]) != s]
    if bad:
        raise RuntimeError(f"load_model({str(path)!r}): shapes differ from the model's: "
                           + "; ".join(f"{n}: expected {m} (the model), found {f} (the file)" for n, f, m in bad[:6])
                           + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
                           + " (was the checkpoint saved from this model's configuration?)")
