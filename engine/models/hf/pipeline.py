"""Pipeline stages of a transformers model, cut by its own ``base_model_pp_plan``.

A stage is a copy of the task model (``LlamaForCausalLM``, ...) holding only its part: the decoder layers
of its slice (the others become parameterless pass-throughs, so every kept parameter keeps the unsplit
model's name and the layer list keeps its length and indices), the embeddings on the first stage, the
final norm and the head on the last. Its forward is the model's *own* base forward (the last stage's: the
task model's own forward, whose head and post-processing of the logits run as unsplit), called with
``input_ids`` on the first stage and ``inputs_embeds=<previous stage's hidden states>`` elsewhere, plus the
batch's ``attention_mask`` / ``position_ids`` (and ``token_type_ids`` on the first; :mod:`.inputs`), so the
glue transformers' plan leaves out (rotary cos/sin from position ids, the causal mask from the model's
mask helper, learned position embeddings) is recomputed exactly as the unsplit model computes it; modules
a later stage must not run again (GPT-2's position embedding, a dropout before the layers) are stood in
for as :mod:`.tables` says. The layout comes from ``config.base_model_pp_plan`` (entries before the layer
list: embeddings, after it: final norms; the head is every other module of the task model), or from the built-in
table for families that ship none (GPT-2, OPT), or else from the model's module tree (:mod:`.derive`: BERT and
its copies, BLOOM, Falcon, ..., each checked by one layer-less forward before it is used). Built on
``copy.deepcopy`` with a memo (the other stages' modules are never copied), as the reference GPT's
``pipeline_stage`` is.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .inputs import stage_kwargs
from .tables import TABLES


@dataclass(frozen=True)
class Layout:
    """Module names (the task model's) a pipeline cuts by: ``base`` the base model ('' when the model is
    one), ``layers`` the layer list, ``pre``/``post`` the modules before/after it with what a stage that does
    not own them puts in their place (``"none"``, ``"identity"``, ``"zeros"``, ``"pass_embeds"``), ``head``
    the task head's modules."""

    base: str
    layers: str
    pre: Dict[str, str]
    post: Dict[str, str]
    head: Tuple[str, ...]
    derived: bool = False  # read from the module tree (derive.py), checked before use
    returns: int = 0  # what a stood-in layer returns (PassThrough), as that check found


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _module(model: nn.Module, name: str) -> Optional[nn.Module]:
    try:
        return model.get_submodule(name) if name else model
    except AttributeError:
        return None


def layout(model: nn.Module) -> Optional[Layout]:
    """The model's pipeline layout, or None when neither its config, the built-in table nor its module tree
    gives one (:func:`layout_or_reason` says why)."""
    return layout_or_reason(model)[0]


def layout_or_reason(model: nn.Module) -> Tuple[Optional[Layout], str]:
    """The layout (module docstring), or None and why not."""
    prefix = getattr(model, "base_model_prefix", "")
    base = prefix if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    config = getattr(model, "config", None)
    table = TABLES.get(getattr(config, "model_type", None), {}).get("pp")
    plan = getattr(config, "base_model_pp_plan", None)
    if table is not None:
        pre, post = dict(table["pre"]), dict(table["post"])
        layers, head = table["layers"], tuple(table["head"])
    elif isinstance(plan, dict) and plan:
        names = list(plan)
        at = next((i for i, n in enumerate(names)
                   if isinstance(_module(model, _join(base, n)), nn.ModuleList)), None)
        if at is None:
            return None, f"its config.base_model_pp_plan names no nn.ModuleList of layers ({names})"
        layers = names[at]
        # an embedding adds nothing on a later stage (a token embedding is not even called: the base forward
        # takes inputs_embeds), anything else on the way in (a dropout, a norm) already ran on the first stage
        tokens = _input_embeddings(model)
        pre = {n: _stand_in_for(_module(model, _join(base, n)), tokens) for n in names[:at]}
        post = {n: "identity" for n in names[at + 1:]}
        head = ()
    else:
        from .derive import derive

        try:
            layers, pre, post = derive(model, base, _input_embeddings(model))
        except ValueError as exc:
            return None, f"it has no config.base_model_pp_plan, and {exc}"
        head = ()
    # the head: every module of the task model beside its base model (lm_head, cls, score, ...)
    head = tuple(dict.fromkeys(list(head) + [n for n, _ in model.named_children() if n != base])) if base else ()
    return Layout(base, _join(base, layers), {_join(base, k): v for k, v in pre.items()},
                  {_join(base, k): v for k, v in post.items()}, head,
                  derived=table is None and not (isinstance(plan, dict) and plan)), ""


def _input_embeddings(model: nn.Module) -> Optional[nn.Module]:
    """The token embedding (``get_input_embeddings()``), or None where the model does not say."""
    try:
        return model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None


def _stand_in_for(module: Optional[nn.Module], tokens: Optional[nn.Module]) -> str:
    """What a later stage puts in place of a module the plan lists before the layers: nothing for the token
    embedding (never called once inputs_embeds is given), zeros for another embedding (its sum was taken on
    the first stage), the identity for the rest (a dropout or norm the first stage applied)."""
    if module is tokens or module is None:
        return "none"
    return "zeros" if isinstance(module, nn.Embedding) else "identity"


def _layout_or_raise(model: nn.Module) -> Layout:
    stage = getattr(model, "_cl_stage", None)
    if stage is not None:  # a stage: the layout it was cut by (its own tree now holds stand-ins)
        return stage[2]
    found, why = layout_or_reason(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    where = f"pipeline parallelism: {type(model).__name__} (model_type={model_type!r})"
    if found is None:
        raise ValueError(f"{where} has no pipeline layout: {why}; colossal-lab has no built-in one for it "
                         "(engine/models/hf/tables.py); use pp_size=1")
    if found.derived:
        from .derive import check

        try:
            found = check(model, found)
        except ValueError as exc:
            raise ValueError(f"{where}: no config.base_model_pp_plan, and the layout read from its module tree "
                             f"does not hold: {exc}; use pp_size=1") from None
    return found


#: config fields whose layers read what only the first stage holds or widen the stream between layers, each
#: refused above the value it has in a model without that feature (Gemma 3n / Gemma 4, HY-V4)
_CROSS_STAGE = {
    "hidden_size_per_layer_input": (0, "per-layer embeddings looked up from the token ids for every layer"),
    "num_kv_shared_layers": (0, "later layers reuse earlier layers' keys and values"),
    "hc_mult": (1, "hyper-connections: between layers the hidden states are hc_mult streams, which the next "
                   "stage's base forward would widen again from what it receives"),
}


def num_layers(model: nn.Module) -> int:
    """How many decoder (encoder) layers the pipeline divides among its stages. A model whose layers read the
    token ids themselves (DeepSeek-V4's hash-routed experts take ``input_ids``, Gemma 4's per-layer embeddings), the
    embedding output (Zamba's ``original_hidden_states``) or another layer's keys and values is refused: a later
    stage receives hidden states only."""
    layers = model.get_submodule(_layout_or_raise(model).layers)
    cfg = getattr(model, "config", None)
    reasons = []  # every reason, so a fix for one does not meet the next at the following try
    for key, (plain, what) in _CROSS_STAGE.items():
        value = getattr(cfg, key, None)
        if isinstance(value, (int, float)) and value > plain:
            reasons.append(f"config.{key}={value} ({what})")
    for kind in {type(layer) for layer in layers}:
        params = inspect.signature(kind.forward).parameters
        carried = [p for p in params if p.startswith("prev_")]
        if carried:
            reasons.append(f"its layers ({kind.__name__}) take {carried} (what the layer before returned beside the "
                           "hidden states)")
        embeds = [p for p in params if p.startswith("original_")]
        if embeds:
            reasons.append(f"its layers ({kind.__name__}) take {embeds} (the embedding output, handed to every "
                           "layer: Zamba's shared attention blocks)")
        if "input_ids" in params:
            reasons.append(f"its layers ({kind.__name__}) take input_ids (token-id routing)")
    if reasons:
        raise ValueError(f"pipeline parallelism: {type(model).__name__}: {'; '.join(reasons)}; a stage after the "
                         "first receives only the hidden states, from which it cannot compute these; use pp_size=1")
    if getattr(model, "_cl_stage", None) is None:
        _check_own_loss(model)
    return len(layers)


def _check_own_loss(model: nn.Module) -> None:
    """The pipeline's last stage computes the model's own loss as ``model.loss_function`` (:mod:`.loss`); a task
    forward that computes it otherwise (TrOCR's unshifted cross-entropy) must agree with it, or training would
    follow another objective. Where the forward's source does not call ``loss_function``, one tiny forward of
    the unsplit model tells (skipped on the meta device); a disagreement is refused, before any group."""
    if getattr(model, "_cl_loss_checked", False):
        return
    try:
        calls = "loss_function" in inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        calls = False
    first = next(iter(model.parameters()), None)
    if calls or first is None or first.device.type == "meta" or not hasattr(model, "loss_function"):
        return
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 2
    x = torch.arange(8, device=first.device).remainder(vocab).view(1, 8)
    with torch.no_grad():
        out = model(input_ids=x, labels=x)
        own = getattr(out, "loss", None)
        generic = model.loss_function(logits=out.logits, labels=x, vocab_size=vocab) if own is not None else None
    if own is not None and not torch.allclose(own, generic, rtol=1e-4, atol=1e-6):
        raise ValueError(f"pipeline parallelism: {type(model).__name__}'s forward computes its loss itself "
                         f"({own.item():.4g} on a probe batch), not as model.loss_function ({generic.item():.4g}), "
                         "which a pipeline's last stage computes; use pp_size=1")
    model._cl_loss_checked = True


def stage_layers(model: nn.Module, stage: int, num_stages: int) -> range:
    """Indices of the layers stage ``stage`` of ``num_stages`` holds (an even split)."""
    per = num_layers(model) // num_stages
    return range(stage * per, (stage + 1) * per)


def owned_layers(model: nn.Module) -> List[Tuple[int, str, nn.Module]]:
    """``(index, name, layer)`` of the layers this model (or stage of it) runs, in order."""
    lay = _layout_or_raise(model)
    return [(i, f"{lay.layers}.{i}", m) for i, m in enumerate(model.get_submodule(lay.layers))
            if not isinstance(m, PassThrough)]


class StandIn(nn.Module):
    """A module another stage holds, in this stage's copy: no parameters, and no tensor-parallel style."""


class PassThrough(StandIn):
    """A layer another stage holds: returns its first argument (the hidden states) unchanged. It keeps the
    layer's plain attributes (``attention_type``, ``layer_idx``, ...), which some releases' base forwards
    read off every layer in the loop. ``returns``: the hidden states alone (0), or, for a base forward that
    takes ``outputs[0]`` of what a layer returns, as a 1-tuple (1) or with a ``None`` beside them (2): the
    form :mod:`.derive`'s check found the base forward to keep."""

    @classmethod
    def of(cls, layer: nn.Module, returns: int = 0) -> "PassThrough":
        stand_in = cls()
        for k, v in vars(layer).items():
            if not k.startswith("_") and (v is None or isinstance(v, (str, int, float, bool))):
                setattr(stand_in, k, v)
        stand_in.returns = returns
        return stand_in

    def forward(self, hidden_states, *args, **kwargs):
        returns = getattr(self, "returns", 0)
        return hidden_states if returns == 0 else (hidden_states,) if returns == 1 else (hidden_states, None)


class Zeros(StandIn):
    """A position embedding an earlier stage already added: adds nothing."""

    def forward(self, *args, **kwargs):
        return torch.zeros(())


class PassEmbeds(StandIn):
    """An embeddings block (BERT's) an earlier stage ran: hands back the ``inputs_embeds`` it is given."""

    def forward(self, *args, inputs_embeds=None, **kwargs):
        return inputs_embeds


class Identity(StandIn):
    """A module an earlier stage already applied (a dropout, an embedding norm) or a later one will (a final
    norm): hands its input back."""

    def forward(self, x, *args, **kwargs):
        return x


_STAND_INS = {"identity": Identity, "zeros": Zeros, "pass_embeds": PassEmbeds, "none": lambda: None}


class BothEnds:
    """A forward hook for a parameter-free module the base forward calls ``calls`` times, all but the last before
    the layers and the last after them (NanoChat's ``norm``: once on the embeddings, once at the end; :mod:`.derive`
    found that order): the stage that does not own an end hands the input of that end's calls back unchanged.
    ``pre`` / ``post``: whether this stage runs the calls before the layers / the last one. The count of calls
    is reset at each stage forward (:class:`_StageForward`)."""

    def __init__(self, calls: int, pre: bool, post: bool):
        self.calls, self.pre, self.post, self.seen = calls, pre, post, 0

    def __call__(self, module, args, out):
        at, self.seen = self.seen, self.seen + 1
        runs = self.post if at >= self.calls - 1 else self.pre
        return out if runs else args[0]


def _both_ends(kind: str) -> int:
    """The number of calls a post entry ``"both_ends:N"`` names (0 for any other stand-in kind)."""
    return int(kind.split(":")[1]) if kind.startswith("both_ends:") else 0


def _set(model: nn.Module, name: str, value: Optional[nn.Module]) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attr, value)


def pipeline_stage(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """A copy of ``model`` holding stage ``stage``'s part, whose forward takes the previous stage's
    hidden states (the first: ``input_ids``) and returns hidden states (the last: the head's logits)."""
    lay = _layout_or_raise(model)
    if not 0 <= stage < num_stages:
        raise ValueError(f"pipeline_stage: stage={stage} must be in [0, {num_stages})")
    part = _cut(model, lay, stage_layers(model, stage, num_stages), stage == 0, stage == num_stages - 1)
    part.forward = _StageForward(part)
    part.stage_index = stage
    return part


def _cut(model: nn.Module, lay: Layout, keep, first: bool, last: bool) -> nn.Module:
    """The copy of ``model`` holding the layers ``keep`` (the others pass-throughs), and the pre / post / head
    modules only where ``first`` / ``last`` say, stood in for elsewhere."""
    layers = model.get_submodule(lay.layers)
    drop = {i: m for i, m in enumerate(layers) if i not in keep}
    replaced = {n: s for n, s in lay.pre.items() if not first}
    replaced.update({n: s for n, s in lay.post.items() if not last and not (first and _both_ends(s))})
    replaced.update({n: "none" for n in lay.head if not last})
    memo = {id(m): None for m in drop.values()}
    memo.update({id(m): None for n in replaced if (m := _module(model, n)) is not None})
    part = copy.deepcopy(model, memo)
    part_layers = part.get_submodule(lay.layers)
    for i, layer in drop.items():
        part_layers[i] = PassThrough.of(layer, lay.returns)
    for name, kind in replaced.items():
        if _module(model, name) is not None:
            _set(part, name, _STAND_INS["identity" if _both_ends(kind) else kind]())
    part._cl_both_ends = []  # a module at both ends, on a stage that owns one end only
    for name, kind in lay.post.items():
        if _both_ends(kind) and first != last and _module(part, name) is not None:
            part._cl_both_ends.append(BothEnds(_both_ends(kind), first, last))
            _module(part, name).register_forward_hook(part._cl_both_ends[-1])
    part._cl_stage = (first, last, lay)
    return part


class _StageForward:
    """The forward of a stage (module docstring); kept on the instance, so the stage stays the HF model.
    The last stage runs the task model's own forward (its head and whatever follows it: Gemma 2's logit
    soft-capping, Cohere's logit scale) and returns the logits; the others run the base model's."""

    def __init__(self, part: nn.Module):
        first, last, lay = part._cl_stage
        self.first, self.last, self.lay = first, last, lay
        self.task = last  # the last stage (or the only one) ends in the task model's own head
        runs = part if self.task else _module(part, lay.base)
        self.cache = "use_cache" in inspect.signature(type(runs).forward).parameters
        self.part_ref = [part]  # not an attribute nn.Module would register

    def __call__(self, x: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        """``inputs``: the microbatch's per-token inputs (``attention_mask``, ``position_ids``, ... :mod:`.inputs`),
        handed to the model's own forward, which builds this stage's mask and positions from them."""
        part = self.part_ref[0]
        for hook in getattr(part, "_cl_both_ends", ()):  # a module at both ends counts from this forward's first
            hook.seen = 0
        runs = part if self.task else _module(part, self.lay.base)
        kw = stage_kwargs(inputs, tuple(inputs), self.first)
        kw.update({"input_ids": x} if self.first else {"inputs_embeds": x})
        if self.cache:
            kw["use_cache"] = False
        out = type(runs).forward(runs, **kw) if runs is part else runs(**kw)
        if isinstance(out, torch.Tensor):
            return out
        logits = getattr(out, "logits", None) if self.task else None
        return logits if logits is not None else out[0]
