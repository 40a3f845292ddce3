"""Run a function on N real processes with torch.distributed (gloo) up, from a test.

The parent hosts the rendezvous TCPStore on port 0 (the OS picks a free port, so no race
between "find a free port" and "bind it"); children join it as clients. Results come back
ordered by rank; a child's exception is re-raised in the test with its rank and traceback.
A child that hangs is killed after ``timeout`` seconds, so a broken collective fails the test
instead of hanging CI.

Children are spawned (a fresh interpreter each), unless the call asks to ``preload``: then they fork
from a server process that imported torch, the engine and transformers once (``multiprocessing``'s
forkserver), so eight ranks do not each spend seconds of CPU importing them on a 2-core machine.
Either way a child starts with the parent's environment as it is at the call, and runs no test code
the parent ran.
"""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List

import torch.distributed as dist
import torch.multiprocessing as mp


def _child(rank, world_size, port, fn, args, kwargs, q, backend, env):
    os.environ.clear()
    os.environ.update(env)  # the parent's at the call (a forked child would have the server's)
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


#: what a child started with ``preload=True`` finds imported: torch, the engine, and transformers with the
#: model code the tests build most (a module that does not import is left out, as without transformers)
PRELOAD = ("torch", "torch.distributed.tensor.parallel", "colossal_lab.engine", "colossal_lab.engine.plugins",
           "transformers", "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
           "safetensors.torch")


def _forkserver():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read once, when the server starts (the first such call)
    return ctx


def _next_report(q, procs, reported, timeout: float):
    """The next rank's ``(rank, status, payload)`` within ``timeout`` seconds (``queue.Empty`` after). A
    rank that exited without a report failed before its function ran (it could not unpickle it: the
    test module changed on disk during the run, say); it is reported at once with its exit code, not
    after the other ranks time out waiting for it in the rendezvous."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            pass
        gone = [r for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
        if gone:
            try:
                return q.get(timeout=2.0)  # a report it sent just before exiting may still be in the pipe
            except queue.Empty:
                r = gone[0]
                return r, "err", (f"rank {r} exited with code {procs[r].exitcode} before running the function, "
                                  "without a report (its own traceback is in the test's stderr)")
        if time.monotonic() >= deadline:
            raise queue.Empty


def run_distributed(fn: Callable[..., Any], world_size: int, *args, backend: str = "gloo",
                    timeout: float = 300.0, preload: bool = False, **kwargs) -> List[Any]:
    """``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes; results by rank.

    ``fn`` must be importable (a module-level function of a test module). ``preload``: the children fork
    from a server that imported :data:`PRELOAD` (see above) instead of each starting a fresh interpreter.
    """
    ctx = _forkserver() if preload else mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          wait_for_workers=False, timeout=timedelta(seconds=60))
    q = ctx.Queue()
    env = dict(os.environ)
    procs = [ctx.Process(target=_child, args=(r, world_size, store.port, fn, args, kwargs, q, backend, env),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        for _ in range(world_size):
            try:
                rank, status, payload = _next_report(q, procs, set(results) | set(errors), timeout)
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
