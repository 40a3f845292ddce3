"""Reading a transformers model's tensor-parallel plan, and what must hold before it is applied.

The plan is read, never retyped: the user's ``HybridParallelPlugin(tp_plan=...)`` first, then the
model's own (transformers 5: the ``model.tp_plan`` property, full module names; before: ``model._tp_plan``
or ``config.base_model_tp_plan`` under ``base_model_prefix`` plus the class's head plan), then
:mod:`.tables` by ``config.model_type``. The checks (heads and key/value heads divide, every style known,
tied weights sharded alike) read only the model and its config, so they run before any process group.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Dict, List, Optional, Tuple

import torch.nn as nn

from . import mla
from .local_params import LocalParams
from .styles import check_name, translate, weight_shard_dim
from .tables import table_for


def _prefixed(model: nn.Module, plan: Optional[dict]) -> dict:
    """A base-model plan's names as the task model's (``layers.*`` -> ``model.layers.*``)."""
    prefix = getattr(model, "base_model_prefix", "")
    if not plan:
        return {}
    if prefix and hasattr(model, prefix) and getattr(model, prefix) is not model:
        return {f"{prefix}.{k}": v for k, v in plan.items()}
    return dict(plan)


def read_plan(model: nn.Module) -> Tuple[Dict[str, object], str]:
    """The model's own plan (module pattern -> style name) and where it came from ('' when none)."""
    head = getattr(type(model), "_tp_plan", None)
    head = dict(head) if isinstance(head, dict) else {}
    for attr in ("tp_plan", "_tp_plan"):
        own = getattr(model, attr, None)
        if isinstance(own, dict) and own:
            return {**own, **_missing_head(model, own, head)}, f"model.{attr}"
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if base:
        return {**_prefixed(model, base), **head}, "config.base_model_tp_plan"
    table = table_for(model)
    if table.get("base"):
        refuse_if_flags(model, table)
        return {**_prefixed(model, base_entries(config, table)), **table["head"]}, \
            f"built-in table ({config.model_type})"
    return {}, ""


def base_entries(config, table: dict) -> dict:
    """A built-in entry's ``base`` with its ``base_if`` on top: ``{flag: entries}`` (or ``{flag: (entries, other
    flag)}``: unless that other flag is set too) swaps in the entries a config flag's layout needs (multi-query)."""
    base = dict(table["base"])
    for flag, extra in table.get("base_if", {}).items():
        extra, unless = extra if isinstance(extra, tuple) else (extra, None)
        if getattr(config, flag, False) and not (unless and getattr(config, unless, False)):
            base.update(extra)
    return base


def refuse_if_flags(model: nn.Module, table: dict) -> None:
    """A built-in entry's ``refuse_if``: a config flag that switches on what the entry's plan cannot cut."""
    config = getattr(model, "config", None)
    for flag, what in table.get("refuse_if", {}).items():
        what, unless = what if isinstance(what, tuple) else (what, None)
        if getattr(config, flag, False) and not (unless and getattr(config, unless, False)):
            raise ValueError(f"tensor parallelism: {type(model).__name__} with config.{flag}=True has {what}, "
                             "which colossal-lab's built-in plan does not cut; pass HybridParallelPlugin(tp_plan="
                             "{...}) leaving those attentions whole, or tp_size=1")


def _missing_head(model: nn.Module, own: dict, head: dict) -> dict:
    """The class's own entries (its LM head) that the instance's plan lacks: some releases (transformers 5.5)
    build the instance's plan from the base model's alone. Not an entry whose weight is tied to a module the
    plan leaves whole (the input embedding there): one side of a tie cannot be sharded alone, and whole it
    stays as that release would run it."""
    extra = {k: v for k, v in head.items() if k not in own}
    planned = {name for _, name, _ in _matches({**own, **extra}, model)}
    for names in tied_weights(model):
        owners = {n.rpartition(".")[0] for n in names}
        if owners - planned:
            extra = {k: v for k, v in extra.items() if not {name for _, name, _ in _matches({k: v}, model)} & owners}
    return extra


def per_rank_attributes(model: nn.Module) -> Dict[str, Tuple[str, ...]]:
    """The built-in table's attributes to divide by tp, under the model's own module names."""
    return _prefixed(model, table_for(model).get("per_rank"))


def _matches(plan: dict, model: nn.Module) -> List[Tuple[str, str, nn.Module]]:
    """``(pattern, module name, module)`` for every module a plan entry names (one dot-part per ``*``); a
    pipeline stage's stand-ins for the other stages' modules are not the modules the plan names."""
    from .pipeline import StandIn

    out = []
    for pattern in plan:
        depth = pattern.count(".")
        for name, mod in model.named_modules():
            if name.count(".") == depth and fnmatch.fnmatchcase(name, pattern) and not isinstance(mod, StandIn):
                out.append((pattern, name, mod))
    return out


def torch_plan(model: nn.Module, plan: dict) -> Dict[str, object]:
    """Every matched module's torch style under its exact name (a style already a ``ParallelStyle``
    passes through); unknown styles raise naming the style and the module."""
    styles, rope = {}, mla.rope_dim(model)
    for pattern, name, mod in _matches(plan, model):
        entry = plan[pattern]
        style = entry if not isinstance(entry, (str, tuple)) else translate(entry, mod, name, rope)
        if style is not None:
            styles[name] = style
    for pattern, entry in plan.items():  # a style matching no module here must still be one we know
        if isinstance(entry, (str, tuple)):
            check_name(entry, pattern)
    shards: Dict[str, Dict[str, int]] = {}  # owner module -> its bare parameters the plan shards, by dim
    for pattern, owner, pname, param in _parameter_matches(model, plan):
        entry = plan[pattern]
        style = entry if isinstance(entry, str) else entry[0] if isinstance(entry, tuple) else None
        if style not in ("colwise", "local_colwise") or param.dim() != 1:
            raise ValueError(f"tp plan entry {pattern!r} ({entry!r}) names a parameter, not a module; a bare "
                             "parameter is run only as a 1-D colwise entry (one value per head: attention sinks); "
                             "pass HybridParallelPlugin(tp_plan={...}) without it")
        if owner in styles:
            raise ValueError(f"tp plan entry {pattern!r}: its module {owner!r} also has a style of its own "
                             f"({type(styles[owner]).__name__}); a module with sharded bare parameters takes "
                             "'local_params' or none")
        shards.setdefault(owner, {})[pname] = 0
    styles.update({owner: LocalParams(names) for owner, names in shards.items()})
    return styles


def _parameter_matches(model: nn.Module, plan: dict) -> List[Tuple[str, str, str, nn.Parameter]]:
    """``(pattern, owner module, parameter name, parameter)`` for every bare parameter a plan entry names
    (transformers 5 plans may shard one: attention sinks, experts' grouped weights)."""
    out = []
    for pattern in unmatched(model, plan):
        for n, p in model.named_parameters():
            if n.count(".") == pattern.count(".") and fnmatch.fnmatchcase(n, pattern):
                owner, _, pname = n.rpartition(".")
                out.append((pattern, owner, pname, p))
    return out


def unmatched(model: nn.Module, plan: dict) -> List[str]:
    """The plan's patterns that name no module of ``model`` (a typo in a user's ``tp_plan=``)."""
    hit = {p for p, _, _ in _matches(plan, model)}
    return [p for p in plan if p not in hit]


def head_counts(model: nn.Module) -> Tuple[Optional[int], Optional[int]]:
    """(attention heads, key/value heads) from the (text) config; None when it names none."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = next((getattr(text, k) for k in ("num_attention_heads", "n_head", "num_heads")
                  if isinstance(getattr(text, k, None), int)), None)
    kv = next((getattr(text, k) for k in ("num_key_value_heads", "num_kv_heads")
               if isinstance(getattr(text, k, None), int)), None)
    return heads, kv if isinstance(kv, int) else heads


def check_heads(model: nn.Module, tp: int) -> None:
    """Heads and key/value heads must both divide over ``tp`` ranks; the error names the sizes that work."""
    divides = table_for(model).get("divides")
    if divides:  # other sizes the built-in plan cuts (a Mamba mixer's channels)
        from .mamba import check_mixers

        check_mixers(model, tp, divides)
    heads, kv = head_counts(model)
    if heads is None or (heads % tp == 0 and kv % tp == 0):
        return
    if heads % tp == 0 and kv == 1 and _shares_one_head(model):
        return  # multi-query: the one key/value head is kept whole on every rank (multi_query.py)
    g = math.gcd(heads, kv)
    valid = [d for d in range(1, g + 1) if g % d == 0]
    raise ValueError(f"HybridParallelPlugin(tp_size={tp}): {type(model).__name__} has {heads} attention heads and "
                     f"{kv} key/value heads, and tensor parallelism gives each rank whole heads of both; "
                     f"choose tp_size in {valid}")


def _shares_one_head(model: nn.Module) -> bool:
    """The built-in plan for this config keeps one key/value head whole on every rank (an entry with the
    ``multi_query`` option, :mod:`.multi_query`)."""
    table = table_for(model)
    if not table.get("base"):
        return False
    entries = base_entries(getattr(model, "config", None), table).values()
    return any(isinstance(e, tuple) and e[1].get("multi_query") for e in entries)


def check_per_head_parameters(model: nn.Module, plan: dict) -> None:
    """A module whose head projections the plan shards must not hold a bare parameter of one value per head
    that the plan leaves whole (Doge's ``self_attn.A``, one per key/value head): each rank would apply every
    head's value to its own heads' shapes. Refused, naming the parameter, rather than run wrong."""
    heads, kv = head_counts(model)
    counts = {c for c in (heads, kv) if c}
    mods = dict(model.named_modules())
    sharding = {name.rpartition(".")[0] for p, name, _ in _matches(plan, model)
                if isinstance(plan[p], (str, tuple)) and "colwise" in (plan[p] if isinstance(plan[p], str)
                                                                       else plan[p][0])}
    planned = {f"{owner}.{pname}" for _, owner, pname, _ in _parameter_matches(model, plan)}
    for parent in sorted(sharding):
        for pname, param in mods[parent].named_parameters(recurse=False):
            if param.dim() == 1 and param.shape[0] in counts and f"{parent}.{pname}" not in planned:
                raise ValueError(f"{parent}.{pname} holds one value per attention head ({param.shape[0]}), which "
                                 f"the plan leaves whole while it shards {parent}'s heads; pass "
                                 "HybridParallelPlugin(tp_plan={...}) leaving that attention whole, or tp_size=1")


#: config settings under which a layer computes statistics over the features a column-parallel cut divides among
#: the tp ranks (each rank would see its share only): key -> what it switches on
FEATURE_STATISTICS = {
    "activation_sparsity_pattern": "a gaussian top-k over each MLP's intermediate features (their mean and standard "
                                   "deviation), which tensor parallelism divides among the ranks",
}


def check_feature_statistics(model: nn.Module, tp: int) -> None:
    """Refuse, before any group, a config that switches on :data:`FEATURE_STATISTICS` (Gemma 3n's activation
    sparsity: each rank would keep the top of its own share of the features, not of all of them)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key, what in FEATURE_STATISTICS.items():
        value = getattr(text, key, None)
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values):
            raise ValueError(f"HybridParallelPlugin(tp_size={tp}): {type(model).__name__}'s config.{key} switches on "
                             f"{what}; pass HybridParallelPlugin(tp_plan={{...}}) leaving those MLPs whole, set "
                             f"config.{key} to zeros, or use tp_size=1")


def check_ties(model: nn.Module, plan: dict) -> None:
    """A weight shared by two modules (an embedding tied to its LM head) must be sharded the same way
    by both, or left whole by both: it stays one parameter. (Owners given torch styles by the user are
    checked when applied, by the placements they made.)"""
    entry_of = {name: plan[p] for p, name, _ in _matches(plan, model)}
    mods = dict(model.named_modules())
    for names in tied_weights(model):
        owners = [n.rpartition(".")[0] for n in names]
        entries = [entry_of.get(o) for o in owners]
        if any(e is not None and not isinstance(e, (str, tuple)) for e in entries):
            continue
        dims = {weight_shard_dim(e, mods[o]) if e is not None else None for o, e in zip(owners, entries)}
        if len(dims) > 1:
            raise ValueError(f"tensor parallelism: {names} are one tied weight, but the plan shards it "
                             f"differently in {dict(zip(owners, entries))}; give both modules styles sharding "
                             "the same dimension, or neither, in tp_plan=")


def tied_weights(model: nn.Module) -> List[List[str]]:
    """Names of every parameter registered under more than one name."""
    seen: Dict[int, List[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), []).append(n)
    return [names for names in seen.values() if len(names) > 1]
