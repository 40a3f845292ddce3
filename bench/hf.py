"""A transformers Llama under the engine: tokens/s and peak memory per rank of tp2, pp2 and ZeRO-2 on
2 ranks against the plain HF loop in one process.

    python bench/hf.py [--hidden 512] [--layers 8] [--heads 8] [--kv-heads 4] [--vocab 8192]
                       [--batch 8] [--seq 256] [--steps 4] [--cases tp2,zero2,pp2]

Every contender trains the same ``LlamaForCausalLM`` (random weights from one seed, fp32, AdamW) on the
same batches of ``batch x seq`` tokens per step, each in fresh processes:

* **one process**, the baseline: ``loss = model(input_ids=x, labels=x).loss; loss.backward();
  opt.step()``, torch's intra-op threads = the ranks the others use (the same cores);
* **tp2**: ``HybridParallelPlugin(tp_size=2)``, the model's own tensor-parallel plan, every rank
  fed the whole batch, the same HF loop through ``booster.backward``;
* **zero2**: ``LowLevelZeroPlugin(stage=2)`` on 2 data-parallel ranks, each half the batch;
* **pp2**: ``HybridParallelPlugin(pp_size=2)`` (1F1B, 2 microbatches) through
  ``booster.execute_pipeline``; reported as refused, with the plugin's reason, where the engine
  does not cut transformers models into stages.

Each rank runs one thread. Measured per contender: the median step time over ``--steps`` steps after
one warm-up step (a step waits for its slowest rank: the max over ranks), tokens/s = ``batch x seq``
/ that; and the peak of live tensor bytes per rank from building the model to the last step
(``colossal_lab.engine.planner.memory.measure``, the profiler's allocator events), the largest
rank's. Prints a table and one JSON line with the ratios: tokens/s against one process, and peak
per rank against one process beside the ideal ``1/world`` of a perfect split.
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


def _parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8, help="samples per step, all ranks together")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up step")
    ap.add_argument("--cases", default="tp2,zero2,pp2")
    return ap.parse_args(argv)


def _model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 64 * 64,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                      max_position_embeddings=max(args.seq, 128))
    return LlamaForCausalLM(cfg)


def _batches(args):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(args.steps + 1)]


def _plugin(case: str):
    from colossal_lab.engine.plugins import HybridParallelPlugin, LowLevelZeroPlugin

    return {"tp2": lambda: HybridParallelPlugin(tp_size=2),
            "zero2": lambda: LowLevelZeroPlugin(stage=2),
            "pp2": lambda: HybridParallelPlugin(pp_size=2, num_microbatches=2)}[case]()


def _run(case: str, args, rank: int, world: int) -> dict:
    """This rank's step times and peak for ``case`` ("one" = the plain loop, no engine)."""
    from colossal_lab.engine import Booster
    from colossal_lab.engine.planner.memory import measure

    data = _batches(args)
    rows = args.batch // world if case == "zero2" else args.batch  # zero2 splits the batch; tp/pp take it whole
    times = []
    with measure() as meter:
        model = _model(args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if case == "one":
            def step(x):
                model(input_ids=x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad()
        else:
            booster = Booster(plugin=_plugin(case))
            model, opt, *_ = booster.boost(model, opt)

            def step(x):
                x = x[rank * rows:(rank + 1) * rows] if case == "zero2" else x
                if case == "pp2":
                    booster.execute_pipeline(iter([{"input_ids": x, "labels": x}]), model, None, opt)
                else:
                    booster.backward(model(input_ids=x, labels=x).loss, opt)
                opt.step()
                opt.zero_grad()
        for i, x in enumerate(data):
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            step(x)
            if i:  # the first is the warm-up (the optimizer's state, first-call costs)
                times.append(time.perf_counter() - t0)
    return {"times": times, "peak": int(max(meter.peak.values(), default=0))}


def _rank_main(rank: int, world: int, port: int, case: str, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    try:
        res = _run(case, args, rank, world)
    except (ValueError, TypeError) as exc:  # a refusal before any work: reported, not a crash
        res = {"refused": f"{type(exc).__name__}: {exc}"}
    out.put((rank, res))
    dist.destroy_process_group()


def _one_process(args, threads: int) -> dict:
    torch.set_num_threads(threads)
    return _run("one", args, 0, 1)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(case: str, args, world: int = 2) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, case, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(60)
    if any("refused" in r for r in got.values()):
        return {"refused": next(r["refused"] for r in got.values() if "refused" in r)}
    steps = [max(t) for t in zip(*(got[r]["times"] for r in range(world)))]  # a step waits for its slowest rank
    return {"times": steps, "peak": max(got[r]["peak"] for r in range(world))}


def _baseline(args, world: int) -> dict:
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:  # a fresh process, as the others
        return pool.apply(_one_process, (args, world))


def main(argv=None) -> dict:
    args = _parse(argv)
    world, tokens = 2, args.batch * args.seq
    results = {"one": _baseline(args, world)}
    for case in [c for c in args.cases.split(",") if c]:
        results[case] = _spawn(case, args, world)
    base = results["one"]
    base_tps = tokens / statistics.median(base["times"])
    report = {"bench": "hf", "model": "LlamaForCausalLM", "hidden": args.hidden, "layers": args.layers,
              "vocab": args.vocab, "params": sum(p.numel() for p in _model(args).parameters()),
              "batch": args.batch, "seq": args.seq, "steps": args.steps, "world": world,
              "one_process_threads": world, "cases": {}}
    print(f"{'case':8} {'tokens/s':>10} {'vs one':>8} {'peak/rank MiB':>14} {'vs one':>8} {'ideal':>6}")
    print(f"{'one':8} {base_tps:10.1f} {1:8.2f} {base['peak'] / 2**20:14.1f} {1:8.2f} {1:6.2f}")
    for case, r in results.items():
        if case == "one":
            continue
        if "refused" in r:
            print(f"{case:8} refused: {r['refused'][:150]}")
            report["cases"][case] = r
            continue
        tps = tokens / statistics.median(r["times"])
        row = {"tokens_per_s": round(tps, 1), "tokens_per_s_ratio": round(tps / base_tps, 3),
               "peak_per_rank": r["peak"], "peak_ratio": round(r["peak"] / base["peak"], 3),
               "peak_ideal": round(1 / world, 3)}
        report["cases"][case] = row
        print(f"{case:8} {tps:10.1f} {row['tokens_per_s_ratio']:8.2f} {r['peak'] / 2**20:14.1f} "
              f"{row['peak_ratio']:8.2f} {row['peak_ideal']:6.2f}")
    report["one"] = {"tokens_per_s": round(base_tps, 1), "peak": base["peak"]}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
