"""``bench/gemini.py --device cuda``: the comparison a GPU user makes, in one call.

Contenders (each trial a fresh process, ``bench/gemini_cuda_trial.py``; same GPT, data, bf16,
activation checkpointing on every block, one-rank process group, same memory cap):
plain PyTorch (autocast, fused AdamW), torch FSDP2 ``fully_shard`` + ``CPUOffloadPolicy``, our
Gemini with placement ``cuda``, ``cpu``, ``auto`` and ``auto`` + NVMe, and Colossal-AI's
``GeminiPlugin`` / DeepSpeed ZeRO-Offload where importable (skipped with the reason otherwise).

1. throughput — at the ladder's throughput rungs (0.8B, 1.4B, 2.8B on GPU; tiny ones on CPU),
   equal batch: tokens/s median over the steps after one warm-up step, and a busy fraction of one
   extra, profiled step (GPU: union of kernel times / wall; CPU: union of aten-op times / wall);
   ratios vs FSDP2 + offload and vs plain PyTorch. Under ``--tput-cap-gib`` (GPU default: the whole
   card, so that plain PyTorch and Gemini ``cuda`` train these sizes at all).
2. capacity — per contender, bisection over a GPT ladder reaching >= 10B parameters, 2 steps per
   rung under the cap (``--cap-gib``, 8 GiB: ``torch.cuda.set_per_process_memory_fraction``; on CPU a
   peak-RSS-growth cap, ``--cap-mib``); the largest rung that trains is the capacity (a lower bound
   when it is the ladder's top); ratios vs plain PyTorch. An OOM or crash costs one rung.

``--budget`` seconds bound the whole run: a trial gets at most what is left, and what does not
start in time is reported as skipped for the budget. The goals' trials go first (``plan``).
Prints a table and one JSON line; ``--out DIR`` writes ``gemini_cuda.json`` and ``gemini_cuda.md``.

    python bench/gemini.py --device cuda --nvme-dir /scratch/gbench --budget 330 --out /tmp/gb
    python bench/gemini.py --device cpu --tiny --budget 80 --out /tmp/gb    # the harness on CPU (CI)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CONTENDERS = ["torch", "fsdp2_offload", "gemini_cuda", "gemini_cpu", "gemini_auto", "gemini_auto_nvme",
              "colossalai_gemini", "deepspeed_offload"]
LABELS = {"torch": "plain PyTorch (autocast, AdamW fused on CUDA)",
          "fsdp2_offload": "FSDP2 fully_shard + CPUOffloadPolicy",
          "gemini_cuda": "Gemini cuda", "gemini_cpu": "Gemini cpu", "gemini_auto": "Gemini auto",
          "gemini_auto_nvme": "Gemini auto + NVMe", "colossalai_gemini": "Colossal-AI GeminiPlugin (auto)",
          "deepspeed_offload": "DeepSpeed ZeRO-3 Offload"}
NEEDS = {"colossalai_gemini": "colossalai", "deepspeed_offload": "deepspeed"}

#: (width, layers); GPU ladder with vocab 50304, seq 512: 0.20, 0.31, 0.44, 0.61, 0.81, 1.42, 2.78, 4.39,
#: 6.86, 10.09, 13.12 B parameters (finer at the bottom, where plain PyTorch's capacity falls)
GPU_LADDER = [(1024, 8), (1024, 16), (1280, 16), (1536, 16), (2048, 12), (2048, 24), (2560, 32), (3072, 36),
              (4096, 32), (4096, 48), (5120, 40)]
#: CPU (--tiny) ladder with vocab 256, seq 64: 0.14 ... 42.9 M parameters
TINY_LADDER = [(64, 2), (96, 2), (128, 2), (160, 4), (192, 4), (256, 4), (320, 4), (384, 6), (512, 6), (640, 6),
               (768, 6)]
TPUT_RUNGS = [4, 5, 6]  # GPU: 0.81B, 1.42B, 2.78B


def settings(a) -> dict:
    """The run's shape: data, caps and step counts for the mode."""
    if a.device == "cuda":
        return {"device": "cuda", "ladder": GPU_LADDER, "vocab": 50304, "seq": 512, "batch": a.batch or 8,
                "cap_bytes": int(a.cap_gib * (1 << 30)),
                "tput_cap_bytes": int(a.tput_cap_gib * (1 << 30)) if a.tput_cap_gib else 1 << 50,
                "trial_timeout": 150, "nvme_frac": 0.0 if a.nvme_frac is None else a.nvme_frac}
    return {"device": "cpu", "ladder": TINY_LADDER, "vocab": 256, "seq": 64, "batch": a.batch or 2,
            "cap_bytes": int(a.cap_mib * (1 << 20)), "tput_cap_bytes": int(a.tput_cap_mib * (1 << 20)),
            "trial_timeout": 60, "nvme_frac": 1.0 if a.nvme_frac is None else a.nvme_frac}


def skip_reason(contender: str, device: str):
    """Why ``contender`` cannot run here (None: it can)."""
    lib = NEEDS.get(contender)
    if lib and importlib.util.find_spec(lib) is None:
        return f"skipped: not importable ({lib})"
    if device != "cuda" and (contender == "gemini_cuda" or lib):
        return "skipped: needs CUDA"
    return None


def ladder_params(s: dict) -> list:
    """Parameter count of every rung (built on the meta device: no memory)."""
    sys.path.insert(0, HERE)
    from gemini_cuda_trial import gpt_config

    from colossal_lab.engine.models import GPT

    out = []
    for d, layers in s["ladder"]:
        with torch.device("meta"):
            out.append(GPT(gpt_config(dict(s, d=d, layers=layers))).num_params())
    return out


class Runner:
    """Starts trials in fresh processes inside the run's time budget."""

    def __init__(self, s: dict, budget: float, nvme_dir: str):
        self.s, self.nvme_dir = s, nvme_dir
        self.deadline = time.monotonic() + budget
        self.log = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def trial(self, contender: str, rung: int, steps: int, cap: int, profile: bool = False) -> dict:
        left = self.left()
        if left < 10:  # not worth starting a process
            row = {"ok": False, "skipped": True, "error": "skipped: budget"}
            self.log.append(dict(row, contender=contender, rung=rung))
            return row
        d, layers = self.s["ladder"][rung]
        limit = min(self.s["trial_timeout"], left)
        spec = {k: self.s[k] for k in ("device", "vocab", "seq", "batch", "nvme_frac")}
        spec.update(contender=contender, d=d, layers=layers, steps=steps, cap_bytes=cap, profile=profile,
                    nvme_dir=os.path.join(self.nvme_dir, f"{contender}-{rung}"))
        os.makedirs(spec["nvme_dir"], exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.s["device"] == "cpu":  # tiny models: one thread each (--jobs share the cores); on a GPU host
            env.setdefault("OMP_NUM_THREADS", "1")  # the offloaders' CPU Adam gets every core
        t0 = time.monotonic()
        try:
            p = subprocess.run([sys.executable, os.path.join(HERE, "gemini_cuda_trial.py"), json.dumps(spec)],
                               capture_output=True, text=True, env=env,
                               timeout=limit)
            lines = p.stdout.strip().splitlines()
            if p.returncode == 0 and lines:
                row = json.loads(lines[-1])
            else:
                tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
                row = {"ok": False, "error": f"crash (exit {p.returncode}): {tail[-200:]}"}
        except subprocess.TimeoutExpired:  # cut by the budget: not the contender's failure
            row = {"ok": False, "error": f"timeout ({limit:.0f} s)"} if limit == self.s["trial_timeout"] else \
                {"ok": False, "skipped": True, "error": f"skipped: budget (cut at {limit:.0f} s)"}
        finally:
            shutil.rmtree(spec["nvme_dir"], ignore_errors=True)
        row.update(contender=contender, rung=rung, wall_s=round(time.monotonic() - t0, 1))
        self.log.append(row)
        print(f"# {contender} rung {rung} (d={d}, L={layers}): "
              f"{'ok' if row['ok'] else row.get('error')} in {row['wall_s']} s", file=sys.stderr, flush=True)
        return row


def _pmap(fn, items: list, jobs: int) -> list:
    """``[fn(i) for i in items]``, ``jobs`` at a time (1 on a GPU: trials share the card)."""
    if jobs <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(jobs) as ex:
        return list(ex.map(fn, items))


#: the goals go first, so a short budget still measures them: plain PyTorch's capacity (the ratios'
#: base), Gemini + NVMe's capacity (first probe at the rung of the 20x goal), then the throughput of
#: the contenders the goals compare, size by size (a cut budget leaves whole sizes), then the rest
FIRST_TPUT = ["torch", "fsdp2_offload", "gemini_cuda", "gemini_auto"]
GOAL_RATIO = 20


def tput_cell(r: Runner, contender: str, rung: int, steps: int) -> dict:
    """tokens/s (median after one warm-up step) and busy fraction of one contender at one size."""
    t = r.trial(contender, rung, steps + 1, r.s["tput_cap_bytes"], profile=True)
    if not t["ok"]:
        return {"error": t.get("error")}
    return {"tokens_per_s": r.s["batch"] * r.s["seq"] / statistics.median(t["step_s"][1:]), "busy": t.get("busy"),
            "busy_source": t.get("busy_source"), "peak_bytes": t.get("peak_bytes")}


def tput_ratios(table: dict) -> dict:
    """Adds vs_fsdp2 / vs_torch to every cell of ``{rung: {contender: cell}}`` where both trained."""
    for row in table.values():
        for base, key in (("fsdp2_offload", "vs_fsdp2"), ("torch", "vs_torch")):
            b = row.get(base, {}).get("tokens_per_s")
            for v in row.values():
                if b and "tokens_per_s" in v:
                    v[key] = v["tokens_per_s"] / b
    return table


def bisect(r: Runner, contender: str, n: int, steps: int, first=None) -> dict:
    """Largest rung in [0, n) that trains ``steps`` steps under the cap (trains below, fails above);
    ``first``: the first rung to probe (then halving as usual: at most one trial more)."""
    lo, hi, tried = -1, n, []
    while hi - lo > 1:
        mid = first if first is not None and lo < first < hi else (lo + hi) // 2
        first = None
        t = r.trial(contender, mid, steps, r.s["cap_bytes"])
        tried.append({"rung": mid, "ok": t["ok"], "error": t.get("error"), "peak_bytes": t.get("peak_bytes")})
        if t.get("skipped"):
            return {"rung": lo, "tried": tried, "incomplete": True}
        lo, hi = (mid, hi) if t["ok"] else (lo, mid)
    return {"rung": lo, "tried": tried, "incomplete": False, "top": lo == n - 1}


def cap_result(b: dict, params: list) -> dict:
    b["params"] = params[b["rung"]] if b["rung"] >= 0 else 0
    return b


def plan(run: list, rungs: list, do_tput: bool, do_cap: bool) -> list:
    """The order of work after plain PyTorch's capacity: [("cap", contender) or ("tput", contender, rung)]."""
    tasks = [("cap", "gemini_auto_nvme")] if do_cap and "gemini_auto_nvme" in run else []
    if do_tput:
        tasks += [("tput", c, k) for k in rungs for c in FIRST_TPUT if c in run]
        tasks += [("tput", c, k) for k in rungs for c in run if c not in FIRST_TPUT]
    return tasks + [("cap", c) for c in run if do_cap and c not in ("torch", "gemini_auto_nvme")]


def measure(r: Runner, run: list, params: list, rungs: list, a, jobs: int = 1) -> tuple:
    """(throughput table, capacity per contender): plain PyTorch's capacity first (the ratios' base
    and the 20x probe's rung), then ``plan``'s order, ``jobs`` trials at a time."""
    caps = {}
    if not a.skip_capacity and "torch" in run:
        caps["torch"] = cap_result(bisect(r, "torch", len(params), a.capacity_steps), params)
    base = caps.get("torch", {}).get("params") or 0
    goal = next((i for i, n in enumerate(params) if base and n >= GOAL_RATIO * base), None)

    def work(task):
        if task[0] == "tput":
            return tput_cell(r, task[1], task[2], a.steps)
        c = task[1]
        return cap_result(bisect(r, c, len(params), a.capacity_steps,
                                 first=goal if c == "gemini_auto_nvme" else None), params)

    tasks = plan(run, rungs, not a.skip_throughput, not a.skip_capacity)
    table = {str(k): {} for k in rungs} if not a.skip_throughput else {}
    for task, got in zip(tasks, _pmap(work, tasks, jobs)):
        if task[0] == "cap":
            caps[task[1]] = got
        else:
            table[str(task[2])][task[1]] = got
    for v in caps.values():
        if base:
            v["vs_torch"] = v["params"] / base
    return tput_ratios(table), {c: caps[c] for c in run if c in caps}


def _commit() -> str:
    """The repository's short commit ("unknown" outside a checkout): which code the figures are of."""
    try:
        return subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _fmt_n(n) -> str:
    return "—" if not n else (f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M")


def _short(err) -> str:
    """An error as a table cell: its first 60 characters (the JSON keeps it whole)."""
    err = str(err or "—").replace("|", "/")
    return err if len(err) <= 60 else err[:57] + "..."


def _cell_tput(v: dict) -> str:
    if "tokens_per_s" not in v:
        return _short(v.get("error"))
    busy = f", busy {v['busy']:.2f}" if v.get("busy") is not None else ""
    rel = "".join(f", {v[k]:.2f}× {n}" for k, n in (("vs_fsdp2", "FSDP2"), ("vs_torch", "plain")) if k in v)
    return f"{v['tokens_per_s']:,.0f} tok/s{busy}{rel}"


def markdown(res: dict) -> str:
    """The tables docs/gpu.md keeps: capacity, then throughput per size."""
    s = res["settings"]
    unit = "GiB GPU memory" if s["device"] == "cuda" else "MiB peak RSS growth"
    cap = s["cap_bytes"] / (1 << 30 if s["device"] == "cuda" else 1 << 20)
    lines = [f"### bench/gemini.py --device {s['device']}: {res['when']}, {res['where']}, commit {res['commit']}",
             "", f"Capacity under {cap:g} {unit} (bisection, {res['capacity_steps']} steps per rung, batch "
             f"{s['batch']}×{s['seq']}, bf16, activation checkpointing for all):", "",
             "| contender | largest GPT trained | vs plain PyTorch | rungs tried |", "|---|---|---|---|"]
    for c in res["contenders"]:
        v = res["capacity"].get(c)
        if v is None:
            lines.append(f"| {LABELS[c]} | {res['skipped'].get(c, 'not run')} | — | — |")
            continue
        size = _fmt_n(v["params"]) + (" (ladder top: a lower bound)" if v.get("top") else "") + \
            (" (incomplete: budget)" if v.get("incomplete") else "")
        ratio = f"{v['vs_torch']:.1f}×" if "vs_torch" in v else "—"
        tried = ", ".join(f"{t['rung']}: {'ok' if t['ok'] else _short(t['error'])}" for t in v["tried"])
        lines.append(f"| {LABELS[c]} | {size} | {ratio} | {tried} |")
    sizes = list(res["throughput"])
    if not sizes:  # --skip-throughput
        return "\n".join(lines) + "\n"
    lines += ["", f"Throughput at equal batch and checkpointing (median after warm-up; busy: {res['busy_source']}):",
              "", "| contender | " + " | ".join(_fmt_n(res["params"][int(k)]) for k in sizes) + " |",
              "|---|" + "---|" * len(sizes)]
    for c in res["contenders"]:
        if c in res["skipped"]:
            cells = [res["skipped"][c]] * len(sizes)
        else:
            cells = [_cell_tput(res["throughput"][k].get(c, {})) for k in sizes]
        lines.append(f"| {LABELS[c]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--cpu", action="store_true", help="= --device cpu --tiny (the harness on CPU, for CI)")
    ap.add_argument("--tiny", action="store_true", help="the tiny ladder (implied on CPU)")
    ap.add_argument("--budget", type=float, default=330, help="seconds for the whole run (default fits a 6-min call)")
    ap.add_argument("--cap-gib", type=float, default=8.0, help="GPU memory cap of the capacity trials")
    ap.add_argument("--tput-cap-gib", type=float, default=0, help="GPU cap of the throughput trials (0: the card)")
    ap.add_argument("--cap-mib", type=float, default=48, help="CPU: peak-RSS-growth cap of the capacity trials")
    ap.add_argument("--tput-cap-mib", type=float, default=1024, help="CPU: cap of the throughput trials")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--steps", type=int, default=3, help="timed throughput steps (after one warm-up step)")
    ap.add_argument("--capacity-steps", type=int, default=2)
    ap.add_argument("--tput-rungs", default=None,
                    help="comma-separated ladder rungs (default 4,5,6: 0.8B, 1.4B, 2.8B on GPU)")
    ap.add_argument("--ladder-rungs", type=int, default=None, help="use only the ladder's first N rungs")
    ap.add_argument("--jobs", type=int, default=1, help="trials at a time (CPU only: on a GPU they would share it)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-capacity", action="store_true")
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--nvme-frac", type=float, default=None,
                    help="Gemini + NVMe's nvme_offload_frac (default: 0 on CUDA, host RAM first and only the "
                         "overflow on disk, which a 64 GiB disk needs at 10B; 1 on CPU, where RAM is the compute tier)")
    ap.add_argument("--out", default=None, help="write gemini_cuda.json and gemini_cuda.md here")
    a = ap.parse_args(argv)
    if a.cpu:
        a.device, a.tiny = "cpu", True
    if a.device == "cuda" and a.jobs != 1:
        ap.error("--jobs: trials on one GPU run one at a time (they would share the card and its cap)")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here; use --cpu to run the harness at tiny sizes")
    return a


def main(argv=None) -> dict:
    a = parse(argv)
    s = settings(a)
    if a.ladder_rungs:
        s["ladder"] = s["ladder"][:a.ladder_rungs]
    rungs = [int(x) for x in a.tput_rungs.split(",")] if a.tput_rungs else TPUT_RUNGS
    if not a.skip_throughput and max(rungs) >= len(s["ladder"]):
        raise SystemExit(f"--tput-rungs {rungs}: the ladder has {len(s['ladder'])} rungs (0..{len(s['ladder']) - 1})")
    wanted = [c for c in a.contenders.split(",") if c]
    unknown = set(wanted) - set(CONTENDERS)
    if unknown:
        raise SystemExit(f"--contenders: unknown {sorted(unknown)}; choose from {CONTENDERS}")
    skipped = {c: r for c in wanted if (r := skip_reason(c, s["device"]))}
    run = [c for c in wanted if c not in skipped]
    for c, why in skipped.items():
        print(f"# {c}: {why}", file=sys.stderr)
    nvme = a.nvme_dir or tempfile.mkdtemp(prefix="gbench-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    params = ladder_params(s)
    r = Runner(s, a.budget, nvme)
    res = {"bench": "gemini_cuda", "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "where": torch.cuda.get_device_name(0) if s["device"] == "cuda" else f"CPU, {os.cpu_count()} cores",
           "commit": _commit(), "settings": {k: v for k, v in s.items() if k != "ladder"},
           "ladder": s["ladder"], "params": params, "contenders": wanted, "skipped": skipped,
           "capacity_steps": a.capacity_steps, "busy_source": "profiler kernel time / wall" if s["device"] == "cuda"
           else "profiler aten-op time / wall (CPU)", "throughput": {}, "capacity": {}}
    t0 = time.monotonic()
    res["throughput"], res["capacity"] = measure(r, run, params, rungs, a, a.jobs)
    res["budget_s"], res["elapsed_s"] = a.budget, round(time.monotonic() - t0, 1)
    res["skipped_for_budget"] = sum(1 for t in r.log if t.get("skipped"))
    if res["skipped_for_budget"]:
        print(f"# budget: {res['skipped_for_budget']} trial(s) skipped, {a.budget:g} s spent", file=sys.stderr)
    if a.nvme_dir is None:
        shutil.rmtree(nvme, ignore_errors=True)
    md = markdown(res)
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gemini_cuda.json"), "w") as f:
            json.dump(dict(res, trials=r.log), f, indent=1)
        with open(os.path.join(a.out, "gemini_cuda.md"), "w") as f:
            f.write(md)
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
