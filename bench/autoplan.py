"""``cl.autoplan`` against an exhaustive measured grid.

    OMP_NUM_THREADS=1 python bench/autoplan.py [--presets tiny,small] [--world 4] [--batch 16]
                                               [--seq 64] [--steps 6] [--rounds 2] [--budgets 48,96]
                                               [--json out.json]

One cluster of ``--world`` gloo ranks. For each model preset:

1. **The grid.** Every layout ``autoplan`` considers (``candidates``) is boosted on the ranks and
   trained: ``--warmup`` steps, then ``--steps`` timed ones, each started together on every rank
   (tokens/s = global tokens / the median over steps of the slowest rank's seconds; the mean is in
   the JSON too). ``--rounds R`` measures the grid R times in alternating order and keeps each
   layout's fastest round (slow periods of a shared box outlast a layout's steps: one round's
   figure for a layout moved by up to ±20% between runs); "search / grid" is then taken against
   one round's time. Each rank's peak of live tensor bytes from model build through two steps (the
   second has the optimizer's state beside its activations, as every later one) is measured with
   ``cl.plan.measure`` (profiler allocation events) in a separate step before the
   timed ones, so the profiler does not slow the timing.
2. **The search**, once per budget (``--budgets``, MiB per rank): ``cl.autoplan`` with its own
   calibration on the same cluster, timed (calibration + memory plans).
   The table shows, per layout, the cost model's tokens/s, the grid's, and the search's own run
   where it verified that layout; "(model's pick)" marks what the model alone would have chosen.
3. **The verdict** per budget: the best measured layout whose measured peak fits the budget; the
   chosen layout's measured tokens/s over it (target ≥ 0.9), whether the chosen layout's measured
   peak fits (target: always), and the search's seconds over the grid's (target ≤ 0.15).

Prints a table (predicted vs measured per layout, so the cost model's error is visible) and one
JSON line per (preset, budget). Absolute times on a shared 2-core box are noise; the ratios are
the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _measure(preset: str, cand: dict, batch: int, seq: int, warmup: int, steps: int) -> dict:
    """On every rank: one layout, boosted and trained; returns seconds of the timed steps and the
    peak bytes of the first step."""
    import gc
    import time as _t

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from colossal_lab.engine import Booster
    from colossal_lab.engine.models import GPT, GPTConfig
    from colossal_lab.engine.planner import measure
    from colossal_lab.engine.planner.layout import Candidate

    c = Candidate(**cand)
    cfg = GPTConfig.preset(preset)
    local = batch // c.dp
    g = torch.Generator().manual_seed(dist.get_rank() // (c.tp * c.pp))  # one stream per dp rank
    data = [torch.randint(0, cfg.vocab_size, (local, seq), generator=g) for _ in range(2)]

    def crit(out, b):
        return F.cross_entropy(out.flatten(0, 1).float(), b["targets"].flatten())

    def step(booster, model, opt, x):
        booster.execute_pipeline(iter([{"idx": x, "targets": x.roll(-1, 1)}]), model, crit, opt)
        opt.step()
        opt.zero_grad()

    with measure() as meter:
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        booster = Booster(plugin=c.plugin())
        model, opt, *_ = booster.boost(model, opt, crit)
        # two steps: the second is training's steady state (AdamW's moments exist from the first
        # optimizer step on, beside the next step's activations); the first alone misses them
        step(booster, model, opt, data[0])
        step(booster, model, opt, data[1])
    peak = max(meter.peak.values())
    for i in range(warmup):
        step(booster, model, opt, data[i % 2])
    times = []
    for i in range(steps):
        dist.barrier()  # every rank starts each step together (as cl.autoplan's probes time them)
        t0 = _t.perf_counter()
        step(booster, model, opt, data[i % 2])
        times.append(_t.perf_counter() - t0)
    booster.plugin.close()  # every layout's process groups, or the ranks pile up gloo threads
    del model, opt, booster
    gc.collect()
    return {"step_seconds": times, "peak": peak}


def _between(peaks, i: int) -> int:
    """A budget at the quartile ``peaks[i]`` but off every measured peak: halfway to the next larger
    distinct one. A budget equal to a layout's measured peak makes "does it fit?" a coin toss on
    that layout's next measurement (peaks move by up to a few percent between runs), for the grid
    as for the search; halfway, each layout clearly fits or not."""
    above = [p for p in peaks if p > peaks[i]]
    return (peaks[i] + above[0]) // 2 if above else peaks[i]


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="samples per step, all data-parallel ranks")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per layout (enough to tell 10%% apart)")
    ap.add_argument("--budgets", default="",
                    help="MiB per rank, comma-separated (default: two per model, "
                         "near the grid's lower and upper quartile measured peaks, halfway to the next one)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="measure the grid this many times, in alternating order; a layout's figure is its "
                         "fastest round (a shared box's slow periods outlast a layout's steps and only add "
                         "time); search / grid is taken against one round's time")
    ap.add_argument("--json", default=None)
    return ap.parse_args()


def _grid(cluster, args, preset: str, cands: list, seq: int) -> tuple:
    """Every layout measured ``--rounds`` times in alternating order: ({layout: its fastest round's
    tokens/s, the largest peak, every round's tokens/s}, seconds measuring the grid once costs)."""
    from dataclasses import asdict

    grid, rounds = {}, {c: [] for c in cands}
    t0 = time.perf_counter()
    for k in range(args.rounds):
        for c in (cands if k % 2 == 0 else cands[::-1]):
            res = cluster.run(_measure, preset, asdict(c), args.batch, seq, args.warmup, args.steps)
            # a step lasts as long as its slowest rank; the median step is the round's figure
            # (a shared box's hiccups land in single steps), the mean beside it
            per_step = [max(r["step_seconds"][i] for r in res) for i in range(args.steps)]
            rounds[c].append({"tokens_per_s": args.batch * seq / statistics.median(per_step),
                              "tokens_per_s_mean": args.steps * args.batch * seq / sum(per_step),
                              "peak": max(r["peak"] for r in res)})
            print(f"  measured {preset} {c.label}: {rounds[c][-1]['tokens_per_s']:.0f} tok/s, "
                  f"peak {rounds[c][-1]['peak'] / 2**20:.1f} MiB", flush=True)
    for c, rs in rounds.items():  # the fastest round's speed; the largest peak (never flatter)
        grid[c] = {**max(rs, key=lambda r: r["tokens_per_s"]), "peak": max(r["peak"] for r in rs),
                   "rounds_tokens_per_s": [round(r["tokens_per_s"], 1) for r in rs]}
    return grid, (time.perf_counter() - t0) / args.rounds


def _model_pick(plan, budget: int):
    """What the cost model alone would have chosen (no verification runs), or None."""
    pick = min((r for r in plan.rows if r["peak_bytes"] <= budget), key=lambda r: r["predicted_s"], default=None)
    return pick["candidate"] if pick else None


def _print_layouts(plan, grid: dict, budget: int, tokens: int, chosen, best_c, model_pick) -> None:
    """Per layout: the cost model's tokens/s and planned peak beside the grid's and the search's run."""
    print(f"{'layout':36s} {'model tok/s':>11s} {'grid tok/s':>10s} {'err':>6s} {'search ran':>10s} "
          f"{'plan peak':>10s} {'grid peak':>10s} {'its peak':>9s} {'fits(grid)':>10s}")
    for r in plan.rows:
        c, g = r["candidate"], grid[r["candidate"]]
        pred = tokens / r["predicted_s"]
        err = pred / g["tokens_per_s"] - 1
        ran = f"{tokens / r['measured_s']:.0f}" if r.get("measured_s") else "-"
        its = f"{r['measured_peak'] / 2**20:.1f}M" if r.get("measured_peak") else "-"  # the search's run
        mark = " <- chosen" if c == chosen else (" <- best" if c == best_c else "")
        if c == model_pick:
            mark += " (model's pick)"
        print(f"{c.label:36s} {pred:11.0f} {g['tokens_per_s']:10.0f} {err:+6.0%} {ran:>10s} "
              f"{r['peak_bytes'] / 2**20:9.1f}M {g['peak'] / 2**20:9.1f}M "
              f"{its:>9s} "
              f"{'yes' if g['peak'] <= budget else 'no':>10s}{mark}")


def _verdict(args, preset: str, seq: int, budget: int, plan, grid: dict, grid_s: float, search_s: float,
             best_c, model_pick) -> dict:
    """The JSON line of one (preset, budget): the chosen layout against the best measured one that
    fits, the search's cost against the grid's, and the cost model's median errors."""
    fitting = {c: g for c, g in grid.items() if g["peak"] <= budget}
    chosen = plan.best
    tokens = args.batch * seq
    return {"bench": "autoplan", "preset": preset, "world": args.world, "batch": args.batch,
            "seq": seq, "budget_mib": round(budget / 2**20, 1), "grid_size": len(grid), "grid_rounds": args.rounds,
            "chosen": chosen.label if chosen else None, "best": best_c.label if best_c else None,
            "chosen_tok_s": round(grid[chosen]["tokens_per_s"], 1) if chosen else None,
            "best_tok_s": round(fitting[best_c]["tokens_per_s"], 1) if best_c else None,
            "ratio_chosen_vs_best": (round(grid[chosen]["tokens_per_s"] / fitting[best_c]["tokens_per_s"], 4)
                                     if chosen and best_c else None),
            "chosen_fits_measured": bool(chosen and grid[chosen]["peak"] <= budget),
            "layouts_run_by_search": len(plan.calibration.get("measured", [])),
            "model_only_choice": model_pick.label if model_pick else None,
            "model_only_ratio": (round(grid[model_pick]["tokens_per_s"] / fitting[best_c]["tokens_per_s"], 4)
                                 if model_pick and best_c else None),
            "model_only_fits": bool(model_pick and grid[model_pick]["peak"] <= budget),
            "search_s": round(search_s, 1), "grid_s": round(grid_s, 1),
            "search_over_grid": round(search_s / grid_s, 4),
            "calibration_s": round(plan.seconds["calibration"], 1),
            "runs_s": round(plan.seconds.get("runs", 0.0), 1),
            "memory_plans_s": round(plan.seconds["memory"], 1),
            "median_abs_time_error": round(sorted(abs(tokens / r["predicted_s"]
                                                      / grid[r["candidate"]]["tokens_per_s"] - 1)
                                                  for r in plan.rows)[len(plan.rows) // 2], 4),
            "median_abs_peak_error": round(sorted(abs(r["peak_bytes"] / grid[r["candidate"]]["peak"] - 1)
                                                  for r in plan.rows)[len(plan.rows) // 2], 4),
            "targets": {"ratio_chosen_vs_best": 0.9, "search_over_grid": 0.15}}


def _search(cluster, args, preset: str, cfg, seq: int, budget: int, grid: dict, grid_s: float) -> dict:
    """``cl.autoplan`` at one budget, timed; prints its table against the grid; returns the verdict."""
    import colossal_lab as cl

    t0 = time.perf_counter()
    plan = cl.autoplan(cfg, world_size=args.world, batch=args.batch, seq=seq, device_memory=budget,
                       cluster=cluster)
    search_s = time.perf_counter() - t0
    plan.fill_peaks()  # the table's planned peak for every layout, after the timed search
    fitting = {c: g for c, g in grid.items() if g["peak"] <= budget}
    best_c = max(fitting, key=lambda c: fitting[c]["tokens_per_s"]) if fitting else None
    chosen = plan.best
    print(f"\n{preset}, budget {budget / 2**20:.1f} MiB per rank (chosen: "
          f"{chosen.label if chosen else 'none'}; best measured: {best_c.label if best_c else 'none'})")
    model_pick = _model_pick(plan, budget)
    _print_layouts(plan, grid, budget, args.batch * seq, chosen, best_c, model_pick)
    return _verdict(args, preset, seq, budget, plan, grid, grid_s, search_s, best_c, model_pick)


def main() -> None:
    args = _parse()

    import colossal_lab as cl
    from colossal_lab.engine.models import GPTConfig
    from colossal_lab.engine.planner.layout import candidates

    out_lines = []
    with cl.launch(n=args.world, backend="gloo", threads=1) as cluster:
        for preset in args.presets.split(","):
            cfg = GPTConfig.preset(preset)
            seq = min(args.seq, cfg.block_size)
            grid, grid_s = _grid(cluster, args, preset, candidates(cfg, args.world, args.batch), seq)
            peaks = sorted(g["peak"] for g in grid.values())
            budgets = ([int(float(b) * 2**20) for b in args.budgets.split(",")] if args.budgets else
                       [_between(peaks, len(peaks) // 4), _between(peaks, (3 * len(peaks)) // 4)])
            for budget in budgets:
                line = _search(cluster, args, preset, cfg, seq, budget, grid, grid_s)
                print(json.dumps(line), flush=True)
                out_lines.append(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out_lines, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
