"""``cl.plan`` against reality: predicted vs measured peak bytes per plugin, rank and tier.

    python bench/plan.py [--preset small] [--batch 2] [--seq 64] [--steps 3] [--cases ddp,zero2,...]
                         [--json out.json]

Two real gloo ranks train a GPT ``--steps`` steps (AdamW) under each plugin in turn — DDP, ZeRO-1,
ZeRO-2, Gemini ``cpu``, Gemini ``auto`` + NVMe (a RAM budget below the model, every optimizer
state on disk), hybrid tp=2, hybrid pp=2 (1F1B) — in one run. Each rank measures itself with
``colossal_lab.engine.planner.memory.measure`` from before the model is built: the peak of live tensor bytes its
CPU allocator holds after ``boost`` (profiler allocation events, not RSS) and the most bytes its
NVMe directory held (files, sampled every 2 ms). The parent predicts the same runs with
``cl.plan`` (on fake tensors: nothing allocated) and prints a table — predicted, measured, error
— and one JSON line per (case, rank, tier) plus a summary line with the largest error.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (plugin kind, plugin kwargs, Booster mixed_precision, batch multiplier)
CASES = {
    "ddp": ("ddp", {}, None),
    "zero1": ("zero", {"stage": 1}, None),
    "zero2": ("zero", {"stage": 2}, None),
    "gemini_cpu": ("gemini", {"placement_policy": "cpu", "precision": "fp32", "chunk_size_mb": 2}, None),
    "gemini_cpu_one_chunk": ("gemini", {"placement_policy": "cpu", "precision": "fp32"}, None),
    "gemini_auto_nvme": ("gemini", {"placement_policy": "auto", "precision": "fp32", "nvme": True,
                                    "nvme_offload_frac": 1.0, "device_memory_limit": 24 << 20}, None),
    "gemini_auto_nvme_bf16": ("gemini", {"placement_policy": "auto", "precision": "bf16", "nvme": True,
                                         "nvme_offload_frac": 1.0, "device_memory_limit": 24 << 20}, None),
    "gemini_auto_nvme_params": ("gemini", {"placement_policy": "auto", "precision": "fp32", "nvme": True,
                                           "nvme_offload_frac": 1.0, "device_memory_limit": 8 << 20}, None),
    "ddp_bf16": ("ddp", {}, "bf16"),
    "hybrid_tp2": ("hybrid", {"tp_size": 2}, None),
    "hybrid_pp2": ("hybrid", {"pp_size": 2, "num_microbatches": 2}, None),
    "hybrid_pp2_gpipe_ac": ("hybrid", {"pp_size": 2, "num_microbatches": 2, "pp_style": "gpipe",
                                       "activation_checkpointing": True}, None),
}
DEFAULT = ["ddp", "zero1", "zero2", "gemini_cpu", "gemini_auto_nvme", "hybrid_tp2", "hybrid_pp2"]


def crit(out, batch):
    return F.cross_entropy(out.flatten(0, 1).float(), batch["targets"].flatten())


def make_plugin(name: str, nvme_dir: str):
    from colossal_lab.engine.plugins import DDPPlugin, GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin

    kind, kw, _ = CASES[name]
    kw = dict(kw)
    if kind == "ddp":
        return DDPPlugin(**kw)
    if kind == "zero":
        return LowLevelZeroPlugin(**kw)
    if kind == "gemini":
        if kw.pop("nvme", False):
            kw["nvme_offload_dir"] = nvme_dir
        return GeminiPlugin(**kw)
    return HybridParallelPlugin(**kw)


def measure_case(rank: int, name: str, cfg, batch: int, seq: int, steps: int, nvme_dir: str) -> dict:
    """Build, boost and train ``steps`` steps under case ``name`` inside ``measure``; the peaks
    after boost (everything allocated since the model was built still counts as live)."""
    from colossal_lab.engine import Booster
    from colossal_lab.engine.models import GPT
    from colossal_lab.engine.planner import measure

    kind, _, mp_ = CASES[name]
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, cfg.vocab_size, (batch, seq), generator=g) for _ in range(steps)]
    plugin = make_plugin(name, nvme_dir)
    nvme = plugin.nvme_offload_dir if kind == "gemini" else None
    t0 = time.perf_counter()
    with measure(nvme_dir=nvme) as meter:
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        booster = Booster(plugin=plugin, mixed_precision=mp_)
        model, opt, *_ = booster.boost(model, opt, crit)
        meter.start_window()
        store = plugin._managers[0].nvme if kind == "gemini" and plugin._managers else None
        io = []  # (bytes read, bytes written) of the NVMe store before each step
        for x in data:
            if store is not None:
                store_io = (store.bytes_read, store.bytes_written)
                io.append(store_io)
            if kind == "hybrid":
                booster.execute_pipeline(iter([{"idx": x, "targets": x}]), model, crit, opt)
            else:
                _, loss = model(x, x)
                booster.backward(loss, opt)
                del _, loss
            opt.step()
            opt.zero_grad()
        if store is not None:
            store._pool.submit(lambda: None).result()  # writes behind the last step have landed
            io.append((store.bytes_read, store.bytes_written))
        if kind == "gemini":
            plugin.close()
        del model, opt, booster
        gc.collect()  # what is still live now was kept by something (reported as left_live)
    step_io = None
    if store is not None and len(io) >= 2:  # the last (steady) step's NVMe traffic
        step_io = {"nvme->cpu": io[-1][0] - io[-2][0], "cpu->nvme": io[-1][1] - io[-2][1]}
    return {"case": name, "rank": rank, "peak": dict(meter.peak), "final": meter.final,
            "nvme_io": step_io, "seconds": time.perf_counter() - t0}


def predict_case(name: str, cfg, batch: int, seq: int, world: int, nvme_dir: str):
    import colossal_lab as cl

    _, _, mp_ = CASES[name]
    return cl.plan(cfg, make_plugin(name, nvme_dir), world_size=world, batch=batch, seq=seq, precision=mp_)


def _rank_main(rank, world, port, names, preset, batch, seq, steps, nvme_root, q):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    sys.path.insert(0, ROOT)
    from colossal_lab.engine.models import GPTConfig

    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        out = []
        for n in names:
            d = os.path.join(nvme_root, n)
            os.makedirs(d, exist_ok=True)
            out.append(measure_case(rank, n, GPTConfig.preset(preset), batch, seq, steps, d))
            dist.barrier()
        q.put((rank, out))
    finally:
        dist.destroy_process_group()


def run(names, preset="small", batch=2, seq=64, steps=3, world=2):
    """Measure every case on ``world`` gloo ranks and predict it; rows of dicts."""
    from colossal_lab.engine.models import GPTConfig

    nvme_root = tempfile.mkdtemp(prefix="plan-bench-")
    try:
        ctx = mp.get_context("spawn")
        store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=60))
        q = ctx.Queue()
        procs = [ctx.Process(target=_rank_main, args=(r, world, store.port, names, preset, batch, seq, steps,
                                                      nvme_root, q)) for r in range(world)]
        for p in procs:
            p.start()
        measured = dict(q.get(timeout=1800) for _ in range(world))
        for p in procs:
            p.join()
        rows = []
        for n in names:
            plan = predict_case(n, GPTConfig.preset(preset), batch, seq, world, os.path.join(nvme_root, n))
            for r in range(world):
                res = next(x for x in measured[r] if x["case"] == n)
                for tier, meas in res["peak"].items():
                    if tier not in plan.tiers:
                        continue
                    pred = plan.peak(tier, rank=r)
                    g = plan.rank_plan(r).tiers[tier]
                    rows.append({"case": n, "rank": r, "tier": tier, "predicted": pred, "measured": meas,
                                 "error_pct": round(100.0 * (pred - meas) / meas, 2) if meas else None,
                                 "phase": g.phase,
                                 "by_category": {c: getattr(g, c) for c in
                                                 ("params", "grads", "optimizer", "activations", "working")},
                                 "left_live": res["final"]})
            for r in range(world):
                res = next(x for x in measured[r] if x["case"] == n)
                for k, v in (res.get("nvme_io") or {}).items():
                    pred = plan.traffic.get(k, 0)
                    rows.append({"case": n, "rank": r, "traffic": k, "predicted": pred, "measured": v,
                                 "error_pct": round(100.0 * (pred - v) / v, 2) if v else None})
        return rows
    finally:
        shutil.rmtree(nvme_root, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cases", default=",".join(DEFAULT), help=f"comma list of {list(CASES)}")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    a = ap.parse_args()
    names = [n for n in a.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    t0 = time.time()
    rows = run(names, a.preset, a.batch, a.seq, a.steps)
    mib = float(1 << 20)
    print(f"{'case':24s} {'rank':>4s} {'tier':5s} {'predicted':>12s} {'measured':>12s} {'error':>8s}  phase")
    mem = [r for r in rows if "tier" in r]
    for r in mem:
        print(f"{r['case']:24s} {r['rank']:4d} {r['tier']:5s} "
              f"{r['predicted'] / mib:9.2f} MiB {r['measured'] / mib:9.2f} MiB "
              f"{r['error_pct']:+7.1f}%  {r['phase']}")
    traffic = [r for r in rows if "traffic" in r]
    if traffic:
        print("NVMe traffic of one steady step (the store's own byte counters):")
        for r in traffic:
            print(f"{r['case']:24s} {r['rank']:4d} {r['traffic']:9s} {r['predicted'] / mib:9.2f} MiB "
                  f"{r['measured'] / mib:9.2f} MiB {r['error_pct']:+7.1f}%")
    for r in rows:
        print(json.dumps(r))
    worst = max(mem, key=lambda r: abs(r["error_pct"] or 0))
    print(json.dumps({"summary": True, "preset": a.preset, "batch": a.batch, "seq": a.seq, "steps": a.steps,
                      "rows": len(mem), "max_abs_error_pct": abs(worst["error_pct"]),
                      "worst": f"{worst['case']} rank {worst['rank']} {worst['tier']}",
                      "within_10pct": all(abs(r["error_pct"]) <= 10 for r in mem),
                      "seconds": round(time.time() - t0, 1)}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
