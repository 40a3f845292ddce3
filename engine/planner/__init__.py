"""The planners: what fits and which layout is fastest, before (or while) anything runs.

| name | question | module |
|---|---|---|
| :func:`plan` (``cl.plan``) | will this model, plugin and world size fit, per rank and tier? | ``memory`` |
| :func:`autoplan` (``cl.autoplan``) | which dp × tp × pp layout is fastest within a memory budget? | ``layout`` |
| :func:`autoshard` (``cl.autoshard``) | which strategy for each linear under tensor parallelism? | ``shard`` |

They import the engine and never the notebook front; what needs ranks (calibration, probes) takes
a runner (``runner.py``: anything with ``run(fn, *args)``, ``cl.Cluster`` among them).
"""
_HOME = {"plan": "memory", "FitPlan": "memory", "TraceCache": "memory", "measure": "memory",
         "autoplan": "layout", "AutoPlan": "layout", "autoshard": "shard", "ShardPlan": "shard"}


def __getattr__(name: str):
    # loaded on first use: the planners import torch, ``runner`` (which the front imports) must not
    if name in _HOME:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AutoPlan", "FitPlan", "ShardPlan", "TraceCache", "autoplan", "autoshard", "measure", "plan"]
