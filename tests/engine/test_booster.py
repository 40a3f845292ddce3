"""Booster surface: bad configs fail early with one clear error; dataloader split; no_sync
gradient accumulation; attribute fall-through and telemetry in a single process."""

import pytest
import torch
import torch.distributed as dist
from support.dist import run_distributed
from support.engine import LR, batch, tiny_model
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from colossal_lab.engine import Booster, telemetry
from colossal_lab.engine.plugins import DDPPlugin, LowLevelZeroPlugin


class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(10)


def test_stage3_points_to_gemini():
    with pytest.raises(ValueError, match=r"stage=3.*GeminiPlugin"):
        LowLevelZeroPlugin(stage=3)
    with pytest.raises(ValueError, match=r"stage must be 1 or 2"):
        LowLevelZeroPlugin(stage=0)


def test_unknown_precision_lists_valid_ones():
    with pytest.raises(ValueError, match=r"mixed_precision='fp64'.*'fp32', 'fp16', 'bf16', 'fp8'"):
        Booster(mixed_precision="fp64")
    with pytest.raises(TypeError, match="plugin"):
        Booster(plugin="ddp")


def test_dataset_without_length_fails_before_work():
    booster = Booster(plugin=DDPPlugin())
    with pytest.raises(ValueError, match=r"prepare_dataloader\(dataset=...\).*no length"):
        booster.prepare_dataloader(_Stream(), batch_size=2)
    model = tiny_model()
    with pytest.raises(ValueError, match=r"boost\(dataloader=...\).*no length"):
        booster.boost(model, torch.optim.AdamW(model.parameters()), dataloader=DataLoader(_Stream()))
    with pytest.raises(ValueError, match="batch_size"):
        booster.prepare_dataloader(TensorDataset(torch.arange(4)), batch_size=0)


def test_single_process_wrapper_and_step_metrics():
    booster = Booster()
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt, *_ = booster.boost(model, opt)
    assert model.cfg.n_layer == 2 and model.generate(torch.zeros(1, 1, dtype=torch.long), 3).shape == (1, 4)
    events = []
    unsub = telemetry.subscribe(events.append)
    try:
        for s in range(3):
            idx, tgt = batch(s)
            _, loss = model(idx=idx, targets=tgt)
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()
    finally:
        unsub()
    assert [(e.step, e.tokens) for e in events] == [(i, idx.numel()) for i in range(3)]
    assert events[-1].loss == pytest.approx(loss.item())
    with pytest.raises(RuntimeError, match="save_optimizer"):
        opt.state_dict()


def _accumulate(rank, world):
    """Two micro-batches with no_sync on the first == one step on the whole batch."""
    out = {}
    ds = TensorDataset(torch.arange(10))
    loader = Booster(plugin=DDPPlugin()).prepare_dataloader(ds, batch_size=5)
    out["samples"] = sorted(int(x) for b in loader for x in b[0])
    for name, plugin in (("ddp", DDPPlugin()), ("zero2", LowLevelZeroPlugin(stage=2))):
        booster = Booster(plugin=plugin)
        model = tiny_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt, *_ = booster.boost(model, opt)
        idx, tgt = batch(0, rank, world)
        half = idx.shape[0] // 2
        with booster.no_sync(model, opt):
            _, l1 = model(idx[:half], tgt[:half])
            booster.backward(l1 / 2, opt)
        if name == "ddp":  # inside no_sync the gradients stayed local: ranks differ
            g = next(model.parameters()).grad.detach().clone()
            both = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(both, g)
            out["ddp_local_grads_differ"] = not torch.allclose(both[0], both[1])
        _, l2 = model(idx[half:], tgt[half:])
        booster.backward(l2 / 2, opt)
        opt.step()
        sd = booster.plugin.get_checkpoint_io().full_model_state_dict(model)
        out[name] = {k: v for k, v in sd.items()} if rank == 0 else None
    return out


def test_prepare_dataloader_and_no_sync_on_two_ranks():
    out = run_distributed(_accumulate, 2, timeout=240)
    assert sorted(out[0]["samples"] + out[1]["samples"]) == list(range(10))
    assert not set(out[0]["samples"]) & set(out[1]["samples"])
    assert out[0]["ddp_local_grads_differ"] and out[1]["ddp_local_grads_differ"]
    ref = tiny_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _, loss = ref(*batch(0))
    loss.backward()
    opt.step()
    for name in ("ddp", "zero2"):
        got = out[0][name]
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")


def test_rebuild_refuses_a_stepped_optimizer_and_foreign_params():
    from colossal_lab.engine.wrappers import rebuild_optimizer

    model = tiny_model()
    names = {id(p): n for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    new = rebuild_optimizer(opt, names, dict(model.named_parameters()))
    assert type(new) is torch.optim.AdamW and new.defaults["lr"] == LR
    stray = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(ValueError, match="not in the model"):
        rebuild_optimizer(stray, names, dict(model.named_parameters()))
    _, loss = model(*batch(0))
    loss.backward()
    opt.step()
    with pytest.raises(ValueError, match="already stepped.*load_optimizer"):
        rebuild_optimizer(opt, names, dict(model.named_parameters()))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        Booster().boost("not a model")
