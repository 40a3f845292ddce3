"""A disk that fills up mid-run: one clear error, and the last checkpoint still loads.

Real full disk: a 4 MiB tmpfs mounted for the test (needs root, as in CI; skipped otherwise).
"""

from __future__ import annotations

import copy
import errno
import os
import subprocess

import pytest
import torch
from support.engine import tiny_model
from support.gemini import LR, adamw_reference, token_batches

from colossal_lab.engine import Booster
from colossal_lab.engine.checkpoint_io import load_state_dict_shards
from colossal_lab.engine.plugins import GeminiPlugin


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small_disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(path: str) -> int:
    """Write zeros until the file system is full; returns the bytes written."""
    n = 0
    with open(path, "wb", buffering=0) as f:
        block = b"\0" * 65536
        try:
            while True:
                n += f.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return n


def test_full_disk_mid_run_raises_clearly_and_checkpoint_survives(small_disk, tmp_path):
    base = tiny_model()
    batches = token_batches(4)
    _, ref_after_2 = adamw_reference(copy.deepcopy(base), batches[:2])
    plugin = GeminiPlugin(placement_policy="auto", precision="fp32", device_memory_limit=400_000,
                          nvme_offload_dir=str(small_disk), chunk_size_mb=0.07, max_prefetch=1)
    model = copy.deepcopy(base)
    booster = Booster(plugin=plugin, mixed_precision="fp32")
    gm, gopt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
    for x, y in batches[:2]:
        _, loss = gm(x, y)
        booster.backward(loss, gopt)
        gopt.step()
    ckpt = tmp_path / "ckpt"
    booster.save_model(gm, str(ckpt))
    assert _fill(str(small_disk / "filler")) > 0  # someone else fills the disk
    with pytest.raises(OSError) as info:
        x, y = batches[2]
        _, loss = gm(x, y)
        booster.backward(loss, gopt)
        gopt.step()
    assert info.value.errno == errno.ENOSPC
    msg = str(info.value)
    assert "Gemini NVMe tier" in msg and "nvme_offload_dir" in msg and "Checkpoints written before" in msg
    store_dir = gm.manager.nvme.dir
    plugin.close()
    assert not os.path.exists(store_dir)  # offload files cleaned up after the failure
    plain = tiny_model()
    plain.load_state_dict(load_state_dict_shards(ckpt))  # the last checkpoint is intact
    for k, v in ref_after_2.items():
        torch.testing.assert_close(plain.state_dict()[k], v, atol=1e-5, rtol=1e-4)
