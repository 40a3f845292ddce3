"""How a layout flows through the ops between linears.

A tensor is whole (``None``) or cut along one dimension (its index; a tuple for an op with tuple
outputs). Elementwise ops keep a cut when every operand is cut alike or broadcasts along it (size
1); transposes/permutes move it; a view keeps it when the elements before the cut dimension are
the same on both sides, the new dimension divides by ``tp`` and the code passed ``-1`` there (the
local shard runs the same Python); SDPA takes q/k/v cut over heads; select/slice/softmax/reductions
keep a cut on another dimension. Every other op needs its inputs whole. DTensor changes a layout
only at a linear's input or output, so a cut tensor reaching an op that needs it whole makes the
combination infeasible (:class:`Conflict`): it is ruled out, not priced as a gather that could not
happen.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional

from .ops import RESHAPES, is_pointwise, opname, shape

# ops whose output has their first input's layout
_SAME_LAYOUT = {"type_as", "to", "_to_copy", "clone", "contiguous", "alias", "detach", "dropout", "lift_fresh_copy"}


class Conflict(Exception):
    """A layout no module boundary can fix: this combination of strategies is infeasible."""


def dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def layout_of(layouts: Dict[Any, Any], a):
    """The layout of argument ``a`` (None for a constant or a tensor not cut)."""
    return layouts.get(a) if hasattr(a, "op") else None


def layout_after(node, layouts: Dict[Any, Any], tp: int):
    """The layout of ``node``'s output from its inputs' (``None`` whole, ``int`` the cut dim, a
    tuple for tuple outputs); raises :class:`Conflict`."""
    name = opname(node)
    if name == "getitem":
        src, i = node.args
        lay = layouts.get(src)
        return lay[i] if isinstance(lay, tuple) else lay
    ins = [(a, layout_of(layouts, a)) for a in node.all_input_nodes]
    cut = [(a, l) for a, l in ins if l is not None]
    if not cut:
        return None
    if name in _SAME_LAYOUT:
        return layout_of(layouts, node.args[0])
    if name == "native_dropout":
        lay = layout_of(layouts, node.args[0])
        return (lay, lay)
    if is_pointwise(node):
        return _pointwise(node, ins, cut)
    (src, lay), = cut if len(cut) == 1 else [(None, None)]
    rule = _RULES.get(name)
    if rule is None:
        raise Conflict  # an op that needs the whole tensor
    return rule(node, src, lay, layouts, tp)


def _pointwise(node, ins, cut) -> int:
    """Every cut operand cut along the same output dimension, every whole one broadcast along it."""
    out = shape(node)
    ndim, d = len(out), None
    for a, l in cut:
        dd = l + ndim - len(shape(a))
        if d not in (None, dd) or shape(a)[l] != out[dd]:
            raise Conflict
        d = dd
    for a, l in ins:
        if l is None and shape(a) is not None:
            k = d - (ndim - len(shape(a)))
            if k >= 0 and shape(a)[k] != 1:
                raise Conflict  # a whole operand along the cut: no boundary to gather at
    return d


# ---- moves: views, transposes, permutes


def _view_rule(node, lay: int, tp: int) -> int:
    src = node.args[0]
    ins, out = shape(src), shape(node)
    left = math.prod(ins[:lay])
    o = next((i for i in range(len(out)) if math.prod(out[:i]) == left and out[i] > 1), None)
    if o is None or out[o] % tp or math.prod(out[o:]) != math.prod(ins[lay:]):
        raise Conflict
    name = opname(node)
    if name in ("view", "reshape", "_unsafe_view"):
        sizes = node.args[1]
        if len(sizes) == len(out) and sizes[o] != -1:  # the local shard runs view(..., full width, ...)
            raise Conflict
    elif name == "unflatten":
        d0, sizes = dim(node.args[1], len(ins)), node.args[2]
        if d0 <= o < d0 + len(sizes) and sizes[o - d0] != -1:
            raise Conflict
    return o


def _reshape(node, src, lay, layouts, tp) -> int:
    if src is not node.args[0]:
        raise Conflict
    return _view_rule(node, lay, tp)


def _transpose(node, src, lay, layouts, tp) -> Optional[int]:
    n = len(shape(node))
    d0, d1 = dim(node.args[1], n), dim(node.args[2], n)
    return d1 if lay == d0 else d0 if lay == d1 else lay


def _t(node, src, lay, layouts, tp) -> int:
    return 1 - lay


def _permute(node, src, lay, layouts, tp) -> int:
    perm = [dim(p, len(shape(node))) for p in node.args[1]]
    return perm.index(lay)


# ---- indexing


def _select(node, src, lay, layouts, tp) -> int:
    d = dim(node.args[1], len(shape(src)))
    if d == lay:
        raise Conflict
    return lay - (d < lay)


def _slice(node, src, lay, layouts, tp) -> int:
    out = shape(node)
    d = dim(node.args[1] if len(node.args) > 1 else 0, len(out))
    if d == lay and out[d] != shape(src)[d]:
        raise Conflict
    return lay


# ---- reductions


def _softmax(node, src, lay, layouts, tp) -> int:
    if dim(node.args[1], len(shape(node))) == lay:
        raise Conflict
    return lay


def _reduce(node, src, lay, layouts, tp) -> int:
    src_nd = len(shape(src))
    dims = node.args[1] if len(node.args) > 1 else None
    if not dims:
        raise Conflict
    dims = [dim(x, src_nd) for x in dims]
    keep = len(node.args) > 2 and node.args[2]
    if lay in dims:
        raise Conflict
    return lay if keep else lay - sum(1 for x in dims if x < lay)


# ---- joins


def _join(node, src, lay, layouts, tp) -> int:
    tensors = node.args[0]
    lays = {layout_of(layouts, t) for t in tensors}
    if len(lays) != 1:
        raise Conflict
    lay = lays.pop()
    nd = len(shape(tensors[0]))
    if opname(node) == "cat":
        if dim(node.args[1] if len(node.args) > 1 else 0, nd) == lay:
            raise Conflict
        return lay
    d = dim(node.args[1] if len(node.args) > 1 else 0, nd + 1)
    return lay + (d <= lay)


# ---- products


def _attention(node, src, lay, layouts, tp) -> int:
    """SDPA on q/k/v cut over heads (dim 1); a whole mask must broadcast over heads."""
    q, k, v = node.args[:3]
    if {layout_of(layouts, t) for t in (q, k, v)} != {1} or len(shape(node)) != 4:
        raise Conflict
    for a in node.all_input_nodes:
        if a not in (q, k, v) and layout_of(layouts, a) is None and shape(a) and len(shape(a)) == 4 \
                and shape(a)[1] != 1:
            raise Conflict
    return 1


def _matmul(node, src, lay, layouts, tp) -> int:
    """Both cut alike on a batch dimension, or the left cut on its rows and the right whole."""
    a, b = node.args[:2]
    la, lb = layout_of(layouts, a), layout_of(layouts, b)
    na, nb = len(shape(a)), len(shape(b))
    if la is not None and lb is not None and la == lb and la < na - 2 and na == nb:
        return la
    if lb is None and la is not None and la == na - 2:
        return len(shape(node)) - 2
    raise Conflict


_RULES: Dict[str, Callable[..., Any]] = {
    **{n: _reshape for n in RESHAPES}, "transpose": _transpose, "t": _t, "permute": _permute,
    "select": _select, "slice": _slice,
    **{n: _softmax for n in ("softmax", "_softmax", "log_softmax", "_log_softmax")}, "mean": _reduce, "sum": _reduce,
    "stack": _join, "cat": _join,
    "scaled_dot_product_attention": _attention, "matmul": _matmul, "bmm": _matmul}
