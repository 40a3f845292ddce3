"""One trial of ``bench/gemini.py --device cuda``: one contender, one GPT size, in this (fresh) process.

The harness (``bench/gemini_cuda.py``) starts this module once per trial so that an OOM or a crash
costs one rung and leaves nothing behind in the allocator. Every contender gets the same GPT
(activation checkpointing on every block), the same data, bf16 compute and the same memory cap:
``torch.cuda.set_per_process_memory_fraction`` on CUDA; on CPU the peak RSS growth over the
post-import baseline (VmHWM), checked after the steps, since CPU has no allocator cap.

Contenders: ``torch`` (autocast bf16, fused AdamW, eager build), ``fsdp2_offload`` (``fully_shard`` per
block and at the root with ``CPUOffloadPolicy``, meta build + ``to_empty`` + init as torch's docs
recommend), ``gemini_{cuda,cpu,auto,auto_nvme}`` (ours, built under ``lazy_init()``),
``colossalai_gemini`` and ``deepspeed_offload`` (their libraries, where importable).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from rss import reset_peak, rss_mib  # bench/ is sys.path[0] when run as a script

GIB = 1 << 30
#: of the cap, kept out of Gemini's compute tier: activations, logits, the loss's fp32 copy
GEMINI_MARGIN = 0.25


def _one_rank_group(cuda: bool) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)


def gpt_config(spec: dict):
    from colossal_lab.engine.models import GPTConfig

    d, layers = spec["d"], spec["layers"]
    return GPTConfig(vocab_size=spec["vocab"], block_size=spec["seq"], n_layer=layers, n_head=max(1, d // 128)
                     if spec["device"] == "cuda" else max(1, d // 64), n_embd=d, activation_checkpointing=True)


def merged_busy(intervals, wall_us: float) -> float:
    """Fraction of ``wall_us`` covered by the union of ``(start, end)`` intervals (overlaps once)."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return min(1.0, total / wall_us) if wall_us > 0 else 0.0


def busy_fraction(step, cuda: bool) -> tuple:
    """(fraction, source) of one profiled step: on CUDA the union of kernel times over the step's
    wall time (torch.profiler, CUDA activity; copies and memsets are not kernels: an offloading
    contender's transfers do not count as busy); on CPU the union of aten-op times over wall."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        _sync(cuda)
        t0 = time.perf_counter()
        step()
        _sync(cuda)
        wall_us = (time.perf_counter() - t0) * 1e6
    want = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    iv = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == want and
          (not e.name.startswith(("Memcpy", "Memset")) if cuda else e.name.startswith("aten::"))]
    return merged_busy(iv, wall_us), "profiler kernel time / wall" if cuda else "profiler aten-op time / wall"


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _build_torch(cfg, dev, spec):
    from colossal_lab.engine.models import GPT

    with torch.device(dev):  # built where it trains: no host copy first
        model = GPT(cfg)
    fused = {"fused": True} if dev.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16)

    def step(x):
        with amp:
            _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, model.num_params(), None


def _build_fsdp2(cfg, dev, spec):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from colossal_lab.engine.models import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    n = model.num_params()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    off = CPUOffloadPolicy(pin_memory=dev.type == "cuda")  # pinning needs an accelerator
    for block in model.blocks.values():
        fully_shard(block, mp_policy=mp, offload_policy=off)
    fully_shard(model, mp_policy=mp, offload_policy=off)
    model.to_empty(device="cpu")  # offloaded: sharded parameters live on the host
    with torch.no_grad():
        for name, mod in model.named_modules():
            model.init_module(name, mod)  # the root's call fills the rope buffers
    model.rope_cos, model.rope_sin = model.rope_cos.to(dev), model.rope_sin.to(dev)  # buffers: not offloaded
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # CPU parameters: the CPU AdamW

    def step(x):
        _, loss = model(x[:, :-1].to(dev), x[:, 1:].to(dev))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, n, None


def _booster_step(booster, model, opt, dev):
    """One training step through a Colossal-AI-shaped booster (ours and Colossal-AI's share the API)."""
    def step(x):
        _, loss = model(x[:, :-1].to(dev), x[:, 1:].to(dev))
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        return loss

    return step


def _build_gemini(cfg, dev, spec):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.lazy import lazy_init
    from colossal_lab.engine.models import GPT
    from colossal_lab.engine.plugins import GeminiPlugin

    policy = spec["contender"].split("_", 1)[1]
    cap = spec["cap_bytes"]
    kw = {"placement_policy": "auto" if policy == "auto_nvme" else policy}
    if dev.type == "cuda" or policy != "cuda":  # plan against the cap, as on a card of that size
        kw["device_memory_limit"] = int(cap * (1 - GEMINI_MARGIN))
    if policy == "auto_nvme":
        kw.update(nvme_offload_dir=spec["nvme_dir"], nvme_offload_frac=spec.get("nvme_frac", 1.0))
    with lazy_init():
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    plugin = GeminiPlugin(precision="bf16", pin_memory=dev.type == "cuda", **kw)
    booster = Booster(plugin=plugin, mixed_precision="bf16")
    model, opt, *_ = booster.boost(model, opt)
    n = sum(i.numel for c in model.manager.chunks for i in c.infos)

    return _booster_step(booster, model, opt, dev), n, plugin.close


def _build_colossalai(cfg, dev, spec):  # pragma: no cover - needs colossalai and CUDA
    from colossalai.booster import Booster
    from colossalai.booster.plugin import GeminiPlugin
    from colossalai.lazy import LazyInitContext
    from colossalai.nn.optimizer import HybridAdam

    from colossal_lab.engine.models import GPT

    with LazyInitContext(default_device=dev):
        model = GPT(cfg)
    opt = HybridAdam(model.parameters(), lr=1e-4)
    plugin = GeminiPlugin(placement_policy="auto", precision="bf16", pin_memory=True)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, opt)
    n = sum(p.numel() for p in model.parameters())

    return _booster_step(booster, model, opt, dev), n, None


def _build_deepspeed(cfg, dev, spec):  # pragma: no cover - needs deepspeed and CUDA
    import deepspeed

    from colossal_lab.engine.models import GPT

    conf = {"train_micro_batch_size_per_gpu": spec["batch"], "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "offload_param": {"device": "cpu", "pin_memory": True}},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    with deepspeed.zero.Init(config_dict_or_path=conf):
        model = GPT(cfg)
    n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, config=conf)

    def step(x):
        _, loss = engine(x[:, :-1].to(dev), x[:, 1:].to(dev))
        engine.backward(loss)
        engine.step()
        return loss

    return step, n, None


BUILDERS = {"torch": _build_torch, "fsdp2_offload": _build_fsdp2, "gemini_cuda": _build_gemini,
            "gemini_cpu": _build_gemini, "gemini_auto": _build_gemini, "gemini_auto_nvme": _build_gemini,
            "colossalai_gemini": _build_colossalai, "deepspeed_offload": _build_deepspeed}


def _warm_up(spec: dict, dev) -> None:
    """One step of the contender itself on a one-layer GPT before the RSS baseline (CPU cap), so the
    libraries and kernels it loads lazily (optimizers, dynamo, the plugin) do not count as its state."""
    from colossal_lab.engine.models import GPTConfig

    cfg = GPTConfig(vocab_size=spec["vocab"], block_size=8, n_layer=1, n_head=1, n_embd=64,
                    activation_checkpointing=True)
    step, _, close = BUILDERS[spec["contender"]](cfg, dev, dict(spec, cap_bytes=64 << 20))
    step(torch.randint(0, cfg.vocab_size, (1, 9)))
    if close is not None:
        close()


def run(spec: dict) -> dict:
    """Train ``spec['steps']`` steps (+1 profiled when ``spec['profile']``); returns the trial's row.

    ``ok`` is False with ``error`` "oom" (the allocator refused under the cap), "over cap" (CPU: peak
    RSS growth above the cap), "nan loss", or the exception's type and text; a crash that kills the
    process is the harness's to report."""
    cuda = spec["device"] == "cuda"
    _one_rank_group(cuda)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    cap = spec["cap_bytes"]
    if cuda:
        torch.cuda.set_device(0)
        total = torch.cuda.get_device_properties(0).total_memory
        cap = spec["cap_bytes"] = min(cap, total)  # "the whole card" is passed as a huge cap
        torch.cuda.set_per_process_memory_fraction(cap / total, 0)
        torch.cuda.reset_peak_memory_stats(0)
    else:
        _warm_up(spec, dev)
        reset_peak()
    base = rss_mib()
    torch.manual_seed(0)
    cfg = gpt_config(spec)
    x = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq"] + 1), generator=torch.Generator().manual_seed(0))
    x = x.to(dev)
    row = {"ok": False}
    close = None
    try:
        t0 = time.perf_counter()
        step, row["params"], close = BUILDERS[spec["contender"]](cfg, dev, spec)
        row["build_s"] = time.perf_counter() - t0
        times, losses = [], []
        for _ in range(spec["steps"]):
            _sync(cuda)
            t0 = time.perf_counter()
            loss = step(x)
            _sync(cuda)
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach().float().item()))
        row.update(step_s=times, losses=losses)
        if spec.get("profile"):
            row["busy"], row["busy_source"] = busy_fraction(lambda: step(x), cuda)
        row["ok"] = all(v == v for v in losses)  # a NaN loss did not train
        if not row["ok"]:
            row["error"] = "nan loss"
    except torch.OutOfMemoryError:
        row["error"] = "oom"
    except Exception as exc:  # a refusal (Gemini's "does not fit" at boost) or a failure: this rung is lost
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        if close is not None:
            with contextlib.suppress(Exception):
                close()
    if cuda:
        row["peak_bytes"] = torch.cuda.max_memory_allocated(0)
    else:
        row["peak_bytes"] = int((rss_mib("VmHWM") - base) * 2 ** 20)
        if row["ok"] and row["peak_bytes"] > cap:
            row.update(ok=False, error="over cap")
    row["host_peak_rss_mib"] = rss_mib("VmHWM")
    dist.destroy_process_group()
    return row


def main(arg: str) -> None:
    spec = json.loads(arg)
    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    print(json.dumps(run(spec)), flush=True)


if __name__ == "__main__":
    import sys

    main(sys.argv[1])
