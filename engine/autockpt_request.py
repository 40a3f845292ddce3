"""A model's own request for planned activation checkpointing, resolved by the engine.

A model asks through the model contract (``checkpoint_budget()``, :mod:`.models.protocol`): "plan my
checkpointing for this many bytes" (GPT: ``GPTConfig(activation_checkpointing="auto",
activation_budget=...)``). The model never plans itself. Where a plugin holds the model
(``HybridParallelPlugin``, ``GeminiPlugin``), the plugin plans the request as its own ``"auto"`` (a
pipeline stage its share, Gemini with its chunks gathered) and :func:`take` tells this module's hook
to stand aside. Everywhere else (no plugin, DDP, ZeRO, a model called by hand) :class:`RequestHook`,
a forward pre-hook the model registers with :func:`plan_on_request`, does it: at the first training
forward of each input shape it profiles the model on that very input, merges the profile over the
ranks whose collectives run inside its layers (:func:`.autockpt_dist.collective_groups`: none under
data parallelism, the tensor/context-parallel groups found on the model otherwise), solves it for the
budget and hands the plan back through the contract (``enable_activation_checkpointing(layers=...)``
and ``model.checkpoint_plan``). A shape seen before gets its plan back without a new profile; every
plan made is reported once on the telemetry bus (``autockpt.solve``).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Dict, Optional

import torch
import torch.nn as nn

__all__ = ["RequestHook", "plan_on_request", "requested_budget", "take"]

# modules whose request a plugin plans itself (weak: a module dropped is forgotten)
_TAKEN: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()

_PLAIN = (torch.Tensor, bool, int, float, str)  # inputs a profile may replay


def requested_budget(model: nn.Module) -> Optional[int]:
    """The budget ``model.checkpoint_budget()`` asks for, or None (no request, or no such method)."""
    ask = getattr(model, "checkpoint_budget", None)
    return ask() if callable(ask) else None


def take(module: nn.Module) -> None:
    """A plugin plans ``module``'s request itself: its :class:`RequestHook` stands aside from now on."""
    _TAKEN.add(module)


def plan_on_request(model: nn.Module) -> None:
    """Register the engine's :class:`RequestHook` on ``model`` (a model that can make a request calls
    it once, when it is built). A deep copy of the model (a pipeline stage) carries its own copy."""
    model.register_forward_pre_hook(RequestHook(), with_kwargs=True)


def _sample(module: nn.Module, args, kwargs):
    """The forward's inputs as ``profile_checkpointing`` takes them: positional, or bound by name."""
    if kwargs:
        return dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
    return tuple(args)


class RequestHook:
    """Forward pre-hook resolving ``module.checkpoint_budget()`` per input shape (module docstring).

    Quiet in eval mode, without autograd, while it profiles (the profile calls the module), for a
    module a plugin took, without a request, and for a forward with an input that is neither a tensor
    nor a plain value (a KV cache: the profile replays the forward, which would advance it)."""

    def __init__(self):
        self.plans: Dict[tuple, Any] = {}  # (input shapes and dtypes, autocast) -> CheckpointPlan
        self.busy = False

    def __call__(self, module: nn.Module, args, kwargs):
        if self.busy or not (module.training and torch.is_grad_enabled()) or module in _TAKEN:
            return None
        budget = requested_budget(module)
        inputs = list(args) + list(kwargs.values())
        if budget is None or not all(x is None or isinstance(x, _PLAIN) for x in inputs):
            return None
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        if not tensors:
            return None
        key = tuple((tuple(t.shape), t.dtype) for t in tensors) + (torch.is_autocast_enabled(tensors[0].device.type),)
        plan = self.plans.get(key)
        if plan is None:
            plan = self._plan(module, _sample(module, args, kwargs), budget)
            self.plans[key] = plan
        if getattr(module, "checkpoint_plan", None) is not plan:
            module.enable_activation_checkpointing(layers=list(plan.layers))
            module.checkpoint_plan = plan
        return None

    def _plan(self, module: nn.Module, sample, budget: int):
        """Profile on ``sample``, agreed over the ranks sharing the layers' collectives, and solve."""
        from .autockpt_dist import collective_groups, plan_agreed

        self.busy = True
        try:
            # [] when no collective runs inside the layers; None (groups not findable): the world
            return plan_agreed(module, sample, budget, groups=collective_groups(module))
        finally:
            self.busy = False
