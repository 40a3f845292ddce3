"""What ``HybridParallelPlugin.configure`` asks of the model, checked before any process group exists.

Every check reads the model contract (:mod:`...models.protocol`) and raises a ``ValueError`` (a
``TypeError`` for a model a pipeline cannot split) naming the method or the argument to change, so a
bad layout fails on every rank alike and before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
import torch.nn as nn


@dataclass
class Checkpointing:
    """The activation checkpointing a boost applies: ``auto`` plans each stage for ``budget`` (the
    plugin's ``"auto"``, or the model's own request); ``every`` recomputes every layer, through the
    model's ``enable_activation_checkpointing()`` when ``own`` is set, else ``checkpoint_wrapper`` on
    a Sequential's children."""

    auto: bool = False
    budget: Optional[int] = None
    every: bool = False
    own: bool = False


def resolve_checkpointing(activation_checkpointing, activation_budget, model: nn.Module) -> Checkpointing:
    """The plugin's argument, or the model's own request (``checkpoint_budget()``), planned here like the
    plugin's with the criterion a pipeline runs and the stage's share, for the model's budget unless
    the plugin gives one."""
    from ...autockpt_request import requested_budget
    from ...models.protocol import checkpointing_method

    ac = activation_checkpointing
    if ac is True:
        return Checkpointing(every=True, own=checkpointing_method(model) is not None)
    asked = requested_budget(model)
    if ac == "auto" or asked is not None:
        return Checkpointing(auto=True, budget=activation_budget if activation_budget is not None else asked)
    return Checkpointing()


def check_checkpointing(model: nn.Module, ckpt: Checkpointing) -> None:
    """``"auto"`` switches layers through the model contract (the model takes a list of layers);
    ``True`` needs the contract's method or an ``nn.Sequential``."""
    from ...models.protocol import check_checkpointing as check

    if ckpt.auto:
        check(model, "HybridParallelPlugin(activation_checkpointing='auto')", layers=True,
              instead="use activation_checkpointing=True")
    elif ckpt.every:
        check(model, "HybridParallelPlugin(activation_checkpointing=True)", layers=False)


def check_tensor_parallel(model: nn.Module, plugin) -> None:
    """1D needs a ``tp_plan`` (the model's or the plugin's); 2D/2.5D/3D resolves and checks its roles;
    heads must divide over the ranks they are cut over. A transformers model is checked by its adapter."""
    from ...models.hf import check_tensor_parallel as check_hf
    from ...models.hf import reads_dict_plan

    if reads_dict_plan(model):  # its tp_plan is transformers' dict (property), not the contract's method
        if plugin.tp_size > 1:  # experts whole per tp rank: what that needs, named first (models/hf/moe.py)
            from ...models.hf.moe import check as check_hf_moe

            check_hf_moe(model, plugin)
        check_hf(model, plugin)
        return
    nd = plugin.tp_mode != "1d" and plugin.tp_size > 1
    if nd:
        from ...tp_nd import apply as nd_apply

        nd_plan = nd_apply.resolve_plan(model, plugin.tp_plan)
        nd_apply.check(model, nd_plan, plugin.tp_mode, plugin.tp_grid, plugin.tp_size)
    elif plugin.tp_size > 1 and plugin.tp_plan is None and not callable(getattr(model, "tp_plan", None)):
        raise ValueError(f"HybridParallelPlugin(tp_size={plugin.tp_size}): {type(model).__name__} has no tp_plan() "
                         "(the model contract); "
                         "pass tp_plan={'layer.name': ColwiseParallel() | RowwiseParallel(), ...}")
    if plugin.tp_size > 1 and callable(getattr(model, "check_tp", None)):
        # N-d: heads are cut over q ranks (a grid side), not over the whole tp group
        model.check_tp(plugin.tp_size if not nd else plugin.tp_grid.get("row", plugin.tp_grid.get("y")))


def check_context_parallel(model: nn.Module, plugin) -> None:
    if plugin.cp_size == 1:
        return
    cp, tp = plugin.cp_size, plugin.tp_size
    from ...models.hf import is_hf_model

    if is_hf_model(model):  # through transformers' attention registry (models/hf/context.py)
        from ...models.hf.context import check_context_parallel as check_hf

        check_hf(model, plugin)
        return
    if not callable(getattr(model, "enable_context_parallel", None)):
        raise ValueError(f"HybridParallelPlugin(cp_size={cp}): {type(model).__name__} has no "
                         "enable_context_parallel(group, mode) (the model contract); implement it or set cp_size=1")
    # Ulysses cuts each rank's heads (already cut over tp) over cp: asked through the contract's
    # check_tp, as the heads must divide over tp_size * cp_size ranks
    if plugin.cp_mode == "ulysses" and callable(getattr(model, "check_tp", None)):
        try:
            model.check_tp(tp * cp)
        except ValueError as exc:
            raise ValueError(f"HybridParallelPlugin(cp_size={cp}, cp_mode='ulysses', tp_size={tp}): Ulysses cuts "
                             f"the heads over tp_size * cp_size = {tp * cp} ranks ({exc}); use cp_mode='ring' or "
                             "smaller sizes") from None


def check_running() -> int:
    """The world size of the running process group (a ``RuntimeError`` naming how to start one)."""
    if not dist.is_initialized():
        raise RuntimeError("HybridParallelPlugin: torch.distributed is not initialised; start the ranks "
                           "with cl.launch(n=...) or torchrun")
    return dist.get_world_size()
