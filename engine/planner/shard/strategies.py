"""The five ways to cut one ``nn.Linear`` over ``tp`` ranks, and what each costs.

==================  =============================================  ====================================
``replicated``      whole weight on every rank                     none (a sharded input is gathered)
``column``          weight rows cut: output ``Shard(-1)`` kept     input grad all-reduce ``N·in``
``column+gather``   the same, output all-gathered (``Replicate``)  + all-gather ``N·out``
``row``             weight columns cut: output partial, reduced    all-reduce ``N·out``
``row+scatter``     the same, output reduce-scattered ``Shard(-1)``  reduce-scatter + all-gather ``N·out``
==================  =============================================  ====================================

(``N`` tokens, ``in``/``out`` features; forward + backward, bytes of the whole tensor.) A ``row``
linear whose input arrives whole slices it locally (backward all-gathers ``N·in``); a ``column``
linear whose input arrives cut gathers it (all-gather + reduce-scatter ``N·in``). Compute is the
linear's ``6·N·in·out`` FLOPs (``/tp`` when cut); memory 16 B per fp32 parameter element (weight,
gradient, AdamW's two moments; ``/tp`` for a cut weight, a row-parallel bias stays whole).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

#: strategy name -> (kind, output): kind "R" | "col" | "row"
STRATEGIES: Dict[str, Tuple[str, str]] = {
    "replicated": ("R", "-"), "column": ("col", "keep"), "column+gather": ("col", "gather"),
    "row": ("row", "reduce"), "row+scatter": ("row", "scatter")}
BYTES_PER_PARAM = 16  # fp32 weight + gradient + AdamW exp_avg + exp_avg_sq


@dataclass
class Priced:
    """One linear under one strategy: compute seconds, its collectives' seconds (in the order they
    are added up), parameter elements on a rank, and its output's layout (None: whole)."""

    compute: float
    comm: Tuple[float, ...]
    elems: float
    layout: Optional[int]


def price(lin, strategy: str, lin_in: Optional[int], out_ndim: int, costs, tp: int) -> Priced:
    """Linear ``lin`` (a ``graph.Linear``) cut by ``strategy``, its input arriving whole
    (``lin_in`` None) or cut on its last dimension; ``costs`` a ``costs.CostAdapter``."""
    kind, outk = STRATEGIES[strategy]
    N, el = lin.tokens, lin.elem
    bin_, bout = N * lin.in_features * el, N * lin.out_features * el
    w = lin.in_features * lin.out_features
    b = lin.out_features if lin.bias else 0
    flops = 6.0 * N * lin.in_features * lin.out_features
    if kind == "R":
        comm = (costs.allgather(tp, bin_),) if lin_in is not None else ()
        return Priced(costs.compute(flops), comm, w + b, None)
    if kind == "col":
        gather_in = costs.allreduce(tp, bin_) if lin_in is None else 2 * costs.allgather(tp, bin_)
        if outk == "gather":
            return Priced(costs.compute(flops / tp), (gather_in, costs.allgather(tp, bout)), (w + b) / tp, None)
        return Priced(costs.compute(flops / tp), (gather_in,), (w + b) / tp, out_ndim - 1)
    slice_in = (costs.allgather(tp, bin_),) if lin_in is None else ()
    if outk == "scatter":
        return Priced(costs.compute(flops / tp), slice_in + (2 * costs.allgather(tp, bout),), w / tp + b, out_ndim - 1)
    return Priced(costs.compute(flops / tp), slice_in + (costs.allreduce(tp, bout),), w / tp + b, None)
