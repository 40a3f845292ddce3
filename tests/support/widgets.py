"""What the widget tests share: pipeline spans with known busy times, a figure's trace by name,
the chunk strip read back cell by cell, and a bounded wait for the live views' redraw threads.

Importing this needs no Jupyter-side package (the widgets are imported where a helper reads them)."""

import time

from colossal_lab.engine import telemetry as T

MIB = 1 << 20


def trace_by_name(fig, name):
    (t,) = [t for t in fig.data if t.name == name]
    return t


def chunk_points(fig):
    """{(rank, chunk_id): (tier, colour, shade)} read back from the ChunkMap's strip: each
    heatmap cell's code through the figure's own colour scale, the colour matched against
    every (tier, shade) colour."""
    from colossal_lab.widgets.chunk_map import FILLS, fill_colour

    by_colour = {fill_colour(t, f): (t, f) for t in T.TIERS for f in FILLS}
    (h,) = [t for t in fig.data if t.type == "heatmap"]
    scale = [(float(p), c) for p, c in h.colorscale]
    out = {}
    for r, row in enumerate(h.z):
        for c, k in enumerate(row):
            if k is None:
                continue
            frac = (k - h.zmin) / (h.zmax - h.zmin)
            (colour,) = {a[1] for a, b in zip(scale, scale[1:]) if a[0] <= frac <= b[0]}
            rank, chunk = h.customdata[r][c]
            out[(rank, chunk)] = (by_colour[colour][0], colour, by_colour[colour][1])
    return out


def chunk_hover(fig, key):
    (h,) = [t for t in fig.data if t.type == "heatmap"]
    (text,) = [h.text[r][c] for r, row in enumerate(h.customdata) for c, k in enumerate(row)
               if k is not None and tuple(k) == key]
    return text


def pipeline_spans(step=3, t0=100.0, mb=2):
    """Two stages, GPipe-like, with known busy times: stage 0 busy 0.4 of a 1.0 s window."""
    s = []
    for m in range(mb):
        s.append(T.StageSpan(0, 0, step, m, "F", t0 + 0.1 * m, t0 + 0.1 * m + 0.1))
        s.append(T.StageSpan(0, 0, step, m, "send", t0 + 0.1 * m + 0.1, t0 + 0.1 * m + 0.12))
        s.append(T.StageSpan(1, 1, step, m, "recv", t0 + 0.1 * m + 0.1, t0 + 0.1 * m + 0.12))
        s.append(T.StageSpan(1, 1, step, m, "F", t0 + 0.2 + 0.1 * m, t0 + 0.3 + 0.1 * m))
        s.append(T.StageSpan(1, 1, step, m, "B", t0 + 0.4 + 0.1 * m, t0 + 0.5 + 0.1 * m))
        s.append(T.StageSpan(0, 0, step, m, "B", t0 + 0.7 + 0.1 * m, t0 + 0.8 + 0.1 * m))
    s.append(T.StageSpan(0, 0, step, -1, "optim", t0 + 0.9, t0 + 1.0))
    s.append(T.StageSpan(1, 1, step, -1, "optim", t0 + 0.9, t0 + 1.0))
    return s


def wait_for(cond, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline and not cond():
        time.sleep(0.02)
    return cond()
