"""The NVMe tier's file store: one file per chunk block, read and written by an IO thread pool.

Built on ``os.pwrite``/``os.preadv`` over ``memoryview``s of the tensor's own bytes, so a
read lands straight in tensor memory with no staging copy, and both calls release the GIL
(the compute thread keeps running while a thread pool of ``io_threads`` moves bytes). We
hand-wrote this because torch has no async file IO; DeepSpeed's aio library is a C++ build
dependency we do not want.

Cleanup: every store owns a directory ``<root>/gemini-<pid>-<uuid>/``. ``close()`` removes it,
``atexit`` removes it on a normal exit or an uncaught exception, and a SIGTERM handler (only
installed when none was set) turns SIGTERM into ``SystemExit`` so ``atexit`` still runs. A
SIGKILLed process cannot clean up; the next store opened on the same root removes
directories whose pid is no longer alive.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import threading
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict

import torch

_LIVE: "weakref.WeakSet[NVMeStore]" = weakref.WeakSet()
_SIGTERM_INSTALLED = False


def _close_all() -> None:
    for store in list(_LIVE):
        store.close()


atexit.register(_close_all)


def _install_sigterm() -> None:
    """Make SIGTERM run atexit (default SIGTERM kills without it); never override a user's handler."""
    global _SIGTERM_INSTALLED
    if _SIGTERM_INSTALLED or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            def _on_term(signum, frame):
                raise SystemExit(128 + signum)

            signal.signal(signal.SIGTERM, _on_term)
    except (ValueError, OSError):  # not the main interpreter / platform without signals
        return
    _SIGTERM_INSTALLED = True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(root: str) -> int:
    """Remove ``gemini-<pid>-*`` directories under ``root`` whose process is gone; returns how many."""
    n = 0
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == "gemini" and parts[1].isdigit():
            if not _pid_alive(int(parts[1])):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                n += 1
    return n


def _as_bytes(t: torch.Tensor) -> memoryview:
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("NVMeStore: tensors must be contiguous CPU tensors")
    if not t.numel():
        return memoryview(b"")
    # ctypes, not .numpy(): numpy views mark the storage non-resizable, and chunk buffers are
    # resized to 0 bytes on release.
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


class NVMeStore:
    """Files under ``root`` holding tensor bytes; ``write``/``read`` return futures."""

    def __init__(self, root: str, io_threads: int = 4):
        os.makedirs(root, exist_ok=True)
        remove_stale(root)
        self.root = root
        self.dir = os.path.join(root, f"gemini-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(self.dir)
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="gemini-nvme")
        self._sizes: Dict[str, int] = {}
        self.bytes_written = 0
        self.bytes_read = 0
        self.io_seconds = 0.0
        self._closed = False
        _LIVE.add(self)
        _install_sigterm()

    def path(self, key: str) -> str:
        return os.path.join(self.dir, key)

    @property
    def used(self) -> int:
        return sum(self._sizes.values())

    # ---- blocking primitives (run on the pool) -------------------------------------------------
    def _write(self, key: str, t: torch.Tensor) -> None:
        import time

        buf = _as_bytes(t)
        t0 = time.perf_counter()
        fd = os.open(self.path(key), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            done = 0
            while done < len(buf):
                try:
                    done += os.pwrite(fd, buf[done:], done)
                except OSError as exc:
                    raise OSError(exc.errno, f"Gemini NVMe tier: writing {len(buf)} bytes to {self.path(key)} "
                                  f"failed ({exc.strerror}); free space on the disk of nvme_offload_dir or "
                                  "lower nvme_offload_frac. Checkpoints written before this step are intact.") from exc
        finally:
            os.close(fd)
        self.io_seconds += time.perf_counter() - t0
        self._sizes[key] = len(buf)
        self.bytes_written += len(buf)

    def _read(self, key: str, out: torch.Tensor) -> torch.Tensor:
        import time

        buf = _as_bytes(out)
        t0 = time.perf_counter()
        fd = os.open(self.path(key), os.O_RDONLY)
        try:
            done = 0
            while done < len(buf):
                n = os.preadv(fd, [buf[done:]], done)
                if n == 0:
                    raise IOError(f"Gemini NVMe tier: {self.path(key)} is shorter than expected "
                                  f"({done} of {len(buf)} bytes); was the offload directory modified?")
                done += n
        finally:
            os.close(fd)
        self.io_seconds += time.perf_counter() - t0
        self.bytes_read += len(buf)
        return out

    # ---- async API ---------------------------------------------------------------------------
    def write(self, key: str, t: torch.Tensor) -> Future:
        """Write ``t``'s bytes to file ``key`` in the background; keep ``t`` alive until done."""
        self._check_open()
        return self._pool.submit(self._write, key, t)

    def read(self, key: str, out: torch.Tensor) -> Future:
        """Fill ``out`` from file ``key`` in the background; the future returns ``out``."""
        self._check_open()
        return self._pool.submit(self._read, key, out)

    def remove(self, key: str) -> None:
        self._sizes.pop(key, None)
        try:
            os.remove(self.path(key))
        except FileNotFoundError:
            pass

    def files(self):
        return sorted(os.listdir(self.dir)) if os.path.isdir(self.dir) else []

    def _check_open(self):
        if self._closed:
            raise RuntimeError("NVMeStore is closed (the Gemini plugin was closed); boost a new model")

    def close(self) -> None:
        """Wait for pending IO, then delete this store's directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        _LIVE.discard(self)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
