"""Pipeline schedules side by side: measured bubble fraction and step time, p=2, m in {2,4,8}.

    python bench/pipeline.py [--steps 6] [--layers 4] [--embd 128] [--seq 64] [--mbs 2]

Two ranks (gloo; CPU or one GPU each) run GPipe, 1F1B, interleaved (2 chunks), zero-bubble
ZB1P (2 chunks) and ZB-V for each m, in one run, on the same model and data; then pp=1 on one
rank for the tokens/s baseline. Prints one JSON line per (schedule, m) — median measured bubble
(mean over stages), the textbook GPipe/1F1B bubble (p-1)/(m+p-1), median step seconds, and
ratios to GPipe at the same m — and one summary line with tokens/s of pp=2 ÷ pp=1.
Bubbles are measured from wall-clock spans, never simulated.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

STYLES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 2), ("zbv", 2)]


def crit(out, batch):
    return F.cross_entropy(out.flatten(0, 1).float(), batch["targets"].flatten())


def _batches(n, bs, seq, vocab):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (bs, seq), generator=g)
        out.append({"idx": x, "targets": torch.roll(x, -1, 1)})
    return out


def _run(style, chunks, pp, m, args):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.models import GPT, GPTConfig
    from colossal_lab.engine.plugins import HybridParallelPlugin

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plugin = HybridParallelPlugin(pp_size=pp, num_microbatches=m, pp_style=style, num_model_chunks=chunks)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, opt, crit)
    data = iter(_batches(args.steps + 1, m * args.mbs, args.seq, 256))
    times, bubbles = [], []
    for step in range(args.steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        out = booster.execute_pipeline(data, model, crit, opt)
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if step:  # step 0 warms up (torch infers stage shapes)
            times.append(time.perf_counter() - t0)
            bubbles.append(statistics.mean(out["bubble"].values()))
    return statistics.median(times), statistics.median(bubbles)


def _worker(rank, world, port, args, q):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    res = {}
    try:
        if world == 2:
            for m in (2, 4, 8):
                for style, chunks in STYLES:
                    res[(style, m)] = _run(style, chunks, 2, m, args)
        else:
            res[("pp1", 8)] = _run("1f1b", 1, 1, 8, args)
    except BaseException as e:
        q.put(("error", rank, repr(e)))
        raise
    else:
        if rank == 0:
            q.put(res)
    finally:
        dist.destroy_process_group()


def _launch(world, args):
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    q = ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(r, world, store.port, args, q)) for r in range(world)]
    for p in ps:
        p.start()
    res = q.get(timeout=1800)
    for p in ps:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if isinstance(res, tuple):
        raise SystemExit(f"bench/pipeline.py: rank {res[1]} failed: {res[2]}")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mbs", type=int, default=2, help="microbatch size (rows)")
    args = ap.parse_args()
    pp2 = _launch(2, args)
    pp1 = _launch(1, args)
    p = 2
    for m in (2, 4, 8):
        g_t, g_b = pp2[("gpipe", m)]
        for style, chunks in STYLES:
            t, b = pp2[(style, m)]
            print(json.dumps({
                "bench": "pipeline", "schedule": style, "chunks": chunks, "p": p, "m": m,
                "bubble_measured": round(b, 4), "bubble_textbook_gpipe": round((p - 1) / (m + p - 1), 4),
                "step_s_median": round(t, 5), "bubble_ratio_vs_gpipe": round(b / g_b, 3),
                "step_time_ratio_vs_gpipe": round(t / g_t, 3),
            }))
    tokens = 8 * args.mbs * args.seq
    t1, _ = pp1[("pp1", 8)]
    t2, _ = pp2[("1f1b", 8)]
    print(json.dumps({"bench": "pipeline_throughput", "m": 8, "tokens_per_step": tokens,
                      "tokens_per_s_pp2_1f1b": round(tokens / t2, 1), "tokens_per_s_pp1": round(tokens / t1, 1),
                      "ratio_pp2_over_pp1": round(t1 / t2, 3)}))


if __name__ == "__main__":
    main()
