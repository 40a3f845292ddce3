"""A boosted model takes batches wherever the user made them (issue: the README snippet fed a
CPU batch to a model on cuda:0). On a CPU machine the model's device is made the ``meta``
device, which refuses CPU inputs exactly as a CUDA model does; on a GPU every plugin is run
for real with CPU batches (``gpu`` tests, one nccl rank)."""

import collections

import pytest
import torch
from support.dist import run_distributed
from support.engine import lm_loss
from torch.utils.data import DataLoader

from colossal_lab.engine.device import DeviceDataLoader, to_device
from colossal_lab.engine.models import GPT, GPTConfig

Pair = collections.namedtuple("Pair", "a b")


def test_to_device_moves_nested_tensors_and_keeps_the_rest():
    x, y = torch.ones(2), torch.zeros(3)
    obj = {"idx": x, "more": [y, (x, "text", 3)], "pair": Pair(x, None), "n": 1}
    out = to_device(obj, torch.device("meta"))
    assert out["idx"].device.type == "meta" and out["more"][0].device.type == "meta"
    assert out["more"][1][0].device.type == "meta" and out["more"][1][1:] == ("text", 3)
    assert isinstance(out["pair"], Pair) and out["pair"].a.device.type == "meta" and out["pair"].b is None
    assert out["n"] == 1 and obj["idx"].device.type == "cpu"  # the user's batch is untouched
    same = to_device(obj, torch.device("cpu"))
    assert same is obj  # nothing to move: no copy, no new containers


def _meta_model():
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", n_layer=1)).to("meta")


def test_a_model_elsewhere_refuses_cpu_batches_unwrapped():
    """The failure this guards against, reproduced: the plain module does not move inputs."""
    x = torch.randint(0, 256, (2, 8))
    with pytest.raises(RuntimeError, match="device"):
        _meta_model()(x, x)


@pytest.mark.parametrize("plugin", ["none", "ddp", "zero1", "zero2"])
def test_boosted_model_and_dataloader_move_cpu_batches(plugin, monkeypatch):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import DDPPlugin, LowLevelZeroPlugin, base, ddp, low_level_zero

    meta = torch.device("meta")
    for mod in (base, ddp, low_level_zero):  # "this rank's device" is the meta device
        monkeypatch.setattr(mod, "default_device", lambda: meta)
    monkeypatch.setattr("colossal_lab.engine.wrappers.default_device", lambda: meta)
    chosen = {"none": None, "ddp": DDPPlugin(), "zero1": LowLevelZeroPlugin(stage=1),
              "zero2": LowLevelZeroPlugin(stage=2)}[plugin]
    if chosen is not None:
        monkeypatch.setattr(type(chosen), "compute_device", lambda self: meta)
    booster = Booster(plugin=chosen)
    if chosen is None:
        monkeypatch.setattr(type(booster.plugin), "compute_device", lambda self: meta)
    x = torch.randint(0, 256, (4, 8))
    data = [{"idx": x[i], "targets": x[i]} for i in range(4)]
    model, _, _, loader, _ = booster.boost(_meta_model(), dataloader=DataLoader(data, batch_size=2))
    # positional, keyword and nested-in-a-dict inputs made on the CPU
    logits, loss = model(x, targets=x)
    assert logits.device.type == "meta" and loss.device.type == "meta"
    assert isinstance(loader, DeviceDataLoader) and len(loader) == 2
    batches = list(loader)
    assert all(t.device.type == "meta" for b in batches for t in b.values())
    assert model.tokens == 4 * 8


def test_device_dataloader_is_its_loader_otherwise():
    dl = DataLoader(list(range(10)), batch_size=4, drop_last=True)
    wrapped = DeviceDataLoader(dl, torch.device("meta"))
    assert len(wrapped) == 2 and wrapped.batch_size == 4 and wrapped.dataset is dl.dataset
    assert [b.device.type for b in wrapped] == ["meta", "meta"]


def _hybrid_cpu_batches(rank, world, pp):
    """pp=1 forward and a pp=2 pipeline fed CPU batches, on whatever device the plugin picked."""
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    torch.manual_seed(0)
    kw = dict(pp_size=pp, num_microbatches=2) if pp > 1 else {}
    booster = Booster(plugin=HybridParallelPlugin(**kw))
    model = GPT(GPTConfig.preset("tiny", n_layer=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, crit, *_ = booster.boost(model, opt, lm_loss)
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    out = booster.execute_pipeline(iter([{"idx": x, "targets": x}]), model, crit, opt)
    opt.step()
    return None if out["loss"] is None else float(out["loss"])


def test_hybrid_pipeline_takes_cpu_batches():
    losses = run_distributed(_hybrid_cpu_batches, 2, 2)
    assert losses[0] is None and losses[1] is not None and losses[1] > 0


# ---- on a GPU: every plugin, one nccl rank, batches made on the CPU --------------------------

def _gpu_plugin_step(rank, world, name, precision, tmp):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import DDPPlugin, GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin

    torch.cuda.set_device(0)
    plugin = {"ddp": lambda: DDPPlugin(), "zero1": lambda: LowLevelZeroPlugin(stage=1),
              "zero2": lambda: LowLevelZeroPlugin(stage=2),
              "gemini_cpu": lambda: GeminiPlugin(placement_policy="cpu"),
              "gemini_auto_nvme": lambda: GeminiPlugin(placement_policy="auto", device_memory_limit=64 << 20,
                                                       nvme_offload_dir=tmp, nvme_offload_frac=1.0),
              "hybrid": lambda: HybridParallelPlugin()}[name]()
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_layer=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    booster = Booster(plugin=plugin, mixed_precision=precision)
    data = [{"idx": torch.randint(0, 256, (16,)), "targets": torch.randint(0, 256, (16,))} for _ in range(8)]
    model, opt, _, loader, _ = booster.boost(model, opt, dataloader=DataLoader(data, batch_size=4))
    losses = []
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))  # a CPU batch
    for _ in range(3):
        _, loss = model(x, x)
        booster.backward(loss, opt)
        booster.clip_grad_by_norm(opt, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    devices = {t.device.type for b in loader for t in b.values()}
    if hasattr(plugin, "close"):
        plugin.close()
    return losses, devices


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "gemini_cpu", "gemini_auto_nvme", "hybrid"])
def test_every_plugin_takes_cpu_batches_on_gpu(name, precision, tmp_path):
    (losses, devices), = run_distributed(_gpu_plugin_step, 1, name, precision, str(tmp_path), backend="nccl")
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert devices == {"cuda"}
