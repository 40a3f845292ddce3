"""Keep freed chunk buffers from pinning host RSS (glibc's malloc, CPU compute tier).

Why: Gemini allocates and frees chunk-sized buffers all the time (gathers, fp32 gradient
buffers, optimizer windows, NVMe staging). glibc serves a large request with ``mmap`` and
returns it on ``free`` — but after the first such free it raises its mmap threshold to that
size (up to 32 MiB) and serves later requests of that size from the heap, which it returns to
the OS only when the top of the heap is free. Measured on the reference GPT with a 32 MiB
``device_memory_limit``: ~90 MiB of RSS stayed pinned after boost and peak RSS grew by ~150 MiB
instead of ~45 MiB. Fixing the threshold (``mallopt(M_MMAP_THRESHOLD)``, which also stops the
dynamic adjustment, exactly like the ``MALLOC_MMAP_THRESHOLD_`` environment variable) makes
every buffer above it go back to the OS on free, so RSS tracks Gemini's accounting.

It is process-wide and only applied when a CPU compute tier has a byte budget; on other C
libraries (musl, macOS) it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3
_applied = False


def bound_host_heap(threshold: int = 128 << 10) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes; True if applied (idempotent)."""
    global _applied
    if _applied:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _applied = bool(mallopt(M_MMAP_THRESHOLD, threshold))
    return _applied
