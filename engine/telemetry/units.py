"""Byte counts as people read them, one rule for the whole project (planner tables, checkpointing
plans, the chunk map's labels): binary units, three significant digits (``1.50 MiB``, ``33.8 MiB``,
``300 KiB``), whole bytes below 1 KiB, ``-`` for an unknown figure."""
from __future__ import annotations

import functools
from typing import Optional

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    return _format(int(n)) if float(n).is_integer() else _format_float(float(n))


@functools.lru_cache(maxsize=4096)  # a model's chunks share a handful of sizes
def _format(n: int) -> str:
    return _format_float(float(n))


def _format_float(n: float) -> str:
    v = n
    for unit in _UNITS:
        if abs(v) < 1024 or unit == _UNITS[-1]:
            break
        v /= 1024
    if unit == "B":
        return f"{int(n)} B"
    a = abs(v)
    return f"{v:.2f} {unit}" if a < 10 else f"{v:.1f} {unit}" if a < 100 else f"{v:.0f} {unit}"
