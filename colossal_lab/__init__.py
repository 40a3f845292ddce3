"""colossal-lab: train, fine-tune and serve large models from a notebook.

``cl.launch(n)`` starts ranks with torch.distributed up (on ipyparallel) and returns a
``cl.Cluster``; ``%load_ext colossal_lab`` adds the ``%colossal`` magics; ``cl.plan(model, plugin,
world_size=...)`` predicts the bytes per rank and tier before anything is launched;
``cl.autoplan(model, world_size=..., batch=...)`` searches the parallel layout.
"""
__version__ = "0.1.0"

from .cluster import Cluster, LaunchConfig, current_cluster  # noqa: E402
from .errors import RankError  # noqa: E402
from .launch import launch  # noqa: E402


def __getattr__(name: str):
    """``cl.plan`` / ``cl.FitPlan``, loaded on first use (the planner imports torch; importing the
    package must not). ``colossal_lab.plan`` is a callable module: ``cl.plan(...)`` runs the planner
    and ``cl.plan.measure`` is its meter, however it was imported first."""
    if name in ("plan", "FitPlan"):
        import importlib

        mod = importlib.import_module(f"{__name__}.plan")
        return mod if name == "plan" else mod.FitPlan
    if name == "autoshard":  # a callable module, as plan is: cl.autoshard(model, inputs, tp_size)
        return __import__(f"{__name__}.autoshard", fromlist=["autoshard"])
    if name in ("autoplan", "AutoPlan"):
        from . import autoparallel as mod

        return getattr(mod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_ipython_extension(ipython) -> None:
    """``%load_ext colossal_lab``: register the ``%colossal`` line/cell magics."""
    from .magics import ColossalMagics

    ipython.register_magics(ColossalMagics)


def unload_ipython_extension(ipython) -> None:
    mm = ipython.magics_manager
    for kind in ("line", "cell"):
        mm.magics[kind].pop("colossal", None)


__all__ = ["Cluster", "LaunchConfig", "RankError", "current_cluster", "launch", "plan", "FitPlan", "autoplan", "AutoPlan", "autoshard",
           "__version__",
           "load_ipython_extension", "unload_ipython_extension"]
