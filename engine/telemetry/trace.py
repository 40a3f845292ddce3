"""JSONL traces: every event of this process to a file, and back as the same dataclasses.

One JSON object per line, flushed per event so a trace survives a crash up to its last event
and can be tailed while training runs. Reading skips a torn last line (a writer killed
mid-line) instead of failing the whole replay.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from typing import Iterator, List

from .bus import subscribe
from .events import Event, from_dict, to_dict


@contextlib.contextmanager
def record(path: str | os.PathLike) -> Iterator[str]:
    """Write every event emitted in this process inside the block to ``path`` (JSONL)."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"telemetry.record(path={path!r}): folder {parent!r} does not exist")
    lock = threading.Lock()
    with open(path, "a", encoding="utf-8") as f:

        def sink(event: Event) -> None:
            line = json.dumps(to_dict(event), separators=(",", ":"))
            with lock:
                f.write(line + "\n")
                f.flush()

        unsubscribe = subscribe(sink)
        try:
            yield path
        finally:
            unsubscribe()


def write_trace(path: str | os.PathLike, events) -> None:
    """Write ``events`` to ``path`` as JSONL (replacing the file)."""
    with open(path, "w", encoding="utf-8") as f:
        for e in events:
            f.write(json.dumps(to_dict(e), separators=(",", ":")) + "\n")


def read_trace(path: str | os.PathLike) -> List[Event]:
    """The events of a JSONL trace, in file order, as the dataclasses they were emitted as."""
    events: List[Event] = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1 or all(not l.strip() for l in lines[i + 1:]):
                break  # torn last line from a writer that died mid-write
            raise ValueError(f"{path}: line {i + 1} is not JSON: {line[:80]!r}")
        events.append(from_dict(d))
    return events
