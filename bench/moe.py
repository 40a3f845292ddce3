"""Expert parallelism against data parallelism: tokens/s, peak memory per rank and all-to-all share of the
step of an MoE GPT under ``HybridParallelPlugin(ep_size=2)`` and ``(ep_size=4)`` beside dp only, same world.

    python bench/moe.py [--world 4] [--cases dp,ep2,ep4] [--embd 128] [--layers 2] [--heads 4] [--experts 8]
                        [--top-k 2] [--vocab 512] [--batch 16] [--seq 128] [--warmup 2] [--steps 5]
                        [--device cpu|cuda] [--json]

One world of ``--world`` ranks (gloo on CPU, one thread each; nccl with ``--device cuda``, one GPU a rank)
runs every case in turn, each on a fresh copy of the same MoE GPT (one seed, fp32, AdamW, clip 1.0) and
the same batches of ``batch x seq`` tokens per step, split over the data-parallel ranks (every case has
``dp = world``; EP groups are cut from the dp ranks):

* **dp**, the baseline: ``HybridParallelPlugin()``: every rank holds every expert, routes its own tokens
  to them locally, and the expert gradients are averaged over dp like any other;
* **ep2** / **ep4**: ``HybridParallelPlugin(ep_size=k)``: a rank holds ``E / k`` experts and its tokens
  travel to the other ranks' experts and back by the counted all-to-alls of ``engine/moe/parallel.py``.

Measured per case: ``--warmup`` steps (the optimizer's state, first-call costs) then ``--steps`` timed
ones; a step waits for its slowest rank, so a step's time is the max over ranks and tokens/s =
``batch x seq`` / the median of those. The peak per rank is the largest rank's peak of live tensor bytes
from building the model to the end of the warm-up (``engine.planner.memory.measure``: the profiler's
allocator events on CPU, ``max_memory_allocated`` on CUDA; kept off the timed steps, whose profiler would
slow them; the warm-up already holds the optimizer state and a step's activations). All-to-all time is
the wall time inside ``comm.all_to_all_single`` for the ``moe.*`` labels (dispatch, combine, counts,
forward and backward), wrapped in this process only; it includes waiting for a slower peer, so it is
the time the step spends in expert-parallel communication, not the wire time. Its share is per rank
over that rank's step time, the mean over ranks (and the max) reported. Expert bytes per rank: the
grouped expert weights a rank holds after ``boost`` (parameters only; AdamW's state is twice that again).
Bytes sent per step: the ``engine.traffic`` counter over the timed steps (every collective through
``comm``: gradient all-reduces and the ``moe.*`` all-to-alls apart), the largest rank's.

Prints a table and the ratios against dp (tokens/s, peak per rank, expert bytes per rank; the ideal
expert ratio is ``1/k``); ``--json`` adds one JSON line with everything.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CASES = {"dp": 1, "ep2": 2, "ep4": 4}  # case -> ep_size


def _parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--cases", default="dp,ep2,ep4", help=f"comma-separated, of {sorted(CASES)}; dp always runs")
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step, all ranks together")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", action="store_true", help="also print one JSON line with every figure")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad:
        ap.error(f"--cases: unknown {bad}; choose from {sorted(CASES)}")
    args.cases = ["dp"] + [c for c in cases if c != "dp"]  # the baseline first, always
    for c in args.cases:
        k = CASES[c]
        if args.world % k or args.experts % k:
            ap.error(f"--cases {c}: ep_size={k} must divide --world ({args.world}) and --experts ({args.experts})")
    if args.batch % args.world:
        ap.error(f"--batch {args.batch} must be a multiple of --world {args.world} (each dp rank takes batch/world)")
    if not 1 <= args.top_k <= args.experts:
        ap.error(f"--top-k {args.top_k} must be in [1, --experts={args.experts}]")
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        ap.error(f"--device cuda needs --world ({args.world}) GPUs; {torch.cuda.device_count()} visible")
    return args


def _config(args):
    from colossal_lab.engine.models import GPTConfig

    return GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                     n_embd=args.embd, n_expert=args.experts, top_k=args.top_k)


def _batches(args):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
            for _ in range(args.warmup + args.steps)]


class _A2AClock:
    """Wall seconds inside ``comm.all_to_all_single`` for the ``moe.*`` labels, while installed.
    engine/moe/parallel.py calls it as ``comm.all_to_all_single``, so replacing the module's attribute
    catches every dispatch, combine and counts call, forward and backward."""

    def __init__(self, device: torch.device):
        from colossal_lab.engine import comm

        self.comm, self.orig, self.seconds, self.cuda = comm, comm.all_to_all_single, 0.0, device.type == "cuda"
        orig, clock = self.orig, self

        def timed(out, inp, group=None, label=None, *rest, **kw):
            if not (label or "").startswith("moe."):
                return orig(out, inp, group, label, *rest, **kw)
            if clock.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = orig(out, inp, group, label, *rest, **kw)
            if clock.cuda:  # nccl returns before the data moved
                torch.cuda.synchronize()
            clock.seconds += time.perf_counter() - t0
            return res

        comm.all_to_all_single = timed

    def close(self) -> None:
        self.comm.all_to_all_single = self.orig


def _run(case: str, args, rank: int, device: torch.device) -> dict:
    """This rank's step times, all-to-all seconds per step, peak bytes and expert bytes for ``case``."""
    from colossal_lab.engine import Booster
    from colossal_lab.engine.models import GPT
    from colossal_lab.engine.moe.experts import GroupedExperts
    from colossal_lab.engine.planner.memory import measure
    from colossal_lab.engine.plugins import HybridParallelPlugin

    data = _batches(args)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with measure() as meter:
        torch.manual_seed(0)
        model = GPT(_config(args)).to(device)
        experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]  # sliced in place at boost
        plugin = HybridParallelPlugin(ep_size=CASES[case]) if CASES[case] > 1 else HybridParallelPlugin()
        booster = Booster(plugin=plugin)
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        rows = args.batch // plugin.dp_size
        expert_bytes = sum(p.numel() * p.element_size() for m in experts for p in m.parameters())

        def step(x):
            x = x[plugin.dp_rank * rows:(plugin.dp_rank + 1) * rows].to(device)
            _, loss = model(x[:, :-1], x[:, 1:])
            booster.backward(loss, opt)
            opt.clip_grad_by_norm(1.0)
            opt.step()
            opt.zero_grad()
            return loss

        for x in data[:args.warmup]:
            step(x)
        sync()
    from colossal_lab.engine.traffic import COUNTER

    clock = _A2AClock(device)
    times, a2a = [], []
    COUNTER.reset()
    try:
        for x in data[args.warmup:]:
            dist.barrier()
            sync()
            clock.seconds, t0 = 0.0, time.perf_counter()
            loss = step(x)
            sync()
            times.append(time.perf_counter() - t0)
            a2a.append(clock.seconds)
    finally:
        clock.close()
    if not torch.isfinite(loss.detach()).item():
        raise RuntimeError(f"{case}: loss {loss.item()} is not finite")
    sent = COUNTER.total / len(times)  # this rank's counted bytes per step, every collective
    moe = sum(COUNTER.by_label("moe.").values()) / len(times)
    return {"times": times, "a2a": a2a, "peak": int(max(meter.peak.values(), default=0)),
            "expert_bytes": expert_bytes, "sent": sent, "sent_moe": moe}


def _rank_main(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    try:
        res = {case: _run(case, args, rank, device) for case in args.cases}
    except Exception as exc:  # reported to the parent, which names the rank and case
        res = {"error": f"rank {rank}: {type(exc).__name__}: {exc}"}
    out.put((rank, res))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(args) -> dict:
    """{rank: {case: figures}} from one world that runs every case."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, args.world, port, args, out)) for r in range(args.world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(60)
    errors = [r["error"] for r in got.values() if "error" in r]
    if errors:
        raise SystemExit("bench/moe.py failed: " + "; ".join(errors))
    return got


def _summary(got: dict, case: str, tokens: int) -> dict:
    ranks = sorted(got)
    steps = [max(t) for t in zip(*(got[r][case]["times"] for r in ranks))]  # a step waits for its slowest rank
    shares = [sum(got[r][case]["a2a"]) / sum(got[r][case]["times"]) for r in ranks]
    return {"tokens_per_s": round(tokens / statistics.median(steps), 1),
            "step_s": round(statistics.median(steps), 4),
            "a2a_share": round(statistics.mean(shares), 4), "a2a_share_max": round(max(shares), 4),
            "peak_per_rank": max(got[r][case]["peak"] for r in ranks),
            "expert_bytes_per_rank": max(got[r][case]["expert_bytes"] for r in ranks),
            "sent_per_step": int(max(got[r][case]["sent"] for r in ranks)),
            "sent_moe_per_step": int(max(got[r][case]["sent_moe"] for r in ranks))}


def main(argv=None) -> dict:
    args = _parse(argv)
    t0 = time.perf_counter()
    got = _spawn(args)
    tokens = args.batch * args.seq
    rows = {case: _summary(got, case, tokens) for case in args.cases}
    base = rows["dp"]
    for case, row in rows.items():
        row["ep_size"] = CASES[case]
        row["tokens_per_s_ratio"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
        row["peak_ratio"] = round(row["peak_per_rank"] / base["peak_per_rank"], 3)
        row["expert_bytes_ratio"] = round(row["expert_bytes_per_rank"] / base["expert_bytes_per_rank"], 3)
        row["expert_bytes_ideal"] = round(1 / CASES[case], 3)
    print(f"MoE GPT: d={args.embd} layers={args.layers} experts={args.experts} top-{args.top_k} vocab={args.vocab}; "
          f"{args.world} ranks ({args.device}), {args.batch}x{args.seq} tokens/step, "
          f"{args.warmup} warm-up + {args.steps} timed steps")
    print(f"{'case':5} {'tokens/s':>10} {'vs dp':>6} {'a2a share':>9} {'(max)':>6} {'peak/rank MiB':>13} "
          f"{'vs dp':>6} {'experts/rank MiB':>16} {'vs dp':>6} {'ideal':>6} {'sent MiB/step':>13} {'(moe)':>6}")
    for case, r in rows.items():
        print(f"{case:5} {r['tokens_per_s']:10.1f} {r['tokens_per_s_ratio']:6.2f} {r['a2a_share']:9.1%} "
              f"{r['a2a_share_max']:6.1%} {r['peak_per_rank'] / 2**20:13.2f} {r['peak_ratio']:6.2f} "
              f"{r['expert_bytes_per_rank'] / 2**20:16.2f} {r['expert_bytes_ratio']:6.2f} "
              f"{r['expert_bytes_ideal']:6.2f} {r['sent_per_step'] / 2**20:13.2f} "
              f"{r['sent_moe_per_step'] / 2**20:6.2f}")
    report = {"bench": "moe", "device": args.device, "world": args.world, "embd": args.embd, "layers": args.layers,
              "heads": args.heads, "experts": args.experts, "top_k": args.top_k, "vocab": args.vocab,
              "batch": args.batch, "seq": args.seq, "warmup": args.warmup, "steps": args.steps,
              "load_avg": os.getloadavg()[0], "wall_s": round(time.perf_counter() - t0, 1), "cases": rows}
    if args.json:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
