"""Run a function on N real processes with torch.distributed (gloo) up, from a test.

The parent hosts the rendezvous TCPStore on port 0 (the OS picks a free port, so no race
between "find a free port" and "bind it"); children join it as clients. Results come back
ordered by rank; a child's exception is re-raised in the test with its rank and traceback.
A child that hangs is killed after ``timeout`` seconds, so a broken collective fails the test
instead of hanging CI.
"""

from __future__ import annotations

import os
import pickle
import queue
import traceback
from datetime import timedelta
from typing import Any, Callable, List

import torch.distributed as dist
import torch.multiprocessing as mp


def _child(rank, world_size, port, fn, args, kwargs, q, backend):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=timedelta(seconds=60))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=120))
        try:
            out = fn(rank, world_size, *args, **kwargs)
        finally:
            dist.destroy_process_group()
        q.put((rank, "ok", pickle.dumps(out)))
    except BaseException:
        q.put((rank, "err", traceback.format_exc()))


def run_distributed(fn: Callable[..., Any], world_size: int, *args, backend: str = "gloo",
                    timeout: float = 300.0, **kwargs) -> List[Any]:
    """``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes; results by rank.

    ``fn`` must be importable (a module-level function of a test module).
    """
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          wait_for_workers=False, timeout=timedelta(seconds=60))
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, world_size, store.port, fn, args, kwargs, q, backend),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        for _ in range(world_size):
            try:
                rank, status, payload = q.get(timeout=timeout)
            except queue.Empty:
                late = sorted(set(range(world_size)) - set(results) - set(errors))
                raise TimeoutError(f"run_distributed: ranks {late} "
                                   f"did not finish within {timeout}s") from None
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                break  # one failure is enough; the others may be stuck in a collective
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise RuntimeError(f"run_distributed: {len(errors)} rank(s) failed\n{msg}")
    return [results[r] for r in range(world_size)]
