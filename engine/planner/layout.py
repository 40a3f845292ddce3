"""``cl.autoplan`` (this module: ``colossal_lab.engine.planner.layout``): search the parallel layout, with a cost model calibrated on this machine.

    best = cl.autoplan(GPTConfig.preset("small"), world_size=4, batch=16, seq=256,
                       device_memory=512 << 20, cluster=cluster)
    best                        # a table: every candidate, predicted step time, peak, fits
    plugin = best.plugin()      # the chosen HybridParallelPlugin
    best.rows, best.to_dict()   # plain data; best.calibration: what was measured

Search space (:func:`candidates`): every ``dp × tp × pp = world_size`` the model allows (its
``check_tp``, its layer count for the stages), the pipeline schedule (``1f1b``, ``interleaved``
with two model chunks; GPipe is left out: same time as 1F1B, more memory), microbatches
(``pp`` or ``2·pp`` per step), ZeRO stage 0/1 (1 only without tensor parallelism), activation
checkpointing off/on, and the tensor-parallel mode: 1D (Megatron), and 2D, 2.5D (every depth)
and 3D for a model with the contract's ``tp_nd_plan()``, where ``tp`` forms the mode's grid, the
heads split over its hidden cut and each microbatch's rows over its batch cut. An N-d layout's
memory is ``cl.plan``'s (which traces the grid-form layers on a fake process group), its traffic
``tp_nd.volume.textbook``'s (:func:`nd_traffic`).

Memory: each candidate's per-rank peak comes from ``cl.plan`` (fake tensors, nothing allocated),
and is never less than the whole model's bytes, which every rank holds once after building it
and before ``boost()`` cuts it (plus a stage's share under a pipeline: the stage is copied out);
a candidate over ``device_memory`` is kept in the table but never chosen. A layout the search
ran (below) is judged by its measured peak instead. A plan costs ~0.1-0.2 s of fake-tensor
tracing, so only the layouts the search needs are planned: the overhead probes' pool, then, in
order of predicted time, each layout down to the first that fits (``plan_all=True`` or
:meth:`AutoPlan.fill_peaks` for every row).

Time: a model of one step, its constants measured on the ranks that will train (all of them at
once, so a CPU box's shared cores and a GPU box's links are what is measured), by
:func:`calibrate`, in seconds:

* compute: the model's forward and forward+backward at two microbatch sizes, with every linear
  of its ``tp_plan()`` cut to a tensor-parallel rank's shape, for each tp size; a straight line in
  tokens between them. A stage of ``pp`` runs ``1/pp`` of it (``1/(pp·v)`` per model chunk).
* collectives: ``all_reduce`` at 1 KiB (latency), 64 KiB and 4 MiB on groups of each size the
  candidates use (the world cut into such groups, all busy at once), piecewise linear between;
  point-to-point send/recv between rank pairs at two sizes.
* contention: the largest forward+backward again on rank 0 alone while the others wait; the
  ratio is how much faster a rank computes when the others idle (~2 for 4 CPU ranks on 2 cores,
  1 with a device per rank).
* the optimizer: AdamW's step per parameter element.

A step is then (``m`` microbatches, ``pp`` stages, ``v`` model chunks per stage, the times those of
one microbatch on one rank, i.e. ``1/pp`` of the model): ``(m + (pp-1)/v) · (t_F + t_B + AC·t_F +
TP comm + 2·v·p2p)`` with the compute at the speed of a rank alone (the bubble's idle ranks
leave their cores to the busy ones), but never less than ``m ·`` the same with every rank busy
(the work itself); with a device per rank both are the plain formula. Plus the data-parallel
gradient all-reduce (ZeRO-1: and the parameters' broadcast, one collective per parameter tensor as
``ZeroRedundancyOptimizer`` issues them), plus the optimizer step over this
rank's parameters (ZeRO-1: its ``1/dp`` share). Tensor parallelism (1D, Megatron) costs two
all-reduces of the microbatch's activations per layer forward and two backward (and the forward's
again under checkpointing). Overlap of communication with compute is not modelled (gloo does not
overlap).

Overheads: what that leaves out (the pipeline runtime's Python per scheduled action, DTensor's
dispatch per sharded layer, the step's fixed bookkeeping) is measured, not guessed: two
layouts (:func:`choose_probes`; tensor-parallel ones only as verification picks them) are
boosted and stepped for real (:func:`probe_step`: two steps
under ``cl.plan.measure`` for the peak, then timed steps; :func:`merge_probe`: each step as long
as its slowest rank, the fastest step counts),
and non-negative coefficients for three features (:func:`features`) are fitted to what the model did
not explain (:func:`fit_overheads`).

Verification: the model ranks, the machine decides. While probes remain (``max_probes``), the
layout the model now ranks first among those that could fit is run for real, as long as its
predicted time is under the best measured time times ``1 + verify_margin`` (the model's error
is of that order). Each run refits the overheads. "Could fit": its planned peak, scaled by the
measured ÷ planned peak of its closest kin that ran (where cl.plan was off), within
``PLAN_TOLERANCE`` of the budget. The answer is the fastest layout that fits, measured where it
ran (its time, and its peak ``PEAK_MARGIN`` under the budget, ``PEAK_MARGIN_ZERO`` under
ZeRO-1), modelled where it did not. A
run-off first (:func:`runoff_pick`): when the runner-up among the layouts run is measured within
``RUNOFF`` of the fastest, both run once more and keep their faster run (runs kept back for it
from ``max_probes``). This
is what makes the choice hold up where the model is off (bench/autoplan.py prints both, per
layout).

Built on: ``cl.plan`` (memory), torch.distributed collectives (calibration), the model contract
(``tp_plan``, ``check_tp``, ``num_layers``). Written by hand: the enumeration, the calibration
probes and the step-time model. The layout is per model, as torchtitan plans it; Colossal-AI's
per-operator strategies on a torch.fx graph are ``cl.autoshard`` (``colossal_lab.engine.planner.shard``),
whose ``tp_plan()`` a layout's ``HybridParallelPlugin(tp_plan=...)`` takes.
"""

from __future__ import annotations

import contextlib
import fnmatch
import itertools
import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

SCHEDULES = ("1f1b", "interleaved")
# cl.plan's stated accuracy (docs/plan.md: each tier's peak within 10%): a layout planned up to this
# much over the budget may still fit, and verification may run it to see
PLAN_TOLERANCE = 0.10
# a layout that ran fits when its measured peak has this much headroom under the budget: the same
# layout's peak moves between runs (allocations on gloo's threads land at different moments; the
# bench saw 34.0 MiB in its grid for a layout the search measured under 33.5)
PEAK_MARGIN = 0.02
# ... and under ZeRO-1 this much: its measured peaks spread wider (the parameters' asynchronous
# broadcasts and the gradients' all-reduce land at different moments of a step): the bench saw one
# layout at 26.3 MiB in a search's run and 28.4 in its grid (+8%), so a search that trusted 26.3
# with 2% to spare could choose it for a 28 MiB budget it then exceeds
PEAK_MARGIN_ZERO = 0.08
# a layout planned this far under the budget is run without the profiler (its planned peak stands)
PLAN_HEADROOM = 0.15
# once layouts were verified, the margin is this many times the largest error the model made on
# them (never under MIN_MARGIN, never over ``verify_margin``): a model that proved close runs fewer
MARGIN_PER_ERROR, MIN_MARGIN = 1.5, 0.15
# the run-off: when the runner-up among the layouts run is measured within this of the fastest,
# both run once more and each keeps its faster run (a shared box's slow periods outlast a probe's
# steps: the same layout's probes moved by up to 16% between runs here)
RUNOFF = 0.10


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Candidate:
    """One layout: ``HybridParallelPlugin(**candidate.plugin_kwargs())``."""

    dp: int
    tp: int
    pp: int
    pp_style: str = "1f1b"
    num_microbatches: int = 1
    num_model_chunks: int = 1
    zero_stage: int = 0
    activation_checkpointing: bool = False
    tp_mode: str = "1d"
    tp_depth: int = 1  # 2.5D's d

    @property
    def label(self) -> str:
        mode = "" if self.tp_mode == "1d" else f"({self.tp_mode}" + (f" d{self.tp_depth}" if self.tp_depth > 1 else "") + ")"
        s = f"dp{self.dp} tp{self.tp}{mode} pp{self.pp}"
        if self.pp > 1:
            s += f" {self.pp_style} m{self.num_microbatches}"
        if self.zero_stage:
            s += f" zero{self.zero_stage}"
        if self.activation_checkpointing:
            s += " ac"
        return s

    def plugin_kwargs(self) -> Dict[str, Any]:
        kw: Dict[str, Any] = {"tp_size": self.tp, "pp_size": self.pp, "zero_stage": self.zero_stage,
                              "activation_checkpointing": self.activation_checkpointing}
        if self.pp > 1:
            kw.update(pp_style=self.pp_style, num_microbatches=self.num_microbatches,
                      num_model_chunks=self.num_model_chunks)
        if self.tp_mode != "1d":
            kw["tp_mode"] = self.tp_mode
        if self.tp_depth > 1:
            kw["tp_depth"] = self.tp_depth
        return kw

    def plugin(self):
        from ..plugins import HybridParallelPlugin

        return HybridParallelPlugin(**self.plugin_kwargs())


# ---------------------------------------------------------------- the search space


def _model_facts(model_or_config) -> Tuple[Any, int]:
    """(a meta-device model, its number of pipeline units)."""
    from .memory import _meta_model

    meta, _ = _meta_model(model_or_config)
    n = meta.num_layers() if callable(getattr(meta, "num_layers", None)) else len(meta)
    return meta, int(n)


def _tp_ok(meta, tp: int) -> bool:
    if tp == 1:
        return True
    if not callable(getattr(meta, "tp_plan", None)):
        return False
    check = getattr(meta, "check_tp", None)
    if callable(check):
        try:
            check(tp)
        except ValueError:
            return False
    return True


def _tp_modes_supported() -> Tuple[str, ...]:
    import inspect

    from ..plugins import HybridParallelPlugin

    return ("1d", "2d", "2.5d", "3d") if "tp_mode" in inspect.signature(HybridParallelPlugin).parameters else ("1d",)


def candidates(model_or_config, world_size: int, batch: int, *, schedules: Sequence[str] = SCHEDULES,
               microbatch_factors: Sequence[int] = (1, 2), zero_stages: Sequence[int] = (0, 1),
               activation_checkpointing: Sequence[bool] = (False, True),
               tp_modes: Optional[Sequence[str]] = None) -> List[Candidate]:
    """Every layout of ``world_size`` ranks the model and a global ``batch`` allow.

    ``batch`` is the samples of one step over all data-parallel ranks (each takes ``batch/dp``);
    microbatches are ``f·pp`` for ``f`` in ``microbatch_factors`` (at least one sample each).
    ``tp_modes`` (default: every mode the plugin offers and the model has a plan for: 1D always,
    2D/2.5D/3D with the contract's ``tp_nd_plan()``) where ``tp`` factors into the mode's grid,
    its heads split over the grid's hidden cut and each microbatch's rows over its batch cut."""
    from ..pipeline.schedules import validate_schedule

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"autoplan(world_size={world_size!r}): must be an int >= 1")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"autoplan(batch={batch!r}): must be an int >= 1 (samples per step, all ranks)")
    bad = [s for s in schedules if s not in ("1f1b", "gpipe", "interleaved", "zbv", "zero_bubble")]
    if bad:
        raise ValueError(f"autoplan(schedules={list(schedules)!r}): unknown {bad}; use '1f1b', 'gpipe', 'interleaved'")
    supported = _tp_modes_supported()
    if tp_modes is None:
        meta0, _ = _model_facts(model_or_config)
        tp_modes = supported if callable(getattr(meta0, "tp_nd_plan", None)) else ("1d",)
    unsupported = [m for m in tp_modes if m not in supported]
    if unsupported:
        raise ValueError(f"autoplan(tp_modes={list(tp_modes)!r}): this HybridParallelPlugin offers {list(supported)}")
    meta, layers = _model_facts(model_or_config)
    out: List[Candidate] = []
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            dp = world_size // (tp * pp)
            if batch % dp:
                continue
            local = batch // dp
            for mode, depth in _grids(tp, tp_modes):
                q, nb = _cuts(mode, tp, depth)
                if not _tp_ok(meta, q) or mode != "1d" and not callable(getattr(meta, "tp_nd_plan", None)):
                    continue  # the heads split over the hidden cut q (1D: q = tp)
                for style, m in _schedules(pp, layers, local, schedules, microbatch_factors):
                    if (local // m) % nb:  # N-d cuts each microbatch's rows nb ways
                        continue
                    try:
                        validate_schedule(style, pp, 2 if style == "interleaved" else 1, m)
                    except ValueError:
                        continue
                    for z in zero_stages:
                        if z == 1 and (dp == 1 or tp > 1):
                            continue
                        for ac in activation_checkpointing:
                            out.append(Candidate(dp, tp, pp, style, m, 2 if style == "interleaved" else 1,
                                                 z, bool(ac), mode, depth))
    if not out:
        raise ValueError(f"autoplan: no layout of world_size={world_size} fits this model and batch={batch} "
                         f"({layers} layers); try a batch divisible by the data-parallel sizes "
                         f"{_divisors(world_size)} or another world_size")
    return out


def _grids(tp: int, modes: Sequence[str]) -> Iterable[Tuple[str, int]]:
    """``(mode, depth)`` for each mode that ``tp`` ranks can form (2.5D: every depth d > 1 with
    ``tp = q² d``, q > 1; 1D only at tp = 1)."""
    from ..tp_nd.grid import factor

    for mode in modes:
        if mode == "1d":
            yield "1d", 1
        elif tp > 1 and mode == "2.5d":
            for d in range(2, tp + 1):
                if tp % d == 0 and tp // d > 1 and round(math.sqrt(tp // d)) ** 2 == tp // d:
                    yield "2.5d", d
        elif tp > 1 and _mode_fits(mode, tp):
            try:
                factor(mode, tp)
            except ValueError:
                continue
            yield mode, 1


def _cuts(mode: str, tp: int, depth: int = 1) -> Tuple[int, int]:
    """``(q, nb)``: the grid's hidden cut and batch cut (``q · nb = tp``); 1D: ``(tp, 1)``."""
    if mode == "1d":
        return tp, 1
    from ..tp_nd.grid import factor

    sizes = factor(mode, tp, depth)
    q = sizes["y"] if mode == "3d" else sizes["row"]
    return q, tp // q


def _mode_fits(mode: str, tp: int) -> bool:
    q2 = round(math.sqrt(tp))
    q3 = round(tp ** (1 / 3))
    if mode == "2d":
        return tp > 1 and q2 * q2 == tp
    if mode == "3d":
        return tp > 1 and q3 ** 3 == tp
    if mode == "2.5d":  # q*q*d with d > 1 and q > 1
        return any(tp % (q * q) == 0 and tp // (q * q) > 1 for q in range(2, tp + 1) if q * q <= tp)
    return True


def _schedules(pp, layers, local, schedules, factors) -> Iterable[Tuple[str, int]]:
    if pp == 1:
        yield "1f1b", 1
        return
    for style in schedules:
        chunks = 2 if style == "interleaved" else 1
        if layers % (pp * chunks):
            continue
        for f in factors:
            m = f * pp
            if local % m == 0:
                yield style, m


# ---------------------------------------------------------------- calibration (on the ranks)


def _shrunk_model(model_or_config, tp: int):
    """A real model whose ``tp_plan()`` linears have one tensor-parallel rank's shape (column:
    out features / tp, row: in features / tp): what one rank computes."""
    import torch.nn as nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    import copy

    if callable(getattr(model_or_config, "build", None)):
        model = model_or_config.build()
    else:  # the user's module: never change theirs
        model = copy.deepcopy(model_or_config)
    if tp == 1:
        return model
    plan = model.tp_plan()
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        style = next((s for k, s in plan.items() if k == name or fnmatch.fnmatchcase(name, k)), None)
        w = mod.weight.data
        if isinstance(style, ColwiseParallel):
            mod.weight = nn.Parameter(w[: w.shape[0] // tp].clone())
            mod.out_features = mod.weight.shape[0]
        elif isinstance(style, RowwiseParallel):
            mod.weight = nn.Parameter(w[:, : w.shape[1] // tp].clone())
            mod.in_features = mod.weight.shape[1]
    return model


def _timed(fn, reps: int, warm_up: bool = True) -> float:
    """Median seconds of ``reps`` calls (after one warm-up call), every rank starting together."""
    import torch.distributed as dist

    if warm_up:
        fn()
    times = []
    for _ in range(reps):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate(model_or_config, seq: int, tokens: Dict[int, Sequence[int]], group_sizes: Sequence[int],
              p2p: bool, reps: int = 3) -> Dict[str, Any]:
    """Measure the cost model's constants on this rank; every rank of the job calls it at once.

    ``tokens``: tp size -> microbatch token counts to time the model at (two are fitted as a
    line); ``group_sizes``: sizes of the all-reduce groups to time; ``p2p``: time send/recv too.
    Returns plain data (seconds): ``compute[tp] = {"tokens": [...], "f": [...], "fb": [...]}`` (the
    forward timed at the first size, scaled with the forward+backward at the others),
    ``allreduce[k] = [(bytes, s), ...]``, ``zero_sync[k] = [(calls, bytes, s), ...]`` (batches of
    asynchronous broadcasts, as ZeRO-1 syncs its parameters), ``p2p = [(bytes, s), ...]``,
    ``adam_s_per_elem``, and
    ``alone = {"busy": s, "alone": s}``: the largest forward+backward of the first tp size with
    every rank computing at once, and on rank 0 alone while the others wait (where ranks share
    cores, as CPU ranks do, one computing alone runs faster: a pipeline's bubble costs less)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    out: Dict[str, Any] = {"compute": {}, "allreduce": {}, "p2p": [], "adam_s_per_elem": 0.0}
    torch.manual_seed(0)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    for tp, toks in sorted(tokens.items()):
        model = _shrunk_model(model_or_config, tp)
        vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
        if vocab is None:
            raise ValueError("autoplan: calibration feeds token ids; this model has no cfg.vocab_size")
        row = {"tokens": [], "f": [], "fb": []}
        warm = True  # the first size warms the model up; later ones are timed straight away
        for n in sorted(set(int(t) for t in toks)):
            b = max(1, n // seq)
            x = torch.randint(0, vocab, (b, seq))

            def fwd():
                with torch.no_grad():
                    model(x)

            def fwd_bwd():
                logits, _ = model(x)
                F.cross_entropy(logits.flatten(0, 1).float(), x.flatten()).backward()
                model.zero_grad(set_to_none=True)

            row["tokens"].append(b * seq)
            row["fb"].append(_timed(fwd_bwd, reps, warm))
            # the forward (checkpointing's recompute) is timed at the first size only, and scaled
            # with the forward+backward at the others: its share of a step hardly moves with size
            row["f"].append(_timed(fwd, reps, warm) if warm else row["f"][0] * row["fb"][-1] / row["fb"][0])
            warm = False
        if "alone" not in out:  # every rank busy just now; rank 0 again while the others wait
            out["alone"] = {"busy": row["fb"][-1], "alone": _timed(fwd_bwd if rank0 else (lambda: None), reps, False)}
        out["compute"][tp] = row
        del model
    if dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        for k in sorted(set(group_sizes)):
            if k < 2 or world % k:
                continue
            groups = [dist.new_group(list(range(i, i + k))) for i in range(0, world, k)]
            mine = groups[rank // k]
            pts = []
            for nbytes in (1 << 10, 64 << 10, 4 << 20):  # latency (ZeRO-1's per-tensor calls), then bandwidth
                t = torch.ones(nbytes // 4)
                pts.append((nbytes, _timed(lambda: dist.all_reduce(t, group=mine), reps)))
            out["allreduce"][k] = pts
            # ZeroRedundancyOptimizer's parameter sync (its ``_sync_params``): every tensor
            # broadcast from the rank that stepped it, all posted asynchronously, then waited on.
            # Its calls queue behind each other without a blocking round trip each, so it costs
            # far less per tensor than a blocking all-reduce's latency (which priced ZeRO-1 steps
            # 30-50% too slow): timed as such, many small calls and a few large ones
            zs = []
            for calls, nbytes in ((32, 1 << 10), (8, 512 << 10)):
                bufs = [torch.ones(nbytes // 4) for _ in range(calls)]
                first_rank = (rank // k) * k

                def sync(bufs=bufs):
                    handles = [dist.broadcast(b, src=first_rank + i % k, group=mine, async_op=True)
                               for i, b in enumerate(bufs)]
                    for h in handles:
                        h.wait()

                zs.append((calls, calls * nbytes, _timed(sync, reps)))
            out.setdefault("zero_sync", {})[k] = zs
        if p2p and world >= 2:
            peer = rank ^ 1
            pts = []
            for nbytes in (64 << 10, 4 << 20):
                t = torch.ones(nbytes // 4)

                def exchange():
                    if peer >= world:
                        return
                    if rank % 2 == 0:
                        dist.send(t, peer)
                        dist.recv(t, peer)
                    else:
                        dist.recv(t, peer)
                        dist.send(t, peer)

                pts.append((nbytes, _timed(exchange, reps) / 2))  # one way
            out["p2p"] = pts
    n = 1 << 20
    p = torch.nn.Parameter(torch.zeros(n))
    p.grad = torch.ones(n)
    opt = torch.optim.AdamW([p], lr=1e-3)
    out["adam_s_per_elem"] = _timed(opt.step, reps) / n
    return out


def merge_calibrations(per_rank: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One calibration for the job: every time the slowest rank's (a step waits for it)."""
    first = per_rank[0]
    out: Dict[str, Any] = {"compute": {}, "allreduce": {}, "p2p": [], "adam_s_per_elem":
                           max(c["adam_s_per_elem"] for c in per_rank)}
    for tp, row in first["compute"].items():
        out["compute"][tp] = {"tokens": row["tokens"],
                              "f": [max(c["compute"][tp]["f"][i] for c in per_rank) for i in range(len(row["f"]))],
                              "fb": [max(c["compute"][tp]["fb"][i] for c in per_rank) for i in range(len(row["fb"]))]}
    for k, pts in first["allreduce"].items():
        out["allreduce"][k] = [(b, max(c["allreduce"][k][i][1] for c in per_rank)) for i, (b, _) in enumerate(pts)]
    for k, pts in first.get("zero_sync", {}).items():
        out.setdefault("zero_sync", {})[k] = [(n, b, max(c["zero_sync"][k][i][2] for c in per_rank))
                                              for i, (n, b, _) in enumerate(pts)]
    if first["p2p"]:
        out["p2p"] = [(b, max(c["p2p"][i][1] for c in per_rank if c["p2p"])) for i, (b, _) in enumerate(first["p2p"])]
    if all("alone" in c for c in per_rank):  # rank 0 ran alone; the others only waited
        out["alone"] = {k: max(c["alone"][k] for c in per_rank) for k in ("busy", "alone")}
    return out


# ---------------------------------------------------------------- the step-time model


def _line(xs: Sequence[float], ys: Sequence[float]):
    """y(x) through measured points: one point, through the origin; two, the line through them;
    more, piecewise between neighbours and the end segments' lines beyond. Never below 0."""
    pts = sorted(zip(xs, ys))
    if len(pts) == 1 or pts[0][0] == pts[-1][0]:
        k = pts[0][1] / pts[0][0] if pts[0][0] else 0.0
        return lambda x: k * x

    def at(x):
        i = next((i for i in range(1, len(pts) - 1) if x <= pts[i][0]), len(pts) - 1)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return max(0.0, y0 + (y1 - y0) / (x1 - x0) * (x - x0)) if x1 != x0 else y1
    return at


@dataclass
class Costs:
    """The calibration as functions: seconds for a microbatch's tokens, a group's all-reduce of
    ``bytes``, a point-to-point transfer, an optimizer step over ``n`` elements."""

    calibration: Dict[str, Any]
    _f: Dict[int, Any] = field(default_factory=dict)
    _fb: Dict[int, Any] = field(default_factory=dict)

    def __post_init__(self):
        for tp, row in self.calibration["compute"].items():
            self._f[int(tp)] = _line(row["tokens"], row["f"])
            self._fb[int(tp)] = _line(row["tokens"], row["fb"])

    def forward(self, tp: int, tokens: int) -> float:
        return self._f[tp](tokens)

    def forward_backward(self, tp: int, tokens: int) -> float:
        return self._fb[tp](tokens)

    def allreduce(self, k: int, nbytes: float) -> float:
        if k <= 1 or nbytes <= 0:
            return 0.0
        pts = self.calibration["allreduce"].get(k) or self.calibration["allreduce"].get(str(k))
        if not pts:
            raise ValueError(f"autoplan: no all-reduce measured for groups of {k}")
        return _line([b for b, _ in pts], [s for _, s in pts])(nbytes)

    def zero_sync(self, k: int, calls: float, nbytes: float) -> Optional[float]:
        """Seconds of ZeroRedundancyOptimizer's parameter sync on a group of ``k``: ``calls``
        asynchronous broadcasts carrying ``nbytes`` in all, as ``seconds = calls * a + bytes * b``
        through the two measured batches (None where the calibration did not measure it)."""
        if k <= 1:
            return 0.0
        zs = self.calibration.get("zero_sync") or {}
        pts = zs.get(k) or zs.get(str(k))
        if not pts:
            return None
        (n1, b1, t1), (n2, b2, t2) = pts[0], pts[-1]
        det = n1 * b2 - n2 * b1
        a = (t1 * b2 - t2 * b1) / det if det else t1 / n1
        b = (n1 * t2 - n2 * t1) / det if det else 0.0
        if b < 0:  # noise: the many small calls cost as much as the few large ones
            a, b = max(t1 / n1, t2 / n2), 0.0
        elif a < 0:
            a, b = 0.0, max(t1 / b1, t2 / b2)
        return calls * a + nbytes * b

    def p2p(self, nbytes: float) -> float:
        pts = self.calibration["p2p"]
        return _line([b for b, _ in pts], [s for _, s in pts])(nbytes) if pts else 0.0

    def adam(self, n: float) -> float:
        return self.calibration["adam_s_per_elem"] * n

    @property
    def slowdown(self) -> float:
        """How much slower a rank computes with every rank busy than alone (1: one device each,
        as on GPUs; ~world/cores where CPU ranks share cores). Bounds ``[1, world]`` are the
        caller's; a calibration without the measurement says 1."""
        a = self.calibration.get("alone")
        return max(1.0, a["busy"] / a["alone"]) if a and a.get("alone") else 1.0


def _compute_key(c: Candidate) -> int:
    """The tp size whose shrunk model times this layout's compute (N-d: the hidden cut q)."""
    return c.tp if c.tp_mode == "1d" else _cuts(c.tp_mode, c.tp, c.tp_depth)[0]


def nd_traffic(meta, c: Candidate, batch: int, seq: int) -> Tuple[float, float]:
    """``(bytes, collectives)`` one rank of layout ``c`` sends per step under 2D/2.5D/3D tensor
    parallelism: ``tp_nd.volume.textbook`` for the whole model over its stage's ``1/pp``, and per
    planned linear and microbatch SUMMA's ``6q`` broadcasts/reduces (2D, 2.5D) or 3D's six
    gathers/scatters. ``(0, 0)`` for 1D."""
    if c.tp_mode == "1d" or c.tp == 1:
        return 0.0, 0.0
    from ..tp_nd.volume import textbook

    m = c.num_microbatches if c.pp > 1 else 1
    tokens = batch // c.dp * seq
    nbytes = sum(textbook(meta, c.tp_mode, c.tp, tokens, depth=c.tp_depth, microbatches=m).values())
    q, _ = _cuts(c.tp_mode, c.tp, c.tp_depth)
    linears = len(meta.tp_plan()) + 1  # the plan's linears and the head
    calls = m * linears * (6 * q if c.tp_mode in ("2d", "2.5d") else 6)
    return nbytes / c.pp, calls / c.pp


def predict(c: Candidate, costs: Costs, *, batch: int, seq: int, n_embd: int, layers: int,
            params: int, tensors: int = 0, act_bytes: int = 4, grad_bytes: int = 4,
            nd_bytes: float = 0.0, nd_calls: float = 0.0) -> Dict[str, float]:
    """Predicted seconds of one step of layout ``c`` (global ``batch``), by part; ``params`` the
    model's parameter elements, ``tensors`` its parameter tensors. Under 2D/2.5D/3D tensor
    parallelism ``nd_bytes`` is what a rank sends per step (``tp_nd.volume.textbook`` over its
    stage) and ``nd_calls`` its collectives per step (:func:`nd_traffic`)."""
    local = batch // c.dp
    m = c.num_microbatches if c.pp > 1 else 1
    tok = local // m * seq                         # tokens of one microbatch
    v = c.num_model_chunks                         # model chunks per rank (interleaved: 2)
    # one microbatch on one rank: its v chunks, 1/pp of the (tp-shrunk) model in all; N-d cuts the
    # hidden size q ways and the rows nb = tp/q ways: the model shrunk q ways, on 1/nb of the rows
    ct, share = _compute_key(c), _compute_key(c) / c.tp
    f, fb = costs.forward(ct, tok) * share / c.pp, costs.forward_backward(ct, tok) * share / c.pp
    compute = fb + (f if c.activation_checkpointing else 0.0)
    # Megatron 1D: per layer two all-reduces of (tokens, n_embd) forward and two backward
    per_layer = (4 + (2 if c.activation_checkpointing else 0)) * costs.allreduce(c.tp, tok * n_embd * act_bytes)
    tp_comm = per_layer * layers / c.pp
    if c.tp_mode != "1d":
        # N-d: the textbook bytes as the payload of all-reduces on the whole tp group (one of n
        # bytes sends 2(p-1)/p n), plus a latency per collective on the grid's lines (size q); the
        # forward's share (a third: one product of three) again under checkpointing
        q, _ = _cuts(c.tp_mode, c.tp, c.tp_depth)
        again = 4 / 3 if c.activation_checkpointing else 1.0
        payload = nd_bytes * c.tp / (2 * (c.tp - 1))
        latency = costs.allreduce(q, 1.0) if q > 1 else 0.0
        tp_comm = again * (costs.allreduce(c.tp, payload) + nd_calls * latency) / m
    # each chunk hands its activation on and takes its gradient back
    p2p = 2 * v * costs.p2p(tok * n_embd * act_bytes) if c.pp > 1 else 0.0
    slots = m + (c.pp - 1) / v                     # microbatches plus the bubble, in microbatch times
    # ranks that share cores (CPU) compute faster while others idle: the critical path's slots at
    # the speed of a rank alone, but never below the work itself (m microbatches per rank, all
    # ranks busy); with a device per rank (slowdown 1) this is slots x the microbatch time
    n, per = max((slots, compute / costs.slowdown), (m, compute), key=lambda x: x[0] * (x[1] + tp_comm + p2p))
    pipeline = n * (per + tp_comm + p2p)
    local_params = params / (c.tp * c.pp)
    dp_comm = costs.allreduce(c.dp, local_params * grad_bytes)
    if c.zero_stage == 1:
        # ZeroRedundancyOptimizer broadcasts every parameter tensor from its owner after the step,
        # all asynchronously (the measured sync); a calibration without it: a blocking collective's
        # latency per tensor, carrying the parameters' bytes once
        sync = costs.zero_sync(c.dp, tensors / (c.tp * c.pp), local_params * grad_bytes)
        if sync is None:
            sync = (tensors / (c.tp * c.pp) * costs.allreduce(c.dp, 1.0)
                    + costs.allreduce(c.dp, local_params * grad_bytes) / 2)
        dp_comm += sync
    optim = costs.adam(local_params / (c.dp if c.zero_stage == 1 else 1))
    total = pipeline + dp_comm + optim
    return {"total": total, "pipeline": pipeline, "compute": n * per, "tp_comm": n * tp_comm,
            "p2p": n * p2p, "dp_comm": dp_comm, "optim": optim}


# ---------------------------------------------------------------- overheads, from short real runs


def features(c: Candidate, layers: int) -> List[float]:
    """What a step's framework overhead scales with: one per step (the optimizer wrapper, the
    data-parallel bookkeeping), per scheduled action (a chunk's forward or backward of one
    microbatch: the pipeline runtime's Python, its send/recv set-up) and per layer pass under
    tensor parallelism (DTensor's dispatch around each sharded linear)."""
    m = c.num_microbatches if c.pp > 1 else 1
    slots = m + (c.pp - 1) / c.num_model_chunks
    actions = 2 * slots * c.num_model_chunks * (1.5 if c.activation_checkpointing else 1.0)
    tp_passes = slots * layers / c.pp * (1.5 if c.activation_checkpointing else 1.0) if c.tp > 1 else 0.0
    return [1.0, actions, tp_passes]


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
    import contextlib
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from .. import Booster
    from .memory import measure

    c = Candidate(**cand)

    def crit(out, b):
        out = out[0] if isinstance(out, tuple) else out
        return F.cross_entropy(out.flatten(0, 1).float(), b["targets"].flatten())

    meter = measure() if measure_peak else contextlib.nullcontext()
    with meter:
        torch.manual_seed(0)
        model = model_or_config.build() if callable(getattr(model_or_config, "build", None)) \
            else copy.deepcopy(model_or_config)
        vocab = model.cfg.vocab_size
        plugin = c.plugin()
        booster = Booster(plugin=plugin)
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3), crit)
        x = torch.randint(0, vocab, (batch // c.dp, seq), generator=torch.Generator().manual_seed(0))

        def step():
            booster.execute_pipeline(iter([{"idx": x, "targets": x}]), model, crit, opt)
            opt.step()
            opt.zero_grad()

        step()  # the warm-up: first-call costs (allocations, the schedule's set-up)
        if measure_peak:
            step()  # training's steady state: the optimizer's state beside the activations (not in step 1)
    peak = int(max(meter.peak.values(), default=0)) if measure_peak else None
    times = []  # the measured step was the warm-up (a median over the steps shrugs off a slow one)
    for _ in range(steps):
        dist.barrier()  # every rank starts the step together: its time is the step's, not a wait
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    plugin.close()  # its process groups: a search boosts many layouts on the same ranks
    return {"peak": peak, "step_seconds": times}


@contextlib.contextmanager
def _own_garbage():
    """Around a probe: cyclic garbage from before it (an earlier probe's model, held in reference
    cycles) is not freed inside it, and its own is freed when it ends. The peak counts live bytes
    from the window's start, so garbage freed inside the window hid the layout's own (a search
    measured 22.7 MiB for a layout that peaks at 28.4 on a fresh rank). The objects from before
    are frozen meanwhile (``gc.freeze``): the automatic collections inside cannot free them, and
    the final collection scans only what the probe made (a full one takes ~0.4 s on a rank with
    torch imported, which was 70% of a tiny GPT's probe). Where someone else froze objects, their
    freeze is left alone and full collections run instead."""
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
    least is the layout's own; the median of 3 steps moved with slow periods (a first probe's steps
    ran 3888, 3827, 3652, then 4655-4702 tok/s). ``median`` is kept beside it."""
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


def fit_overheads(feats: Sequence[Sequence[float]], residuals: Sequence[float]) -> List[float]:
    """Non-negative coefficients for ``features`` that best explain ``measured - modelled`` (least
    squares over every subset of the features, keeping the best fit with no negative
    coefficient): the overhead a layout adds beyond its compute and communication."""
    import torch

    k = len(feats[0])
    best, best_err = [0.0] * k, sum(r * r for r in residuals)
    X_all = torch.tensor(feats, dtype=torch.float64)
    y = torch.tensor(residuals, dtype=torch.float64).unsqueeze(1)
    for n in range(1, k + 1):
        for cols in itertools.combinations(range(k), n):
            X = X_all[:, list(cols)]
            if torch.linalg.matrix_rank(X) < n:
                continue
            coef = torch.linalg.lstsq(X, y).solution.squeeze(1)
            if (coef < 0).any():
                continue
            err = float(((X @ coef.unsqueeze(1) - y) ** 2).sum())
            if err < best_err - 1e-15:
                best, best_err = [0.0] * k, err
                for i, ci in zip(cols, coef.tolist()):
                    best[i] = ci
    return best


# ---------------------------------------------------------------- the search


@dataclass
class AutoPlan:
    """What :func:`autoplan` found: ``rows`` (every candidate, best first among those that fit),
    ``best`` (a :class:`Candidate`), ``plugin()`` (the chosen ``HybridParallelPlugin``)."""

    rows: List[Dict[str, Any]]
    best: Optional[Candidate]
    world_size: int
    batch: int
    seq: int
    device_memory: Optional[int]
    calibration: Dict[str, Any]
    seconds: Dict[str, float]
    _fits: Optional[Callable[[Candidate], bool]] = field(default=None, repr=False, compare=False)
    _peak_of: Optional[Callable[[Candidate], Tuple[int, bool]]] = field(default=None, repr=False, compare=False)

    def fill_peaks(self) -> "AutoPlan":
        """Plan the memory of the rows the search did not need (``peak_bytes`` None); the answer
        stays: every faster layout was planned and did not fit."""
        if self._fits is not None:
            for r in self.rows:
                if r["fits"] is None:
                    r["fits"] = self._fits(r["candidate"])
                    r["peak_bytes"] = self._peak_of(r["candidate"])[0]
            self.rows = _ordered(self.rows)
        return self

    def plugin(self):
        if self.best is None:
            raise ValueError("autoplan: no candidate fits device_memory; see the table's peaks, raise "
                             "device_memory or lower batch/seq")
        return self.best.plugin()

    def to_dict(self) -> dict:
        return {"best": asdict(self.best) if self.best else None, "world_size": self.world_size,
                "batch": self.batch, "seq": self.seq, "device_memory": self.device_memory,
                "seconds": self.seconds,
                "rows": [{**{k: v for k, v in r.items() if k != "candidate"}, "candidate": asdict(r["candidate"])}
                         for r in self.rows]}

    def table(self, top: Optional[int] = None) -> str:
        from .memory import _fmt

        head = ("layout", "step (model)", "step (run)", "tokens/s", "peak/rank (plan)", "peak (run)", "fits")
        rows = [(r["label"], f"{r['predicted_s'] * 1e3:.1f} ms",
                 f"{r['measured_s'] * 1e3:.1f} ms" if r.get("measured_s") is not None else "-",
                 f"{r['tokens_per_s']:.0f}", _fmt(r["peak_bytes"]) if r["peak_bytes"] is not None else "-",
                 _fmt(r["measured_peak"]) if r.get("measured_peak") is not None else "-",
                 {True: "yes", False: "no", None: "-"}[r["fits"]]) for r in self.rows[:top]]
        w = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
        lines = [f"AutoPlan: world {self.world_size} · batch {self.batch} × seq {self.seq} · device_memory "
                 f"{_fmt(self.device_memory)} · best: {self.best.label if self.best else 'none fits'}",
                 "  ".join(h.ljust(w[i]) for i, h in enumerate(head)),
                 "  ".join("-" * x for x in w)]
        lines += ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows]
        lines.append(f"search: calibration {self.seconds.get('calibration', 0):.1f} s, layouts run "
                     f"{self.seconds.get('runs', 0):.1f} s, memory plans {self.seconds.get('memory', 0):.1f} s")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.table()

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(self.table())


def _probe_tokens(cands: Sequence[Candidate], batch: int, seq: int) -> Dict[int, List[int]]:
    by_tp: Dict[int, set] = {}
    for c in cands:
        m = c.num_microbatches if c.pp > 1 else 1
        by_tp.setdefault(_compute_key(c), set()).add(batch // c.dp // m * seq)
    return {tp: sorted({min(v), max(v)}) for tp, v in by_tp.items()}


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
    measured time. ``plan_all``: plan every layout's memory (``cl.plan``, ~0.1-0.2 s each); by
    default only those the search needs: the overhead probes' pool and, in order of predicted
    time, every layout up to the first that fits; the rest show no planned peak
    (:meth:`AutoPlan.fill_peaks` plans them later). ``space``: narrows :func:`candidates` (``schedules``,
    ``microbatch_factors``, ``zero_stages``, ``activation_checkpointing``, ``tp_modes``)."""
    from . import runner
    from .memory import TraceCache

    if device_memory is not None and not (isinstance(device_memory, int) and device_memory > 0):
        raise ValueError(f"autoplan(device_memory={device_memory!r}): bytes per rank, an int > 0 (or None)")
    meta, layers = _model_facts(model_or_config)
    cfg = getattr(meta, "cfg", None)
    seq = seq if seq is not None else getattr(cfg, "block_size", None)
    if not isinstance(seq, int) or seq < 1:
        raise ValueError(f"autoplan(seq={seq!r}): tokens per sample, an int >= 1")
    if cfg is None or not hasattr(cfg, "n_embd"):
        raise ValueError("autoplan: the model needs a cfg with n_embd (the activation width) for the cost model")
    if cluster is not None and getattr(cluster, "n", world_size) != world_size:
        raise ValueError(f"autoplan(cluster=...): it has {cluster.n} ranks, world_size={world_size}; "
                         f"launch cl.launch(n={world_size}) or pass world_size={cluster.n}")
    cands = candidates(model_or_config, world_size, batch, **space)
    unique = {id(p): p for p in meta.parameters()}.values()
    params, tensors = sum(p.numel() for p in unique), len(unique)

    peaks: Dict[Candidate, Tuple[int, bool]] = {}
    t_mem = [0.0]
    traces = TraceCache()  # cl.plan's traces, shared by the layouts with the same per-rank batch
    # every rank builds the whole model before boost() cuts it (as probe_step does, and a user who
    # calls model = GPT(cfg) on each rank): whatever the layout, a rank holds that much once
    built = sum(p.numel() * p.element_size() for p in unique) + sum(b.numel() * b.element_size()
                                                                   for b in meta.buffers())

    def peak_of(c: Candidate) -> Tuple[int, bool]:
        """``(planned peak bytes, fits)`` of layout ``c``, planned on first use."""
        if c in peaks:
            return peaks[c]
        t0 = time.perf_counter()
        # N-d layouts too: cl.plan traces a rank's grid-form layers on a fake process group
        fp = traces.plan(model_or_config, c.plugin(), world_size=world_size, batch=batch // c.dp, seq=seq,
                         device_memory=device_memory, host_memory=host_memory)
        tier = fp.tiers[0]
        # splitting a pipeline stage copies that stage while the built model is still alive
        peak = max(fp.peak(tier), built + (built // c.pp if c.pp > 1 else 0))
        peaks[c] = (peak, fp.fits and (device_memory is None or peak <= device_memory))
        t_mem[0] += time.perf_counter() - t0
        return peaks[c]

    if plan_all:
        for c in cands:
            peak_of(c)

    t0, mem0 = time.perf_counter(), t_mem[0]
    dims = dict(batch=batch, seq=seq, n_embd=cfg.n_embd, layers=layers, params=params, tensors=tensors)
    import torch.distributed as dist

    if cluster is None and dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(f"autoplan(world_size={world_size}): this process group has "
                             f"{dist.get_world_size()} ranks; plan for those")
        cluster = runner.InProcess()  # every rank is here: calibrate and probe together
    own = cluster is None and calibration is None
    if own:
        cluster = runner.launch(world_size)
    # layouts run for real, this search's and any an earlier search measured (``calibration=``)
    measured: Dict[Candidate, Dict[str, float]] = {}
    try:
        t_runs = [0.0]

        def run_probe(c: Candidate) -> None:
            # the profiler costs time: a layout planned well under the budget (cl.plan's error is a few
            # percent, -12% at worst in bench/autoplan) keeps its planned peak
            near = device_memory is not None and peak_of(c)[0] > device_memory * (1 - PLAN_HEADROOM)
            t = time.perf_counter()
            measured[c] = merge_probe(cluster.run(probe_step, model_or_config, asdict(c), batch, seq, probe_steps,
                                                  near))
            t_runs[0] += time.perf_counter() - t

        if calibration is None:
            args = (model_or_config, seq, _probe_tokens(cands, batch, seq),
                    sorted({c.tp for c in cands} | {c.dp for c in cands} | {_cuts(c.tp_mode, c.tp, c.tp_depth)[0]
                                                                              for c in cands}),
                    any(c.pp > 1 for c in cands), reps)
            calibration = merge_calibrations(cluster.run(calibrate, *args))
            # the framework's own overheads: layouts that tell them apart, run for real
            # (they are chosen among the plain layouts without tensor parallelism when there are any:
            # only those need a memory plan now)
            plain = [c for c in cands if not c.activation_checkpointing and c.zero_stage == 0]
            pool = [c for c in plain if c.tp == 1] or plain or cands
            for c in choose_probes([{"candidate": c, "fits": peak_of(c)[1]} for c in pool], layers):
                if len(measured) < max_probes:
                    run_probe(c)
        else:
            calibration, known = dict(calibration), set(cands)
            for entry in calibration.get("measured", []):
                c = Candidate(**entry["candidate"])
                if c in known:
                    measured[c] = {"seconds": entry["seconds"], "peak": entry["peak"]}
        costs = Costs(calibration)
        nd = {c: nd_traffic(meta, c, batch, seq) for c in cands}
        modelled = {c: predict(c, costs, **dims, nd_bytes=nd[c][0], nd_calls=nd[c][1]) for c in cands}

        def refit() -> List[float]:
            probed = list(measured)
            if not probed:
                return list(calibration.get("overheads") or [0.0, 0.0, 0.0])
            return fit_overheads([features(c, layers) for c in probed],
                                 [measured[c]["seconds"] - modelled[c]["total"] for c in probed])

        def estimate(over) -> Dict[Candidate, float]:
            """Seconds per layout: measured where it ran, else the model's."""
            return {c: measured[c]["seconds"] if c in measured else
                    modelled[c]["total"] + sum(x * f for x, f in zip(over, features(c, layers))) for c in cands}

        def fits(c: Candidate) -> bool:
            """Measured where it ran with the profiler, else planned (on first use)."""
            peak = measured[c]["peak"] if c in measured else None
            if peak is not None:
                margin = PEAK_MARGIN_ZERO if c.zero_stage else PEAK_MARGIN
                return device_memory is None or peak * (1 + margin) <= device_memory
            return peak_of(c)[1]

        def ratio(c: Candidate) -> float:
            """Measured ÷ planned peak of the closest layout that ran: the same shape (dp, tp, pp,
            schedule, mode), else the same dp × tp × pp, else the median of all (1 before any)."""
            def r(x):
                return measured[x]["peak"] / peaks[x][0]

            sized = [x for x in measured if measured[x]["peak"] is not None and peak_of(x)[0] > 0]

            for key in (lambda x: (x.dp, x.tp, x.pp, x.pp_style, x.num_microbatches, x.tp_mode),
                        lambda x: (x.dp, x.tp, x.pp)):
                near = [r(x) for x in sized if key(x) == key(c)]
                if near:
                    return max(near)
            return statistics.median([r(x) for x in sized] or [1.0])

        # verify: run the layout the model ranks first among those that could fit, while it could beat
        # the best layout measured so far (cl.plan's peak is an estimate: a layout a little over the
        # budget on paper may fit for real, judged by how far off the plan was for its closest kin)
        errors: List[float] = []  # |measured / predicted - 1| of each layout verification ran
        def reserved() -> int:
            """Runs kept back for the run-off the layouts measured so far would need."""
            return len(runoff_pick({c: v["seconds"] for c, v in measured.items()}, fits))

        while cluster is not None and len(measured) + reserved() < max_probes:
            over = refit()
            est = estimate(over)
            best_meas = min((est[c] for c in measured if fits(c)), default=math.inf)
            margin = min(verify_margin, max(MIN_MARGIN, MARGIN_PER_ERROR * max(errors))) if errors else verify_margin
            # fastest first; memory planned only down to the first that could fit
            pick = next((c for c in sorted(cands, key=est.get) if c not in measured
                         and est[c] < best_meas * (1 + margin)
                         and (device_memory is None
                              or peak_of(c)[0] * ratio(c) <= device_memory * (1 + PLAN_TOLERANCE))), None)
            calibration["margin"] = margin  # the last stop decision's (rows not run are that much slower)
            if pick is None:
                break
            run_probe(pick)
            errors.append(abs(measured[pick]["seconds"] / est[pick] - 1))
        # the run-off: two layouts measured within the noise of each other run once more each
        # (inside ``max_probes``: the verification kept runs back for it)
        runoff = runoff_pick({c: v["seconds"] for c, v in measured.items()}, fits) if cluster is not None else []
        runoff = runoff if len(measured) + len(runoff) <= max_probes else []
        for c in runoff:
            t = time.perf_counter()
            again = merge_probe(cluster.run(probe_step, model_or_config, asdict(c), batch, seq, probe_steps, False))
            t_runs[0] += time.perf_counter() - t
            measured[c]["runs"] = measured[c].get("runs", [measured[c]["seconds"]]) + [again["seconds"]]
            measured[c]["seconds"] = min(measured[c]["runs"])
        calibration["runoff"] = [c.label for c in runoff]
    finally:
        if own:
            cluster.stop()
    over = refit()
    calibration["overheads"] = over
    calibration["measured"] = [{"candidate": asdict(c), **v} for c, v in measured.items()]
    calibration["probes"] = [(asdict(c), v["seconds"]) for c, v in measured.items()]
    est = estimate(over)
    # the answer: the fastest that fits (memory planned in order of time, down to it)
    best = next((c for c in sorted(cands, key=est.get) if fits(c)), None)
    # the microbenchmarks: what neither the layouts run nor the memory plans on the way took
    t_cal = time.perf_counter() - t0 - (t_mem[0] - mem0) - t_runs[0]

    rows = []
    for c in cands:
        parts = dict(modelled[c])
        parts["overhead"] = sum(a * b for a, b in zip(over, features(c, layers)))
        parts["total"] += parts["overhead"]
        m = measured.get(c)
        rows.append({"label": c.label, "candidate": c, "predicted_s": parts["total"], "seconds": est[c],
                     "tokens_per_s": batch * seq / est[c], "parts": parts,
                     "peak_bytes": peaks[c][0] if c in peaks else None,
                     "measured_s": m["seconds"] if m else None, "measured_peak": m["peak"] if m else None,
                     "fits": fits(c) if c in peaks or (m and m["peak"] is not None) else None})
    return AutoPlan(_ordered(rows), best, world_size, batch, seq, device_memory, calibration,
                    {"memory": t_mem[0], "calibration": t_cal, "runs": t_runs[0]}, _fits=fits, _peak_of=peak_of)


def _ordered(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Those that fit first, fastest first; then those not planned (slower than the answer); then
    those that do not fit."""
    return sorted(rows, key=lambda r: ({True: 0, None: 1, False: 2}[r["fits"]], r["seconds"]))


__all__ = ["AutoPlan", "Candidate", "Costs", "autoplan", "calibrate", "candidates", "choose_probes", "features",
           "fit_overheads", "merge_calibrations", "merge_probe", "nd_traffic", "predict", "probe_step",
           "runoff_pick"]
