"""The NVMe tier with O_DIRECT (``nvme_direct_io=True``): real files, unaligned tensors, training."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from support.engine import tiny_model
from support.gemini import STEPS, adamw_reference, token_batches, train_gemini

from colossal_lab.engine.gemini.nvme import NVMeStore, check_direct_io
from colossal_lab.engine.plugins import GeminiPlugin


def _direct_ok(path) -> bool:
    try:
        check_direct_io(str(path))
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("direct", [False, True])
def test_store_round_trips_unaligned_tensors(tmp_path, direct):
    if direct and not _direct_ok(tmp_path):
        pytest.skip("this file system has no O_DIRECT")
    st = NVMeStore(str(tmp_path), io_threads=3, direct=direct)
    g = torch.Generator().manual_seed(0)
    # sizes around the 4 KiB block and the 8 MiB bounce buffer; a view at an odd offset
    big = torch.randn(2 * (8 << 20) // 4 + 777, generator=g)
    tensors = {"a": torch.randn(1000, generator=g), "b": torch.randint(0, 255, (4097,), dtype=torch.uint8),
               "c": big, "d": torch.randn(3001, generator=g)[3:], "e": torch.empty(0)}
    for k, t in tensors.items():
        st.write(k, t).result()
    for k, t in tensors.items():
        out = torch.full_like(t, 7)
        st.read(k, out).result()
        assert torch.equal(out, t), k
        size = os.path.getsize(st.path(k))
        assert size >= t.numel() * t.element_size()
        if direct:
            assert size % 4096 == 0  # O_DIRECT writes whole blocks
    assert st.bytes_written == sum(t.numel() * t.element_size() for t in tensors.values())
    d = st.dir
    st.close()
    assert not os.path.exists(d)


def test_training_with_direct_io_matches_pytorch(tmp_path):
    if not _direct_ok(tmp_path):
        pytest.skip("this file system has no O_DIRECT")
    base = tiny_model()
    batches = token_batches(STEPS)
    ref_losses, ref_params = adamw_reference(copy.deepcopy(base), batches)
    plugin = GeminiPlugin(placement_policy="auto", precision="fp32", device_memory_limit=400_000,
                          nvme_offload_dir=str(tmp_path), nvme_direct_io=True, chunk_size_mb=0.07, max_prefetch=1)
    _, gm, _, losses = train_gemini(copy.deepcopy(base), batches, plugin)
    assert gm.manager.nvme.direct and gm.manager.nvme.bytes_read > 0
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    sd = gm.state_dict()
    for k, v in ref_params.items():
        torch.testing.assert_close(sd[k], v, atol=1e-5, rtol=1e-4)
    d = gm.manager.nvme.dir
    plugin.close()
    assert not os.path.exists(d)


def test_direct_io_bad_input():
    with pytest.raises(ValueError, match="nvme_direct_io=True.*needs nvme_offload_dir"):
        GeminiPlugin(nvme_direct_io=True)
    if os.path.isdir("/dev/shm") and not _direct_ok("/dev/shm"):  # tmpfs: no O_DIRECT
        with pytest.raises(ValueError, match="does not support O_DIRECT"):
            GeminiPlugin(nvme_offload_dir="/dev/shm/colossal-direct-test", nvme_direct_io=True)
