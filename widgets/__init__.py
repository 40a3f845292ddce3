"""ipywidgets/plotly views that turn telemetry events into pictures.

    from colossal_lab.widgets import ChunkMap, PipelineTimeline, MemoryGauges, Dashboard, FitPlan, CheckpointPlanView
    dash = Dashboard()                      # listens to this process's telemetry bus
    FitPlan(cl.plan(cfg, plugin, world_size=2))   # predicted bytes per rank x tier; measured peaks on top
    CheckpointPlanView.from_trace("run.jsonl")    # per block: what recomputes, bytes kept, the budget
    ExpertLoadView.from_trace("run.jsonl")        # per MoE layer: tokens per expert x step, dropped
    dash                                    # live widget in JupyterLab; static figure elsewhere
    PipelineTimeline.from_trace("run.jsonl").export_chrome_trace("run.trace.json")

Each view: a no-argument constructor that subscribes to ``telemetry.subscribe``;
``from_trace(path)``; ``.figure`` (a plotly figure, built on read from the plain dict the live path
sends); ``feed(event)`` / ``update(events)``; ``close()``. Only telemetry event types, plotly and
ipywidgets are imported here (DESIGN.md).
"""

from ._live import display_mode, set_display_mode, widget_frontend_present
from .checkpoint_plan import CheckpointPlanView, checkpoint_plan_dict, checkpoint_plan_figure
from .chunk_map import ChunkMap, chunk_map_dict, chunk_map_figure
from .dashboard import Dashboard, metrics_dict, metrics_figure
from .expert_load import ExpertLoadView, expert_load_dict, expert_load_figure
from .fit_plan import FitPlan, fit_plan_dict, fit_plan_figure
from .gauges import MemoryGauges, gauges_dict, gauges_figure
from .timeline import PipelineTimeline, timeline_dict, timeline_figure

__all__ = ["ChunkMap", "PipelineTimeline", "MemoryGauges", "Dashboard", "FitPlan", "chunk_map_figure",
           "timeline_figure", "gauges_figure", "metrics_figure", "chunk_map_dict", "timeline_dict",
           "gauges_dict", "metrics_dict", "fit_plan_dict", "fit_plan_figure", "set_display_mode",
           "display_mode", "widget_frontend_present", "CheckpointPlanView", "checkpoint_plan_dict",
           "checkpoint_plan_figure", "ExpertLoadView", "expert_load_dict", "expert_load_figure"]
