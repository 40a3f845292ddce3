"""Gemini chunk order: execution order (re-packed at the first step) vs registration order.

The model is the reference GPT with tied embeddings whose modules are *registered* out of the
order they run (attention/MLP sub-modules reversed inside every block, the embedding last — so
the tied weight, used first, is packed last at boost). Both contenders train the same batches
with ``placement_policy="auto"`` + NVMe under a ``device_memory_limit`` smaller than the model,
interleaved (``--repeats`` rounds, each round runs both orders), fp32, one process.

Prints one JSON line: ratios execution ÷ registration of the medians of
* ``step_s``: seconds per training step, after the first (warm-up) step;
* ``nvme_read_per_step``: bytes read from the NVMe tier per step (chunk gathers + optimizer);
* ``moves_per_step``: chunk tier changes per step;
* ``compute_peak``: peak bytes Gemini held in the compute tier over the steady steps (gathered
  chunks, fp32 gradient buffers waiting for a chunk's last gradient, optimizer windows) — byte
  accounting, not timing, so it is exact;
and ``repack_s_over_step``: the one-time re-pack (trace + move) in units of a steady step.

With ``--min-limit``: instead, the smallest ``device_memory_limit`` (bisected to 4 KiB) under which
each order trains 2 steps without ``MemoryError`` — byte accounting, deterministic — and the ratio.

    python bench/gemini_order.py --nvme-dir /tmp/gemini-order --preset small --limit-mib 8 --chunk-mb 1
    python bench/gemini_order.py --nvme-dir /tmp/gemini-order --preset tiny --precision bf16 --chunk-mb 0.04 --min-limit
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from colossal_lab.engine import Booster
from colossal_lab.engine.models import GPT, GPTConfig
from colossal_lab.engine.plugins import GeminiPlugin


def reordered(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)
    m = GPT(cfg)
    for mod in m.modules():
        if type(mod).__name__ in ("Block", "Attention", "MLP"):
            mod.__dict__["_modules"] = dict(reversed(list(mod._modules.items())))
    m._modules["tok_emb"] = m._modules.pop("tok_emb")
    return m


def run(order: str, cfg: GPTConfig, args, nvme_dir: str) -> dict:
    model = reordered(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plugin = GeminiPlugin(placement_policy="auto", precision=args.precision, device_memory_limit=args.limit_mib << 20,
                          nvme_offload_dir=nvme_dir, max_prefetch=args.max_prefetch, pack_order=order,
                          chunk_size_mb=args.chunk_mb)
    booster = Booster(plugin=plugin, mixed_precision=args.precision)
    gm, gopt, *_ = booster.boost(model, opt)
    mgr = gm.manager
    g = torch.Generator().manual_seed(1)
    times, reads, moves = [], [], []
    first = None
    for i in range(args.steps):
        x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
        r0, m0, t0 = mgr.nvme.bytes_read, mgr.moves, time.perf_counter()
        _, loss = gm(x, x)
        booster.backward(loss, gopt)
        gopt.step()
        dt = time.perf_counter() - t0
        if i == 0:
            first = dt
            mgr.compute.peak = mgr.compute.used  # steady-state peak from here on
            continue
        times.append(dt)
        reads.append(mgr.nvme.bytes_read - r0)
        moves.append(mgr.moves - m0)
    out = {"step_s": statistics.median(times), "nvme_read": statistics.median(reads),
           "moves": statistics.median(moves), "first_s": first, "compute_peak": mgr.compute.peak,
           "repack_s": gm.pack.seconds, "status": gm.pack.status, "chunks": len(mgr.chunks), "loss": loss.item()}
    plugin.close()
    return out


def trains(order: str, cfg: GPTConfig, args, nvme_dir: str, limit: int) -> bool:
    model = reordered(cfg)
    try:
        plugin = GeminiPlugin(placement_policy="auto", precision=args.precision, device_memory_limit=limit,
                              nvme_offload_dir=nvme_dir, max_prefetch=args.max_prefetch, pack_order=order,
                              chunk_size_mb=args.chunk_mb)
        booster = Booster(plugin=plugin, mixed_precision=args.precision)
        gm, gopt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    except ValueError:  # below the boost-time minimum
        return False
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(2):
            x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
            _, loss = gm(x, x)
            booster.backward(loss, gopt)
            gopt.step()
        return True
    except MemoryError:
        return False
    finally:
        plugin.close()


def min_limit(order: str, cfg: GPTConfig, args, nvme_dir: str) -> int:
    lo, hi = 1 << 16, 1 << 30
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if trains(order, cfg, args, nvme_dir, mid) else (mid, hi)
    return hi


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--limit-mib", type=int, default=8)
    ap.add_argument("--max-prefetch", type=int, default=1)
    ap.add_argument("--chunk-mb", type=float, default=1.0, help="chunk size (None: searched under the limit's cap)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--min-limit", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = GPTConfig.preset(args.preset, tie_embeddings=True)
    root = args.nvme_dir or tempfile.mkdtemp(prefix="gemini-order-")
    if args.min_limit:
        lim = {o: min_limit(o, cfg, args, os.path.join(root, o)) for o in ("execution", "registration")}
        print(json.dumps({"bench": "gemini_order_min_limit", "preset": args.preset, "precision": args.precision,
                          "chunk_mb": args.chunk_mb, "params": GPT(cfg).num_params(),
                          "min_limit_ratio": lim["execution"] / lim["registration"], "min_limit": lim}))
        return
    res = {"execution": [], "registration": []}
    for r in range(args.repeats):
        for order in (("execution", "registration") if r % 2 == 0 else ("registration", "execution")):
            res[order].append(run(order, cfg, args, os.path.join(root, order)))

    def med(order, key):
        return statistics.median(x[key] for x in res[order])

    ex, reg = "execution", "registration"
    print(json.dumps({
        "bench": "gemini_order", "preset": args.preset, "precision": args.precision, "params": GPT(cfg).num_params(),
        "limit_mib": args.limit_mib, "chunk_mb": args.chunk_mb, "repeats": args.repeats, "steps": args.steps,
        "step_s_ratio": med(ex, "step_s") / med(reg, "step_s"),
        "nvme_read_per_step_ratio": med(ex, "nvme_read") / max(1, med(reg, "nvme_read")),
        "moves_per_step_ratio": med(ex, "moves") / max(1, med(reg, "moves")),
        "compute_peak_ratio": med(ex, "compute_peak") / med(reg, "compute_peak"),
        "repack_s_over_step": med(ex, "repack_s") / med(ex, "step_s"),
        "median": {o: {k: med(o, k) for k in ("step_s", "nvme_read", "moves", "compute_peak",
                                                          "first_s", "repack_s", "chunks")}
                   for o in (ex, reg)},
        "status": {o: sorted({x["status"] for x in res[o]}) for o in (ex, reg)},
        "same_final_loss": all(a["loss"] == b["loss"] for a, b in zip(res[ex], res[reg])),
    }))


if __name__ == "__main__":
    main()
