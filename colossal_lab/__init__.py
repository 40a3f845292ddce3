"""colossal-lab: train, fine-tune and serve large models from a notebook.

``cl.launch(n)`` starts ranks with torch.distributed up (on ipyparallel) and returns a
``cl.Cluster``; ``%load_ext colossal_lab`` adds the ``%colossal`` magics; ``cl.plan(model, plugin,
world_size=...)`` predicts the bytes per rank and tier before anything is launched.
"""
__version__ = "0.1.0"

from .cluster import Cluster, LaunchConfig, current_cluster  # noqa: E402
from .errors import RankError  # noqa: E402
from .launch import launch  # noqa: E402
from .plan import FitPlan, plan  # noqa: E402  (``colossal_lab.plan`` is then the function)


def load_ipython_extension(ipython) -> None:
    """``%load_ext colossal_lab``: register the ``%colossal`` line/cell magics."""
    from .magics import ColossalMagics

    ipython.register_magics(ColossalMagics)


def unload_ipython_extension(ipython) -> None:
    mm = ipython.magics_manager
    for kind in ("line", "cell"):
        mm.magics[kind].pop("colossal", None)


__all__ = ["Cluster", "LaunchConfig", "RankError", "current_cluster", "launch", "plan", "FitPlan", "__version__",
           "load_ipython_extension", "unload_ipython_extension"]
