"""Memory gauges with no sampler code in the training cell: ``relay.attach(cluster)`` (what
``%colossal dashboard`` calls) starts one memory sampler per rank, which reports RSS, the
NVMe directories Gemini's store registers, and leaves the tiers Gemini reports itself to it;
detach, restart and stop end or re-install it. Real 2-rank gloo clusters, real training."""

import pytest

# Jupyter-side packages this module needs: absent (a bare GPU image), it skips.
pytest.importorskip("zmq")
pytest.importorskip("plotly")
pytest.importorskip("ipyparallel")
pytest.importorskip("psutil")

import os
import threading
import time

import psutil
import torch

import colossal_lab as cl
from colossal_lab import relay as relay_mod
from colossal_lab.engine import telemetry as T
from colossal_lab.engine.gemini.nvme import NVMeStore
from colossal_lab.engine.telemetry.memory import (
    MemorySampler,
    MemorySamplerConfig,
    register_nvme_dir,
    registered_nvme_dirs,
    sample_memory,
    unregister_nvme_dir,
)
from colossal_lab.widgets import MemoryGauges

MIB = 1 << 20
SAMPLER = MemorySampler.THREAD_NAME


# ---------------------------------------------------------------- on the ranks
def _thread_names():
    import threading

    return sorted(t.name for t in threading.enumerate())


def _train_ddp(stop, max_seconds):
    """Plain DDP training until the test creates the file ``stop`` (or ``max_seconds``): no
    sampler, no telemetry code. The ranks agree on the step they stop at."""
    import time

    import torch
    import torch.distributed as dist

    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import DDPPlugin

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    booster = Booster(plugin=DDPPlugin())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt, *_ = booster.boost(model, opt)
    steps, t_end = 0, time.monotonic() + max_seconds
    while True:
        x = torch.randn(32, 64)
        loss = model(x).pow(2).mean()
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        steps += 1
        time.sleep(0.05)
        done = torch.tensor([float(os.path.exists(stop) or time.monotonic() > t_end)])
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
        if done.item():
            return steps


def _nvme_store_for(seconds, nbytes):
    """Open a Gemini NVMe store, write ``nbytes``, hold it ``seconds``, close it, wait a bit.
    Returns (bytes written, registered while open, registered after close, close wall time)."""
    import shutil
    import tempfile
    import time

    import torch

    from colossal_lab.engine.gemini.nvme import NVMeStore
    from colossal_lab.engine.telemetry.memory import registered_nvme_dirs

    root = tempfile.mkdtemp(prefix="autosample_nvme_")
    store = NVMeStore(root)
    store.write("block0", torch.ones(nbytes // 4, dtype=torch.float32)).result()
    during = store.dir in registered_nvme_dirs()
    time.sleep(seconds)
    store.close()
    closed_at = time.time()
    after = store.dir in registered_nvme_dirs()
    shutil.rmtree(root, ignore_errors=True)
    time.sleep(1.5)
    return nbytes, during, after, closed_at


def _train_gemini(steps, pause):
    """Gemini on CPU + NVMe (its chunk manager reports cpu and nvme samples itself)."""
    import shutil
    import tempfile
    import time

    import torch
    import torch.distributed as dist

    from colossal_lab.engine import Booster
    from colossal_lab.engine.models import GPT, GPTConfig
    from colossal_lab.engine.plugins import GeminiPlugin

    rank = dist.get_rank()
    torch.manual_seed(0)
    nvme = tempfile.mkdtemp(prefix=f"autosample_gemini{rank}_")
    t_start = time.time()
    model = GPT(GPTConfig.preset("tiny"))
    plugin = GeminiPlugin(placement_policy="auto", precision="fp32", device_memory_limit=1 << 20,
                          chunk_size_mb=0.125, nvme_offload_dir=nvme, nvme_offload_frac=1.0)
    booster = Booster(plugin=plugin, mixed_precision="fp32")
    gm, gopt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 32), generator=g)
        _, loss = gm(x, x.roll(-1, 1))
        booster.backward(loss, gopt)
        gopt.step()
        gopt.zero_grad()
        time.sleep(pause)
    t_end = time.time()
    plugin.close()
    shutil.rmtree(nvme, ignore_errors=True)
    return t_start, t_end


# ---------------------------------------------------------------- the kernel's side
class _Collector:
    """Every MemorySample re-emitted on this process's bus, with whether the rank call that
    produced it was still running when it arrived."""

    def __init__(self):
        self.lock = threading.Lock()
        self.samples = []
        self.running = threading.Event()
        self.unsub = T.subscribe(self)

    def __call__(self, e):
        if isinstance(e, T.MemorySample):
            with self.lock:
                self.samples.append((e, self.running.is_set()))

    def of(self, rank, tier, during_only=False):
        with self.lock:
            return [e for e, live in self.samples
                    if e.rank == rank and e.tier == tier and (live or not during_only)]


def _run_in_thread(cluster, fn, *args):
    out, done = {}, threading.Event()

    def go():
        try:
            out["result"] = cluster.run(fn, *args)
        except BaseException as e:  # re-raised by the caller
            out["error"] = e
        finally:
            done.set()

    th = threading.Thread(target=go)
    th.start()
    return th, done, out


def _all_received(relay):
    """Flush every rank's queue and wait until this process has received all the ranks sent;
    returns the ranks' stats. (The receiver counts a message just before it re-emits its
    events: only the last one, the flush of what a rank emitted after its call's last
    0.2 s, may still be on its way to the collector.)"""
    stats = relay.rank_stats()
    deadline = time.time() + 30
    while time.time() < deadline and relay.received < sum(s["sent"] for s in stats):
        time.sleep(0.05)
    return stats


def _samplers(cluster):
    return [names.count(SAMPLER) for names in cluster.run(_thread_names)]


def test_ddp_training_fills_the_gauges_of_both_ranks_without_sampler_code(cluster, tmp_path):
    col = _Collector()
    gauges = MemoryGauges(live=False)
    relay = relay_mod.attach(cluster, memory_interval=0.3)
    try:
        assert _samplers(cluster) == [1, 1]
        # attaching again (another %colossal dashboard) keeps one sampler per rank
        assert relay_mod.attach(cluster, memory_interval=0.3) is relay
        assert _samplers(cluster) == [1, 1]
        col.running.set()
        stop = tmp_path / "stop"  # training goes on until the samples are here: no race with them
        th, done, out = _run_in_thread(cluster, _train_ddp, str(stop), 90.0)
        deadline = time.time() + 60
        while time.time() < deadline and not done.is_set():
            if all(len(col.of(r, "cpu", during_only=True)) >= 3 for r in (0, 1)):
                break
            time.sleep(0.05)
        arrived_while_training = not done.is_set() and all(
            len(col.of(r, "cpu", during_only=True)) >= 3 for r in (0, 1))
        stop.touch()
        th.join(timeout=120)
        col.running.clear()
        assert "error" not in out, out.get("error")
        assert all(n > 0 for n in out["result"])
        assert arrived_while_training, "memory samples only arrived after training returned"
        for r in (0, 1):
            live = col.of(r, "cpu", during_only=True)
            assert len(live) >= 3, (r, live)
            times = [e.time for e in live]
            assert times == sorted(times) and len(set(times)) == len(times), times
            for e in live:  # measured: the rank's RSS (and its peak) against what it could grow to
                assert 10 * MIB < e.used <= e.peak and e.used < e.capacity, e
        gauges.flush()
        drawn = gauges.details()
        assert {(0, "cpu"), (1, "cpu")} <= set(drawn), drawn
        names = {d["name"] for d in gauges.figure.to_dict()["data"]}
        assert {"rank 0 cpu", "rank 1 cpu"} <= names
        stats = relay.rank_stats()
        assert all(s["memory_samples"] >= 3 for s in stats), stats
    finally:
        gauges.close()
        col.unsub()
        relay.detach()
    assert _samplers(cluster) == [0, 0]  # detach stops every rank's sampler thread
    # and attaching with memory_interval=None starts none
    relay = relay_mod.attach(cluster, memory_interval=None)
    try:
        assert _samplers(cluster) == [0, 0]
    finally:
        relay.detach()


def test_a_gemini_nvme_store_shows_an_nvme_tier_while_it_is_open(cluster):
    col = _Collector()
    relay = relay_mod.attach(cluster, memory_interval=0.2)
    try:
        col.running.set()
        res = cluster.run(_nvme_store_for, 2.0, 3 * MIB)
        col.running.clear()
        _all_received(relay)
        for r, (nbytes, during, after, closed_at) in enumerate(res):
            assert during and not after, (r, during, after)  # registered by the store, unregistered at close
            nv = col.of(r, "nvme")
            assert nv, f"rank {r}: no nvme sample"
            assert max(e.used for e in nv) >= nbytes and all(e.capacity > e.used for e in nv)
            # the directory is reported only while the store has it open
            assert not [e for e in nv if e.time > closed_at + 0.05], [e.time - closed_at for e in nv]
    finally:
        col.unsub()
        relay.detach()


def test_tiers_gemini_reports_are_left_to_it(cluster):
    """Gemini's chunk manager reports its placement (bytes it put in cpu / nvme against its
    budgets); the sampler must not interleave its RSS under the same (rank, tier), or a gauge
    would jump between two meanings of "used"."""
    col = _Collector()
    relay = relay_mod.attach(cluster, memory_interval=0.2)
    try:
        # the sampler reports RSS before Gemini starts: here, before the ranks are even asked to
        deadline = time.time() + 30
        while time.time() < deadline and not all(col.of(r, "cpu") for r in (0, 1)):
            time.sleep(0.05)
        res = cluster.run(_train_gemini, 6, 0.3)
        stats = _all_received(relay)
        for r, (t_start, t_end) in enumerate(res):
            cpu = col.of(r, "cpu")
            sampled = [e for e in cpu if e.peak > 0]  # the sampler's: a peak RSS is always > 0
            engine = [e for e in cpu if e.peak == 0]  # Gemini's: its accounting has no peak
            assert [e for e in sampled if e.time < t_start], f"rank {r}: no RSS sample before Gemini"
            assert engine, f"rank {r}: Gemini's own cpu samples did not arrive"
            first_engine = min(e.time for e in engine)
            interleaved = [e for e in sampled if first_engine < e.time <= t_end]
            assert not interleaved, f"rank {r}: {len(interleaved)} RSS samples between Gemini's"
            assert col.of(r, "nvme"), f"rank {r}: no nvme tier"
        assert all(s["memory_deferred"] > 0 for s in stats), stats
    finally:
        col.unsub()
        relay.detach()


def test_attach_rejects_a_bad_memory_interval(cluster):
    for bad in (0, -1, "0.5", True):
        with pytest.raises(ValueError, match="attach\\(memory_interval="):
            relay_mod.attach(cluster, memory_interval=bad)


def test_restart_reinstalls_the_sampler_and_stop_ends_it():
    c = cl.launch(n=2, backend="gloo", threads=1)
    col = _Collector()
    try:
        relay = relay_mod.attach(c, memory_interval=0.2)
        old = c.pids
        assert _samplers(c) == [1, 1]
        t_restart = time.time()
        c.restart()
        assert not set(c.pids) & set(old)
        assert _samplers(c) == [1, 1]  # the relay's restart hook installed it on the new ranks
        assert relay_mod.attach(c, memory_interval=0.2) is relay and _samplers(c) == [1, 1]
        deadline = time.time() + 20
        while time.time() < deadline and not all(
                [e for e in col.of(r, "cpu") if e.time > t_restart] for r in (0, 1)):
            time.sleep(0.1)
        assert all([e for e in col.of(r, "cpu") if e.time > t_restart] for r in (0, 1))
        pids = c.pids
    finally:
        c.stop()
        col.unsub()
    # the sampler threads went with their processes, and the relay closed itself
    _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=10)
    assert not alive, alive
    deadline = time.time() + 5
    while time.time() < deadline and relay.active:
        time.sleep(0.1)
    assert not relay.active
    assert relay._on_restart not in c.restart_hooks


# ---------------------------------------------------------------- in this process
def test_nvme_store_registers_its_directory_and_the_sampler_reports_it(tmp_path):
    store = NVMeStore(str(tmp_path))
    try:
        assert store.dir in registered_nvme_dirs()
        store.write("b", torch.ones(MIB // 4)).result()
        by_tier = {s.tier: s for s in sample_memory(0, cuda=False, registered_nvme=True)}
        assert by_tier["nvme"].used >= MIB and by_tier["nvme"].capacity > by_tier["nvme"].used
        assert "nvme" not in {s.tier for s in sample_memory(0, cuda=False)}  # only when asked
    finally:
        store.close()
    assert store.dir not in registered_nvme_dirs()
    assert "nvme" not in {s.tier for s in sample_memory(0, cuda=False, registered_nvme=True)}


def test_cpu_sample_carries_the_peak_rss():
    (s,) = sample_memory(0, cuda=False)
    assert s.tier == "cpu" and 0 < s.used <= s.peak and s.reserved == 0 and s.util is None
    big = bytearray(64 * MIB)  # touched pages: RSS and its peak grow
    big[::4096] = b"x" * len(big[::4096])
    (s2,) = sample_memory(0, cuda=False)
    assert s2.peak >= s.used + 32 * MIB
    del big


def test_registry_and_sampler_reject_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="register_nvme_dir"):
        register_nvme_dir(str(tmp_path / "missing"))
    with pytest.raises(TypeError, match="register_nvme_dir"):
        register_nvme_dir(42)
    unregister_nvme_dir(str(tmp_path / "never"))  # unknown: ignored (close is idempotent)
    p = register_nvme_dir(tmp_path)
    register_nvme_dir(tmp_path)
    unregister_nvme_dir(tmp_path)
    assert p in registered_nvme_dirs()  # two registrations, one undone
    unregister_nvme_dir(tmp_path)
    assert p not in registered_nvme_dirs()
    with pytest.raises(ValueError, match="defer_s"):
        MemorySampler(MemorySamplerConfig(rank=0, defer_s=0))
    with pytest.raises(ValueError, match="interval"):
        MemorySampler(MemorySamplerConfig(rank=0, interval=0))
    with pytest.raises(FileNotFoundError, match="nvme_dir"):
        MemorySampler(MemorySamplerConfig(rank=0, nvme_dir=[str(tmp_path), str(tmp_path / "x")]))
    with pytest.raises(TypeError, match="MemorySamplerConfig"):
        MemorySampler({"rank": 0})


def test_gauges_draw_peak_reserved_and_util_where_present():
    g = MemoryGauges.from_events([
        T.MemorySample(0, 1.0, "cuda", 100 * MIB, 1000 * MIB, peak=300 * MIB, reserved=50 * MIB, util=42.0),
        T.MemorySample(0, 1.0, "cpu", 10 * MIB, 100 * MIB)])
    data = {d["name"]: d for d in g.figure.to_dict()["data"]}
    cuda, cpu = data["rank 0 cuda"], data["rank 0 cpu"]
    assert cuda["gauge"]["threshold"]["value"] == 300.0
    assert cuda["gauge"]["steps"][0]["range"] == [100.0, 150.0]
    assert "peak 300" in cuda["title"]["text"] and "util 42%" in cuda["title"]["text"] \
        and "+50 reserved" in cuda["title"]["text"]
    assert "threshold" not in cpu["gauge"] and "steps" not in cpu["gauge"]
    assert "peak" not in cpu["title"]["text"] and "util" not in cpu["title"]["text"]
    assert "peak 300" in g.summary() and "util 42%" in g.summary()


@pytest.mark.gpu
def test_cuda_sample_measures_the_allocator():
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.empty(64 * MIB, dtype=torch.uint8, device=dev)
    (s,) = [s for s in sample_memory(0, device=dev) if s.tier == "cuda"]
    assert s.used >= 64 * MIB and s.peak >= s.used and s.reserved >= 0
    assert s.capacity == torch.cuda.get_device_properties(dev).total_memory
    assert s.used == torch.cuda.memory_allocated(dev)
    assert s.used + s.reserved == torch.cuda.memory_reserved(dev)
    assert s.util is None or 0.0 <= s.util <= 100.0
    del x
