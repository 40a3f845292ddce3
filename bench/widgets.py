"""Training tokens/s with the live dashboard attached vs without (target >= 0.97x).

Same run shape for both contenders: the tiny/small GPT boosted with GeminiPlugin (CPU + NVMe
tiers, so ChunkEvents flow every step), one rank on a gloo group. "attached" = a live
``Dashboard(live=True)`` subscribed to this process's telemetry bus with its four redraw
threads running, each redraw building the figure dict and its plotly mime bundle for the
``ipywidgets.Output`` (exactly the work done in a kernel; outside a kernel the comm message
is simply not sent). Contenders alternate, the order flips each repeat; each repeat builds a
fresh model and booster and times ``--steps`` steps after ``--warmup``.

Prints one JSON line: ratio = median tokens/s attached / median tokens/s detached, the raw
medians, and the redraw rate achieved (redraws per second per view that had events to draw, and per
view; the timeline stays idle here since Gemini emits no StageSpans), and events per second.

    OMP_NUM_THREADS=1 python bench/widgets.py --preset tiny --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from colossal_lab.engine import Booster, telemetry
from colossal_lab.engine.models import GPT, GPTConfig
from colossal_lab.engine.plugins import GeminiPlugin
from colossal_lab.widgets import Dashboard


def run(args, attached: bool) -> dict:
    torch.manual_seed(0)
    nvme = tempfile.mkdtemp(prefix="bench_widgets_")
    cfg = GPTConfig.preset(args.preset)
    model = GPT(cfg)
    plugin = GeminiPlugin(placement_policy="auto", precision="fp32",
                          device_memory_limit=args.device_memory_limit, chunk_size_mb=args.chunk_mb,
                          nvme_offload_dir=nvme, nvme_offload_frac=1.0)
    booster = Booster(plugin=plugin)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gm, gopt, *_ = booster.boost(model, opt)
    seq = min(args.seq, cfg.block_size)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, seq), generator=g) for _ in range(4)]
    events = [0]
    count = telemetry.subscribe(lambda e: events.__setitem__(0, events[0] + 1))
    dash = Dashboard(live=True, max_hz=args.max_hz) if attached else None
    try:
        def step(i):
            x = batches[i % len(batches)]
            _, loss = gm(x, x.roll(-1, 1))
            booster.backward(loss, gopt)
            gopt.step()
            gopt.zero_grad()

        for i in range(args.warmup):
            step(i)
        r0 = dict(dash.redraw_counts) if dash else {}
        b0 = sum(v._throttle.busy_s for v in dash.views.values()) if dash else 0.0
        e0 = events[0]
        t0 = time.perf_counter()
        for i in range(args.steps):
            step(i)
        dt = time.perf_counter() - t0
        out = {"tok_s": args.steps * args.batch * seq / dt, "seconds": dt, "events": events[0] - e0}
        if dash:
            per = {k: (v - r0[k]) / dt for k, v in dash.redraw_counts.items()}
            out["redraws_per_s_by_view"] = per
            # views that had anything to draw (no StageSpans without a pipeline: timeline idle)
            active = [v for v in per.values() if v > 0]
            out["redraws_per_s_per_view"] = sum(active) / max(1, len(active))
            out["redraw_busy_frac"] = (sum(v._throttle.busy_s for v in dash.views.values()) - b0) / dt
            out["errors"] = sum(len(v._throttle.errors) for v in dash.views.values())
        return out
    finally:
        count()
        if dash:
            dash.close()
        plugin.close()
        shutil.rmtree(nvme, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-hz", type=float, default=5.0)
    ap.add_argument("--device-memory-limit", type=int, default=1 << 20, help="bytes")
    ap.add_argument("--chunk-mb", type=float, default=0.125)
    args = ap.parse_args()
    if args.repeats < 1 or args.steps < 1:
        ap.error("--repeats and --steps must be >= 1")
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    res = {True: [], False: []}
    try:
        for r in range(args.repeats):
            for attached in ((True, False) if r % 2 == 0 else (False, True)):
                res[attached].append(run(args, attached))
    finally:
        dist.destroy_process_group()
    on = statistics.median(x["tok_s"] for x in res[True])
    off = statistics.median(x["tok_s"] for x in res[False])
    paired = [a["tok_s"] / b["tok_s"] for a, b in zip(res[True], res[False])]
    print(json.dumps({
        "bench": "widgets", "preset": args.preset, "batch": args.batch, "seq": args.seq,
        "steps": args.steps, "repeats": args.repeats, "max_hz": args.max_hz,
        "ratio": round(on / off, 4), "paired_ratio_median": round(statistics.median(paired), 4),
        "tok_s_attached_median": round(on, 1), "tok_s_detached_median": round(off, 1),
        "events_per_s": round(statistics.median(x["events"] / x["seconds"] for x in res[True]), 1),
        "redraws_per_s_per_active_view": round(statistics.median(x["redraws_per_s_per_view"] for x in res[True]), 2),
        "redraws_per_s_by_view": {k: round(statistics.median(x["redraws_per_s_by_view"][k] for x in res[True]), 2)
                                  for k in res[True][0]["redraws_per_s_by_view"]},
        "redraw_busy_frac_all_views": round(statistics.median(x["redraw_busy_frac"] for x in res[True]), 4),
        "redraw_errors": sum(x["errors"] for x in res[True]),
        "target": 0.97}))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
