"""Gemini end to end: real chunks, real NVMe files, real gloo ranks, against plain PyTorch AdamW."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from support.dist import run_distributed
from support.engine import tiny_model
from support.gemini import LR, STEPS, adamw_reference, token_batches, train_gemini

from colossal_lab.engine import Booster, telemetry
from colossal_lab.engine.plugins import GeminiPlugin


def test_policies_match_pytorch_single_process(tmp_path):
    base = tiny_model()
    batches = token_batches(STEPS)
    ref_losses, ref_params = adamw_reference(copy.deepcopy(base), batches)
    for plugin in (GeminiPlugin(placement_policy="cpu", precision="fp32"),
                   GeminiPlugin(placement_policy="static", offload_param_frac=0.5, offload_optim_frac=0.5,
                                nvme_offload_dir=str(tmp_path / "s"), nvme_offload_frac=0.5,
                                precision="fp32", chunk_size_mb=0.07)):
        _, gm, _, losses = train_gemini(copy.deepcopy(base), batches, plugin)
        assert losses == pytest.approx(ref_losses, abs=1e-5), plugin.placement_policy
        sd = gm.state_dict()
        for k, v in ref_params.items():
            torch.testing.assert_close(sd[k], v, atol=1e-5, rtol=1e-4)
        plugin.close()


def test_auto_nvme_under_memory_limit_matches_and_cleans_up(tmp_path):
    base = tiny_model()
    batches = token_batches(STEPS)
    ref_losses, ref_params = adamw_reference(copy.deepcopy(base), batches)
    model_bytes = sum(p.numel() * 4 for p in base.parameters())
    limit = 400_000
    assert limit < model_bytes  # the compute tier cannot hold even the fp32 parameters
    events = []
    unsub = telemetry.subscribe(events.append)
    seen_files = []
    plugin = GeminiPlugin(placement_policy="auto", precision="fp32", device_memory_limit=limit,
                          nvme_offload_dir=str(tmp_path), chunk_size_mb=0.07, max_prefetch=1)
    try:
        _, gm, _, losses = train_gemini(copy.deepcopy(base), batches, plugin,
                                         on_step=lambda m: seen_files.append(sorted(os.listdir(m.manager.nvme.dir))))
    finally:
        unsub()
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    sd = gm.state_dict()
    for k, v in ref_params.items():
        torch.testing.assert_close(sd[k], v, atol=1e-5, rtol=1e-4)
    # real files during training, in the NVMe directory, with the bytes we planned
    mgr = gm.manager
    assert all(any(f.endswith(".param") for f in fs) and any(f.endswith(".state") for f in fs) for fs in seen_files)
    assert mgr.nvme.bytes_written > model_bytes and mgr.nvme.bytes_read > model_bytes
    # telemetry: chunks on both tiers, moves between them, compute tier never over the limit
    chunk_ev = [e for e in events if isinstance(e, telemetry.ChunkEvent)]
    assert {e.tier for e in chunk_ev} == {"cpu", "nvme"}
    moved = {}
    for e in chunk_ev:
        moved.setdefault(e.chunk_id, set()).add(e.tier)
    assert any(len(t) > 1 for t in moved.values())
    samples = [e for e in events if isinstance(e, telemetry.MemorySample) and e.tier == "cpu"]
    assert samples and all(s.used <= s.capacity == limit for s in samples)
    assert 0 < mgr.compute.peak <= limit
    assert mgr.trace.ready and mgr.trace.order  # the auto policy learned an access order in warm-up
    nvme_dir = mgr.nvme.dir
    plugin.close()
    assert not os.path.exists(nvme_dir) and os.listdir(tmp_path) == []


def test_checkpoint_roundtrip_into_gemini_and_plain_gpt(tmp_path):
    base = tiny_model()
    batches = token_batches(6)
    ref = copy.deepcopy(base)
    ref_losses, _ = adamw_reference(ref, batches)
    plugin = GeminiPlugin(placement_policy="auto", precision="fp32", device_memory_limit=400_000,
                          nvme_offload_dir=str(tmp_path / "nv"), chunk_size_mb=0.07)
    booster, gm, gopt, losses = train_gemini(copy.deepcopy(base), batches[:3], plugin)
    booster.save_model(gm, tmp_path / "model")
    booster.save_optimizer(gopt, tmp_path / "optim")
    assert losses == pytest.approx(ref_losses[:3], abs=1e-5)
    plugin.close()
    # into a plain GPT: its loss on the next batch equals the reference run's 4th loss
    from colossal_lab.engine.checkpoint_io import load_state_dict_shards

    plain = tiny_model()
    plain.load_state_dict(load_state_dict_shards(tmp_path / "model"))
    _, l = plain(*batches[3])
    assert l.item() == pytest.approx(ref_losses[3], abs=1e-5)
    # into a fresh Gemini (another placement): model + optimizer resume the same loss curve
    model3 = tiny_model()
    opt3 = torch.optim.AdamW(model3.parameters(), lr=LR, weight_decay=0.1)
    p3 = GeminiPlugin(placement_policy="cpu", precision="fp32")
    b3 = Booster(plugin=p3, mixed_precision="fp32")
    gm3, gopt3, *_ = b3.boost(model3, opt3)
    b3.load_model(gm3, tmp_path / "model")
    b3.load_optimizer(gopt3, tmp_path / "optim")
    resumed = []
    for x, y in batches[3:]:
        _, loss = gm3(x, y)
        b3.backward(loss, gopt3)
        gopt3.step()
        resumed.append(loss.item())
    assert resumed == pytest.approx(ref_losses[3:], abs=1e-5)
    p3.close()


# ---- two real ranks ------------------------------------------------------------------------------
def _two_rank_worker(rank, world, tmp):
    base = tiny_model()
    batches = token_batches(STEPS, batch=4)
    ref_losses, ref_params = adamw_reference(copy.deepcopy(base), batches)
    out = {}
    configs = {
        "cpu": GeminiPlugin(placement_policy="cpu", precision="fp32"),
        "auto_nvme": GeminiPlugin(placement_policy="auto", precision="fp32", device_memory_limit=300_000,
                                  nvme_offload_dir=os.path.join(tmp, f"nv{rank}"), chunk_size_mb=0.07),
        "static_half_sharded": GeminiPlugin(placement_policy="static", shard_param_frac=0.5, precision="fp32",
                                            chunk_size_mb=0.07),
    }
    for name, plugin in configs.items():
        booster, gm, gopt, losses = train_gemini(copy.deepcopy(base), batches, plugin, rank, world)
        mean = torch.tensor(losses)
        torch.distributed.all_reduce(mean)
        mean /= world
        sd = gm.state_dict()
        err = max((sd[k] - v).abs().max().item() for k, v in ref_params.items())
        out[name] = {"loss_err": max(abs(a - b) for a, b in zip(mean.tolist(), ref_losses)), "param_err": err,
                     "sharded": sum(c.sharded for c in gm.manager.chunks), "n": len(gm.manager.chunks),
                     "shard_numel": [c.shard_size for c in gm.manager.chunks]}
        if name == "auto_nvme":
            booster.save_model(gm, os.path.join(tmp, "ckpt"))
            out[name]["files"] = len(gm.manager.nvme.files())
        plugin.close()
    return out


def test_two_ranks_match_single_process(tmp_path):
    results = run_distributed(_two_rank_worker, 2, str(tmp_path), timeout=240)
    for res in results:
        for name, r in res.items():
            assert r["loss_err"] < 1e-4 and r["param_err"] < 1e-4, (name, r)
        assert res["cpu"]["sharded"] == res["cpu"]["n"]          # ZeRO-3: every chunk halved
        assert 0 < res["static_half_sharded"]["sharded"] < res["static_half_sharded"]["n"]
        assert res["auto_nvme"]["files"] > 0
    # the 2-rank checkpoint reloads into a plain GPT
    from colossal_lab.engine.checkpoint_io import load_state_dict_shards

    plain = tiny_model()
    plain.load_state_dict(load_state_dict_shards(tmp_path / "ckpt"))
    ref = tiny_model()
    _, ref_params = adamw_reference(ref, token_batches(STEPS))
    for k, v in ref_params.items():
        torch.testing.assert_close(plain.state_dict()[k], v, atol=1e-4, rtol=1e-4)
    assert not [d for d in os.listdir(tmp_path) if d.startswith("nv") and os.listdir(tmp_path / d)]


# ---- cleanup at exit -----------------------------------------------------------------------------
_CHILD = textwrap.dedent("""
    import os, sys, time, torch
    from colossal_lab.engine.models import GPT, GPTConfig
    from colossal_lab.engine.plugins import GeminiPlugin
    torch.manual_seed(0)
    m = GPT(GPTConfig.preset("tiny"))
    plugin = GeminiPlugin(placement_policy="auto", precision="fp32", device_memory_limit=400_000,
                          nvme_offload_dir=sys.argv[1], chunk_size_mb=0.07)
    gm, opt, *_ = plugin.configure(m, torch.optim.AdamW(m.parameters()), None, None, None, "fp32")
    x = torch.randint(0, 256, (2, 16))
    _, loss = gm(x, x); opt.backward(loss); opt.step()
    print(gm.manager.nvme.dir, len(os.listdir(gm.manager.nvme.dir)), flush=True)
    if sys.argv[2] == "term":
        time.sleep(60)
    else:
        sys.stdin.readline()      # exit only once the parent has seen the files: no race with its check
""")


def test_offload_files_removed_at_exit_and_on_sigterm(tmp_path):
    """Two real processes that never call close(): one exits normally, one gets SIGTERM."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = {how: subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / how), how],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for how in ("exit", "term")}
    for how, p in procs.items():
        line = p.stdout.readline().split()
        assert line, f"{how}: child printed nothing"
        d, nfiles = line[0], int(line[1])
        assert nfiles > 0 and os.path.isdir(d)
        if how == "term":
            p.send_signal(signal.SIGTERM)
        else:
            p.stdin.write("go\n")
            p.stdin.flush()
        p.wait(timeout=60)
        assert p.returncode == 0 if how == "exit" else p.returncode != 0, (how, p.returncode)
        assert not os.path.exists(d), how


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["cuda", "cpu", "auto"])
def test_gpu_policies_match_pytorch(policy, tmp_path):
    """The CUDA stack (cuda → cpu → nvme), side-stream prefetch included; runs only with a GPU."""
    base = tiny_model()
    batches = token_batches(STEPS)
    ref = copy.deepcopy(base).cuda()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    ref_losses = []
    for x, y in batches:
        _, loss = ref(x.cuda(), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    kw = {}
    if policy == "auto":
        kw = dict(device_memory_limit=400_000, nvme_offload_dir=str(tmp_path), chunk_size_mb=0.07)
    plugin = GeminiPlugin(placement_policy=policy, precision="fp32", **kw)
    model = copy.deepcopy(base)
    b = Booster(plugin=plugin, mixed_precision="fp32")
    gm, gopt, *_ = b.boost(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
    losses = []
    for x, y in batches:
        _, loss = gm(x.cuda(), y.cuda())
        b.backward(loss, gopt)
        gopt.step()
        losses.append(loss.item())
    assert losses == pytest.approx(ref_losses, abs=1e-3)
    plugin.close()


def test_fp16_overflow_in_nvme_resident_grads_skips_the_step(tmp_path):
    """fp16: a non-finite gradient whose optimizer home is NVMe is caught before the update."""
    model = tiny_model()
    plugin = GeminiPlugin(placement_policy="cpu", precision="fp16", nvme_offload_dir=str(tmp_path),
                          nvme_offload_frac=1.0, chunk_size_mb=0.07)
    booster = Booster(plugin=plugin)
    gm, gopt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    assert {c.optim_home for c in gm.manager.chunks} == {"nvme"}
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    gopt.scale = 2.0 ** 40  # fp16 gradients overflow
    x, y = token_batches(1)[0]
    _, loss = gm(x, y)
    booster.backward(loss, gopt)
    gopt.step()
    assert gopt.skipped == 1 and gopt.scale == 2.0 ** 39
    after = gm.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    gopt.scale = 1.0
    _, loss = gm(x, y)
    booster.backward(loss, gopt)
    gopt.step()  # a finite step updates
    assert gopt.skipped == 1 and not all(torch.equal(before[k], gm.state_dict()[k]) for k in before)
    plugin.close()
