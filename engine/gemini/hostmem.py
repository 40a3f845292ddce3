"""Keep freed chunk buffers from pinning host RSS (glibc's malloc, CPU compute tier).

glibc's dynamic mmap threshold would serve Gemini's chunk-sized buffers from a heap that rarely
returns memory; fixing the threshold makes RSS follow Gemini's accounting. Process-wide, applied
only under a CPU compute-tier budget, a no-op on other C libraries. Why and measured: docs/gemini.md,
``hostmem.py`` row.
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
