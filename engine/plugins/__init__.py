"""Booster plugins: DDP, ZeRO-1/2, Gemini, hybrid parallel.

Imported lazily so that importing one plugin never pulls in another's dependencies.
"""

import importlib

_WHERE = {
    "Plugin": ".base",
    "DDPPlugin": ".ddp",
    "LowLevelZeroPlugin": ".low_level_zero",
    "GeminiPlugin": ".gemini",
    "HybridParallelPlugin": ".hybrid_parallel",
}

__all__ = list(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
