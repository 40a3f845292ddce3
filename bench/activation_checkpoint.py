"""Activation checkpointing within a budget: the planned plan against every uniform policy.

    python bench/activation_checkpoint.py [--preset small] [--n-layer 8] [--batch 8] [--seq 256]
                                          [--budgets 9] [--rounds 5] [--h2h 32] [--json out.jsonl]

One process, one GPT (``GPTConfig.preset(preset, n_layer=...)``, CPU), one fixed batch. Contenders:

* uniform policies: checkpoint every k-th block (blocks ``i % k == 0``) for every k = 1..n_layer,
  and none; each one's peak is measured once,
* ours: ``autockpt.profile_checkpointing`` once, then ``solve`` per budget, for budgets spread
  evenly from the measured peak of checkpointing every block to that of checkpointing none.

A step is one forward + loss + backward with the parameters' gradients already allocated (as after
a first step); its peak is ``colossal_lab.engine.planner.memory.measure`` (the profiler's allocator events: bytes
allocated by the step and live, above what was live before it). Tokens/s: every distinct set of
checkpointed blocks is timed in ``--rounds`` interleaved rounds (order shuffled per round, one
untimed step before each timed one) and the median counts; a plan equal to a uniform policy's set
is that policy's measurement. Tokens/s is per CPU second of this process (``time.process_time``:
on a shared machine the wall clock mostly measures the neighbours), median over rounds; also
reported: the least CPU time over rounds (``*_best``: contention only adds time) and the median
wall time (``*_wall``), each with its own best uniform policy. Per budget one JSON line: our plan,
its predicted and measured peak, whether it held, our tokens/s, the best uniform policy whose
measured peak fits the same budget, and the ratio ours / best uniform. A last line sums up (every
peak held? the least ratio) with a noise floor: the largest tokens/s difference between two uniform
policies that recompute as many (identical) blocks (k=5 and k=6 both recompute two). A markdown
table goes to stderr.

**Head-to-head** (``--h2h N``, the verdict's resolution). On a shared machine a step's CPU time
moves ±10% from one step to the next (neighbours' load slows the core itself), while at some
budgets our plan and the best uniform policy differ by under 1% of a step: rounds of every set
cannot resolve that. So, per budget, our plan meets its rival, the fitting uniform policy that
recomputes the fewest blocks (the blocks are identical, so fewer is faster; among as many, the
faster in the rounds), alternated step by step in random order, ``N`` timed steps each, and each
side's least CPU time counts (``ratio_h2h``; a plan equal to its rival is 1.0). A control duel of
two uniform policies doing the same work (the first pair recomputing as many blocks: k=4 and k=5)
shows what the duel resolves (``h2h_control``). With ``--rounds 7 --h2h 32`` the small GPT's run
takes ~35 minutes on a 2-core CPU; measured figures are in docs/activation_checkpointing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from colossal_lab.engine.autockpt import min_peak, profile_checkpointing, solve  # noqa: E402
from colossal_lab.engine.models import GPT, GPTConfig  # noqa: E402
from colossal_lab.engine.planner import measure  # noqa: E402


def _parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--budgets", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile-repeats", type=int, default=2)
    ap.add_argument("--h2h", type=int, default=32,
                    help="head-to-head: timed steps each of ours and its rival per budget (0: none)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    ap.add_argument("--json", default=None, help="also write the JSON lines here")
    return ap.parse_args(argv)


Blocks = Tuple[int, ...]  # a set of checkpointed blocks, sorted


class _Workload:
    """One GPT in training mode and one fixed batch, with the parameters' gradients already
    allocated (as after a first step): a step's peak and its time for any set of checkpointed
    blocks."""

    def __init__(self, a: argparse.Namespace):
        torch.manual_seed(0)
        self.cfg = GPTConfig.preset(a.preset, n_layer=a.n_layer)
        self.model = GPT(self.cfg).train()
        self.idx = torch.randint(0, self.cfg.vocab_size, (a.batch, a.seq))
        self.tgt = torch.randint(0, self.cfg.vocab_size, (a.batch, a.seq))
        self.tokens = a.batch * a.seq
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def step(self) -> None:
        logits, loss = self.model(self.idx, self.tgt)
        loss.backward()
        del logits, loss

    def use(self, layers: Blocks) -> None:
        self.model.enable_activation_checkpointing(list(layers))

    def peak_of(self, layers: Blocks) -> int:
        self.use(layers)
        self.step()
        with measure() as m:
            self.step()
        return int(m.peak["cpu"])

    def timed(self, layers: Blocks) -> Tuple[float, float]:
        """(CPU seconds, wall seconds) of one step with ``layers`` checkpointed, after an untimed one."""
        self.use(layers)
        self.step()
        t, c = time.perf_counter(), time.process_time()
        self.step()
        return time.process_time() - c, time.perf_counter() - t


@dataclass
class _Results:
    """What was measured, by block set."""

    uniform: Dict[Blocks, str]               # the uniform policies' sets -> name ("none", "k=1", ...)
    peaks: Dict[Blocks, int]                 # measured peak bytes of a step
    cpu: Dict[Blocks, List[float]]           # CPU seconds of a step, one per round
    wall: Dict[Blocks, List[float]]          # wall seconds of a step, one per round
    tok: Dict[str, Dict[Blocks, float]]      # estimator suffix ("", "_best", "_wall") -> tokens/s
    h2h: Dict[Tuple[Blocks, Blocks], tuple]  # (ours, rival) -> (ours' CPU s, rival's CPU s) per step
    control: Optional[tuple] = None          # the control duel's (CPU s, CPU s), or None


def _uniform_policies(L: int) -> Dict[Blocks, str]:
    """Distinct block sets of the uniform policies (none, every k-th block for k = 1..L), each
    named after the first policy that gives it."""
    configs = {"none": ()}
    for k in range(1, L + 1):
        configs[f"k={k}"] = tuple(i for i in range(L) if i % k == 0)
    uniform: Dict[Blocks, str] = {}
    for name, layers in configs.items():
        uniform.setdefault(layers, name)
    return uniform


def _same_work_pairs(uniform: Dict[Blocks, str]) -> List[Tuple[Blocks, Blocks]]:
    """Pairs of uniform policies that recompute as many (identical, so equally costly) blocks."""
    return [(x, y) for x in uniform for y in uniform if x < y and x and len(x) == len(y)]


def _plans(prof, full: int, none: int, n: int) -> tuple:
    """``n`` budgets spread evenly from checkpointing every block's peak to none's, and ``solve``'s
    plan for each (or its ``ValueError`` where the profile predicts no plan reaches the budget)."""
    budgets = [int(full + (none - full) * i / max(1, n - 1)) for i in range(n)]
    plans = []
    for b in budgets:
        try:
            plans.append(solve(prof, b))
        except ValueError as e:  # below what the profile predicts any plan reaches: reported, not hidden
            plans.append(e)
    return budgets, plans


def _rounds(w: _Workload, sets: List[Blocks], rounds: int, rng: random.Random) -> tuple:
    """({set: CPU seconds per round}, {set: wall seconds per round}): every set timed once per
    round, in an order shuffled per round."""
    cpu: Dict[Blocks, List[float]] = {s: [] for s in sets}
    wall: Dict[Blocks, List[float]] = {s: [] for s in sets}
    for _ in range(rounds):
        order = sets[:]
        rng.shuffle(order)
        for s in order:
            c, t = w.timed(s)
            cpu[s].append(c)
            wall[s].append(t)
    return cpu, wall


def _tokens_per_s(cpu, wall, tokens: int) -> Dict[str, Dict[Blocks, float]]:
    """Three estimators of a set's tokens/s, each reported: the median CPU time (the headline), the
    least CPU time (contention only ever adds time, so best-of-rounds is timeit's estimate of a
    set's own cost), the median wall time."""
    est = {"": (cpu, statistics.median), "_best": (cpu, min), "_wall": (wall, statistics.median)}
    return {sfx: {s: tokens / agg(v) for s, v in src.items()} for sfx, (src, agg) in est.items()}


def _rival(uniform, peaks, tok, budget: int) -> Optional[Blocks]:
    """The fitting uniform policy that recomputes the fewest blocks (identical blocks: fewer is
    faster; among as many, the faster in the rounds), or None when none fits."""
    fits = [u for u in uniform if peaks[u] <= budget]
    return min(fits, key=lambda u: (len(u), -tok[""][u])) if fits else None


def _duel(w: _Workload, x: Blocks, y: Blocks, n: int, rng: random.Random) -> tuple:
    """``n`` timed steps each of ``x`` and ``y``, alternated in random order so that both meet the
    same slow periods: (x's CPU seconds, y's CPU seconds)."""
    tx, ty = [], []
    for _ in range(n):
        for s in rng.sample([x, y], 2):
            (tx if s == x else ty).append(w.timed(s)[0])
    return tx, ty


def _head_to_head(w: _Workload, n: int, budgets, plans, uniform, peaks, tok, rng) -> tuple:
    """The verdict's resolution: per budget, our plan against its rival (``_rival``), ``n`` timed
    steps each; and a control duel of the first pair of uniform policies doing the same work,
    which shows what a duel resolves. Returns ({(ours, rival): duel}, control duel or None)."""
    h2h = {}
    for b, plan in zip(budgets, plans):
        if isinstance(plan, Exception):
            continue
        rival = _rival(uniform, peaks, tok, b)
        if rival is None:
            continue
        ours_s = tuple(plan.layers)
        if ours_s != rival and (ours_s, rival) not in h2h:
            h2h[(ours_s, rival)] = _duel(w, ours_s, rival, n, rng)
    same = _same_work_pairs(uniform)
    return h2h, (_duel(w, *same[0], n, rng) if same else None)


def _row(a: argparse.Namespace, L: int, i: int, b: int, plan, r: _Results) -> dict:
    """The JSON line of budget ``i`` (``b`` bytes): our plan, its peaks, every estimator's ratio to
    the best fitting uniform policy, and the head-to-head's."""
    row = {"bench": "activation_checkpoint", "preset": a.preset, "n_layer": L, "batch": a.batch, "seq": a.seq,
           "budget": b, "budget_frac": round(i / max(1, a.budgets - 1), 3)}
    if isinstance(plan, Exception):
        row.update(plan=None, error=str(plan), peak_ok=False)
    else:
        s = tuple(plan.layers)
        row.update(plan=list(plan.layers), same_as_uniform=r.uniform.get(s), predicted_peak=plan.predicted_peak,
                   measured_peak=r.peaks[s], peak_ok=r.peaks[s] <= b,
                   predicted_recompute_ms=round(plan.predicted_recompute_s * 1e3, 2))
    for sfx, t in r.tok.items():
        fits = [(t[u], r.uniform[u]) for u in r.uniform if r.peaks[u] <= b]
        best_tok, best_name = max(fits) if fits else (None, None)
        ours_tok = None if isinstance(plan, Exception) else t[tuple(plan.layers)]
        row.update({f"ours_tokens_s{sfx}": round(ours_tok, 1) if ours_tok else None,
                    f"best_uniform{sfx}": best_name,
                    f"best_uniform_tokens_s{sfx}": round(best_tok, 1) if best_tok else None,
                    f"ratio{sfx}": round(ours_tok / best_tok, 4) if ours_tok and best_tok else None})
    if a.h2h > 0 and not isinstance(plan, Exception):
        rival = _rival(r.uniform, r.peaks, r.tok, b)
        if rival is not None:
            ours_s = tuple(plan.layers)
            if ours_s == rival:
                ratio = 1.0
            else:
                tx, ty = r.h2h[(ours_s, rival)]
                ratio = min(ty) / min(tx)
            row.update(h2h_rival=r.uniform[rival], ratio_h2h=round(ratio, 4))
    return row


def _summary(a: argparse.Namespace, lines: List[dict], r: _Results) -> dict:
    """The last JSON line's verdict: every peak held? the least ratio per estimator, with a noise
    floor (the largest tokens/s difference between two uniform policies doing the same work)."""
    summary = {"bench": "activation_checkpoint", "summary": True, "budgets": len(lines),
               "all_peaks_within_budget": all(row["peak_ok"] for row in lines)}
    same = _same_work_pairs(r.uniform)
    for sfx, t in r.tok.items():
        ratios = [row[f"ratio{sfx}"] for row in lines if row[f"ratio{sfx}"] is not None]
        dev = [abs(1 - t[x] / t[y]) for x, y in same]
        summary.update({f"all_at_least_best_uniform{sfx}": all(x >= 1.0 for x in ratios) and len(ratios) == len(lines),
                        f"min_ratio{sfx}": min(ratios) if ratios else None,
                        f"median_ratio{sfx}": statistics.median(ratios) if ratios else None,
                        f"noise_same_cost{sfx}": round(max(dev), 4) if dev else None})
    if a.h2h > 0:
        h = [row.get("ratio_h2h") for row in lines]
        summary.update({"all_at_least_best_uniform_h2h": all(x is not None and x >= 1.0 for x in h),
                        "min_ratio_h2h": min((x for x in h if x is not None), default=None),
                        "h2h_steps": a.h2h,
                        "h2h_control": None if r.control is None else
                        {"pair": [r.uniform[same[0][0]], r.uniform[same[0][1]]],
                         "ratio": round(min(r.control[1]) / min(r.control[0]), 4)},
                        "h2h_seconds": {f"{','.join(map(str, x)) or 'none'} vs {r.uniform[y]}":
                                        {"ours": [round(v, 4) for v in tx], "rival": [round(v, 4) for v in ty]}
                                        for (x, y), (tx, ty) in r.h2h.items()}})
    return summary


def _measurements(r: _Results) -> dict:
    """The summary's raw figures: each uniform policy's blocks, peak and tokens/s, and every set's
    step seconds per round."""
    return {"uniform": {r.uniform[s]: {"blocks": list(s), "peak": r.peaks[s],
                                       **{f"tokens_s{sfx}": round(t[s], 1) for sfx, t in r.tok.items()}}
                        for s in r.uniform},
            "step_seconds": {("none" if not s else ",".join(map(str, s))):
                             {"cpu": [round(x, 4) for x in r.cpu[s]], "wall": [round(x, 4) for x in r.wall[s]]}
                             for s in r.cpu}}


def _emit(rows: List[dict], path: Optional[str]) -> None:
    """JSON lines to stdout, and to ``path`` too when given."""
    out = open(path, "w") if path else None
    for row in rows:
        print(json.dumps(row))
        if out:
            out.write(json.dumps(row) + "\n")
    if out:
        out.close()


def _print_table(lines: List[dict], summary: dict, h2h: int) -> None:
    """A readable table (stderr, so stdout stays JSON lines)."""
    print("\n| budget MiB | plan (blocks recomputed) | predicted MiB | measured MiB | held | ours tok/s (CPU) "
          "| best uniform | its tok/s | ratio | ratio (CPU best-of) | ratio (wall) | head-to-head |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|", file=sys.stderr)
    for r in lines:
        plan = r.get("plan")
        plan = "none" if plan == [] else ", ".join(map(str, plan)) if plan else r.get("error", "")[:40]
        print(f"| {r['budget'] / 2**20:.1f} | {plan} | {(r.get('predicted_peak') or 0) / 2**20:.1f} "
              f"| {(r.get('measured_peak') or 0) / 2**20:.1f} | {'yes' if r['peak_ok'] else 'NO'} "
              f"| {r['ours_tokens_s'] or 0:.0f} | {r['best_uniform']} | {r['best_uniform_tokens_s'] or 0:.0f} "
              f"| {r['ratio'] or 0:.3f} | {r['ratio_best'] or 0:.3f} ({r['best_uniform_best']}) "
              f"| {r['ratio_wall'] or 0:.3f} ({r['best_uniform_wall']}) "
              f"| {r.get('ratio_h2h') or 0:.3f} ({r.get('h2h_rival')}) |", file=sys.stderr)
    if h2h > 0 and summary.get("h2h_control"):
        c = summary["h2h_control"]
        print(f"head-to-head control, the same work: {c['pair'][0]} / {c['pair'][1]} = {c['ratio']:.4f}",
              file=sys.stderr)


def main(argv=None) -> int:
    a = _parse(argv)
    torch.set_num_threads(a.threads)
    w = _Workload(a)
    L = w.cfg.n_layer
    uniform = _uniform_policies(L)
    peaks = {layers: w.peak_of(layers) for layers in uniform}
    full, none = peaks[tuple(range(L))], peaks[()]  # checkpointing every block (k=1), and none

    t0 = time.perf_counter()
    prof = profile_checkpointing(w.model, (w.idx, w.tgt), repeats=a.profile_repeats)
    profile_s = time.perf_counter() - t0
    print(prof.table(), file=sys.stderr)

    budgets, plans = _plans(prof, full, none, a.budgets)
    ours = {tuple(p.layers) for p in plans if not isinstance(p, Exception)}
    print(repr(plans[len(plans) // 2]), file=sys.stderr)
    for layers in ours:
        if layers not in peaks:
            peaks[layers] = w.peak_of(layers)

    # tokens/s: every distinct set, interleaved rounds, median; per CPU second of this process
    # (what a busy shared machine barely disturbs) and per wall second
    rng = random.Random(0)
    cpu, wall = _rounds(w, sorted(set(peaks), key=str), a.rounds, rng)
    tok = _tokens_per_s(cpu, wall, w.tokens)
    h2h, control = (_head_to_head(w, a.h2h, budgets, plans, uniform, peaks, tok, rng) if a.h2h > 0
                    else ({}, None))
    r = _Results(uniform, peaks, cpu, wall, tok, h2h, control)

    lines = [_row(a, L, i, b, plan, r) for i, (b, plan) in enumerate(zip(budgets, plans))]
    summary = _summary(a, lines, r)
    summary.update({"peak_none": none, "peak_every_block": full, "predicted_lowest_peak": min_peak(prof)[0],
                    "profile_s": round(profile_s, 2), "rounds": a.rounds, "threads": a.threads,
                    **_measurements(r)})
    _emit(lines + [summary], a.json)
    _print_table(lines, summary, a.h2h)
    return 0 if summary["all_peaks_within_budget"] else 1


if __name__ == "__main__":
    sys.exit(main())
