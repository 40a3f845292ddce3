"""``cl.autoplan``: search the parallel layout, with a cost model calibrated on this machine.

    best = cl.autoplan(GPTConfig.preset("small"), world_size=4, batch=16, seq=256,
                       device_memory=512 << 20, cluster=cluster)
    best                        # a table: every candidate, predicted step time, peak, fits
    plugin = best.plugin()      # the chosen HybridParallelPlugin
    best.rows, best.to_dict()   # plain data; best.calibration: what was measured

| module | what |
|---|---|
| ``space`` | the search space: :class:`Candidate`, :func:`candidates` |
| ``microbench`` | the step-time model's constants, measured on ranks: :func:`calibrate`, :func:`merge_calibrations` |
| ``calibration`` | those figures (:class:`Calibration`), a search's bookkeeping (:class:`SearchRecord`), as dicts too |
| ``costs`` | the step-time model: :class:`Costs`, :func:`predict`, :func:`nd_traffic`, |
| | and the overheads' :func:`features` and :func:`fit_overheads` |
| ``probe`` | layouts really run: :func:`probe_step`, :func:`merge_probe`, :func:`choose_probes`, :func:`runoff_pick` |
| ``search`` | :func:`autoplan`: calibrate, probe, verify, run-off, answer |
| ``result`` | :class:`AutoPlan` |

The model ranks, the machine decides: the layouts the model ranks first are run for real, and
the answer is the fastest that fits, measured where it ran. Built on ``cl.plan`` (memory),
torch.distributed collectives (calibration), the engine's ``Booster`` (probes) and the model
contract (``tp_plan``, ``check_tp``, ``num_layers``, ``tp_nd_plan``). The layout is per model, as
torchtitan plans it; Colossal-AI's per-operator strategies on a torch.fx graph are
``cl.autoshard`` (``colossal_lab.engine.planner.shard``), whose ``tp_plan()`` a layout's
``HybridParallelPlugin(tp_plan=...)`` takes. docs/autoplan.md has the model, and what it was
measured against.
"""
from .calibration import Calibration, SearchRecord
from .costs import Costs, features, fit_overheads, nd_traffic, predict
from .microbench import calibrate, merge_calibrations
from .probe import RUNOFF, choose_probes, merge_probe, probe_step, runoff_pick
from .result import AutoPlan
from .search import MARGIN_PER_ERROR, MIN_MARGIN, PEAK_MARGIN, PEAK_MARGIN_ZERO, PLAN_HEADROOM, PLAN_TOLERANCE, autoplan
from .space import SCHEDULES, Candidate, candidates

__all__ = ["AutoPlan", "Calibration", "Candidate", "Costs", "SearchRecord", "autoplan", "calibrate", "candidates",
           "choose_probes", "features", "fit_overheads", "merge_calibrations", "merge_probe", "nd_traffic", "predict",
           "probe_step", "runoff_pick", "MARGIN_PER_ERROR", "MIN_MARGIN", "PEAK_MARGIN", "PEAK_MARGIN_ZERO",
           "PLAN_HEADROOM", "PLAN_TOLERANCE", "RUNOFF", "SCHEDULES"]
