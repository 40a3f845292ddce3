"""The live machinery every widget shares: queue, throttled redraw thread, display fallback.

Why hand-written: ipywidgets and plotly give the picture and the comm to the browser, but
nothing that (a) takes events from a training thread without ever blocking it, (b) coalesces
a burst of thousands of events into one redraw, and (c) bounds the redraw rate so a slow
browser tab cannot back-pressure training. That is this file:

* the bus subscriber only appends to a ``deque`` and sets an ``Event`` (O(1), never blocks
  on the notebook, never raises into the emitter);
* one daemon thread per view wakes on that event, folds everything queued into the view's
  state (``widgets/state.py``, cheap), and redraws at most ``max_hz`` times a second, always
  from the *latest* state, so intermediate states are skipped, not queued;
* ipykernel sends comm messages from any thread through its IOPub thread, so the redraw
  reaches JupyterLab while the main thread is busy in a ``%%colossal`` cell or a torch op.

How a live view reaches the browser, and why not plotly's ``FigureWidget``: each view owns
an ``ipywidgets.Output`` whose ``outputs`` the redraw thread replaces with one
``application/vnd.plotly.v1+json`` bundle (the figure as it is now), which JupyterLab's
plotly mime renderer (the ``jupyterlab-plotly`` extension that ships with plotly) draws.
``.figure`` stays a plain ``go.Figure`` holding the same picture. We used ``FigureWidget``
first and it rendered empty axes in the real-browser test (JupyterLab 4.6, ipywidgets 8.1.9,
anywidget 0.11, plotly 7.1). The cause, read in plotly's ``package_data/widgetbundle.js``:
the anywidget ``FigureModel`` applies every Python-side delta (``_py2js_addTraces``,
``restyle``, ``relayout``, ``update``) to ``this.model.get("_widget_data")``, and that getter
returns a *freshly deserialized copy*, so the model in the browser never records a delta;
only views alive at that moment apply it. A view created later (JupyterLab renders outputs
lazily, a reloaded tab, a second view, a page still loading while the kernel streams
updates) starts from the state at the last *full* ``_widget_data`` assignment, which for a
live dashboard is the empty figure it was displayed with. A bare ``FigureWidget`` with data
in its constructor does render, which is why the bug looked version-specific. The ``Output``
route carries the full state in every update (a few KB to ~100 KB at <= ``max_hz``), so any
view, created at any time, shows the latest picture, and it needs no 5 MB ESM per figure.

Display: inside a Jupyter kernel a view is a live widget whose display bundle also carries
a static plotly figure (``text/html``) and a text summary, so JupyterLab draws the widget and
a client without a widget manager shows the static figure; outside a kernel (a plain
terminal, a script) it is the static figure and the summary. For nbconvert HTML exports run
with ``COLOSSAL_LAB_WIDGETS=static`` (nbconvert prefers the widget view when one is present);
``set_display_mode("widget"|"static"|"auto")`` does the same from code.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Callable, Iterable, List, Optional

import plotly.graph_objects as go

from colossal_lab.engine import telemetry

_MODES = ("auto", "widget", "static")
_mode: Optional[str] = None


def set_display_mode(mode: str) -> None:
    """``"widget"`` (always live widgets), ``"static"`` (plotly HTML + text) or ``"auto"``."""
    if mode not in _MODES:
        raise ValueError(f"set_display_mode(mode={mode!r}): expected one of {_MODES}")
    global _mode
    _mode = mode


def display_mode() -> str:
    mode = _mode or os.environ.get("COLOSSAL_LAB_WIDGETS", "auto")
    if mode not in _MODES:
        raise ValueError(f"COLOSSAL_LAB_WIDGETS={mode!r}: expected one of {_MODES}")
    return mode


def widget_frontend_present() -> bool:
    """True when views should be live widgets: we run inside a Jupyter kernel (auto mode).

    A kernel cannot know for sure whether the client renders widgets (the widget manager's
    control comm only opens if ipywidgets was imported before the front end attached), so a
    live view's display bundle also carries a static ``text/html`` figure and a text summary:
    JupyterLab renders the widget, clients without a widget manager fall back to the HTML.
    """
    mode = display_mode()
    if mode != "auto":
        return mode == "widget"
    try:
        from IPython import get_ipython

        ip = get_ipython()
    except Exception:
        return False
    return ip is not None and getattr(ip, "kernel", None) is not None


PLOTLY_MIME = "application/vnd.plotly.v1+json"


def _jsonable(obj: Any) -> Any:
    """Plain JSON for the mime bundle: numpy arrays become lists (not plotly's base64
    ``bdata``, so the page's ``gd.data`` stays plain arrays that tests and users can read)."""
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    tolist = getattr(obj, "tolist", None)
    if tolist is not None and not isinstance(obj, (str, bytes)):
        return _jsonable(tolist())
    return obj


def plotly_bundle(fig: go.Figure, text: str = "") -> dict:
    """One ``display_data`` output that JupyterLab's plotly mime renderer draws."""
    return {"output_type": "display_data", "metadata": {},
            "data": {PLOTLY_MIME: _jsonable(fig.to_plotly_json()), "text/plain": text}}


def make_output():
    """An ``ipywidgets.Output`` for a live view, or None where ipywidgets is unusable."""
    try:
        import ipywidgets as W

        return W.Output()
    except Exception:  # no ipywidgets: degrade to static
        return None


class Throttle:
    """A daemon thread that calls ``fn()`` after ``poke()``, at most ``max_hz`` times/second
    and spending at most ``max_duty`` of the wall clock in ``fn``."""

    def __init__(self, fn: Callable[[], None], max_hz: float = 8.0, name: str = "redraw",
                 max_duty: float = 0.05):
        if not max_hz > 0:
            raise ValueError(f"max_hz={max_hz!r}: must be > 0 (redraws per second)")
        if not 0 < max_duty <= 1:
            raise ValueError(f"max_duty={max_duty!r}: must be in (0, 1] (fraction of wall time)")
        self._fn, self._period, self._duty = fn, 1.0 / max_hz, max_duty
        self._wake, self._stop = threading.Event(), threading.Event()
        self.calls = 0
        self.errors: List[BaseException] = []
        self._thread = threading.Thread(target=self._loop, name=f"colossal-{name}", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=0.5)
            if self._stop.is_set():
                return
            if not self._wake.is_set():
                continue
            self._wake.clear()
            t0 = time.monotonic()
            try:
                self._fn()
                self.calls += 1
            except BaseException as exc:  # a drawing bug must not kill the live view
                self.errors.append(exc)
                del self.errors[:-10]
            took = time.monotonic() - t0
            # at most max_hz, and at most ``max_duty`` of the wall clock spent drawing: building
            # a plotly figure is GIL-held Python (tens of ms), so a redraw thread that draws
            # flat out would slow the training thread that shares the interpreter
            rest = max(self._period, took / self._duty) - took
            if rest > 0:
                self._stop.wait(rest)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)


class LiveView:
    """Base of every widget: subscribe, queue, fold into state, redraw throttled, display.

    Subclasses set ``self._fig`` (a figure they own), implement ``_fold(events)`` (update state,
    return True when something changed), ``build_figure()`` (a fresh ``go.Figure`` from state)
    and ``summary()`` (text).
    """

    def __init__(self, *, subscribe: bool = True, live: Optional[bool] = None,
                 max_hz: float = 8.0):
        self._lock = threading.RLock()
        self._queue: collections.deque = collections.deque()
        self._live = widget_frontend_present() if live is None else bool(live)
        self._fig = go.Figure()
        self._out = make_output() if self._live else None
        self._unsubscribe: Optional[Callable[[], None]] = None
        self._throttle: Optional[Throttle] = None
        self._closed = False
        self.redraws = 0
        self._init_state()
        self.redraw()
        if subscribe:
            self._throttle = Throttle(self._tick, max_hz=max_hz, name=type(self).__name__)
            self._unsubscribe = telemetry.subscribe(self.feed)

    # ---- subclass hooks -------------------------------------------------------------------
    def _init_state(self) -> None:
        raise NotImplementedError

    def _fold(self, events: List[Any]) -> bool:
        raise NotImplementedError

    def build_figure(self) -> go.Figure:
        raise NotImplementedError

    def summary(self) -> str:
        raise NotImplementedError

    # ---- constructors ---------------------------------------------------------------------
    @classmethod
    def from_trace(cls, path, **kw):
        """A view of a saved JSONL trace (``telemetry.record``), not subscribed to the bus."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{cls.__name__}.from_trace(path={os.fspath(path)!r}): no such file")
        view = cls(subscribe=False, **kw)
        view.update(telemetry.read_trace(path))
        return view

    @classmethod
    def from_events(cls, events: Iterable, **kw):
        view = cls(subscribe=False, **kw)
        view.update(events)
        return view

    # ---- feeding --------------------------------------------------------------------------
    def feed(self, event) -> None:
        """Queue one event (the bus subscriber: O(1), never blocks, never draws)."""
        self._queue.append(event)
        if self._throttle is not None:
            self._throttle.poke()

    def update(self, events: Iterable) -> None:
        """Fold ``events`` in and redraw now (synchronously; for replay and tests)."""
        with self._lock:
            self._drain()
            changed = self._fold(list(events))
        if changed:
            self.redraw()

    def flush(self) -> None:
        """Fold everything queued and redraw now (a live view catches up immediately)."""
        with self._lock:
            self._drain()
        self.redraw()

    def _drain(self) -> bool:
        batch = []
        while True:
            try:
                batch.append(self._queue.popleft())
            except IndexError:
                break
        return self._fold(batch) if batch else False

    def _tick(self) -> None:
        with self._lock:
            changed = self._drain()
        if changed:
            self.redraw()

    def redraw(self) -> None:
        with self._lock:
            new = self.build_figure()
            if self._out is not None:
                # one trait assignment = one comm message with the full picture
                self._out.outputs = (plotly_bundle(new, self.summary()),)
            self._fig = new  # a fresh figure each redraw (copying into the old one cost 2x)
            self.redraws += 1

    # ---- outputs --------------------------------------------------------------------------
    @property
    def figure(self) -> go.Figure:
        """The plotly figure this view draws into (the picture the browser shows)."""
        return self._fig

    def static_figure(self) -> go.Figure:
        with self._lock:
            return self.build_figure()

    def widget(self):
        """The ipywidgets object shown in a notebook (an ``Output`` redrawn live), or None."""
        return self._out

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        if self._live and display_mode() != "static" and self.widget() is not None:
            bundle = self._static_bundle()
            bundle.update(self.widget()._repr_mimebundle_())
            bundle["text/plain"] = self.summary()
            return bundle
        return self._static_bundle()

    def _static_bundle(self) -> dict:
        return {"text/html": self.static_html(), "text/plain": self.summary()}

    def static_html(self) -> str:
        return self.static_figure().to_html(full_html=False, include_plotlyjs="cdn")

    def __repr__(self) -> str:
        return self.summary()

    # ---- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop listening and stop the redraw thread (the last picture stays).

        A live view holds itself alive through its bus subscription on purpose (a widget
        shown with ``display(ChunkMap())`` must keep drawing); ``close()`` releases it.
        """
        if self._closed:
            return
        self._closed = True
        if self._unsubscribe is not None:
            self._unsubscribe()
        if self._throttle is not None:
            self._throttle.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
