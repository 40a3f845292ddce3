"""Which memory model plans which plugin: a small ordered table of (plugin class, memory model),
searched with ``isinstance`` so a subclass of a plugin is planned as that plugin. A class that
subclasses another in the table goes before it. ``plugin=None`` (one process) has its own model.

A memory model is an ordinary callable ``model(m, plugin, env, precision, optimizer, ac) -> _Result``
over the traced model (``model._Model``) and the tiers (``env._Env``).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from .gemini import plan_gemini
from .hybrid import plan_hybrid
from .peaks import _Result
from .replicated import plan_ddp, plan_low_level_zero, plan_single


def _table() -> List[Tuple[type, Callable]]:
    from ...plugins import DDPPlugin, GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin

    return [(HybridParallelPlugin, plan_hybrid), (GeminiPlugin, plan_gemini),
            (LowLevelZeroPlugin, plan_low_level_zero), (DDPPlugin, plan_ddp)]


def memory_model(plugin) -> Optional[Callable]:
    """The memory model that plans ``plugin`` (None: no model knows it)."""
    if plugin is None:
        return plan_single
    return next((model for cls, model in _table() if isinstance(plugin, cls)), None)


def plugin_name(plugin) -> str:
    """How the plan names the plugin: its class name, or "None"."""
    return type(plugin).__name__ if plugin is not None else "None"


def _precision(plugin, precision: Optional[str]) -> str:
    """The precision the run will use: ``Booster(mixed_precision=...)`` when given, else the plugin's
    own where it controls precision (Booster's rule), else fp32."""
    from ...mixed_precision import PRECISIONS, resolve_precision

    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"cl.plan(precision={precision!r}): choose one of {list(PRECISIONS)} or None (the plugin's)")
    if getattr(plugin, "controls_precision", False):
        return resolve_precision(precision, plugin.precision, plugin_name(plugin))
    return precision or "fp32"


def _compose(m, plugin, env, precision: str, opt: str, ac: bool) -> _Result:
    return memory_model(plugin)(m, plugin, env, precision, opt, ac)
