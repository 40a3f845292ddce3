"""The linears a transformers model's tensor-parallel plan cuts, and how, for the code that cuts them by
its own means rather than through ``parallelize_module``: ``cl.autoshard`` (which searches over these cuts)
and tensor-parallel int8 serving (which slices int8 weights with plain collectives).

The plan is the one the plugin applies (:func:`.resolve_plan`: the user's ``tp_plan=``, the model's own,
or the built-in table), its patterns expanded to module names (:func:`.plan._matches`); each style is read
down to the cut of one linear's weight. Embeddings are left out (both users cut linears only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch.nn as nn

from .local_linear import is_conv1d
from .plan import _matches
from .styles import _parse, check_name

_COL = ("colwise", "local_colwise", "packed_colwise")
_COL_GATHER = ("colwise_rep", "colwise_gather_output")
_ROW = ("rowwise", "local_rowwise")
_ROW_SPLIT = ("rowwise_rep", "rowwise_split_input")


@dataclass(frozen=True)
class Cut:
    """How the plan cuts one linear: ``kind`` ``"col"`` (output features) or ``"row"`` (input features);
    ``gather``: a column cut whose output is gathered whole (an LM head); ``split_input``: a row cut whose
    input arrives whole and is split on the rank; ``parts``: a column cut of a weight packing that many
    equal parts (GPT-2's q|k|v), each cut alike; ``conv1d``: the weight is stored ``(in, out)``."""

    kind: str
    gather: bool = False
    split_input: bool = False
    parts: int = 1
    conv1d: bool = False


def _is_linear(mod: nn.Module) -> bool:
    """An ``nn.Linear``, a ``Conv1D``, or a drop-in with feature counts (an int8 linear), not an embedding."""
    if isinstance(mod, nn.Embedding) or type(mod).__name__.endswith("Embedding"):
        return False
    return isinstance(mod, nn.Linear) or is_conv1d(mod) or hasattr(mod, "in_features")


def _cut_of(entry) -> Optional[Cut]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(entry, ColwiseParallel):  # a torch style from the user's tp_plan=
        return Cut("col", gather=entry.output_layouts == Replicate())
    if isinstance(entry, RowwiseParallel):
        return Cut("row", split_input=entry.input_layouts == Replicate())
    if not isinstance(entry, (str, tuple)):
        return None
    name, opts = _parse(entry)
    if name in _COL:
        return Cut("col", parts=int(opts.get("parts", 2 if name == "packed_colwise" else 1)))
    if name in _COL_GATHER:
        return Cut("col", gather=True)
    if name in _ROW:
        return Cut("row")
    if name in _ROW_SPLIT:
        return Cut("row", split_input=True)
    return None  # kept whole (replicate, norms), or an embedding's style


def linear_cuts(model: nn.Module, user_plan: Optional[dict] = None, tp: int = 0) -> Dict[str, Cut]:
    """``{module name: Cut}`` for every linear the model's plan (or ``user_plan``) cuts; an unknown style
    raises naming it, a model without a plan raises naming ``tp_plan=`` (:func:`.resolve_plan`)."""
    from . import resolve_plan

    plan = resolve_plan(model, user_plan, tp)[0]
    out: Dict[str, Cut] = {}
    for pattern, name, mod in _matches(plan, model):
        entry = plan[pattern]
        if isinstance(entry, (str, tuple)):
            check_name(entry, pattern)
        cut = _cut_of(entry)
        if cut is not None and _is_linear(mod):
            out[name] = Cut(cut.kind, cut.gather, cut.split_input, cut.parts, is_conv1d(mod))
    return out


def divide_heads(model: nn.Module, names, tp: int, rank: int) -> None:
    """The built-in table's head-count attributes as one rank's share, and an ALiBi bias sliced to
    ``rank``'s heads, on the modules holding ``names`` (the plugin's own rule, :func:`.share_heads`)."""
    from . import share_heads

    share_heads(model, {n.rpartition(".")[0] for n in names}, tp, rank)
