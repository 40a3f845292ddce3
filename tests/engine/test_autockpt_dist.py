"""Activation checkpointing within a budget under the plugins (engine/autockpt_dist.py): tensor-parallel
ranks agree on one plan (their profiles merged to the worst case), a pipeline stage plans its share
of the step's budget (divided by the microbatches it holds in flight) and its measured step peak
stays within the budget, Gemini plans with its chunks gathered outside its hooks (and takes the
budget from what device_memory_limit leaves), and bad arguments are named before any work.

Every multi-rank case runs real gloo processes and follows a single-process plain run's losses."""

import pytest
import torch
import torch.nn as nn
from support.dist import run_distributed
from support.engine import lm_loss, plain_losses

from colossal_lab.engine.autockpt import min_peak, profile_checkpointing
from colossal_lab.engine.autockpt_dist import in_flight, merge_profiles, stage_budget
from colossal_lab.engine.models import GPT, GPTConfig

BATCH, SEQ, LR = 8, 32, 0.1


def _data(steps=3):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randint(0, 256, (BATCH, SEQ), generator=g)
        out.append({"idx": x, "targets": torch.roll(x, -1, 1)})
    return out


def _model(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", n_layer=4, **kw))


def _adamw(params):  # Gemini's optimizer (it runs fused AdamW on chunk shards)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _sgd(params):
    return torch.optim.SGD(params, lr=LR)


def _reference_losses(steps=3, make_opt=_sgd):
    """One process, no checkpointing, the whole batch: the curve every layout must follow."""
    return plain_losses(_model(), _data(steps), make_opt)


def _figures(prof):
    """Every number of a profile, for comparing two ranks' profiles exactly."""
    from colossal_lab.engine.autockpt_dist import _flat

    return _flat(prof)


def _memory(prof):
    """The byte figures of a profile (no seconds): what two profiles of the same step share exactly."""
    out = [prof.prefix_keep, prof.prefix_peak, prof.prefix_bwd_peak, prof.tail_keep, prof.tail_peak,
           prof.tail_bwd_delta, prof.tail_bwd_peak]
    for u in prof.units:
        for o in prof.options:
            c = u.options[o]
            out += [c.keep, c.fwd_peak, c.bwd_delta, c.bwd_peak, c.saved]
    return out


def _inner_gpt(model):
    return next(m for m in model.modules() if isinstance(m, GPT))


# ---- tensor parallelism: one plan over the ranks --------------------------------------------------
def _measured_step(step):
    """The peak one more step allocates, its gradients already there (as after a first step)."""
    from colossal_lab.engine.planner import measure

    step()
    with measure() as meter:
        step()
    return meter.peak["cpu"]


def _tp_worker(rank, world, budget):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    out = {}
    b0 = _data(1)[0]
    # the model's own "auto" under tp2 + sequence parallelism (collectives inside every block), trained
    # by direct forwards (the model's own loss)
    model = _model(activation_checkpointing="auto", activation_budget=budget)
    plugin = HybridParallelPlugin(tp_size=2, sequence_parallel=True)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, _sgd(model.parameters()))
    losses = []
    for b in _data():
        _, loss = model(b["idx"], b["targets"])
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    plan = _inner_gpt(model).checkpoint_plan
    measured = _measured_step(lambda: booster.backward(model(b0["idx"], b0["targets"])[1], opt))
    out["tp"] = (losses, list(plan.layers), plan.budget, plan.predicted_peak, _figures(plan.profile), measured)
    plugin.close()

    # context parallelism (ring): each rank holds half of every sequence, attention passes K/V around;
    # trained by execute_pipeline, whose criterion the plan is made with
    model = _model(activation_checkpointing="auto", activation_budget=budget * 3 // 4)
    plugin = HybridParallelPlugin(cp_size=2)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, _sgd(model.parameters()))
    losses = []
    for b in _data():
        losses.append(booster.execute_pipeline(iter([b]), model, lm_loss, opt)["loss"].item())
        opt.step()
        opt.zero_grad()
    plan = _inner_gpt(model).checkpoint_plan
    measured = _measured_step(lambda: booster.execute_pipeline(iter([b0]), model, lm_loss, opt))
    out["cp"] = (losses, list(plan.layers), plan.budget, plan.predicted_peak, _figures(plan.profile), measured)
    plugin.close()

    # GPT's own "auto" outside any plugin hook (tensor parallelism applied, the model called itself):
    # it finds its DTensor parameters' tensor-parallel group and agrees over it
    model = _model()
    plugin = HybridParallelPlugin(tp_size=2)
    hp, *_ = Booster(plugin=plugin).boost(model)
    inner = _inner_gpt(hp)
    del inner._checkpoint_groups  # what the plugin would have told it
    inner.cfg.activation_checkpointing, inner.cfg.activation_budget = "auto", budget
    inner(b0["idx"], b0["targets"])[1].backward()
    plan = inner.checkpoint_plan
    out["own"] = (None, list(plan.layers), plan.budget, plan.predicted_peak, _figures(plan.profile), None)
    plugin.close()

    # a budget below what any plan reaches: the same error on both ranks (they solve one merged profile)
    model = _model()
    plugin = HybridParallelPlugin(tp_size=2, activation_checkpointing="auto", activation_budget=1)
    hp, *_ = Booster(plugin=plugin).boost(model)
    try:
        hp(b0["idx"], b0["targets"])
        out["low"] = None
    except ValueError as e:
        out["low"] = str(e)
    plugin.close()
    return out


def test_tensor_and_context_parallel_ranks_agree_on_one_plan_and_follow_one_process():
    ref = _reference_losses()
    b = _data(1)[0]
    prof = profile_checkpointing(_model(), (b["idx"], b["targets"]))
    # one process's lowest peak: each tp rank holds half of every block's activations (a cp rank half
    # of every sequence), so this (3/4 of it under cp) lies between a rank's lowest and highest peak
    budget = min_peak(prof)[0]
    r0, r1 = run_distributed(_tp_worker, 2, budget, timeout=300)
    for name, want in (("tp", budget), ("cp", budget * 3 // 4), ("own", budget)):
        for losses, layers, got, peak, _, measured in (r0[name], r1[name]):
            assert got == want and peak <= want, name
            assert 0 < len(layers) < 2 * 4, name  # something recomputes, not everything
            if losses is not None:
                assert losses == pytest.approx(ref, abs=1e-5), name
                # a later step's measured peak on this rank holds the budget
                assert measured <= want, (name, measured, want)
        assert r0[name][1] == r1[name][1], name  # the same layers on both ranks
        # the ranks solved the very same profile: their own measurements were merged (no two CPU clocks
        # agree to the last bit)
        assert r0[name][4] == r1[name][4], name
    for r in (r0, r1):
        assert r["low"] is not None and "Raise the budget to at least" in r["low"]
    assert r0["low"] == r1["low"]  # the same lowest peak named on both


# ---- a pipeline: each stage plans its share of the budget -----------------------------------------
class Res(nn.Module):
    """x + w2(relu(w1(x))): a user's layer, no model contract beyond being a Sequential's child."""

    def __init__(self, d=32, h=128):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


def _user_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(256, 32), Res(), Res(), Res(), Res(), nn.Linear(32, 256))


def _pp_worker(rank, world, budget, m, user_budget, low_budget):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.planner import measure
    from colossal_lab.engine.plugins import HybridParallelPlugin

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=m, activation_checkpointing="auto",
                                  activation_budget=budget)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, opt)
    losses = []
    for b in _data():
        out = booster.execute_pipeline(iter([b]), model, lm_loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(None if out["loss"] is None else out["loss"].item())
    # one more step's forward and backward, measured: the gradients exist (as after a first step),
    # so what it allocates is activations, their gradients and the pipeline's buffers
    b = _data(1)[0]
    booster.execute_pipeline(iter([b]), model, lm_loss, opt)
    with measure() as meter:
        booster.execute_pipeline(iter([b]), model, lm_loss, opt)
    plan = model.stage_modules[0].inner.checkpoint_plan
    plugin.close()

    # a user's nn.Sequential, split by its children: its stage's children are wrapped (checkpoint_wrapper)
    user = _user_model()
    opt = torch.optim.SGD(user.parameters(), lr=LR)
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=m, activation_checkpointing="auto",
                                  activation_budget=user_budget)
    booster = Booster(plugin=plugin)
    user, opt, *_ = booster.boost(user, opt)
    out = booster.execute_pipeline(iter([_data(1)[0]]), user, lm_loss, opt)
    stage = user.stage_modules[0].inner
    wrapped = [i for i, c in enumerate(stage) if hasattr(c, "_checkpoint_wrapped_module")]
    user_out = (None if out["loss"] is None else out["loss"].item(), list(stage.checkpoint_plan.layers), wrapped,
                stage.checkpoint_plan.budget)
    plugin.close()

    # stage 0's share below its lowest peak, stage 1's not: both ranks get the error after the step
    model = _model()
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=m, activation_checkpointing="auto",
                                  activation_budget=low_budget)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, _sgd(model.parameters()))
    try:
        booster.execute_pipeline(iter([_data(1)[0]]), model, lm_loss, opt)
        low = None
    except ValueError as e:
        low = str(e)
    plugin.close()
    return losses, list(plan.layers), plan.budget, plan.predicted_peak, meter.peak["cpu"], user_out, low, \
        plan.profile.stage


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _stage_profile(stage, m, model=None):
    """A stage's profile on one microbatch, as the plugin takes it (its input; the criterion on the
    last stage, an output-sized gradient on the first)."""
    if model is None:
        model, width = _model().pipeline_stage(stage, 2), _model().cfg.n_embd
    else:  # a Sequential: half of its children
        width, half = model[0].embedding_dim, len(model) // 2
        model = model[:half] if stage == 0 else model[half:]
    b = {k: v[:BATCH // m] for k, v in _data(1)[0].items()}
    if stage == 0:
        return profile_checkpointing(model, (b["idx"],),
                                     lambda out, inp: (_first(out) * torch.ones_like(_first(out))).sum())
    h = torch.randn(BATCH // m, SEQ, width, requires_grad=True)
    return profile_checkpointing(model, (h,), lambda out, inp: lm_loss(_first(out), b))


def test_pipeline_stages_plan_their_share_and_hold_the_budget():
    m = 4
    ref = _reference_losses()
    # 1F1B on 2 stages: stage 0 holds 2 microbatches in flight, stage 1 one. The budget puts stage 0's
    # share halfway between its lowest and its highest peak per microbatch, so it must choose.
    p0 = _stage_profile(0, m)
    budget = min_peak(p0)[0] + p0.predict(["none"] * 2)[0]
    # the user's Sequential: stage 1's share (the whole budget) halfway between its extremes; stage 0's
    # half of it must still be reachable (else stage 0 would fail alone while stage 1 waits for it)
    u0, u1 = _stage_profile(0, m, _user_model()), _stage_profile(1, m, _user_model())
    user_budget = (min_peak(u1)[0] + u1.predict(["none"] * 3)[0]) // 2
    assert min_peak(u0)[0] <= user_budget // 2
    user = _user_model()
    user_ref = lm_loss(user(_data(1)[0]["idx"]), _data(1)[0]).item()
    low_budget = 2 * min_peak(p0)[0] - 2  # stage 0's half just below its lowest peak; stage 1's whole is not
    p1 = _stage_profile(1, m)
    assert min_peak(p1)[0] <= low_budget
    assert (p0.stage, p1.stage) == (0, 1)  # a GPT.pipeline_stage copy profiled outside the plugin knows its stage
    r0, r1 = run_distributed(_pp_worker, 2, budget, m, user_budget, low_budget, timeout=300)
    assert r1[0] == pytest.approx(ref, abs=1e-5) and r0[0] == [None] * 3  # the loss lives on the last stage
    for stage, (_, layers, got, peak, measured, _, _, planned_stage) in enumerate((r0, r1)):
        assert planned_stage == stage  # the plan says which stage it is for (telemetry reports it)
        assert got == budget // in_flight("1f1b", 2, stage, m) == stage_budget(budget, "1f1b", 2, stage, m)
        assert peak <= got
        # the step's measured peak on this stage (every microbatch in flight) is within the budget
        assert measured <= budget, (stage, measured, budget)
    assert r0[2] == budget // 2 and r1[2] == budget
    assert 0 < len(r0[1])  # stage 0's half share forces recompute
    # the user's model through the contract (a Sequential): planned per stage, its children wrapped
    (_, layers0, wrapped0, b0), (loss1, layers1, wrapped1, b1) = r0[5], r1[5]
    assert loss1 == pytest.approx(user_ref, abs=1e-5)
    assert (b0, b1) == (user_budget // 2, user_budget)
    assert wrapped0 == layers0 and wrapped1 == layers1 and 0 < len(layers1) < 3
    # a stage that cannot hold its share: the same error on every rank, after the step (no rank hangs)
    assert r0[6] == r1[6] and r0[6] is not None
    assert "1 pipeline stage(s) cannot hold their share" in r0[6] and "pp rank 0" in r0[6]
    assert "at least that" in r0[6] and "pp rank 1" not in r0[6]


def _pp_tp_worker(rank, world, budget, m):
    import torch.distributed as dist

    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    model = _model()
    plugin = HybridParallelPlugin(pp_size=2, tp_size=2, num_microbatches=m, activation_checkpointing="auto",
                                  activation_budget=budget)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, _sgd(model.parameters()))
    losses = []
    for b in _data():
        out = booster.execute_pipeline(iter([b]), model, lm_loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(None if out["loss"] is None else out["loss"].item())
    plan = model.stage_modules[0].inner.checkpoint_plan
    pp_rank = plugin.mesh["pp"].get_local_rank()
    plugin.close()
    return dict(rank=dist.get_rank(), pp_rank=pp_rank, losses=losses, layers=list(plan.layers), budget=plan.budget,
                peak=plan.predicted_peak, figures=_figures(plan.profile), stage=plan.profile.stage)


def test_pipeline_by_tensor_parallel_stages_agree_within_each_stage():
    # pp2 x tp2 on 4 ranks: each stage's two tensor-parallel ranks merge their profiles and solve one
    # plan for that stage's share of the budget; the stages plan apart; the losses follow one process
    m = 4
    ref = _reference_losses()
    p0 = _stage_profile(0, m)
    # two thirds of the pp2 test's budget: a tp rank holds less of each block's activations, and at
    # the pp2 budget stage 0 recomputed nothing here; at 2/3 it must choose (seen: "0.mlp")
    budget = 2 * (min_peak(p0)[0] + p0.predict(["none"] * 2)[0]) // 3
    rs = run_distributed(_pp_tp_worker, 4, budget, m, timeout=400)
    by_stage = {}
    for r in rs:
        by_stage.setdefault(r["pp_rank"], []).append(r)
    assert sorted(by_stage) == [0, 1] and all(len(v) == 2 for v in by_stage.values())
    for stage, (a, b) in by_stage.items():
        assert a["stage"] == b["stage"] == stage
        assert a["budget"] == b["budget"] == stage_budget(budget, "1f1b", 2, stage, m)
        assert a["peak"] <= a["budget"] and b["peak"] <= b["budget"]
        assert a["layers"] == b["layers"], stage  # one plan per stage
        assert a["figures"] == b["figures"], stage  # solved from one merged profile
    assert by_stage[0][0]["layers"], "stage 0's share must force some recompute, else agreement is trivial"
    assert by_stage[0][0]["budget"] == budget // 2 and by_stage[1][0]["budget"] == budget
    for r in by_stage[1]:
        assert r["losses"] == pytest.approx(ref, abs=1e-5)
    assert all(r["losses"] == [None] * 3 for r in by_stage[0])


# ---- Gemini: planned outside its hooks, with its chunks gathered ------------------------------------
def _gemini_overhead(limit):
    """What Gemini keeps on the compute tier under ``limit`` (resident chunks and optimizer state, and
    its working-set reserve), from a boost that does not train."""
    from colossal_lab.engine import Booster
    from colossal_lab.engine.gemini.placement import working_set_bytes
    from colossal_lab.engine.plugins import GeminiPlugin

    plugin = GeminiPlugin(placement_policy="static", precision="fp32", device_memory_limit=limit)
    model = _model()
    gm, *_ = Booster(plugin=plugin, mixed_precision="fp32").boost(model, _adamw(model.parameters()))
    tier = gm.manager.stack.compute
    used = tier.used + working_set_bytes(gm.manager.chunks, plugin.max_prefetch, tier.capacity)
    plugin.close()
    return used


def _gemini_worker(rank, world, budget, limit):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.gemini.placement import working_set_bytes
    from colossal_lab.engine.plugins import GeminiPlugin

    # a device_memory_limit leaving about ``budget`` for activations once Gemini has its share
    limit = _gemini_overhead(limit) + budget
    out = {"limit": limit}
    for name, plugin in (
            ("given", GeminiPlugin(placement_policy="cpu", precision="fp32", activation_checkpointing="auto",
                                   activation_budget=budget)),
            ("derived", GeminiPlugin(placement_policy="static", precision="fp32", device_memory_limit=limit,
                                     activation_checkpointing="auto")),
            ("model", GeminiPlugin(placement_policy="cpu", precision="fp32")),
            ("every", GeminiPlugin(placement_policy="cpu", precision="fp32", activation_checkpointing=True))):
        model = _model(activation_checkpointing="auto", activation_budget=budget) if name == "model" else _model()
        opt = _adamw(model.parameters())
        gm, gopt, *_ = Booster(plugin=plugin, mixed_precision="fp32").boost(model, opt)
        mgr = gm.manager
        tier = mgr.stack.compute
        left = tier.capacity - tier.used - working_set_bytes(mgr.chunks, plugin.max_prefetch, tier.capacity)
        losses = []
        n = BATCH // world
        for b in _data():
            _, loss = gm(b["idx"][rank * n:(rank + 1) * n], b["targets"][rank * n:(rank + 1) * n])
            gopt.backward(loss)
            gopt.step()
            gopt.zero_grad()
            t = loss.detach().clone()
            torch.distributed.all_reduce(t)
            losses.append(t.item() / world)
        if name == "every":  # every block recomputes, as before "auto"
            inner = gm.unwrap()
            out[name] = dict(losses=losses, every=inner.cfg.activation_checkpointing is True
                             and inner.checkpoint_layers is None and inner.checkpoint_plan is None)
            plugin.close()
            continue
        plan = gm.checkpoint_plan
        out[name] = dict(losses=losses, layers=list(plan.layers), budget=plan.budget, left=left,
                         peak=plan.predicted_peak, figures=_figures(plan.profile), memory=_memory(plan.profile))
        plugin.close()
    return out


def test_gemini_plans_with_gathered_chunks_and_follows_one_process():
    ref = _reference_losses(make_opt=_adamw)
    b = {k: v[:BATCH // 2] for k, v in _data(1)[0].items()}
    prof = profile_checkpointing(_model(), (b["idx"], b["targets"]))
    budget = (min_peak(prof)[0] + prof.predict(["none"] * 4)[0]) // 2
    limit = 8 << 20
    r0, r1 = run_distributed(_gemini_worker, 2, budget, limit, timeout=300)
    for r in (r0, r1):
        assert r["every"]["every"] and r["every"]["losses"] == pytest.approx(ref, abs=1e-5)
        for name in ("given", "derived", "model"):
            assert r[name]["losses"] == pytest.approx(ref, abs=1e-5), name
            assert r[name]["peak"] <= r[name]["budget"]
            assert 0 < len(r[name]["layers"]) < 8  # halfway between the extremes: some parts recompute
        assert r["given"]["budget"] == budget
        # without a budget: what device_memory_limit leaves after Gemini's resident chunks and working set
        assert 0 < r["derived"]["budget"] == r["derived"]["left"] < r["limit"]
    # the model's own "auto" is planned by the plugin the same way, with the model's budget: the same
    # bytes to the byte (which of the plans that fit is fastest is read off timings, which move
    # between two profiles: on this tiny GPT a region's overhead is as large as its recompute)
    assert r0["model"]["budget"] == budget and r0["model"]["memory"] == r0["given"]["memory"]
    for name in ("given", "derived", "model"):
        assert r0[name]["layers"] == r1[name]["layers"] and r0[name]["figures"] == r1[name]["figures"]


# ---- bad arguments, before any work -----------------------------------------------------------------
class _NoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4)])

    def forward(self, x):
        return self.layers[0](x)

    def num_layers(self):
        return 1

    def enable_activation_checkpointing(self):
        pass


def test_bad_arguments_are_named():
    from colossal_lab.engine.plugins import GeminiPlugin, HybridParallelPlugin

    for cls in (HybridParallelPlugin, GeminiPlugin):
        name = cls.__name__
        if cls is HybridParallelPlugin:  # Gemini can take the budget from device_memory_limit
            with pytest.raises(ValueError, match=rf"{name}\(activation_checkpointing='auto'\) needs activation_budget"):
                cls(activation_checkpointing="auto")
        for bad in (0, -5, True, "1GB", float("inf")):
            with pytest.raises(ValueError, match=rf"{name}\(activation_budget=.*\): must be a number of bytes > 0"):
                cls(activation_checkpointing="auto", activation_budget=bad)
        with pytest.raises(ValueError, match=rf"{name}\(activation_checkpointing='yes'\): choose False, True"):
            cls(activation_checkpointing="yes")
        with pytest.raises(ValueError,
                           match=r"activation_budget=1024\) is read only with activation_checkpointing='auto'"):
            cls(activation_budget=1024)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"pass activation_budget=<bytes> .* or device_memory_limit=<bytes>"):
            GeminiPlugin(activation_checkpointing="auto")
    # a model that cannot take a list of layers: refused at configure, before any process group
    with pytest.raises(ValueError, match=r"enable_activation_checkpointing\(\) takes no `layers`"):
        HybridParallelPlugin(activation_checkpointing="auto", activation_budget=1 << 20).configure(_NoLayers())
    with pytest.raises(ValueError, match=r"enable_activation_checkpointing\(\) takes no `layers`"):
        GeminiPlugin(activation_checkpointing="auto", activation_budget=1 << 20).configure(_NoLayers(), None, None,
                                                                                         None, None)


def test_merge_and_budget_rules_without_a_process_group():
    b = _data(1)[0]
    prof = profile_checkpointing(_model(), (b["idx"], b["targets"]))
    assert merge_profiles(prof) is prof  # one process: nothing to merge with
    # the schedules' in-flight counts (cl.plan's rule): GPipe all, 1F1B pp - s, times the chunks
    assert [in_flight("gpipe", 4, s, 8) for s in range(4)] == [8] * 4
    assert [in_flight("1f1b", 4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight("1f1b", 4, 0, 2) == 2 and in_flight("interleaved", 2, 0, 4, chunks=2) == 4
    assert in_flight("1f1b", 1, 0, 8) == 1 and stage_budget(1000, "1f1b", 4, 1, 8) == 333
