"""Warm-up memory statistics: non-model (activation) bytes per operator, rising through forward
and falling through backward, and the 'rest of the step' bound ``auto`` caches against."""

from __future__ import annotations

import torch

from colossal_lab.engine import Booster
from colossal_lab.engine.models import GPT, GPTConfig
from colossal_lab.engine.plugins import GeminiPlugin


def test_nonmodel_memory_per_access_rises_then_falls():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=3, n_head=2, n_embd=64))
    plugin = GeminiPlugin(placement_policy="auto", precision="fp32", chunk_size_mb=0.07)
    booster = Booster(plugin=plugin, mixed_precision="fp32")
    gm, gopt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randint(0, 256, (4, 64))
    _, loss = gm(x, x)
    mgr = gm.manager
    fwd_peak = mgr.nonmodel.current
    assert fwd_peak > 0 and fwd_peak == mgr.nonmodel.peak  # forward only adds saved activations
    booster.backward(loss, gopt)
    gopt.step()
    tr = mgr.trace
    at = tr.nonmodel_at
    assert tr.ready and len(at) == len(tr.order) > 4
    top = at.index(max(at))
    assert 0 < top < len(at) - 1
    assert at[:top + 1] == sorted(at[:top + 1])          # non-decreasing through forward
    assert at[-1] < max(at) / 2                           # released through backward
    assert mgr.nonmodel.current < fwd_peak / 4            # unpacked tensors were uncounted
    # the bound auto uses: the most still needed from a position to the end of the step
    tr.begin_step()
    assert tr.nonmodel_ahead(-1) == max(at)
    for cid in tr.order:                                  # replay the step
        tr.record(cid)
    assert tr.nonmodel_ahead(-1) == at[-1]
    # a second step with the learned statistics still trains
    _, loss2 = gm(x, x)
    booster.backward(loss2, gopt)
    gopt.step()
    assert torch.isfinite(loss2)
    plugin.close()
