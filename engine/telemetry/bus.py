"""The in-process event bus: ``emit`` fans an event out to every subscriber.

Why so small: emitting sits on the training hot path, so with no subscriber it is one list
check, and a subscriber that raises is dropped from that call with a warning rather than
breaking the training step. Subscribers run synchronously on the emitting thread; a sink that
does slow work (the relay, a widget) must queue and return.
"""

from __future__ import annotations

import threading
import warnings
from typing import Callable, List, Optional

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


BACKGROUND_NICE = 10  # how far a telemetry consumer's thread steps back (Linux nice units)


def background_priority(nice: Optional[int] = None) -> bool:
    """Lower the *calling thread's* CPU priority by ``nice`` (default ``BACKGROUND_NICE``, read
    at the call; Linux); True when it was lowered.

    For the threads that consume telemetry beside training, in the process that draws (the
    relay's receiver, a dashboard's redraw thread): they must take CPU the ranks leave idle,
    not CPU the ranks want. On a CPU-bound box (ranks filling every core) a normal-priority
    thread waking at 5 Hz preempts a rank, and the ranks, in lockstep at each collective, all
    wait for that one; at nice 10 it runs in the gaps (or at ~1/10 of a core's share when
    there are none), which is still plenty for a throttled redraw. Linux applies nice per
    thread (``setpriority`` on the thread id) within the process's scheduling autogroup, so
    it orders these threads against ranks launched from the same session (``cl.launch`` ranks
    are), not against other sessions. Elsewhere (macOS, Windows) nothing changes. Never raises:
    a priority is a preference, not a requirement."""
    import os
    import sys

    nice = BACKGROUND_NICE if nice is None else nice
    if not sys.platform.startswith("linux") or nice <= 0:
        return False
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        return True
    except (OSError, AttributeError):
        return False


_AUTOGROUP = "/proc/self/autogroup"


def session_group() -> Optional[str]:
    """This process's Linux scheduling autogroup (``"/autogroup-N"``), None where there is none."""
    try:
        with open(_AUTOGROUP) as f:
            return f.read().split()[0]
    except (OSError, IndexError):
        return None


def session_background(nice: Optional[int] = None) -> Optional[int]:
    """Step this process's scheduling *autogroup* back to ``nice`` (default ``BACKGROUND_NICE``);
    returns the nice it had (for :func:`session_restore`), None when nothing changed.

    Why, beside :func:`background_priority`: Linux shares the CPU first between autogroups (one
    per session) and only then between the threads of each, by their nice. ``cl.launch``'s
    ranks are ipyparallel engines, each started in a session of its own, so a kernel thread at
    nice 10 still weighs as much as a whole rank whenever it runs: on a box whose cores the
    ranks fill, each redraw takes its CPU from training at full weight. Lowering the kernel's
    autogroup (the kernel's own session under Jupyter) while it only draws for ranks elsewhere
    makes its threads take what the ranks leave. Only where it can be undone: unprivileged
    processes may lower their priority but not raise it back (unless ``RLIMIT_NICE`` allows),
    and a kernel left at the lower weight after detach would be a surprise; there it does
    nothing. Where the cores have room for the kernel anyway it changes nothing; it is for a
    kernel that draws while other work competes for them (figures: docs/widgets.md, "The 0.97x
    target")."""
    nice = BACKGROUND_NICE if nice is None else nice
    try:
        with open(_AUTOGROUP) as f:
            now = int(f.read().split()[-1])
        if now >= nice or not _can_raise_to(now):
            return None  # already lower, or no way back afterwards: leave the kernel as it is
        with open(_AUTOGROUP, "w") as f:
            f.write(str(nice))
        return now
    except (OSError, ValueError, IndexError):
        return None


def _can_raise_to(nice: int) -> bool:
    """Whether this process may set its autogroup back to ``nice`` later (root, or an
    ``RLIMIT_NICE`` that allows it: the kernel's ``20 - rlim`` floor)."""
    import os

    if os.geteuid() == 0:
        return True
    try:
        import resource

        return 20 - resource.getrlimit(resource.RLIMIT_NICE)[0] <= nice
    except (ImportError, OSError, ValueError):
        return False


def session_restore(previous: Optional[int]) -> bool:
    """Put back the autogroup nice :func:`session_background` returned; False if not allowed."""
    if previous is None:
        return False
    try:
        with open(_AUTOGROUP, "w") as f:
            f.write(str(previous))
        return True
    except OSError:
        return False
