"""Bad Gemini input fails with one clear error before any work (no files, no chunks)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn

from colossal_lab.engine import Booster
from colossal_lab.engine.models import GPT, GPTConfig
from colossal_lab.engine.plugins import GeminiPlugin


@pytest.mark.parametrize("kwargs, needle", [
    ({"placement_policy": "gpu"}, "placement_policy"),
    ({"shard_param_frac": 1.5}, "shard_param_frac"),
    ({"nvme_offload_frac": -0.1}, "nvme_offload_frac"),
    ({"nvme_offload_frac": 0.5}, "nvme_offload_dir"),
    ({"precision": "int8"}, "precision"),
    ({"device_memory_limit": 0}, "device_memory_limit"),
    ({"chunk_size_mb": 0}, "chunk_size_mb"),
    ({"max_prefetch": -1}, "max_prefetch"),
    ({"offload_param_frac": 0.5}, "placement_policy='static'"),
])
def test_bad_arguments(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        GeminiPlugin(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_policy_without_cuda():
    with pytest.raises(ValueError, match="placement_policy='cuda'.*no CUDA"):
        GeminiPlugin(placement_policy="cuda")


def test_unwritable_nvme_dir(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="nvme_offload_dir.*not writable"):
        GeminiPlugin(nvme_offload_dir=str(blocker / "sub"))


def _boost(plugin, model):
    return Booster(plugin=plugin, mixed_precision="fp32").boost(model, torch.optim.AdamW(model.parameters()))


def test_disk_too_small_for_planned_bytes(tmp_path):
    # A 3.4 T-parameter model on the meta device (planning touches no memory): with a 1 TiB
    # compute budget its ~60 TiB of parameters and Adam state would need far more disk than exists.
    model = nn.Sequential(*[nn.Linear(1 << 16, 1 << 16, bias=False, device="meta") for _ in range(800)])
    plugin = GeminiPlugin(placement_policy="auto", precision="fp32", device_memory_limit=1 << 40,
                          nvme_offload_dir=str(tmp_path))
    with pytest.raises(ValueError, match="nvme_offload_dir has .* GiB free"):
        _boost(plugin, model)
    assert os.listdir(tmp_path) == []  # nothing started


def test_memory_limit_too_small_for_a_chunk_pair():
    model = GPT(GPTConfig.preset("tiny"))
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ValueError, match="device_memory_limit=1000.*largest chunk pair"):
        _boost(GeminiPlugin(precision="fp32", device_memory_limit=1000), model)
    assert [p.data_ptr() for p in model.parameters()] == before  # parameters untouched


def test_model_does_not_fit_without_nvme():
    model = GPT(GPTConfig.preset("tiny"))
    with pytest.raises(ValueError, match="nvme_offload_dir"):
        _boost(GeminiPlugin(precision="fp32", device_memory_limit=400_000, chunk_size_mb=0.07), model)


def test_chunk_smaller_than_largest_parameter():
    model = GPT(GPTConfig.preset("tiny"))
    with pytest.raises(ValueError, match="chunk_size_mb=0.01.*tok_emb.weight|chunk_size_mb=0.01.*lm_head.weight"):
        _boost(GeminiPlugin(precision="fp32", chunk_size_mb=0.01), model)


def test_unsupported_optimizer():
    model = GPT(GPTConfig.preset("tiny"))
    with pytest.raises(ValueError, match="optimizer=SGD"):
        Booster(plugin=GeminiPlugin(precision="fp32")).boost(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_fp32_plan_counts_the_shared_master_once():
    """fp32 chunks homed in the compute tier's RAM keep one copy (parameter = master): the plan
    must count 16 bytes/parameter, not 20, or a budget torch fits in is refused. The tier's
    measured peak over real steps stays within the limit."""
    from colossal_lab.engine.gemini.placement import working_set_bytes

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    probe = GeminiPlugin(placement_policy="cpu", precision="fp32", chunk_size_mb=0.07)
    gm, gopt, *_ = _boost(probe, copy.deepcopy(model))
    chunks = gm.manager.chunks
    padded = sum(c.size for c in chunks)
    ws = working_set_bytes(chunks, probe.max_prefetch)
    limit = 16 * padded + ws + 4096
    assert limit < 20 * padded + ws  # what the old 20 bytes/parameter plan required
    probe.close()
    plugin = GeminiPlugin(placement_policy="cpu", precision="fp32", chunk_size_mb=0.07, device_memory_limit=limit)
    gm, gopt, *_ = _boost(plugin, copy.deepcopy(model))
    assert all(c.param_home == c.optim_home == "cpu" for c in gm.manager.chunks)
    x = torch.randint(0, 256, (2, 32))
    for _ in range(2):
        _, loss = gm(x, x)
        gopt.backward(loss)
        gopt.step()
    tier = gm.manager.stack.compute
    assert 0 < tier.peak <= limit
    plugin.close()
