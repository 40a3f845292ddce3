"""Context parallelism: peak activation memory per rank vs sequence length, cp=1 against ring and
Ulysses at cp=2 and cp=4.

    python bench/context_parallel.py [--seqs 4096,8192,16384,32768] [--cps 2,4] [--modes ring,ulysses]
                                     [--layers 1] [--embd 64] [--heads 4] [--vocab 256] [--batch 1]

One GPT training step (forward + backward of the loss over a batch of ``--batch`` sequences) per
point, on gloo ranks (CPU). cp=1 is the plain model (attention through ``kernels.flash_attention``,
SDPA's fused CPU flash kernel here); cp>1 is the same model after ``apply_context_parallel`` fed
``shard_batch``'s shards. Each rank measures itself with ``colossal_lab.engine.planner.memory.measure``: the peak of
live tensor bytes held through PyTorch's CPU allocator during the step, every thread included
(c10's process-wide allocation counter read from ``torch.profiler``'s memory events; gloo's
buffers count), from a baseline taken just before the step (by default the second step at each
length: the first also makes what is kept per length, e.g. the ring's rotary-table shards;
``--first-step`` measures that one). A warm-up step at a short length
first allocates the parameters' ``.grad``; the measured step accumulates into them, so the peak is
activations, temporaries and communication buffers, not weights or gradients.

Prints one JSON line per (mode, cp, seq): the peak of the worst rank, its ratio to cp=1's at the
same length, the goal ``1/cp``, and the excess over ``cp1_peak / cp`` (the "constant" of the goal
``peak <= cp1_peak / cp + constant``); then one line per (mode, cp) with least-squares fits
``peak = slope * seq + intercept``, the slope ratio to cp=1's (the goal: ``<= 1/cp``, checked
strictly: ``slope_goal_met``) and what a rank holds per local token beyond ``1/cp`` of cp=1. Bytes
sent per rank per step (counted at the collective calls) and the step's seconds are printed too;
the seconds of gloo ranks on shared CPU cores are a rough figure, the bytes are exact.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _fit(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return slope, my - slope * mx


def _step(model, batch):
    _, loss = model(batch["idx"], batch["targets"])
    loss.backward()


def _worker(rank, world, port, args, modes, q):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=3600))
    try:
        from colossal_lab.engine import context_parallel as cp
        from colossal_lab.engine.models import GPT, GPTConfig
        from colossal_lab.engine.planner import measure

        cfg = GPTConfig(vocab_size=args.vocab, block_size=max(args.seqs), n_layer=args.layers,
                        n_head=args.heads, n_embd=args.embd)
        g = torch.Generator().manual_seed(0)
        res = {}
        for mode in modes:
            torch.manual_seed(0)
            model = GPT(cfg)
            if mode != "none":
                cp.apply_context_parallel(model, None, mode)

            def batch_of(T):
                x = torch.randint(0, args.vocab, (args.batch, T), generator=g)
                b = {"idx": x, "targets": torch.roll(x, -1, 1)}
                return b if mode == "none" else cp.shard_batch(b, None, mode)

            _step(model, batch_of(2 * world * 16))  # warm-up: allocates every .grad
            for T in args.seqs:
                b = batch_of(T)
                if not args.first_step:  # steady state: what every later step at this length holds
                    _step(model, b)
                gc.collect()
                dist.barrier()
                cp.COMM.reset()
                t0 = time.perf_counter()
                with measure() as meter:
                    _step(model, b)
                res[(mode, T)] = {"peak": meter.peak["cpu"], "seconds": time.perf_counter() - t0,
                                  "sent": cp.COMM.total}
                del b
        q.put((rank, res))
    except BaseException as e:
        q.put((rank, repr(e)))
        raise
    finally:
        dist.destroy_process_group()


def _launch(world, args, modes):
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    q = ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(r, world, store.port, args, modes, q)) for r in range(world)]
    for p in ps:
        p.start()
    by_rank = {}
    for _ in range(world):
        rank, res = q.get(timeout=7200)
        if isinstance(res, str):
            raise SystemExit(f"bench/context_parallel.py: rank {rank} of {world} failed: {res}")
        by_rank[rank] = res
    for p in ps:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return [by_rank[r] for r in range(world)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="4096,8192,16384,32768")
    ap.add_argument("--cps", default="2,4")
    ap.add_argument("--modes", default="ring,ulysses")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--first-step", action="store_true",
                    help="measure the first step at each length (default: a second one, after an unmeasured "
                         "step at that length: what training holds at every later step)")
    args = ap.parse_args()
    args.seqs = [int(s) for s in args.seqs.split(",")]
    cps = [int(c) for c in args.cps.split(",")]
    modes = args.modes.split(",")
    model = {k: getattr(args, k) for k in ("layers", "embd", "heads", "vocab", "batch")}

    base = _launch(1, args, ["none"])[0]
    cp1 = {T: base[("none", T)]["peak"] for T in args.seqs}
    slope1, icpt1 = _fit(args.seqs, [cp1[T] for T in args.seqs])
    for T in args.seqs:
        print(json.dumps({"bench": "context_parallel", "mode": "none", "cp": 1, "seq": T, **model,
                          "peak_bytes_per_rank": cp1[T], "step_s": round(base[("none", T)]["seconds"], 3)}),
              flush=True)
    print(json.dumps({"bench": "context_parallel_fit", "mode": "none", "cp": 1, "bytes_per_token": round(slope1, 1),
                      "intercept_bytes": round(icpt1)}), flush=True)
    for world in cps:
        ranks = _launch(world, args, modes)
        for mode in modes:
            peaks = []
            for T in args.seqs:
                per_rank = [r[(mode, T)]["peak"] for r in ranks]
                peak = max(per_rank)
                peaks.append(peak)
                print(json.dumps({
                    "bench": "context_parallel", "mode": mode, "cp": world, "seq": T, **model,
                    "peak_bytes_per_rank": peak, "peak_bytes_ranks": per_rank, "cp1_peak_bytes": cp1[T],
                    "ratio_to_cp1": round(peak / cp1[T], 4), "goal_ratio": round(1 / world, 4),
                    "excess_over_cp1_div_cp_bytes": round(peak - cp1[T] / world),
                    "sent_bytes_per_rank": max(r[(mode, T)]["sent"] for r in ranks),
                    "step_s": round(max(r[(mode, T)]["seconds"] for r in ranks), 3)}), flush=True)
            slope, icpt = _fit(args.seqs, peaks)
            print(json.dumps({"bench": "context_parallel_fit", "mode": mode, "cp": world,
                              "bytes_per_token": round(slope, 1), "intercept_bytes": round(icpt),
                              "slope_ratio_to_cp1": round(slope / slope1, 4), "goal_ratio": round(1 / world, 4),
                              "excess_bytes_per_local_token": round((slope - slope1 / world) * world, 1),
                              "slope_goal_met": slope <= slope1 / world + 0.5}), flush=True)


if __name__ == "__main__":
    main()
