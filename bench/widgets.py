"""Training tokens/s with the live dashboard attached vs without (target >= 0.97x).

Two run shapes, each comparing the same training with and without a live ``Dashboard``:

* ``--mode inproc``: training and the dashboard in one process (the tiny GPT boosted with
  GeminiPlugin, CPU + NVMe tiers so ChunkEvents flow every step, one rank on a gloo group).
  "attached" = a live ``Dashboard(live=True)`` subscribed to this process's telemetry bus
  with its redraw thread running; "detached" = no subscriber at all (so the engine does not
  even build its events: the baseline a user without the dashboard gets).
* ``--mode cluster``: the shape of real use. Training runs on a ``--ranks``-rank (default 2)
  ``colossal_lab.launch`` cluster (other processes); this process is the notebook kernel and
  only draws. "attached" = ``relay.attach(cluster)`` + ``Dashboard(live=True)`` here (ranks
  coalesce, encode and PUSH their events every ``--relay-interval``, this process decodes,
  re-emits and draws); "relay_only" = the relay without a dashboard (this process then
  decodes nothing); "detached" = neither (ranks emit nothing). On a 2-core box ``--ranks 2``
  leaves no core for the kernel (every CPU-ms it spends is taken from training), ``--ranks 1``
  leaves it one, as a GPU machine with spare CPU cores does. ``relay.attach`` also starts
  each rank's memory sampler (its default), so "attached" and "relay_only" pay for it, as a
  user of ``%colossal dashboard`` does.
* ``--emit-only`` (inproc) / ``--relay-only`` (cluster) add a third contender that splits the
  cost: the engine building and emitting its events (resp. the relay carrying them) with
  nobody drawing.

Each redraw pays what it pays in a kernel: the views build their figure dicts, each view's
``PlotlyView`` widget builds its ``update`` message, and the comm message is serialized and
HMAC-signed by jupyter_client's ``Session`` exactly as ipykernel's ``Comm.publish_msg`` does
(only the final zmq send to a browser is left out; ``--no-serialize`` skips the serialization
too).

Per repeat: a fresh model and booster, ``--warmup`` steps, then ``--pairs`` rounds of one
block of ``--steps`` timed steps per contender, the order alternating (ABBA...) and rotating
per repeat. Short interleaved blocks: the other jobs on a shared box change its speed over
seconds, and blocks seconds apart see the same load. A live dashboard is created (outside
the timing) before each attached block and closed after it. Prints one JSON line per mode:
ratio = median block tokens/s attached / median detached; pooled_ratio = all tokens / all
seconds, attached over detached; the median of the paired (adjacent) block ratios; in
inproc mode the ratio of this process's CPU seconds per token (all threads: the direct cost,
which other jobs disturb less than wall time); and the redraw rate achieved (redraws per
second of each view, and per view that had something new to draw), events/s, the redraw
thread's wakes, ticks and CPU share, and comm bytes. In cluster mode also CPU microseconds
per token per contender (``cpu_us_per_token``: the ranks' processes, their relay sender
threads, this kernel process, its relay receiver thread and the dashboard's redraw thread),
``direct_cpu_overhead_*`` (sender threads + the kernel's CPU above its detached baseline, over
the ranks' detached CPU: what the live path costs, measured on its own threads, which the
ranks' block-to-block noise does not swamp) and the relay's events, rows and messages per
rank per second.

``--runs N`` repeats the whole measurement N times (cluster mode: a fresh cluster each run)
and prints each run's JSON line, then a final one with every run's ratio and the median of
the runs' ratios (``ratio_median_of_runs``, the figure to hold against the 0.97 target): one
run's ratio moves with whatever else the box is doing in those minutes.

    OMP_NUM_THREADS=1 python bench/widgets.py --mode both --repeats 5 --pairs 6
    OMP_NUM_THREADS=1 python bench/widgets.py --mode cluster --ranks 2 --runs 3 --repeats 2 --pairs 4
    OMP_NUM_THREADS=1 python bench/widgets.py --mode cluster --relay-only --ranks 1 --repeats 4 --pairs 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta

# ---------------------------------------------------------------- kernel-like comm


def install_serializing_comm() -> dict:
    """Make ipywidgets' comms serialize and sign every message the way ipykernel's does.

    Outside a kernel ipywidgets gets ``comm.DummyComm``, whose ``publish_msg`` drops the
    message before any JSON is written, which would leave the biggest per-redraw cost out of
    the benchmark. This comm builds the same message ipykernel builds and runs it through
    ``jupyter_client.session.Session.serialize`` (JSON + HMAC-SHA256), discarding the frames.
    Returns counters (messages, bytes) that it updates."""
    import comm
    from comm.base_comm import BaseComm
    from jupyter_client.session import Session

    session = Session(key=b"colossal-lab-bench", username="bench")
    stats = {"messages": 0, "bytes": 0}

    class SerializingComm(BaseComm):
        def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
            content = dict(data={} if data is None else data, comm_id=self.comm_id, **keys)
            msg = session.msg(msg_type, content, parent={}, metadata=metadata or {})
            frames = session.serialize(msg, ident=self.topic)
            stats["messages"] += 1
            stats["bytes"] += sum(len(f) for f in frames)

    comm.create_comm = SerializingComm
    return stats


# ---------------------------------------------------------------- the training step (any rank)


def _build(preset, device_memory_limit, chunk_mb, batch, seq):
    """Model, Gemini booster (CPU + NVMe), a few fixed batches; returns (step_fn, cleanup, seq)."""
    import shutil as _sh
    import tempfile as _tf

    import torch

    from colossal_lab.engine import Booster
    from colossal_lab.engine.models import GPT, GPTConfig
    from colossal_lab.engine.plugins import GeminiPlugin

    torch.manual_seed(0)
    nvme = _tf.mkdtemp(prefix="bench_widgets_")
    cfg = GPTConfig.preset(preset)
    model = GPT(cfg)
    plugin = GeminiPlugin(placement_policy="auto", precision="fp32",
                          device_memory_limit=device_memory_limit, chunk_size_mb=chunk_mb,
                          nvme_offload_dir=nvme, nvme_offload_frac=1.0)
    booster = Booster(plugin=plugin)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gm, gopt, *_ = booster.boost(model, opt)
    seq = min(seq, cfg.block_size)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (batch, seq), generator=g) for _ in range(4)]

    def step(i):
        x = batches[i % len(batches)]
        _, loss = gm(x, x.roll(-1, 1))
        booster.backward(loss, gopt)
        gopt.step()
        gopt.zero_grad()

    def cleanup():
        plugin.close()
        _sh.rmtree(nvme, ignore_errors=True)

    return step, cleanup, seq


# ---------------------------------------------------------------- dashboard measurements


class DashProbe:
    """A live Dashboard plus counters read at the start and end of a timed block."""

    def __init__(self, max_hz: float, comm_stats: dict):
        from colossal_lab.widgets import Dashboard

        self.dash = Dashboard(live=True, max_hz=max_hz)
        self.comm = comm_stats

    def _snap(self) -> dict:
        th = self.dash._throttle
        return {"redraws": dict(self.dash.redraw_counts), "events": th.events + len(th.queue),
                "cpu": th.cpu_s, "busy": th.busy_s, "calls": th.calls, "wakes": th.wakes,
                "msgs": self.comm.get("messages", 0), "bytes": self.comm.get("bytes", 0),
                "t": time.perf_counter()}

    def start(self) -> None:
        self._a = self._snap()

    def stop(self) -> dict:
        b, a = self._snap(), self._a
        dt = b["t"] - a["t"]
        per = {k: (b["redraws"][k] - a["redraws"][k]) / dt for k in b["redraws"]}
        active = [v for v in per.values() if v > 0]
        th = self.dash._throttle
        return {"redraws_per_s_by_view": per,
                "redraws_per_s_per_active_view": sum(active) / max(1, len(active)),
                "events_per_s": (b["events"] - a["events"]) / dt,
                "ticks_per_s": (b["calls"] - a["calls"]) / dt,
                "wakes_per_s": (b["wakes"] - a["wakes"]) / dt,
                "redraw_cpu_frac": (b["cpu"] - a["cpu"]) / dt,
                "redraw_busy_frac": (b["busy"] - a["busy"]) / dt,
                "comm_kb_per_s": (b["bytes"] - a["bytes"]) / dt / 1e3,
                "errors": len(th.errors)}

    def close(self) -> None:
        self.dash.close()


# ---------------------------------------------------------------- in-process mode


def _orders(contenders, r, pairs):
    """The contenders' order for each block round of repeat ``r``: rotated per repeat and
    reversed every other round (ABBA...), so neither one always runs first or right after a
    build, and slow drifts in the box's load hit both alike."""
    k = r % len(contenders)
    base = tuple(contenders[k:] + contenders[:k])
    return [base if j % 2 == 0 else base[::-1] for j in range(pairs)]


def run_inproc(args, comm_stats) -> dict:
    import collections

    import torch.distributed as dist

    from colossal_lab.engine import telemetry

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    contenders = ("attached", "detached") + (("emit_only",) if args.emit_only else ())
    res = {c: [] for c in contenders}
    try:
        for r in range(args.repeats):
            step, cleanup, seq = _build(args.preset, args.device_memory_limit, args.chunk_mb,
                                        args.batch, args.seq)
            try:
                i = 0
                for _ in range(args.warmup):
                    step(i)
                    i += 1
                for order in _orders(contenders, r, args.pairs):
                    for c in order:
                        probe = DashProbe(args.max_hz, comm_stats) if c == "attached" else None
                        # emit_only: a subscriber that keeps nothing, so the engine builds and
                        # emits its events and nobody draws (the engine's share of the cost)
                        unsub = (telemetry.subscribe(collections.deque(maxlen=1).append)
                                 if c == "emit_only" else None)
                        try:
                            if probe:
                                probe.start()
                            c0, t0 = time.process_time(), time.perf_counter()
                            for _ in range(args.steps):
                                step(i)
                                i += 1
                            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
                            out = {"tok_s": args.steps * args.batch * seq / dt, "seconds": dt,
                                   "tokens": args.steps * args.batch * seq, "cpu_s": cpu}
                            if probe:
                                out.update(probe.stop())
                        finally:
                            if probe:
                                probe.close()
                            if unsub:
                                unsub()
                        res[c].append(out)
            finally:
                cleanup()
            if args.verbose:
                n = args.pairs
                print(json.dumps({"repeat": r, **{c: [round(x["tok_s"]) for x in res[c][-n:]]
                                                  for c in contenders}}), flush=True)
    finally:
        dist.destroy_process_group()
    return summarize("inproc", args, res, ranks=1)


# ---------------------------------------------------------------- cluster mode (ranks elsewhere)


def _rank_setup(bench_path, preset, device_memory_limit, chunk_mb, batch, seq, warmup):
    """On each rank: build model + booster, run warm-up steps, keep them for ``_rank_block``.
    (Shipped by code: this file is loaded on the rank by path for ``_build``.)"""
    import importlib.util
    import sys

    st = sys.modules.get("_colossal_bench_widgets")
    if st is None:
        spec = importlib.util.spec_from_file_location("_colossal_bench_widgets", bench_path)
        st = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(st)
        sys.modules["_colossal_bench_widgets"] = st
    old = getattr(st, "cleanup", None)
    if old is not None:
        old()
    st.step, st.cleanup, st.seq = st._build(preset, device_memory_limit, chunk_mb, batch, seq)
    st.batch, st.i = batch, 0
    for _ in range(warmup):
        st.step(st.i)
        st.i += 1
    return st.seq


def _rank_block(steps):
    """On each rank: ``steps`` timed steps; returns this rank's tokens, seconds, CPU seconds of
    the whole process, and of the relay's sender thread (0 without a relay) in that time."""
    import sys
    import time as _t

    import torch.distributed as _dist

    st = sys.modules["_colossal_bench_widgets"]
    try:
        from colossal_lab import relay as _relay
    except ImportError:
        _relay = None
    sink = getattr(_relay, "_rank_sink", None)
    _dist.barrier()
    s0 = getattr(sink, "cpu_s", 0.0)
    t0, c0 = _t.perf_counter(), _t.process_time()
    for _ in range(steps):
        st.step(st.i)
        st.i += 1
    dt, cpu = _t.perf_counter() - t0, _t.process_time() - c0
    return steps * st.batch * st.seq, dt, cpu, getattr(sink, "cpu_s", 0.0) - s0


def _rank_teardown():
    import sys

    st = sys.modules.get("_colossal_bench_widgets")
    if st is not None and getattr(st, "cleanup", None) is not None:
        st.cleanup()
        st.cleanup = None


def run_cluster(args, comm_stats) -> dict:
    import colossal_lab as cl
    from colossal_lab import relay as relay_mod

    contenders = ("attached", "detached") + (("relay_only",) if args.relay_only else ())
    res = {c: [] for c in contenders}
    relay_kw = {}  # only what was asked for: a relay whose attach() lacks a keyword still runs
    if args.relay_interval is not None:
        relay_kw["interval"] = args.relay_interval
    if args.no_coalesce:
        relay_kw["coalesce"] = False
    if args.memory_interval is not None:
        relay_kw["memory_interval"] = None if args.memory_interval == "none" else float(args.memory_interval)
    cluster = cl.launch(n=args.ranks, backend="gloo", threads=1)
    try:
        for r in range(args.repeats):
            cluster.run(_rank_setup, os.path.abspath(__file__), args.preset, args.device_memory_limit, args.chunk_mb,
                        args.batch, args.seq, args.warmup)
            for order in _orders(contenders, r, args.pairs):
                for c in order:
                    relay = relay_mod.attach(cluster, **relay_kw) if c != "detached" else None
                    probe = DashProbe(args.max_hz, comm_stats) if c == "attached" else None
                    try:
                        st0 = relay.rank_stats() if relay is not None else None
                        r0 = getattr(relay, "cpu_s", 0.0)
                        if probe:
                            probe.start()
                        k0 = time.process_time()
                        per_rank = cluster.run(_rank_block, args.steps)
                        k1 = time.process_time()
                        tokens, seconds = sum(x[0] for x in per_rank), max(x[1] for x in per_rank)
                        out = {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
                               # CPU seconds in the block: the ranks (whole processes), their
                               # relay sender threads, this process (the kernel), its receiver
                               "ranks_cpu_s": sum(x[2] for x in per_rank),
                               "sender_cpu_s": sum(x[3] for x in per_rank),
                               "kernel_cpu_s": k1 - k0,
                               "receiver_cpu_s": getattr(relay, "cpu_s", 0.0) - r0}
                        if probe:
                            time.sleep(0.3)  # let the events in flight arrive before counting
                            out.update(probe.stop())
                        if relay is not None:
                            st = relay.rank_stats()
                            out["relay_dropped"] = sum(x["dropped"] for x in st if x)
                            for k in ("sent", "rows", "messages"):  # per rank per second
                                out["relay_" + k] = sum(b.get(k, 0) - a.get(k, 0)
                                                        for a, b in zip(st0, st)) / len(st) / seconds
                    finally:
                        if probe:
                            probe.close()
                        if relay is not None:
                            relay.detach()
                    res[c].append(out)
            if args.verbose:
                n = args.pairs
                print(json.dumps({"repeat": r, **{c: [round(x["tok_s"]) for x in res[c][-n:]]
                                                  for c in contenders}}), flush=True)
        cluster.run(_rank_teardown)
    finally:
        cluster.stop()
    return summarize("cluster", args, res, ranks=args.ranks)


# ---------------------------------------------------------------- report


def summarize(mode, args, res, ranks) -> dict:
    med = statistics.median
    on = med(x["tok_s"] for x in res["attached"])
    off = med(x["tok_s"] for x in res["detached"])
    # blocks are paired in the order they ran (same repeat, same model, seconds apart)
    paired = [a["tok_s"] / b["tok_s"] for a, b in zip(res["attached"], res["detached"])]

    def pooled(c):  # all tokens over all seconds of a contender
        return sum(x["tokens"] for x in res[c]) / sum(x["seconds"] for x in res[c])

    att = res["attached"]
    out = {
        "bench": "widgets", "mode": mode, "ranks": ranks, "preset": args.preset,
        "batch": args.batch, "seq": args.seq, "steps_per_block": args.steps,
        "repeats": args.repeats, "blocks_per_contender": len(att), "max_hz": args.max_hz,
        "serialize": not args.no_serialize,
        "ratio": round(on / off, 4), "paired_ratio_median": round(med(paired), 4),
        "pooled_ratio": round(pooled("attached") / pooled("detached"), 4),
        "tok_s_attached_median": round(on, 1), "tok_s_detached_median": round(off, 1),
    }
    if all("cpu_s" in x for c in res for x in res[c]):
        # this process's CPU seconds per token (all threads): the direct cost, which the
        # other jobs on the box disturb far less than wall time
        cpt = {c: sum(x["cpu_s"] for x in res[c]) / sum(x["tokens"] for x in res[c]) for c in res}
        out["cpu_per_token_ratio"] = round(cpt["attached"] / cpt["detached"], 4)
        if "emit_only" in cpt:
            out["cpu_per_token_ratio_emit_only"] = round(cpt["emit_only"] / cpt["detached"], 4)
    if "emit_only" in res:
        eo = med(x["tok_s"] for x in res["emit_only"])
        out["tok_s_emit_only_median"] = round(eo, 1)
        out["ratio_emit_only"] = round(eo / off, 4)
        out["pooled_ratio_emit_only"] = round(pooled("emit_only") / pooled("detached"), 4)
        out["pooled_ratio_attached_vs_emit_only"] = round(pooled("attached") / pooled("emit_only"), 4)
    if "relay_only" in res:
        ro = med(x["tok_s"] for x in res["relay_only"])
        out["tok_s_relay_only_median"] = round(ro, 1)
        out["ratio_relay_only"] = round(ro / off, 4)
        out["pooled_ratio_relay_only"] = round(pooled("relay_only") / pooled("detached"), 4)
    if mode == "cluster":
        out["relay_dropped"] = sum(x.get("relay_dropped", 0) for c in res for x in res[c])
        out["relay_interval"] = args.relay_interval
        out["relay_coalesce"] = not args.no_coalesce
        # CPU seconds per token (ranks' processes + this kernel process), in microseconds: the
        # direct cost, which the box's load disturbs less than wall time
        tok = {c: sum(x["tokens"] for x in res[c]) for c in res}
        cpu = {}
        for c in res:
            d = {k: round(sum(x[k + "_cpu_s"] for x in res[c]) / tok[c] * 1e6, 3)
                 for k in ("ranks", "sender", "kernel", "receiver")}
            d["total"] = round(d["ranks"] + d["kernel"], 3)
            if c == "attached":
                d["redraw"] = round(sum(x["redraw_cpu_frac"] * x["seconds"] for x in res[c])
                                    / tok[c] * 1e6, 3)
            cpu[c] = d
        out["cpu_us_per_token"] = cpu
        # what the live path adds, measured on its own threads and the kernel process only
        # (rank senders + the kernel's CPU above its detached baseline), as a fraction of the
        # ranks' CPU per token when detached: not swamped by the ranks' own block-to-block noise
        for c in cpu:
            if c != "detached":
                extra = cpu[c]["sender"] + cpu[c]["kernel"] - cpu["detached"]["kernel"]
                out[f"direct_cpu_overhead_{c}"] = round(extra / cpu["detached"]["ranks"], 4)
        out["cpu_per_token_ratio"] = round(cpu["attached"]["total"] / cpu["detached"]["total"], 4)
        if "relay_only" in cpu:
            out["cpu_per_token_ratio_relay_only"] = round(cpu["relay_only"]["total"]
                                                          / cpu["detached"]["total"], 4)
        for c in ("attached", "relay_only"):
            if c in res and "relay_sent" in res[c][0]:
                out[f"relay_per_rank_per_s_{c}"] = {
                    k: round(med(x["relay_" + k] for x in res[c]), 1) for k in ("sent", "rows", "messages")}
    out.update({
        "events_per_s": round(med(x["events_per_s"] for x in att), 1),
        "redraws_per_s_per_active_view": round(med(x["redraws_per_s_per_active_view"] for x in att), 2),
        "redraws_per_s_by_view": {k: round(med(x["redraws_per_s_by_view"][k] for x in att), 2)
                                  for k in att[0]["redraws_per_s_by_view"]},
        "redraw_thread_ticks_per_s": round(med(x["ticks_per_s"] for x in att), 2),
        "redraw_thread_wakes_per_s": round(med(x["wakes_per_s"] for x in att), 2),
        "redraw_thread_cpu_frac": round(med(x["redraw_cpu_frac"] for x in att), 4),
        "redraw_thread_busy_frac": round(med(x["redraw_busy_frac"] for x in att), 4),
        "comm_kb_per_s": round(med(x["comm_kb_per_s"] for x in att), 1),
        "redraw_errors": max(x["errors"] for x in att),
        "target": 0.97,
    })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("inproc", "cluster", "both"), default="inproc")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per block")
    ap.add_argument("--pairs", type=int, default=6,
                    help="blocks per contender per repeat (order alternating)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="fresh model + booster each")
    ap.add_argument("--max-hz", type=float, default=5.0)
    ap.add_argument("--ranks", type=int, default=2, help="cluster mode: number of ranks")
    ap.add_argument("--emit-only", action="store_true",
                    help="inproc mode: also time the engine emitting to a subscriber that draws nothing")
    ap.add_argument("--relay-only", action="store_true",
                    help="cluster mode: also time the relay without a dashboard")
    ap.add_argument("--relay-interval", type=float, default=None,
                    help="cluster mode: seconds between a rank's relay messages (default: the relay's)")
    ap.add_argument("--no-coalesce", action="store_true",
                    help="cluster mode: the relay carries every event as emitted")
    ap.add_argument("--memory-interval", default=None,
                    help="cluster mode: seconds between each rank's memory samples, or 'none' for no "
                         "sampler (default: the relay's)")
    ap.add_argument("--nice", type=int, default=None,
                    help="how far the kernel's relay receiver and redraw thread step back "
                         "(telemetry.bus.BACKGROUND_NICE; 0: not at all; default: the library's)")
    ap.add_argument("--no-serialize", action="store_true",
                    help="leave out the kernel's JSON serialization of each comm message")
    ap.add_argument("--device-memory-limit", type=int, default=1 << 20, help="bytes")
    ap.add_argument("--chunk-mb", type=float, default=0.125)
    ap.add_argument("--runs", type=int, default=1,
                    help="whole measurements per mode (cluster: a fresh cluster each); with more "
                         "than one, a final JSON line gives every run's ratio and their median")
    ap.add_argument("--verbose", action="store_true", help="print each repeat's tokens/s")
    args = ap.parse_args()
    if args.repeats < 1 or args.steps < 1 or args.pairs < 1 or args.warmup < 0:
        ap.error("--repeats, --steps and --pairs must be >= 1 and --warmup >= 0")
    if args.ranks < 1:
        ap.error("--ranks must be >= 1")
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    if not args.max_hz > 0:
        ap.error("--max-hz must be > 0")
    if args.relay_interval is not None and not args.relay_interval > 0:
        ap.error("--relay-interval must be > 0 seconds")
    if args.nice is not None:
        from colossal_lab.engine.telemetry import bus

        bus.BACKGROUND_NICE = args.nice
    comm_stats = {} if args.no_serialize else install_serializing_comm()
    modes = [("inproc", run_inproc)] * (args.mode in ("inproc", "both")) + \
            [("cluster", run_cluster)] * (args.mode in ("cluster", "both"))
    for mode, run in modes:
        results = []
        for k in range(args.runs):
            out = run(args, comm_stats)
            if args.runs > 1:
                out = {"run": k + 1, **out}
            print(json.dumps(out), flush=True)
            results.append(out)
        if args.runs > 1:
            print(json.dumps(runs_summary(mode, args, results)), flush=True)


def runs_summary(mode, args, results) -> dict:
    """The final line over ``--runs`` whole measurements: each run's ratios and their medians."""
    med = statistics.median
    out = {"bench": "widgets", "mode": mode, "runs": len(results),
           "ranks": results[0]["ranks"], "repeats": args.repeats, "pairs": args.pairs,
           "steps_per_block": args.steps}
    for k in ("ratio", "paired_ratio_median", "pooled_ratio", "cpu_per_token_ratio"):
        if all(k in r for r in results):
            out[f"{k}_runs"] = [r[k] for r in results]
            out[f"{k}_median_of_runs"] = round(med(r[k] for r in results), 4)
    out["target"] = 0.97
    out["meets_target"] = out["ratio_median_of_runs"] >= out["target"]
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
