"""Expert slices in Gemini's full state: gathered over the EP group to save, cut back to this rank's rows to load.

Under ``GeminiPlugin(ep_size=k)`` a rank's chunks hold only its ``E / k`` experts of each grouped expert
weight (``hybrid.experts.ExpertGroups.shard``). ``GeminiModel.state_dict`` and ``GeminiOptimizer.state_dict``
first gather each chunk over its own group (the expert-dp ranks for expert chunks), then :func:`gather`
all-gathers every expert tensor over the EP group (``ExpertGroups.full``: every rank, in the same sorted
order), so the saved state is the one-process model's. :func:`cut` keeps this rank's rows of a whole
tensor before a load, so a checkpoint of one process (or of another EP size) loads.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, Iterable, Sequence, Tuple

import torch

MODEL = ("", ("",))                                       # state key = parameter name
OPTIM = ("state.", (".exp_avg", ".exp_avg_sq"))           # GeminiOptimizer.state_dict's moment keys


def keys(experts, form=MODEL) -> Iterable[Tuple[str, str]]:
    """``(state key, parameter name)`` of every expert tensor, in the same order on every rank."""
    prefix, suffixes = form
    for name in sorted(experts.names):
        for suf in suffixes:
            yield prefix + name + suf, name


def gather(out: Dict[str, torch.Tensor], experts, form=MODEL) -> None:
    """Replace this rank's expert slices in ``out`` by the whole tensors (collective over the EP group)."""
    for k, _ in keys(experts, form):
        if k in out:
            out[k] = experts.full(out[k])


def cut(sd: Dict[str, torch.Tensor], experts, local_shape: Dict[str, Sequence[int]], form=MODEL
        ) -> Dict[str, torch.Tensor]:
    """``sd`` with each whole expert tensor cut to this rank's rows (a tensor of another shape is kept:
    the local shape of this same layout, or a wrong one the load's shape check names)."""
    sd = dict(sd)
    for k, name in keys(experts, form):
        t, shape = sd.get(k), local_shape.get(name)
        if t is None or shape is None:
            continue
        local = SimpleNamespace(shape=tuple(shape))
        if tuple(t.shape) == experts.full_shape(local):
            lo, hi = experts.rows(local)
            sd[k] = t[lo:hi]
    return sd
