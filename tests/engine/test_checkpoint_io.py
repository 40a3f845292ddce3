"""Checkpoints: HF-style safetensors shards readable by plain safetensors; 2-rank ZeRO saves
load on 1 rank with identical weights and the same next-step losses; a save killed midway
leaves the previous checkpoint intact."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from support.dist import run_distributed
from support.engine import LR, batch, global_mean, tiny_model

from colossal_lab.engine import Booster
from colossal_lab.engine.checkpoint_io import (
    load_state_dict_shards,
    recover,
    save_state_dict_shards,
)
from colossal_lab.engine.models import GPT, GPTConfig

SAVE_AT, AFTER = 3, 2  # train 3 steps, save, then 2 more steps to compare


def test_sharded_layout_is_plain_safetensors(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", tie_embeddings=True))  # shared storage must still save
    sd = model.state_dict()
    files = save_state_dict_shards(sd, tmp_path / "ck", size_per_shard=0.05)
    index = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(files) == set(shards) | {"model.safetensors.index.json"}
    merged = {}
    for f in shards:  # plain safetensors, no colossal_lab code
        merged.update(load_file(str(tmp_path / "ck" / f)))
    assert set(merged) == set(sd) == set(index["weight_map"])
    assert all(torch.equal(merged[k], sd[k]) for k in sd)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    save_state_dict_shards(sd, tmp_path / "one", shard=False)
    assert os.listdir(tmp_path / "one") == ["model.safetensors"]
    assert all(torch.equal(v, sd[k]) for k, v in load_file(str(tmp_path / "one" / "model.safetensors")).items())
    booster = Booster()
    booster.save_model(model, tmp_path / "weights.safetensors", shard=False)
    assert all(torch.equal(v, sd[k]) for k, v in load_file(str(tmp_path / "weights.safetensors")).items())
    with pytest.raises(ValueError, match="shard=False"):
        booster.save_model(model, tmp_path / "w2.safetensors")


def _train_and_save(rank, world, root, stage):
    from colossal_lab.engine.plugins import LowLevelZeroPlugin

    booster = Booster(plugin=LowLevelZeroPlugin(stage=stage))
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    losses = []
    for s in range(SAVE_AT + AFTER):
        if s == SAVE_AT:
            path = Path(root) / f"zero{stage}"
            booster.save_model(model, path / "model", size_per_shard=0.1)
            booster.save_optimizer(opt, path / "optim")
            booster.save_lr_scheduler(sched, path / "sched.pt")
        _, loss = model(*batch(s, rank, world))
        booster.backward(loss, opt)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
    # and back onto 2 ranks: a fresh sharded model loads the saved weights and optimizer
    fresh = Booster(plugin=LowLevelZeroPlugin(stage=stage))
    m2 = tiny_model(seed=7)
    m2, o2, *_ = fresh.boost(m2, torch.optim.AdamW(m2.parameters(), lr=LR))
    fresh.load_model(m2, path / "model")
    fresh.load_optimizer(o2, path / "optim")
    full = fresh.plugin.get_checkpoint_io().full_model_state_dict(m2)
    return {"losses": losses, "reloaded": full if rank == 0 else None, "state_bytes": sum(
        v.numel() for st in o2.state.values() for k, v in st.items() if k != "step")}


def _failed_collective_save(rank, world, root):
    """Every rank writes into one atomic directory; rank 1 fails midway: nothing is replaced
    and every rank learns the save failed."""
    from colossal_lab.engine.checkpoint_io import atomic_dir

    target = Path(root) / "collective"
    with atomic_dir(target, collective=True) as tmp:
        (tmp / f"part{rank}").write_text("v1")
    try:
        with atomic_dir(target, collective=True) as tmp:
            (tmp / f"part{rank}").write_text("v2")
            if rank == 1:
                raise OSError("disk full (injected)")
    except (OSError, RuntimeError) as exc:
        err = f"{type(exc).__name__}: {exc}"
    else:
        err = None
    dist.barrier()
    return {"error": err, "files": sorted((p.name, p.read_text()) for p in target.iterdir()),
            "leftovers": sorted(p.name for p in Path(root).iterdir() if p.name.startswith(".collective"))}


def _both_stages(rank, world, root):
    out = {stage: _train_and_save(rank, world, root, stage) for stage in (1, 2)}
    out["atomic"] = _failed_collective_save(rank, world, root)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = run_distributed(_both_stages, 2, str(root), timeout=240)
    return root, out[0], out


def test_collective_save_failing_on_one_rank_replaces_nothing(saved):
    _, _, both = saved
    for rank, out in enumerate(both):
        a = out["atomic"]
        assert a["files"] == [("part0", "v1"), ("part1", "v1")]
        assert a["leftovers"] == []  # the temporary directory was removed
        assert a["error"] is not None and ("injected" in a["error"] if rank == 1 else "another rank" in a["error"])


@pytest.mark.parametrize("stage", [1, 2])
def test_two_rank_save_reloads_on_two_ranks(saved, stage):
    root, out, _ = saved
    on_disk = load_state_dict_shards(root / f"zero{stage}" / "model")
    reloaded = out[stage]["reloaded"]
    assert set(reloaded) == set(on_disk)
    assert all(torch.equal(reloaded[k], on_disk[k]) for k in on_disk)
    assert out[stage]["state_bytes"] > 0


@pytest.mark.parametrize("stage", [1, 2])
def test_two_rank_save_loads_on_one_rank(saved, stage):
    root, out, _ = saved
    losses = {k: out[k]["losses"] for k in (1, 2)}
    path = root / f"zero{stage}"
    assert len(list((path / "model").glob("model-*-of-*.safetensors"))) > 1
    # reference weights: replay the first SAVE_AT steps in one process
    ref = tiny_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    for s in range(SAVE_AT):
        _, loss = ref(*batch(s))
        loss.backward()
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()

    booster = Booster()  # one process, no plugin
    model = tiny_model(seed=123)  # different init: everything must come from the checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    booster.load_model(model, path / "model")
    booster.load_optimizer(opt, path / "optim")
    booster.load_lr_scheduler(sched, path / "sched.pt")
    sd = model.unwrap().state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=2e-6)
    assert sched.get_last_lr() == ref_sched.get_last_lr()
    got = []
    for s in range(SAVE_AT, SAVE_AT + AFTER):
        _, loss = model(*batch(s))
        booster.backward(loss, opt)
        opt.step()
        sched.step()
        opt.zero_grad()
        got.append(loss.item())
    assert got == pytest.approx(losses[stage][SAVE_AT:], abs=2e-5)  # 2nd step depends on the optimizer state


def test_interrupted_swap_is_recovered(tmp_path):
    save_state_dict_shards({"w": torch.ones(3)}, tmp_path / "ck")
    # the state a kill between the two renames of a swap leaves behind
    os.rename(tmp_path / "ck", tmp_path / ".ck.old-abc")
    assert torch.equal(load_state_dict_shards(tmp_path / "ck")["w"], torch.ones(3))
    assert recover(tmp_path / "ck").is_dir()


_KILLED_SAVER = textwrap.dedent("""
    import os, sys, time, torch
    import colossal_lab.engine.checkpoint_io.safetensors_shards as shards
    from colossal_lab.engine.checkpoint_io import GeneralCheckpointIO
    real = shards.save_file
    n = [0]
    def slow_save(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        n[0] += 1
        if n[0] == 2:  # two shards of the new checkpoint are on disk: tell the parent, then stall
            with open(sys.argv[2] + ".tmp", "w") as f:
                f.write(filename)
            os.replace(sys.argv[2] + ".tmp", sys.argv[2])  # the marker appears with its content
            time.sleep(60)
    shards.save_file = slow_save
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    torch.nn.init.constant_(model[0].weight, 7.0)
    GeneralCheckpointIO().save_model(model, sys.argv[1], size_per_shard=1)
""")


def test_killed_save_leaves_previous_checkpoint(tmp_path):
    target = tmp_path / "ck"
    old = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    Booster().save_model(old, target, size_per_shard=1)
    before = sorted(os.listdir(target))
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVER, str(target), str(marker)])
    try:
        deadline = time.time() + 120
        while not marker.exists():
            assert proc.poll() is None, "saver exited before reaching the middle of the save"
            assert time.time() < deadline, "saver never reached the middle of the save"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert Path(marker.read_text()).parent != target  # it was writing elsewhere (the temp dir)
    assert sorted(os.listdir(target)) == before
    fresh = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    Booster().load_model(fresh, target)
    for a, b in zip(old.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)


def test_checkpoints_get_the_users_usual_permissions(tmp_path):
    """tempfile makes 0700 dirs / 0600 files; the renamed-in checkpoint must not keep that."""
    mask = os.umask(0o022)
    try:
        booster = Booster()
        model = GPT(GPTConfig.preset("tiny"))
        booster.save_model(model, tmp_path / "ck", shard=True)
        booster.save_model(model, tmp_path / "w.safetensors", shard=False)
    finally:
        os.umask(mask)
    assert (tmp_path / "ck").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "w.safetensors").stat().st_mode & 0o777 == 0o644
