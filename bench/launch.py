"""Time from launch to a finished first all_reduce: ``cl.launch`` vs bare ipyparallel.

Contenders, interleaved in one run, ``--repeats`` times each:
  ours          cl.launch(n) then cluster.run(all_reduce)
  bare          ipyparallel.Cluster(n=n).start_and_connect_sync() (its defaults, as a user
                would write it) + a hand-written torch.distributed init (TCPStore on port 0 in
                the parent, init_process_group on each engine) + the same all_reduce
  bare_nodelay  the same with Cluster(delay=0), the setting cl.launch uses — the strict
                baseline: what our extra work (probe, rank map, env, watchdog) costs

Prints one JSON line: medians in seconds and ratios ours / baseline (target: <= 1.2).
Run: OMP_NUM_THREADS=1 .venv/bin/python bench/launch.py [--n 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from datetime import timedelta


def _all_reduce():
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _init(rank, world, port):
    import os
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))


def ours(n: int) -> float:
    import colossal_lab as cl

    t0 = time.perf_counter()
    c = cl.launch(n=n, backend="gloo")
    try:
        assert c.run(_all_reduce) == [float(n)] * n
        return time.perf_counter() - t0
    finally:
        c.stop()


def bare(n: int, delay=None) -> float:
    import ipyparallel as ipp
    import torch.distributed as dist

    t0 = time.perf_counter()
    kw = {} if delay is None else {"delay": delay}
    cluster = ipp.Cluster(n=n, log_level=logging.WARNING, **kw)
    rc = cluster.start_and_connect_sync()
    try:
        store = dist.TCPStore("127.0.0.1", 0, n + 1, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=120))
        ids = sorted(rc.ids)
        ars = [rc[e].apply_async(_init, r, n, store.port) for r, e in enumerate(ids)]
        [a.get() for a in ars]
        assert rc[ids].apply_sync(_all_reduce) == [float(n)] * n
        return time.perf_counter() - t0
    finally:
        rc.close()
        cluster.stop_cluster_sync()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    times = {"ours": [], "bare": [], "bare_nodelay": []}
    for _ in range(a.repeats):  # interleaved, so machine-load drift hits all three alike
        times["ours"].append(ours(a.n))
        times["bare"].append(bare(a.n))
        times["bare_nodelay"].append(bare(a.n, delay=0))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({
        "bench": "launch", "n": a.n, "repeats": a.repeats, "cpu_count": os.cpu_count(),
        "ours_s": round(med["ours"], 3), "bare_s": round(med["bare"], 3),
        "bare_nodelay_s": round(med["bare_nodelay"], 3),
        "ratio_vs_bare": round(med["ours"] / med["bare"], 3),
        "ratio_vs_bare_nodelay": round(med["ours"] / med["bare_nodelay"], 3),
        "raw": {k: [round(x, 3) for x in v] for k, v in times.items()},
    }))


if __name__ == "__main__":
    main()
