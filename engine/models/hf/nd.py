"""2D / 2.5D / 3D tensor parallelism for a transformers model: its roles read from its own 1D plan.

:mod:`...tp_nd` converts modules by role (``colwise``, ``rowwise``, ``head``, ``embedding``,
``rmsnorm``, ``layernorm``). A transformers model has no ``tp_nd_plan()``; its roles come from the plan
the 1D adapter reads (:func:`.plan.read_plan`: ``model.tp_plan``, ``config.base_model_tp_plan`` or
:mod:`.tables`): a column style is ``colwise``, a row style ``rowwise``, the output embeddings the
``head``, every ``nn.Embedding`` an ``embedding``, and each norm over the hidden size a ``rmsnorm``
(weight, no bias) or ``layernorm`` (weight and bias), after checking on a small input that the module
computes that formula (a norm of another kind, Gemma's ``(1 + weight)``, would be silently wrong). A
``Conv1D`` (GPT-2 and kin: weight ``(in, out)``) is a linear role with ``transposed``, a packed style
(GPT-2's ``c_attn``: q | k | v) one with ``parts``. Anything else that holds parameters is an error naming
it, as is what the layouts cannot run yet: ALiBi (BLOOM), per-head norms (Qwen3's ``q_norm``).

Attention runs unchanged on a rank's heads: transformers reshapes by ``-1`` heads (or by the table's
``per_rank`` attributes, divided here by the grid side ``q``), so the checks ask that heads and key/value
heads divide over ``q``. On a direct call :func:`whole_logits` gathers the vocabulary of this rank's
rows so the model's own ``loss_function`` runs on them (``HybridParallelModule`` calls it).
"""

from __future__ import annotations

import fnmatch
import math
from typing import Dict, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from .local_linear import is_conv1d
from .plan import _matches, head_counts, per_rank_attributes
from .styles import _parse, check_name
from .tables import TABLES

COLUMN = ("colwise", "local_colwise")
HEAD = ("colwise_rep", "colwise_gather_output")
ROW = ("rowwise", "local_rowwise", "rowwise_rep", "rowwise_split_input")
WHOLE = ("replicate", "sequence_parallel")


def _hidden(model: nn.Module) -> Optional[int]:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return next((getattr(text, k) for k in ("hidden_size", "n_embd", "d_model")
                 if isinstance(getattr(text, k, None), int)), None)


def _refuse(what: str, mode: str) -> ValueError:
    return ValueError(f"HybridParallelPlugin(tp_mode={mode!r}): {what}, which 2D/2.5D/3D tensor parallelism does "
                      "not run for transformers models yet; use tp_mode='1d'")


def _norm_role(name: str, mod: nn.Module, hidden: Optional[int], mode: str) -> Optional[str]:
    """``rmsnorm`` / ``layernorm`` for a norm over the hidden size that computes that formula, else None
    (a module holding parameters and no role is refused by the caller)."""
    own = dict(mod.named_parameters(recurse=False))
    w, b = own.get("weight"), own.get("bias")
    eps = next((float(getattr(mod, a)) for a in ("eps", "variance_epsilon")
                if isinstance(getattr(mod, a, None), (int, float))), None)
    if w is None or w.dim() != 1 or set(own) - {"weight", "bias"} or eps is None:
        return None
    if hidden is not None and w.shape[0] != hidden:
        raise _refuse(f"{name!r} ({type(mod).__name__}) normalises {w.shape[0]} features, not the hidden size "
                      f"{hidden} (a per-head norm)", mode)
    role = "layernorm" if b is not None else "rmsnorm"
    if w.is_meta:
        return role
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, w.shape[0], generator=gen, dtype=w.dtype, device=w.device)
    with torch.no_grad():
        got = mod(x)
        want = F.layer_norm(x, (w.shape[0],), w, b, eps) if b is not None else \
            x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise _refuse(f"{name!r} ({type(mod).__name__}) does not compute {role} (weight * x / rms(x)"
                      f"{' around the mean, plus bias' if b is not None else ''})", mode)
    return role


def nd_roles(model: nn.Module, plan: dict, mode: str) -> Dict[str, Union[str, tuple]]:
    """``{module name: role}`` for :func:`...tp_nd.resolve_plan` from the model's 1D ``plan`` (patterns to
    style names); a ``ValueError`` naming the first module or style these layouts cannot run."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if TABLES.get(model_type, {}).get("alibi") and getattr(model.config, "alibi", True):  # Falcon: by flag
        raise _refuse(f"{type(model).__name__} adds an ALiBi bias per head", mode)
    if TABLES.get(model_type, {}).get("head_bias"):  # CPM-Ant: a relative position bias per head
        raise _refuse(f"{type(model).__name__} hands its attentions a bias per head", mode)
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    roles: Dict[str, Union[str, tuple]] = {}
    for pattern, name, mod in _matches(plan, model):
        entry = plan[pattern]
        if not isinstance(entry, (str, tuple)):
            raise _refuse(f"tp_plan entry {pattern!r} is a torch ParallelStyle (give transformers' style names)", mode)
        check_name(entry, pattern)
        style, opts = _parse(entry)
        if style in WHOLE:
            continue
        if style == "replicated_with_grad_allreduce":
            raise _refuse(f"{name!r} ({type(mod).__name__}) is a per-head norm kept whole on every rank", mode)
        if opts.get("multi_query"):
            raise _refuse(f"{name!r} packs q with one key/value head every rank shares (multi-query)", mode)
        conv = is_conv1d(mod)
        if isinstance(mod, nn.Embedding):
            roles[name] = "embedding"
            continue
        if not (conv or isinstance(mod, nn.Linear)):
            raise _refuse(f"{name!r} is a {type(mod).__name__} with style {style!r}", mode)
        if style in HEAD and mod is head and not conv:
            role = "head"
        elif style in COLUMN or style == "packed_colwise":
            role = "colwise"
        elif style in ROW:
            role = "rowwise"
        else:
            raise _refuse(f"{name!r} ({type(mod).__name__}) has style {style!r}", mode)
        options = {"transposed": True} if conv else {}
        if style == "packed_colwise":
            options["parts"] = int(opts.get("parts", 2))
        roles[name] = (role, options) if options else role
    hidden = _hidden(model)
    for name, mod in model.named_modules():
        if name in roles or not any(True for _ in mod.parameters(recurse=False)):
            continue
        if isinstance(mod, nn.Embedding):
            roles[name] = "embedding"
        elif mod is head and isinstance(mod, nn.Linear):
            roles[name] = "head"
        elif is_conv1d(mod):
            raise _refuse(f"{name!r} is a Conv1D that the model's tp plan gives no style", mode)
        else:
            role = _norm_role(name, mod, hidden, mode)
            if role is None:
                params = [f"{name}.{n}" for n, _ in mod.named_parameters(recurse=False)]
                raise _refuse(f"{params} of {type(mod).__name__} have no 2D/2.5D/3D role (colwise, rowwise, head, "
                              "embedding, rmsnorm, layernorm; read from the model's tp_plan)", mode)
            roles[name] = role
    return roles


def check_heads(model: nn.Module, q: int, mode: str, tp: int) -> None:
    """A rank runs the heads of its hidden slice (``1 / q`` of them): heads and key/value heads divide by
    ``q``; the error names the ``q`` (and tp sizes) that would."""
    heads, kv = head_counts(model)
    if heads is None or (heads % q == 0 and kv % q == 0):
        return
    g = math.gcd(heads, kv)
    qs = [d for d in range(1, g + 1) if g % d == 0]
    power = 3 if mode == "3d" else 2
    raise ValueError(f"HybridParallelPlugin(tp_mode={mode!r}, tp_size={tp}): {type(model).__name__} has {heads} "
                     f"attention heads and {kv} key/value heads, and the grid side q={q} cuts both (each rank "
                     f"runs whole heads); use a grid side in {qs} (tp_size in {[d ** power for d in qs]}"
                     f"{' times tp_depth' if mode == '2.5d' else ''})")


def divide_per_rank(model: nn.Module, roles: Dict[str, str], q: int) -> None:
    """The table's head-count attributes hold one rank's share (``1 / q``) on modules whose children
    became N-d layers."""
    parents = {name.rpartition(".")[0] for name, role in roles.items()
               if (role[0] if isinstance(role, tuple) else role) in ("colwise", "rowwise")}
    mods = dict(model.named_modules())
    for pattern, attrs in per_rank_attributes(model).items():
        for name in [n for n in parents if n.count(".") == pattern.count(".") and fnmatch.fnmatchcase(n, pattern)]:
            for attr in attrs:
                setattr(mods[name], attr, getattr(mods[name], attr) // q)


def whole_logits(model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` of this rank's rows with the whole vocabulary, gathered from the N-d head's blocks
    (each rank back-propagates its own columns); unchanged when the head is not an N-d one."""
    from ...tp_nd import gather_vocab

    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    shard = getattr(head, "vocab", None)
    return gather_vocab(logits, shard) if shard is not None else logits

