"""The browser side of a live view: one ``anywidget`` per figure that keeps one plotly.js plot
alive and updates it in place with ``Plotly.react``.

Why not the plotly mime bundle in an ``ipywidgets.Output``: every ``outputs`` assignment makes
JupyterLab clear the output area and build a new ``jupyterlab-plotly`` renderer, which draws the
figure from scratch into a new DOM node and then (``RenderedPlotly.createGraph``) rasterizes it
with ``Plotly.toImage`` to cache a PNG in the notebook model, so every redraw of every view
costs the page a full render and a PNG encoding, enough to stall a browser under a live
``Dashboard``. Here the plot is created once and ``Plotly.react`` diffs each new
``{data, layout}`` against the drawn one; updates that arrive while a draw is in progress
collapse to the newest (the browser never queues stale pictures), so a slow or hidden tab
costs the kernel nothing either.

Why not plotly's ``FigureWidget``: see ``_live.py`` (its model drops deltas, so views created
later show the figure it was displayed with). Here the model's state is the whole latest figure
(``figure`` trait), so a view created at any time (a re-opened tab, a second view, a page still
loading) draws the current picture.

Where plotly.js comes from: JupyterLab (and Notebook 7) already carry it in the
``jupyterlab-plotly`` extension that ships with the plotly package; its module federation
container (``window._JUPYTERLAB["jupyterlab-plotly"]``) exports ``RenderedPlotly``, whose first
render loads plotly.js and sets ``window.Plotly``. We let it render one empty figure into a
detached node to trigger that load (no PNG: a detached node has no size) and use
``window.Plotly``, so the plotly.js bundle never travels with a widget. Front ends without that
extension (VS Code, Colab) get plotly.js from the CDN (the version the Python plotly package
embeds).

Kernel side: ``figure`` updates skip ipywidgets' recursive binary-buffer search (a plotly dict
holds no binary values, and the walk is GIL-held Python paid on every redraw) and send
ipywidgets' own ``update`` message directly (``send_state``).
"""

from __future__ import annotations

from typing import Any

ESM = r"""
const MIME = "application/vnd.plotly.v1+json";
let plotlyPromise = null;

async function fromJupyterLab() {
  const lab = globalThis._JUPYTERLAB && globalThis._JUPYTERLAB["jupyterlab-plotly"];
  if (!lab) return null;
  const mod = (await lab.get("./mimeExtension"))();
  const R = mod.RenderedPlotly;
  if (!R) return null;
  if (!R.Plotly) {
    // its first render loads plotly.js (and sets window.Plotly); a detached node has no size,
    // so it skips the PNG snapshot it takes of visible plots
    const r = new R({mimeType: mod.MIME_TYPE || MIME});
    r.renderModel({data: {[mod.MIME_TYPE || MIME]: {data: [], layout: {}}}, setData() {}});
    await R.loadingPlotly;
    setTimeout(() => { try { r.dispose(); } catch (e) {} }, 0);
  }
  return R.Plotly || globalThis.Plotly || null;
}

function fromCdn(version) {
  return new Promise((resolve, reject) => {
    const s = document.createElement("script");
    s.src = `https://cdn.plot.ly/plotly-${version}.min.js`;
    s.onload = () => resolve(globalThis.Plotly);
    s.onerror = () => reject(new Error(`could not load plotly.js ${version} from ${s.src}`));
    document.head.appendChild(s);
  });
}

function loadPlotly(version) {
  if (!plotlyPromise) {
    plotlyPromise = (async () => {
      if (globalThis.Plotly) return globalThis.Plotly;
      let P = null;
      try { P = await fromJupyterLab(); } catch (e) { console.warn("colossal-lab: jupyterlab-plotly", e); }
      return P || await fromCdn(version);
    })();
  }
  return plotlyPromise;
}

function render({model, el}) {
  const div = document.createElement("div");
  div.className = "colossal-lab-plot";
  div.style.width = "100%";
  el.appendChild(div);
  let Plotly = null, drawing = false, again = false, alive = true;
  async function draw() {
    if (!Plotly || !alive) return;
    if (drawing) { again = true; return; }  // collapse to the newest picture
    drawing = true;
    try {
      do {
        again = false;
        const fig = model.get("figure") || {};
        await Plotly.react(div, fig.data || [], fig.layout || {}, {responsive: true, displaylogo: false});
        globalThis.__colossalFrames = (globalThis.__colossalFrames || 0) + 1;  // tests read it
      } while (again && alive);
    } catch (e) {
      div.textContent = "colossal-lab: could not draw this figure: " + e;
    } finally {
      drawing = false;
    }
  }
  model.on("change:figure", draw);
  loadPlotly(model.get("plotly_version")).then((P) => { Plotly = P; draw(); }, (e) => {
    div.textContent = "colossal-lab: " + e;
  });
  return () => {
    alive = false;
    model.off("change:figure", draw);
    if (Plotly) Plotly.purge(div);
  };
}

export default { render };
"""

_PlotlyView: Any = None


def plotly_view_class():
    """The ``anywidget.AnyWidget`` subclass every live view draws into (built on first use, so
    importing ``colossal_lab.widgets`` does not import anywidget)."""
    global _PlotlyView
    if _PlotlyView is None:
        import anywidget
        import plotly.offline
        import traitlets

        class PlotlyView(anywidget.AnyWidget):
            """One plotly figure, redrawn in place in the browser when ``figure`` changes."""

            _esm = ESM
            figure = traitlets.Dict().tag(sync=True)
            plotly_version = traitlets.Unicode(plotly.offline.get_plotlyjs_version()).tag(sync=True)

            def send_state(self, key=None):
                send = getattr(self, "_send", None)
                if key != "figure" or send is None:
                    return super().send_state(key)
                state = {"figure": self.figure}
                lock = getattr(self, "_property_lock", None)
                if lock and "figure" in lock:  # keep ipywidgets' echo guard current
                    lock["figure"] = state["figure"]
                send({"method": "update", "state": state, "buffer_paths": []}, buffers=[])

        _PlotlyView = PlotlyView
    return _PlotlyView


def make_view():
    """A ``PlotlyView`` for a live view, or None where ipywidgets/anywidget are unusable."""
    try:
        return plotly_view_class()()
    except Exception:  # no ipywidgets or anywidget: degrade to static
        return None
