"""HybridParallelPlugin on real gloo processes.

Every schedule, tp, sp, dp x pp and tied embeddings train exactly like one process; measured
timelines are well-formed. One multi-process run checks several configurations in a row (CI has 2
cores); each configuration trains two steps from the same seed as a single-process reference and
compares the losses and the post-step weights (gathered under the plain model's names).

Features beyond the schedules: one 2-rank run checks, in a row, ZeRO-1 over dp=2,
``microbatch_size``, activation checkpointing (same weights, blocks really recomputed), a user
``nn.Sequential`` split over pp=2 (with and without checkpointing), a user ``tp_plan`` on a non-GPT
MLP, bf16/fp16 training under pp=2 with an fp16 overflow on ONE rank skipped by all, and checkpoints:
``save_model`` from pp=2 loads into a plain GPT and into tp=2; ``save_optimizer``/``load_optimizer``
resume the same loss curve in the same layout and in another one (pp=2 -> tp=2). One 4-rank run
checks ZeRO-1 under pp=2 x dp=2 and checkpoints from pp=2 x tp=2 (model into a plain GPT, optimizer
into pp=2 x dp=2 with ZeRO-1). Bad arguments fail before any process group exists.
"""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support.dist import run_distributed
from support.engine import lm_loss

M = 4          # microbatches
BATCH = 8
SEQ = 16


def _gpt_data(steps=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, 256, (BATCH, SEQ), generator=g)
        out.append({"idx": x, "targets": torch.roll(x, -1, 1)})
    return out


def _gpt(tie=False):
    from colossal_lab.engine.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", n_layer=4, tie_embeddings=tie))


def _reference(tie):
    model = _gpt(tie)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for b in _gpt_data():
        loss = lm_loss(model(b["idx"])[0], b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _train(rank, world, configs):
    """Train each config for two steps through Booster; return what the parent checks."""
    from colossal_lab.engine import Booster, telemetry
    from colossal_lab.engine.plugins import HybridParallelPlugin

    results = []
    for cfg in configs:
        cfg = dict(cfg)
        tie = cfg.pop("tie", False)
        dp_rows = cfg.pop("dp_rows", None)
        model = _gpt(tie)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        plugin = HybridParallelPlugin(num_microbatches=cfg.pop("m", M), **cfg)
        booster = Booster(plugin=plugin)
        emitted = []
        unsub = telemetry.subscribe(emitted.append)
        model, opt, *_ = booster.boost(model, opt, lm_loss)
        data = _gpt_data()
        if dp_rows:  # this data-parallel rank's half of each batch
            d, n = plugin.dp_rank, plugin.dp_size
            rows = BATCH // n
            data = [{k: v[d * rows:(d + 1) * rows] for k, v in b.items()} for b in data]
        it = iter(data)
        losses, bubbles = [], []
        for _ in range(2):
            out = booster.execute_pipeline(it, model, lm_loss, opt)
            opt.step()
            opt.zero_grad()
            losses.append(None if out["loss"] is None else out["loss"].item())
            bubbles.append(out["bubble"])
        unsub()
        spans = list(model.runtime.recorder.spans)
        results.append({
            "losses": losses, "bubbles": bubbles, "state": model.full_state_dict(), "spans": spans,
            "emitted": [e for e in emitted if isinstance(e, telemetry.StageSpan)],
            "stage_ids": plugin._model.runtime.spec.stage_indices(plugin.mesh["pp"].get_local_rank()),
            "dp": plugin.dp_rank,
        })
    return results


def _check_matches(results, tie, label, tol=2e-5):
    ref_losses, ref_state = _reference(tie)
    for rank, res in enumerate(results):
        for k, v in ref_state.items():
            err = (res["state"][k] - v).abs().max().item()
            assert err < tol, f"{label}: rank {rank} weight {k} differs from one-process training by {err}"
        if label.startswith("dp"):
            continue  # a dp rank's loss is its half-batch loss; the weights above are the check
        for got, want in zip(res["losses"], ref_losses):
            if got is not None:
                assert abs(got - want) < 1e-4 * max(1, abs(want)), (label, got, want)
    assert any(r["losses"][0] is not None for r in results), f"{label}: no rank reported the loss"


def _check_timeline(res, style, chunks, label):
    from colossal_lab.engine.telemetry import to_chrome_trace

    spans = res["spans"]
    # every span went out on the telemetry bus as it closed (an F is emitted before the loss
    # stretches it, so compare kinds and microbatches, not end times)
    key = lambda s: (s.step, s.kind, s.microbatch, s.start)  # noqa: E731
    assert sorted(map(key, res["emitted"])) == sorted(map(key, spans)), label
    trace = to_chrome_trace(spans)
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == len(spans), label
    for step in (0, 1):
        ss = sorted((s for s in spans if s.step == step), key=lambda s: s.start)
        for a, b in zip(ss, ss[1:]):  # one rank's actions never overlap
            assert b.start >= a.end - 1e-6, f"{label}: overlapping spans {a} / {b}"
        kinds = [s.kind for s in ss]
        n = M * chunks
        assert kinds.count("F") == n and kinds.count("B") == n, f"{label}: {kinds}"
        assert kinds.count("W") == (n if style in ("zb", "zbv") else 0), f"{label}: {kinds}"
        assert kinds.count("optim") == 1, f"{label}: {kinds}"
        for frac in res["bubbles"][step].values():
            assert 0.0 < frac < 1.0, f"{label}: bubble {frac}"


def ideal_bubble(orders, stage_ids, chunks):
    """Bubble fraction of a pipeline replayed in *unit time* from the measured action order.

    Wall times on a shared 2-core CI box are noise, the order is not: each rank's measured
    sequence of F/B/W actions is replayed with F = 1, B = 2 (full backward) or B = W = 1
    (split backward), all divided by ``chunks`` (a chunk holds 1/chunks of the rank's layers),
    with the pipeline dependencies (F needs the previous stage's F, B the next stage's B,
    W its own B). The k-th F of a microbatch on a rank is its k-th chunk; backward runs the
    chunks in reverse. Returns the mean over ranks of 1 - busy / makespan.
    """
    split = any(k == "W" for order in orders for k, _ in order)
    cost = {"F": 1.0, "B": 1.0 if split else 2.0, "W": 1.0}
    acts = []  # per rank: [(kind, stage, mb)]
    for rank, order in enumerate(orders):
        seen, seq = {}, []
        for kind, mb in order:
            k = seen.get((kind, mb), 0)
            seen[(kind, mb)] = k + 1
            chunk = k if kind == "F" else chunks - 1 - k
            seq.append((kind, stage_ids[rank][chunk], mb))
        acts.append(seq)
    num_stages = max(max(s) for s in stage_ids) + 1
    done, free, pos = {}, [0.0] * len(acts), [0] * len(acts)
    busy = [0.0] * len(acts)
    while any(p < len(a) for p, a in zip(pos, acts)):
        progressed = False
        for r, seq in enumerate(acts):
            if pos[r] == len(seq):
                continue
            kind, s, mb = seq[pos[r]]
            if kind == "F":
                deps = [("F", s - 1, mb)] if s > 0 else []
            elif kind == "B":
                deps = [("B", s + 1, mb)] if s < num_stages - 1 else [("F", s, mb)]
            else:
                deps = [("B", s, mb)]
            if not all(d in done for d in deps):
                continue
            start = max([free[r]] + [done[d] for d in deps])
            dur = cost[kind] / chunks
            done[(kind, s, mb)] = free[r] = start + dur
            busy[r] += dur
            pos[r] += 1
            progressed = True
        assert progressed, "measured order deadlocks under its own dependencies"
    makespan = max(free)
    return sum(1 - b / makespan for b in busy) / len(busy)


SCHEDULES = [
    dict(pp_size=2, pp_style="gpipe"),
    dict(pp_size=2, pp_style="1f1b", tie=True),
    dict(pp_size=2, pp_style="interleaved", num_model_chunks=2),
    dict(pp_size=2, pp_style="zb", num_model_chunks=2, tie=True),
    dict(pp_size=2, pp_style="zbv", num_model_chunks=2, tie=True),
]


def test_pipeline_schedules_match_one_process_and_time_every_action():
    per_rank = run_distributed(_train, 2, SCHEDULES, timeout=400)
    ideal = {}
    for i, cfg in enumerate(SCHEDULES):
        style, chunks, label = cfg["pp_style"], cfg.get("num_model_chunks", 1), cfg["pp_style"]
        results = [per_rank[r][i] for r in range(2)]
        _check_matches(results, cfg.get("tie", False), label)
        for res in results:
            _check_timeline(res, style, chunks, label)
        orders = [[(s.kind, s.microbatch) for s in sorted(res["spans"], key=lambda s: s.start)
                   if s.step == 1 and s.kind in ("F", "B", "W")] for res in results]
        ideal[style] = ideal_bubble(orders, [res["stage_ids"] for res in results], chunks)
    # the textbook figure for GPipe/1F1B at p=2, m=4: (p-1)/(m+p-1) = 0.2
    assert abs(ideal["gpipe"] - 0.2) < 1e-9 and abs(ideal["1f1b"] - 0.2) < 1e-9, ideal
    assert ideal["interleaved"] < ideal["1f1b"], ideal
    assert ideal["zb"] < ideal["1f1b"] and ideal["zbv"] < ideal["1f1b"], ideal
    assert all(0 <= v < 1 for v in ideal.values()), ideal


def test_tensor_parallel_and_sequence_parallel_match_one_process():
    configs = [dict(tp_size=2), dict(tp_size=2, sequence_parallel=True, tie=True)]
    per_rank = run_distributed(_train, 2, configs, timeout=300)
    for i, cfg in enumerate(configs):
        _check_matches([per_rank[r][i] for r in range(2)], cfg.get("tie", False), f"tp {cfg}")


def test_pipeline_times_data_parallel_on_four_ranks():
    """pp=2 x dp=2: each dp rank trains on its half of the batch; after the dp all-reduce the
    weights equal one process trained on the whole batch (and so do pp=2 x tp=2 with sp)."""
    configs = [dict(pp_size=2, pp_style="1f1b", m=2, dp_rows=True, tie=True),
               dict(pp_size=2, tp_size=2, pp_style="gpipe", sequence_parallel=True)]
    per_rank = run_distributed(_train, 4, configs, timeout=400)
    _check_matches([per_rank[r][0] for r in range(4)], True, "dp x pp")
    assert sorted({per_rank[r][0]["dp"] for r in range(4)}) == [0, 1]
    _check_matches([per_rank[r][1] for r in range(4)], False, "pp x tp")


@pytest.mark.parametrize("kwargs, match", [
    (dict(pp_style="pipedream"), r"pp_style='pipedream'.*gpipe"),
    (dict(pp_size=2, num_microbatches=1, pp_style="1f1b"), r"num_microbatches=1.*1F1B.*num_microbatches >= pp_size=2"),
    (dict(pp_size=2, num_microbatches=4, pp_style="zbv"), r"num_model_chunks=1.*num_model_chunks=2"),
    (dict(pp_size=2), r"set num_microbatches"),
    (dict(zero_stage=3), r"zero_stage=3"),
    (dict(precision="int4"), r"precision='int4'"),
    (dict(sequence_parallel=True), r"sequence_parallel=True.*tp_size"),
    (dict(pp_size=2, num_microbatches=5, pp_style="interleaved", num_model_chunks=2), r"num_microbatches=5"),
])
def test_bad_arguments_fail_in_init(kwargs, match):
    from colossal_lab.engine.plugins import HybridParallelPlugin

    with pytest.raises(ValueError, match=match):
        HybridParallelPlugin(**kwargs)


def test_sizes_not_dividing_world_fail_before_any_group(monkeypatch):
    import torch.distributed as dist

    from colossal_lab.engine.plugins import HybridParallelPlugin

    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ValueError, match=r"tp_size=4, pp_size=1.*divide the world size 6"):
        HybridParallelPlugin(tp_size=4)


def test_layers_not_divisible_fail_before_any_group():
    import torch.distributed as dist

    from colossal_lab.engine.models import GPT, GPTConfig
    from colossal_lab.engine.plugins import HybridParallelPlugin

    model = GPT(GPTConfig.preset("tiny", n_layer=3))
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=2)
    with pytest.raises(ValueError, match=r"3 layers.*pp_size \* num_model_chunks in \[1, 3\]"):
        plugin.configure(model, None, None, None, None, "fp32")
    assert not dist.is_initialized()  # rejected before any process group existed


def test_ideal_bubble_replay_matches_textbook_gpipe():
    """The replay helper itself: GPipe p=2, m=4 in unit time has bubble 1/5 (a wrong dependency
    rule or cost would move it)."""
    orders = [[("F", i) for i in range(4)] + [("B", i) for i in range(4)]] * 2
    assert abs(ideal_bubble(orders, [[0], [1]], 1) - 0.2) < 1e-9


# ---------------------------------------------------------------- features beyond the schedules
def mse(out, batch):
    return F.mse_loss(out.float(), batch["y"])


def _mlp_data(steps):
    g = torch.Generator().manual_seed(2)
    return [{"idx": torch.randn(BATCH, 8, generator=g), "y": torch.randn(BATCH, 8, generator=g)}
            for _ in range(steps)]


def _seq():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8), nn.Identity())


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))


def _sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.1)


def _adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


MODELS = {"gpt": (_gpt, lm_loss, _gpt_data), "gpt_tied": (lambda: _gpt(True), lm_loss, _gpt_data),
          "seq": (_seq, mse, _mlp_data), "mlp": (_mlp, mse, _mlp_data)}
OPTS = {"sgd": _sgd, "adamw": _adamw}


def _plain_reference(model, opt, steps):
    make, loss_fn, data = MODELS[model]
    m = make()
    o = OPTS[opt](m)
    losses = []
    for b in data(steps):
        out = m(b["idx"])
        loss = loss_fn(out[0] if isinstance(out, tuple) else out, b)
        loss.backward()
        o.step()
        o.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in m.state_dict().items()}


def _boost(model, opt, **kw):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    make, loss_fn, _ = MODELS[model]
    m = make()
    plugin = HybridParallelPlugin(**kw)
    booster = Booster(plugin=plugin)
    m, o, *_ = booster.boost(m, OPTS[opt](m), loss_fn)
    return booster, plugin, m, o, loss_fn


def _steps(booster, plugin, m, o, loss_fn, batches, dp_rows=False):
    losses = []
    for b in batches:
        if dp_rows:  # this data-parallel rank's share of the batch
            rows = BATCH // plugin.dp_size
            b = {k: v[plugin.dp_rank * rows:(plugin.dp_rank + 1) * rows] for k, v in b.items()}
        out = booster.execute_pipeline(iter([b]), m, loss_fn, o)
        o.step()
        o.zero_grad()
        losses.append(None if out["loss"] is None else out["loss"].item())
    return losses


def _train_one(model, opt, steps=2, dp_rows=False, **kw):
    booster, plugin, m, o, loss_fn = _boost(model, opt, **kw)
    losses = _steps(booster, plugin, m, o, loss_fn, MODELS[model][2](steps), dp_rows)
    return {"losses": losses, "state": m.full_state_dict(), "plugin": plugin, "model": m, "opt": o}


def _parity(res, model, opt, steps=2):
    return {"label": f"{model}/{opt}", "losses": res["losses"], "state": res["state"],
            "model": model, "opt": opt, "steps": steps}


def _fp_training(precision):
    """pp=2, loss must fall over 8 AdamW steps on one repeated batch."""
    from colossal_lab.engine.plugins.hybrid_parallel import _local

    booster, plugin, m, o, loss_fn = _boost("gpt", "adamw", pp_size=2, num_microbatches=2,
                                            pp_style="1f1b", precision=precision)
    batch = _gpt_data(1)[0]
    losses = _steps(booster, plugin, m, o, loss_fn, [batch] * 8)
    out = {"losses": losses}
    if precision == "fp16":
        # overflow on ONE rank only: every rank must skip the step and halve its scale
        before = {n: _local(p).detach().clone() for n, p in m.named_model_parameters()}
        scale = plugin._scaler.scale
        booster.execute_pipeline(iter([batch]), m, loss_fn, o)
        if torch.distributed.get_rank() == 1:
            next(p for _, p in m.named_model_parameters()).grad.view(-1)[0] = float("inf")
        stepped = o.step()
        o.zero_grad()
        out["skip"] = {"stepped": stepped is not None, "scale_ratio": plugin._scaler.scale / scale,
                       "unchanged": all(torch.equal(before[n], _local(p)) for n, p in m.named_model_parameters())}
    return out


def _worker2(rank, world, ckpt_dir):
    from colossal_lab.engine.models import GPT  # noqa: F401  (import before timing-sensitive parts)

    out = {"parity": []}
    # ZeRO-1 over dp=2 (pp=1, tp=1), AdamW: optimizer state really sharded
    res = _train_one("gpt", "adamw", dp_rows=True, zero_stage=1)
    o = res["opt"].optim
    out["zero_kind"] = type(o).__name__
    out["zero_local_params"] = sum(len(g["params"]) for g in o.optim.param_groups)
    out["zero_total_params"] = sum(len(g["params"]) for g in o.param_groups)
    out["parity"].append(dict(_parity(res, "gpt", "adamw"), label="zero1 dp=2", dp=True))
    # microbatch_size instead of num_microbatches (8 rows / 2 = 4 microbatches)
    res = _train_one("gpt", "sgd", pp_size=2, microbatch_size=2, pp_style="1f1b")
    out["parity"].append(dict(_parity(res, "gpt", "sgd"), label="microbatch_size"))
    # activation checkpointing: same weights, and every block runs twice per microbatch (counted
    # by a pre-hook: torch stops a recompute early, before forward hooks would fire)
    for ac in (False, True):
        booster, plugin, m, o, loss_fn = _boost("gpt", "sgd", pp_size=2, num_microbatches=2,
                                                pp_style="gpipe", activation_checkpointing=ac)
        calls = [0]
        for mod in m.stage_modules:
            for blk in mod.inner.blocks.values():
                blk.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
        losses = _steps(booster, plugin, m, o, loss_fn, _gpt_data(2))
        out[f"ac_calls_{ac}"] = calls[0]
        if ac:
            out["parity"].append(dict(_parity({"losses": losses, "state": m.full_state_dict()}, "gpt", "sgd"),
                                      label="activation_checkpointing"))
    # a user nn.Sequential split over pp=2, with and without checkpointing its children
    for ac in (False, True):
        res = _train_one("seq", "sgd", pp_size=2, num_microbatches=2, pp_style="gpipe", activation_checkpointing=ac)
        out["parity"].append(dict(_parity(res, "seq", "sgd"), label=f"sequential pp=2 ac={ac}"))
    # a user tp_plan for a non-GPT MLP
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    res = _train_one("mlp", "adamw", tp_size=2, tp_plan={"0": ColwiseParallel(), "2": RowwiseParallel()})
    out["mlp_sharded"] = tuple(res["model"].stage_modules[0].inner[0].weight.to_local().shape)
    out["parity"].append(dict(_parity(res, "mlp", "adamw"), label="user tp_plan"))
    # mixed precision under pp=2
    out["bf16"] = _fp_training("bf16")
    out["fp16"] = _fp_training("fp16")
    out["ckpt"] = _checkpoints(ckpt_dir)
    out["wrong_optim"] = _worker_errors(rank, world, ckpt_dir)
    return out


def _checkpoints(ckpt_dir):
    """pp=2 trains 2 steps, saves, trains 2 more (the reference curve); resumes from the files
    in the same layout and in tp=2, each of which must reproduce steps 3-4."""
    data = _gpt_data(4)
    layout = dict(pp_size=2, num_microbatches=2, pp_style="1f1b")
    booster, plugin, m, o, loss_fn = _boost("gpt_tied", "adamw", **layout)
    _steps(booster, plugin, m, o, loss_fn, data[:2])
    booster.save_model(m, os.path.join(ckpt_dir, "model"))
    booster.save_optimizer(o, os.path.join(ckpt_dir, "optim"))
    saved_state = m.full_state_dict()
    ref = _steps(booster, plugin, m, o, loss_fn, data[2:])
    out = {"saved_state": saved_state, "ref": ref, "files": sorted(os.listdir(ckpt_dir))}
    for name, kw in (("same", layout), ("tp2", dict(tp_size=2))):
        booster, plugin, m, o, loss_fn = _boost("gpt_tied", "adamw", **kw)
        booster.load_model(m, os.path.join(ckpt_dir, "model"))
        booster.load_optimizer(o, os.path.join(ckpt_dir, "optim"))
        out[f"loaded_{name}"] = m.full_state_dict()
        out[f"resumed_{name}"] = _steps(booster, plugin, m, o, loss_fn, data[2:])
    return out


def _close(a, b, tol):
    return abs(a - b) <= tol * max(1.0, abs(b))


def _check_parity(per_rank):
    for i, item in enumerate(per_rank[0]["parity"]):
        ref_losses, ref_state = _plain_reference(item["model"], item["opt"], item["steps"])
        label = item["label"]
        for rank, res in enumerate(per_rank):
            got = res["parity"][i]
            assert got["label"] == label
            for k, v in ref_state.items():
                err = (got["state"][k] - v).abs().max().item()
                # Adam divides by sqrt(v): a near-zero gradient's rounding moves its update by a
                # fraction of lr (1e-2); a missed or doubled step would move it by ~lr
                tol = 2e-4 if item["opt"] == "adamw" else 2e-5
                assert err < tol, f"{label}: rank {rank} weight {k} differs by {err}"
            if not item.get("dp"):
                for a, b in zip(got["losses"], ref_losses):
                    assert a is None or _close(a, b, 1e-4), (label, a, b)
        assert any(r["parity"][i]["losses"][0] is not None for r in per_rank), label


def test_hybrid_features_two_ranks(tmp_path):
    from colossal_lab.engine.checkpoint_io import load_state_dict_shards

    per_rank = run_distributed(_worker2, 2, str(tmp_path), timeout=400)
    _check_parity(per_rank)
    r0 = per_rank[0]
    assert r0["zero_kind"] == "ZeroRedundancyOptimizer"
    assert 0 < r0["zero_local_params"] < r0["zero_total_params"], r0
    for r in per_rank:  # >= one recompute per block (2 per rank) per microbatch (2) per step (2)
        assert r["ac_calls_True"] - r["ac_calls_False"] >= 8, (r["ac_calls_True"], r["ac_calls_False"])
    assert r0["mlp_sharded"] == (16, 8)
    for prec in ("bf16", "fp16"):
        losses = [l for r in per_rank for l in r[prec]["losses"] if l is not None]
        assert len(losses) == 8 and losses[-1] < 0.8 * losses[0], (prec, losses)
    for rank, r in enumerate(per_rank):
        skip = r["fp16"]["skip"]
        assert skip == {"stepped": False, "scale_ratio": 0.5, "unchanged": True}, (rank, skip)
    # an optimizer checkpoint of another model: one clear error on every rank, no hang
    for r in per_rank:
        assert r["wrong_optim"] and "same model and optimizer type" in r["wrong_optim"], r["wrong_optim"]
    # checkpoints: one writer, atomic (no temporary names left), plain-GPT loadable
    ck = [r["ckpt"] for r in per_rank]
    assert ck[0]["files"] == ["model", "optim"], ck[0]["files"]
    sd = load_state_dict_shards(tmp_path / "model")
    plain = _gpt(True)
    plain.load_state_dict(sd, strict=True)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, ck[0]["saved_state"][k]), k
    for name in ("same", "tp2"):
        for k, v in ck[0]["saved_state"].items():
            for c in ck:
                assert torch.equal(c[f"loaded_{name}"][k], v), (name, k)
        ref = [l for c in ck for l in c["ref"] if l is not None][:2]
        got = [l for c in ck for l in c[f"resumed_{name}"] if l is not None][:2]
        assert len(ref) == len(got) == 2
        for a, b in zip(got, ref):
            assert _close(a, b, 1e-4), (name, got, ref)


def _worker4(rank, world, ckpt_dir):
    out = {}
    res = _train_one("gpt", "adamw", dp_rows=True, zero_stage=1, pp_size=2, num_microbatches=2, pp_style="1f1b")
    o = res["opt"].optim
    out["zero_kind"] = type(o).__name__
    out["parity"] = [dict(_parity(res, "gpt", "adamw"), label="zero1 pp=2 x dp=2", dp=True)]
    # pp=2 x tp=2 saves; a plain GPT (parent) and pp=2 x dp=2 with ZeRO-1 load it
    data = _gpt_data(4)
    booster, plugin, m, o, loss_fn = _boost("gpt", "adamw", pp_size=2, tp_size=2, num_microbatches=2,
                                            pp_style="gpipe")
    _steps(booster, plugin, m, o, loss_fn, data[:2])
    booster.save_model(m, os.path.join(ckpt_dir, "model"))
    booster.save_optimizer(o, os.path.join(ckpt_dir, "optim"))
    out["saved_state"] = m.full_state_dict()
    out["ref"] = _steps(booster, plugin, m, o, loss_fn, data[2:])
    booster, plugin, m, o, loss_fn = _boost("gpt", "adamw", pp_size=2, zero_stage=1, num_microbatches=2,
                                            pp_style="gpipe")
    booster.load_model(m, os.path.join(ckpt_dir, "model"))
    booster.load_optimizer(o, os.path.join(ckpt_dir, "optim"))
    # each dp rank trains on the whole batch here, so its loss is the full-batch loss
    out["resumed"] = _steps(booster, plugin, m, o, loss_fn, data[2:])
    out["files"] = sorted(os.listdir(ckpt_dir))
    return out


def test_zero1_pipeline_data_parallel_and_checkpoints_four_ranks(tmp_path):
    from colossal_lab.engine.checkpoint_io import load_state_dict_shards

    per_rank = run_distributed(_worker4, 4, str(tmp_path), timeout=400)
    _check_parity(per_rank)
    assert {r["zero_kind"] for r in per_rank} == {"ZeroRedundancyOptimizer"}
    assert per_rank[0]["files"] == ["model", "optim"]
    plain = _gpt()
    plain.load_state_dict(load_state_dict_shards(tmp_path / "model"), strict=True)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, per_rank[0]["saved_state"][k]), k
    # step 3's loss checks the weights, step 4's the Adam state loaded into ZeRO-1 partitions
    ref = [r["ref"] for r in per_rank if r["ref"][0] is not None]
    got = [r["resumed"] for r in per_rank if r["resumed"][0] is not None]
    assert ref and len(got) == 2, (ref, got)  # the last stage of each of the two dp replicas
    for g in got:
        assert all(_close(a, b, 1e-4) for a, b in zip(g, ref[0])), (ref, got)


def _worker_errors(rank, world, ckpt_dir):
    """Wrong optimizer checkpoint: one clear error on every rank, naming what does load."""
    booster, plugin, m, o, loss_fn = _boost("mlp", "adamw")  # dp=2
    _steps(booster, plugin, m, o, loss_fn, _mlp_data(1))
    booster.save_optimizer(o, os.path.join(ckpt_dir, "mlp_optim"))
    booster, plugin, m, o, loss_fn = _boost("seq", "adamw", pp_size=2, num_microbatches=2, pp_style="gpipe")
    try:
        booster.load_optimizer(o, os.path.join(ckpt_dir, "mlp_optim"))
    except RuntimeError as e:
        return str(e)
    return None


def test_unsupported_model_choices_fail_before_any_group():
    import pytest
    import torch.distributed as dist

    from colossal_lab.engine.plugins import HybridParallelPlugin

    class Net(nn.Module):  # neither the GPT nor an nn.Sequential
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

    with pytest.raises(ValueError, match=r"activation_checkpointing=True.*Net.*nn.Sequential"):
        HybridParallelPlugin(activation_checkpointing=True).configure(Net(), None, None, None, None, "fp32")
    with pytest.raises(ValueError, match=r"tp_size=2.*Sequential has no tp_plan.*tp_plan="):
        HybridParallelPlugin(tp_size=2).configure(_mlp(), None, None, None, None, "fp32")
    assert not dist.is_initialized()
