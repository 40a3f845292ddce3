"""Gemini benchmarks (CPU-runnable at small scale): prints one JSON line of ratios and medians.

1. overhead  — tokens/s of Gemini (placement 'cpu', everything resident, fp32, 1 rank) vs a
   plain PyTorch AdamW loop on the same GPT, interleaved in one run. Target >= 0.9x.
2. capacity  — the largest GPT (of a ladder of widths) that trains one step with the
   process's peak RSS growth (peak RSS minus RSS after imports) under --budget-mib: plain
   PyTorch AdamW vs Gemini 'cpu' vs Gemini 'auto' + NVMe. Each trial is a fresh subprocess.
   Gemini's models are built under ``lazy_init()`` (materialised chunk by chunk into their
   home tier); Gemini 'cpu' plans against the whole budget, Gemini+NVMe gets the budget less
   ``NVME_MARGIN_MIB`` as its RAM tier and puts the rest of the state on NVMe.
3. nvme_bw   — bytes moved through the NVMe tier per second of optimizer step (Gemini 'auto'
   + NVMe) vs the directory's raw sequential bandwidth measured with dd in the same run.

GPU parts of the issue (Colossal-AI comparison, 6/24 GB caps) need an accelerator; not run here.

    python bench/gemini.py --nvme-dir /tmp/gemini-bench --budget-mib 512
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

NVME_MARGIN_MIB = 128  # of the RSS budget, kept out of Gemini's RAM tier: activations, autograd grads, IO threads

# (width, layers), ordered by parameter count: ~3M ... ~850M parameters
LADDER = [(256, 4), (384, 4), (512, 4), (640, 4), (768, 4), (1024, 4), (1024, 8), (1024, 16),
          (1024, 24), (1024, 32), (1024, 48), (1024, 64)]


def _cfg(d, layers=4):
    from colossal_lab.engine.models import GPTConfig

    # activation checkpointing for every contender: at batch 2 x 64 a 32-layer model's saved
    # activations (~350 MiB) would otherwise dominate the budget, and the bench measures state capacity
    return GPTConfig(vocab_size=256, block_size=64, n_layer=layers, n_head=max(1, d // 64), n_embd=d,
                     activation_checkpointing=True)


def _rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return 0.0


def trial(kind: str, d: int, layers: int, budget_mib: float, nvme_dir: str) -> dict:
    """One training step of GPT(width d, layers) in this process; reports peak RSS growth.

    Plain PyTorch builds the model eagerly (it has to hold it); Gemini gets it built under
    ``lazy_init()`` and materialises it chunk by chunk into the chunks' home tiers."""
    from colossal_lab.engine.lazy import lazy_init
    from colossal_lab.engine.models import GPT
    from colossal_lab.engine.plugins import GeminiPlugin

    warm = GPT(_cfg(64, 1))  # load lazily-imported kernels/libraries before measuring
    _, wl = warm(torch.randint(0, 256, (1, 8)), torch.randint(0, 256, (1, 8)))
    wl.backward()
    del warm, wl
    try:  # reset the kernel's peak-RSS mark (VmHWM) so import-time peaks do not count
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    base = _rss_mib()
    torch.manual_seed(0)
    if kind == "torch":
        model = GPT(_cfg(d, layers))
    else:
        with lazy_init():
            model = GPT(_cfg(d, layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plugin = None
    if kind != "torch":
        if kind == "gemini_cpu":  # everything in RAM, planned against the same budget
            plugin = GeminiPlugin(placement_policy="cpu", precision="fp32",
                                  device_memory_limit=int(budget_mib * 2 ** 20))
        else:  # the RAM tier gets the budget less a fixed margin; the rest lives on NVMe
            plugin = GeminiPlugin(placement_policy="auto", precision="fp32", nvme_offload_dir=nvme_dir,
                                  device_memory_limit=int((budget_mib - NVME_MARGIN_MIB) * 2 ** 20), max_prefetch=1)
        model, opt, *_ = plugin.configure(model, opt, None, None, None, "fp32")
    x = torch.randint(0, 256, (2, 64))
    _, loss = model(x, x)
    (opt.backward(loss) if plugin else loss.backward())
    st = model.manager.nvme if plugin is not None and kind == "gemini_nvme" else None
    before = st.bytes_read + st.bytes_written if st else 0
    t0 = time.perf_counter()
    opt.step()  # returns after write-behind has landed
    step_s = time.perf_counter() - t0
    moved = (st.bytes_read + st.bytes_written - before) if st else 0
    peak = _rss_mib("VmHWM")
    params = sum(p.numel() for p in model.parameters()) if plugin is None else \
        sum(i.numel for c in model.manager.chunks for i in c.infos)
    if plugin is not None:
        plugin.close()
    return {"params": params, "peak_growth_mib": peak - base, "step_s": step_s, "nvme_bytes": moved}


def _run_trial(kind, d, layers, budget, nvme_dir):
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    p = subprocess.run([sys.executable, __file__, "--trial", kind, str(d), str(layers), str(budget), nvme_dir],
                       capture_output=True, text=True, env=env, timeout=900)
    if p.returncode != 0:
        print(f"# {kind} d={d} L={layers}: failed: {p.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


def capacity(budget, nvme_dir, nvme_from=0, max_rung=None):
    best = {}
    detail = {}
    ladder = LADDER[:max_rung] if max_rung else LADDER
    for kind in ("torch", "gemini_cpu", "gemini_nvme"):
        best[kind] = 0
        for d, layers in ladder[nvme_from if kind == "gemini_nvme" else 0:]:
            r = _run_trial(kind, d, layers, budget, nvme_dir)
            if r is not None:
                print(f"# {kind} d={d} L={layers}: {json.dumps(r)}", file=sys.stderr, flush=True)
            if r is None or r["peak_growth_mib"] > budget:
                break
            best[kind] = r["params"]
            detail[kind] = dict(r, top=(d, layers) == ladder[-1])  # top: passed the last rung tried
    return best, detail


def overhead(steps=8):
    from colossal_lab.engine.models import GPT, GPTConfig
    from colossal_lab.engine.plugins import GeminiPlugin

    torch.manual_seed(0)
    base = GPT(GPTConfig.preset("small"))
    ref = copy.deepcopy(base)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    plugin = GeminiPlugin(placement_policy="cpu", precision="fp32")
    g = copy.deepcopy(base)
    gm, gopt, *_ = plugin.configure(g, torch.optim.AdamW(g.parameters(), lr=1e-3), None, None, None, "fp32")
    x = torch.randint(0, 256, (4, 256))
    tok = x.numel()
    tt, tg = [], []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        _, l = ref(x, x); l.backward(); ropt.step(); ropt.zero_grad()
        t1 = time.perf_counter()
        _, l = gm(x, x); gopt.backward(l); gopt.step()
        t2 = time.perf_counter()
        if i:  # first step is warm-up for both
            tt.append(tok / (t1 - t0))
            tg.append(tok / (t2 - t1))
    plugin.close()
    return statistics.median(tg), statistics.median(tt)


def raw_bw(nvme_dir, mib=256):
    f = os.path.join(nvme_dir, "dd-probe")
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=1M", f"count={mib}", "conv=fdatasync"],
                   capture_output=True, check=True)
    w = mib * 2 ** 20 / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=1M"], capture_output=True, check=True)
    r = mib * 2 ** 20 / (time.perf_counter() - t0)
    os.remove(f)
    return (w + r) / 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trial", nargs=5)
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--budget-mib", type=float, default=512)
    ap.add_argument("--skip-capacity", action="store_true")
    ap.add_argument("--nvme-from", type=int, default=0, help="start the NVMe ladder at this rung (saves time)")
    ap.add_argument("--max-rung", type=int, default=None, help="stop every ladder before this rung")
    a = ap.parse_args()
    if a.trial:
        kind, d, layers, budget, nvme_dir = a.trial
        print(json.dumps(trial(kind, int(d), int(layers), float(budget), nvme_dir)))
        return
    nvme_dir = a.nvme_dir or tempfile.mkdtemp(prefix="gemini-bench-")
    os.makedirs(nvme_dir, exist_ok=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    g_tps, t_tps = overhead()
    out = {"bench": "gemini", "device": "cpu", "overhead_ratio": g_tps / t_tps,
           "gemini_tokens_per_s": g_tps, "torch_tokens_per_s": t_tps}
    if not a.skip_capacity:
        best, detail = capacity(a.budget_mib, nvme_dir, a.nvme_from, a.max_rung)
        out.update({"budget_mib": a.budget_mib, "max_params": best,
                    "peak_growth_mib": {k: round(v["peak_growth_mib"], 1) for k, v in detail.items()},
                    "lower_bound": {k: best[k] > 0 and best[k] == detail[k]["params"] and detail[k].get("top", False)
                                    for k in detail},
                    "nvme_from_rung": a.nvme_from, "max_rung": a.max_rung,
                    "capacity_ratio_cpu": best["gemini_cpu"] / max(best["torch"], 1),
                    "capacity_ratio_nvme": best["gemini_nvme"] / max(best["torch"], 1)})
        nv = detail.get("gemini_nvme")
        raw = raw_bw(nvme_dir)
        if nv and nv["step_s"] > 0:
            ours = nv["nvme_bytes"] / nv["step_s"]
            out.update({"nvme_bw_ratio": ours / raw, "nvme_step_bytes_per_s": ours, "raw_dd_bytes_per_s": raw,
                        "nvme_bw_note": "NVMe bytes read+written during the optimizer step of the largest NVMe model / step seconds; our writes are not fsynced (page cache), dd's are"})
    if a.nvme_dir is None:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
