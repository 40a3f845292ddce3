"""Mixed precision: bf16/fp16 train, fp16 skips an overflowed step on every rank, fp8 is a
clear error without a capable GPU (and trains on one)."""

import pytest
import torch
from support.dist import run_distributed
from support.engine import LR, batch, tiny_model

from colossal_lab.engine import Booster
from colossal_lab.engine.mixed_precision import DynamicLossScaler, fp8_unavailable_reason


def _train_losses(mixed_precision, steps=15):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    booster = Booster(mixed_precision=mixed_precision)
    model, opt, *_ = booster.boost(model, opt)
    losses = []
    for s in range(steps):
        _, loss = model(*batch(s))
        booster.backward(loss, opt)
        opt.clip_grad_by_norm(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    return losses, opt


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_trains(precision):
    losses, opt = _train_losses(precision)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5, losses
    if precision == "fp16":
        assert opt.loss_scaler.skipped_steps == 0


def test_loss_scaler_schedule():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    s.update(False)
    assert s.scale == 8.0
    s.update(False)
    assert s.scale == 16.0
    s.update(True)
    assert s.scale == 8.0 and s.skipped_steps == 1
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([8.0, 16.0, float("nan")])
    assert s.unscale_([p]) is True
    p.grad = torch.tensor([8.0, 16.0, 24.0])
    assert s.unscale_([p]) is False and torch.equal(p.grad, torch.tensor([1.0, 2.0, 3.0]))


def _local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _overflow(rank, world, plugin_name):
    from colossal_lab.engine.plugins import DDPPlugin, LowLevelZeroPlugin

    plugin = DDPPlugin() if plugin_name == "ddp" else LowLevelZeroPlugin(stage=2)
    booster = Booster(plugin=plugin, mixed_precision="fp16")
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt, *_ = booster.boost(model, opt)
    log = []
    for s in range(8):
        _, loss = model(*batch(s, rank, world))
        booster.backward(loss, opt)
        before = [_local(p) for p in model.parameters()]
        scale = opt.loss_scaler.scale
        if s == 2 and rank == 1:  # a real inf in one gradient of ONE rank (its local shard)
            g = next(p.grad for p in model.parameters() if p.grad is not None)
            (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("inf")
        opt.step()
        opt.zero_grad()
        changed = any(not torch.equal(b, _local(p)) for b, p in zip(before, model.parameters()))
        log.append({"loss": loss.item(), "skipped": opt.skipped_last, "changed": changed,
                    "scale_before": scale, "scale_after": opt.loss_scaler.scale})
    return log


def _bf16_sharded(rank, world, stage):
    from support.engine import global_mean

    from colossal_lab.engine.plugins import LowLevelZeroPlugin

    booster = Booster(plugin=LowLevelZeroPlugin(stage=stage), mixed_precision="bf16")
    model = tiny_model()
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    losses = []
    for s in range(10):
        _, loss = model(*batch(s, rank, world))
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
    return losses


def _overflow_both(rank, world):
    out = {name: _overflow(rank, world, name) for name in ("ddp", "zero2")}
    bf16 = {f"bf16_zero{stage}": _bf16_sharded(rank, world, stage) for stage in (1, 2)}
    return out, bf16


def test_fp16_overflow_skips_step_on_every_rank():
    out = run_distributed(_overflow_both, 2, timeout=240)
    for rank_out, bf16 in out:
        for name, losses in bf16.items():  # bf16 under ZeRO-1/2 on 2 ranks trains too
            assert losses[-1] < losses[0] - 0.3, (name, losses)
        for name, log in rank_out.items():
            assert [e["skipped"] for e in log] == [False, False, True] + [False] * 5, name
            assert not log[2]["changed"], "a skipped step must not touch the weights"
            assert all(e["changed"] for i, e in enumerate(log) if i != 2)
            assert log[2]["scale_after"] == log[2]["scale_before"] / 2
            assert all(torch.isfinite(torch.tensor(e["loss"])) for e in log)
            assert log[-1]["loss"] < log[0]["loss"], "training continues after the skipped step"


@pytest.mark.skipif(fp8_unavailable_reason() is None, reason="this machine can run fp8")
def test_fp8_is_a_clear_error_here():
    with pytest.raises(ValueError, match=r"mixed_precision='fp8'.*(compute capability|float8).*bf16"):
        Booster(mixed_precision="fp8")


@pytest.mark.gpu
@pytest.mark.skipif(fp8_unavailable_reason() is not None, reason="needs a CUDA GPU with compute capability >= 8.9")
def test_fp8_trains_on_capable_gpu():
    from colossal_lab.engine.mixed_precision.fp8 import Fp8Linear
    from colossal_lab.engine.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("small"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    booster = Booster(mixed_precision="fp8")
    model, opt, *_ = booster.boost(model, opt)
    assert any(isinstance(m, Fp8Linear) for m in model.modules())
    x = torch.randint(0, 256, (16, 129), device="cuda")
    losses = []
    for _ in range(30):
        _, loss = model(x[:, :-1], x[:, 1:])
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


def test_fp16_loss_scale_survives_checkpoint(tmp_path):
    _, opt = _train_losses("fp16", steps=2)
    opt.loss_scaler.scale, opt.loss_scaler.skipped_steps = 1024.0, 3
    Booster(mixed_precision="fp16").save_optimizer(opt, tmp_path / "optim")
    booster = Booster(mixed_precision="fp16")
    model = tiny_model()
    model, fresh, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    booster.load_optimizer(fresh, tmp_path / "optim")
    assert fresh.loss_scaler.scale == 1024.0 and fresh.loss_scaler.skipped_steps == 3
    assert torch.equal(next(iter(fresh.state.values()))["exp_avg"], next(iter(opt.state.values()))["exp_avg"])


def test_fp8_linear_math_on_cpu():
    """The fp8 module itself (torch._scaled_mm also runs on CPU in this torch): the forward is
    e4m3-accurate, the backward is the bf16 math, names and parameters are unchanged. The
    Booster still refuses fp8 on CPU: there it is slower, not faster."""
    from colossal_lab.engine.mixed_precision.fp8 import Fp8Linear, convert_to_fp8

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(128, 10))
    keys = list(model.state_dict())
    ref = torch.nn.Linear(64, 128, bias=False)
    ref.weight.data.copy_(model[0].weight.data)
    try:
        assert convert_to_fp8(model) == 1  # 10 outputs is not a multiple of 16: stays as it is
    except Exception as exc:  # pragma: no cover
        pytest.skip(f"no fp8 matmul on this CPU build: {exc}")
    assert isinstance(model[0], Fp8Linear) and type(model[1]) is torch.nn.Linear
    assert list(model.state_dict()) == keys
    x = torch.randn(32, 64, requires_grad=True)
    try:
        y = model[0](x)
    except RuntimeError as exc:  # pragma: no cover
        pytest.skip(f"no fp8 matmul on this CPU build: {exc}")
    want = ref(x)
    err = (y.float() - want).abs().max() / want.abs().max()
    assert 0 < err < 0.08  # e4m3 (3 mantissa bits), not exact, not garbage
    g = torch.randn_like(want)
    y.float().backward(g)
    want_gw = (g.bfloat16().t() @ x.detach().bfloat16()).float()
    torch.testing.assert_close(model[0].weight.grad, want_gw, rtol=2e-2, atol=2e-2)
    assert model[0].weight.grad.dtype == torch.float32  # master-weight gradients stay fp32


def test_fp8_gpt_trains_on_cpu_kernels():
    from colossal_lab.engine.mixed_precision.fp8 import convert_to_fp8

    model = tiny_model()
    try:
        n = convert_to_fp8(model)
        model(*batch(0))
    except RuntimeError as exc:  # pragma: no cover
        pytest.skip(f"no fp8 matmul on this CPU build: {exc}")
    assert n == 2 * 7 + 1  # 7 linears per block + lm_head
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for s in range(6):  # each CPU fp8 matmul is slow (~0.3 s at these shapes); the loss falls by ~1 in 6 steps
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(*batch(s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
