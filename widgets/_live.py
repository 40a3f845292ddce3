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

Why the redraw path builds plain dicts, not ``go.Figure``: plotly's ``graph_objects`` validate
every property on construction (10-50 ms of GIL-held Python per figure), and the redraw
threads share the interpreter with training, so that cost came straight out of tokens/s. Each
view's ``build_dict()`` writes the ``{"data": [...], "layout": {...}}`` plotly.js reads,
directly from the reduced state (plain lists, the default template's JSON shared by
reference), and that dict *is* the mime bundle. ``.figure`` (a real ``go.Figure``, validated)
is built from the same dict only when someone reads it, so tests and static exports see
exactly what the browser got. A redraw whose dict equals the last one sends nothing.

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


def plotly_bundle(fig: Any, text: str = "") -> dict:
    """One ``display_data`` output that JupyterLab's plotly mime renderer draws.

    ``fig`` is a figure dict from a view's ``build_dict()`` (already plain JSON: sent as is)
    or a ``go.Figure`` (converted)."""
    if isinstance(fig, go.Figure):
        fig = _jsonable(fig.to_plotly_json())
    return {"output_type": "display_data", "metadata": {},
            "data": {PLOTLY_MIME: fig, "text/plain": text}}


_template: Optional[dict] = None


def template_json() -> dict:
    """plotly's default template as JSON, resolved once and shared by every figure dict (what
    ``go.Figure`` would embed; without it plotly.js would draw with its bare defaults)."""
    global _template
    if _template is None:
        import plotly.io as pio

        name = pio.templates.default
        _template = _jsonable(pio.templates[name].to_plotly_json()) if name else {}
    return _template


def columns_layout(widths: List[float], spacing: float, titles: Iterable[str]) -> dict:
    """The axes and title annotations ``make_subplots(rows=1, cols=len(widths),
    column_widths=widths, horizontal_spacing=spacing, subplot_titles=titles)`` would write, as
    plain layout keys (``xaxis``, ``yaxis``, ``xaxis2``, ... and ``annotations``)."""
    n, total = len(widths), float(sum(widths))
    free = 1.0 - spacing * (n - 1)
    out: dict = {"annotations": []}
    x0 = 0.0
    for i, (w, title) in enumerate(zip(widths, titles)):
        sfx = "" if i == 0 else str(i + 1)
        x1 = x0 + free * w / total
        out["xaxis" + sfx] = {"anchor": "y" + sfx, "domain": [x0, x1]}
        out["yaxis" + sfx] = {"anchor": "x" + sfx, "domain": [0.0, 1.0]}
        out["annotations"].append({"font": {"size": 16}, "showarrow": False, "text": title,
                                   "x": (x0 + x1) / 2, "xanchor": "center", "xref": "paper",
                                   "y": 1.0, "yanchor": "bottom", "yref": "paper"})
        x0 = x1 + spacing
    return out


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

    def __init__(self, fn: Callable[[], None], max_hz: float = 5.0, name: str = "redraw",
                 max_duty: float = 0.05):
        if not max_hz > 0:
            raise ValueError(f"max_hz={max_hz!r}: must be > 0 (redraws per second)")
        if not 0 < max_duty <= 1:
            raise ValueError(f"max_duty={max_duty!r}: must be in (0, 1] (fraction of wall time)")
        self._fn, self._period, self._duty = fn, 1.0 / max_hz, max_duty
        self._wake, self._stop = threading.Event(), threading.Event()
        self.calls = 0
        self.busy_s = 0.0  # wall seconds spent in ``fn`` (what the redraws cost the process)
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
            self.busy_s += took
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

    Subclasses implement ``_fold(events)`` (update state, return True when something
    changed), ``build_dict()`` (the plotly figure as a plain JSON dict, from state; no
    ``graph_objects`` on this path) and ``summary()`` (text).
    """

    def __init__(self, *, subscribe: bool = True, live: Optional[bool] = None,
                 max_hz: float = 5.0):
        self._lock = threading.RLock()
        self._queue: collections.deque = collections.deque()
        self._live = widget_frontend_present() if live is None else bool(live)
        self._dict: dict = {"data": [], "layout": {}}
        self._fig: Optional[go.Figure] = None  # built from ``_dict`` on first read
        self._out = make_output() if self._live else None
        self._unsubscribe: Optional[Callable[[], None]] = None
        self._throttle: Optional[Throttle] = None
        self._closed = False
        self.redraws = 0
        self.skipped = 0  # redraws whose picture equalled the last one (nothing sent)
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

    def build_dict(self) -> dict:
        raise NotImplementedError

    def build_figure(self) -> go.Figure:
        """A validated ``go.Figure`` of the current state (for static exports; not live)."""
        with self._lock:
            return go.Figure(self.build_dict())

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
            new = self.build_dict()
            if self.redraws and new == self._dict:
                self.skipped += 1  # same picture: send nothing
                return
            if self._out is not None:
                # one trait assignment = one comm message with the full picture
                self._out.outputs = (plotly_bundle(new, self.summary()),)
            self._dict, self._fig = new, None  # ``.figure`` is rebuilt from the dict on demand
            self.redraws += 1

    # ---- outputs --------------------------------------------------------------------------
    @property
    def figure(self) -> go.Figure:
        """The latest picture as a plotly ``go.Figure`` (the dict the browser got, validated;
        built on first read after a redraw, so the live path never pays for it)."""
        with self._lock:
            if self._fig is None:
                self._fig = go.Figure(self._dict)
            return self._fig

    def figure_dict(self) -> dict:
        """The latest picture as the plain dict sent to the browser (do not mutate)."""
        return self._dict

    def static_figure(self) -> go.Figure:
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
