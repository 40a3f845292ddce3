"""What the engine's telemetry costs training when someone listens, with nobody drawing.

The tiny GPT boosted with GeminiPlugin (CPU + NVMe tiers, so chunks change tier and ChunkEvents
flow every step) in one process; two contenders in alternating blocks: ``emit`` (a bus
subscriber that only counts events, so Gemini, the optimizer wrapper and StepMetrics build and
emit theirs) and ``none`` (no subscriber: the engine builds nothing). ``bench/widgets.py
--emit-only`` has the same contender beside a live dashboard; this one isolates it, with more
blocks in the same time.

    OMP_NUM_THREADS=1 python bench/telemetry_cost.py --blocks 60
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from datetime import timedelta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=60, help="blocks per contender")
    ap.add_argument("--steps", type=int, default=10, help="steps per block")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch.distributed as dist

    import widgets as wb  # bench/widgets.py: the same model and step
    from colossal_lab.engine import telemetry

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    step, cleanup, seq = wb._build("tiny", 1 << 20, 0.125, 8, 64)
    tok_s = {"emit": [], "none": []}
    cpu = {"emit": 0.0, "none": 0.0}
    secs = {"emit": 0.0, "none": 0.0}
    seen: collections.Counter = collections.Counter()
    try:
        for i in range(3):
            step(i)
        for b in range(args.blocks):
            for c in (("emit", "none") if b % 2 == 0 else ("none", "emit")):
                unsub = (telemetry.subscribe(lambda e: seen.update((type(e).__name__,)))
                         if c == "emit" else None)
                c0, t0 = time.process_time(), time.perf_counter()
                for i in range(args.steps):
                    step(i)
                dt = time.perf_counter() - t0
                cpu[c] += time.process_time() - c0
                secs[c] += dt
                if unsub:
                    unsub()
                tok_s[c].append(args.steps * 8 * seq / dt)
    finally:
        cleanup()
        dist.destroy_process_group()
    med = {c: statistics.median(v) for c, v in tok_s.items()}
    print(json.dumps({
        "bench": "telemetry_cost", "blocks_per_contender": args.blocks, "steps_per_block": args.steps,
        "ratio": round(med["emit"] / med["none"], 4),
        "paired_ratio_median": round(statistics.median(a / b for a, b in zip(tok_s["emit"], tok_s["none"])), 4),
        "pooled_ratio": round(secs["none"] / secs["emit"], 4),
        "cpu_per_token_ratio": round(cpu["emit"] / cpu["none"], 4),
        "tok_s_emit_median": round(med["emit"], 1), "tok_s_none_median": round(med["none"], 1),
        "events_per_step": {k: round(v / (args.blocks * args.steps), 1) for k, v in seen.items()}}))


if __name__ == "__main__":
    main()
