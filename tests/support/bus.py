"""What reaches this process's telemetry bus, collected for a test to look at: the relay's receiver
thread re-emits the ranks' events here, so the list is kept under a lock."""

from __future__ import annotations

import threading
import time

from colossal_lab.engine import telemetry as T


class BusSink:
    """Every event emitted on this process's bus from now until ``close`` (or the ``with`` block's end)."""

    def __init__(self):
        self._got: list = []
        self._lock = threading.Lock()
        self._unsub = T.subscribe(self)

    def __call__(self, event) -> None:
        with self._lock:
            self._got.append(event)

    def close(self) -> None:
        self._unsub()

    def __enter__(self) -> "BusSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def events(self) -> list:
        """A copy of what arrived so far, in arrival order."""
        with self._lock:
            return list(self._got)

    def __len__(self) -> int:
        with self._lock:
            return len(self._got)

    def wait_for(self, n: int, timeout: float) -> list:
        """The events once at least ``n`` arrived, or what arrived by ``timeout`` seconds."""
        deadline = time.time() + timeout
        while time.time() < deadline and len(self) < n:
            time.sleep(0.05)
        return self.events()
