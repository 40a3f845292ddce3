"""Benchmark: tokens/s of the reference GPT under ``Booster(DDPPlugin)`` vs a plain PyTorch loop.

Both contenders run in this one process on a 1-rank process group (gloo on CPU, nccl on CUDA),
same model size, same data, same optimizer; they alternate repeat by repeat (order flipped
every repeat) so drift in the machine's load hits both. Prints one JSON line: ``ratio`` = ours /
baseline median tokens/s, and ``paired_ratio_median``, the median of per-repeat ratios (each
pair timed back to back: the figure to trust on a busy machine).

    python bench/engine.py --preset small --steps 3 --repeats 21
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from colossal_lab.engine import Booster, telemetry
from colossal_lab.engine.models import GPT, GPTConfig
from colossal_lab.engine.plugins import DDPPlugin


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=None, help="default: the preset's block_size")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--baseline", default="plain", choices=["plain", "ddp"],
                    help="plain: a bare torch loop; ddp: the same loop on torch DDP "
                         "(on one rank DDPPlugin skips DDP, so this flatters us)")
    ap.add_argument("--telemetry", action="store_true",
                    help="subscribe a no-op listener (StepMetrics built every step)")
    return ap.parse_args()


def _one_rank_group() -> torch.device:
    """A 1-rank default process group (nccl on CUDA, gloo on CPU); returns the device."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    return device


def _ours(cfg, precision: str) -> Callable:
    """Our contender's step: the GPT under ``Booster(DDPPlugin)``."""
    torch.manual_seed(0)
    booster = Booster(plugin=DDPPlugin(), mixed_precision=precision)
    m1 = GPT(cfg)
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-4)
    m1, o1, *_ = booster.boost(m1, o1)

    def step_ours(x):
        _, loss = m1(x[:, :-1], x[:, 1:])
        booster.backward(loss, o1)
        o1.step()
        o1.zero_grad()

    return step_ours


def _baseline(cfg, args, device: torch.device) -> Callable:
    """The baseline's step: what a user writes without us (autocast + GradScaler for reduced
    precision), on torch DDP with ``--baseline ddp``."""
    torch.manual_seed(0)
    m2 = GPT(cfg).to(device)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-4)
    if args.baseline == "ddp":
        m2 = torch.nn.parallel.DistributedDataParallel(m2, device_ids=[0] if device.type == "cuda" else None)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    scaler = torch.amp.GradScaler(device.type) if args.precision == "fp16" else None

    def step_base(x):
        if dtype is None:
            _, loss = m2(x[:, :-1], x[:, 1:])
        else:
            with torch.autocast(device.type, dtype=dtype):
                _, loss = m2(x[:, :-1], x[:, 1:])
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(o2)
            scaler.update()
        else:
            loss.backward()
            o2.step()
        o2.zero_grad()

    return step_base


def _alternate(steps: Dict[str, Callable], data: list, args, seq: int, device: torch.device) -> tuple:
    """After two warm-up steps each, ``--repeats`` timed repeats of ``--steps`` steps per contender,
    the order flipped every repeat. Returns ({name: wall tokens/s per repeat}, {name: CPU tokens/s
    per repeat})."""
    tps: Dict[str, List[float]] = {"ours": [], "base": []}
    cpu_tps: Dict[str, List[float]] = {"ours": [], "base": []}

    def timed(step, name):
        _sync(device)
        t, c = time.perf_counter(), time.process_time()
        for i in range(args.steps):
            step(data[i % len(data)])
        _sync(device)
        tokens = args.batch * seq * args.steps
        cpu_tps[name].append(tokens / (time.process_time() - c))
        return tokens / (time.perf_counter() - t)

    for step in (steps["ours"], steps["base"]):  # warm-up (allocator, DDP buckets, optimizer state)
        step(data[0])
        step(data[1])
    for r in range(args.repeats):
        for name in (("ours", "base") if r % 2 == 0 else ("base", "ours")):
            tps[name].append(timed(steps[name], name))
    return tps, cpu_tps


def _report(args, device: torch.device, seq: int, tps: dict, cpu_tps: dict) -> dict:
    """The JSON line: median ratio, paired ratios (wall and CPU), every repeat's tokens/s."""
    ours, base = tps["ours"], tps["base"]
    mo, mb = statistics.median(ours), statistics.median(base)
    # paired: each repeat timed both back to back, so load drift cancels within a pair
    paired = statistics.median(o / b for o, b in zip(ours, base))
    # CPU time of this process: on a CPU run with one thread, insensitive to other processes
    # competing for the cores (wall-clock figures on a shared machine swing widely)
    cpu_paired = statistics.median(o / b for o, b in zip(cpu_tps["ours"], cpu_tps["base"]))
    return {
        "bench": "engine", "contenders": f"Booster(DDPPlugin) vs {args.baseline} torch loop", "device": str(device),
        "preset": args.preset, "precision": args.precision, "batch": args.batch, "seq": seq,
        "steps": args.steps, "repeats": args.repeats, "telemetry": args.telemetry,
        "threads": torch.get_num_threads(),
        "ratio": round(mo / mb, 4), "paired_ratio_median": round(paired, 4),
        "cpu_time_paired_ratio_median": round(cpu_paired, 4),
        "ours_tokens_per_s_median": round(mo, 1), "baseline_tokens_per_s_median": round(mb, 1),
        "ours_tokens_per_s": [round(v, 1) for v in ours], "baseline_tokens_per_s": [round(v, 1) for v in base],
    }


def main() -> None:
    args = _parse()
    device = _one_rank_group()
    cfg = GPTConfig.preset(args.preset)
    seq = args.seq or cfg.block_size
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg.vocab_size, (args.batch, seq + 1), generator=g).to(device) for _ in range(4)]
    steps = {"ours": _ours(cfg, args.precision), "base": _baseline(cfg, args, device)}
    unsub = telemetry.subscribe(lambda e: None) if args.telemetry else None
    tps, cpu_tps = _alternate(steps, data, args, seq, device)
    if unsub:
        unsub()
    print(json.dumps(_report(args, device, seq, tps, cpu_tps)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
