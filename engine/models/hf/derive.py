"""A pipeline layout read from a transformers model's module tree, for a family that ships no
``base_model_pp_plan`` and has no built-in ``pp`` entry (:mod:`.tables`): BERT and its copies, BLOOM, Falcon,
XGLM, BioGPT, DiffLlama, ...

The base model must hold exactly one ``nn.ModuleList`` of ``num_hidden_layers`` blocks (at any depth: BERT's
``encoder.layer``; lists inside a block, experts or per-head norms, are not candidates). On the way from the
base model down to it, the modules registered before it are the *pre* modules (embeddings, their norm and
dropout), those after it the *post* modules (final norms), as transformers' own ``base_model_pp_plan`` lists
them; rotary embeddings, which every stage recomputes from the position ids, are neither and stay on every stage.
What a later stage puts in place of a pre module (:mod:`.pipeline`'s stand-ins): nothing for the token embedding
(the base forward takes ``inputs_embeds`` there), the ``inputs_embeds`` handed back for an embeddings block
whose forward takes them (BERT's), zeros for a position embedding, the identity for the rest.

Registration order is a convention, not a contract, so a derived layout is checked before it is used
(:func:`check`): a stage with no layers of its own and every pre and post module stood in for, run through the
model's own base forward with ``inputs_embeds=x``, must hand back ``x`` exactly. A base forward that does more
to its input than its modules do (CTRL scales it by sqrt(d) and adds its sinusoid table in the forward itself;
a dropout applied functionally; a loop that unpacks what a layer returns) fails that, and the family's pipeline
is refused, naming what came back, rather than run on a wrong curve. The same run records the order of the
post modules' and the layers' calls: a post module called once before the layers and once after them with no
weights (NanoChat's norm) becomes a ``"both_ends:2"`` stand-in (:class:`.pipeline.BothEnds`); any other repeat
is refused. The check runs on the model's own (real) tensors, once per model, before any process group.
"""

from __future__ import annotations

import inspect
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn


def _n_layers(model: nn.Module) -> Optional[int]:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return next((getattr(text, k) for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
                 if isinstance(getattr(text, k, None), int)), None)


def hidden_width(model: nn.Module) -> Optional[int]:
    """The width of the hidden states the stages hand on (the config's hidden size)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return next((getattr(text, k) for k in ("hidden_size", "n_embd", "d_model", "embed_dim", "dim")
                 if isinstance(getattr(text, k, None), int)), None)


def layer_list(base: nn.Module, n_layers: Optional[int]) -> str:
    """The name (under ``base``) of its one list of blocks; raises ``ValueError`` naming what it found else."""
    found = [n for n, m in base.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0
             and (n_layers is None or len(m) == n_layers)]
    outer = [n for n in found if not any(n != o and n.startswith(o + ".") for o in found)]
    if len(outer) != 1:
        what = f"{len(outer)} lists of {n_layers} blocks ({outer})" if outer else f"no list of {n_layers} blocks"
        raise ValueError(f"its base model holds {what}, not one layer list to cut between")
    return outer[0]


def _kept(module: nn.Module) -> bool:
    """Rotary embeddings: cos/sin from the position ids, recomputed by every stage's base forward."""
    return "Rotary" in type(module).__name__


def _stand_in(module: nn.Module, tokens: Optional[nn.Module]) -> str:
    if module is tokens:
        return "none"
    if "inputs_embeds" in inspect.signature(module.forward).parameters:
        return "pass_embeds"
    if isinstance(module, nn.Embedding) or "Position" in type(module).__name__:
        return "zeros"
    return "identity"


def derive(model: nn.Module, base: str, tokens: Optional[nn.Module]) -> Tuple[str, Dict[str, str], Dict[str, str]]:
    """``(layers, pre, post)`` under the base model ``base`` (names relative to it); raises ``ValueError``
    naming why when the tree has no single layer list."""
    root = model.get_submodule(base) if base else model
    layers = layer_list(root, _n_layers(model))
    pre: Dict[str, str] = {}
    post: Dict[str, str] = {}
    parts: List[str] = layers.split(".")
    node, path = root, ""
    for part in parts:
        names = [n for n, _ in node.named_children()]
        at = names.index(part)
        for i, (n, child) in enumerate(node.named_children()):
            if i == at or _kept(child):
                continue
            full = f"{path}{n}"
            if i < at:
                pre[full] = _stand_in(child, tokens)
            else:
                post[full] = "identity"
        node, path = getattr(node, part), f"{path}{part}."
    return layers, pre, post


def _has(model: nn.Module, name: str) -> bool:
    try:
        return model.get_submodule(name) is not None
    except AttributeError:
        return False


def _both_ends(model: nn.Module, lay, events: List[str]) -> Dict[str, str]:
    """The post modules the base forward called more than once (``events``: the order of calls of the post
    modules and the layers), as ``"both_ends:2"`` stand-ins where one call came before the first layer and one
    after the last and the module holds no parameters (NanoChat's norm, applied to the embeddings and at the
    end); ``ValueError`` naming the module for any other order (between layers: a looped model; twice before
    them: XLNet's dropout, on the embeddings the first stage made and on the relative positions every stage
    remakes, which a stage cannot tell apart), or for one with weights (the first and the last stage would each
    train a copy of them)."""
    layers = [i for i, e in enumerate(events) if e.startswith(lay.layers + ".")]
    out = {}
    for n in dict.fromkeys(e for e in events if e in lay.post):
        at = [i for i, e in enumerate(events) if e == n]
        if len(at) == 1:
            continue
        if not (len(at) == 2 and layers and at[0] < layers[0] and at[1] > layers[-1]):
            where = "between the layers too" if layers and any(layers[0] < i < layers[-1] for i in at) else \
                "more than once before the layers (on what the first stage made, or on what every stage remakes?)"
            raise ValueError(f"{n!r}, registered after its layer list, runs {len(at)} times in its base forward, "
                             f"{where}, so a stage cannot tell which run is its own")
        if any(True for _ in model.get_submodule(n).parameters()):
            raise ValueError(f"{n!r}, registered after its layer list, runs before the layers and after them and "
                             "holds weights, which the first and the last stage would each train a copy of")
        out[n] = f"both_ends:{len(at)}"
    return out


def _real(part: nn.Module) -> nn.Module:
    """A layer-less middle stage of a model on the meta device (``lazy_init``, ``from_config`` under
    ``torch.device("meta")``) or of a planner's fake copy (``cl.plan`` traces on fake tensors, sharded ones as
    DTensors), given storage on the CPU: what is left of the model in it (rotary tables, a scale, the stand-ins) is
    small, so the check costs no more than on a real model. Initialised by the model's own rule
    (:func:`...lazy.materialize`), else zeros."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor

    from ...lazy import is_lazy, materialize

    for mod in part.modules():  # a fake or sharded tensor: a meta one of its whole shape, materialised below
        for kind in ("_parameters", "_buffers"):
            table = getattr(mod, kind)
            for k, t in list(table.items()):
                if isinstance(t, (FakeTensor, DTensor)):
                    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
                    table[k] = nn.Parameter(meta, requires_grad=t.requires_grad) if kind == "_parameters" else meta
    if not is_lazy(part):
        return part
    part.__dict__.pop("_lazy_memo", None)
    try:
        return materialize(part, "cpu")
    except Exception:  # noqa: BLE001 - a family whose init rule needs more than the part holds
        part.to_empty(device="cpu")
        with torch.no_grad():
            for t in list(part.parameters()) + list(part.buffers()):
                t.zero_()
        return part


def check(model: nn.Module, lay):
    """The derived layout ``lay``, checked (module docstring), with the form a stood-in layer must return
    (``returns``: the hidden states alone, a 1-tuple or a pair, for base forwards that take ``outputs[0]``);
    raises ``ValueError`` naming what a layer-less middle stage returned for ``inputs_embeds=x`` in each form."""
    import dataclasses

    from .pipeline import _cut, _StageForward

    done = getattr(model, "_cl_pp_checked", None)
    if done is not None and done[0] == lay:
        return done[1]
    width = hidden_width(model)
    first = next((t for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()), None)
    if width is None or first is None:
        raise ValueError("its layout, read from the module tree, is checked by running the base forward once, "
                         "which needs a hidden size in the config and a floating-point parameter (or add a 'pp' "
                         "entry to engine/models/hf/tables.py)")
    g = torch.Generator(device="cpu").manual_seed(0)
    device = "cpu" if first.device.type == "meta" else first.device
    x = torch.randn(2, 5, width, generator=g, dtype=first.dtype).to(device)
    seen = []
    for returns in (0, 1, 2):
        trial = dataclasses.replace(lay, returns=returns)
        part = _real(_cut(model, trial, keep=range(0), first=False, last=False))
        events: List[str] = []  # the order of the post modules' and the (stood-in) layers' calls
        for n in [n for n in lay.post if _has(part, n)] + [lay.layers + f".{i}" for i in range(len(
                part.get_submodule(lay.layers)))]:
            part.get_submodule(n).register_forward_hook(lambda *_, n=n: events.append(n))
        try:
            with torch.no_grad():
                out = _StageForward(part)(x)
        except Exception as exc:  # noqa: BLE001 - whatever the model's own forward raises, named
            seen.append(f"raised {type(exc).__name__}: {str(exc)[:120]}")
            continue
        trial = dataclasses.replace(trial, post={**trial.post, **_both_ends(model, lay, events)})
        if isinstance(out, torch.Tensor) and out.shape == x.shape and torch.equal(out, x):
            model._cl_pp_checked = (lay, trial)
            return trial
        seen.append(f"returned a {type(out).__name__}" if not isinstance(out, torch.Tensor) else
                    f"returned shape {tuple(out.shape)}" if out.shape != x.shape else
                    f"returned other values (largest change {float((out - x).abs().max()):.3g})")
    raise ValueError("its base forward, given a later stage's hidden states (inputs_embeds=x) and no layers of its "
                     "own, does not hand x back (it scales them, adds positions, applies a dropout itself or reads "
                     "more than hidden states off its layers), so a stage cut cannot reproduce it: with stood-in "
                     "layers returning the hidden states, a 1-tuple, a pair, it " + "; ".join(seen))
