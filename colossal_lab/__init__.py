"""colossal-lab: train, fine-tune and serve large models from a notebook.

``cl.launch(n)`` starts ranks with torch.distributed up (on ipyparallel) and returns a
``cl.Cluster``; ``%load_ext colossal_lab`` adds the ``%colossal`` magics; ``cl.plan(model, plugin,
world_size=...)`` predicts the bytes per rank and tier before anything is launched;
``cl.autoplan(model, world_size=..., batch=...)`` searches the parallel layout.
"""
__version__ = "0.1.0"

from .cluster import Cluster, LaunchConfig, current_cluster  # noqa: E402
from .errors import EngineStartError, LauncherSetupError, RankError  # noqa: E402
from .launch import launch  # noqa: E402


def __getattr__(name: str):
    """``cl.plan``, ``cl.autoplan``, ``cl.autoshard`` and their result types, loaded on first use
    (the planners live in the engine, ``colossal_lab.engine.planner``, and import torch; importing
    this package must not)."""
    if name in ("plan", "FitPlan", "autoplan", "AutoPlan", "autoshard", "ShardPlan"):
        from .engine import planner

        return getattr(planner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _launch_for_planner(n: int):
    """What the engine's planners call when a search needs ranks and was given none."""
    return launch(n=n, threads=1)


def _register_launcher() -> None:
    # the engine cannot import the front, so the front hands it a launcher (without importing torch)
    try:
        from .engine.planner import runner
    except ImportError:  # a torch below the engine's floor: the planners cannot run anyway
        return
    runner.set_launcher(_launch_for_planner)


_register_launcher()


def load_ipython_extension(ipython) -> None:
    """``%load_ext colossal_lab``: register the ``%colossal`` line/cell magics."""
    from .magics import ColossalMagics

    ipython.register_magics(ColossalMagics)


def unload_ipython_extension(ipython) -> None:
    mm = ipython.magics_manager
    for kind in ("line", "cell"):
        mm.magics[kind].pop("colossal", None)


__all__ = ["Cluster", "LaunchConfig", "RankError", "LauncherSetupError", "EngineStartError",
           "current_cluster", "launch",
           "plan", "FitPlan", "autoplan", "AutoPlan", "autoshard",
           "__version__",
           "load_ipython_extension", "unload_ipython_extension"]
