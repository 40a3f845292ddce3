"""What runs *on* each rank (an ipyparallel engine) to bring torch.distributed up and down.

These functions are shipped to engines by reference (``colossal_lab._rank.<name>``), so the
engine imports this module instead of receiving code. They only touch the engine's own
process: environment variables, device, default process group, import path.

How a ``Cluster.run`` call's function and arguments arrive on a rank (both halves) is in
``shipping.py``.

Why the notebook hosts the rendezvous store: the kernel opens ``dist.TCPStore`` on port 0, so
the OS picks a free port and keeps it bound — there is no window between "find a free port"
and "bind it" for another process to steal it. Every rank joins that store as a client.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from typing import Any, Dict, List, Optional


def probe() -> Dict[str, Any]:
    """Facts the notebook needs before assigning ranks: host, pid, visible GPUs."""
    gpus = 0
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # torch missing or broken on this engine: reported as 0 GPUs
        gpus = 0
    return {"host": socket.gethostname(), "pid": os.getpid(), "gpus": gpus}


def setup(rank: int, world_size: int, local_rank: int, master_addr: str, master_port: int,
          backend: str, timeout_s: float, generation: int, cwd: Optional[str],
          sys_path: List[str], threads: Optional[int], watch: Optional[tuple] = None,
          watch_kernel_store: bool = False) -> Dict[str, Any]:
    """Set the rank's environment, pick its device and join the default process group.

    ``generation`` namespaces the store keys, so a process group rebuilt after a failure
    never reads keys left by the previous one.
    ``watch``: (kernel pid, kernel start time, pids to kill) for ``watch_parent``;
    ``watch_kernel_store``: exit when the kernel's store is gone (``watch_store``), for ranks that
    may be on another host than the kernel.
    """
    import torch
    import torch.distributed as dist

    if watch:
        watch_parent(*watch)
    if watch_kernel_store:
        watch_store(master_addr, master_port)
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)  # the notebook's folder: relative paths mean the same thing on every rank
    for p in reversed(sys_path):
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
    })
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    if dist.is_initialized():
        _destroy()
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_addr, master_port, is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"colossal/{generation}/", store)
    kw = {"device_id": torch.device(device)} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout, **kw)
    os.environ["COLOSSAL_DEVICE"] = device
    return {"rank": dist.get_rank(), "device": device, "pid": os.getpid()}


def watch_parent(pid: int, create_time: float, also_kill: Optional[List[int]] = None) -> None:
    """Exit this rank when the notebook kernel ``pid`` is gone, however it died.

    A kernel that exits normally stops its cluster (atexit); one killed with SIGKILL cannot,
    and ipyparallel starts engines in their own session, so nothing else would stop them.
    Only used with the ``local`` launcher, where the kernel's pid means something here.
    """
    import threading

    def loop() -> None:
        wait_for_kernel(pid, create_time, also_kill)
        os._exit(3)

    if not getattr(watch_parent, "_started", False):
        watch_parent._started = True
        threading.Thread(target=loop, name="colossal-watch-kernel", daemon=True).start()


def wait_for_kernel(pid: int, create_time: float, also_kill: Optional[List[int]] = None,
                    until_they_exit: bool = False) -> bool:
    """Block while the process ``pid`` (started at ``create_time``) lives; then kill ``also_kill``
    and their children (the controller's own children first: once it is dead they are init's,
    and nothing would find them) and return True. With ``until_they_exit``, return False as soon
    as every ``also_kill`` process has exited by itself (the cluster was stopped)."""
    import time

    import psutil

    def alive() -> bool:  # a zombie (killed, not yet reaped by its parent) is gone too
        try:
            p = psutil.Process(pid)
            return abs(p.create_time() - create_time) < 1.0 and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def any_left() -> bool:
        return any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in also_kill or [])

    while alive():
        if until_they_exit and not any_left():
            return False
        time.sleep(1.0)
    for other in also_kill or []:
        try:
            proc = psutil.Process(other)
            tree = proc.children(recursive=True) + [proc]
        except psutil.Error:
            continue
        for p in tree:
            try:
                p.kill()
            except psutil.Error:
                pass
    return True


def watch_store(addr: str, port: int, misses: int = 3) -> None:
    """Exit this rank when the rendezvous store the notebook kernel hosts refuses connections:
    the kernel is gone (killed without cleanup), as seen from any host.

    Ranks on other hosts cannot look the kernel's pid up, but its store's port is refused once
    the kernel's process has died. Polled once a second from a thread, so a rank busy in a
    computation or blocked in a collective goes too; ``misses`` refusals in a row, so one
    dropped connection is not taken for a dead kernel."""
    import threading
    import time

    watch_store.target = (addr, port)  # a rebuilt process group may move the store: follow it

    def refused() -> bool:
        try:
            with socket.create_connection(watch_store.target, timeout=5):
                return False
        except ConnectionRefusedError:
            return True
        except OSError:  # a timeout, or the kernel's host unreachable: not taken as proof
            return False

    def loop() -> None:
        gone = 0
        while gone < misses:
            time.sleep(1.0)
            gone = gone + 1 if refused() else 0
        os._exit(3)

    if not getattr(watch_store, "_started", False):
        watch_store._started = True
        threading.Thread(target=loop, name="colossal-watch-store", daemon=True).start()


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group (timed out, peer gone) may fail to tear down cleanly
            pass


def teardown() -> None:
    """Leave the process group (called before the engines are stopped)."""
    _destroy()


def status() -> Dict[str, Any]:
    """One row of ``Cluster.status()``: who and where this rank is, and what memory it uses."""
    import psutil

    row: Dict[str, Any] = {
        "rank": int(os.environ.get("RANK", -1)),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "device": os.environ.get("COLOSSAL_DEVICE", "cpu"),
        "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
        "gpu_mb": None,
    }
    try:
        import torch
        import torch.distributed as dist

        row["dist"] = dist.is_initialized()
        if row["device"].startswith("cuda"):
            row["gpu_mb"] = round(torch.cuda.memory_allocated(row["device"]) / 2**20, 1)
    except Exception:
        row["dist"] = False
    return row
