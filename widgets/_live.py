"""The live machinery every widget shares: queue, throttled redraw thread, display fallback.

Why hand-written: ipywidgets and plotly give the picture and the comm to the browser, but
nothing that (a) takes events from a training thread without ever blocking it, (b) coalesces
a burst of thousands of events into one redraw, and (c) bounds the redraw rate so a slow
browser tab cannot back-pressure training. That is this file:

* the bus subscriber is a ``deque``'s own ``append`` (a C call: O(1), no Python frame, no
  lock, no thread wake-up, never blocks on the notebook, never raises into the emitter), so
  the training thread pays one append per event and nothing else;
* one daemon thread (``Redrawer``) per subscription, shared by all four views of a
  ``Dashboard``, wakes ``max_hz`` times a second; when something was queued it hands each
  view the events of the types it draws, folds them into that view's state
  (``widgets/state.py``, cheap), and redraws the views whose state changed, always from the
  *latest* state, so intermediate states are skipped, not queued; an idle wake is one
  ``len()`` check;
* ipykernel sends comm messages from any thread through its IOPub thread, so the redraw
  reaches JupyterLab while the main thread is busy in a ``%%colossal`` cell or a torch op.

How a live view reaches the browser: each view owns one ``PlotlyView`` (an ``anywidget``,
``widgets/_frontend.py``) whose ``figure`` trait the redraw thread replaces with the figure as
it is now; in the browser one plotly.js plot per view is updated in place with
``Plotly.react`` (plotly.js taken from the ``jupyterlab-plotly`` extension the plotly package
installs). ``.figure`` stays a plain ``go.Figure`` holding the same picture. Why not the two
obvious routes:

* plotly's ``FigureWidget`` shows empty axes in a live view. Read in plotly's
  ``package_data/widgetbundle.js``: the anywidget ``FigureModel`` applies every Python-side
  delta (``_py2js_addTraces``, ``restyle``, ``relayout``, ``update``) to
  ``this.model.get("_widget_data")``, and that getter returns a *freshly deserialized copy*,
  so the model in the browser never records a delta; only views alive at that moment apply
  it. A view created later (JupyterLab renders outputs lazily, a reloaded tab, a page still
  loading while the kernel streams updates) starts from the last *full* ``_widget_data``
  assignment, which for a live dashboard is the empty figure it was displayed with;
* an ``ipywidgets.Output`` holding a plotly mime bundle draws correctly but each update makes
  JupyterLab build a new renderer that plots from scratch and then rasterizes the plot to a
  PNG (``Plotly.toImage``): a live ``Dashboard`` makes the browser do that for every redraw
  of every view (see ``_frontend.py``).

Our ``figure`` trait carries the full picture in every update (at most ``max_hz`` times a
second), so any view, created at any time, shows the latest picture.

Why the redraw path builds plain dicts, not ``go.Figure``: plotly's ``graph_objects`` validate
every property on construction (GIL-held Python), and the redraw thread shares the
interpreter with training, so that cost would come straight out of tokens/s. Each
view's ``build_dict()`` writes the ``{"data": [...], "layout": {...}}`` plotly.js reads,
directly from the reduced state (plain lists, the default template's JSON shared by
reference), and that dict *is* what the browser receives. ``.figure`` (a real ``go.Figure``, validated)
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
from colossal_lab.engine.telemetry.bus import background_priority

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


def _jsonable(obj: Any) -> Any:
    """Plain JSON: numpy arrays become lists (not plotly's base64 ``bdata``, so the page's
    ``gd.data`` stays plain arrays that tests and users can read)."""
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    tolist = getattr(obj, "tolist", None)
    if tolist is not None and not isinstance(obj, (str, bytes)):
        return _jsonable(tolist())
    return obj


_template: Optional[dict] = None

# what our figures draw: the template's defaults for other trace types (choropleth, surface,
# ...) and other subplot kinds (3-D scenes, maps, polar, ternary) and colour scales change
# nothing in our pictures, and would be most of every message's JSON
TEMPLATE_TRACE_TYPES = ("scatter", "bar", "indicator")
_UNUSED_LAYOUT_KEYS = ("scene", "geo", "polar", "ternary", "mapbox", "map", "colorscale",
                       "coloraxis")


def template_json() -> dict:
    """plotly's default template as JSON, resolved once and shared by every figure dict (what
    ``go.Figure`` would embed; without it plotly.js would draw with its bare defaults), keeping
    only what our figures use (``TEMPLATE_TRACE_TYPES``; no 3-D/map/polar/ternary subplots, no
    colour scales): the look is the same, and every redraw message is smaller."""
    global _template
    if _template is None:
        import plotly.io as pio

        name = pio.templates.default
        full = _jsonable(pio.templates[name].to_plotly_json()) if name else {}
        data = {k: v for k, v in full.get("data", {}).items() if k in TEMPLATE_TRACE_TYPES}
        layout = {k: v for k, v in full.get("layout", {}).items() if k not in _UNUSED_LAYOUT_KEYS}
        _template = {k: v for k, v in (("data", data), ("layout", layout)) if v}
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
    """The browser-side widget of a live view (``_frontend.PlotlyView``), or None where
    ipywidgets/anywidget are unusable (the view then degrades to static output)."""
    from ._frontend import make_view

    return make_view()


class Redrawer:
    """One daemon thread that keeps one or more views current (a ``Dashboard``'s four views
    share one): every ``1/max_hz`` s it takes everything queued, hands each view the events of
    the types it draws (``LiveView.accepts``), folds them into that view's state and redraws the
    views whose state changed, spending at most ``max_duty`` of the wall clock doing so.

    The bus subscriber is ``queue.append`` itself (a C call: no Python frame, no lock and no
    thread wake-up on the emitting thread), so everything the live path costs happens here,
    at most ``max_hz`` times a second, on one thread. It polls instead of being woken: a
    wake-up per event (``threading.Event.set``) is Python run on the training thread for
    every event and view, and a thread per view would multiply the GIL hand-offs.
    ``maxlen`` bounds the queue (the oldest events are dropped past it: only if this thread
    stalls for a very long time). The thread runs at ``nice`` below the process's priority
    (``telemetry.bus.background_priority``): drawing takes the CPU training leaves idle.
    """

    def __init__(self, views: Iterable["LiveView"] = (), max_hz: float = 5.0,
                 name: str = "redraw", max_duty: float = 0.05, maxlen: int = 1_000_000,
                 nice: Optional[int] = None):
        if not (isinstance(max_hz, (int, float)) and max_hz > 0):
            raise ValueError(f"max_hz={max_hz!r}: must be > 0 (redraws per second)")
        if not (isinstance(max_duty, (int, float)) and 0 < max_duty <= 1):
            raise ValueError(f"max_duty={max_duty!r}: must be in (0, 1] (fraction of wall time)")
        if not (isinstance(maxlen, int) and maxlen > 0):
            raise ValueError(f"maxlen={maxlen!r}: must be a positive int (events queued)")
        self.queue: collections.deque = collections.deque(maxlen=maxlen)
        self.yield_gil = True  # ``time.sleep(0)`` between a tick's pieces (see ``tick``)
        self._nice = nice      # the thread's priority step back (None: BACKGROUND_NICE, 0: none)
        self.niced = False
        self._views: tuple = tuple(views)  # copy-on-write: the thread reads it without a lock
        self._period, self._duty = 1.0 / max_hz, float(max_duty)
        self._tick_lock = threading.Lock()  # one tick at a time (this thread vs ``flush()``)
        self._stop = threading.Event()
        self.wakes = 0     # times the thread woke up
        self.calls = 0     # ticks that had events to fold (at most max_hz per second)
        self.events = 0    # events taken from the queue
        self.busy_s = 0.0  # wall seconds spent in ticks
        self.cpu_s = 0.0   # this thread's CPU seconds spent in ticks (``time.thread_time``)
        self.errors: List[BaseException] = []
        self._thread = threading.Thread(target=self._loop, name=f"colossal-{name}", daemon=True)
        self._thread.start()

    @property
    def views(self) -> tuple:
        return self._views

    def add(self, view: "LiveView") -> None:
        self._views = self._views + (view,)

    def remove(self, view: "LiveView") -> None:
        self._views = tuple(v for v in self._views if v is not view)

    def pending(self) -> bool:
        return bool(self.queue) or any(v._queue for v in self._views)

    def tick(self) -> int:
        """Fold everything queued into the views, redraw the ones that changed; returns how
        many bus events were taken. Runs on the thread; ``flush()`` calls it to catch up now."""
        with self._tick_lock:
            q = self.queue
            batch = [q.popleft() for _ in range(len(q))]
            by_type: dict = {}
            for e in batch:
                lst = by_type.get(type(e))
                if lst is None:
                    lst = by_type[type(e)] = []
                lst.append(e)
            for view in self._views:
                mine = [e for t, es in by_type.items() if issubclass(t, view.accepts) for e in es]
                try:
                    if view._take(mine):
                        if self.yield_gil:
                            time.sleep(0)
                        view.redraw()
                except BaseException as exc:  # a drawing bug must not stop the other views
                    self.errors.append(exc)
                    del self.errors[:-10]
                if self.yield_gil:
                    # hand the GIL back between pieces of work: a training thread that comes
                    # back from a torch op waits for it at most one piece, not a whole tick
                    # (CPython lets a holder run up to ``sys.getswitchinterval()``, 5 ms)
                    time.sleep(0)
            self.events += len(batch)
            return len(batch)

    def _loop(self) -> None:
        # drawing takes the CPU training leaves (see telemetry.bus.background_priority)
        self.niced = background_priority(self._nice)
        rest = self._period
        while not self._stop.wait(rest):
            self.wakes += 1
            rest = self._period
            if not self.pending():
                continue  # nothing arrived: no GIL-held work beyond this check
            t0, c0 = time.monotonic(), time.thread_time()
            try:
                self.tick()
                self.calls += 1
            except BaseException as exc:
                self.errors.append(exc)
                del self.errors[:-10]
            took = time.monotonic() - t0
            self.busy_s += took
            self.cpu_s += time.thread_time() - c0
            # at most max_hz, and at most ``max_duty`` of the wall clock drawing: this is
            # GIL-held Python, and the training thread shares the interpreter
            rest = max(self._period, took / self._duty) - took

    def close(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)


class LiveView:
    """Base of every widget: subscribe, queue, fold into state, redraw throttled, display.

    Subclasses set ``accepts`` (the event types they draw) and implement ``_fold(events)``
    (update state, return True when something changed), ``build_dict()`` (the plotly figure as
    a plain JSON dict, from state; no ``graph_objects`` on this path) and ``summary()`` (text).
    A subscribed view gets a ``Redrawer`` of its own; ``_served_views()`` names the views that
    one thread keeps current (a ``Dashboard`` returns its four).
    """

    accepts: tuple = ()

    def __init__(self, *, subscribe: bool = True, live: Optional[bool] = None,
                 max_hz: float = 5.0):
        self._lock = threading.RLock()
        self._queue: collections.deque = collections.deque()  # ``feed()``: this view only
        self._live = widget_frontend_present() if live is None else bool(live)
        self._dict: dict = {"data": [], "layout": {}}
        self._fig: Optional[go.Figure] = None  # built from ``_dict`` on first read
        self._out = make_output() if self._live else None
        self._unsubscribe: Optional[Callable[[], None]] = None
        self._throttle: Optional[Redrawer] = None  # the thread that keeps this view current
        self._owns_throttle = False
        self._closed = False
        self.redraws = 0
        self.skipped = 0  # redraws whose picture equalled the last one (nothing sent)
        self._init_state()
        self.redraw()
        if subscribe:
            views = self._served_views()
            self._throttle = Redrawer(views, max_hz=max_hz, name=type(self).__name__)
            self._owns_throttle = True
            for v in views:
                if v is not self:
                    v._throttle = self._throttle
            append = self._throttle.queue.append  # one bound method: the same object unsubscribes
            self._unsubscribe = telemetry.subscribe(append)

    def _served_views(self) -> List["LiveView"]:
        return [self]

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
        """Queue one event for this view (O(1), never draws; the redraw thread or the next
        ``flush()``/``update()`` folds it in)."""
        self._queue.append(event)

    def update(self, events: Iterable) -> None:
        """Fold ``events`` in and redraw now (synchronously; for replay and tests)."""
        with self._lock:
            changed = self._take(list(events))
        if changed:
            self.redraw()

    def flush(self) -> None:
        """Fold everything queued and redraw now (a live view catches up immediately)."""
        if self._throttle is not None:
            self._throttle.tick()  # the bus queue, into every view this thread serves
        with self._lock:
            self._take([])
        self.redraw()

    def _take(self, events: List[Any]) -> bool:
        """Fold what ``feed()`` queued plus ``events`` (already of ``accepts`` types) into the
        state; True when something changed."""
        with self._lock:
            q = self._queue
            if q:
                events = [q.popleft() for _ in range(len(q))] + list(events)
            return self._fold(events) if events else False

    def redraw(self) -> None:
        with self._lock:
            new = self.build_dict()
            if self.redraws and new == self._dict:
                self.skipped += 1  # same picture: send nothing
                return
            if self._out is not None:
                # one trait assignment = one comm message with the full picture
                self._out.figure = new
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
        """The ipywidgets object shown in a notebook (a ``PlotlyView`` redrawn live), or None."""
        return self._out

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        if self._live and display_mode() != "static" and self.widget() is not None:
            bundle = self._static_bundle()
            view = self.widget()._repr_mimebundle_()
            bundle.update(view[0] if isinstance(view, tuple) else view)  # anywidget: (data, md)
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
            if self._owns_throttle:
                self._throttle.close()
            else:
                self._throttle.remove(self)  # a view of a Dashboard: the others keep drawing

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
