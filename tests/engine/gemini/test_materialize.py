"""Gemini + NVMe capacity: a lazily built model never exists in RAM, and RSS is bounded by the budget.

Real files, real processes: the RSS test runs a training process and a baseline process (same
imports, same warm-up, no model) in fresh interpreters and compares their peak RSS (VmHWM).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from colossal_lab.engine import Booster
from colossal_lab.engine.lazy import is_lazy, lazy_init, materialize
from colossal_lab.engine.models import GPT, GPTConfig
from colossal_lab.engine.plugins import GeminiPlugin

LR = 1e-2


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (4, 32), generator=g), torch.randint(0, 256, (4, 32), generator=g))
            for _ in range(n)]


def test_lazy_model_trains_through_gemini_nvme_like_eager_torch(tmp_path):
    cfg = GPTConfig.preset("tiny")
    with lazy_init():
        eager = GPT(cfg)
    torch.manual_seed(3)
    materialize(eager, "cpu")  # the eager plain-PyTorch model: same lazy init rules, all in RAM
    with lazy_init():
        lazy = GPT(cfg)
    assert is_lazy(lazy)
    names = [n for n, _ in lazy.named_parameters()]
    ref_opt = torch.optim.AdamW(eager.parameters(), lr=LR, weight_decay=0.1)
    opt = torch.optim.AdamW(lazy.parameters(), lr=LR, weight_decay=0.1)
    held = list(opt.param_groups[0]["params"])
    torch.manual_seed(3)
    plugin = GeminiPlugin(placement_policy="auto", precision="fp32", device_memory_limit=400_000,
                          nvme_offload_dir=str(tmp_path), chunk_size_mb=0.07, max_prefetch=1)
    booster = Booster(plugin=plugin, mixed_precision="fp32")
    gm, gopt, *_ = booster.boost(lazy, opt)
    assert not is_lazy(lazy) and lazy.rope_cos.device.type == "cpu"
    # the user's optimizer still holds the very parameter objects, now views into chunks
    assert all(a is b for a, b in zip(held, opt.param_groups[0]["params"]))
    assert [n for n, _ in lazy.named_parameters()] == names
    mgr = gm.manager
    assert {c.param_home for c in mgr.chunks} == {"nvme"}
    ref_losses, losses, files = [], [], []
    for x, y in _batches(6):
        _, l = eager(x, y)
        l.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(l.item())
        _, l = gm(x, y)
        booster.backward(l, gopt)
        gopt.step()
        losses.append(l.item())
        files.append(mgr.nvme.files())
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    sd = gm.state_dict()
    for k, v in eager.state_dict().items():
        if k in sd:
            torch.testing.assert_close(sd[k], v, atol=1e-5, rtol=1e-4)
    assert all(any(f.endswith(".param") for f in fs) and any(f.endswith(".state") for f in fs) for fs in files)
    d = mgr.nvme.dir
    plugin.close()
    assert not os.path.exists(d) and os.listdir(tmp_path) == []


_CHILD = textwrap.dedent("""
    import json, os, sys, tempfile, torch
    from colossal_lab.engine import Booster
    from colossal_lab.engine.lazy import lazy_init
    from colossal_lab.engine.models import GPT, GPTConfig
    from colossal_lab.engine.plugins import GeminiPlugin

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024

    def train(cfg, limit, nvme_dir, steps):
        with lazy_init():
            m = GPT(cfg)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        plugin = GeminiPlugin(placement_policy="auto", precision="fp32", device_memory_limit=limit,
                              nvme_offload_dir=nvme_dir, max_prefetch=1)
        b = Booster(plugin=plugin, mixed_precision="fp32")
        gm, go, *_ = b.boost(m, opt)
        x = torch.randint(0, cfg.vocab_size, (2, 32))
        files, losses = [], []
        for _ in range(steps):
            _, loss = gm(x, x)
            b.backward(loss, go)
            go.step()
            files.append(len(gm.manager.nvme.files()))
            losses.append(loss.item())
        out = {"params": sum(i.numel for c in gm.manager.chunks for i in c.infos), "files": files,
               "losses": losses, "tier_peak": gm.manager.compute.peak, "dir": gm.manager.nvme.dir}
        plugin.close()
        out["dir_gone"] = not os.path.exists(out["dir"])
        return out

    mode, limit, root = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    train(GPTConfig.preset("tiny"), 400_000, os.path.join(root, "warm-" + mode), 1)  # same libraries, same warm-up
    out = {}
    if mode == "train":
        out = train(GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=8, n_embd=512), limit,
                    os.path.join(root, "run"), 3)
    out["hwm"] = hwm()
    print(json.dumps(out))
""")

LIMIT = 32 << 20     # compute-tier (RAM) budget
MARGIN = 48 << 20    # allowed on top: activations, autograd's per-parameter grads, chunks in flight, IO threads


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc")
def test_peak_rss_bounded_by_budget_not_model_size(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def child(mode):
        p = subprocess.run([sys.executable, "-c", _CHILD, mode, str(LIMIT), str(tmp_path)],
                           capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    base = child("baseline")
    run = child("train")
    state_bytes = 16 * run["params"]           # fp32 params + grads + Adam m, v
    assert state_bytes > 4 * MARGIN and state_bytes > 6 * LIMIT  # ~13M params, ~210 MB of training state
    growth = run["hwm"] - base["hwm"]
    assert growth < LIMIT + MARGIN, (growth / 2 ** 20, run)
    assert 0 < run["tier_peak"] <= LIMIT
    assert all(n > 0 for n in run["files"]) and run["dir_gone"]
    assert all(l == l and l < 10 for l in run["losses"])  # finite
    assert os.listdir(tmp_path / "run") == []
