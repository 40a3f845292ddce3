"""The in-process event bus: ``emit`` fans an event out to every subscriber.

Why so small: emitting sits on the training hot path, so with no subscriber it is one list
check, and a subscriber that raises is dropped from that call with a warning rather than
breaking the training step. Subscribers run synchronously on the emitting thread; a sink that
does slow work (the relay, a widget) must queue and return.
"""

from __future__ import annotations

import threading
import warnings
from typing import Callable, List

from .events import Event

Subscriber = Callable[[Event], None]

_lock = threading.Lock()
_subscribers: List[Subscriber] = []


def subscribe(fn: Subscriber) -> Callable[[], None]:
    """Call ``fn(event)`` for every event emitted in this process; returns an unsubscribe."""
    if not callable(fn):
        raise TypeError(f"telemetry.subscribe(fn): fn must be callable, got {type(fn).__name__}")
    global _subscribers
    with _lock:
        _subscribers = _subscribers + [fn]

    def unsubscribe() -> None:
        global _subscribers
        with _lock:
            _subscribers = [s for s in _subscribers if s is not fn]

    return unsubscribe


def has_subscribers() -> bool:
    """True when someone listens: lets emitters skip building events nobody reads."""
    return bool(_subscribers)


def emit(event: Event) -> None:
    """Deliver ``event`` to every current subscriber (copy-on-write list, no lock held)."""
    for fn in _subscribers:
        try:
            fn(event)
        except Exception as exc:  # a broken sink must never break training
            warnings.warn(f"telemetry subscriber {fn!r} raised {exc!r}; event dropped for it")
