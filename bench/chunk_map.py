"""ChunkMap redraw rate at 8 ranks × 2 000 chunks: the wrapped strip (widgets/chunk_map.py)
against a layout with one SVG marker per chunk ("old" below), side by side in one run.

Workload, per step: every chunk of every rank gets a ChunkEvent (Gemini's chunk manager
re-sends each chunk once per step, ``ChunkManager.snapshot``), of which ``--move-frac`` of
the chunks changed tier (a move: their events also come first, as ``_moved`` emits them) and
``--state-frac`` changed state only; ``--no-snapshot`` sends only the events of the chunks
that moved or changed state (after a first step with every chunk, the warm-up placement). Both
contenders get the same events.

Kernel side, per step and contender: fold the step's events into the view's state
(``LiveView._take``), then ``redraw()``: build the figure dict, compare it with the last one,
assign it to the ``PlotlyView``'s ``figure`` trait, whose ``update`` comm message is
serialized and HMAC-signed as ipykernel does (``bench/widgets.py``'s comm). Steps alternate
which contender goes first. Reported: median seconds of the fold, of the redraw and of both,
redraws/s = 1 / median(fold + redraw), the same in CPU seconds of this thread
(``time.thread_time``: what the redraw thread takes from training, and less disturbed than
wall time by other jobs on a shared machine), and the message bytes.

Browser side (skipped with ``--no-browser`` or without Playwright/Chromium): the figure JSON
each contender sent for ``--frames`` consecutive steps is replayed in headless Chromium into
a 1280 px wide plot with plotly.js (the bundle the plotly package ships): per frame
``JSON.parse`` + ``Plotly.react`` + the next animation frame (paint), contenders alternating
in rounds. Reported: the median per frame and frames/s.

"old" is widgets/chunk_map.py at ``--old-rev`` (default: the parent of the commit that
brought the strip in, found with ``git log -S``; HEAD while that change is uncommitted),
loaded as a module of ``colossal_lab.widgets``. Ratios are new ÷ old redraws/s (> 1: the new
one redraws faster). One JSON line.

    OMP_NUM_THREADS=1 python bench/chunk_map.py
    OMP_NUM_THREADS=1 python bench/chunk_map.py --steps 20 --frames 6 --screenshot artifacts/bench
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "class StripCache"  # a line the strip's chunk_map.py has and the old one lacks


def old_rev() -> str:
    out = subprocess.run(["git", "log", "--format=%H", "-S", MARKER, "--", "widgets/chunk_map.py"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    rev = f"{out[-1]}^" if out else "HEAD"
    return subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()


def load_old(rev: str):
    """widgets/chunk_map.py at ``rev`` as ``colossal_lab.widgets._chunk_map_old`` (its relative
    imports resolve against today's ``_live`` and ``state``)."""
    src = subprocess.run(["git", "show", f"{rev}:widgets/chunk_map.py"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    if MARKER in src:
        raise SystemExit(f"--old-rev {rev}: widgets/chunk_map.py there is already the strip")
    import colossal_lab.widgets  # noqa: F401  (the package the module lives in)

    name = "colossal_lab.widgets._chunk_map_old"
    spec = importlib.util.spec_from_loader(name, loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "colossal_lab.widgets"
    sys.modules[name] = mod
    exec(compile(src, f"{rev}:widgets/chunk_map.py", "exec"), mod.__dict__)
    return mod


# ---------------------------------------------------------------- the event stream

TIER_W = (("cuda", 0.3), ("cpu", 0.5), ("nvme", 0.2))
STATES = ("hold", "free", "compute", "hold_after_bwd", "ready_for_reduce")


class Workload:
    """8 ranks × 2 000 chunks of a GPT-like model; ``step(s)`` is the events of step ``s``."""

    def __init__(self, ranks: int, chunks: int, move_frac: float, state_frac: float,
                 snapshot: bool = True, seed: int = 0):
        from colossal_lab.engine.telemetry import ChunkEvent

        self.CE, self.rng = ChunkEvent, random.Random(seed)
        self.ranks, self.n, self.move_frac, self.state_frac = ranks, chunks, move_frac, state_frac
        self.snapshot = snapshot
        tiers, weights = zip(*TIER_W)
        self.params, self.place = {}, {}
        for c in range(chunks):
            layer = c // 8
            k = self.rng.randint(1, 12)  # parameters packed in this chunk
            self.params[c] = tuple(f"model.transformer.h.{layer}.{part}.{i}.weight"
                                   for i, part in zip(range(k), ["attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                 "mlp.c_proj", "ln_1", "ln_2"] * 2))
            for r in range(ranks):
                self.place[(r, c)] = [self.rng.choices(tiers, weights)[0], "hold"]

    def _event(self, r, c, step):
        tier, state = self.place[(r, c)]
        nbytes = 4 << 20 if state != "free" else 1 << 20  # a gathered chunk vs this rank's shard
        return self.CE(r, step, c, tier, state, nbytes, self.params[c])

    def step(self, step: int) -> list:
        rng, keys = self.rng, list(self.place)
        moved = rng.sample(keys, int(self.move_frac * len(keys)))
        first = []
        for key in moved:
            p = self.place[key]
            p[0] = rng.choice([t for t, _ in TIER_W if t != p[0]])
            first.append(self._event(*key, step))  # ChunkManager._moved: the move itself
        changed = rng.sample(keys, int(self.state_frac * len(keys)))
        for key in changed:
            self.place[key][1] = rng.choice(STATES)
        if not self.snapshot and step > 0:  # step 0: the placement after warm-up, every chunk
            return first + [self._event(*key, step) for key in dict.fromkeys(moved + changed)]
        return first + [self._event(r, c, step) for r, c in keys]  # the step's snapshot


# ---------------------------------------------------------------- kernel side


def kernel_side(mods: dict, wl: Workload, steps: int, frames: int) -> tuple:
    from colossal_lab.engine.telemetry import MemorySample

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import widgets as wb  # bench/widgets.py: ipykernel's message serialization

    comm_stats = wb.install_serializing_comm()
    views = {k: m.ChunkMap(live=True, subscribe=False) for k, m in mods.items()}
    assert all(v.widget() is not None for v in views.values()), "no PlotlyView: ipywidgets/anywidget missing"
    mem = [MemorySample(r, 1.0, t, 1 << 30, 8 << 30) for r in range(wl.ranks) for t in ("cpu", "nvme")]
    warm = wl.step(0) + mem
    for v in views.values():
        v.update(warm)
    times = {k: {"fold": [], "redraw": [], "cpu": [], "bytes": []} for k in views}
    sent = {k: [] for k in views}  # figure JSON of the last ``frames`` steps, for the browser
    order = list(views)
    for s in range(1, steps + 1):
        events = wl.step(s)
        for k in (order if s % 2 else order[::-1]):
            v = views[k]
            b0 = comm_stats["bytes"]
            c0, t0 = time.thread_time(), time.perf_counter()
            v._take(list(events))
            t1 = time.perf_counter()
            v.redraw()
            t2, c2 = time.perf_counter(), time.thread_time()
            times[k]["fold"].append(t1 - t0)
            times[k]["redraw"].append(t2 - t1)
            times[k]["cpu"].append(c2 - c0)
            times[k]["bytes"].append(comm_stats["bytes"] - b0)
            if s > steps - frames:
                sent[k].append(json.dumps(v.figure_dict()))
    out = {}
    for k, t in times.items():
        tot = [a + b for a, b in zip(t["fold"], t["redraw"])]
        out[k] = {"fold_s": statistics.median(t["fold"]), "redraw_s": statistics.median(t["redraw"]),
                  "total_s": statistics.median(tot), "redraws_per_s": 1 / statistics.median(tot),
                  "build_and_send_per_s": 1 / statistics.median(t["redraw"]),
                  "cpu_s": statistics.median(t["cpu"]), "redraws_per_cpu_s": 1 / statistics.median(t["cpu"]),
                  "message_bytes": int(statistics.median(t["bytes"])),
                  "traces": len(views[k].figure_dict()["data"])}
    for v in views.values():
        v.close()
    return out, sent


# ---------------------------------------------------------------- browser side

PAGE_JS = """async ([names, rounds]) => {
  const frameDone = () => new Promise(r => requestAnimationFrame(() => r()));
  const res = {};
  for (const k of names) {
    res[k] = [];
    const div = document.getElementById(k);
    const f = JSON.parse(window.FRAMES[k][0]);
    await Plotly.newPlot(div, f.data, f.layout, {displaylogo: false});
    await frameDone();
  }
  for (let r = 0; r < rounds; r++) {
    for (const k of (r % 2 ? names.slice().reverse() : names)) {
      const div = document.getElementById(k);
      for (const s of window.FRAMES[k]) {
        const t0 = performance.now();
        const f = JSON.parse(s);
        await Plotly.react(div, f.data, f.layout, {displaylogo: false});
        await frameDone();
        res[k].push(performance.now() - t0);
      }
    }
  }
  return res;
}"""


def browser_side(sent: dict, rounds: int, screenshot: str = "") -> dict:
    import plotly
    from playwright.sync_api import sync_playwright

    bundle = os.path.join(os.path.dirname(plotly.__file__), "package_data", "plotly.min.js")
    chromium = "/usr/bin/chromium"
    if not os.path.exists(chromium):
        raise FileNotFoundError(chromium)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=[
            "--headless", "--no-sandbox", "--disable-background-networking"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1600})
            page.set_content("<!DOCTYPE html><html><body style='margin:0'>" + "".join(
                f"<div id='{k}' style='width:1280px'></div>" for k in sent) + "</body></html>")
            page.add_script_tag(path=bundle)
            page.evaluate("frames => { window.FRAMES = frames; }", sent)
            ms = page.evaluate(PAGE_JS, [list(sent), rounds])
            if screenshot:
                os.makedirs(screenshot, exist_ok=True)
                for k in sent:
                    page.locator(f"#{k}").screenshot(path=os.path.join(screenshot, f"chunk_map_{k}.png"))
        finally:
            browser.close()
    return {k: {"frame_ms": statistics.median(v), "frames_per_s": 1000 / statistics.median(v),
                "frames": len(v)} for k, v in ms.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=2000, help="chunks per rank")
    ap.add_argument("--move-frac", type=float, default=0.05, help="chunks that change tier per step")
    ap.add_argument("--state-frac", type=float, default=0.2, help="chunks that change state per step")
    ap.add_argument("--steps", type=int, default=30, help="timed steps (kernel side)")
    ap.add_argument("--frames", type=int, default=5, help="steps replayed in the browser")
    ap.add_argument("--rounds", type=int, default=3, help="browser rounds per contender")
    ap.add_argument("--no-snapshot", action="store_true",
                    help="send only the changed chunks' events, not every chunk each step")
    ap.add_argument("--old-rev", default=None, help="git revision of the old chunk_map.py")
    ap.add_argument("--no-browser", action="store_true")
    ap.add_argument("--screenshot", default="", help="folder for a PNG of each contender's plot")
    args = ap.parse_args()
    rev = args.old_rev or old_rev()
    from colossal_lab.widgets import chunk_map as new

    mods = {"new": new, "old": load_old(rev)}
    wl = Workload(args.ranks, args.chunks, args.move_frac, args.state_frac, not args.no_snapshot)
    kern, sent = kernel_side(mods, wl, args.steps, min(args.frames, args.steps))
    res = {"bench": "chunk_map", "ranks": args.ranks, "chunks_per_rank": args.chunks,
           "snapshot": not args.no_snapshot, "move_frac": args.move_frac,
           "state_frac": args.state_frac, "old_rev": rev, "kernel": kern,
           "kernel_ratio_redraws_per_s": kern["new"]["redraws_per_s"] / kern["old"]["redraws_per_s"],
           "kernel_ratio_redraws_per_cpu_s": kern["new"]["redraws_per_cpu_s"] / kern["old"]["redraws_per_cpu_s"],
           "kernel_ratio_build_and_send": kern["new"]["build_and_send_per_s"] / kern["old"]["build_and_send_per_s"],
           "message_bytes_ratio": kern["new"]["message_bytes"] / kern["old"]["message_bytes"]}
    if not args.no_browser:
        try:
            br = browser_side(sent, args.rounds, args.screenshot)
            res["browser"] = br
            res["browser_ratio_frames_per_s"] = br["new"]["frames_per_s"] / br["old"]["frames_per_s"]
        except (ImportError, FileNotFoundError) as exc:
            res["browser"] = f"skipped: {exc!r}"
    print(json.dumps(res))


if __name__ == "__main__":
    main()
