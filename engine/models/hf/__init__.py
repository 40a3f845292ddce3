"""The transformers adapter: what the engine asks of a model, for a ``transformers.PreTrainedModel``.

transformers 5 gives every ``PreTrainedModel`` a ``tp_plan`` *property* (a dict of style names), which
collides with the model contract's ``tp_plan(sequence_parallel)`` method; the engine therefore asks
:func:`is_hf_model` first and reads an HF model's plan here, never by calling ``model.tp_plan``. This
package never imports transformers: it knows the model by its class names and reads its plan, config
and module types by attribute (:mod:`.plan` reads, :mod:`.styles` translates into torch's
``parallelize_module`` styles, :mod:`.local_linear` runs ``Conv1D`` and packed weights, :mod:`.grad_sum`
per-head norms whose gradients are partial, :mod:`.tables`
holds plans for families that ship none, :mod:`.pipeline` cuts pipeline stages from the model's
``base_model_pp_plan``, :mod:`.loss` is the criterion contract of ``execute_pipeline``, :mod:`.checkpointing`
recomputes decoder layers, :mod:`.nd` reads 2D/2.5D/3D roles from the 1D plan, :mod:`.sequence` cuts the
residual stream for sequence parallelism, :mod:`.context` runs ring / Ulysses attention through transformers'
attention registry, :mod:`.vocab_parallel` keeps the LM head's logits vocabulary-sharded for the loss,
:mod:`.export` writes our reference GPT as a Llama checkpoint). Tensor
parallelism (1D, and 2D/2.5D/3D for ``nn.Linear`` families), sequence and context parallelism, pipelines and
activation checkpointing are covered so far (docs/hf.md).
"""

from __future__ import annotations

import fnmatch
from typing import Optional, Tuple

import torch.nn as nn

from .export import export_llama
from .loss import check_batch, pipeline_criterion, whole_outputs
from .pipeline import num_layers, pipeline_stage
from .plan import (
    _prefixed,
    check_feature_statistics,
    check_heads,
    check_per_head_parameters,
    check_ties,
    per_rank_attributes,
    read_plan,
    tied_weights,
    torch_plan,
    unmatched,
)
from .tables import TABLES, table_for

__all__ = ["apply_tensor_parallel", "check_batch", "check_tensor_parallel", "export_llama", "is_hf_model",
           "nd_plan", "num_layers",
           "pipeline_criterion", "pipeline_stage", "reads_dict_plan", "resolve_plan", "whole_outputs"]


def is_hf_model(module: nn.Module) -> bool:
    """True for a ``transformers.PreTrainedModel`` (by its class's MRO: no import of transformers)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(module).__mro__)


def reads_dict_plan(module: nn.Module) -> bool:
    """Whether the engine reads this model's tensor-parallel plan here: an HF model, or any model whose
    ``tp_plan`` is a dict (transformers' form: module pattern -> style name) rather than the contract's method."""
    return is_hf_model(module) or isinstance(getattr(module, "tp_plan", None), dict)


def resolve_plan(model: nn.Module, user_plan: Optional[dict], tp: int) -> Tuple[dict, str]:
    """The plan to apply and where it came from: the user's ``tp_plan=`` or the model's own; an error
    naming ``tp_plan=`` if neither."""
    if user_plan is not None:
        return dict(user_plan), "tp_plan="
    plan, source = read_plan(model)
    if plan:  # a mixture of experts' experts stay whole per tp rank (moe.py)
        from .moe import whole_experts

        plan = whole_experts(model, plan)
    if not plan:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        why = table_for(model).get("refuse_tp")
        if why:
            raise ValueError(f"HybridParallelPlugin(tp_size={tp}): {type(model).__name__} (model_type={model_type!r}) "
                             f"is not cut by tensor parallelism: {why}; use tp_size=1")
        raise ValueError(f"HybridParallelPlugin(tp_size={tp}): {type(model).__name__} (model_type={model_type!r}) "
                         "carries no tensor-parallel plan (no model.tp_plan, no config.base_model_tp_plan) and "
                         "colossal-lab has no built-in one for it; pass HybridParallelPlugin(tp_plan={"
                         "'model.layers.*.self_attn.q_proj': 'colwise', ...}) with transformers' style names "
                         "or torch ParallelStyles (docs/hf.md)")
    return plan, source


def check_tensor_parallel(model: nn.Module, plugin) -> None:
    """Everything tensor parallelism needs of an HF model, before any process group exists: a mode
    and options it runs, a plan whose every style is known, heads that divide, ties sharded alike
    (under 2D/2.5D/3D: a role for every parameter, blocks that cut evenly, no ties)."""
    tp = plugin.tp_size
    if tp == 1:
        return
    if plugin.tp_mode != "1d":
        _check_nd(model, plugin)
        return
    if plugin.sequence_parallel:
        check_sequence_parallel(model, plugin)
    plan, source = resolve_plan(model, plugin.tp_plan, tp)
    try:
        torch_plan(model, plan)  # every style translated: an unknown one, or one on a parameter, raises here
    except ValueError as exc:
        raise ValueError(f"HybridParallelPlugin(tp_size={tp}): {type(model).__name__}'s plan ({source}): {exc}") \
            from None
    missing = unmatched(model, plan) if plugin.tp_plan is not None else []
    if missing:
        names = [n for n, _ in model.named_modules() if n][:6]
        raise ValueError(f"HybridParallelPlugin(tp_plan=...): {missing} name no module of {type(model).__name__} "
                         f"(names are module paths, '*' one part of them, e.g. {names})")
    check_heads(model, tp)
    if plugin.tp_plan is None:  # a user's plan may leave the MLPs whole
        check_feature_statistics(model, tp)
    try:
        check_per_head_parameters(model, plan)
    except ValueError as exc:
        raise ValueError(f"HybridParallelPlugin(tp_size={tp}): {type(model).__name__}'s plan ({source}): {exc}") \
            from None
    check_ties(model, plan)


def _check_nd(model: nn.Module, plugin) -> None:
    from ...tp_nd import apply as nd_apply
    from .nd import check_heads as check_nd_heads
    from .nd import nd_roles

    mode, tp, grid = plugin.tp_mode, plugin.tp_size, plugin.tp_grid
    if plugin.pp_size > 1:
        raise ValueError(f"HybridParallelPlugin(tp_mode={mode!r}, pp_size={plugin.pp_size}): pipeline stages of a "
                         "transformers model under 2D/2.5D/3D tensor parallelism are not run yet; use pp_size=1 or "
                         "tp_mode='1d'")
    plan, source = resolve_plan(model, plugin.tp_plan, tp)
    try:
        roles = nd_roles(model, plan, mode)
        check_nd_heads(model, grid.get("row", grid.get("y")), mode, tp)
        nd_plan = nd_apply.resolve_plan(model, roles=roles)
        nd_apply.check(model, nd_plan, mode, grid, tp)
    except ValueError as exc:
        raise ValueError(f"{type(model).__name__} (plan: {source}): {exc}") from None


def nd_plan(model: nn.Module, user_plan: Optional[dict], mode: str) -> dict:
    """The ``{module name: role}`` of a (checked) model under ``tp_mode`` 2d/2.5d/3d."""
    from .nd import nd_roles

    return nd_roles(model, resolve_plan(model, user_plan, 0)[0], mode)


def check_sequence_parallel(model: nn.Module, plugin) -> None:
    """Sequence parallelism cuts the residual stream of the model's layer list: it needs that list (the
    pipeline layout; under ``pp_size > 1`` the stages hand on sequence shards, :mod:`.sequence`)."""
    from .pipeline import layout_or_reason

    where = f"HybridParallelPlugin(sequence_parallel=True, tp_size={plugin.tp_size})"
    found, why = layout_or_reason(model)
    if found is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(f"{where}: {type(model).__name__} (model_type={model_type!r}) has no layer list "
                         f"(config.base_model_pp_plan or the module tree's) for sequence parallelism to cut "
                         f"between: {why}; set sequence_parallel=False")
    why = table_for(model).get("refuse_sp")
    if not why and getattr(getattr(model, "config", None), "hidden_size_per_layer_input", 0):
        why = ("its per-layer embeddings (config.hidden_size_per_layer_input, Gemma 3n / Gemma 4) are looked up for "
               "the whole sequence and added to every layer's shard")
    hc = getattr(getattr(model, "config", None), "hc_mult", 1)
    if not why and isinstance(hc, int) and hc > 1:
        why = (f"its layers pass config.hc_mult={hc} hyper-connection streams between them (HY-V4), which the base "
               "forward widens and folds on the whole sequence")
    if why:
        raise ValueError(f"{where}: {type(model).__name__} cannot cut its residual stream: {why}; "
                         "set sequence_parallel=False")
    from .sequence import check_regions

    try:
        styles = torch_plan(model, resolve_plan(model, plugin.tp_plan, plugin.tp_size)[0])
    except ValueError:
        return  # the plan's own faults are named by check_tensor_parallel, after this
    check_regions(model, styles)


def apply_tensor_parallel(model: nn.Module, tp_mesh, user_plan: Optional[dict] = None,
                          sequence_parallel: bool = False, loss_parallel: bool = False) -> nn.Module:
    """Shard ``model`` in place over ``tp_mesh`` (1-D) with its plan (and, with ``sequence_parallel``, the
    residual stream between its regions along the sequence: :mod:`.sequence`); tied weights stay one
    parameter and the built-in table's head counts become one rank's share. ``loss_parallel``: an LM head the
    plan gathers keeps its logits vocabulary-sharded when the model is called with labels
    (:mod:`.vocab_parallel`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from . import vocab_parallel

    tp = tp_mesh.size()
    if tp == 1:
        return model
    ties = tied_weights(model)  # before: parallelize_module gives each owner its own new parameter
    plan = resolve_plan(model, user_plan, tp)[0]
    styles = torch_plan(model, plan)
    heads = vocab_parallel.head_names(model, plan) if loss_parallel else []
    styles.update({name: vocab_parallel.head_style() for name in heads})
    parents = {name.rpartition(".")[0] for name in styles}
    hooks = []
    if sequence_parallel:
        from .sequence import register, sequence_parallel_plan

        hooks = sequence_parallel_plan(model, styles, tp_mesh)
        register(hooks, "pre")
    parallelize_module(model, tp_mesh, styles)
    if hooks:
        register(hooks, "post")
    for name in heads:  # a pipeline's last stage (pipeline.py marks it) hands its schedule the logits block
        stage = getattr(model, "_cl_stage", None)
        (vocab_parallel.install_stage if stage is not None else vocab_parallel.install)(model, name)
    for names in ties:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            if getattr(model.get_parameter(name), "placements", None) != getattr(first, "placements", None):
                raise ValueError(f"tensor parallelism: {names} are one tied weight, but tp_plan= sharded "
                                 f"{names[0]} and {name} differently; give both modules the same layout")
            setattr(model.get_submodule(owner), attr, first)
    share_heads(model, parents, tp, tp_mesh.get_local_rank())
    return model


def share_heads(model: nn.Module, parents: set, tp: int, rank: int) -> None:
    """Once the plan's linears under ``parents`` are cut: the table's head counts become one rank's share
    and ALiBi attentions (or ones handed another per-head bias: the table's ``head_bias``) among them take only
    this rank's heads' bias (:mod:`.alibi`)."""
    _per_rank(model, parents, tp)
    table = TABLES.get(getattr(model.config, "model_type", None), {})
    alibi = _prefixed(model, dict.fromkeys(table.get("alibi", ())))
    if alibi:  # ALiBi attentions whose heads the plan cut: each its rank's slice of the bias
        from .alibi import slice_alibi

        slice_alibi(model, alibi, rank, tp, only=parents)
    bias = _prefixed(model, table.get("head_bias"))
    if bias:  # a per-head bias the base model hands each attention (CPM-Ant's position_bias): its rank's heads
        from .alibi import slice_head_bias

        slice_head_bias(model, bias, rank, tp, only=parents)


def _per_rank(model: nn.Module, parents: set, tp: int) -> None:
    """The table's head-count attributes become one rank's share, on modules whose children the plan
    sharded (a plan that leaves an attention whole leaves its counts alone)."""
    mods = dict(model.named_modules())
    for pattern, attrs in per_rank_attributes(model).items():
        for name in [n for n in parents if n.count(".") == pattern.count(".") and fnmatch.fnmatchcase(n, pattern)]:
            for attr in attrs:
                n = getattr(mods[name], attr)  # a count of one is a head every rank shares (multi-query)
                setattr(mods[name], attr, n // tp if n > 1 else n)
