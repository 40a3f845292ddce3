"""2-rank DDP, ZeRO-1 and ZeRO-2 follow the single-process loss curve; ZeRO-2 shards the
optimizer state; the booster emits one StepMetrics per step. One multi-process run for all."""

import pytest
import torch
from support.dist import run_distributed
from support.engine import (
    GLOBAL_BATCH,
    LR,
    SEQ,
    boosted_losses,
    param_groups,
    reference_losses,
    state_bytes,
    tiny_model,
)

STEPS = 20


def _train(rank, world, plugin_name):
    from colossal_lab.engine import Booster, telemetry
    from colossal_lab.engine.plugins import DDPPlugin, LowLevelZeroPlugin

    plugin = {"ddp": lambda: DDPPlugin(), "zero1": lambda: LowLevelZeroPlugin(stage=1),
              "zero2": lambda: LowLevelZeroPlugin(stage=2)}[plugin_name]()
    booster = Booster(plugin=plugin)
    model = tiny_model()
    opt = torch.optim.AdamW(param_groups(model), lr=LR)  # two groups survive the ZeRO rebuild
    model, opt, *_ = booster.boost(model, opt)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    events = []
    unsub = telemetry.subscribe(events.append)
    losses = boosted_losses(model, opt, booster, STEPS, rank, world)
    unsub()
    steps = [e for e in events if isinstance(e, telemetry.StepMetrics)]
    return {"losses": losses, "state_bytes": state_bytes(opt),
            "metrics": [(e.rank, e.step, e.tokens, e.loss, e.seconds) for e in steps]}


def _all_plugins(rank, world):
    return {name: _train(rank, world, name) for name in ("ddp", "zero1", "zero2")}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all_plugins, 2, timeout=240)


@pytest.fixture(scope="module")
def reference():
    return reference_losses(STEPS)


@pytest.mark.parametrize("plugin", ["ddp", "zero1", "zero2"])
def test_follows_single_process_curve(runs, reference, plugin):
    for rank_out in runs:
        got = rank_out[plugin]["losses"]
        assert got == pytest.approx(reference, abs=2e-5), plugin
    assert reference[-1] < reference[0] - 0.5  # it really trained


def test_zero_shards_optimizer_state(runs):
    ddp = [r["ddp"]["state_bytes"] for r in runs]
    for stage in ("zero1", "zero2"):
        mine = [r[stage]["state_bytes"] for r in runs]
        assert sum(mine) == pytest.approx(ddp[0], rel=0.01), stage  # nothing lost
        for b in mine:
            assert b <= 0.6 * ddp[0], (stage, mine, ddp)  # ~1/world each
    z2 = [r["zero2"]["state_bytes"] for r in runs]
    assert max(z2) / ddp[0] == pytest.approx(0.5, abs=0.05)


def test_step_metrics_every_step(runs):
    for rank, r in enumerate(runs):
        for plugin in ("ddp", "zero1", "zero2"):
            m = r[plugin]["metrics"]
            assert [e[1] for e in m] == list(range(STEPS))
            assert all(e[0] == rank for e in m)
            assert all(e[2] == GLOBAL_BATCH // 2 * SEQ for e in m)  # this rank's tokens
            assert all(e[4] > 0 for e in m)
            assert all(isinstance(e[3], float) for e in m)
