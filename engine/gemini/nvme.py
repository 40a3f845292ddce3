"""The NVMe tier's file store: one file per chunk block, read and written by an IO thread pool.

``os.pwrite``/``os.preadv`` over ``memoryview``s of the tensor's own bytes (no staging copy; both
release the GIL, so compute runs on while ``io_threads`` move bytes): torch has no async file IO,
and DeepSpeed's aio is a C++ build dependency we do not want. Buffered IO (the page cache) by
default; ``direct=True`` is ``O_DIRECT`` through per-thread page-aligned bounce buffers, files
padded to 4 KiB. Each store owns ``<root>/gemini-<pid>-<uuid>/``, removed by ``close()``,
``atexit`` and SIGTERM, or by the next store on that root once its pid is gone. Trade-offs and
why: docs/gemini.md (the ``nvme.py`` row and ``nvme_direct_io``).
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import mmap
import os
import shutil
import signal
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, Tuple

import torch

from ..telemetry.memory import register_nvme_dir, unregister_nvme_dir

_LIVE: "weakref.WeakSet[NVMeStore]" = weakref.WeakSet()
_ALIGN = 4096                # O_DIRECT alignment (logical block size of any common disk divides it)
_BOUNCE = 8 << 20            # bytes per IO thread's bounce buffer in direct mode
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


def check_direct_io(root: str) -> None:
    """Raise ``ValueError`` if files under ``root`` cannot be opened with ``O_DIRECT``."""
    if not hasattr(os, "O_DIRECT"):
        raise ValueError("GeminiPlugin(nvme_direct_io=True): this platform has no O_DIRECT; "
                         "use nvme_direct_io=False (buffered IO)")
    os.makedirs(root, exist_ok=True)
    probe = os.path.join(root, f".gemini-direct-probe-{os.getpid()}")
    buf = mmap.mmap(-1, _ALIGN)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, memoryview(buf), 0)
        finally:
            os.close(fd)
    except OSError as exc:
        raise ValueError(f"GeminiPlugin(nvme_direct_io=True): the file system of nvme_offload_dir={root!r} "
                         f"does not support O_DIRECT ({exc.strerror}); use a directory on a local disk "
                         "(ext4/xfs) or nvme_direct_io=False") from None
    finally:
        buf.close()
        try:
            os.remove(probe)
        except OSError:
            pass


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class NVMeStore:
    """Files under ``root`` holding tensor bytes; ``write``/``read`` return futures."""

    def __init__(self, root: str, io_threads: int = 4, direct: bool = False):
        if direct:
            check_direct_io(root)
        self.direct = direct
        self._local = threading.local()
        self._lock = threading.Lock()
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
        register_nvme_dir(self.dir)  # the rank's memory sampler reports this directory's bytes

    def path(self, key: str) -> str:
        return os.path.join(self.dir, key)

    @property
    def used(self) -> int:
        return sum(self._sizes.values())

    # ---- blocking primitives (run on the pool) -------------------------------------------------
    def _count(self, nread: int, nwritten: int, seconds: float) -> None:
        with self._lock:
            self.bytes_read += nread
            self.bytes_written += nwritten
            self.io_seconds += seconds

    def _bounce(self) -> Tuple[memoryview, int]:
        """This IO thread's bounce buffer for direct IO: a view of it and its address."""
        b = getattr(self._local, "buf", None)
        if b is None:
            b = self._local.buf = mmap.mmap(-1, _BOUNCE)  # anonymous mmap: page-aligned
        return memoryview(b), ctypes.addressof(ctypes.c_char.from_buffer(b))

    def _write_error(self, key: str, n: int, exc: OSError) -> OSError:
        return OSError(exc.errno, f"Gemini NVMe tier: writing {n} bytes to {self.path(key)} "
                       f"failed ({exc.strerror}); free space on the disk of nvme_offload_dir or "
                       "lower nvme_offload_frac. Checkpoints written before this step are intact.")

    def _write(self, key: str, t: torch.Tensor) -> None:
        buf = _as_bytes(t)
        n = len(buf)
        t0 = time.perf_counter()
        flags = os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if self.direct else 0)
        fd = os.open(self.path(key), flags, 0o600)
        try:
            if self.direct:
                self._write_direct(fd, key, t.data_ptr(), n)
            else:
                self._pwrite_all(fd, key, buf, 0, n)
        finally:
            os.close(fd)
        self._sizes[key] = n
        self._count(0, n, time.perf_counter() - t0)

    def _pwrite_all(self, fd: int, key: str, data: memoryview, offset: int, n: int) -> None:
        """Write all of ``data`` at ``offset`` of file ``key`` (``n``: the file's size, for errors)."""
        done = 0
        while done < len(data):
            try:
                w = os.pwrite(fd, data[done:], offset + done)
            except OSError as exc:
                raise self._write_error(key, n, exc) from exc
            if w <= 0:
                raise self._write_error(key, n, OSError(errno.EIO, "short write"))
            done += w

    def _write_direct(self, fd: int, key: str, src: int, n: int) -> None:
        view, addr = self._bounce()
        off = 0
        while off < n:
            k = min(_BOUNCE, n - off)
            ctypes.memmove(addr, src + off, k)          # releases the GIL
            kk = _round_up(k)
            if kk != k:
                ctypes.memset(addr + k, 0, kk - k)       # pad the last block
            self._pwrite_all(fd, key, view[:kk], off, n)
            off += k
        del view

    def _read(self, key: str, out: torch.Tensor) -> torch.Tensor:
        buf = _as_bytes(out)
        n = len(buf)
        t0 = time.perf_counter()
        fd = os.open(self.path(key), os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        try:
            if self.direct:
                self._read_direct(fd, key, out.data_ptr(), n)
            else:
                self._preadv(fd, key, buf, 0)
        finally:
            os.close(fd)
        self._count(n, 0, time.perf_counter() - t0)
        return out

    def _preadv(self, fd: int, key: str, buf: memoryview, offset: int) -> None:
        done = 0
        while done < len(buf):
            r = os.preadv(fd, [buf[done:]], offset + done)
            if r == 0:
                raise self._short(key, done, len(buf))
            done += r

    def _short(self, key: str, done: int, n: int) -> IOError:
        return IOError(f"Gemini NVMe tier: {self.path(key)} is shorter than expected "
                       f"({done} of {n} bytes); was the offload directory modified?")

    def _read_direct(self, fd: int, key: str, dst: int, n: int) -> None:
        view, addr = self._bounce()
        off = 0
        while off < n:
            k = min(_BOUNCE, n - off)
            kk = _round_up(k)
            done = 0
            while done < k:
                r = os.preadv(fd, [view[done:kk]], off + done)
                if r == 0:
                    raise self._short(key, off + done, n)
                done += r
            ctypes.memmove(dst + off, addr, k)           # releases the GIL
            off += k
        del view

    # ---- async API ---------------------------------------------------------------------------
    def write(self, key: str, t: torch.Tensor) -> Future:
        """Write ``t``'s bytes to file ``key`` in the background; keep ``t`` alive until done."""
        self._check_open()
        return self._pool.submit(self._write, key, t)

    def read(self, key: str, out: torch.Tensor) -> Future:
        """Fill ``out`` from file ``key`` in the background; the future returns ``out``."""
        self._check_open()
        return self._pool.submit(self._read, key, out)

    def read_at(self, key: str, offset: int, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (any device or layout) from file ``key`` at byte ``offset``, now and through
        the page cache: any offset, and coherent with files written with ``O_DIRECT``."""
        self._check_open()
        host = out if out.device.type == "cpu" and out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
        fd = os.open(self.path(key), os.O_RDONLY)
        try:
            self._preadv(fd, key, _as_bytes(host), offset)
        finally:
            os.close(fd)
        return out if host is out else out.copy_(host)

    def rename(self, src: str, dst: str) -> None:
        """File ``src`` becomes ``dst`` (replacing it); nothing when there is no ``src``."""
        if os.path.exists(self.path(src)):
            os.replace(self.path(src), self.path(dst))
            self._sizes[dst] = self._sizes.pop(src, 0)

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
        unregister_nvme_dir(self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)
        _LIVE.discard(self)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
