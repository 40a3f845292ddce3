"""N-dimensional tensor parallelism (engine/tp_nd) through HybridParallelPlugin on real gloo ranks.

A tiny GPT trained 5 steps under 2D (4 ranks), and on 8 ranks 2.5D (q=2, d=2), 3D (q=2), 2D x dp=2
and 2D x pp=2, follows the one-process loss curve within 1e-4 relative and its gradients match per
parameter at every step; the bytes counted at the collective calls equal the textbook volume of
each scheme exactly (engine/tp_nd/volume.py) and every collective is one ``comm`` span inside an
F or B span, on the telemetry bus; a user model (biases, learned positions) does the same under 2D
and 3D; 2D with activation checkpointing and under bf16 train; 2D checkpoints load into a plain
GPT and into a 1D run (model and optimizer: its next steps' losses are the 2D run's), and the 1D
run's back into 2D; sizes that do not factor are rejected before any process group exists,
naming sizes that work. One process-group launch per world size (CI has 2 cores); the tests
below check its parts.
"""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from support.dist import run_distributed
from support.engine import lm_loss  # written for whole logits: the plugin gathers the vocab for it

STEPS = 5
BATCH, SEQ = 8, 16


def _cfg(**kw):
    from colossal_lab.engine.models import GPTConfig

    return GPTConfig(**{**dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64), **kw})


def _gpt():
    from colossal_lab.engine.models import GPT

    torch.manual_seed(0)
    return GPT(_cfg())


class Norm(torch.nn.Module):
    """An RMSNorm with no ``eps`` attribute: its role carries the eps."""

    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class UserLM(torch.nn.Module):
    """A model the engine has never seen, unlike the GPT: learned positions, biases on every
    linear (the head too), one norm used twice, bare logits out; it joins through tp_nd_plan."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(256, 32), torch.nn.Embedding(SEQ, 32)
        self.norm = Norm(32)
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
        self.out = torch.nn.Linear(32, 256)

    def forward(self, x):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        h = h + self.down(F.gelu(self.up(self.norm(h))))
        return self.out(self.norm(h))

    def tp_nd_plan(self):
        return {"tok": "embedding", "pos": "embedding", "norm": ("rmsnorm", 1e-5), "up": "colwise",
                "down": "rowwise", "out": "head"}


def _user():
    torch.manual_seed(0)
    return UserLM()


def _batch():
    x = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"idx": x, "targets": torch.roll(x, -1, 1)}


def _optim(model):
    # SGD with momentum: Adam would turn fp32 rounding in near-zero gradient elements into
    # lr-sized weight differences
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _reference(steps=STEPS, build=_gpt):
    model = build()
    opt = _optim(model)
    losses, grads = [], []
    b = _batch()
    for _ in range(steps):
        out = model(b["idx"])
        loss = lm_loss(out[0] if isinstance(out, tuple) else out, b)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads


# ---- on every rank ---------------------------------------------------------------------------------

def _train(cfg, criterion, steps=STEPS, after=None, build=_gpt):
    """Train ``steps`` steps; per step: the reported loss, the full gradients (on the first tp rank
    of the first dp replica of each stage), the bytes counted per kind, the collective calls."""
    from colossal_lab.engine import Booster, telemetry
    from colossal_lab.engine.plugins import HybridParallelPlugin
    from colossal_lab.engine.tp_nd import COUNTER

    cfg = dict(cfg)
    plugin = HybridParallelPlugin(**cfg)
    booster = Booster(plugin=plugin)
    model = build()
    model, opt, *_ = booster.boost(model, _optim(model), criterion)
    emitted = []
    unsub = telemetry.subscribe(emitted.append)
    b = _batch()
    if plugin.dp_size > 1:  # this data-parallel replica's rows
        rows = BATCH // plugin.dp_size
        b = {k: v[plugin.dp_rank * rows:(plugin.dp_rank + 1) * rows] for k, v in b.items()}
    keep = plugin.dp_rank == 0 and model.nd.grid.tp_rank == 0
    steps_out = []
    try:
        for _ in range(steps):
            COUNTER.reset()
            out = booster.execute_pipeline(iter([b]), model, criterion, opt)
            opt.step()  # gradients are synced (dp and batch-piece mean) inside, then kept until zero_grad
            grads = {n: model.nd.full(n, p.grad) if n in model.nd.params else p.grad.clone()
                     for n, p in model.named_model_parameters()}
            steps_out.append({"loss": None if out["loss"] is None else out["loss"].item(),
                              "grads": grads if keep else None, "bytes": COUNTER.snapshot(),
                              "calls": sum(COUNTER.calls.values())})
            opt.zero_grad()
    finally:
        unsub()
    res = {"steps": steps_out, "spans": list(model.runtime.recorder.spans), "dp": plugin.dp_rank,
           "emitted": [e for e in emitted if isinstance(e, telemetry.StageSpan)],
           "stage": plugin.mesh["pp"].get_local_rank(), "tp_rank": model.nd.grid.tp_rank}
    if after is not None:
        res.update(after(booster, model, opt, b, criterion))
    return res


def _checkpoint_round_trip(ckpt_dir):
    """After the 2D run: save model and optimizer, take two more steps; then a 1D run (tp=4) loads
    both checkpoints and its two steps have the 2D run's losses (the second needs the momentum)."""
    def after(booster, model, opt, b, criterion):
        booster.save_model(model, os.path.join(ckpt_dir, "model"))
        booster.save_optimizer(opt, os.path.join(ckpt_dir, "optim"))
        state = model.full_state_dict()
        more = []
        for _ in range(2):
            more.append(booster.execute_pipeline(iter([b]), model, criterion, opt)["loss"].item())
            opt.step()
            opt.zero_grad()
        # the 1D run, from a differently seeded model: everything must come from the checkpoint
        from colossal_lab.engine import Booster
        from colossal_lab.engine.models import GPT
        from colossal_lab.engine.plugins import HybridParallelPlugin

        torch.manual_seed(123)
        plain = GPT(_cfg())
        booster1 = Booster(plugin=HybridParallelPlugin(tp_size=4))
        m1, o1, *_ = booster1.boost(plain, _optim(plain))
        booster1.load_model(m1, os.path.join(ckpt_dir, "model"))
        booster1.load_optimizer(o1, os.path.join(ckpt_dir, "optim"))
        loaded = m1.full_state_dict()
        more_1d = []
        for i in range(3):
            if i == 2:  # and back: a 2D run resumes from the 1D run's checkpoints
                booster1.save_model(m1, os.path.join(ckpt_dir, "model_1d"))
                booster1.save_optimizer(o1, os.path.join(ckpt_dir, "optim_1d"))
            more_1d.append(booster1.execute_pipeline(iter([_batch()]), m1, lm_loss, o1)["loss"].item())
            o1.step()
            o1.zero_grad()
        booster2 = Booster(plugin=HybridParallelPlugin(tp_size=4, tp_mode="2d"))
        torch.manual_seed(321)
        m2 = GPT(_cfg())
        m2, o2, *_ = booster2.boost(m2, _optim(m2))
        booster2.load_model(m2, os.path.join(ckpt_dir, "model_1d"))
        booster2.load_optimizer(o2, os.path.join(ckpt_dir, "optim_1d"))
        back = booster2.execute_pipeline(iter([_batch()]), m2, criterion, o2)["loss"].item()
        return {"state": state, "next_losses": more, "loaded_1d": loaded, "next_losses_1d": more_1d[:2],
                "third_loss_1d": more_1d[2], "back_in_2d": back}
    return after


def _four(rank, world, ckpt_dir):
    from colossal_lab.engine.tp_nd import CrossEntropy

    return {"2d": _train(dict(tp_size=4, tp_mode="2d"), CrossEntropy(), after=_checkpoint_round_trip(ckpt_dir)),
            "user_2d": _train(dict(tp_size=4, tp_mode="2d"), CrossEntropy(), steps=3, build=_user),
            "2d_ac": _train(dict(tp_size=4, tp_mode="2d", activation_checkpointing=True), CrossEntropy(), steps=3),
            "2d_bf16": _train(dict(tp_size=4, tp_mode="2d", precision="bf16"), CrossEntropy(), steps=3)}


EIGHT = {
    "2.5d": (dict(tp_size=8, tp_mode="2.5d", tp_depth=2), "vocab_parallel"),
    "3d": (dict(tp_size=8, tp_mode="3d"), "whole"),
    "2d_dp2": (dict(tp_size=4, tp_mode="2d"), "vocab_parallel"),
    "2d_pp2": (dict(tp_size=4, tp_mode="2d", pp_size=2, num_microbatches=2), "whole"),
    "3d_vp": (dict(tp_size=8, tp_mode="3d"), "vocab_parallel"),
}


def _eight(rank, world):
    from colossal_lab.engine.tp_nd import CrossEntropy

    out = {}
    for name, (cfg, loss) in EIGHT.items():
        steps = STEPS if name != "3d_vp" else 1
        out[name] = _train(cfg, CrossEntropy() if loss == "vocab_parallel" else lm_loss, steps=steps)
    out["user_3d"] = _train(dict(tp_size=8, tp_mode="3d"), CrossEntropy(), steps=3, build=_user)
    # a batch that does not cut into 3D's q**2 = 4 pieces: one clear error on every rank
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    booster = Booster(plugin=HybridParallelPlugin(tp_size=8, tp_mode="3d"))
    model, opt, *_ = booster.boost(_gpt(), None)
    b = {k: v[:6] for k, v in _batch().items()}
    try:
        booster.execute_pipeline(iter([b]), model, lm_loss, opt)
        out["bad_batch"] = None
    except ValueError as e:
        out["bad_batch"] = str(e)
    try:
        model(b["idx"])
        out["direct_call"] = None
    except ValueError as e:
        out["direct_call"] = str(e)
    # the plain loop's call on the whole batch: the loss of the batch, as execute_pipeline reports it
    full = _batch()
    out["direct_loss"] = model(full["idx"], full["targets"])[1].item()
    out["pipeline_loss"] = booster.execute_pipeline(iter([full]), model, lm_loss, None)["loss"].item()
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tp_nd_ckpt"))
    return run_distributed(_four, 4, d, timeout=300), d


@pytest.fixture(scope="module")
def eight():
    return run_distributed(_eight, 8, timeout=400)


@pytest.fixture(scope="module")
def reference():
    return _reference()


# ---- checks ----------------------------------------------------------------------------------------

def _check_curve(results, ref, label, steps=STEPS):
    ref_losses, ref_grads = ref
    assert ref_losses[-1] < 0.99 * ref_losses[0], ref_losses  # it trains
    for s in range(steps):
        by_dp = {}
        for r in results:
            if r["steps"][s]["loss"] is not None:
                by_dp.setdefault(r["dp"], []).append(r["steps"][s]["loss"])
        assert by_dp, f"{label}: no rank reported a loss at step {s}"
        for losses in by_dp.values():  # every rank of a replica's last stage reports the same mean
            assert max(losses) - min(losses) <= 1e-6 * abs(losses[0]), (label, s, losses)
        got = sum(v[0] for v in by_dp.values()) / len(by_dp)  # dp replicas: equal halves of the batch
        want = ref_losses[s]
        assert abs(got - want) <= 1e-4 * abs(want), f"{label} step {s}: loss {got} vs one process {want}"
        grads = {}
        for r in results:
            if r["steps"][s]["grads"] is not None:
                grads.update(r["steps"][s]["grads"])  # each stage's first tp rank: its parameters
        assert grads.keys() == ref_grads[s].keys(), label
        for n, w in ref_grads[s].items():  # measured: below 2e-6 of each parameter's max
            scale = w.abs().max().item()
            err = (grads[n] - w).abs().max().item()
            assert err <= 1e-5 * scale, f"{label} step {s}: gradient {n} off by {err} (max {scale})"


def test_2d_four_ranks_follows_one_process(four, reference):
    results, _ = four
    _check_curve([r["2d"] for r in results], reference, "2d")


@pytest.mark.parametrize("name", ["2.5d", "3d", "2d_dp2", "2d_pp2"])
def test_eight_ranks_follow_one_process(eight, reference, name):
    _check_curve([r[name] for r in eight], reference, name)


def test_2d_with_activation_checkpointing_and_bf16(four, reference):
    """Recomputed blocks rerun their collectives in backward (same curve, more bytes); bf16
    autocast moves the linears' blocks in bf16 (half the bytes) and trains like fp32."""
    results = four[0]
    _check_curve([r["2d_ac"] for r in results], (reference[0][:3], reference[1][:3]), "2d ac", steps=3)
    for r in results:
        plain, ac, bf = (r[k]["steps"][0]["bytes"] for k in ("2d", "2d_ac", "2d_bf16"))
        assert ac["summa.bcast_x"] > plain["summa.bcast_x"]  # the forward ran twice
        assert bf["summa.bcast_w"] == plain["summa.bcast_w"] / 2
        losses = [s["loss"] for s in r["2d_bf16"]["steps"]]
        for got, want in zip(losses, reference[0]):
            assert abs(got - want) <= 1e-2 * want, (losses, reference[0][:3])
        assert losses[-1] < losses[0] - 0.2


def test_a_user_model_follows_one_process_under_2d_and_3d(four, eight):
    """Biases (gathered pieces), learned positions and a norm whose eps comes with its role."""
    ref = _reference(3, _user)
    _check_curve([r["user_2d"] for r in four[0]], ref, "user 2d", steps=3)
    _check_curve([r["user_3d"] for r in eight], ref, "user 3d", steps=3)


def _textbook(name):
    from colossal_lab.engine.tp_nd import textbook

    if name in ("2d", "user_2d", "user_3d"):
        cfg, loss = dict(tp_size=8 if name == "user_3d" else 4, tp_mode=name[-2:]), "vocab_parallel"
    else:
        cfg, loss = EIGHT[name]
    dp = 8 // (cfg["tp_size"] * cfg.get("pp_size", 1)) if name not in ("2d", "user_2d") else 1
    model = _user() if name.startswith("user") else _gpt()
    return textbook(model, cfg["tp_mode"], cfg["tp_size"], tokens=BATCH * SEQ // dp, depth=cfg.get("tp_depth", 1),
                    microbatches=cfg.get("num_microbatches", 1), vocab_parallel_loss=loss == "vocab_parallel",
                    calls={"norm": 2} if name.startswith("user") else None)


@pytest.mark.parametrize("name", ["2d", "2.5d", "3d", "3d_vp", "2d_dp2", "user_2d", "user_3d"])
def test_bytes_equal_the_textbook_volume(four, eight, name):
    """Counted at the collective calls, per rank and step: exactly the scheme's formula."""
    from colossal_lab.engine.tp_nd import by_part

    results = [r[name] for r in four[0]] if name in ("2d", "user_2d") else [r[name] for r in eight]
    want = {k: v for k, v in _textbook(name).items() if v}
    for r in results:
        for step in r["steps"]:
            got = {k: v for k, v in by_part(step["bytes"]).items() if v}
            assert got.keys() == want.keys(), (name, got, want)
            for k in want:
                assert math.isclose(got[k], want[k], rel_tol=1e-9), (name, k, got[k], want[k])


def test_pipeline_bytes_equal_the_textbook_volume_per_stage(eight):
    """2D x pp=2: the two stages together send the whole model's formula, at m=2 microbatches.
    Step 1: at step 0 torch's PipelineStage also runs one real forward per stage (and the last
    stage a backward) to infer the shapes it sends, which communicates once more."""
    from colossal_lab.engine.tp_nd import by_part, textbook

    full = textbook(_gpt(), "2d", 4, tokens=BATCH * SEQ, microbatches=2, vocab_parallel_loss=False)
    total = {}
    for r in eight:
        res = r["2d_pp2"]
        if res["tp_rank"] == 0:
            for k, v in by_part(res["steps"][1]["bytes"]).items():
                total[k] = total.get(k, 0) + v
    assert total.keys() == {k for k, v in full.items() if v}
    for k in total:
        assert math.isclose(total[k], full[k], rel_tol=1e-9), (k, total[k], full[k])


def test_every_collective_is_a_comm_span_inside_its_f_or_b(four, eight):
    for res, pp in [(r["2d"], False) for r in four[0]] + [(r["2d_pp2"], True) for r in eight]:
        spans = res["spans"]
        for step, info in enumerate(res["steps"]):
            mine = [s for s in spans if s.step == step]
            comm = [s for s in mine if s.kind == "comm"]
            assert len(comm) == info["calls"] > 0, (step, len(comm), info["calls"])
            if pp and step == 0:
                continue  # torch's shape inference runs (and communicates) before the first F
            outer = [s for s in mine if s.kind in ("F", "B")]
            for c in comm:
                assert any(o.start <= c.start and c.end <= o.end for o in outer), c
        key = lambda s: (s.step, s.kind, s.microbatch, s.start, s.end)  # noqa: E731
        assert sorted(map(key, res["emitted"])) == sorted(map(key, spans))  # all on the bus, final ends


def test_2d_checkpoints_load_into_a_plain_model_and_a_1d_run_and_back(four):
    from colossal_lab.engine.checkpoint_io import load_state_dict_shards
    from colossal_lab.engine.models import GPT

    results, d = four
    state = results[0]["2d"]["state"]
    plain = GPT(_cfg())
    plain.load_state_dict(load_state_dict_shards(os.path.join(d, "model")), strict=True)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, state[k]), k
    for r in results:
        assert all(torch.equal(r["2d"]["loaded_1d"][k], state[k]) for k in state)
        # the 1D run's next steps (model and SGD momentum from the 2D checkpoints) equal the 2D run's
        for got, want in zip(r["2d"]["next_losses_1d"], results[0]["2d"]["next_losses"]):
            assert abs(got - want) <= 1e-5 * want, (r["2d"]["next_losses_1d"], results[0]["2d"]["next_losses"])
        # and a 2D run loads the 1D run's checkpoints: its step equals the 1D run's next one
        assert abs(r["2d"]["back_in_2d"] - r["2d"]["third_loss_1d"]) <= 1e-5 * r["2d"]["third_loss_1d"]
    first, second = results[0]["2d"]["next_losses"]
    assert second < first  # the second step moved (with momentum), so the check above can fail


def test_bad_batch_rejected_and_the_direct_call_reports_the_batch_loss(eight):
    for r in eight:
        assert "batch['idx'] has 6 rows" in r["bad_batch"] and "multiple of 4" in r["bad_batch"], r["bad_batch"]
        assert "argument 0 has 6 rows" in r["direct_call"] and "multiple of 4" in r["direct_call"], r["direct_call"]
        assert abs(r["direct_loss"] - r["pipeline_loss"]) <= 1e-6 * r["pipeline_loss"], r


# ---- one process: errors before any process group --------------------------------------------------

def test_sizes_that_do_not_factor_are_rejected_naming_sizes_that_work(monkeypatch):
    import torch.distributed as dist

    from colossal_lab.engine.models import GPT
    from colossal_lab.engine.plugins import HybridParallelPlugin

    monkeypatch.setenv("WORLD_SIZE", "16")
    cases = [
        (dict(tp_size=8, tp_mode="2d"), r"tp_size must be a square q\*\*2; use tp_size in \[1, 4, 9, 16, 25\]"),
        (dict(tp_size=4, tp_mode="3d"), r"tp_size must be a cube q\*\*3; use tp_size in \[1, 8, 27, 64\]"),
        (dict(tp_size=8, tp_mode="2.5d", tp_depth=4),
         r"with tp_depth=4 use tp_size in \[4, 16, 36, 64\], or with tp_size=8 use tp_depth in \[2, 8\]"),
        (dict(tp_size=4, tp_mode="2d", tp_depth=2), r"tp_depth is 2.5D's d; use tp_mode='2.5d'"),
        (dict(tp_size=4, tp_mode="4d"), r"tp_mode='4d'.*choose one of"),
        (dict(tp_size=4, tp_mode="2d", sequence_parallel=True), r"sequence parallelism is 1D's"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            HybridParallelPlugin(**kw)

    def configure(model, **kw):
        return HybridParallelPlugin(**kw).configure(model, None, None, None, None, "fp32")

    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"tok_emb.weight has size 36 in dimension 1, which must be cut into 8 "
                                         r"equal blocks.*multiple of 8"):
        configure(GPT(_cfg(n_embd=36, n_head=2)), tp_size=8, tp_mode="3d")
    with pytest.raises(ValueError, match=r"n_head=3 is not divisible by the 2 ranks"):
        configure(GPT(_cfg(n_embd=96, n_head=3)), tp_size=4, tp_mode="2d")
    with pytest.raises(ValueError, match=r"one tied parameter.*tp_mode='1d'"):
        configure(GPT(_cfg(tie_embeddings=True)), tp_size=4, tp_mode="2d")

    class Plain(torch.nn.Module):  # no tp_nd_plan, a norm without a role
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.norm = torch.nn.LayerNorm(8)

    with pytest.raises(ValueError, match=r"neither tp_nd_plan\(\) nor tp_plan\(\)"):
        configure(Plain(), tp_size=4, tp_mode="2d")
    Plain.tp_plan = lambda self: {}
    with pytest.raises(ValueError, match=r"no role for parameters \['norm.weight', 'norm.bias'\]"):
        configure(Plain(), tp_size=4, tp_mode="2d")
    assert not dist.is_initialized()  # every error came before any process group


def test_grid_blocks_round_trip_single_process():
    """Block layouts: every rank's blocks of a tensor tile it exactly once (no group needed)."""
    from colossal_lab.engine.tp_nd import apply, grid

    for mode, tp, d in (("2d", 4, 1), ("2.5d", 8, 2), ("3d", 8, 1)):
        sizes = grid.factor(mode, tp, d)
        g = grid.Grid.__new__(grid.Grid)  # coordinates only: no process groups
        g.mode, g.axes, g.sizes = mode, grid.AXES[mode], {a: sizes[a] for a in grid.AXES[mode]}
        for role in apply.ROLES:
            for spec in apply.specs(role, mode).values():
                shape = tuple(16 for _ in spec)
                full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
                seen = torch.zeros(shape)
                for t in range(tp):
                    g.coords = g.coords_of(t)
                    blk = g.block(full, spec)
                    assert blk.numel() * tp == full.numel(), (mode, role, spec)  # one owner per element
                    sl = g.block(seen, spec)
                    sl += 1
                assert torch.equal(seen, torch.ones(shape)), (mode, role, spec)
