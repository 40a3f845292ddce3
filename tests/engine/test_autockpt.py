"""Activation checkpointing within a budget (engine/autockpt/): the profile's saved bytes against a
hand count, the dynamic program against brute force, measured peaks under budgets spread between
checkpointing everything and nothing (with loss and gradients equal to the plain model's), GPTConfig's
"auto", and the errors a user can meet."""

import itertools
import random

import pytest
import torch
import torch.nn as nn

from colossal_lab.engine import autockpt
from colossal_lab.engine.autockpt import (
    CheckpointProfile,
    OptionCost,
    UnitProfile,
    apply,
    min_peak,
    plan_checkpointing,
    profile_checkpointing,
    solve,
)
from colossal_lab.engine.models import GPT, GPTConfig
from colossal_lab.engine.planner import measure


class Res(nn.Module):
    """x + w2(relu(w1(x))): autograd saves w1's input and relu's output (which w2 also saves)."""

    def __init__(self, d, h):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


def _toy(n=3, d=32, h=96):
    torch.manual_seed(0)
    return nn.Sequential(*[Res(d, h) for _ in range(n)])


def _grads_ready(model):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # as after a first step: the step's memory is activations only


def _peak(model, run):
    """Peak bytes one step allocates above what was live before it (the profiler's allocator events)."""
    run()  # warm-up
    with measure() as m:
        run()
    return m.peak["cpu"]


def _grads(model, run):
    for p in model.parameters():
        p.grad = None
    loss = run()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_profile_saved_bytes_match_a_hand_count():
    B, d, h = 8, 32, 96
    model = _toy(3, d, h)
    x = torch.randn(B, d, requires_grad=True)
    prof = profile_checkpointing(model, (x,), loss_fn=lambda out, inp: out.sum())
    assert [u.name for u in prof.units] == ["0", "1", "2"] and prof.parts == ()
    # profiling ran on aliases: no gradient reached the input or the parameters, nothing stays wrapped
    assert x.grad is None and all(p.grad is None for p in model.parameters())
    assert not any(hasattr(m, "_checkpoint_wrapped_module") for m in model)
    for u in prof.units:
        # w1 saves its input (B x d), relu its output (B x h), w2 the same relu output: one storage
        assert u.saved == 4 * B * (d + h)
        assert u.options["none"].saved == 4 * B * (d + h)
        assert u.options["layer"].saved == 0  # checkpointed: its saves are the checkpoint's, not autograd's
        # what stays live after its forward: its output and relu's output (w1's input was the
        # previous layer's output; w1's own output died in relu)
        assert u.options["none"].keep == 4 * B * (d + h)
        assert u.options["layer"].recompute_s > 0 and u.options["none"].recompute_s == 0


def test_gpt_profile_splits_saved_bytes_into_attention_and_mlp():
    cfg = GPTConfig.preset("tiny", n_layer=2)
    model = GPT(cfg)
    B, T, C, H = 2, 16, cfg.n_embd, cfg.hidden
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    prof = profile_checkpointing(model, (idx, idx))
    assert prof.parts == ("attn", "mlp") and [u.name for u in prof.units] == ["blocks.0", "blocks.1"]
    for u in prof.units:
        # SwiGLU MLP: w1 and w3 save their input, silu saves w1's output, the product saves silu's
        # and w3's outputs, w2 saves the product: input C + three hidden-wide tensors + the product
        assert u.parts["mlp"][0] == 4 * B * T * (C + 4 * H)
        assert u.saved > u.parts["attn"][0] + u.parts["mlp"][0]  # the norms save too
        assert u.options["mlp"].keep < u.options["none"].keep and u.options["layer"].keep < u.options["mlp"].keep
    # the per-option overhead is one figure pooled over the layers, measured, and not checkpointing
    # has none
    for o in prof.options:
        assert len({u.options[o].overhead_s for u in prof.units}) == 1
        assert all(u.options[o].cost_s >= 0 for u in prof.units)
    assert prof.units[0].options["none"].overhead_s == 0.0
    assert all(prof.units[0].options[o].overhead_s != 0.0 for o in ("layer", "attn", "mlp"))
    assert "overhead a region" in prof.table()


def _random_profile(rng, n, parts):
    opts = ("none", "layer") + parts
    # an overhead per option, pooled over the layers as the profile pools it; negative ones too
    # (a cost never goes below zero)
    overhead = {name: 0.0 if name == "none" else rng.uniform(-0.3, 0.3) for name in opts}
    units = []
    for i in range(n):
        o = {}
        for name in opts:
            keep = rng.randint(1, 100) * 1000
            o[name] = OptionCost(keep=keep, fwd_peak=keep + rng.randint(0, 50) * 1000,
                                 bwd_delta=-keep + rng.randint(-3, 3) * 100, bwd_peak=rng.randint(0, 80) * 1000,
                                 recompute_s=0.0 if name == "none" else rng.random(),
                                 saved=0, overhead_s=overhead[name])
        units.append(UnitProfile(name=str(i), index=i, options=o, forward_s=1.0, saved=0))
    return CheckpointProfile(units=units, parts=parts, prefix_keep=rng.randint(0, 20) * 1000, prefix_peak=20000,
                             prefix_bwd_peak=rng.randint(0, 20) * 1000, tail_keep=rng.randint(0, 50) * 1000,
                             tail_peak=rng.randint(0, 60) * 1000, tail_bwd_delta=rng.randint(-20, 0) * 1000,
                             tail_bwd_peak=rng.randint(0, 60) * 1000, device="cpu", inputs="synthetic")


def _brute_force(prof, budget):
    best = None
    for choice in itertools.product(prof.options, repeat=len(prof.units)):
        peak, t = prof.predict(choice)
        if peak <= budget and (best is None or t < best[0]):
            best = (t, choice)
    return best


def test_an_options_overhead_can_make_one_whole_layer_cheaper_than_two_parts():
    """Two layers; the budget forces recomputing about one layer's worth. On the recompute alone both
    MLPs (2 x 10 ms) beat one whole layer (25 ms); at 10 ms overhead an MLP region they cost
    2 x 20 ms, and the plan recomputes the whole layer instead."""
    def prof(mlp_overhead):
        units = []
        for i in range(2):
            # the peak is then the bytes kept: none 100 a layer, the whole layer 10, the MLP 45
            o = {"none": OptionCost(keep=100, fwd_peak=100, bwd_delta=-100, bwd_peak=0, recompute_s=0.0, saved=0),
                 "layer": OptionCost(keep=10, fwd_peak=10, bwd_delta=-10, bwd_peak=0, recompute_s=0.025, saved=0),
                 "mlp": OptionCost(keep=45, fwd_peak=45, bwd_delta=-45, bwd_peak=0, recompute_s=0.010, saved=0,
                                   overhead_s=mlp_overhead)}
            units.append(UnitProfile(name=str(i), index=i, options=o, forward_s=0.05, saved=0))
        return CheckpointProfile(units=units, parts=("mlp",), prefix_keep=0, prefix_peak=0, prefix_bwd_peak=0,
                                 tail_keep=0, tail_peak=0, tail_bwd_delta=0, tail_bwd_peak=0, device="cpu",
                                 inputs="synthetic")
    # the budget: both MLPs (45 + 45 kept) or one whole layer and one plain (10 + 100) fit; one MLP
    # alone (45 + 100) does not
    p0 = prof(0.0)
    budget = 110
    assert p0.predict(["mlp", "mlp"])[0] == 90 and p0.predict(["layer", "none"])[0] == 110
    assert p0.predict(["mlp", "none"])[0] > budget
    assert solve(p0, budget, report=False).choice == ("mlp", "mlp")
    plan = solve(prof(0.010), budget, report=False)
    assert sorted(plan.choice) == ["layer", "none"]
    assert plan.predicted_recompute_s == pytest.approx(0.025)
    assert prof(-1.0).units[0].options["mlp"].cost_s == 0.0  # a cost is never negative


def test_dynamic_program_equals_brute_force():
    rng = random.Random(0)
    checked = infeasible = 0
    for trial in range(40):
        prof = _random_profile(rng, n=rng.randint(1, 5), parts=("attn", "mlp") if trial % 2 else ())
        lo, _ = min_peak(prof)
        hi = prof.predict(["none"] * len(prof.units))[0]
        # the lowest peak is the least over every combination
        assert lo == min(prof.predict(c)[0] for c in itertools.product(prof.options, repeat=len(prof.units)))
        for budget in [lo - 1, lo, *(rng.randint(lo, max(lo, hi)) for _ in range(4)), hi, hi + 10**6]:
            want = _brute_force(prof, budget)
            if want is None:
                with pytest.raises(ValueError, match="below the lowest peak"):
                    solve(prof, budget)
                infeasible += 1
                continue
            plan = solve(prof, budget)
            assert plan.predicted_recompute_s == pytest.approx(want[0], abs=1e-12)
            assert plan.predicted_peak <= budget
            assert prof.predict(plan.choice) == (plan.predicted_peak, plan.predicted_recompute_s)
            checked += 1
    assert checked > 150 and infeasible > 10


def test_dynamic_program_coarsens_long_chains_safely(monkeypatch):
    rng = random.Random(1)
    prof = _random_profile(rng, n=5, parts=("attn", "mlp"))
    budget = (min_peak(prof)[0] + prof.predict(["none"] * 5)[0]) // 2
    exact = solve(prof, budget)
    monkeypatch.setattr(autockpt.solver, "MAX_STATES", 3)  # forces rounding kept bytes up to a grid
    coarse = solve(prof, budget)
    assert coarse.predicted_peak <= budget and coarse.predicted_recompute_s >= exact.predicted_recompute_s - 1e-12


@pytest.fixture(scope="module")
def gpt_case():
    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny", n_layer=4)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (4, 64))
    tgt = torch.randint(0, cfg.vocab_size, (4, 64))

    def run():
        logits, loss = model(idx, tgt)
        loss.backward()
        return loss

    model.enable_activation_checkpointing([])
    ref = _grads(model, run)
    _grads_ready(model)
    none_peak = _peak(model, run)
    model.enable_activation_checkpointing(None)
    full_peak = _peak(model, run)
    prof = profile_checkpointing(model, (idx, tgt))
    return model, run, ref, none_peak, full_peak, prof


def test_measured_peak_within_budget_and_same_loss_and_grads(gpt_case):
    model, run, (ref_loss, ref_grads), none_peak, full_peak, prof = gpt_case
    assert full_peak < none_peak
    # the lowest plan can mix: the last block's backward comes first, so checkpointing its MLP may do
    assert min_peak(prof)[0] <= full_peak
    seen = set()
    for frac in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0):
        budget = int(full_peak + frac * (none_peak - full_peak))
        plan = solve(prof, budget)
        assert apply(model, plan) is model and model.checkpoint_plan is plan and plan.predicted_peak <= budget
        _grads_ready(model)
        measured = _peak(model, run)
        assert measured <= budget, (frac, plan.layers, measured, budget)
        assert abs(measured - plan.predicted_peak) <= 0.02 * plan.predicted_peak, (plan.layers, measured)
        loss, grads = _grads(model, run)
        assert torch.equal(loss, ref_loss)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=0, atol=1e-6)
        seen.add(tuple(plan.layers))
    assert len(seen) >= 4  # the budgets really led to different plans
    assert plan.layers == []  # the no-checkpointing peak needs nothing recomputed
    # recompute falls as the budget grows
    times = [solve(prof, int(full_peak + f * (none_peak - full_peak))).predicted_recompute_s for f in (0, .3, .6, 1)]
    assert times == sorted(times, reverse=True) and times[-1] == 0.0


def test_sequential_user_model_is_planned_and_wrapped():
    model = _toy(4, 64, 256)
    x = torch.randn(32, 64, requires_grad=True)

    def run():
        loss = model(x).square().mean()
        loss.backward()
        return loss

    ref_loss, ref_grads = _grads(model, run)
    loss_fn = lambda out, inp: out.square().mean()  # noqa: E731
    prof = profile_checkpointing(model, (x,), loss_fn=loss_fn)
    hi = prof.predict(["none"] * 4)[0]
    budget = (min_peak(prof)[0] + hi) // 2
    plan = plan_checkpointing(model, (x,), budget, loss_fn=loss_fn)
    apply(model, plan)
    wrapped = [i for i, m in enumerate(model) if hasattr(m, "_checkpoint_wrapped_module")]
    assert wrapped == plan.layers and 0 < len(wrapped) < 4
    _grads_ready(model)
    assert _peak(model, run) <= budget
    loss, grads = _grads(model, run)
    assert torch.equal(loss, ref_loss)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-6)
    assert "CheckpointPlan" in repr(plan) and str(plan.layers) in repr(plan)


def test_gpt_config_auto_plans_on_the_first_training_forward(gpt_case):
    model, run, (ref_loss, ref_grads), none_peak, full_peak, _ = gpt_case
    budget = (full_peak + none_peak) // 2
    torch.manual_seed(0)
    auto = GPT(GPTConfig.preset("tiny", n_layer=4, activation_checkpointing="auto", activation_budget=budget))
    auto.load_state_dict(model.state_dict())
    idx = torch.randint(0, 256, (4, 64))
    logits, loss = auto.eval()(idx, idx)
    assert auto.checkpoint_plan is None  # eval: nothing planned
    auto.train()
    logits, loss = auto(idx, idx)
    plan = auto.checkpoint_plan
    assert plan is not None and plan.budget == budget and 0 < len(plan.layers) and plan.predicted_peak <= budget
    assert auto.cfg.activation_checkpointing == "auto" and all(p.grad is None for p in auto.parameters())
    loss.backward()
    # same numbers as the plain model on the same batch
    model.enable_activation_checkpointing([])
    _, want = model(idx, idx)
    assert torch.equal(loss.detach(), want.detach())
    _grads_ready(auto)

    def step():
        _, loss = auto(idx, idx)
        loss.backward()

    assert _peak(auto, step) <= budget
    assert auto.checkpoint_plan is plan  # one profile per input shape


def test_gpt_enable_activation_checkpointing_layers():
    m = GPT(GPTConfig.preset("tiny", n_layer=3))
    m.enable_activation_checkpointing([0, "2.mlp", "1.attn", "1.mlp"])
    assert m.checkpoint_layers == {0: {"layer"}, 2: {"mlp"}, 1: {"attn", "mlp"}}
    assert m.cfg.activation_checkpointing is True
    m.enable_activation_checkpointing()
    assert m.checkpoint_layers is None  # every block, as before
    for bad, msg in (([3], r"layer 3 is not a block index in \[0, 3\)"), (["1.foo"], "'1.foo' is not a block index"),
                     ([1, "1.mlp"], "block 1 is listed whole and in part"), ([True], "True is not a block index")):
        with pytest.raises(ValueError, match=msg):
            m.enable_activation_checkpointing(bad)
    with pytest.raises(TypeError, match="pass a list"):
        m.enable_activation_checkpointing(2)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"activation_checkpointing='auto'\) needs activation_budget=<bytes> > 0"):
        GPTConfig.preset("tiny", activation_checkpointing="auto")
    for b in (0, -5, True, "1GB"):
        with pytest.raises(ValueError, match=r"activation_budget=.* must be a number of bytes > 0"):
            GPTConfig.preset("tiny", activation_checkpointing="auto", activation_budget=b)
    with pytest.raises(ValueError, match=r"activation_checkpointing='yes' must be True, False or 'auto'"):
        GPTConfig.preset("tiny", activation_checkpointing="yes")
    assert GPTConfig.preset("tiny", activation_checkpointing=True).activation_checkpointing is True

    model = _toy(2)
    x = torch.randn(4, 32)
    for b in (0, -1, None, True):
        with pytest.raises(ValueError, match=r"budget=.* must be a number of bytes > 0"):
            plan_checkpointing(model, (x,), b)
    prof = profile_checkpointing(model, (x,))
    lo = min_peak(prof)[0]
    with pytest.raises(ValueError, match=rf"below the lowest peak .*: {lo} bytes .* Raise the budget"):
        solve(prof, lo - 1)
    with pytest.raises(TypeError, match="not a CheckpointPlan"):
        apply(model, [0])

    class NoLayersArg(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4)])

        def forward(self, x):
            return self.layers[0](x)

        def enable_activation_checkpointing(self):
            pass

    with pytest.raises(ValueError, match=r"enable_activation_checkpointing\(\) takes no `layers`"):
        plan_checkpointing(NoLayersArg(), (torch.randn(2, 4),), 1 << 20)
    with pytest.raises(ValueError, match="has no layers to checkpoint"):
        plan_checkpointing(nn.Linear(4, 4), (torch.randn(2, 4),), 1 << 20)


def _tp_train(rank, world, layers):
    from support.engine import lm_loss

    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_layer=4))
    model.enable_activation_checkpointing(layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plugin = HybridParallelPlugin(tp_size=2, sequence_parallel=True, pp_size=1, num_microbatches=1)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, opt)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (4, 16), generator=g)
    out = booster.execute_pipeline(iter([{"idx": x, "targets": torch.roll(x, -1, 1)}]), model, lm_loss, opt)
    opt.step()
    # "auto" where blocks hold collectives: the ranks merge their profiles (engine/autockpt_dist.py)
    # and solve the same one, so both recompute the same blocks (tests/engine/test_autockpt_dist.py has more)
    inner = next(m for m in model.modules() if isinstance(m, GPT))
    state = model.full_state_dict()
    inner.cfg.activation_checkpointing, inner.cfg.activation_budget = "auto", 1 << 30
    inner(x, x)
    return out["loss"].item(), state, list(map(str, inner.checkpoint_plan.layers))


def test_chosen_layers_run_under_tensor_and_sequence_parallelism():
    """Whole blocks and single parts recompute under a tensor-parallel plan's input hooks (5 inputs)."""
    import torch.nn.functional as F
    from support.dist import run_distributed

    layers = [0, "1.attn", "2.mlp"]
    torch.manual_seed(0)
    ref = GPT(GPTConfig.preset("tiny", n_layer=4))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (4, 16), generator=g)
    loss = F.cross_entropy(ref(x)[0].flatten(0, 1).float(), torch.roll(x, -1, 1).flatten())
    loss.backward()
    opt.step()
    results = run_distributed(_tp_train, 2, layers, timeout=240)
    assert results[0][2] == results[1][2]  # one plan on both ranks
    for got_loss, state, _ in results:
        assert abs(got_loss - loss.item()) < 1e-5
        for k, v in ref.state_dict().items():
            assert (state[k] - v).abs().max().item() < 2e-5, k


def test_eval_mode_is_refused():
    model = _toy(2).eval()
    with pytest.raises(ValueError, match=r"eval mode.*model.train\(\)"):
        profile_checkpointing(model, (torch.randn(4, 32),))
