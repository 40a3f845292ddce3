"""Tensor parallelism, 1D vs 2D vs 2.5D vs 3D: bytes sent per rank per step, against each scheme's
textbook volume, and peak activation bytes per rank, at tp=4 and tp=8 on the same model.

    python bench/tensor_parallel.py [--tps 4,8] [--layers 2] [--embd 256] [--heads 8] [--vocab 512]
                                    [--batch 16] [--seq 128] [--steps 3]

Cases (each one ``HybridParallelPlugin(tp_size=tp, tp_mode=...)`` on ``tp`` gloo ranks, one
training step over one batch of ``batch x seq`` tokens that every rank is fed whole):
tp=4: 1D, 2D (q=2), 2.5D (q=1, d=4); tp=8: 1D, 2.5D (q=2, d=2), 3D (q=2). 3D needs a cube and 2D a
square, so 3D has no tp=4 row and 2D no tp=8 row; 2.5D with q=1 is the only 2.5D at tp=4 that is not
2D itself (its one "layer" per rank is a whole weight gathered over the depth: FSDP's pattern).
Also a one-process run (tp=1) for the activation baseline. 1D uses a whole-logits criterion (its
head is not split); the N-d modes the vocab-parallel ``tp_nd.CrossEntropy``.

Measured per rank, on one step after a warm-up step (which allocates the gradients):

* **bytes sent**, counted at the collective calls: ``tp_nd.COUNTER`` for 2D/2.5D/3D (every
  broadcast/reduce/all-reduce/all-gather/reduce-scatter of engine/tp_nd), and for 1D the DTensor
  collectives seen by a dispatch mode as torch's ``CommDebugMode`` sees them
  (``tp_nd.count_dtensor``: the functional collectives DTensor issues), forward and backward;
  each call counted as the bandwidth-optimal algorithm sends (engine/tp_nd/counter.py). Mean over
  ranks and the max; the broadcast root changes every SUMMA step, so ranks agree over a step.
* **textbook**: ``tp_nd.textbook`` from the model's shapes alone, with ``r = N / nb`` rows per rank,
  ``q`` the grid side, ``d`` the depth, for a linear ``(in, out)``:
  1D ``2 (p-1)/p * N * in`` per column-parallel linear (its backward all-reduce) and ``... * out``
  per row-parallel one (forward); 2D/2.5D ``3 (q-1) (r in / q + in out / q^2) + 2 (d-1)/d * in out
  / q^2``; 3D ``2 (q-1) (r in / q + r out / q + in out / q^3)``; plus, for N-d, norms (``4 (q-1)/q
  * 4r`` of statistics, ``2 (nb-1)/nb * h/q`` of weight), the embedding (``2 (nb-1)/nb * V h / q``)
  and the vocab-parallel loss (``3 * 2 (q-1)/q * 4r``). The ratio measured / textbook is printed.
* **activations**: bytes of the tensors autograd saves for backward (``saved_tensors_hooks``,
  storages counted once, parameters excluded, gathered weight blocks included), i.e. what a rank
  holds between forward and backward; and **step peak**: the peak of live CPU tensor bytes during
  forward + backward above what was live before (``colossal_lab.engine.planner.memory.measure``: the profiler's
  allocator events, every thread), which adds temporaries and communication buffers.
* tokens/s: the median of ``--steps`` plain steps (no counting modes), printed, not a target (gloo
  ranks sharing a few CPU cores make it a rough figure).

Prints a table and one JSON line: per case the raw figures, and the ratios (per-rank bytes and
activations) against 1D at the same tp.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

CASES = {1: [("1d", 1)], 4: [("1d", 1), ("2d", 1), ("2.5d", 4)], 8: [("1d", 1), ("2.5d", 2), ("3d", 1)]}


def crit(out, batch):
    return F.cross_entropy(out.flatten(0, 1).float(), batch["targets"].flatten())


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class SavedBytes:
    """Bytes of the tensors autograd saves for backward while active (each storage once, the
    parameters' excluded)."""

    def __init__(self, params):
        self.skip = {_local(p).untyped_storage().data_ptr() for p in params}
        self.seen = {}

    def pack(self, t):
        try:
            st = _local(t).untyped_storage()
        except Exception:
            return t
        if st.data_ptr() not in self.skip:
            self.seen[st.data_ptr()] = st.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def _train_step(booster, batch, model, criterion, opt):
    """One training step; a function of its arguments, so nothing outlives the case's ``del``."""
    booster.execute_pipeline(iter([batch]), model, criterion, opt)
    opt.step()
    opt.zero_grad(set_to_none=False)


def _worker(rank, world, port, args, q):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=3600))
    try:
        from colossal_lab.engine import Booster
        from colossal_lab.engine.models import GPT, GPTConfig
        from colossal_lab.engine.planner import measure
        from colossal_lab.engine.plugins import HybridParallelPlugin
        from colossal_lab.engine.tp_nd import COUNTER, CrossEntropy, count_dtensor

        cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                        n_embd=args.embd)
        x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
        batch = {"idx": x, "targets": torch.roll(x, -1, 1)}
        res = {}
        for mode, depth in CASES[world]:
            torch.manual_seed(0)
            model = GPT(cfg)
            plugin = HybridParallelPlugin(tp_size=world, tp_mode=mode, tp_depth=depth)
            booster = Booster(plugin=plugin)
            model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=1e-3))
            criterion = crit if mode == "1d" else CrossEntropy()
            _train_step(booster, batch, model, criterion, opt)  # warm-up: every .grad allocated
            gc.collect()
            dist.barrier()
            COUNTER.reset()
            saved = SavedBytes([p for _, p in model.named_model_parameters()])
            counting = count_dtensor() if mode == "1d" and world > 1 else contextlib.nullcontext()
            with measure() as meter, saved, counting:
                booster.execute_pipeline(iter([batch]), model, criterion, opt)
            opt.step()
            opt.zero_grad(set_to_none=False)
            sent = COUNTER.snapshot()
            times = []
            for _ in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                _train_step(booster, batch, model, criterion, opt)
                times.append(time.perf_counter() - t0)
            res[(mode, depth)] = {"sent": sent, "saved": saved.total, "peak": meter.peak["cpu"],
                                  "step_s": statistics.median(times)}
            del model, opt, booster, plugin
            gc.collect()
        q.put((rank, res))
    except BaseException:
        import traceback

        q.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def _launch(world, args):
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    q = ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(r, world, store.port, args, q)) for r in range(world)]
    for p in ps:
        p.start()
    by_rank = {}
    for _ in range(world):
        rank, res = q.get(timeout=7200)
        if isinstance(res, str):
            raise SystemExit(f"bench/tensor_parallel.py: rank {rank} of {world} failed:\n{res}")
        by_rank[rank] = res
    for p in ps:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return [by_rank[r] for r in range(world)]


def _mb(b: float) -> str:
    return f"{b / 2 ** 20:8.3f}"


def main(argv=None) -> int:
    from colossal_lab.engine.models import GPT, GPTConfig
    from colossal_lab.engine.tp_nd import by_part, factor, textbook

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tps", default="4,8")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    tps = [int(t) for t in args.tps.split(",")]
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.embd)
    N = args.batch * args.seq
    rows, ratios = [], {}
    base = _launch(1, args)[0][("1d", 1)]
    for tp in tps:
        ranks = _launch(tp, args)
        ref = None
        for mode, depth in CASES[tp]:
            rs = [r[(mode, depth)] for r in ranks]
            per_rank = [sum(r["sent"].values()) for r in rs]
            mean = sum(per_rank) / len(per_rank)
            book = textbook(GPT(cfg), mode, tp, tokens=N, depth=depth, vocab_parallel_loss=mode != "1d")
            parts = {k: round(sum(by_part(r["sent"]).get(k, 0) for r in rs) / len(rs)) for k in book}
            row = {"tp": tp, "mode": mode, "grid": factor(mode, tp, depth),
                   "sent_mean": mean, "sent_max": max(per_rank),
                   "textbook": sum(book.values()), "sent_by_part": parts,
                   "textbook_by_part": {k: round(v) for k, v in book.items()},
                   "saved_max": max(r["saved"] for r in rs), "peak_max": max(r["peak"] for r in rs),
                   "step_s": max(r["step_s"] for r in rs), "tokens_s": N / max(r["step_s"] for r in rs)}
            row["measured_over_textbook"] = row["sent_mean"] / row["textbook"]
            if mode == "1d":
                ref = row
            else:
                key = f"tp{tp}_{mode}" + (f"_d{depth}" if mode == "2.5d" else "")
                ratios[key] = {"bytes_vs_1d": round(row["sent_mean"] / ref["sent_mean"], 4),
                               "activations_vs_1d": round(row["saved_max"] / ref["saved_max"], 4),
                               "step_peak_vs_1d": round(row["peak_max"] / ref["peak_max"], 4)}
            rows.append(row)
    print(f"model: GPT n_layer={args.layers} n_embd={args.embd} n_head={args.heads} vocab={args.vocab}; "
          f"batch {args.batch} x seq {args.seq} = {N} tokens per step; fp32")
    print(f"one process: saved activations {_mb(base['saved'])} MiB, step peak {_mb(base['peak'])} MiB, "
          f"{N / base['step_s']:.0f} tokens/s")
    hdr = ("tp", "mode", "grid", "sent MiB/rank", "textbook MiB", "meas/book", "saved act MiB", "step peak MiB",
           "tokens/s")
    print(" | ".join(hdr))
    for r in rows:
        grid = "x".join(str(v) for v in r["grid"].values())
        print(f"{r['tp']:>2} | {r['mode']:>4} | {grid:>5} | {_mb(r['sent_mean'])} | {_mb(r['textbook'])} | "
              f"{r['measured_over_textbook']:.4f} | {_mb(r['saved_max'])} | {_mb(r['peak_max'])} | "
              f"{r['tokens_s']:8.0f}")
    print(json.dumps({"bench": "tensor_parallel", "tokens": N, "ratios": ratios,
                      "one_process": {"saved": base["saved"], "peak": base["peak"], "step_s": base["step_s"]},
                      "raw": rows}, default=str))
    off = [r for r in rows if abs(r["measured_over_textbook"] - 1) > 0.10]
    return 1 if off else 0


if __name__ == "__main__":
    raise SystemExit(main())
