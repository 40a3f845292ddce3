"""Measuring the step-time model's constants on the ranks that will train.

:func:`calibrate` runs on every rank at once (so a CPU box's shared cores and a GPU box's links are
what is measured), :func:`merge_calibrations` makes one figure of the ranks' (the slowest: a step
waits for it). Measured, in seconds:

* compute: the model's forward and forward+backward at two microbatch sizes, with every linear of
  its ``tp_plan()`` cut to a tensor-parallel rank's shape, for each tp size (a line in tokens
  between them);
* collectives: ``all_reduce`` at 1 KiB (latency), 64 KiB and 4 MiB on groups of each size the
  layouts use (the world cut into such groups, all busy at once); ZeRO-1's parameter sync as
  ``ZeroRedundancyOptimizer`` runs it (batches of asynchronous broadcasts); point-to-point
  send/recv between rank pairs at two sizes;
* contention: the largest forward+backward again on rank 0 alone while the others wait (how much
  faster a rank computes when the others idle: more than 1 where ranks share cores);
* the optimizer: AdamW's step per parameter element.

The timed collectives call torch.distributed itself, not ``comm``: what is measured is the
transport a layout's collectives will ride, without the engine's counting around it; the barriers
between measurements go through ``comm`` like every other engine collective.

Built on torch.distributed collectives and the model contract (``build``, ``tp_plan``,
``cfg.vocab_size``). The results are plain data (dicts keyed by int sizes), as they travel back
from the ranks; :mod:`.calibration` reads them.
"""
from __future__ import annotations

import fnmatch
import statistics
import time
from typing import Any, Dict, List, Sequence, Tuple

from .space import Candidate, compute_tp, cuts, microbatches


def what_to_time(cands: Sequence[Candidate], batch: int, seq: int) -> Tuple[Dict[int, List[int]], List[int], bool]:
    """:func:`calibrate`'s ``(tokens, group_sizes, p2p)`` for these layouts: per compute tp size
    the smallest and largest microbatch; every dp, tp, hidden-cut, ep and expert-dp group size; send/recv when
    any layout has a pipeline."""
    by_tp: Dict[int, set] = {}
    for c in cands:
        by_tp.setdefault(compute_tp(c), set()).add(batch // c.dp // microbatches(c) * seq)
    tokens = {tp: sorted({min(v), max(v)}) for tp, v in by_tp.items()}
    sizes = sorted({c.tp for c in cands} | {c.dp for c in cands} | {cuts(c.tp_mode, c.tp, c.tp_depth)[0]
                                                                  for c in cands}
                   | {c.ep for c in cands} | {c.dp // c.ep for c in cands})  # all-to-alls, expert-dp sync
    return tokens, sizes, any(c.pp > 1 for c in cands)


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

    out: Dict[str, Any] = {"compute": {}, "allreduce": {}, "p2p": [], "adam_s_per_elem": 0.0}
    torch.manual_seed(0)
    for tp, toks in sorted(tokens.items()):
        out["compute"][tp] = _time_compute(model_or_config, tp, toks, seq, reps, out)
    if dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        for k in sorted(set(group_sizes)):
            if k < 2 or world % k:
                continue
            _time_group(k, world, rank, reps, out)
        if p2p and world >= 2:
            out["p2p"] = _time_p2p(world, rank, reps)
    n = 1 << 20
    p = torch.nn.Parameter(torch.zeros(n))
    p.grad = torch.ones(n)
    opt = torch.optim.AdamW([p], lr=1e-3)
    out["adam_s_per_elem"] = _timed(opt.step, reps) / n
    return out


def _time_compute(model_or_config, tp: int, toks: Sequence[int], seq: int, reps: int,
                  out: Dict[str, Any]) -> Dict[str, List[float]]:
    """The model shrunk to ``tp``, timed at each token count: ``{"tokens", "f", "fb"}``. The
    first tp size also times ``out["alone"]`` (its largest forward+backward with every rank busy,
    then on rank 0 alone)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    from .space import vocab_of

    model = _shrunk_model(model_or_config, tp)
    vocab = vocab_of(model)
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
            logits = logits_of(model(x))  # a head cut to a rank's vocabulary slice: targets within it
            F.cross_entropy(logits.flatten(0, 1).float(), x.flatten() % logits.shape[-1]).backward()
            model.zero_grad(set_to_none=True)

        row["tokens"].append(b * seq)
        row["fb"].append(_timed(fwd_bwd, reps, warm))
        # the forward (checkpointing's recompute) is timed at the first size only, and scaled
        # with the forward+backward at the others: its share of a step hardly moves with size
        row["f"].append(_timed(fwd, reps, warm) if warm else row["f"][0] * row["fb"][-1] / row["fb"][0])
        warm = False
    if "alone" not in out:  # every rank busy just now; rank 0 again while the others wait
        out["alone"] = {"busy": row["fb"][-1], "alone": _timed(fwd_bwd if rank0 else (lambda: None), reps, False)}
    return row


def _time_group(k: int, world: int, rank: int, reps: int, out: Dict[str, Any]) -> None:
    """All-reduces and ZeRO-1's parameter sync on groups of ``k`` (the world cut into such groups,
    all busy at once): ``out["allreduce"][k]``, ``out["zero_sync"][k]``."""
    import torch
    import torch.distributed as dist

    groups = [dist.new_group(list(range(i, i + k))) for i in range(0, world, k)]
    mine = groups[rank // k]
    pts = []
    for nbytes in (1 << 10, 64 << 10, 4 << 20):  # latency (ZeRO-1's per-tensor calls), then bandwidth
        t = torch.ones(nbytes // 4)
        pts.append((nbytes, _timed(lambda: dist.all_reduce(t, group=mine), reps)))
    out["allreduce"][k] = pts
    # ZeroRedundancyOptimizer's parameter sync (its ``_sync_params``): every tensor broadcast from
    # the rank that stepped it, all posted asynchronously, then waited on. Its calls queue behind
    # each other without a blocking round trip each, so it costs far less per tensor than a
    # blocking all-reduce's latency: timed as such, many small calls and a few large ones
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


def _time_p2p(world: int, rank: int, reps: int) -> List[Tuple[int, float]]:
    """One-way send/recv seconds between rank pairs (0-1, 2-3, ...) at two sizes."""
    import torch
    import torch.distributed as dist

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
    return pts


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


def _shrunk_model(model_or_config, tp: int):
    """A real model whose ``tp_plan()`` linears have one tensor-parallel rank's shape (column:
    out features / tp, row: in features / tp): what one rank computes."""

    import torch.nn as nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from .space import build_model

    model = build_model(model_or_config)  # never the user's own module
    if tp == 1:
        return model
    from ...models.hf import reads_dict_plan

    if reads_dict_plan(model):  # a transformers model: its own plan's shapes (engine/models/hf)
        from ...models.hf import resolve_plan
        from ...models.hf.planning import shrink

        return shrink(model, resolve_plan(model, None, tp)[0], tp)
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


def logits_of(out):
    """The logits of a forward: ours return ``(logits, loss)``, transformers' an output with ``.logits``."""
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, (tuple, list)) else out


def _timed(fn, reps: int, warm_up: bool = True) -> float:
    """Median seconds of ``reps`` calls (after one warm-up call), every rank starting together."""
    import torch.distributed as dist

    from ... import comm

    if warm_up:
        fn()
    times = []
    for _ in range(reps):
        if dist.is_initialized():
            comm.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
