"""``cl.plan``: will it fit? Bytes per rank and tier, predicted before anything is launched.

    plan = cl.plan(GPTConfig.preset("small"), GeminiPlugin(placement_policy="auto",
                   device_memory_limit=64 << 20, nvme_offload_dir="/scratch"),
                   world_size=2, batch=8, seq=256)
    plan.fits, plan.advice          # bool, list of concrete changes
    plan                            # a table: rank group x tier x category, capacity, fits
    plan.to_dict()                  # plain data (what colossal_lab.widgets.FitPlan draws)

``cl.plan`` is :func:`plan` (``cl.plan.measure`` its meter, ``cl.plan.FitPlan`` its result);
``import colossal_lab`` stays free of torch until the planner is first touched.

The model is never allocated: its parameters become meta tensors and one training step runs on
fake tensors, followed storage by storage, which gives the activations and gradients op by op
(``model.py``, ``trace.py``; N-d tensor parallelism on a fake process group, ``nd.py``). Each
plugin's own allocations are read off its code and laid over that trace by its memory model, found
by ``isinstance`` (``dispatch.py``): ``replicated.py`` (None, DDP, ZeRO-1), ``fsdp.py`` (ZeRO-2),
``gemini.py`` with ``gemini_backward.py`` (Gemini's chunks, packed and homed by the engine's own
functions), ``hybrid.py`` (pipeline stages, tensor shards, microbatches in flight). ``peaks.py``
composes a peak from a trace, ``env.py`` sizes the tiers, ``result.py`` is the plan's plain data,
``advice.py`` what to change when it does not fit, ``api.py`` the entry points. ``meter.py``
measures the real thing. ``docs/plan.md`` has the measured table and what is not modelled.
"""

from .api import TraceCache, plan
from .meter import measure
from .model import _meta_model as _meta_model  # re-exported for the layout search
from .result import CATEGORIES, TIERS, FitPlan, RankPlan, TierPlan
from .result import _fmt as _fmt  # re-exported: how the plan writes bytes

# ``cl.plan.measure`` / ``cl.plan.FitPlan``: the meter and the result type, reached from the planner itself
plan.measure = measure
plan.FitPlan = FitPlan

__all__ = ["CATEGORIES", "FitPlan", "RankPlan", "TIERS", "TierPlan", "TraceCache", "measure", "plan"]
