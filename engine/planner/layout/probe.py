"""Layouts run for real: a probe boosts one layout on the ranks and times a few training steps.

The search runs probes to learn what the step-time model leaves out (:func:`choose_probes`: the
layouts that tell the overheads apart) and to verify the layouts the model ranks first; the
machine, not the model, has the last word. :func:`merge_probe` makes one figure of the ranks'
(a step lasts as long as its slowest rank; the fastest step counts, since other work on a shared
machine only ever adds time), :func:`runoff_pick` the two layouts to run again when their
measured times are within a probe's noise of each other.

Built on the engine's ``Booster`` and ``HybridParallelPlugin`` and ``cl.plan.measure`` (the peak of
live tensor bytes).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Dict, List, Sequence

from .costs import features
from .space import Candidate

# the run-off: when the runner-up among the layouts run is measured within this of the fastest,
# both run once more and each keeps its faster run (a shared box's slow periods outlast a
# probe's steps)
RUNOFF = 0.10


def probe_step(model_or_config, cand: dict, batch: int, seq: int, steps: int = 3,
               measure_peak: bool = True) -> Dict[str, Any]:
    """On every rank: boost layout ``cand`` on a real model and train it: model build, boost and
    two steps, under ``cl.plan.measure`` for its peak bytes with ``measure_peak`` (the second step
    is training's steady state: the optimizer's state exists beside its activations; without
    ``measure_peak`` one warm-up step), then
    ``steps`` timed ones. Returns ``{"peak": bytes or None, "step_seconds": [s, ...]}`` for this
    rank (:func:`merge_probe` makes one figure of the ranks': a step waits for its slowest rank)."""
    with _own_garbage():
        return _probe(model_or_config, cand, batch, seq, steps, measure_peak)


def _probe(model_or_config, cand: dict, batch: int, seq: int, steps: int, measure_peak: bool) -> Dict[str, Any]:

    import torch
    import torch.nn.functional as F

    from ... import Booster, comm
    from ...models.hf import is_hf_model
    from ..memory import measure
    from .microbench import logits_of
    from .space import build_model, vocab_of

    c = Candidate(**cand)

    def crit(out, b):
        return F.cross_entropy(logits_of(out).flatten(0, 1).float(), b["targets"].flatten())

    meter = measure() if measure_peak else contextlib.nullcontext()
    with meter:
        torch.manual_seed(0)
        model = build_model(model_or_config)
        vocab = vocab_of(model)
        # a transformers model takes HF batches and its own loss (the engine's contract for it, docs/hf.md)
        hf = is_hf_model(model)
        loss_fn = None if hf else crit
        plugin = c.plugin()
        booster = Booster(plugin=plugin)
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn)
        x = torch.randint(0, vocab, (batch // c.dp, seq), generator=torch.Generator().manual_seed(0))
        feed = {"input_ids": x, "labels": x} if hf else {"idx": x, "targets": x}

        def step():
            booster.execute_pipeline(iter([feed]), model, loss_fn, opt)
            opt.step()
            opt.zero_grad()

        step()  # the warm-up: first-call costs (allocations, the schedule's set-up)
        if measure_peak:
            step()  # training's steady state: the optimizer's state beside the activations (not in step 1)
    peak = int(max(meter.peak.values(), default=0)) if measure_peak else None
    times = []  # the measured step was the warm-up (a median over the steps shrugs off a slow one)
    for _ in range(steps):
        comm.barrier()  # every rank starts the step together: its time is the step's, not a wait
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    plugin.close()  # its process groups: a search boosts many layouts on the same ranks
    return {"peak": peak, "step_seconds": times}


@contextlib.contextmanager
def _own_garbage():
    """Around a probe: cyclic garbage from before it (an earlier probe's model, held in reference
    cycles) is not freed inside it, and its own is freed when it ends. The peak counts live bytes
    from the window's start, so garbage freed inside the window would hide the layout's own. The
    objects from before are frozen meanwhile (``gc.freeze``): the automatic collections inside
    cannot free them, and the final collection scans only what the probe made (a full collection
    on a rank with torch imported costs more than a small model's probe). Where someone else froze
    objects, their freeze is left alone and full collections run instead."""
    import gc

    mine = gc.get_freeze_count() == 0
    if mine:
        gc.freeze()
    else:
        gc.collect()
    try:
        yield
    finally:
        gc.collect()
        if mine:
            gc.unfreeze()


def merge_probe(per_rank: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    """One probe's figures for the job: per step the slowest rank's seconds (the step's length:
    every rank started it together), the fastest of those steps, and the largest peak. The
    fastest, not the median: on a shared machine other work only ever adds time to a step, so the
    least is the layout's own (the median of a few steps moves with slow periods). ``median`` is
    kept beside it."""
    steps = [max(r["step_seconds"][i] for r in per_rank) for i in range(len(per_rank[0]["step_seconds"]))]
    peaks = [r["peak"] for r in per_rank if r["peak"] is not None]
    return {"seconds": min(steps), "median": statistics.median(steps), "peak": max(peaks) if peaks else None}


def runoff_pick(seconds: Dict[Any, float], fits: Callable[[Any], bool], within: float = RUNOFF) -> List[Any]:
    """The layouts to run once more before choosing: the fastest measured layout that fits and its
    runner-up, when the runner-up is within ``within`` of it (the order a probe's noise can swap);
    else none. Runner-up first, so the leader runs last."""
    ranked = sorted((c for c in seconds if fits(c)), key=seconds.get)
    if len(ranked) >= 2 and seconds[ranked[1]] <= seconds[ranked[0]] * (1 + within):
        return [ranked[1], ranked[0]]
    return []


def choose_probes(rows: Sequence[Dict[str, Any]], layers: int, widest_tp: bool = False) -> List[Candidate]:
    """Layouts that tell the overheads apart: the fewest scheduled actions without tensor
    parallelism and the most (from the layouts that fit when there are any: a probe must not run
    out of memory); the widest tensor parallelism too with ``widest_tp``, or when every layout
    has it. :func:`autoplan` leaves the tensor-parallel probe to its verification: it runs a
    tensor-parallel layout when the model ranks one near the top, and the fit then learns its
    overhead, rather than paying for one up front that the model would not have chosen."""
    pool = [r["candidate"] for r in rows if r["fits"]] or [r["candidate"] for r in rows]
    plain = [c for c in pool if not c.activation_checkpointing and c.zero_stage == 0] or pool
    out: List[Candidate] = []
    no_tp = [c for c in plain if c.tp == 1]
    if no_tp:
        out.append(min(no_tp, key=lambda c: features(c, layers)[1]))
        out.append(max(no_tp, key=lambda c: features(c, layers)[1]))
    with_tp = [c for c in plain if c.tp > 1]
    if with_tp and (widest_tp or not no_tp):
        wide = max(c.tp for c in with_tp)
        out.append(min((c for c in with_tp if c.tp == wide), key=lambda c: features(c, layers)[1]))
    return list(dict.fromkeys(out))
