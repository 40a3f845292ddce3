"""Gemini re-packs its chunks in execution order at the first training forward (engine/gemini/repack.py).

The model: the reference GPT with tied embeddings whose modules are *registered* out of the
order they run (inside every block, attention and MLP in reverse; the embedding last, so the
tied weight is named ``lm_head.weight`` and packed last at boost although it is used first).
Real chunks, real NVMe files, real gloo ranks, against plain PyTorch AdamW.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn
from support.dist import run_distributed
from support.gemini import LR, adamw_reference

from colossal_lab.engine import Booster, telemetry
from colossal_lab.engine.models import GPT, GPTConfig
from colossal_lab.engine.plugins import GeminiPlugin

STEPS = 10
CFG = GPTConfig.preset("tiny", tie_embeddings=True)


def _batches(n, batch=4, seq=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (batch, seq), generator=g), torch.randint(0, 256, (batch, seq), generator=g))
            for _ in range(n)]


def _base():
    torch.manual_seed(0)
    return GPT(CFG)


def _reordered(model: GPT) -> GPT:
    """Same modules, same forward, registered out of execution order."""
    for m in model.modules():
        if type(m).__name__ in ("Block", "Attention", "MLP"):
            m.__dict__["_modules"] = dict(reversed(list(m._modules.items())))
    model._modules["tok_emb"] = model._modules.pop("tok_emb")
    return model


def _execution_names():
    """First-use order of the GPT's parameters, from its structure: a GPT registered in the order it
    runs lists them so; the tied weight keeps the name it has in the reordered model."""
    return ["lm_head.weight" if n == "tok_emb.weight" else n for n, _ in _base().named_parameters()]


def _layout(gm):
    return [i.name for c in gm.manager.chunks for i in c.infos]


def _boost(model, plugin):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    booster = Booster(plugin=plugin, mixed_precision="fp32" if plugin.precision == "fp32" else plugin.precision)
    gm, gopt, *_ = booster.boost(model, opt)
    return booster, gm, gopt, opt


def _step(booster, gm, gopt, x, y, rank=0, world=1):
    b = x.shape[0] // world
    _, loss = gm(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b])
    booster.backward(loss, gopt)
    gopt.step()
    gopt.zero_grad()
    return loss.item()


def _check_homes(gm, ref=None):
    """Tier accounting equals what the chunks' homes hold (after a step: no gathered copies, no
    gradients); the NVMe directory holds exactly the new chunks' files (no old-layout or temporary
    ones) with the new layout's sizes; with ``ref`` (parameter values by name), every chunk's fp32
    master — in RAM or in its ``c<k>.state`` file — holds those values at the new offsets."""
    mgr = gm.manager
    comp = mgr.compute.name
    want = {t.name: 0 for t in mgr.stack.tiers if t.name != "nvme"}
    files = {}
    for c in mgr.chunks:
        n = c.shard_size
        alias = c.param_home == comp and (not c.sharded or mgr.world == 1)
        share = mgr.shares_master(c)
        if c.optim_home == "nvme":
            files[f"c{c.id}.state"] = 12 * n
        else:
            want[c.optim_home] += 12 * n
        if c.param_home == "nvme":
            files[f"c{c.id}.param"] = c.shard_bytes
        elif not share:
            want[comp if alias else c.param_home] += c.full_bytes if alias else c.shard_bytes
    got = {t.name: t.used for t in mgr.stack.tiers if t.name != "nvme"}
    assert got == want, (got, want)
    if mgr.nvme is not None:
        names = mgr.nvme.files()
        assert sorted(names) == sorted(files), names
        for name, nbytes in files.items():
            assert mgr.nvme._sizes[name] == nbytes
    if ref is not None:
        for c in mgr.chunks:
            if c.optim_home == "nvme":
                st = torch.empty(3 * c.shard_size)
                mgr.nvme.read(f"c{c.id}.state", st).result()
            else:
                st = mgr._optim_state[c.id]
            s0 = c.shard_range[0]
            for info, lo, hi in c.segments():
                vals = ref[info.name].reshape(-1)[lo + s0 - info.offset:hi + s0 - info.offset]
                torch.testing.assert_close(st[lo:hi], vals.float(), atol=1e-4, rtol=1e-4)
    return files


PLACEMENTS = {
    "cpu": lambda tmp, rank: dict(placement_policy="cpu", chunk_size_mb=0.07),
    "auto_nvme": lambda tmp, rank: dict(placement_policy="auto", device_memory_limit=400_000, max_prefetch=1,
                                        nvme_offload_dir=os.path.join(tmp, f"nv{rank}"), chunk_size_mb=0.07),
}
# one process also: the chunk size searched again for the new order (under the limit's cap)
SEARCHED = lambda tmp, rank: dict(placement_policy="auto", device_memory_limit=400_000, max_prefetch=1,  # noqa: E731
                                  nvme_offload_dir=os.path.join(tmp, f"ns{rank}"))
# on 2 ranks also: half the chunks sharded, half replicated, half the optimizer states on NVMe
HALF = lambda tmp, rank: dict(placement_policy="static", shard_param_frac=0.5, offload_param_frac=0.5,  # noqa: E731
                              offload_optim_frac=0.5, nvme_offload_dir=os.path.join(tmp, f"nh{rank}"),
                              nvme_offload_frac=0.5, chunk_size_mb=0.07)


def _train(name, tmp, rank=0, world=1):
    base = _base()
    batches = _batches(STEPS)
    ref_losses, ref_params = adamw_reference(copy.deepcopy(base), batches)
    model = _reordered(copy.deepcopy(base))
    registered = [n for n, _ in model.named_parameters()]
    placement = {**PLACEMENTS, "static_half": HALF, "auto_searched": SEARCHED}[name]
    plugin = GeminiPlugin(precision="fp32", **placement(tmp, rank))
    booster, gm, gopt, opt = _boost(model, plugin)
    held = list(opt.param_groups[0]["params"])
    out = {"registered": registered, "at_boost": _layout(gm), "n_at_boost": len(gm.manager.chunks)}
    losses = []
    for i, (x, y) in enumerate(batches):
        losses.append(_step(booster, gm, gopt, x, y, rank, world))
        if i == 0:
            out["after_first"] = _layout(gm)
            out["status"] = gm.pack.status
            out["n_after"] = len(gm.manager.chunks)
            out["files"] = sorted(_check_homes(gm))
    _check_homes(gm, ref_params)
    mgr = gm.manager
    # the user's optimizer holds the same Parameter objects, now views into the new chunks
    assert all(a is b for a, b in zip(held, opt.param_groups[0]["params"]))
    for c in mgr.chunks:
        for info in c.infos:
            assert info.param.untyped_storage()._cdata == c.full.untyped_storage()._cdata
    assert set(gopt.steps) == {c.id for c in mgr.chunks} and set(gopt.steps.values()) == {STEPS}
    assert mgr.trace.ready and max(mgr.trace.order) == len(mgr.chunks) - 1
    sd = gm.state_dict()
    out["loss"] = losses
    out["ref_loss"] = ref_losses
    out["param_err"] = max((sd[k] - v).abs().max().item() for k, v in ref_params.items() if k in sd)
    out["gathers"] = gm.pack.gathers
    out["sharded"] = [c.sharded for c in mgr.chunks]
    out["peak"] = mgr.compute.peak
    out["limit"] = mgr.compute.capacity
    nvme_dir = mgr.nvme.dir if mgr.nvme is not None else None
    plugin.close()
    out["dir_gone"] = nvme_dir is None or not os.path.exists(nvme_dir)
    return out


def _check_order(r):
    want = _execution_names()
    assert r["at_boost"] == r["registered"] != want        # boost packs in registration order
    assert r["after_first"] == want and r["status"] == "repacked"
    assert r["dir_gone"]


@pytest.mark.parametrize("name", [*PLACEMENTS, "auto_searched"])
def test_repacked_in_execution_order_and_matches_pytorch(name, tmp_path):
    events = []
    unsub = telemetry.subscribe(events.append)
    try:
        r = _train(name, str(tmp_path))
    finally:
        unsub()
    _check_order(r)
    assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)
    assert r["param_err"] < 1e-5
    assert r["peak"] <= r["limit"]
    # a snapshot of the new layout was emitted during the first step: chunks 0..N-1, their
    # parameters in execution order
    want = _execution_names()
    ev = [e for e in events if isinstance(e, telemetry.ChunkEvent) and e.step == 0]
    n = r["n_after"]
    runs = [ev[i:i + n] for i in range(len(ev) - n + 1)
            if [e.chunk_id for e in ev[i:i + n]] == list(range(n))]
    assert any([p for e in run for p in e.params] == want for run in runs)
    last = {e.chunk_id: e for e in ev}
    assert all(last[cid].nbytes == 0 and last[cid].params == () for cid in range(n, r["n_at_boost"]))


def test_any_precision_repack_is_exact(tmp_path):
    """bf16 with NVMe homes: re-packed training is bit-identical to the same run kept in
    registration order (only where the bytes live changed), and the fallback flag works."""
    batches = _batches(6)
    runs = {}
    for order in ("execution", "registration"):
        model = _reordered(_base())
        plugin = GeminiPlugin(placement_policy="auto", precision="bf16", device_memory_limit=600_000,
                              nvme_offload_dir=str(tmp_path / order), chunk_size_mb=0.04, max_prefetch=1,
                              pack_order=order)
        booster, gm, gopt, _ = _boost(model, plugin)
        losses = [_step(booster, gm, gopt, x, y) for x, y in batches]
        _check_homes(gm)
        runs[order] = (losses, gm.state_dict(), _layout(gm), gm.pack.status, {c.param_home for c in gm.manager.chunks})
        plugin.close()
    (l_ex, sd_ex, lay_ex, st_ex, homes), (l_reg, sd_reg, lay_reg, st_reg, _) = runs["execution"], runs["registration"]
    assert st_ex == "repacked" and st_reg == "registration"
    assert lay_ex == _execution_names() and lay_reg != lay_ex
    assert "nvme" in homes
    assert l_ex == l_reg
    assert all(torch.equal(sd_ex[k], sd_reg[k]) for k in sd_reg)


class _DataDependent(nn.Module):
    """A forward that reads a value (``.item()``): it cannot run on the meta device."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, x, y):
        if x.float().mean().item() < 0:
            raise AssertionError("token ids are never negative")
        return self.gpt(x, y)


def test_untraceable_forward_keeps_registration_order_with_a_warning():
    base = _base()
    batches = _batches(4)
    ref_losses, _ = adamw_reference(copy.deepcopy(base), batches)
    model = _DataDependent(_reordered(copy.deepcopy(base)))
    plugin = GeminiPlugin(placement_policy="cpu", precision="fp32", chunk_size_mb=0.07)
    booster, gm, gopt, _ = _boost(model, plugin)
    before = _layout(gm)
    from colossal_lab.engine.gemini import repack

    repack._WARNED.discard("untraced")
    with pytest.warns(RuntimeWarning, match="execution order"):
        losses = [_step(booster, gm, gopt, x, y) for x, y in batches]
    assert gm.pack.status.startswith("untraced: RuntimeError") and _layout(gm) == before
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    plugin.close()


@pytest.mark.parametrize("room_chunks, spilled", [(1.05, True), (0.5, False)])
def test_tight_budget_stages_through_nvme_or_keeps_the_packing(room_chunks, spilled, tmp_path):
    """All homes in a RAM compute tier with almost no free room when the re-pack runs: new chunks
    cannot all wait for the old ones they replace, so one goes through a temporary NVMe file (and
    the tier never exceeds its capacity); with less room than one chunk the packing is kept, with a
    warning. Either way training then matches plain PyTorch."""
    base = _base()
    batches = _batches(STEPS)
    ref_losses, ref_params = adamw_reference(copy.deepcopy(base), batches)
    plugin = GeminiPlugin(placement_policy="auto", precision="fp32", device_memory_limit=5_000_000,
                          nvme_offload_dir=str(tmp_path), chunk_size_mb=0.07, max_prefetch=1)
    booster, gm, gopt, _ = _boost(_reordered(copy.deepcopy(base)), plugin)
    mgr = gm.manager
    assert {(c.param_home, c.optim_home) for c in mgr.chunks} == {("cpu", "cpu")}
    before = _layout(gm)
    capacity = mgr.compute.capacity
    mgr.compute.capacity = mgr.compute.used + int(room_chunks * 12 * mgr.chunks[0].shard_size)
    mgr.compute.peak = mgr.compute.used
    from colossal_lab.engine.gemini import repack

    repack._WARNED.discard("kept")
    if spilled:
        repack.learn_and_repack(gm, batches[0], {})
        assert gm.pack.status == "repacked" and gm.pack.spilled >= 1 and _layout(gm) == _execution_names()
    else:
        with pytest.warns(RuntimeWarning, match="does not fit"):
            repack.learn_and_repack(gm, batches[0], {})
        assert gm.pack.status.startswith("kept: ") and _layout(gm) == before
    assert mgr.compute.peak <= mgr.compute.capacity
    mgr.compute.capacity = capacity
    losses = [_step(booster, gm, gopt, x, y) for x, y in batches]
    _check_homes(gm, {k: v for k, v in ref_params.items()})
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    plugin.close()


class _Towers(nn.Module):
    """Two towers registered one after the other but run interleaved (a1, b1, a2, b2, ...)."""

    def __init__(self, depth=4, width=32):
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))
        self.b = nn.ModuleList(nn.LayerNorm(width, elementwise_affine=True, bias=False) for _ in range(depth))

    def forward(self, x, y):
        for a, b in zip(self.a, self.b):
            x = torch.tanh(b(a(x)))
        return x, torch.nn.functional.mse_loss(x, y)


def test_interleaved_order_fewer_chunks_and_retired_ids_emptied():
    """Registration a1..a4 b1..b4 packs into 5 chunks of 1056 elements; the interleaved execution
    order packs into 4 (each a with its b). The chunk map gets the ids no longer used as empty."""
    torch.manual_seed(0)
    base = _Towers()
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)) for _ in range(STEPS)]
    ref_losses, ref_params = adamw_reference(copy.deepcopy(base), batches)
    events = []
    unsub = telemetry.subscribe(events.append)
    plugin = GeminiPlugin(placement_policy="cpu", precision="fp32", chunk_size_mb=1056 * 4 / 2 ** 20)
    try:
        booster, gm, gopt, _ = _boost(copy.deepcopy(base), plugin)
        assert len(gm.manager.chunks) == 5
        losses = [_step(booster, gm, gopt, x, y) for x, y in batches]
    finally:
        unsub()
    assert [c.names() for c in gm.manager.chunks] == [(f"a.{i}.weight", f"b.{i}.weight") for i in range(4)]
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    _check_homes(gm, ref_params)
    last = {e.chunk_id: e for e in events if isinstance(e, telemetry.ChunkEvent) and e.step == 0}
    assert last[4].nbytes == 0 and last[4].params == () and all(last[i].nbytes > 0 for i in range(4))
    plugin.close()


def test_pack_order_is_validated():
    with pytest.raises(ValueError, match="pack_order"):
        GeminiPlugin(pack_order="random")


def _resume(tmp, rank=0, world=1, steps=STEPS, cut=4):
    """Uninterrupted vs save at ``cut`` -> new boost -> load -> continue; both re-pack."""
    batches = _batches(steps)
    kw = PLACEMENTS["auto_nvme"]
    plugin = GeminiPlugin(precision="fp32", **kw(os.path.join(tmp, "a"), rank))
    booster, gm, gopt, _ = _boost(_reordered(_base()), plugin)
    full = [_step(booster, gm, gopt, x, y, rank, world) for x, y in batches]
    plugin.close()

    plugin = GeminiPlugin(precision="fp32", **kw(os.path.join(tmp, "b"), rank))
    booster, gm, gopt, _ = _boost(_reordered(_base()), plugin)
    first = [_step(booster, gm, gopt, x, y, rank, world) for x, y in batches[:cut]]
    booster.save_model(gm, os.path.join(tmp, "model"))
    booster.save_optimizer(gopt, os.path.join(tmp, "optim"))
    plugin.close()

    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    plugin = GeminiPlugin(precision="fp32", **kw(os.path.join(tmp, "c"), rank))
    booster, gm, gopt, _ = _boost(_reordered(GPT(CFG)), plugin)
    booster.load_model(gm, os.path.join(tmp, "model"))
    booster.load_optimizer(gopt, os.path.join(tmp, "optim"))
    loaded_layout = _layout(gm)
    old_files = sorted(gm.manager.nvme.files())
    rest = [_step(booster, gm, gopt, x, y, rank, world) for x, y in batches[cut:]]
    files = _check_homes(gm)
    out = {"full": full, "resumed": first + rest, "loaded_layout": loaded_layout, "layout": _layout(gm),
           "status": gm.pack.status, "old_files": old_files, "files": sorted(files),
           "steps": sorted(set(gopt.steps.values()))}
    plugin.close()
    return out


def test_resume_repacks_after_load_and_continues_the_same_curve(tmp_path):
    r = _resume(str(tmp_path))
    assert r["loaded_layout"] != r["layout"] == _execution_names() and r["status"] == "repacked"
    assert r["resumed"] == pytest.approx(r["full"], abs=1e-6)
    assert r["steps"] == [STEPS]
    assert r["old_files"] and r["files"]


# ---- two real ranks ------------------------------------------------------------------------------
def _two_rank_worker(rank, world, tmp):
    out = {name: _train(name, tmp, rank, world) for name in [*PLACEMENTS, "static_half"]}
    for r in out.values():
        mean = torch.tensor(r["loss"])
        torch.distributed.all_reduce(mean)
        r["mean_loss"] = (mean / world).tolist()
    # one checkpoint, per-rank NVMe dirs
    out["resume"] = _resume(os.path.join(tmp, "resume"), rank, world, steps=6, cut=3)
    return out


def test_two_ranks_repack_sharded_chunks_and_match_pytorch(tmp_path):
    results = run_distributed(_two_rank_worker, 2, str(tmp_path), timeout=400)
    for rank, res in enumerate(results):
        for name in [*PLACEMENTS, "static_half"]:
            r = res[name]
            _check_order(r)
            assert r["gathers"] > 0 and any(r["sharded"])      # sharded old chunks were all-gathered
            err = max(abs(a - b) for a, b in zip(r["mean_loss"], r["ref_loss"]))
            assert err < 1e-4 and r["param_err"] < 1e-4, (rank, name, err, r["param_err"])
            assert r["peak"] <= r["limit"]
        rs = res["resume"]
        assert rs["layout"] == _execution_names() != rs["loaded_layout"] and rs["status"] == "repacked"
        assert rs["resumed"] == pytest.approx(rs["full"], abs=1e-6)
    assert all(results[0]["cpu"]["sharded"]) and not all(results[0]["static_half"]["sharded"])
