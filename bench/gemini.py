"""Gemini benchmarks (CPU-runnable at small scale): prints one JSON line of ratios and medians.

1. overhead  — tokens/s of Gemini (placement 'cpu', everything resident, fp32, 1 rank) vs a
   plain PyTorch AdamW loop on the same GPT, interleaved in one run. Target >= 0.9x.
2. capacity  — the largest GPT (of a ladder of widths) that trains one step with the
   process's peak RSS growth (peak RSS minus RSS after imports) under --budget-mib: plain
   PyTorch AdamW vs Gemini 'cpu' vs Gemini 'auto' + NVMe. Each trial is a fresh subprocess.
   Gemini's models are built under ``lazy_init()`` (materialised chunk by chunk into their
   home tier); Gemini 'cpu' plans against the whole budget, Gemini+NVMe gets the budget less
   ``NVME_MARGIN_MIB`` as its RAM tier and puts the rest of the state on NVMe.
   The NVMe ladder starts at the first rung with >= 20x plain PyTorch's best and walks up until
   a rung fails (down if the first one fails), so the target is tested directly.
3. nvme_bw   — the optimizer step of Gemini 'auto' + NVMe with ``nvme_direct_io=True`` (O_DIRECT:
   no page cache on either side) vs the same directory's raw sequential bandwidth measured
   with ``dd oflag=direct`` / ``iflag=direct`` in the same run. The step reads R bytes and
   writes W bytes; ``nvme_bw_ratio = (R / dd_read + W / dd_write) / step_seconds``: the fraction
   of the step that dd would need to move the same bytes (1.0 = the disk is busy the whole
   step at dd's speed; Adam's compute is inside the step, so overlap counts).

``--device cuda`` (or ``--cpu`` / ``--device cpu --tiny`` for the same harness at tiny sizes on CPU)
runs the GPU user's comparison instead: bench/gemini_cuda.py (plain PyTorch, FSDP2 + CPU offload,
Gemini's placements, Colossal-AI and DeepSpeed where importable; capacity and throughput).

    python bench/gemini.py --nvme-dir /tmp/gemini-bench --budget-mib 512
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from rss import reset_peak, rss_mib  # bench/ is sys.path[0] when run as a script

NVME_MARGIN_MIB = 128  # of the RSS budget, kept out of Gemini's RAM tier: activations, autograd grads, IO threads

# (width, layers), ordered by parameter count: ~3M ... ~850M parameters
LADDER = [(256, 4), (384, 4), (512, 4), (640, 4), (768, 4), (1024, 4), (1024, 8), (1024, 16),
          (1024, 24), (1024, 32), (1024, 48), (1024, 64)]


def _cfg(d, layers=4):
    from colossal_lab.engine.models import GPTConfig

    # activation checkpointing for every contender: at batch 2 x 64 a deep model's saved activations
    # would otherwise take most of the budget (docs/gemini.md, "Measured"), and the bench measures
    # state capacity
    return GPTConfig(vocab_size=256, block_size=64, n_layer=layers, n_head=max(1, d // 64), n_embd=d,
                     activation_checkpointing=True)


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
    reset_peak()  # import-time peaks do not count
    base = rss_mib()
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
                                  device_memory_limit=int((budget_mib - NVME_MARGIN_MIB) * 2 ** 20), max_prefetch=1,
                                  nvme_direct_io=kind == "gemini_nvme_direct")
        model, opt, *_ = plugin.configure(model, opt, None, None, None, "fp32")
    x = torch.randint(0, 256, (2, 64))
    _, loss = model(x, x)
    (opt.backward(loss) if plugin else loss.backward())
    st = model.manager.nvme if plugin is not None and kind.startswith("gemini_nvme") else None
    r0, w0 = (st.bytes_read, st.bytes_written) if st else (0, 0)
    t0 = time.perf_counter()
    opt.step()  # returns after write-behind has landed
    step_s = time.perf_counter() - t0
    rd, wr = (st.bytes_read - r0, st.bytes_written - w0) if st else (0, 0)
    peak = rss_mib("VmHWM")
    params = sum(p.numel() for p in model.parameters()) if plugin is None else \
        sum(i.numel for c in model.manager.chunks for i in c.infos)
    if plugin is not None:
        plugin.close()
    return {"params": params, "peak_growth_mib": peak - base, "step_s": step_s, "nvme_bytes": rd + wr,
            "nvme_read": rd, "nvme_written": wr}


def _run_trial(kind, d, layers, budget, nvme_dir):
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    p = subprocess.run([sys.executable, __file__, "--trial", kind, str(d), str(layers), str(budget), nvme_dir],
                       capture_output=True, text=True, env=env, timeout=900)
    if p.returncode != 0:
        print(f"# {kind} d={d} L={layers}: failed: {p.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


def _ladder_params(d, layers):
    from colossal_lab.engine.models import GPT

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(_cfg(d, layers)).parameters())


def capacity(budget, nvme_dir, nvme_from=None, max_rung=None):
    """Largest rung that trains one step under the budget, per contender (fresh process each)."""
    best, detail = {}, {}
    ladder = LADDER[:max_rung] if max_rung else LADDER

    def attempt(kind, i):
        d, layers = ladder[i]
        r = _run_trial(kind, d, layers, budget, nvme_dir)
        if r is not None:
            print(f"# {kind} d={d} L={layers}: {json.dumps(r)}", file=sys.stderr, flush=True)
        ok = r is not None and r["peak_growth_mib"] <= budget
        if ok and r["params"] > best[kind]:
            best[kind] = r["params"]
            detail[kind] = dict(r, top=i == len(ladder) - 1)  # top: passed the last rung there is
        return ok

    for kind in ("torch", "gemini_cpu"):
        best[kind] = 0
        for i in range(len(ladder)):
            if not attempt(kind, i):
                break
    best["gemini_nvme"] = 0
    if nvme_from is None:  # test the 20x target directly: first rung at >= 20x torch's best
        sizes = [_ladder_params(*r) for r in ladder]
        nvme_from = next((i for i, n in enumerate(sizes) if n >= 20 * best["torch"]), len(ladder) - 1)
    i = nvme_from
    if attempt("gemini_nvme", i):
        while i + 1 < len(ladder) and attempt("gemini_nvme", i + 1):
            i += 1
    else:
        while i > 0 and not attempt("gemini_nvme", i - 1):
            i -= 1
    return best, detail


def nvme_bandwidth(nvme_dir, budget, rung):
    """Direct-IO optimizer step of one NVMe trial vs dd's direct sequential bandwidth, same run.

    dd runs before the trial (1 GiB) and after it (the step's own volumes, up to 8 GiB each: a
    virtual disk's burst rate on 1 GiB can be far from its sustained rate). ``nvme_bw_ratio``
    compares with the after-trial dd (same volumes); ``nvme_bw_ratio_vs_fastest_dd`` with the
    fastest dd of each direction (conservative)."""
    d, layers = rung
    raw_w, raw_r = raw_bw(nvme_dir)
    r = _run_trial("gemini_nvme_direct", d, layers, budget, nvme_dir)
    if r is None or r["step_s"] <= 0:
        return {"nvme_bw_error": "direct-IO trial failed"}
    cap = 8 << 10
    raw_w2, _ = raw_bw(nvme_dir, mib=max(64, min(cap, r["nvme_written"] >> 20)))
    _, raw_r2 = raw_bw(nvme_dir, mib=max(64, min(cap, r["nvme_read"] >> 20)))
    dd = {"dd_direct_write_bytes_per_s": [raw_w, raw_w2], "dd_direct_read_bytes_per_s": [raw_r, raw_r2]}
    # primary: dd moving the step's own volumes (sustained rate); also vs the fastest dd seen
    # (a 1 GiB probe can be served by the virtual disk's host-side cache)
    dd_s = r["nvme_read"] / raw_r2 + r["nvme_written"] / raw_w2
    best_s = r["nvme_read"] / max(raw_r, raw_r2) + r["nvme_written"] / max(raw_w, raw_w2)
    return {"nvme_bw_ratio": dd_s / r["step_s"], "nvme_bw_ratio_vs_fastest_dd": best_s / r["step_s"],
            "nvme_bw_params": r["params"], "nvme_step_s": r["step_s"],
            "nvme_step_read_bytes": r["nvme_read"], "nvme_step_written_bytes": r["nvme_written"],
            "nvme_step_bytes_per_s": r["nvme_bytes"] / r["step_s"], **dd}


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
        _, l = ref(x, x)
        l.backward()
        ropt.step()
        ropt.zero_grad()
        t1 = time.perf_counter()
        _, l = gm(x, x)
        gopt.backward(l)
        gopt.step()
        t2 = time.perf_counter()
        if i:  # first step is warm-up for both
            tt.append(tok / (t1 - t0))
            tg.append(tok / (t2 - t1))
    plugin.close()
    return statistics.median(tg), statistics.median(tt)


def raw_bw(nvme_dir, mib=1024, bs_mib=8):
    """dd's sequential write and read bandwidth of ``nvme_dir`` with O_DIRECT (bytes/s)."""
    f = os.path.join(nvme_dir, "dd-probe")
    n = mib // bs_mib
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={f}", f"bs={bs_mib}M", f"count={n}", "oflag=direct", "conv=fdatasync"],
                   capture_output=True, check=True)
    w = n * bs_mib * 2 ** 20 / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={f}", "of=/dev/null", f"bs={bs_mib}M", "iflag=direct"], capture_output=True, check=True)
    r = n * bs_mib * 2 ** 20 / (time.perf_counter() - t0)
    os.remove(f)
    return w, r


def _wants_harness(argv) -> bool:
    """``--device cuda``, ``--cpu`` or ``--device cpu --tiny``: the GPU comparison's harness."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", default=None)
    pre.add_argument("--cpu", action="store_true")
    pre.add_argument("--tiny", action="store_true")
    a, _ = pre.parse_known_args(argv)
    return a.device == "cuda" or a.cpu or (a.device == "cpu" and a.tiny)


def main():
    if _wants_harness(sys.argv[1:]):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gemini_cuda import main as harness

        harness(sys.argv[1:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu"], default="cpu",
                    help="cpu: these CPU benchmarks; --device cuda / --cpu: the GPU comparison (bench/gemini_cuda.py)")
    ap.add_argument("--trial", nargs=5)
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--budget-mib", type=float, default=512)
    ap.add_argument("--skip-capacity", action="store_true")
    ap.add_argument("--nvme-from", type=int, default=None,
                    help="start the NVMe ladder at this rung (default: the first rung >= 20x plain PyTorch)")
    ap.add_argument("--max-rung", type=int, default=None, help="stop every ladder before this rung")
    ap.add_argument("--bw-rung", type=int, default=6, help="ladder rung of the direct-IO bandwidth trial")
    ap.add_argument("--skip-bw", action="store_true")
    a = ap.parse_args()
    if a.trial:
        kind, d, layers, budget, nvme_dir = a.trial
        print(json.dumps(trial(kind, int(d), int(layers), float(budget), nvme_dir)))
        return
    nvme_dir = a.nvme_dir or tempfile.mkdtemp(prefix="gemini-bench-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    os.makedirs(nvme_dir, exist_ok=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    g_tps, t_tps = overhead()
    out = {"bench": "gemini", "device": "cpu", "overhead_ratio": g_tps / t_tps,
           "gemini_tokens_per_s": g_tps, "torch_tokens_per_s": t_tps}
    print(json.dumps(out), file=sys.stderr, flush=True)
    if not a.skip_bw:
        out.update(nvme_bandwidth(nvme_dir, a.budget_mib, LADDER[a.bw_rung]))
        print(json.dumps(out), file=sys.stderr, flush=True)
    if not a.skip_capacity:
        best, detail = capacity(a.budget_mib, nvme_dir, a.nvme_from, a.max_rung)
        out.update({"budget_mib": a.budget_mib, "max_params": best,
                    "peak_growth_mib": {k: round(v["peak_growth_mib"], 1) for k, v in detail.items()},
                    "lower_bound": {k: bool(v.get("top")) for k, v in detail.items()},
                    "capacity_ratio_cpu": best["gemini_cpu"] / max(best["torch"], 1),
                    "capacity_ratio_nvme": best["gemini_nvme"] / max(best["torch"], 1)})
        nv = detail.get("gemini_nvme")
        if nv:
            out["nvme_buffered_step_bytes_per_s"] = nv["nvme_bytes"] / nv["step_s"]
    if a.nvme_dir is None:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
