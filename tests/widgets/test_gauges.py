"""MemoryGauges: one gauge per (rank, tier), the latest sample winning whatever the arrival order;
the memory sampler measures real host memory and a real NVMe directory and feeds them."""

import pytest

# Jupyter-side packages this module needs: absent (a bare GPU image), it skips.
pytest.importorskip("plotly")

from support.widgets import MIB, wait_for

from colossal_lab.engine import telemetry as T
from colossal_lab.engine.telemetry.memory import MemorySampler, MemorySamplerConfig, sample_memory
from colossal_lab.widgets import MemoryGauges


def test_gauges_values_latest_sample_wins():
    ev = [T.MemorySample(0, 2.0, "cpu", 300 * MIB, 1000 * MIB),
          T.MemorySample(0, 1.0, "cpu", 100 * MIB, 1000 * MIB),  # older, arrives late
          T.MemorySample(1, 1.5, "nvme", 50 * MIB, 500 * MIB),
          T.MemorySample(1, 1.5, "nvme", 50 * MIB, 500 * MIB)]   # duplicate
    g = MemoryGauges.from_events(ev)
    assert g.values() == {(0, "cpu"): (300 * MIB, 1000 * MIB), (1, "nvme"): (50 * MIB, 500 * MIB)}
    inds = {t.name: t for t in g.figure.data}
    assert set(inds) == {"rank 0 cpu", "rank 1 nvme"}
    assert inds["rank 0 cpu"].value == pytest.approx(300.0)
    assert inds["rank 0 cpu"].gauge.axis.range == (0, 1000.0)
    assert inds["rank 1 nvme"].domain.row == 1 and inds["rank 1 nvme"].domain.column == 1


def test_memory_sampler_measures_real_host_and_nvme_dir(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "chunk0.bin").write_bytes(b"x" * 123_457)
    by_tier = {s.tier: s for s in sample_memory(rank=2, nvme_dir=str(tmp_path), cuda=False)}
    assert set(by_tier) == {"cpu", "nvme"}
    assert by_tier["nvme"].used == 123_457 and by_tier["nvme"].capacity > by_tier["nvme"].used
    assert 0 < by_tier["cpu"].used < by_tier["cpu"].capacity and by_tier["cpu"].rank == 2
    with pytest.raises(FileNotFoundError, match="nvme_dir"):
        sample_memory(0, nvme_dir=str(tmp_path / "missing"))
    got = []

    def two_of_each():  # the sampler thread appends to ``got`` while this reads it
        tiers = [e.tier for e in list(got) if isinstance(e, T.MemorySample)]
        return tiers.count("nvme") >= 2 and tiers.count("cpu") >= 2

    unsub = T.subscribe(got.append)
    try:
        with MemorySampler(MemorySamplerConfig(rank=1, interval=0.05, nvme_dir=str(tmp_path), cuda=False)):
            assert wait_for(two_of_each)
    finally:
        unsub()
    tiers = [e.tier for e in got if isinstance(e, T.MemorySample)]
    assert tiers.count("nvme") >= 2 and tiers.count("cpu") >= 2
    g = MemoryGauges.from_events(got)
    assert g.values()[(1, "nvme")][0] == 123_457
