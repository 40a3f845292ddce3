"""Run one training step of a pipeline: microbatches in, losses and a measured timeline out.

The schedule is torch's (``torch.distributed.pipelining``); this module feeds it Colossal-AI's
data contract (a dict batch, ``criterion(outputs, batch) -> loss``: torch's loss function sees
``(output, target)``, so it gets ``target = arange(m)``, one index per microbatch, and looks that
microbatch's dict up), times the step (:mod:`.timing`) and gathers one ``telemetry.RankBusy``
per rank for its bubbles per rank and per stage. ``pp_size == 1`` runs the same microbatch loop
by hand (forward+loss = ``F``, backward = ``B``). Details: docs/hybrid.md, "Measured timelines".
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import comm
from ..device import to_device
from ..moe import aux_loss_scale
from ..telemetry import RankBusy, fractions_from_busy, rank_busy, stage_means
from .schedules import MULTI_STAGE_STYLES, ScheduleSpec
from .timing import SpanRecorder


def split_batch(batch: Dict[str, Any], m: int) -> List[Dict[str, Any]]:
    """``m`` equal microbatches of a dict batch (tensors split on dim 0, others copied)."""
    sizes = {k: v.shape[0] for k, v in batch.items() if isinstance(v, torch.Tensor)}
    if not sizes:
        raise ValueError("execute_pipeline: the batch holds no tensors to split into microbatches")
    bs = next(iter(sizes.values()))
    if any(s != bs for s in sizes.values()):
        raise ValueError(f"execute_pipeline: batch tensors disagree on the batch size: {sizes}")
    if bs % m:
        raise ValueError(f"execute_pipeline: batch size {bs} does not split into num_microbatches={m} "
                         f"equal microbatches; use a batch size that is a multiple of {m}")
    out = [dict() for _ in range(m)]
    for k, v in batch.items():
        parts = v.chunk(m, dim=0) if isinstance(v, torch.Tensor) else [v] * m
        for i in range(m):
            out[i][k] = parts[i]
    return out


class PipelineRuntime:
    """One rank's side of the pipeline: its stages, torch's schedule, and its recorder.

    ``rank`` is the global rank; ``pp_rank``, ``dp_rank`` and ``tp_rank`` its coordinates in the
    job's (dp, pp, tp) mesh, which its spans carry. Every rank of the job runs each step (the
    step's bubbles are gathered over all of them)."""

    def __init__(self, spec: ScheduleSpec, modules, stages, *, device: torch.device, rank: int, pp_rank: int,
                 pp_group, dp_rank: int = 0, tp_rank: int = 0, input_key: str = "idx",
                 loss_scale: Callable[[], float] = lambda: 1.0):
        self.spec = spec
        self.device = device
        self.modules = modules
        self.stages = stages
        self.pp_rank = pp_rank
        self.pp_group = pp_group
        self.input_key = input_key
        self.loss_scale = loss_scale
        self.recorder = SpanRecorder(rank=rank, stage=pp_rank, dp=dp_rank, tp=tp_rank)
        for st in stages:
            self.recorder.instrument(st)
        self.holds_first = any(s.is_first for s in stages) if stages else True
        self.holds_last = any(s.is_last for s in stages) if stages else True
        self._schedules: Dict[int, Any] = {}
        self._mbs: List[dict] = []
        self._criterion: Optional[Callable] = None
        self.step_index = 0
        self.last_bubble: Dict[int, float] = {}       # {stage: mean bubble over its ranks}
        self.last_rank_bubble: Dict[int, float] = {}  # {rank: bubble}, every rank of the job

    @property
    def criterion(self) -> Optional[Callable]:
        """The criterion of the step in progress (the last one run, between steps)."""
        return self._criterion

    @property
    def microbatches(self) -> List[dict]:
        """The microbatches of the step in progress, on this rank's device."""
        return self._mbs

    # ---- torch-facing loss -------------------------------------------------------------
    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        mb = int(target.reshape(-1)[0])
        loss = self._criterion(output, self._mbs[mb])
        self.recorder.extend_last_forward(time.time())
        scale = self.loss_scale()
        return loss * scale if scale != 1.0 else loss

    def _schedule(self, m: int):
        if m not in self._schedules:
            cls = self.spec.schedule_class()
            arg = self.stages if self.spec.style in MULTI_STAGE_STYLES else self.stages[0]
            self._schedules[m] = cls(arg, n_microbatches=m, loss_fn=self._loss_fn, scale_grads=True)
        return self._schedules[m]

    # ---- one step ----------------------------------------------------------------------
    def run(self, batch: Dict[str, Any], criterion: Callable, m: int,
            return_outputs: bool = False, stage_keys: Tuple[str, ...] = ()) -> Dict[str, Any]:
        """One step; ``stage_keys`` name the batch's entries every stage's forward takes as keyword
        arguments (split into microbatches by torch's schedule on dim 0, as :func:`split_batch` splits)."""
        if self.input_key not in batch:
            raise KeyError(f"execute_pipeline: batch has no {self.input_key!r} entry (keys: {sorted(batch)}); "
                           f"the first stage's input is batch[{self.input_key!r}]")
        self.recorder.step = self.step_index
        self._criterion = criterion
        batch = to_device(batch, self.device)  # batches are made wherever the user likes (CPU)
        self._mbs = split_batch(batch, m)
        losses: List[torch.Tensor] = []
        outputs = None
        if not self.stages:  # pp_size == 1: the microbatch loop by hand
            outputs = self._run_local(m, losses, return_outputs, stage_keys)
        else:
            sched = self._schedule(m)
            args = (batch[self.input_key],) if self.holds_first else ()
            target = torch.arange(m)
            try:
                with self.recorder.timing_p2p(), contextlib.ExitStack() as aux:
                    for mod in self.modules:  # the schedule divides every gradient by m: the aux losses weigh 1
                        aux.enter_context(aux_loss_scale(mod, self.loss_scale()))
                    out = sched.step(*args, target=target, losses=losses, return_outputs=return_outputs,
                                     **{k: batch[k] for k in stage_keys})
            finally:
                self.recorder.flush()  # a last-stage F whose loss never came
            if self.holds_last and return_outputs:
                outputs = out
        loss = None
        if self.holds_last and losses:
            loss = torch.stack([l.detach().float() for l in losses]).mean() / self.loss_scale()
        self.last_rank_bubble, self.last_bubble = self._bubble()
        self.step_index += 1
        return {"loss": loss, "outputs": outputs, "bubble": self.last_bubble,
                "rank_bubble": self.last_rank_bubble}

    def _run_local(self, m: int, losses: list, return_outputs: bool, stage_keys: Tuple[str, ...] = ()):
        (module,) = self.modules
        outs = []
        for i, mb in enumerate(self._mbs):
            # each microbatch's MoE auxiliary losses weigh 1/m, as its loss does (torch's schedules, with a
            # pipeline, divide every gradient by m after the step instead: there they keep weight 1)
            with self.recorder.timed("F", i), aux_loss_scale(module, self.loss_scale() / m):
                out = module(mb[self.input_key], **{k: mb[k] for k in stage_keys})
                loss = self._criterion(out, mb) * self.loss_scale()
            with self.recorder.timed("B", i):
                (loss / m).backward()
            losses.append(loss.detach())
            if return_outputs:
                outs.append(out.detach())
        return torch.cat(outs) if return_outputs else None

    def _bubble(self) -> Tuple[Dict[int, float], Dict[int, float]]:
        """This step's ``({rank: bubble}, {stage: mean bubble of its ranks})`` over every rank,
        from one gathered row per rank (a few numbers however many microbatches ran; float64
        carries the ``time.time()`` values exactly)."""
        mine = rank_busy(self.recorder.step_spans(self.step_index)).get(self.step_index, {})
        rank = self.recorder.rank
        if not comm.initialized() or dist.get_world_size() == 1:
            ranks = mine
        else:
            b = mine.get(rank)
            row = [1.0, *map(float, b)] if b is not None else [0.0] * (1 + len(RankBusy._fields))
            t = torch.tensor(row, dtype=torch.float64, device=comm.comm_device())
            parts = comm.all_gather([torch.empty_like(t) for _ in range(dist.get_world_size())], t)
            ranks = {}
            for r, part in enumerate(parts):
                has, stage, dp, tp, start, end, busy = part.tolist()
                if has:  # a rank with no span this step has nothing to measure
                    ranks[r] = RankBusy(int(stage), int(dp), int(tp), start, end, busy)
            for x in (t, *parts):
                comm.release(x)  # freed here, not whenever gloo's worker drops the all-gather
        fractions = fractions_from_busy(ranks)
        return fractions, stage_means(fractions, ranks)
