"""Megatron-style sequence parallelism for a transformers model under 1D tensor parallelism.

Between the tensor-parallel regions of every decoder layer the residual stream is cut along the sequence
(each of the tp ranks holds ``T/tp`` of the tokens), so the norms, dropouts and residual adds run on a
shard instead of on the whole sequence on every rank. The layout is derived from the model itself, not
from its class: the layer list from its pipeline layout (``base_model_pp_plan`` or the built-in table,
:mod:`.pipeline`), the regions from its translated tensor-parallel plan, the norms by type (a norm
class holding only 1-D parameters). For each direct child of a decoder layer:

* a norm runs on the shard, its weight whole, its gradient summed over tp (:mod:`.grad_sum`: each rank's
  covers its tokens only); a plain hook, not DTensor's ``SequenceParallel``, as some layers flatten the
  tokens to ``(B*T, C)`` first (OPT), where a ``Shard(1)`` would name the wrong dimension;
* a region holding parameters (attention, MLP) gathers the whole sequence on entry; its output is cut
  back to the shard by the plan's own row-parallel layers inside it (``RowwiseParallel(output_layouts=
  Shard(1))``: a reduce-scatter where plain tp all-reduces), or, where it has none (a region the plan
  leaves whole, ``Conv1D``'s row style), by cutting its whole output;
* a mixture-of-experts block (a child holding an experts module of the model's ep plan, :mod:`.moe`), whose
  router and experts stay whole on every tp rank, is a per-token function (each token routed on its own,
  dropless): it runs on the shard as a norm does, no gather, ``1/tp`` of the expert work per rank, and every
  whole parameter in it has its gradient summed over tp (:mod:`.grad_sum`). A part the plan cuts inside it
  (a shared expert's column / row layers) gathers the whole sequence on entry and cuts its whole output (after
  its row layer's all-reduce: the block may hand it the tokens flattened, where ``Shard(1)`` would cut features).
  What is not per-token (capacity, router statistics, expert parallelism) is refused in :func:`.moe.check`;
* a bare column-parallel layer (OPT's ``fc1``) gathers on entry, a bare row-parallel one (``fc2``) cuts
  its output; parameter-free children (dropouts, activations) run on what they are handed;
* a region that opens features without closing them (BERT's ``intermediate``: column layers, no row layer)
  gathers the whole sequence on entry and hands its feature shard on; the sibling after it that closes them
  (BERT's ``output``: row layers, no column layer, the residual handed in) has its row layers reduce-scatter to
  the shard (``Shard(1)``), so its dropout, residual add (the shard its parent was handed) and norm run on the
  shard, the norm's gradient summed over tp. This is Megatron's own BERT layout. A region that closes its
  features in a child module of its own (BERT's ``attention``: ``self`` opens, ``output`` closes and adds the
  residual; XLM-R-XL's and Megatron-BERT's also hold their pre-norm) has its children walked as a layer's are.
  An opening or closing region without its pair among its siblings is refused, by name, before any group.

The embedding output stays whole, so the base model's code before the layers (position ids, rotary
tables, the causal mask) sees the whole sequence; the first layer cuts it, the last gathers its output
whole again, so the code after the layers (final norm, GPT-2's reshape, the head) does too.

Under a pipeline (a stage of :mod:`.pipeline`, marked ``_cl_stage``) the stream stays cut between stages:
a stage before the last cuts its output to this rank's ``(B, T/tp, C)`` shard (the p2p buffers are ``1/tp``
of the whole), and a later stage gathers what it receives whole on entry, so its base forward computes
positions, rotary tables and the mask on the whole sequence as the unsplit model does; its first layer cuts
it again. Every stage still gathers its last layer's output, because a base forward may reshape by the
whole sequence after its layers even where the final norm is a stand-in (GPT-2's ``view(-1, T, C)``
would silently fold a shard's rows together); the cost is an all-gather per stage boundary on each side
(and their backwards), in exchange for p2p messages ``1/tp`` the size. No hook keeps a tensor between
calls, so a layer recomputed in backward cuts alike. Tokens lie
along dim 1 of a ``(B, T, C)`` tensor and dim 0 of a flattened one (a per-token region gathers and
cuts such rows alike). Built on DTensor's ``redistribute`` (its autograd gives each move its backward:
a cut for a gather, a gather for a cut) and torch's ``RowwiseParallel``; written here only the hooks
and the walk that places them. A length tp does not divide is refused at the first layer, before that
layer's collectives (under a pipeline, ``execute_pipeline`` refuses it before the schedule starts).
"""

from __future__ import annotations

import copy
from typing import Dict, List

import torch
import torch.nn as nn


def is_norm(module: nn.Module) -> bool:
    """A per-token normalisation: ``nn.LayerNorm``/``nn.RMSNorm`` or a class named ``...Norm`` holding only
    1-D parameters (transformers' ``LlamaRMSNorm``, ``Qwen2RMSNorm``, ...)."""
    if isinstance(module, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))):
        return True
    params = list(module.parameters())
    return type(module).__name__.lower().endswith("norm") and bool(params) and all(p.dim() == 1 for p in params)


def _seq_dim(x: torch.Tensor) -> int:
    """Where the tokens of a shard lie: ``(B, T, C)`` along 1; a layer that flattened them to ``(B*T, C)``
    (OPT's feed-forward) along 0, whose rows a per-token region gathers and cuts back alike."""
    return 1 if x.dim() >= 3 else 0


def _move(x, mesh, to_whole: bool, what: str, keep: bool = False):
    """``x`` (a local tensor) between this rank's shard of the tokens and the whole of them, over ``mesh``,
    through DTensor (whose autograd gives the backward: a cut for a gather, a gather for a cut). ``keep``
    hands a gathered ``x`` on as the replicated DTensor: column-parallel layers take it as it is, and
    their partial input gradients meet at the gather, whose backward is then one reduce-scatter (a local
    tensor would have each layer's input all-reduce its gradient, as plain tp does)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(x, torch.Tensor):
        return x
    if isinstance(x, DTensor):
        x = x.to_local()
    dim, n = _seq_dim(x), mesh.size()
    if not to_whole and x.shape[dim] % n:
        raise ValueError(f"HybridParallelPlugin(sequence_parallel=True, tp_size={n}): {what} has a sequence of "
                         f"{x.shape[dim]} tokens, which does not cut into {n} equal shards; use a length "
                         f"divisible by tp_size={n}")
    src, dst = (Shard(dim), Replicate()) if to_whole else (Replicate(), Shard(dim))
    moved = DTensor.from_local(x, mesh, (src,), run_check=False).redistribute(mesh, (dst,))
    return moved if keep and to_whole else moved.to_local()


class _OnInput:
    """Forward pre-hook: the module's hidden states (first positional argument, or ``hidden_states=``)
    gathered whole (``to_whole``) or cut to this rank's shard."""

    def __init__(self, mesh, to_whole: bool, name: str, keep: bool = False):
        self.mesh, self.to_whole, self.name, self.keep = mesh, to_whole, name, keep

    def __call__(self, module, args, kwargs):
        move = lambda x: _move(x, self.mesh, self.to_whole, self.name, self.keep)  # noqa: E731
        if args:
            return (move(args[0]),) + tuple(args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": move(kwargs["hidden_states"])}
        return args, kwargs


class _OnOutput:
    """Forward hook: the module's output (or the first element of a tuple or list output: GPT's attention
    returns a list) cut from whole to this rank's shard of the tokens, or (``to_whole``) gathered whole."""

    def __init__(self, mesh, to_whole: bool, name: str, own: bool = False):
        self.mesh, self.to_whole, self.name, self.own = mesh, to_whole, name, own

    def __call__(self, module, args, output):
        if isinstance(output, (tuple, list)):
            moved = _move(output[0], self.mesh, self.to_whole, self.name)
            return (moved,) + tuple(output[1:]) if isinstance(output, tuple) else [moved, *output[1:]]
        out = _move(output, self.mesh, self.to_whole, self.name)
        # ``own``: a pipeline stage's output, which the zero-bubble schedules detach in place: not a view
        return out.clone() if self.own and out._is_view() else out


def _rowwise_to_shard(style):
    from torch.distributed.tensor import Shard

    out = copy.copy(style)
    out.output_layouts = (Shard(1),)
    return out


def _all_torch_styles(region: nn.Module, name: str, styles: Dict[str, object]) -> bool:
    """Whether every module of ``region`` holding parameters of its own runs torch's column / row style
    (or is a norm, fed by them): then only those layers read the gathered hidden states, and they take a
    DTensor; any other layer might meet it beside a plain tensor, so the region gets a local one."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from .grad_sum import ReplicatedGradSum

    for sub, mod in region.named_modules(prefix=name):
        if any(True for _ in mod.parameters(recurse=False)) and not is_norm(mod) and \
                not isinstance(styles.get(sub), (ColwiseParallel, RowwiseParallel, ReplicatedGradSum)):
            return False
    return True


def _opens(inner: Dict[str, object]) -> List[str]:
    """The layers among ``inner`` (name -> style) whose output is feature-sharded (column-parallel, not gathered)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    from .local_linear import LocalColwise

    return [n for n, s in inner.items() if isinstance(s, ColwiseParallel) and not
            any(isinstance(p, Replicate) for p in s.output_layouts) or isinstance(s, LocalColwise) and not s.gather]


def _closes(inner: Dict[str, object]) -> List[str]:
    """The layers among ``inner`` that take feature-sharded input and hand out whole features (row-parallel)."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    from .local_linear import LocalRowwise

    return [n for n, s in inner.items() if isinstance(s, (RowwiseParallel, LocalRowwise))]


def _inner(name: str, styles: Dict[str, object]) -> Dict[str, object]:
    return {n: s for n, s in styles.items() if n.startswith(name + ".")}


def _kind(name: str, styles: Dict[str, object]) -> str:
    """What a region does to features: ``"closed"`` (opens and closes them inside itself: whole features out),
    ``"opens"`` (its output stays feature-sharded: BERT's ``intermediate``, ``attention.self``), ``"closes"``
    (its input is feature-sharded, its output whole: BERT's ``output``, ``attention.output``) or ``"whole"``."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    from .grad_sum import ReplicatedGradSum

    inner = _inner(name, styles)
    opens, closes = bool(_opens(inner)), bool(_closes(inner))
    if opens:
        return "closed" if closes else "opens"
    # closing only where nothing else in it is cut (Phi-3's attention: a packed q|k|v style of its own, then o_proj,
    # is closed; it is run as one region)
    only_rows = all(isinstance(s, (RowwiseParallel, ReplicatedGradSum)) for s in inner.values())
    return "closes" if closes and only_rows else "whole"


def _check_closed(region: nn.Module, name: str, styles: Dict[str, object]) -> None:
    """A region that shards features (a column-parallel layer) and is run as one piece must end them with a
    row-parallel one: its output is then whole features, which the walk cuts along the tokens. One whose output
    stays feature-sharded is closed in a sibling, which the walk pairs it with (:func:`_walk`); where it is run as
    one piece (inside an MoE block) it cannot be cut: refused, before any forward."""
    opens = _opens(_inner(name, styles))
    if opens and not _closes(_inner(name, styles)):
        raise ValueError(f"HybridParallelPlugin(sequence_parallel=True): {name} ({type(region).__name__}) shards "
                         f"features ({opens}) but closes them outside itself, so its output cannot be cut along "
                         "the sequence; set sequence_parallel=False")


def _splits(region: nn.Module, name: str, styles: Dict[str, object]) -> bool:
    """Whether a closed region closes its features in a child module of its own (not a bare layer): BERT's
    ``attention``, whose ``output`` runs the row layer, then dropout and LayerNorm(x + the residual the region
    was handed). Its children are then walked as a layer's are, so the residual it receives is the shard."""
    return any(styles.get(f"{name}.{c}") is None and _kind(f"{name}.{c}", styles) == "closes"
               for c, _ in region.named_children())


def _refuse(name: str, region: nn.Module, why: str):
    return ValueError(f"HybridParallelPlugin(sequence_parallel=True): {name} ({type(region).__name__}) {why}, so "
                      "the sequence cannot be cut around it; set sequence_parallel=False")


def _close_on_shard(region: nn.Module, name: str, styles: Dict[str, object]) -> None:
    """A region closing features a sibling opened (BERT's ``output``): its row-parallel layers reduce-scatter to
    the shard, so what follows them inside it (dropout, the residual add with the shard its parent was handed,
    a norm) runs on the shard; its norms' gradients are summed over tp, as a layer's norms' are."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    from .grad_sum import ReplicatedGradSum

    for sub, mod in region.named_modules(prefix=name):
        style = styles.get(sub)
        if isinstance(style, RowwiseParallel):
            styles[sub] = _rowwise_to_shard(style)
        elif style is None and is_norm(mod):
            styles[sub] = ReplicatedGradSum()
        elif style is not None and not isinstance(style, ReplicatedGradSum) or \
                style is None and any(True for _ in mod.parameters(recurse=False)):
            raise _refuse(name, region, f"closes features a sibling opened, but holds {sub} "
                          f"({type(mod).__name__}, {type(style).__name__ if style else 'no tp style'}), which is "
                          "neither torch's row-parallel layer nor a norm")


def _experts_inside(model: nn.Module) -> List[str]:
    """The experts modules the model's ep plan names (:mod:`.moe`): what marks a child of a layer an MoE block."""
    from .moe import expert_modules

    return [name for name, _, _ in expert_modules(model)]


def _holds(name: str, inner: List[str]) -> bool:
    return any(n == name or n.startswith(name + ".") for n in inner)


def _per_token_block(block: nn.Module, name: str, styles: Dict[str, object], tp_mesh) -> List[tuple]:
    """An MoE block on the shard: its whole parameters' gradients summed over tp, and each child the plan cuts
    (a shared expert) a region of its own, whole sequence in, its whole output cut back to the shard."""
    from .grad_sum import ReplicatedGradSum

    if styles.get(name) is not None:
        raise ValueError(f"HybridParallelPlugin(sequence_parallel=True): the MoE block {name} has a tp style of "
                         f"its own ({type(styles[name]).__name__}); its experts stay whole, so it cannot be cut; "
                         "set sequence_parallel=False")
    hooks, regions = [], []
    for child_name, child in block.named_children():
        sub = f"{name}.{child_name}"
        if not any(_holds(sub, [n]) for n, s in styles.items() if not isinstance(s, ReplicatedGradSum)):
            continue
        if styles.get(sub) is not None:  # a cut layer straight in the block: its output is not whole features
            raise ValueError(f"HybridParallelPlugin(sequence_parallel=True): {sub} ({type(child).__name__}) is cut "
                             f"by the tp plan ({type(styles[sub]).__name__}) directly inside the MoE block {name}, "
                             "not within a part of its own that closes it; set sequence_parallel=False")
        _check_closed(child, sub, styles)
        regions.append(sub)
        hooks.append((child, "pre", _OnInput(tp_mesh, True, sub, _all_torch_styles(child, sub, styles))))
        hooks.append((child, "post", _OnOutput(tp_mesh, False, sub)))
    for sub, mod in block.named_modules(prefix=name):
        if not _holds(sub, regions) and styles.get(sub) is None and any(True for _ in mod.parameters(recurse=False)):
            styles[sub] = ReplicatedGradSum()  # whole weights, each rank's gradient from its tokens only
    return hooks


def _only_columns(region: nn.Module, name: str, styles: Dict[str, object]) -> bool:
    """Whether every module of an opening region holding parameters is a torch column (or a norm the plan styles,
    fed by them): then the gathered hidden states reach only those layers, as a DTensor. A norm of its own before
    them (RoBERTa-PreLayerNorm's ``intermediate.LayerNorm``) takes a local tensor: it then runs on the whole
    sequence, its input gradient all-reduced by the columns, its weight's gradient whole on every rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from .grad_sum import ReplicatedGradSum

    return all(isinstance(styles.get(sub), (ColwiseParallel, ReplicatedGradSum))
               for sub, mod in region.named_modules(prefix=name) if any(True for _ in mod.parameters(recurse=False)))


def _walk(parent: nn.Module, prefix: str, styles: Dict[str, object], tp_mesh, experts: List[str]) -> List[tuple]:
    """The hooks (and style rewrites) for the children of ``parent`` (a decoder layer, or a region that closes its
    features in a child of its own, :func:`_splits`), handed this rank's shard of the tokens. A region that opens
    features (column layers, no row layer) gathers the whole sequence on entry and hands its feature shard on; the
    next sibling that closes them (row layers, no column layer) reduce-scatters to the shard inside itself; each
    must have its pair among the siblings (in the order the parent registers them), or it is refused."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from .grad_sum import ReplicatedGradSum
    from .local_params import LocalParams

    hooks: List[tuple] = []
    opened = None  # the opening region whose features are not closed yet
    for child_name, child in parent.named_children():
        name = f"{prefix}.{child_name}"
        own = styles.get(name)
        own = None if isinstance(own, LocalParams) else own  # sinks read locally: a region like any other
        kind = _kind(name, styles) if own is None else None
        if kind == "closes" and not opened and styles.get(prefix) is not None:
            kind = "whole"  # the layer's own style cuts what comes before the rows (Mamba 2's mixer): a region
        if _holds(name, experts):  # an MoE block: per token, on the shard
            hooks += _per_token_block(child, name, styles, tp_mesh)
        elif is_norm(child):  # runs on the shard; its weight's gradient summed over the shards
            styles[name] = ReplicatedGradSum()
        elif own is not None and "Rowwise" in type(own).__name__:  # closes a region a sibling opened
            hooks.append((child, "post", _OnOutput(tp_mesh, False, name)))
        elif own is not None:  # opens a region (a bare column-parallel layer): whole sequence in
            hooks.append((child, "pre", _OnInput(tp_mesh, True, name, isinstance(own, ColwiseParallel))))
        elif not any(True for _ in child.parameters()):
            continue
        elif kind == "closed" and _splits(child, name, styles):  # BERT's attention: closes in a child of its own
            hooks += _walk(child, name, styles, tp_mesh, experts)
        elif kind == "opens":  # whole sequence in, a feature shard out to the sibling that closes it
            if opened:
                raise _refuse(opened, parent.get_submodule(opened[len(prefix) + 1:]),
                              f"shards features that {name} opens again before a sibling closes them")
            opened = name
            hooks.append((child, "pre", _OnInput(tp_mesh, True, name, _only_columns(child, name, styles))))
        elif kind == "closes":  # reduce-scatters to the shard; the residual it adds is the shard its parent holds
            if not opened:
                raise _refuse(name, child, "takes feature-sharded input that no sibling before it opens")
            opened = None
            _close_on_shard(child, name, styles)
        else:  # a region: whole sequence in
            hooks.append((child, "pre", _OnInput(tp_mesh, True, name, _all_torch_styles(child, name, styles))))
            closers = [n for n, s in styles.items() if n.startswith(name + ".") and isinstance(s, RowwiseParallel)]
            for n in closers:
                styles[n] = _rowwise_to_shard(styles[n])
            if not closers:  # left whole by the plan, or closed by another style: cut its whole output
                hooks.append((child, "post", _OnOutput(tp_mesh, False, name)))
    if opened:
        raise _refuse(opened, parent.get_submodule(opened[len(prefix) + 1:]),
                      "shards features that no later sibling closes")
    return hooks


def check_regions(model: nn.Module, styles: Dict[str, object]) -> None:
    """The walk of :func:`sequence_parallel_plan` on a copy of ``styles`` (the torch plan, module name -> style),
    before any process group: what it cannot pair or cut is refused here, by name."""
    sequence_parallel_plan(model, dict(styles), None)


def sequence_parallel_plan(model: nn.Module, styles: Dict[str, object], tp_mesh) -> List[tuple]:
    """Rewrite ``styles`` (module name -> torch style, before ``parallelize_module``) for sequence
    parallelism and return the hooks to register: ``[(module, "pre" | "post", hook)]``."""
    from .pipeline import _layout_or_raise

    lay = _layout_or_raise(model)
    hooks: List[tuple] = []
    layers = list(model.get_submodule(lay.layers).named_children())
    experts = _experts_inside(model)
    first, last = getattr(model, "_cl_stage", (True, True))[:2]  # a pipeline stage's place, or the whole model
    if not first:  # the previous stage's shard, gathered whole for this stage's base forward (positions, mask)
        hooks.append((model, "pre", _OnInput(tp_mesh, True, "the stage's input (the previous stage's shard)")))
    for i, (idx, layer) in enumerate(layers):
        prefix = f"{lay.layers}.{idx}"
        if i == 0:  # the whole embedding output, cut to this rank's shard
            hooks.append((layer, "pre", _OnInput(tp_mesh, False, f"{prefix}'s input")))
        hooks += _walk(layer, prefix, styles, tp_mesh, experts)
    if layers:  # the base model's code after the layers (final norm, reshapes) sees the whole sequence
        hooks.append((layers[-1][1], "post", _OnOutput(tp_mesh, True, f"{lay.layers}.{layers[-1][0]}'s output")))
    if not last:  # what the next stage receives: this rank's shard
        hooks.append((model, "post", _OnOutput(tp_mesh, False, "the stage's output", own=True)))
    return hooks


def register(hooks: List[tuple], kind: str) -> None:
    """Register the hooks of one ``kind`` that :func:`sequence_parallel_plan` returned: the ``"pre"`` ones
    before ``parallelize_module`` (they run ahead of a style's own input preparation on the same module),
    the ``"post"`` ones after it (they cut what a style's own output preparation hands back)."""
    for module, k, hook in hooks:
        if k == kind == "pre":
            module.register_forward_pre_hook(hook, with_kwargs=True)
        elif k == kind == "post":
            module.register_forward_hook(hook)
