"""``cl.autoplan``: the layouts it considers, its step-time model, and a real search on 2 gloo ranks
whose chosen plugin then trains."""

import math

import pytest

pytest.importorskip("ipyparallel")

import torch

import colossal_lab as cl
from colossal_lab.engine.models import GPTConfig
from colossal_lab.engine.planner.layout import (
    PEAK_MARGIN,
    PEAK_MARGIN_ZERO,
    Candidate,
    Costs,
    candidates,
    choose_probes,
    features,
    fit_overheads,
    merge_calibrations,
    predict,
)

TINY = GPTConfig.preset("tiny")          # 2 layers, 2 heads
FOUR = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=32)


def test_candidates_are_every_layout_the_model_and_batch_allow():
    got = {c.label for c in candidates(TINY, 4, 8)}
    # 1D tp 4 is out (2 heads; 2D cuts the hidden size only q = 2 ways), pp 4 is out (2 layers),
    # interleaving needs pp*2 = 4 layers
    assert got == {
        "dp1 tp4(2d) pp1", "dp1 tp4(2d) pp1 ac",
        "dp4 tp1 pp1", "dp4 tp1 pp1 ac", "dp4 tp1 pp1 zero1", "dp4 tp1 pp1 zero1 ac",
        "dp2 tp1 pp2 1f1b m2", "dp2 tp1 pp2 1f1b m2 ac", "dp2 tp1 pp2 1f1b m2 zero1", "dp2 tp1 pp2 1f1b m2 zero1 ac",
        "dp2 tp1 pp2 1f1b m4", "dp2 tp1 pp2 1f1b m4 ac", "dp2 tp1 pp2 1f1b m4 zero1", "dp2 tp1 pp2 1f1b m4 zero1 ac",
        "dp2 tp2 pp1", "dp2 tp2 pp1 ac",
        "dp1 tp2 pp2 1f1b m2", "dp1 tp2 pp2 1f1b m2 ac", "dp1 tp2 pp2 1f1b m4", "dp1 tp2 pp2 1f1b m4 ac",
    }
    four = candidates(FOUR, 4, 8, activation_checkpointing=(False,), zero_stages=(0,))
    assert {c.label for c in four} >= {"dp1 tp4 pp1", "dp1 tp1 pp4 1f1b m4", "dp2 tp1 pp2 interleaved m2",
                                       "dp1 tp1 pp4 1f1b m8"}
    assert all(c.num_model_chunks == (2 if c.pp_style == "interleaved" else 1) for c in four)
    # a batch of 2 cannot feed 4 data-parallel ranks, nor 4 microbatches on 2 data-parallel ranks
    small = {c.label for c in candidates(TINY, 4, 2, activation_checkpointing=(False,), zero_stages=(0,))}
    assert small == {"dp2 tp2 pp1", "dp1 tp2 pp2 1f1b m2", "dp1 tp4(2d) pp1"}
    # 8 ranks: 2.5D (q=2, d=2) and 3D (q=2) where 1D tp 8 cannot split 2 heads; both cut a
    # microbatch's rows 4 ways; 1D only with tp_modes=("1d",)
    eight = {c.label for c in candidates(TINY, 8, 8, activation_checkpointing=(False,), zero_stages=(0,))}
    assert {"dp1 tp8(2.5d d2) pp1", "dp1 tp8(3d) pp1", "dp2 tp4(2d) pp1"} <= eight
    assert not any("tp8 " in x or "tp8(1d" in x for x in eight)
    with pytest.raises(ValueError, match="no layout"):  # 2 rows cannot be cut 4 ways (nor 2 ways per dp rank)
        candidates(TINY, 8, 2)
    assert all(c.tp_mode == "1d" for c in candidates(TINY, 8, 8, tp_modes=("1d",)))
    assert Candidate(1, 8, 1, tp_mode="2.5d", tp_depth=2).plugin_kwargs() == {
        "tp_size": 8, "pp_size": 1, "zero_stage": 0, "activation_checkpointing": False, "tp_mode": "2.5d",
        "tp_depth": 2}
    assert Candidate(2, 1, 2, "1f1b", 4, 1, 1, True).plugin_kwargs() == {
        "tp_size": 1, "pp_size": 2, "zero_stage": 1, "activation_checkpointing": True, "pp_style": "1f1b",
        "num_microbatches": 4, "num_model_chunks": 1}


def test_bad_input_is_refused_before_any_work():
    with pytest.raises(ValueError, match="world_size"):
        candidates(TINY, 0, 8)
    with pytest.raises(ValueError, match="batch"):
        candidates(TINY, 4, 0)
    with pytest.raises(ValueError, match="schedules"):
        candidates(TINY, 4, 8, schedules=("zigzag",))
    with pytest.raises(ValueError, match="device_memory"):
        cl.autoplan(TINY, world_size=2, batch=4, device_memory=-1)
    with pytest.raises(ValueError, match="seq"):
        cl.autoplan(TINY, world_size=2, batch=4, seq=0)


def _cal():
    # hand-made constants: compute 1 ms per 100 tokens (+1 ms), all-reduce 1 ms + 1 ms per MB,
    # p2p 0.5 ms + 1 ms per MB, AdamW 1 ns per element
    def line(toks, a, b):
        return [a + b * t for t in toks]

    toks = [100, 1000]
    return {"compute": {tp: {"tokens": toks, "f": line(toks, 1e-3 / tp, 1e-5 / tp / 3),
                             "fb": line(toks, 1e-3 / tp, 1e-5 / tp)} for tp in (1, 2)},
            "allreduce": {k: [(1e6, 2e-3), (2e6, 3e-3)] for k in (2, 4)},
            "p2p": [(1e6, 1.5e-3), (2e6, 2.5e-3)], "adam_s_per_elem": 1e-9}


def test_the_step_model_is_the_documented_formula():
    costs = Costs(_cal())
    kw = dict(batch=8, seq=100, n_embd=10, layers=2, params=1_000_000)
    # dp2 pp2 1f1b m2: microbatch = 8/2/2 * 100 = 200 tokens; a rank runs half the model
    t = predict(Candidate(2, 1, 2, "1f1b", 2), costs, **kw)
    fb = (1e-3 + 1e-5 * 200) / 2
    p2p = 2 * (0.5e-3 + 1e-3 * 200 * 10 * 4 / 1e6)
    slots = 2 + 1
    dp = 1e-3 + 1e-3 * (1_000_000 / 2 * 4) / 1e6
    assert t["pipeline"] == pytest.approx(slots * (fb + p2p))
    assert t["dp_comm"] == pytest.approx(dp)
    assert t["optim"] == pytest.approx(1e-9 * 500_000)
    assert t["total"] == pytest.approx(slots * (fb + p2p) + dp + 1e-9 * 500_000)
    # checkpointing recomputes the forward; interleaving shrinks the bubble; ZeRO-1 shards the step
    ac = predict(Candidate(2, 1, 2, "1f1b", 2, activation_checkpointing=True), costs, **kw)
    assert ac["compute"] - t["compute"] == pytest.approx(slots * (1e-3 + 1e-5 * 200 / 3) / 2)
    inter = predict(Candidate(2, 1, 2, "interleaved", 2, 2), costs, **kw)
    assert inter["compute"] == pytest.approx((2 + 0.5) * fb)
    z = predict(Candidate(2, 1, 2, "1f1b", 2, zero_stage=1), costs, **kw)
    assert z["optim"] == pytest.approx(t["optim"] / 2) and z["dp_comm"] > t["dp_comm"]
    # tensor parallelism: 4 all-reduces of (200 tokens x 10 x 4 B) per layer, 2 layers, 1 slot
    tp = predict(Candidate(1, 2, 1), costs, batch=2, seq=100, n_embd=10, layers=2, params=1_000_000)
    assert tp["tp_comm"] == pytest.approx(4 * 2 * (1e-3 + 1e-3 * 200 * 10 * 4 / 1e6))


def test_ranks_sharing_cores_pay_less_for_the_bubble_but_never_less_than_their_work():
    # CPU ranks share cores: computing alone (the bubble: others idle) runs `slowdown` x faster
    # than with every rank busy. The step is the longer of the critical path at that speed and the
    # work itself (m microbatches, all busy); one device per rank (slowdown 1) is the plain formula
    kw = dict(batch=8, seq=100, n_embd=10, layers=2, params=1_000_000)
    plain = Costs(_cal())
    shared = Costs({**_cal(), "alone": {"busy": 0.02, "alone": 0.01}})
    assert plain.slowdown == 1.0 and shared.slowdown == 2.0
    p2p = 2 * (0.5e-3 + 1e-3 * 200 * 10 * 4 / 1e6)
    deep = Candidate(1, 1, 4, "1f1b", 4)  # microbatch 8/4 = 2 samples: 200 tokens, a quarter model
    fb4 = (1e-3 + 1e-5 * 200) / 4
    assert predict(deep, plain, **kw)["pipeline"] == pytest.approx((4 + 3) * (fb4 + p2p))
    # critical path (4 + 3) x (fb4/2 + p2p) against the work 4 x (fb4 + p2p): the path is longer
    assert predict(deep, shared, **kw)["pipeline"] == pytest.approx(max(7 * (fb4 / 2 + p2p), 4 * (fb4 + p2p)))
    assert predict(deep, shared, **kw)["pipeline"] < predict(deep, plain, **kw)["pipeline"]
    # a small bubble: the work bound holds (m = 8 microbatches, 1 bubble slot)
    wide = Candidate(1, 1, 2, "1f1b", 8)
    fb8 = (1e-3 + 1e-5 * 100) / 2
    p2p8 = 2 * (0.5e-3 + 1e-3 * 100 * 10 * 4 / 1e6)
    assert 9 * (fb8 / 2 + p2p8) < 8 * (fb8 + p2p8)
    assert predict(wide, shared, **kw)["pipeline"] == pytest.approx(8 * (fb8 + p2p8))
    # no pipeline: the same with or without
    dp = Candidate(4, 1, 1)
    assert predict(dp, shared, **kw)["total"] == pytest.approx(predict(dp, plain, **kw)["total"])


def test_all_reduce_is_piecewise_through_its_measured_sizes():
    # a small message measures the latency (ZeRO-1's per-tensor broadcasts), large ones the bandwidth
    cal = {**_cal(), "allreduce": {2: [(1 << 10, 1e-4), (64 << 10, 1e-3), (4 << 20, 1e-2)]}}
    costs = Costs(cal)
    assert costs.allreduce(2, 1 << 10) == pytest.approx(1e-4)
    assert costs.allreduce(2, 64 << 10) == pytest.approx(1e-3)
    assert costs.allreduce(2, 1.0) == pytest.approx(1e-4 - (1e-3 - 1e-4) / ((64 << 10) - (1 << 10)) * ((1 << 10) - 1))
    mid = (1 << 20)
    slope = (1e-2 - 1e-3) / ((4 << 20) - (64 << 10))
    assert costs.allreduce(2, mid) == pytest.approx(1e-3 + slope * (mid - (64 << 10)))


def test_zero1_pays_its_measured_asynchronous_sync_not_a_blocking_latency_per_tensor():
    # two measured batches of asynchronous broadcasts: 32 x 1 KiB in 3.3 ms, 8 x 512 KiB in 4.2 ms
    # give 0.1 ms a call and 1 ns a byte (seconds = calls * a + bytes * b through both)
    a, b = 1e-4, 1e-9
    sync = {2: [(32, 32 << 10, 32 * a + (32 << 10) * b), (8, 4 << 20, 8 * a + (4 << 20) * b)]}
    costs = Costs({**_cal(), "zero_sync": sync})
    assert costs.zero_sync(2, 50, 3e6) == pytest.approx(50 * a + 3e6 * b)
    assert costs.zero_sync(1, 50, 3e6) == 0.0 and costs.zero_sync(4, 50, 3e6) is None
    kw = dict(batch=8, seq=100, n_embd=10, layers=2, params=1_000_000, tensors=40)
    plain = predict(Candidate(2, 1, 2, "1f1b", 2), costs, **kw)
    z = predict(Candidate(2, 1, 2, "1f1b", 2, zero_stage=1), costs, **kw)
    # the stage's 20 tensors and 500k parameters (2 MB) broadcast once, beside the gradients' all-reduce
    assert z["dp_comm"] - plain["dp_comm"] == pytest.approx(20 * a + 2e6 * b)
    # without the measurement (an older calibration): a blocking latency per tensor plus half an all-reduce
    old = predict(Candidate(2, 1, 2, "1f1b", 2, zero_stage=1), Costs(_cal()), **kw)
    base = Costs(_cal())
    assert old["dp_comm"] - plain["dp_comm"] == pytest.approx(20 * base.allreduce(2, 1.0) + base.allreduce(2, 2e6) / 2)
    # noise that makes the many small calls cost as much as the few large ones: a cost per call only
    flat = Costs({**_cal(), "zero_sync": {2: [(32, 32 << 10, 8e-3), (8, 4 << 20, 1e-3)]}})
    assert flat.zero_sync(2, 10, 1e9) == pytest.approx(10 * 8e-3 / 32)


def test_a_probe_is_the_fastest_step_of_the_slowest_rank_per_step():
    from colossal_lab.engine.planner.layout import merge_probe

    got = merge_probe([{"peak": 10, "step_seconds": [1.0, 0.2, 0.3]},
                       {"peak": 30, "step_seconds": [0.1, 0.4, 0.35]}])
    # steps take 1.0, 0.4, 0.35 (each as long as its slowest rank): the fastest 0.35, median 0.4
    assert got == {"seconds": 0.35, "median": 0.4, "peak": 30}


def test_the_run_off_reruns_the_leader_and_a_runner_up_inside_the_noise():
    from colossal_lab.engine.planner.layout import runoff_pick

    def fits(c):
        return c != "big"

    # within 10%: the runner-up, then the leader, run again
    assert runoff_pick({"a": 1.0, "b": 1.08, "c": 1.5}, fits) == ["b", "a"]
    # 12% apart: the order is beyond a probe's noise, nothing re-runs
    assert runoff_pick({"a": 1.0, "b": 1.12}, fits) == []
    # only layouts that fit take part: "big" is faster but over the budget
    assert runoff_pick({"big": 0.5, "a": 1.0, "b": 1.05}, fits) == ["b", "a"]
    assert runoff_pick({"big": 0.5, "a": 1.0}, fits) == [] and runoff_pick({}, fits) == []


def test_n_d_layouts_cost_their_textbook_traffic():
    from colossal_lab.engine.planner.layout import nd_traffic
    from colossal_lab.engine.planner.memory import _meta_model
    from colossal_lab.engine.tp_nd.volume import textbook

    meta, _ = _meta_model(FOUR)
    two = Candidate(1, 4, 1, tp_mode="2d")
    nbytes, calls = nd_traffic(meta, two, 8, 16)
    assert nbytes == pytest.approx(sum(textbook(meta, "2d", 4, 8 * 16).values())) and calls > 0
    assert nd_traffic(meta, Candidate(1, 4, 1), 8, 16) == (0.0, 0.0)  # 1D is modelled per layer
    piped = Candidate(1, 2, 2, "1f1b", 2, tp_mode="1d")
    assert nd_traffic(meta, piped, 8, 16) == (0.0, 0.0)
    # the step model charges them: more bytes, more time, all else equal
    cal = {"compute": {2: {"tokens": [16, 128], "f": [0.001, 0.008], "fb": [0.003, 0.024]}},
           "allreduce": {2: [(1 << 16, 1e-4), (1 << 22, 4e-3)], 4: [(1 << 16, 2e-4), (1 << 22, 8e-3)]},
           "p2p": [], "adam_s_per_elem": 1e-9}
    dims = dict(batch=8, seq=16, n_embd=32, layers=4, params=10_000)
    low = predict(two, Costs(cal), **dims, nd_bytes=nbytes, nd_calls=calls)
    high = predict(two, Costs(cal), **dims, nd_bytes=2 * nbytes, nd_calls=calls)
    assert high["tp_comm"] > low["tp_comm"] > 0 and high["total"] > low["total"]
    # compute: the model shrunk q = 2 ways on half the rows (nb = 2)
    assert low["compute"] == pytest.approx(Costs(cal).forward_backward(2, 8 * 16) / 2)


def test_a_search_from_a_given_calibration_plans_every_mode_without_any_rank():
    # no cluster, a calibration given: memory plans (N-d ones included) and the model alone
    cal = {"compute": {t: {"tokens": [16, 512], "f": [0.001, 0.03], "fb": [0.003, 0.09]} for t in (1, 2)},
           "allreduce": {k: [(1 << 16, 1e-4 * k), (1 << 22, 4e-3 * k)] for k in (2, 4)},
           "p2p": [(1 << 16, 1e-4), (1 << 22, 4e-3)], "adam_s_per_elem": 1e-9}
    plan = cl.autoplan(TINY, world_size=4, batch=8, seq=16, device_memory=64 << 20, calibration=cal,
                       plan_all=True)
    labels = {r["label"] for r in plan.rows}
    assert "dp1 tp4(2d) pp1" in labels and plan.best is not None
    assert all(r["measured_s"] is None for r in plan.rows)  # nothing ran
    two_d = next(r for r in plan.rows if r["label"] == "dp1 tp4(2d) pp1")
    assert two_d["parts"]["tp_comm"] > 0 and two_d["peak_bytes"] > 0


def test_moe_layouts_search_ep_and_pick_it_where_only_it_fits():
    """Mixture of experts: ep_size is searched (divisors of the experts and of dp; 1D tp only), its all-to-alls
    cost time (priced on the EP group's all-reduce curve: here latency-bound, so 5 calls per MoE layer and
    microbatch make ep slower), and its 1/ep of the experts is what makes a layout fit a small budget."""
    six = candidates(GPTConfig.preset("tiny", n_expert=6, top_k=2), 4, 8)
    assert {(c.dp, c.ep) for c in six if c.tp == 1 and c.pp == 1} == {(4, 1), (4, 2)}  # 4 does not divide 6
    assert {c.tp_mode for c in six} == {"1d"} and all(c.dp % c.ep == 0 for c in six)
    assert max(c.ep for c in candidates(TINY, 4, 8)) == 1  # a dense model: no ep
    moe = GPTConfig.preset("tiny", n_expert=8, top_k=2)  # the experts are ~90% of the parameters
    cal = {"compute": {t: {"tokens": [16, 512], "f": [0.001, 0.03], "fb": [0.003, 0.09]} for t in (1, 2)},
           "allreduce": {k: [(1 << 10, 5e-3), (1 << 22, 6e-3)] for k in (2, 4)},
           "p2p": [(1 << 16, 1e-4), (1 << 22, 4e-3)], "adam_s_per_elem": 1e-9}
    space = dict(schedules=("1f1b",), microbatch_factors=(1,), zero_stages=(0,), activation_checkpointing=(False,))
    kw = dict(world_size=4, batch=8, seq=16, calibration=cal, **space)
    roomy = cl.autoplan(moe, device_memory=None, **kw)
    rows = {r["label"]: r for r in roomy.rows}
    assert roomy.best.ep == 1 and rows["dp4 tp1 pp1 ep4"]["parts"]["a2a"] > 0 == rows["dp4 tp1 pp1"]["parts"]["a2a"]
    tight = cl.autoplan(moe, device_memory=5 << 20, **kw)
    assert tight.best.ep > 1 and tight.plugin().ep_size == tight.best.ep, tight.table()
    planned = [r for r in tight.rows if r["peak_bytes"] is not None]
    assert any(r["candidate"].ep == 1 for r in planned)
    assert all(r["fits"] is False for r in planned if r["candidate"].ep == 1), tight.table()


def test_a_measured_zero1_peak_needs_more_headroom_than_others():
    # two layouts reported run (a reused calibration): both peaked at 10 MiB, ZeRO-1 the faster.
    # Under a 10.5 MiB budget the plain one fits (2% to spare) and ZeRO-1 does not (its peaks
    # spread 8% between runs); at 11 MiB both fit and ZeRO-1, the faster, is chosen
    from dataclasses import asdict

    from colossal_lab.engine.planner.layout import PEAK_MARGIN, PEAK_MARGIN_ZERO

    assert (PEAK_MARGIN, PEAK_MARGIN_ZERO) == (0.02, 0.08)
    cal = {"compute": {t: {"tokens": [16, 512], "f": [0.001, 0.03], "fb": [0.003, 0.09]} for t in (1, 2)},
           "allreduce": {k: [(1 << 16, 1e-4 * k), (1 << 22, 4e-3 * k)] for k in (2, 4)},
           "p2p": [(1 << 16, 1e-4), (1 << 22, 4e-3)], "adam_s_per_elem": 1e-9}
    plain, zero = Candidate(4, 1, 1), Candidate(4, 1, 1, zero_stage=1)
    cal["measured"] = [{"candidate": asdict(plain), "seconds": 1e-3, "peak": 10 << 20},
                       {"candidate": asdict(zero), "seconds": 0.5e-3, "peak": 10 << 20}]
    # only these two: every other layout is slower on this calibration's model or left out
    space = dict(zero_stages=(0, 1), activation_checkpointing=(False,), tp_modes=("1d",), schedules=("1f1b",))
    tight = cl.autoplan(TINY, world_size=4, batch=8, seq=16, device_memory=int(10.5 * 2**20), calibration=cal, **space)
    rows = {r["label"]: r for r in tight.rows}
    assert rows[plain.label]["fits"] is True and rows[zero.label]["fits"] is False and tight.best == plain
    roomy = cl.autoplan(TINY, world_size=4, batch=8, seq=16, device_memory=11 << 20, calibration=cal, **space)
    assert roomy.best == zero


def test_memory_is_planned_only_down_to_the_fastest_layout_that_fits():
    # cl.plan costs ~0.1-0.2 s a layout: by default only the layouts faster than the answer (and
    # the answer) are planned; fill_peaks() plans the rest, and plan_all=True gives the same table
    cal = {"compute": {t: {"tokens": [16, 512], "f": [0.001, 0.03], "fb": [0.003, 0.09]} for t in (1, 2)},
           "allreduce": {k: [(1 << 16, 1e-4 * k), (1 << 22, 4e-3 * k)] for k in (2, 4)},
           "p2p": [(1 << 16, 1e-4), (1 << 22, 4e-3)], "adam_s_per_elem": 1e-9}
    kw = dict(world_size=4, batch=8, seq=16, calibration=cal, tp_modes=("1d",))
    # 1.4 MB: the three layouts predicted fastest (dp4, dp2 pp2 m4 / m2) do not fit
    whole = cl.autoplan(TINY, device_memory=1_400_000, plan_all=True, **kw)
    lazy = cl.autoplan(TINY, device_memory=1_400_000, **kw)
    assert whole.best == lazy.best is not None
    planned = [r for r in lazy.rows if r["peak_bytes"] is not None]
    assert 0 < len(planned) < len(lazy.rows)
    # every layout predicted faster than the answer was planned, and does not fit
    answer = next(r for r in lazy.rows if r["candidate"] == lazy.best)
    faster = [r for r in lazy.rows if r["seconds"] < answer["seconds"]]
    assert faster and all(r["peak_bytes"] is not None and r["fits"] is False for r in faster)
    assert "-" in lazy.table()  # the rows not planned say so
    lazy.fill_peaks()
    assert lazy.best == whole.best
    assert {r["label"]: (r["peak_bytes"], r["fits"]) for r in lazy.rows} == \
        {r["label"]: (r["peak_bytes"], r["fits"]) for r in whole.rows}
    assert [r["label"] for r in lazy.rows] == [r["label"] for r in whole.rows]


def test_merged_calibration_takes_the_slowest_rank():
    a, b = _cal(), _cal()
    b["compute"][1]["fb"] = [x * 2 for x in b["compute"][1]["fb"]]
    b["adam_s_per_elem"] = 5e-9
    m = merge_calibrations([a, b])
    assert m["compute"][1]["fb"] == b["compute"][1]["fb"] and m["compute"][1]["f"] == a["compute"][1]["f"]
    assert m["adam_s_per_elem"] == 5e-9


def test_overheads_are_fitted_non_negative_from_what_the_model_left_unexplained():
    layers = 4
    probes = [Candidate(4, 1, 1), Candidate(1, 1, 4, "1f1b", 8), Candidate(1, 4, 1)]
    assert [features(c, layers) for c in probes] == [[1.0, 2.0, 0.0], [1.0, 2 * (8 + 3), 0.0], [1.0, 2.0, 4.0]]
    true = [0.01, 0.002, 0.0005]
    resid = [sum(a * b for a, b in zip(true, features(c, layers))) for c in probes]
    assert fit_overheads([features(c, layers) for c in probes], resid) == pytest.approx(true)
    # a model that over-predicts one probe: no negative overhead, the others still explained
    got = fit_overheads([[1.0, 2.0, 0.0], [1.0, 22.0, 0.0]], [-0.01, 0.02])
    assert all(x >= 0 for x in got) and got[1] > 0
    rows = [{"candidate": c, "fits": True} for c in probes + [Candidate(4, 1, 1, activation_checkpointing=True)]]
    assert choose_probes(rows, layers, widest_tp=True) == probes  # fewest actions, most actions, widest tp
    assert choose_probes(rows, layers) == probes[:2]  # tensor parallelism left to verification
    assert choose_probes([r for r in rows if r["candidate"].tp > 1], layers) == probes[2:]  # unless all have it


def _train_one_step(kw, batch, seq):
    import torch.distributed as dist
    from support.engine import lm_loss

    from colossal_lab.engine import Booster
    from colossal_lab.engine.models import GPT, GPTConfig
    from colossal_lab.engine.planner.layout import Candidate

    c = Candidate(**kw)
    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny")
    model = GPT(cfg)
    booster = Booster(plugin=c.plugin())
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3), lm_loss)
    x = torch.randint(0, cfg.vocab_size, (batch // c.dp, seq), generator=torch.Generator().manual_seed(dist.get_rank()))
    out = booster.execute_pipeline(iter([{"idx": x, "targets": x}]), model, lm_loss, opt)
    opt.step()
    return None if out["loss"] is None else float(out["loss"])


def test_a_real_search_on_two_ranks_picks_a_layout_that_fits_and_trains(cluster):
    from dataclasses import asdict

    plan = cl.autoplan(TINY, world_size=2, batch=4, seq=32, device_memory=64 << 20, cluster=cluster, reps=1)
    unplanned = [r["label"] for r in plan.rows if r["peak_bytes"] is None]
    assert all(r["fits"] is None for r in plan.rows if r["peak_bytes"] is None and r["measured_peak"] is None)
    plan.fill_peaks()  # every row's planned peak, for the checks below
    assert unplanned == [] or all(r["peak_bytes"] is not None for r in plan.rows)
    cal = plan.calibration
    assert set(cal["compute"]) == {1, 2} and all(v > 0 for row in cal["compute"].values() for v in row["fb"])
    assert cal["allreduce"][2][1][1] > 0 and cal["p2p"] and cal["adam_s_per_elem"] > 0
    # ZeRO-1's parameter sync, timed as the optimizer does it (batches of asynchronous broadcasts)
    assert [(n, b) for n, b, _ in cal["zero_sync"][2]] == [(32, 32 << 10), (8, 4 << 20)]
    assert all(t > 0 for *_, t in cal["zero_sync"][2]) and Costs(cal).zero_sync(2, 10, 1 << 20) > 0
    assert 1 <= len(cal["probes"]) <= 7 and all(t > 0 for _, t in cal["probes"])
    assert len(cal["overheads"]) == 3 and all(x >= 0 for x in cal["overheads"])
    fits = [r for r in plan.rows if r["fits"]]
    assert plan.best is not None and plan.best == fits[0]["candidate"]
    # verified: the chosen layout ran for real, its figures are the run's (time and peak)
    ran = {Candidate(**m["candidate"]): m for m in cal["measured"]}
    # the run-off: none, or the chosen layout and its runner-up, each keeping its faster run
    labels = {c.label for c in ran}
    assert len(ran) + len(cal["runoff"]) <= 7  # the run-off's runs come out of max_probes
    assert cal["runoff"] == [] or (len(cal["runoff"]) == 2 and plan.best.label in cal["runoff"]
                                   and set(cal["runoff"]) <= labels), cal["runoff"]
    for m in ran.values():
        again = Candidate(**m["candidate"]).label in cal["runoff"]
        runs = m.get("runs", [m["seconds"]])
        assert len(runs) == (2 if again else 1) and m["seconds"] == min(runs)
    assert plan.best in ran and fits[0]["measured_s"] == ran[plan.best]["seconds"] == fits[0]["seconds"]
    # 64 MiB is far above every plan: no run paid for the profiler, the planned peaks stand
    assert all(m["peak"] is None for m in ran.values())
    # ... and every layout that ran is judged by its run, the others by the model
    for r in plan.rows:
        assert (r["measured_s"] is not None) == (r["candidate"] in ran)
        if r["candidate"] not in ran:
            assert r["seconds"] == r["predicted_s"]
    # no layout the model ranked ahead of the chosen one (and that fits on paper) was left unrun
    # while probes remained: each was run, or predicted slower than the best run by the margin (50%
    # at first, then 1.5x the model's largest error on the layouts verified, at least 15%)
    margin = cal["margin"]
    assert 0.15 <= margin <= 0.5
    if len(ran) < 7:
        best_run = ran[plan.best]["seconds"]
        for r in plan.rows:
            if r["candidate"] not in ran and r["fits"]:
                assert r["predicted_s"] >= best_run * (1 + margin), (r["label"], r["predicted_s"], best_run)
    assert [r["seconds"] for r in fits] == sorted(r["seconds"] for r in fits)
    assert "best: " + plan.best.label in plan.table()
    losses = cluster.run(_train_one_step, asdict(plan.best), 4, 32)
    assert any(l is not None and math.isfinite(l) for l in losses)
    # a budget below every layout's peak: nothing is chosen, and asking for the plugin says why
    tight = cl.autoplan(TINY, world_size=2, batch=4, seq=32, device_memory=1 << 10, calibration=cal)
    assert tight.best is None and not any(r["fits"] for r in tight.rows)
    with pytest.raises(ValueError, match="device_memory"):
        tight.plugin()
    # near the budget the runs measure their peaks, and a layout that ran is judged by its own. The
    # budget sits 5% above the layout the search probes first whatever the timings (the fewest
    # scheduled actions of the plain layouts without tensor parallelism), so that probe is near it
    plain = [{"candidate": c, "fits": True} for c in candidates(TINY, 2, 4)  # in the search's order
             if c.tp == 1 and c.zero_stage == 0 and not c.activation_checkpointing]
    first = choose_probes(plain, TINY.n_layer)[0]
    budget = int(next(r["peak_bytes"] for r in plan.rows if r["candidate"] == first) * 1.05)
    near = cl.autoplan(TINY, world_size=2, batch=4, seq=32, device_memory=budget, cluster=cluster, reps=1)
    sized = {r["candidate"]: r for r in near.rows if r["measured_peak"] is not None}
    assert first in sized and all(r["measured_peak"] > 0 for r in sized.values())
    for c, r in sized.items():  # the headroom a measured peak needs: 2%, 8% under ZeRO-1
        assert r["fits"] == (r["measured_peak"] * (1 + (PEAK_MARGIN_ZERO if c.zero_stage else PEAK_MARGIN))
                             <= near.device_memory), (c.label, r["measured_peak"], near.device_memory)
    # the budget decides: the tightest layout that fits a budget just above its peak is chosen
    low = min(plan.rows, key=lambda r: r["peak_bytes"])
    snug = cl.autoplan(TINY, world_size=2, batch=4, seq=32, device_memory=low["peak_bytes"], calibration=cal)
    def judged(r):  # a layout that ran is judged by its measured peak, the others by the plan's
        return r["measured_peak"] if r["measured_peak"] is not None else r["peak_bytes"]

    assert all(judged(r) <= low["peak_bytes"] for r in snug.rows if r["fits"])
    assert not any(judged(r) > low["peak_bytes"] for r in snug.rows if r["fits"])
    assert snug.best is not None and judged(snug.rows[0]) <= low["peak_bytes"]
    # the reused calibration carries the runs: the same layouts count as measured, nothing new ran
    assert ({m["candidate"]["dp"] for m in snug.calibration["measured"]}
            <= {m["candidate"]["dp"] for m in cal["measured"]})
    assert len(snug.calibration["measured"]) == len(cal["measured"])


def _plan_on_ranks():
    import colossal_lab as cl
    from colossal_lab.engine.models import GPTConfig

    plan = cl.autoplan(GPTConfig.preset("tiny"), world_size=2, batch=4, seq=32, device_memory=64 << 20, reps=1)
    return plan.best.label, plan.calibration["adam_s_per_elem"]


def test_on_every_rank_of_a_process_group_the_ranks_calibrate_together_and_agree(cluster):
    got = cluster.run(_plan_on_ranks)
    assert len(got) == 2 and got[0] == got[1], got  # one merged calibration, one choice


def _auto_plugin_on_ranks():

    from colossal_lab.engine.models import GPTConfig
    from colossal_lab.engine.plugins import HybridParallelPlugin

    plugin = HybridParallelPlugin.auto(GPTConfig.preset("tiny"), batch=4, seq=32, device_memory=64 << 20, reps=1)
    assert isinstance(plugin, HybridParallelPlugin)
    return plugin.autoplan.best.label, plugin.tp_size * plugin.pp_size * plugin.dp_size


def test_hybrid_parallel_plugin_auto_returns_the_chosen_layout_as_a_plugin(cluster):
    got = cluster.run(_auto_plugin_on_ranks)
    assert got[0] == got[1] and got[0][1] == 2, got
    from colossal_lab.engine.plugins import HybridParallelPlugin

    with pytest.raises(ValueError, match="world_size"):
        HybridParallelPlugin.auto(TINY, batch=4)  # no process group here, no world_size
