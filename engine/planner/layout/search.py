"""``cl.autoplan``: the fastest layout that fits, chosen by a calibrated model and verified by runs.

The steps, over one :class:`_Search` (its state: the memory plans, the layouts run, the timers):

1. **Calibrate** (:mod:`.microbench`) on the ranks, or take an earlier search's calibration.
2. **Overhead probes**: two layouts that tell the overheads apart run for real
   (:func:`.probe.choose_probes`, among the plain layouts without tensor parallelism).
3. **Verify**: while runs remain (``max_probes``), run the layout the model, refitted on every
   run so far, ranks first among those that could fit, as long as its predicted time is within
   a margin of the best measured time (``verify_margin`` at first, then ``MARGIN_PER_ERROR`` times
   the model's largest error on the layouts verified, within ``[MIN_MARGIN, verify_margin]``).
   "Could fit": its planned peak, scaled by the measured ÷ planned peak of its closest kin that
   ran, within ``PLAN_TOLERANCE`` of the budget.
4. **Run-off** (:func:`.probe.runoff_pick`): the two fastest layouts run, when within the noise of
   each other, run once more each (runs kept back for it from ``max_probes``).
5. **Answer**: the fastest layout that fits: measured where it ran (its time, and its peak
   ``PEAK_MARGIN`` under the budget, ``PEAK_MARGIN_ZERO`` under ZeRO-1), modelled where it did not.

Memory is ``cl.plan``'s per-rank peak (fake tensors, nothing allocated), never less than the
whole model's bytes, which every rank holds once after building it and before ``boost()`` cuts it
(plus a stage's share under a pipeline: the stage is copied out). Planning costs fake-tensor
tracing, so only the layouts the search needs are planned: the overhead probes' pool, then, in
order of predicted time, each layout down to the first that fits (``plan_all=True`` or
``AutoPlan.fill_peaks`` for every row). Ranks come from a runner (:mod:`..runner`).
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ..memory.model import context_length
from .calibration import Calibration, SearchRecord, read_calibration, write_calibration
from .costs import Costs, features, fit_overheads, nd_traffic, overhead, predict
from .microbench import calibrate, merge_calibrations, what_to_time
from .probe import choose_probes, merge_probe, probe_step, runoff_pick
from .result import AutoPlan, ordered
from .space import Candidate, candidates, model_facts, width_of

# cl.plan's stated accuracy (docs/plan.md: each tier's peak within 10%): a layout planned up to this
# much over the budget may still fit, and verification may run it to see
PLAN_TOLERANCE = 0.10
# a layout that ran fits when its measured peak has this much headroom under the budget: the same
# layout's peak moves between runs (allocations on gloo's threads land at different moments)
PEAK_MARGIN = 0.02
# ... and under ZeRO-1 this much: its measured peaks spread wider (the parameters' asynchronous
# broadcasts and the gradients' all-reduce land at different moments of a step)
PEAK_MARGIN_ZERO = 0.08
# a layout planned this far under the budget is run without the profiler (its planned peak stands)
PLAN_HEADROOM = 0.15
# once layouts were verified, the margin is this many times the largest error the model made on
# them (never under MIN_MARGIN, never over ``verify_margin``): a model that proved close runs fewer
MARGIN_PER_ERROR, MIN_MARGIN = 1.5, 0.15


def autoplan(model_or_config, *, world_size: int, batch: int, seq: Optional[int] = None,
             device_memory: Optional[int] = None, host_memory: Optional[int] = None, cluster=None,
             calibration: Optional[Dict[str, Any]] = None, reps: int = 3, probe_steps: int = 3,
             max_probes: int = 7, verify_margin: float = 0.5, plan_all: bool = False, **space) -> AutoPlan:
    """Search the layouts of ``world_size`` ranks for the fastest predicted step that fits.

    ``batch``: samples per step over all data-parallel ranks; ``seq``: tokens per sample (default
    the config's ``block_size``); ``device_memory``: bytes per rank the step may peak at (None: no
    limit). ``cluster``: a running ``cl.Cluster`` of ``world_size`` ranks to calibrate on (None:
    one is launched for the calibration and stopped); ``calibration``: reuse an earlier
    ``AutoPlan.calibration`` instead. Called on every rank of an initialised process group (no
    ``cluster``), the ranks calibrate together and all return the same plan; ``reps``: timings per
    calibration probe; ``probe_steps``: timed steps of each layout run for real; ``max_probes``:
    runs of layouts at most (the overhead probes, verification and the run-off; 0 with a reused
    ``calibration`` and no ``cluster``: the model alone, plus what the calibration measured);
    ``verify_margin``: a layout is verified while predicted within this fraction of the best
    measured time. ``plan_all``: plan every layout's memory (a ``cl.plan`` fake-tensor trace each); by
    default only those the search needs: the overhead probes' pool and, in order of predicted
    time, every layout up to the first that fits; the rest show no planned peak
    (:meth:`AutoPlan.fill_peaks` plans them later). ``space``: narrows :func:`candidates` (``schedules``,
    ``microbatch_factors``, ``zero_stages``, ``activation_checkpointing``, ``tp_modes``)."""
    from .. import runner

    search = _Search(_job(model_or_config, world_size, batch, seq, device_memory, host_memory, cluster, space),
                     probe_steps)
    if plan_all:
        for c in search.job.cands:
            search.peak_of(c)
    started, memory_before = time.perf_counter(), search.seconds["memory"]
    cluster = _ranks_here(cluster, world_size)
    own = cluster is None and calibration is None
    if own:
        cluster = runner.launch(world_size)
    try:
        if calibration is None:
            search.calibrate(cluster, reps, max_probes)
        else:
            search.recall(calibration)
        search.model()
        if cluster is not None:
            search.verify(cluster, max_probes, verify_margin)
            search.runoff(cluster, max_probes)
    finally:
        if own:
            cluster.stop()
    return search.answer(started, memory_before)


@dataclass
class _Job:
    """What is searched: the model and its facts, the world, one step's shape, the budget."""

    model_or_config: Any
    world_size: int
    batch: int
    seq: int
    device_memory: Optional[int]
    host_memory: Optional[int]
    meta: Any  # the model on the meta device
    layers: int  # its pipeline units
    cands: List[Candidate]
    dims: Dict[str, int]  # predict()'s model dimensions
    built: int  # bytes of the whole model, which every rank holds once before boost() cuts it


def _job(model_or_config, world_size, batch, seq, device_memory, host_memory, cluster, space) -> _Job:
    """The search's fixed inputs, every argument checked before any work."""
    if device_memory is not None and not (isinstance(device_memory, int) and device_memory > 0):
        raise ValueError(f"autoplan(device_memory={device_memory!r}): bytes per rank, an int > 0 (or None)")
    meta, layers = model_facts(model_or_config)
    seq = seq if seq is not None else context_length(meta)
    if not isinstance(seq, int) or seq < 1:
        raise ValueError(f"autoplan(seq={seq!r}): tokens per sample, an int >= 1")
    width = width_of(meta)
    if width is None:
        raise ValueError("autoplan: the model needs a cfg with n_embd (the activation width) for the cost model, "
                         "or a transformers config with hidden_size")
    if cluster is not None and getattr(cluster, "n", world_size) != world_size:
        raise ValueError(f"autoplan(cluster=...): it has {cluster.n} ranks, world_size={world_size}; "
                         f"launch cl.launch(n={world_size}) or pass world_size={cluster.n}")
    cands = candidates(model_or_config, world_size, batch, **space)
    unique = {id(p): p for p in meta.parameters()}.values()
    params, tensors = sum(p.numel() for p in unique), len(unique)
    # every rank builds the whole model before boost() cuts it (as probe_step does, and a user who
    # calls model = GPT(cfg) on each rank): whatever the layout, a rank holds that much once
    built = sum(p.numel() * p.element_size() for p in unique) + sum(b.numel() * b.element_size()
                                                                   for b in meta.buffers())
    dims = dict(batch=batch, seq=seq, n_embd=width, layers=layers, params=params, tensors=tensors,
                experts=_experts(meta))
    return _Job(model_or_config, world_size, batch, seq, device_memory, host_memory, meta, layers, cands, dims,
                built)


def _experts(meta) -> Optional[Dict[str, int]]:
    """A mixture-of-experts model's figures for the step model (``costs.predict``), None for a dense one."""
    from ..memory.experts import moe_layers

    layers = moe_layers(meta)
    if not layers:
        return None
    params = dict(meta.named_parameters())
    names = {p for layer in layers for p in layer.params}
    return {"params": sum(params[n].numel() for n in names if n in params), "layers": len(layers),
            "top_k": layers[0].top_k, "n_expert": layers[0].n_expert}


def _ranks_here(cluster, world_size: int):
    """The runner to use: the one given; else, called on every rank of a process group, those
    ranks themselves; else None (one is launched when needed)."""
    import torch.distributed as dist

    from .. import runner

    if cluster is None and dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(f"autoplan(world_size={world_size}): this process group has "
                             f"{dist.get_world_size()} ranks; plan for those")
        cluster = runner.InProcess()  # every rank is here: calibrate and probe together
    return cluster


class _Search:
    """One search's state: the memory plans (``peaks``), the figures and the record of layouts run,
    the modelled step of every layout, the model's errors on the layouts verified, and the
    seconds spent planning memory and running layouts."""

    def __init__(self, job: _Job, probe_steps: int):
        from ..memory import TraceCache

        self.job, self.probe_steps = job, probe_steps
        self.traces = TraceCache()  # cl.plan's traces, shared by the layouts with the same per-rank batch
        self.peaks: Dict[Candidate, Tuple[int, bool]] = {}
        self.seconds = {"memory": 0.0, "runs": 0.0}
        self.figures: Optional[Calibration] = None
        self.record = SearchRecord()
        self.modelled: Dict[Candidate, Dict[str, float]] = {}
        self.errors: List[float] = []  # |measured / predicted - 1| of each layout verification ran

    @property
    def measured(self) -> Dict[Candidate, Dict[str, Any]]:
        return self.record.measured

    @contextlib.contextmanager
    def _clock(self, what: str) -> Iterator[None]:
        t = time.perf_counter()
        yield
        self.seconds[what] += time.perf_counter() - t

    # ---- memory

    def peak_of(self, c: Candidate) -> Tuple[int, bool]:
        """``(planned peak bytes, fits)`` of layout ``c``, planned on first use."""
        if c in self.peaks:
            return self.peaks[c]
        job = self.job
        with self._clock("memory"):
            # N-d layouts too: cl.plan traces a rank's grid-form layers on a fake process group
            fp = self.traces.plan(job.model_or_config, c.plugin(), world_size=job.world_size,
                                  batch=job.batch // c.dp, seq=job.seq, device_memory=job.device_memory,
                                  host_memory=job.host_memory)
            # splitting a pipeline stage copies that stage while the built model is still alive
            peak = max(fp.peak(fp.tiers[0]), job.built + (job.built // c.pp if c.pp > 1 else 0))
            self.peaks[c] = (peak, fp.fits and (job.device_memory is None or peak <= job.device_memory))
        return self.peaks[c]

    def fits(self, c: Candidate) -> bool:
        """Measured where it ran with the profiler, else planned (on first use)."""
        peak = self.measured[c]["peak"] if c in self.measured else None
        if peak is not None:
            margin = PEAK_MARGIN_ZERO if c.zero_stage else PEAK_MARGIN
            return self.job.device_memory is None or peak * (1 + margin) <= self.job.device_memory
        return self.peak_of(c)[1]

    def _ratio(self, c: Candidate) -> float:
        """Measured ÷ planned peak of the closest layout that ran: the same shape (dp, tp, pp,
        schedule, mode), else the same dp × tp × pp, else the median of all (1 before any)."""
        def r(x):
            return self.measured[x]["peak"] / self.peaks[x][0]

        sized = [x for x in self.measured if self.measured[x]["peak"] is not None and self.peak_of(x)[0] > 0]
        for key in (lambda x: (x.dp, x.tp, x.pp, x.pp_style, x.num_microbatches, x.tp_mode),
                    lambda x: (x.dp, x.tp, x.pp)):
            near = [r(x) for x in sized if key(x) == key(c)]
            if near:
                return max(near)
        return statistics.median([r(x) for x in sized] or [1.0])

    def _could_fit(self, c: Candidate) -> bool:
        """Planned within ``PLAN_TOLERANCE`` of the budget, scaled as its closest kin ran."""
        budget = self.job.device_memory
        return budget is None or self.peak_of(c)[0] * self._ratio(c) <= budget * (1 + PLAN_TOLERANCE)

    # ---- the figures

    def calibrate(self, cluster, reps: int, max_probes: int) -> None:
        """Measure the figures on the ranks, then run the overhead probes: layouts that tell the
        framework's overheads apart, chosen among the plain layouts without tensor parallelism when
        there are any (only those need a memory plan now)."""
        job = self.job
        per_rank = cluster.run(calibrate, job.model_or_config, job.seq, *what_to_time(job.cands, job.batch, job.seq),
                               reps)
        self.figures = Calibration.of(merge_calibrations(per_rank))
        plain = [c for c in job.cands if not c.activation_checkpointing and c.zero_stage == 0]
        pool = [c for c in plain if c.tp == 1] or plain or job.cands
        for c in choose_probes([{"candidate": c, "fits": self.peak_of(c)[1]} for c in pool], job.layers):
            if len(self.measured) < max_probes:
                self.run(cluster, c)

    def recall(self, calibration: Dict[str, Any]) -> None:
        """An earlier search's figures, and its runs of the layouts in this search's space."""
        self.figures, self.record = read_calibration(calibration)
        known = set(self.job.cands)
        self.record.measured = {c: v for c, v in self.record.measured.items() if c in known}

    def model(self) -> None:
        """Every layout's modelled step, before overheads."""
        job, costs = self.job, Costs(self.figures)
        nd = {c: nd_traffic(job.meta, c, job.batch, job.seq) for c in job.cands}
        self.modelled = {c: predict(c, costs, **job.dims, nd_bytes=nd[c][0], nd_calls=nd[c][1]) for c in job.cands}

    def refit(self) -> List[float]:
        """The overheads' coefficients, fitted to what the model did not explain of every run."""
        probed = list(self.measured)
        if not probed:
            return list(self.record.overheads or [0.0, 0.0, 0.0])
        return fit_overheads([features(c, self.job.layers) for c in probed],
                             [self.measured[c]["seconds"] - self.modelled[c]["total"] for c in probed])

    def estimate(self, over: List[float]) -> Dict[Candidate, float]:
        """Seconds per layout: measured where it ran, else the model's."""
        return {c: self.measured[c]["seconds"] if c in self.measured else
                self.modelled[c]["total"] + overhead(over, c, self.job.layers) for c in self.job.cands}

    # ---- runs

    def run(self, cluster, c: Candidate) -> None:
        """Layout ``c`` run for real; its peak measured only when planned near the budget (the
        profiler costs time; cl.plan's error is a few percent)."""
        job = self.job
        near = job.device_memory is not None and self.peak_of(c)[0] > job.device_memory * (1 - PLAN_HEADROOM)
        with self._clock("runs"):
            self.measured[c] = merge_probe(cluster.run(probe_step, job.model_or_config, asdict(c), job.batch,
                                                       job.seq, self.probe_steps, near))

    def _runoff_pair(self) -> List[Candidate]:
        return runoff_pick({c: v["seconds"] for c, v in self.measured.items()}, self.fits)

    def verify(self, cluster, max_probes: int, verify_margin: float) -> None:
        """Run the layout the model ranks first among those that could fit, while it could beat the
        best layout measured so far; runs for the run-off the measured layouts need are kept back."""
        while len(self.measured) + len(self._runoff_pair()) < max_probes:
            est = self.estimate(self.refit())
            best_run = min((est[c] for c in self.measured if self.fits(c)), default=math.inf)
            margin = (min(verify_margin, max(MIN_MARGIN, MARGIN_PER_ERROR * max(self.errors))) if self.errors
                      else verify_margin)
            # fastest first; memory planned only down to the first that could fit
            pick = next((c for c in sorted(self.job.cands, key=est.get) if c not in self.measured
                         and est[c] < best_run * (1 + margin) and self._could_fit(c)), None)
            self.record.margin = margin  # the last stop decision's (rows not run are that much slower)
            if pick is None:
                break
            self.run(cluster, pick)
            self.errors.append(abs(self.measured[pick]["seconds"] / est[pick] - 1))

    def runoff(self, cluster, max_probes: int) -> None:
        """Two layouts measured within the noise of each other run once more each and keep their
        faster run (inside ``max_probes``: verification kept the runs back)."""
        pair = self._runoff_pair()
        pair = pair if len(self.measured) + len(pair) <= max_probes else []
        for c in pair:
            with self._clock("runs"):
                again = merge_probe(cluster.run(probe_step, self.job.model_or_config, asdict(c), self.job.batch,
                                                self.job.seq, self.probe_steps, False))
            m = self.measured[c]
            m["runs"] = m.get("runs", [m["seconds"]]) + [again["seconds"]]
            m["seconds"] = min(m["runs"])
        self.record.runoff = [c.label for c in pair]

    # ---- the answer

    def answer(self, started: float, memory_before: float) -> AutoPlan:
        """The fastest layout that fits (memory planned in order of time, down to it), and every
        layout's row. ``started``: when the calibration began (its seconds are what neither the
        layouts run nor the memory plans on the way took)."""
        job = self.job
        over = self.refit()
        self.record.overheads = over
        est = self.estimate(over)
        best = next((c for c in sorted(job.cands, key=est.get) if self.fits(c)), None)
        t_cal = time.perf_counter() - started - (self.seconds["memory"] - memory_before) - self.seconds["runs"]
        rows = [self._row(c, over, est) for c in job.cands]
        return AutoPlan(ordered(rows), best, job.world_size, job.batch, job.seq, job.device_memory,
                        write_calibration(self.figures, self.record),
                        {"memory": self.seconds["memory"], "calibration": t_cal, "runs": self.seconds["runs"]},
                        _fits=self.fits, _peak_of=self.peak_of)

    def _row(self, c: Candidate, over: List[float], est: Dict[Candidate, float]) -> Dict[str, Any]:
        parts = dict(self.modelled[c])
        parts["overhead"] = overhead(over, c, self.job.layers)
        parts["total"] += parts["overhead"]
        m = self.measured.get(c)
        return {"label": c.label, "candidate": c, "predicted_s": parts["total"], "seconds": est[c],
                "tokens_per_s": self.job.batch * self.job.seq / est[c], "parts": parts,
                "peak_bytes": self.peaks[c][0] if c in self.peaks else None,
                "measured_s": m["seconds"] if m else None, "measured_peak": m["peak"] if m else None,
                "fits": self.fits(c) if c in self.peaks or (m and m["peak"] is not None) else None}
