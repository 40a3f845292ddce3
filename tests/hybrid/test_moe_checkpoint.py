"""MoE checkpoints across expert-parallel sizes: ``booster.save_model`` / ``save_optimizer`` under
``HybridParallelPlugin(ep_size=2)``, ``ep_size=4`` and ep2 with ZeRO-1 write every expert (and its AdamW moments)
under the unsplit names; loading at ep_size 1, 2, 4, under ZeRO-1 and ep×tp on 4 gloo ranks, and in one process,
gives the saved model's logits and, after the optimizer too, the saving run's next two losses. An EP rank reads
only its own experts' rows of the model files. One distributed world."""

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.dist import run_distributed
from support.engine import batch, param_groups, train_step
from support.moe import CLIP, LR, tiny_moe

WORLD = 4
# the layouts the checkpoints are written at: (ep_size, zero_stage)
SAVES = {"ep2": (2, 0), "ep4": (4, 0), "ep2_zero1": (2, 1)}
# load layout -> (ep_size, zero_stage, tp_size)
LOADS = {"dp4": (1, 0, 1), "ep2": (2, 0, 1), "ep4": (4, 0, 1), "ep2_zero1": (2, 1, 1), "ep2xtp2": (2, 0, 2)}
SHARD_MB = 0.05  # small shards, so a checkpoint spans several files and an index


def _probe():
    """The same tokens on every rank (the logits compared across layouts)."""
    return batch(99)[0][:2]


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        logits = model(_probe())[0]
    model.train()
    return (logits.full_tensor() if hasattr(logits, "full_tensor") else logits).detach().clone()


def _scrambled(seed: int):
    """A fresh tiny MoE GPT whose every parameter differs from the saved one (anything not loaded shows)."""
    model = tiny_moe(False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _steps(model, opt, booster, plugin, steps):
    """Train on ``steps``' batches; the mean loss over every rank's rows, per step."""
    losses = []
    for s in steps:
        _, loss = model(*batch(s, plugin.dp_rank, plugin.dp_size))
        train_step(model, opt, loss, CLIP, booster)
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses


def _rank(rank, world):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    root = [tempfile.mkdtemp(prefix="moeckpt-") if rank == 0 else None]
    dist.broadcast_object_list(root)
    root = Path(root[0])
    out = {"saved": {}, "resumed": {}, "loaded": {}, "read": {}, "files": {}}
    for name, (ep, zero) in SAVES.items():
        plugin = HybridParallelPlugin(ep_size=ep, zero_stage=zero)
        booster = Booster(plugin=plugin)
        model = tiny_moe(False)
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(param_groups(model), lr=LR))
        _steps(model, opt, booster, plugin, range(2))  # trained: experts and AdamW moments away from their start
        out["saved"][name] = _logits(model)
        booster.save_model(model, root / name, shard=True, size_per_shard=SHARD_MB)
        booster.save_optimizer(opt, root / f"{name}-optim")
        out["resumed"][name] = _steps(model, opt, booster, plugin, range(2, 4))  # what a resume must repeat
        plugin.close()
    for save in SAVES:
        for name, (ep, zero, tp) in LOADS.items():
            plugin = HybridParallelPlugin(ep_size=ep, zero_stage=zero, tp_size=tp)
            booster = Booster(plugin=plugin)
            model = _scrambled(rank)
            model, opt, *_ = booster.boost(model, torch.optim.AdamW(param_groups(model), lr=LR))
            before = _logits(model)
            io = plugin.get_checkpoint_io()
            io.load_model(model, root / save)
            after = _logits(model)
            if name == "ep2":  # the booster's own route gives the same
                booster.load_model(model, root / save)
                assert torch.equal(_logits(model), after)
            booster.load_optimizer(opt, root / f"{save}-optim")
            resumed = _steps(model, opt, booster, plugin, range(2, 4))
            out["loaded"][(save, name)] = (before, after, resumed)
            out["read"][(save, name)] = io.bytes_read
            plugin.close()
    if rank == 0:  # the files, for the single-process checks
        out["files"] = {n: {f.relative_to(root).as_posix(): f.read_bytes() for f in (root / n).rglob("*")
                            if f.is_file()} for s in SAVES for n in (s, f"{s}-optim")}
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    per = run_distributed(_rank, WORLD, timeout=600)
    root = tmp_path_factory.mktemp("moeckpt")
    for name, files in per[0]["files"].items():
        for f, data in files.items():
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            (root / f).write_bytes(data)
    return per, {n: root / n for n in SAVES}


def _reference_sizes():
    """Bytes of each tensor of the whole model, and of its grouped expert weights."""
    sd = tiny_moe(False).state_dict()
    total = sum(t.numel() * t.element_size() for t in sd.values())
    expert = sum(t.numel() * t.element_size() for n, t in sd.items() if ".experts." in n)
    return total, expert


def test_files_hold_every_expert_under_unsplit_names(runs):
    _, dirs = runs
    want = {k: tuple(v.shape) for k, v in tiny_moe(False).state_dict().items()}
    for name, d in dirs.items():
        index = json.loads((d / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1, name  # several shards
        from safetensors import safe_open

        got = {}
        for f in set(index["weight_map"].values()):
            with safe_open(str(d / f), framework="pt") as h:
                got.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})
        assert got == want, name  # w1/w3/w2 with all E experts, names as the plain model's


@pytest.mark.parametrize("save", sorted(SAVES))
def test_single_process_load_gives_saved_logits(runs, save):
    """Booster() without a plugin, and plain load_state_dict of the files: the saving run's logits."""
    from colossal_lab.engine import Booster
    from colossal_lab.engine.checkpoint_io import load_state_dict_shards

    per, dirs = runs
    saved = per[0]["saved"][save]
    for r in per:  # every rank of the saving run computed the same logits (experts over the EP group)
        assert torch.allclose(r["saved"][save], saved, atol=1e-6, rtol=0)
    plain = _scrambled(7)
    plain.load_state_dict(load_state_dict_shards(dirs[save]))
    boosted = _scrambled(8)
    Booster().load_model(boosted, dirs[save])
    for model in (plain, boosted):
        assert (_logits(model) - saved).abs().max().item() < 1e-6


@pytest.mark.parametrize("layout", sorted(LOADS))
@pytest.mark.parametrize("save", sorted(SAVES))
def test_load_at_any_ep_size_gives_saved_logits(runs, save, layout):
    per, _ = runs
    saved = per[0]["saved"][save]
    for rank, r in enumerate(per):
        before, after, _ = r["loaded"][(save, layout)]
        assert (before - saved).abs().max().item() > 1e-2, (save, layout, rank)  # scrambled before the load
        err = (after - saved).abs().max().item()
        assert err < 1e-6, (save, layout, rank, err)


def test_each_rank_reads_only_its_experts(runs):
    """An EP rank reads every non-expert tensor and 1/ep of each grouped expert weight's bytes."""
    per, _ = runs
    total, expert = _reference_sizes()
    for r in per:
        for (save, layout), got in r["read"].items():
            ep = LOADS[layout][0]
            assert got == total - expert + expert // ep, (save, layout, got)


def _close(got, want, label):
    for a, b in zip(got, want):  # fp32 sums in another order (and AdamW's ~1e-5 steps on them)
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (label, got, want)
    assert len(got) == len(want) == 2


@pytest.mark.parametrize("layout", sorted(LOADS))
@pytest.mark.parametrize("save", sorted(SAVES))
def test_optimizer_resumes_at_any_ep_size(runs, save, layout):
    """Model and optimizer loaded at another EP size (ZeRO-1 or not), steps 3-4 repeat the saving run's."""
    per, _ = runs
    for rank, r in enumerate(per):
        _close(r["loaded"][(save, layout)][2], per[0]["resumed"][save], (save, layout, rank))


@pytest.mark.parametrize("save", sorted(SAVES))
def test_optimizer_resumes_in_one_process(runs, save):
    """One process (Booster() without a plugin, GeneralCheckpointIO) loads the EP run's model and optimizer
    files; steps 3-4 on the whole batch repeat the saving run's mean losses (each expert's AdamW moments were
    written whole)."""
    from colossal_lab.engine import Booster
    from colossal_lab.engine.checkpoint_io import GeneralCheckpointIO

    per, dirs = runs
    model = _scrambled(9)
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    Booster().load_model(model, dirs[save])
    GeneralCheckpointIO().load_optimizer(opt, dirs[save].parent / f"{save}-optim", model=model)
    losses = []
    for s in range(2, 4):
        _, loss = model(*batch(s))
        train_step(model, opt, loss, CLIP)
        losses.append(loss.item())
    _close(losses, per[0]["resumed"][save], save)
