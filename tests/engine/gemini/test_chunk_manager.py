"""Gemini's writes into a chunk's compute buffer must stay invisible to autograd's saved tensors.

A chunk that leaves the compute tier between a module's forward and its backward is gathered
again into the same storage before the backward (``ChunkManager._start_load`` /
``_wait_load`` / ``_issue_gather``), with the values it had in the forward. The parameters,
and the views of them autograd saved (the head's weight for the logits matmul), must not see
that refill as an in-place modification, whichever way the model was built.

On a CPU-only machine with one process a RAM home *is* the compute buffer and an NVMe read
lands in it through ``os.preadv``, so the tensor-op refill that a GPU machine runs for every
host-homed chunk is reached here by (a) a stack shaped like a GPU machine's — a compute tier
separate from host RAM, both in RAM (the ``device_tier`` fixture) — and (b) two real gloo
ranks, whose sharded chunks are all-gathered into the buffer before each use.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from support.dist import run_distributed
from support.engine import batch

from colossal_lab.engine import Booster
from colossal_lab.engine.gemini.tiers import UNLIMITED, Tier, TierStack
from colossal_lab.engine.lazy import lazy_init, materialize
from colossal_lab.engine.models import GPT, GPTConfig
from colossal_lab.engine.plugins import GeminiPlugin

LR = 1e-2
STEPS = 4
SEED = 3
# a head much larger than a block, as at vocab 50304: its chunk is the one memory pressure evicts
CFG = GPTConfig.preset("tiny", vocab_size=2048)


def _models(cfg=CFG, seed=SEED):
    """A lazily built GPT and the same GPT materialised eagerly (equal values once Gemini has
    materialised the lazy one under the same seed)."""
    with lazy_init():
        lazy = GPT(cfg)
    with lazy_init():
        eager = GPT(cfg)
    torch.manual_seed(seed)
    materialize(eager, "cpu")
    return lazy, eager


def _batches(steps, k=1):
    """``steps`` batches, each ``k`` of the shared test stream's batches stacked (activations
    large next to the model, as at scale)."""
    out = []
    for s in range(steps):
        xs, ys = zip(*(batch(k * s + i) for i in range(k)))
        out.append((torch.cat(xs), torch.cat(ys)))
    return out


def _reference(model, batches):
    """Plain PyTorch fp32 AdamW: losses, the first step's gradients, final parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, grads = [], None
    for x, y in batches:
        _, loss = model(x, y)
        loss.backward()
        if grads is None:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _chunk_grads(mgr):
    """Gradients Gemini handed to the optimizer homes (one rank, RAM homes), by parameter name."""
    out = {}
    for c in mgr.chunks:
        g = mgr._grad_shard[c.id]
        for info in c.infos:
            out[info.name] = g[info.offset:info.end].view(info.shape).clone()
    return out


def _train(model, batches, plugin, precision, rank=0, world=1):
    """Train through Gemini; also record which chunks were loaded while backward ran."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    booster = Booster(plugin=plugin, mixed_precision=precision)
    torch.manual_seed(SEED)  # the lazy model's values come from the same seed as the eager one
    gm, gopt, *_ = booster.boost(model, opt)
    mgr = gm.manager
    reloads = []
    start = mgr._start_load

    def spy(c):
        if mgr.in_backward and mgr.trace.ready:  # the warm-up's saved-tensor hooks skip version checks
            reloads.append(c.id)
        start(c)

    mgr._start_load = spy
    losses, grads = [], None
    for x, y in batches:
        n = x.shape[0] // world
        _, loss = gm(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        booster.backward(loss, gopt)
        if grads is None and world == 1:
            grads = _chunk_grads(mgr)
        gopt.step()
        losses.append(loss.item())
    head = next(c.id for c in mgr.chunks for i in c.infos if i.name == "lm_head.weight")
    return {"losses": losses, "grads": grads, "params": gm.state_dict(), "head_reloaded": head in reloads,
            "peak": mgr.compute.peak, "capacity": mgr.compute.capacity}


@pytest.fixture
def device_tier(monkeypatch):
    """The stack of a GPU machine, in RAM: compute tier (with ``device_memory_limit``) → host RAM
    (→ NVMe), so host-homed chunks are copied into their compute buffer as on a GPU (the tier
    keeps the name ``cuda``; the device is the CPU, so no streams or pinned memory)."""

    def build(cls, device, device_memory_limit, nvme_dir):
        tiers = [Tier("cuda", device_memory_limit or UNLIMITED, torch.device("cpu")),
                 Tier("cpu", UNLIMITED, torch.device("cpu"))]
        if nvme_dir is not None:
            tiers.append(Tier("nvme", shutil.disk_usage(nvme_dir).free, None))
        return cls(tiers)

    monkeypatch.setattr(TierStack, "build", classmethod(build))


# ---- the invariant, directly ----------------------------------------------------------------------
@pytest.mark.parametrize("built", ["lazy", "eager"])
def test_refilling_a_chunk_buffer_leaves_saved_parameters_valid(built):
    """Autograd saved views of the parameters in a forward; every chunk buffer is then rewritten
    in place with the same values (what a reload does): backward still runs and the parameters'
    version counters did not move."""
    lazy, eager = _models()
    model = lazy if built == "lazy" else eager
    plugin = GeminiPlugin(placement_policy="cpu", precision="fp32")
    torch.manual_seed(SEED)
    gm, gopt, *_ = Booster(plugin=plugin).boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    x, y = batch(0)
    _, loss = gm(x, y)
    versions = {n: p._version for n, p in model.named_parameters()}
    for c in gm.manager.chunks:
        c.full.copy_(c.full.clone())
    assert {n: p._version for n, p in model.named_parameters()} == versions
    gopt.backward(loss)  # raised "modified by an inplace operation" for the lazily built model
    gopt.step()


# ---- the GPU machine's reload path, on CPU ------------------------------------------------------
@pytest.mark.parametrize("policy,limit", [("cpu", None), ("auto", 7_500_000)])
def test_chunk_reloaded_between_forward_and_backward_matches_pytorch(device_tier, policy, limit):
    """fp32, lazily built: the head's chunk leaves the compute tier after its forward and is copied
    back from host RAM for its backward; losses, first-step gradients and final weights equal
    plain PyTorch AdamW's, and the compute tier stays within its limit."""
    lazy, eager = _models()
    batches = _batches(STEPS, k=4)
    ref_losses, ref_grads, ref_params = _reference(copy.deepcopy(eager), batches)
    plugin = GeminiPlugin(placement_policy=policy, precision="fp32", device_memory_limit=limit)
    out = _train(lazy, batches, plugin, "fp32")
    assert out["head_reloaded"]  # the pattern under test happened
    assert out["losses"] == pytest.approx(ref_losses, abs=1e-5)
    for k, g in ref_grads.items():
        torch.testing.assert_close(out["grads"][k], g, atol=1e-6, rtol=1e-4)
    for k, v in ref_params.items():
        torch.testing.assert_close(out["params"][k], v, atol=1e-5, rtol=1e-4)
    if limit is not None:
        assert out["peak"] <= limit == out["capacity"]


@pytest.mark.parametrize("policy,limit", [("cpu", None), ("auto", 6_000_000)])
def test_bf16_lazy_model_trains_like_the_eager_one_when_chunks_reload(device_tier, policy, limit):
    """The issue's precision: bf16, lazily built, head chunk reloaded for its backward; the run is
    bit-identical to the same model built eagerly (whose parameters never shared the buffer's
    version counter), and the loss falls."""
    lazy, eager = _models()
    batches = _batches(STEPS, k=4)
    runs = {}
    for name, model in (("lazy", lazy), ("eager", eager)):
        plugin = GeminiPlugin(placement_policy=policy, precision="bf16", device_memory_limit=limit)
        runs[name] = _train(model, batches, plugin, "bf16")
        assert runs[name]["head_reloaded"], name
    assert runs["lazy"]["losses"] == runs["eager"]["losses"]
    assert runs["lazy"]["losses"][-1] < runs["lazy"]["losses"][0]
    for k, v in runs["eager"]["params"].items():
        assert torch.equal(runs["lazy"]["params"][k], v), k


def test_warmup_counts_gathered_chunk_parameters_as_model_memory(device_tier):
    """The warm-up's activation curve (what ``auto`` keeps cached chunks against) is the same
    whether the chunks are resident on the compute tier or gathered into it from host RAM: a
    gathered chunk's parameters saved for backward are model memory, not activations."""
    peaks = {}
    for policy in ("auto", "cpu"):  # no limit: auto homes every chunk on the compute tier
        lazy, _ = _models()
        plugin = GeminiPlugin(placement_policy=policy, precision="bf16")
        gm, gopt, *_ = Booster(plugin=plugin, mixed_precision="bf16").boost(
            lazy, torch.optim.AdamW(lazy.parameters(), lr=LR))
        mgr = gm.manager
        x, y = _batches(1, k=4)[0]
        _, loss = gm(x, y)
        gopt.backward(loss)
        gopt.step()
        assert mgr.trace.ready
        peaks[policy] = (mgr.nonmodel.peak, {c.param_home for c in mgr.chunks})
    assert peaks["auto"][1] == {"cuda"} and peaks["cpu"][1] == {"cpu"}
    assert peaks["cpu"][0] == peaks["auto"][0] > 0


# ---- two real ranks: sharded chunks all-gathered into the buffer before each use ---------------
def _two_rank_worker(rank, world):
    lazy, eager = _models()
    batches = _batches(STEPS)
    ref_losses, _, ref_params = _reference(copy.deepcopy(eager), batches)
    out = _train(lazy, batches, GeminiPlugin(placement_policy="cpu", precision="fp32"), "fp32", rank, world)
    mean = torch.tensor(out["losses"])
    torch.distributed.all_reduce(mean)
    mean /= world
    return {"loss_err": max(abs(a - b) for a, b in zip(mean.tolist(), ref_losses)),
            "param_err": max((out["params"][k] - v).abs().max().item() for k, v in ref_params.items()),
            "head_reloaded": out["head_reloaded"]}


def test_two_ranks_lazy_model_regathered_for_backward_matches_pytorch():
    for res in run_distributed(_two_rank_worker, 2, timeout=240):
        assert res["head_reloaded"]
        assert res["loss_err"] < 1e-4 and res["param_err"] < 1e-4, res


# ---- the shape, small, on a GPU ----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("policy,limit,n_layer,batch_size", [("cpu", None, 2, 4), ("auto", 224 << 20, 8, 32)])
def test_gpu_vocab_50304_head_reloaded_for_backward(policy, limit, n_layer, batch_size):
    """bf16, d=256, vocab 50304, sequences of 256, lazily built (as large models are): host-homed
    chunks are copied to the device on the side stream, and the head's chunk leaves the device
    after its forward and comes back for its backward. ``cpu`` does that at any size; ``auto``
    only when the activations still to come outweigh the room left, so it runs with the least
    limit the chunks allow and enough layers and batch for that (at 2 layers x 4 sequences it
    keeps the head cached). Trains like the same model built eagerly."""
    cfg = GPTConfig(vocab_size=50304, block_size=256, n_layer=n_layer, n_head=4, n_embd=256)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 50304, (batch_size, 256), generator=g),
                torch.randint(0, 50304, (batch_size, 256), generator=g)) for _ in range(3)]
    runs = {}
    for name, model in zip(("lazy", "eager"), _models(cfg)):
        plugin = GeminiPlugin(placement_policy=policy, precision="bf16", device_memory_limit=limit)
        runs[name] = _train(model, [(x.cuda(), y.cuda()) for x, y in batches], plugin, "bf16")
        assert runs[name]["head_reloaded"], name
        plugin.close()
        torch.cuda.empty_cache()
    assert runs["lazy"]["losses"] == pytest.approx(runs["eager"]["losses"], rel=1e-3)
