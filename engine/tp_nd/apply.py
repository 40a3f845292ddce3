"""Turn a model (or a pipeline stage of it) into its 2D / 2.5D / 3D tensor-parallel form.

By hand, on torch modules: which layer plays which role comes from the model contract
(``engine/models/protocol.py``): the model's ``tp_nd_plan()`` (``{module name: role}``), or, without
it, the column/row linears of its 1D ``tp_plan()`` (or the plugin's ``tp_plan=``) plus its
``nn.Embedding``s; a parameter no role covers is an error (a norm left whole would compute its
statistics over a slice of the hidden dimension, silently wrong). Roles:

==============  =====================================================================================
``colwise``     ``nn.Linear`` from the residual stream into a sharded inner width (q/k/v, MLP up/gate)
``rowwise``     ``nn.Linear`` from the inner width back to the stream (attention out, MLP down)
``head``        the LM head: a ``colwise`` whose output is vocab-parallel logits
``embedding``   ``nn.Embedding`` (token or position ids -> the stream)
``rmsnorm``     RMSNorm over the stream's hidden dimension (``weight``; ``eps`` from the module, or
                the role given as ``("rmsnorm", eps)``)
``layernorm``   LayerNorm over the stream's hidden dimension (``weight``, ``bias``; ``eps`` likewise)
==============  =====================================================================================

A linear role may carry options, ``("colwise", {"transposed": True, "parts": 3})``: ``transposed``
for a weight stored ``(in, out)`` (transformers' ``Conv1D``), ``parts`` for an output that packs
equal parts (GPT-2's q | k | v): the output features are reordered before slicing so a rank's block
holds its slice of every part, in order, and put back in order when gathered (:class:`NdParallel`).

Each converted module keeps its parameter names (``weight``/``bias``) and holds this rank's block of
them (:func:`specs` says which), built by slicing the full tensors the model was created with. A
subclass of ``nn.Embedding`` keeps its own forward (OPT's learned positions add an offset before the
lookup): only the lookup it inherits runs on the sharded weight.
Attention, activations and residual adds run unchanged on the local block: the reference GPT infers
its heads from the local width, so a (batch piece, head piece) block is a whole attention problem.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn

from .grid import Layout, Spec, check_spec, layouts

ROLES = ("colwise", "rowwise", "head", "embedding", "rmsnorm", "layernorm")
NORMS = ("rmsnorm", "layernorm")
LINEARS = ("colwise", "rowwise", "head")
LINEAR_OPTIONS = ("transposed", "parts")


# ---- which module is what -----------------------------------------------------------------------

def _role(value) -> Tuple[str, dict]:
    if isinstance(value, tuple) and len(value) == 2 and value[0] in NORMS and not isinstance(value[1], dict):
        return value[0], {"eps": float(value[1])}
    if isinstance(value, tuple) and len(value) == 2 and value[0] in LINEARS and isinstance(value[1], dict) \
            and set(value[1]) <= set(LINEAR_OPTIONS):
        return value[0], dict(value[1])
    if isinstance(value, str) and value in ROLES:
        return value, {}
    raise ValueError(f"tp_nd_plan: role {value!r} is not one of {ROLES} (or (norm role, eps), or (linear role, "
                     f"{{option: value}}) with options {LINEAR_OPTIONS})")


def resolve_plan(model: nn.Module, tp_plan: Optional[dict] = None,
                 roles: Optional[dict] = None) -> Dict[str, Tuple[str, dict]]:
    """``{module name: (role, options)}`` for ``model``; ``ValueError`` naming what is missing.
    ``roles`` (``{module name: role}``) stands for a ``tp_nd_plan()`` the model lacks (the
    transformers adapter derives it from the model's own 1D plan)."""
    own = getattr(model, "tp_nd_plan", None)
    if roles is not None:
        raw = dict(roles)
    elif callable(own):
        raw = dict(own())
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan = tp_plan if tp_plan is not None else (
            model.tp_plan() if callable(getattr(model, "tp_plan", None)) else None)
        if plan is None:
            raise ValueError(f"N-d tensor parallelism: {type(model).__name__} has neither tp_nd_plan() nor tp_plan() "
                             "(the model contract); implement tp_nd_plan() -> {module name: 'colwise' | 'rowwise' | "
                             "'head' | 'embedding' | 'rmsnorm'}")
        raw = {}
        for name, style in plan.items():
            if isinstance(style, ColwiseParallel):
                raw[name] = "colwise"
            elif isinstance(style, RowwiseParallel):
                raw[name] = "rowwise"
        raw.update({n: "embedding" for n, m in model.named_modules() if isinstance(m, nn.Embedding)})
    names = dict(model.named_modules())
    out = {}
    for name, value in raw.items():
        if name not in names:
            continue  # a pipeline stage lacks the other stages' layers
        out[name] = _role(value)
    covered = set(out)
    loose = [n for n, _ in model.named_parameters()
             if n.rpartition(".")[0] not in covered or n.rpartition(".")[2] not in ("weight", "bias")]
    if loose:
        raise ValueError(f"N-d tensor parallelism: no role for parameters {loose[:6]}"
                         f"{' ...' if len(loose) > 6 else ''} of {type(model).__name__}; "
                         f"give their modules a role in tp_nd_plan() (the model contract: {ROLES})")
    seen: Dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            raise ValueError(f"N-d tensor parallelism: {n!r} and {seen[id(p)]!r} are one tied parameter, which the "
                             "2D/2.5D/3D layouts of an embedding and a head cannot share; untie them (give each "
                             "module its own parameter) or use tp_mode='1d'")
        seen[id(p)] = n
    return out


# ---- layouts of parameters ----------------------------------------------------------------------

def _io(role: str, mode: str) -> Tuple[Layout, Layout]:
    stream, inner = layouts(mode)
    return (inner, stream) if role == "rowwise" else (stream, inner)


def specs(role: str, mode: str, transposed: bool = False) -> Dict[str, Spec]:
    """The block layout (:data:`grid.Spec`) of each parameter of a module playing ``role``
    (``transposed``: a linear weight stored ``(in, out)``)."""
    stream, _ = layouts(mode)
    if role in LINEARS:
        lin, lout = _io(role, mode)
        vec = ((lout.hidden,) + lout.batch,)
        if mode == "3d":  # nn.Linear weight (out, in): out by (output axis, x), in by the input axis
            w = ((lout.hidden, "x"), (lin.hidden,))
        else:
            w = (("col", "dep"), ("row",))
        return {"weight": w[::-1] if transposed else w, "bias": vec}
    hidden = (stream.hidden,) + stream.batch
    if role == "embedding":
        return {"weight": ((), hidden)}
    if role == "layernorm":
        return {"weight": (hidden,), "bias": (hidden,)}
    return {"weight": (hidden,)}


def check(model: nn.Module, plan, mode: str, sizes: Dict[str, int], tp_size: int) -> None:
    """Every parameter cuts evenly into its blocks at these grid sizes (no process group needed)."""
    mods = dict(model.named_modules())
    for name, (role, opts) in plan.items():
        m = mods[name]
        tr = bool(opts.get("transposed"))
        if role in LINEARS and not (isinstance(m, nn.Linear) or tr and getattr(m, "weight", None) is not None
                                    and m.weight.dim() == 2):
            raise ValueError(f"N-d tensor parallelism: {name!r} has role {role!r} but is a {type(m).__name__}, "
                             "not an nn.Linear (or a linear with a 2-D weight stored (in, out): transposed)")
        if role == "embedding":
            if not isinstance(m, nn.Embedding):
                raise ValueError(f"N-d tensor parallelism: {name!r} has role 'embedding' but is a {type(m).__name__}")
            if m.max_norm is not None or m.sparse:
                raise ValueError(f"N-d tensor parallelism: embedding {name!r} uses max_norm/sparse, which the "
                                 "sharded embedding does not implement")
        if role in NORMS:
            w, b = getattr(m, "weight", None), getattr(m, "bias", None)
            has_bias = isinstance(b, torch.Tensor)
            if not isinstance(w, torch.Tensor) or w.dim() != 1 or has_bias != (role == "layernorm") or (
                    has_bias and b.shape != w.shape):
                what = "a 1-D weight and bias" if role == "layernorm" else "one 1-D weight and no bias"
                raise ValueError(f"N-d tensor parallelism: {name!r} has role {role!r} but is not a norm with {what}")
            if "eps" not in opts and _eps(m) is None:
                raise ValueError(f"N-d tensor parallelism: norm {name!r} has no eps attribute; give its role as "
                                 f"({role!r}, eps) in tp_nd_plan()")
        parts = int(opts.get("parts", 1))
        for pname, spec in specs(role, mode, tr).items():
            p = getattr(m, pname, None)
            if isinstance(p, torch.Tensor):
                shape = list(p.shape)
                dim = _out_dim(pname, tr)
                if parts > 1:  # each part cuts alike
                    if shape[dim] % parts:
                        raise ValueError(f"N-d tensor parallelism: {name}.{pname} has {shape[dim]} output features, "
                                         f"which do not pack {parts} equal parts")
                    shape[dim] //= parts
                check_spec(f"{name}.{pname}", tuple(shape), spec, sizes, mode, tp_size)


def _out_dim(pname: str, transposed: bool) -> int:
    """The dimension of a linear's parameter that indexes output features."""
    return 1 if pname == "weight" and transposed else 0


def pack_order(n: int, parts: int, q: int) -> torch.Tensor:
    """The order of ``n`` output features packing ``parts`` equal parts under which a contiguous cut
    into ``q`` slices gives slice ``j`` the ``j``-th ``1 / q`` of every part, in part order."""
    h = n // parts
    c = h // q
    return torch.cat([torch.arange(p * h + j * c, p * h + (j + 1) * c) for j in range(q) for p in range(parts)])


def _eps(m) -> Optional[float]:
    for attr in ("eps", "variance_epsilon"):
        v = getattr(m, attr, None)
        if isinstance(v, (int, float)):
            return float(v)
    return None


# ---- the conversion -----------------------------------------------------------------------------

def convert(model: nn.Module, grid, plan) -> Dict[str, tuple]:
    """Replace each planned module of ``model`` by its N-d form, in place; returns
    ``{parameter name: (spec, full shape)}`` for the checkpoint gather (plus ``(dim, order)`` for a
    packed output, :func:`pack_order`)."""
    from .layers_2d import Linear2D
    from .layers_2p5d import Linear2p5D
    from .layers_3d import Linear3D
    from .layers_common import Embedding, LayerNorm, RMSNorm, VocabShard, adopt_embedding

    mode = grid.mode
    stream, inner = layouts(mode)
    out: Dict[str, tuple] = {}
    for name, (role, opts) in plan.items():
        old = model.get_submodule(name)
        tr, parts = bool(opts.get("transposed")), int(opts.get("parts", 1))
        sp = specs(role, mode, tr)
        blocks = {}
        for pname, spec in sp.items():
            p = getattr(old, pname, None)
            if isinstance(p, torch.Tensor):
                full, extra = p.detach(), ()
                if parts > 1:
                    dim = _out_dim(pname, tr)
                    order = pack_order(p.shape[dim], parts, grid.q)
                    full, extra = full.index_select(dim, order.to(full.device)), ((dim, order),)
                blocks[pname] = grid.block(full, spec).clone()
                out[f"{name}.{pname}" if name else pname] = (spec, tuple(p.shape)) + extra
        if role in LINEARS:
            lin, lout = _io(role, mode)
            if mode == "3d":
                new = Linear3D(blocks["weight"], blocks.get("bias"), grid, lin.hidden, lout.hidden, lout, tr)
            elif mode == "2.5d":
                new = Linear2p5D(blocks["weight"], blocks.get("bias"), grid, lout, tr)
            else:
                new = Linear2D(blocks["weight"], blocks.get("bias"), grid, lout, tr)
            if role == "head":
                V = old.out_features
                new.vocab = VocabShard(grid.group((lout.hidden,)), grid.coords[lout.hidden] * (V // grid.q), V,
                                       grid.group(lout.batch))
        elif role == "embedding" and type(old) is not nn.Embedding:
            new = adopt_embedding(old, blocks["weight"], grid, stream)
        elif role == "embedding":
            new = Embedding(blocks["weight"], grid, stream, old.padding_idx)
        elif role == "layernorm":
            new = LayerNorm(blocks["weight"], blocks["bias"], opts.get("eps", _eps(old)), old.weight.shape[0], grid,
                            stream)
        else:
            new = RMSNorm(blocks["weight"], opts.get("eps", _eps(old)), old.weight.shape[0], grid, stream)
        new.train(old.training)
        if name:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, new)
        else:
            raise ValueError("N-d tensor parallelism: the model itself cannot play a role; name its layers")
    return out


class NdParallel:
    """What the boosted model needs of its N-d form: the grid, each converted parameter's block
    layout and full shape (under the unsplit model's names), and the batch sharding."""

    def __init__(self, grid, params: Dict[str, tuple]):
        self.grid = grid
        self.params = params  # name -> (spec, full shape[, (dim, pack order)])

    def full(self, name: str, block: torch.Tensor) -> torch.Tensor:
        """The whole tensor of parameter (or same-shaped state) ``name`` (a collective over the tp group)."""
        entry = self.params[name]
        t = self.grid.full(block, entry[0])
        if len(entry) > 2:  # a packed output: back in the model's own order
            dim, order = entry[2]
            t = t.index_select(dim, torch.argsort(order).to(t.device))
        return t

    def block(self, name: str, full: torch.Tensor) -> torch.Tensor:
        entry = self.params[name]
        if len(entry) > 2:
            dim, order = entry[2]
            full = full.index_select(dim, order.to(full.device))
        return self.grid.block(full, entry[0])

    def full_shape(self, name: str) -> Tuple[int, ...]:
        return self.params[name][1]

    def shard_batch(self, batch: dict, input_key: str) -> dict:
        """This rank's rows of a whole (data-parallel replica's) batch: ``batch[input_key]`` cut like
        the model's input (the stream layout's batch pieces), every other tensor like the logits
        (the inner layout's; the same in 2D/2.5D)."""
        out = {}
        for k, v in batch.items():
            if isinstance(v, torch.Tensor) and v.dim() >= 1:
                lay = self.grid.stream if k == input_key else self.grid.inner
                out[k] = self.grid.batch_piece(v, lay, f"batch[{k!r}]")
            else:
                out[k] = v
        return out
