"""ExpertLoadView: known ``ExpertLoad`` events -> the heatmap's z (summed over ranks), axes, dropped
bars and per-rank breakdown; a JSONL trace of a real MoE GPT's step round-trips into the same
picture; the ``Dashboard`` shows the view once an ``ExpertLoad`` arrives and not before."""

import pytest

pytest.importorskip("plotly")

import torch  # noqa: E402
from support.widgets import wait_for  # noqa: E402

from colossal_lab.engine import telemetry as T  # noqa: E402
from colossal_lab.engine.models import GPT, GPTConfig  # noqa: E402
from colossal_lab.engine.moe import emit_load  # noqa: E402
from colossal_lab.widgets import Dashboard, ExpertLoadView  # noqa: E402
from colossal_lab.widgets.expert_load import expert_load_dict, imbalance  # noqa: E402
from colossal_lab.widgets.state import ExpertLoadState  # noqa: E402

L = T.ExpertLoad


def _events():
    """Two layers (named so that string order would put blocks.10 first), 4 experts, 2 ranks,
    steps 1 and 2; rank 1 has not reported blocks.10's step 2 yet."""
    return [L(0, 1, "blocks.2.mlp", (5, 0, 3, 0), 1), L(1, 1, "blocks.2.mlp", (1, 2, 0, 0), 0),
            L(0, 2, "blocks.2.mlp", (4, 4, 0, 0), 0), L(1, 2, "blocks.2.mlp", (0, 0, 6, 2), 3),
            L(0, 1, "blocks.10.mlp", (8, 0, 0, 0), 2), L(1, 1, "blocks.10.mlp", (0, 8, 0, 0), 0),
            L(0, 2, "blocks.10.mlp", (2, 2, 2, 2), 0)]


def _heat(fig, layer):
    (h,) = [t for t in fig.data if t.type == "heatmap" and t.name == layer]
    return h


def _bar(fig, layer):
    (b,) = [t for t in fig.data if t.type == "bar" and t.name == f"dropped · {layer}"]
    return b


def test_heatmap_sums_ranks_per_expert_and_step():
    ev = _events()
    v = ExpertLoadView.from_events(ev + ev[:3], live=False)  # a replay changes nothing
    assert v.layers == ["blocks.2.mlp", "blocks.10.mlp"]
    fig = v.figure
    h, b = _heat(fig, "blocks.2.mlp"), _bar(fig, "blocks.2.mlp")
    assert list(h.x) == [1, 2] and list(h.y) == [0, 1, 2, 3]
    assert [list(r) for r in h.z] == [[6, 4], [2, 4], [3, 6], [0, 2]]  # z[expert][step]
    assert list(b.x) == [1, 2] and list(b.y) == [1, 3] and list(b.customdata) == [2, 2]
    h10, b10 = _heat(fig, "blocks.10.mlp"), _bar(fig, "blocks.10.mlp")
    assert [list(r) for r in h10.z] == [[8, 2], [8, 2], [0, 2], [0, 2]]
    assert list(b10.y) == [2, 0] and list(b10.customdata) == [2, 1]  # step 2: one rank so far
    # per-cell share of the step's tokens and the per-rank breakdown in the hover
    assert h.customdata[2][1] == pytest.approx(6 / 16)
    assert h.text[0][0] == "rank 0: 5<br>rank 1: 1"
    assert v.per_rank("blocks.2.mlp") == {0: (4, 4, 0, 0), 1: (0, 0, 6, 2)}
    assert v.per_rank("blocks.2.mlp", 1) == {0: (5, 0, 3, 0), 1: (1, 2, 0, 0)}
    # one colour scale for all layers, from 0 to the hottest cell anywhere
    assert h.coloraxis == h10.coloraxis == "coloraxis"
    assert (fig.layout.coloraxis.cmin, fig.layout.coloraxis.cmax) == (0, 8)
    # panels top to bottom in model order, the dropped bars under their heatmap, x axes linked
    lay = fig.layout
    y2, y10 = lay[h.yaxis.replace("y", "yaxis")], lay[h10.yaxis.replace("y", "yaxis")]
    yb = lay[b.yaxis.replace("y", "yaxis")]
    assert y2.domain[0] > yb.domain[1] > yb.domain[0] > y10.domain[1]
    assert lay[b.xaxis.replace("x", "xaxis")].matches == h.xaxis
    titles = [a.text for a in lay.annotations]
    # blocks.2 at step 2: 16 routed over 4 experts, busiest 6 -> 1.5; 3 dropped of 19
    assert titles[0] == "blocks.2.mlp · 4 experts · step 2: max/mean 1.50 · dropped 3 (15.8%)"
    assert titles[1].startswith("blocks.10.mlp · 4 experts · step 2: max/mean 1.00 · dropped 0")
    assert "2 MoE layer(s) · steps 1–2 · 2 rank(s)" in lay.title.text
    assert v.summary() == ("ExpertLoadView: blocks.2.mlp step 2: max/mean 1.50, dropped 3; "
                           "blocks.10.mlp step 2: max/mean 1.00, dropped 0")


def test_later_event_replaces_old_steps_fall_off_and_empty_picture():
    assert imbalance([0, 0]) == 0.0 and imbalance([3, 1]) == 1.5
    st = ExpertLoadState(keep_steps=3)
    for s in range(5):
        assert st.apply(L(0, s, "m", (s, 1)))
    assert st.steps == [2, 3, 4] and st.grid("m").z == [[2, 3, 4], [1, 1, 1]]
    assert not st.apply(L(0, 0, "m", (9, 9)))  # older than all kept: ignored
    assert st.apply(L(0, 4, "m", (7, 0), 5))  # the same key again, other counts: the later wins
    assert st.grid("m").z == [[2, 3, 7], [1, 1, 0]] and st.grid("m").dropped == [0, 0, 5]
    assert len(st.loads) == 3
    assert st.totals("m", 4) == ((7, 0), 5) and st.totals("m", 9) is None and st.totals("x", 4) is None
    st.apply(L(0, 5, "m", (1, 1)))
    st.totals("m", 5)
    assert st.totals("m", 2) is None and {k[1] for k in st._totals} <= {3, 4, 5}  # the cache trims too
    with pytest.raises(KeyError, match="layers seen: \\['m'\\]"):
        st.grid("other")
    with pytest.raises(ValueError, match="keep_steps=0"):
        ExpertLoadState(keep_steps=0)
    # a large job's hover lists the busiest ranks and counts the rest
    many = ExpertLoadView.from_events([L(r, 0, "m", (r, 1)) for r in range(12)], live=False)
    assert _heat(many.figure, "m").text[0][0] == "<br>".join(f"rank {r}: {r}" for r in range(11, 3, -1)) \
        + "<br>… +4 ranks"
    # past HOVER_CELLS cells the hover carries the tokens only (a redraw's message stays small)
    big = ExpertLoadView.from_events([L(0, s, "m", (1,) * 160) for s in range(300)], live=False)
    h = _heat(big.figure, "m")
    assert len(h.z) == 160 and len(h.x) == 128 and h.text is None and h.customdata is None  # 128 steps kept
    v = ExpertLoadView.from_events([], live=False)
    assert "waiting for ExpertLoad" in v.figure.layout.title.text and v.figure.data == ()


def test_trace_of_a_real_moe_step_round_trips(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_expert=4, top_k=2, capacity_factor=0.5))
    x = torch.randint(0, 256, (2, 9))
    path = tmp_path / "moe.jsonl"
    with T.record(path):
        for step in range(3):
            model(x[:, :-1], x[:, 1:])[1].backward()
            emit_load(model, rank=0, step=step)
    got = [e for e in T.read_trace(path) if isinstance(e, L)]
    assert len(got) == 3 * 2
    v = ExpertLoadView.from_trace(path, live=False)
    assert v.layers == ["blocks.0.mlp", "blocks.1.mlp"]
    for layer in v.layers:
        mine = sorted((e for e in got if e.layer == layer), key=lambda e: e.step)
        h, b = _heat(v.figure, layer), _bar(v.figure, layer)
        assert list(h.x) == [0, 1, 2]
        assert [list(r) for r in h.z] == [list(c) for c in zip(*(e.tokens for e in mine))]
        assert list(b.y) == [e.dropped for e in mine] and all(d > 0 for d in b.y)  # capacity 0.5 drops
        # every assignment is either routed to an expert or dropped: 2 x 8 tokens x top 2
        assert all(sum(col) + d == 2 * 8 * 2 for col, d in zip(zip(*h.z), b.y))


def test_dashboard_shows_the_view_only_once_an_expert_load_arrives():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    d = Dashboard(live=True, subscribe=False)
    try:
        n = len(d.widget().children)
        d.update([T.StepMetrics(0, 1, 2.0, 64, 0.1), T.MemorySample(0, 1.0, "cpu", 1, 1 << 30)])
        assert "expert_load" not in d.views and "ExpertLoad" not in d.summary()
        assert len(d.widget().children) == n and d.expert_load.redraws == 1  # its first, empty picture only
        for e in _events():
            d.feed(e)
        d.flush()
        assert d.views["expert_load"] is d.expert_load and "expert_load" in d.figures
        assert len(d.widget().children) == n + 1 and d.widget().children[-1] is d.expert_load.widget()
        assert [list(r) for r in _heat(d.figures["expert_load"], "blocks.2.mlp").z][0] == [6, 4]
        assert "ExpertLoadView: blocks.2.mlp step 2" in d.summary()
        assert "ExpertLoadView" in d.static_html()
    finally:
        d.close()


def test_live_dashboard_draws_emitted_loads_throttled():
    """A subscribed dashboard gets a real model's emitted loads through the bus and its one
    redraw thread; a burst of steps is drawn in a few redraws, not one per event."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_expert=4, top_k=2))
    x = torch.randint(0, 256, (2, 9))
    d = Dashboard(live=False, max_hz=5)
    try:
        for step in range(6):
            model(x[:, :-1], x[:, 1:])[1].backward()
            emit_load(model, rank=0, step=step)
        assert wait_for(lambda: "expert_load" in d.views and d.expert_load.experts.steps == list(range(6)))
        assert not d._throttle.errors
        assert d.expert_load.redraws < 1 + 12  # 12 events (6 steps x 2 layers), coalesced into ticks
        g = d.expert_load.load("blocks.1.mlp")
        assert g.steps == list(range(6)) and all(sum(col) == 2 * 8 * 2 for col in zip(*g.z))
    finally:
        d.close()


def _many(n_layers=40):
    """``n_layers`` layers, 4 experts, 2 ranks, steps 0-2; layer i at step s sums to
    ``(k + 2, 2, 2, 2)`` with ``k = (7i + 3s) % 13``, so its imbalance is ``4 (k + 2) / (k + 8)``;
    the last layer has not reported step 2 and is at its busiest (k = 12) at step 1."""
    ev, want = [], {}
    last = n_layers - 1
    for i in range(n_layers):
        for s in range(3 if i != last else 2):
            k = 12 if (i, s) == (last, 1) else (7 * i + 3 * s) % 13
            ev += [L(0, s, f"blocks.{i}.mlp", (k, 1, 1, 1), i + s), L(1, s, f"blocks.{i}.mlp", (2, 1, 1, 1), 0)]
            want[i, s] = 4 * (k + 2) / (k + 8)
    return ev, want


def _detail(fig):
    return [t.name for t in fig.data if t.type == "heatmap" and t.name != "imbalance"]


def test_many_layers_summary_busiest_panels_and_select():
    ev, want = _many()
    v = ExpertLoadView.from_events(ev, live=False)
    names = [f"blocks.{i}.mlp" for i in range(40)]
    assert v.max_panels == 8 and v.layers == names
    fig = v.figure
    (s,) = [t for t in fig.data if t.name == "imbalance"]
    assert fig.data[0] is s and list(s.x) == [0, 1, 2] and list(s.y) == names
    assert [list(r) for r in s.z] == [[want.get((i, st)) for st in range(3)] for i in range(40)]
    assert [list(r) for r in s.customdata] == [[i + st if st < 2 or i < 39 else None for st in range(3)]
                                               for i in range(40)]
    # the busiest at each layer's newest step: k = 12 at layers 12, 25, 38 (step 2) and 39 (its step 1),
    # k = 11 at 10, 23, 36, then k = 10 at 8 (before 21 and 34: model order breaks the tie); model order
    busiest = [8, 10, 12, 23, 25, 36, 38, 39]
    assert sorted(range(40), key=lambda i: (-want[i, 2 if i < 39 else 1], i))[:8] == [12, 25, 38, 39, 10, 23, 36, 8]
    assert _detail(fig) == v.shown == [f"blocks.{i}.mlp" for i in busiest]
    assert len([t for t in fig.data if t.type == "bar"]) == 8
    lay = fig.layout
    assert lay[s.yaxis.replace("y", "yaxis")].domain[0] > max(a.y for a in lay.annotations)  # summary on top
    assert sum(t.startswith("● ") for t in lay[s.yaxis.replace("y", "yaxis")].ticktext) == 8
    assert "40 MoE layer(s)" in lay.title.text and "8 shown (highest max/mean at the newest step): " \
        "blocks.8.mlp, blocks.10.mlp" in lay.title.text
    assert lay.coloraxis2.cmin == 1 and s.coloraxis == "coloraxis2"
    # every layer stays readable, shown or not
    assert v.load("blocks.0.mlp").z == [[0 + 2, 3 + 2, 6 + 2], [2, 2, 2], [2, 2, 2], [2, 2, 2]]
    assert v.per_rank("blocks.39.mlp") == {0: (12, 1, 1, 1), 1: (2, 1, 1, 1)}
    # a new busiest layer enters, the least busy shown one leaves; the rest keep their places
    v.update([L(0, 3, "blocks.0.mlp", (100, 0, 0, 0))])
    assert v.shown == [f"blocks.{i}.mlp" for i in [0] + busiest[1:]]
    # pinned: exactly those, in model order, until select(None)
    v.select(["blocks.3.mlp", "blocks.1.mlp", "blocks.3.mlp"])
    assert v.shown == _detail(v.figure) == ["blocks.1.mlp", "blocks.3.mlp"]
    assert "2 shown (pinned by view.select)" in v.figure.layout.title.text
    v.update([L(0, 4, "blocks.5.mlp", (100, 0, 0, 0))])
    assert v.shown == ["blocks.1.mlp", "blocks.3.mlp"]
    v.select(None)
    assert v.shown[0] == "blocks.0.mlp" and "blocks.5.mlp" in v.shown and len(_detail(v.figure)) == 8
    # bad choices are refused before anything changes
    with pytest.raises(ValueError, match=r"unknown layer\(s\) \['blocks.99.mlp'\]; known layers: \['blocks.0.mlp'"):
        v.select(["blocks.1.mlp", "blocks.99.mlp"])
    with pytest.raises(ValueError, match=r"pass a list of layer names, e.g. select\(\['blocks.1.mlp'\]\)"):
        v.select("blocks.1.mlp")
    with pytest.raises(ValueError, match="no layer given"):
        v.select([])
    with pytest.raises(ValueError, match=r"more than max_panels=8.*ExpertLoadView\(max_panels=9\)"):
        v.select(names[:9])
    assert len(_detail(v.figure)) == 8
    with pytest.raises(ValueError, match=r"max_panels=0.*positive int"):
        ExpertLoadView(max_panels=0, subscribe=False, live=False)


def test_few_layers_draw_the_figure_without_a_summary():
    ev = _events()
    st = ExpertLoadState()
    for e in ev:
        st.apply(e)
    old = expert_load_dict(st)  # no panel limit: one panel per layer, as before the selector
    assert not any(t["name"] == "imbalance" for t in old["data"])
    assert ExpertLoadView.from_events(ev, live=False).figure_dict() == old
    assert ExpertLoadView.from_events(ev, live=False, max_panels=2).figure_dict() == old
    # one past the limit: the summary and the busier layer (blocks.2 at 1.5 over blocks.10 at 1.0)
    one = ExpertLoadView.from_events(ev, live=False, max_panels=1)
    assert _detail(one.figure) == one.shown == ["blocks.2.mlp"] and one.figure.data[0].name == "imbalance"
    assert [list(r) for r in one.figure.data[0].z] == [[6 * 4 / 11, 1.5], [2.0, 1.0]]
    # rank 1's late blocks.10 step 2 (drawn once already): the summary sums it in, the busiest changes
    one.update([L(1, 2, "blocks.10.mlp", (8, 0, 0, 0), 4)])
    assert [list(r) for r in one.figure.data[0].z] == [[6 * 4 / 11, 1.5], [2.0, 10 * 4 / 16]]
    assert list(one.figure.data[0].customdata[1]) == [2, 4] and one.shown == ["blocks.10.mlp"]
    # a pin on a small model shows the summary and the pinned layer
    v = ExpertLoadView.from_events(ev, live=False)
    v.select(["blocks.10.mlp"])
    assert _detail(v.figure) == ["blocks.10.mlp"] and v.figure.data[0].name == "imbalance"
    v.select(None)
    assert v.figure_dict() == old
