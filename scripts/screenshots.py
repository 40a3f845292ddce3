"""Regenerate the pictures in docs/widgets.md: each view, as a real JupyterLab draws it.

Starts JupyterLab on a temporary notebook, opens it in headless Chromium (Debian's
``chromium``, driven by Playwright), runs every cell — a 4-rank gloo cluster with the live
dashboard, a "will it fit?" plan, Gemini training over CPU + NVMe, a dp2 × pp2 pipeline, then an
MoE GPT under expert parallelism —
and screenshots each plot (found by the first word of its title) into ``docs/img/``:

    chunk_map.png  memory_gauges.png  training.png  pipeline_timeline.png  fit_plan.png  expert_load.png

The chunk map is taken mid-step, at a step where chunks moved between RAM and NVMe (the small GPT
under a 3 MiB compute tier), the rest once every cell has run; the models train on Python's own
sources, so the loss falls. They show what a user sees, not a drawing. Run it with
``bash scripts/screenshots.sh`` (which sets up the environment first).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

STEPS = 24  # Gemini's steps: the training view is shot at its last one, before the MoE run's steps arrive
MOE_STEPS = 30
PARAMS = f"STEPS, PP_STEPS, MOE_STEPS, PAUSE = {STEPS}, 12, {MOE_STEPS}, 0.4"
SETUP = """\
%load_ext colossal_lab
%colossal launch -n 4 --backend gloo --threads 1
%colossal dashboard"""
PLAN = """\
import colossal_lab as cl
from colossal_lab.engine.models import GPTConfig
from colossal_lab.engine.plugins import GeminiPlugin
from colossal_lab.widgets import FitPlan
cl.current_cluster().push({'STEPS': STEPS, 'PP_STEPS': PP_STEPS, 'MOE_STEPS': MOE_STEPS, 'PAUSE': PAUSE})
plan = cl.plan(GPTConfig.preset("small"), GeminiPlugin(placement_policy="auto", device_memory_limit=256 << 20),
               world_size=4, batch=8, seq=256, device_memory=256 << 20, host_memory=2 << 30)
FitPlan(plan)"""
GEMINI = """\
%%colossal
import shutil, tempfile, time, torch, torch.distributed as dist
from colossal_lab.engine import Booster
from colossal_lab.engine.plugins import GeminiPlugin
from colossal_lab.engine.models import GPT, GPTConfig
from colossal_lab.engine.data import encode, stdlib_corpus
rank = dist.get_rank()
tokens = encode(stdlib_corpus(200_000))  # real text (Python's own sources), so the loss falls
g = torch.Generator().manual_seed(rank)
def batch(rows, T=32):
    i = torch.randint(0, len(tokens) - T - 1, (rows,), generator=g)
    return torch.stack([tokens[j:j + T] for j in i]), torch.stack([tokens[j + 1:j + T + 1] for j in i])
torch.manual_seed(0)
# the small GPT (3.3M parameters) under a 3 MiB compute tier: parameter chunks live on NVMe and RAM and
# move between them every step, which is what the chunk map is for
model = GPT(GPTConfig.preset("small"))
plugin = GeminiPlugin(placement_policy="auto", precision="fp32", device_memory_limit=3 << 20,
                      chunk_size_mb=0.75, nvme_offload_dir=(nvme := tempfile.mkdtemp(prefix=f"nv{rank}_")),
                      nvme_offload_frac=0.5)
booster = Booster(plugin=plugin)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
gm, gopt, *_ = booster.boost(model, opt)
for step in range(STEPS):  # steps back to back: the chunk map is caught mid-step
    x, y = batch(8, 64)
    _, loss = gm(x, y)
    booster.backward(loss, gopt)
    gopt.step(); gopt.zero_grad()
plugin.close()  # removes Gemini's files; then the folder this cell made
shutil.rmtree(nvme, ignore_errors=True)
print("gemini done", rank)"""
PIPELINE = """\
%%colossal
import time, torch
from colossal_lab.engine import Booster
from colossal_lab.engine.plugins import HybridParallelPlugin
from colossal_lab.engine.models import GPT, GPTConfig
torch.manual_seed(0)
model = GPT(GPTConfig.preset("tiny"))
booster = Booster(plugin=HybridParallelPlugin(pp_size=2, num_microbatches=4, pp_style="1f1b"))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
crit = lambda out, batch: torch.nn.functional.cross_entropy(out.flatten(0, 1), batch["targets"].flatten())
pm, popt, pcrit, *_ = booster.boost(model, opt, crit)
for step in range(PP_STEPS):
    x, y = batch(8)
    booster.execute_pipeline(iter([{"idx": x, "targets": y}]), pm, pcrit, popt)
    popt.zero_grad()
    time.sleep(PAUSE)
print("pipeline done")"""
MOE = """\
%%colossal
# an MoE GPT (8 experts, top-2) with experts split over pairs of ranks (ep_size=2); a capacity factor of 1
# drops the tokens an overfull expert cannot take (the red bars); the balancing loss evens the load out
torch.manual_seed(0)
model = GPT(GPTConfig.preset("tiny", n_expert=8, top_k=2, capacity_factor=1.0, aux_loss_coef=0.05))
booster = Booster(plugin=HybridParallelPlugin(ep_size=2))
mm, mopt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
for step in range(MOE_STEPS):
    x, y = batch(8)
    _, loss = mm(x, y)
    booster.backward(loss, mopt)
    mopt.step(); mopt.zero_grad()
    time.sleep(PAUSE / 4)
print("moe done")"""
CELLS = [PARAMS, SETUP, PLAN, GEMINI, PIPELINE, MOE, "%colossal stop"]

# title's first word -> file name
SHOTS = {"ChunkMap": "chunk_map.png", "MemoryGauges": "memory_gauges.png", "Training": "training.png",
         "PipelineTimeline": "pipeline_timeline.png", "FitPlan": "fit_plan.png",
         "ExpertLoadView": "expert_load.png"}

JS_STATE = """() => {
  const plots = Array.from(document.querySelectorAll('.js-plotly-plot'));
  const titles = plots.map(g => String((g.layout && g.layout.title && (g.layout.title.text || g.layout.title)) || ''));
  const prompts = Array.from(document.querySelectorAll('.jp-InputArea-prompt')).map(e => e.innerText);
  const bars = plots.map(g => g.querySelectorAll('.barlayer .point, .scatterlayer .point, .heatmaplayer image').length);
  const legends = plots.map(g => Array.from(g.querySelectorAll('.legendtext')).map(e => e.textContent).join('|'));
  return {titles, prompts, bars, legends};
}"""


def _mid_step(title: str, legend: str) -> bool:
    """The chunk map worth a picture: mid-step (some chunk gathered for compute or in flight, not
    every one freed), after the warm-up step, with many chunks moving and chunks on NVMe as well as in RAM."""
    busy = any(s in legend for s in ("computing", "in flight", "held"))
    m = re.search(r"step (\d+) · (\d+) moved:", title)  # past the warm-up step, while many chunks move
    return bool(m) and int(m.group(1)) >= 2 and int(m.group(2)) >= 8 and "nvme" in legend and "cpu" in legend \
        and busy


def _notebook(path: Path) -> None:
    import nbformat as nbf

    nb = nbf.v4.new_notebook()
    nb.cells = [nbf.v4.new_code_cell(c) for c in CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbf.write(nb, str(path))


def _start_lab(folder: Path):
    token = secrets.token_hex(16)
    # every cell stays in the page while others run (Lab 4 otherwise drops cells scrolled out of view,
    # and the dashboard above the running cell would only be drawn again at the end)
    settings = folder / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
         "--port=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={folder}",
         "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
         f"--LabApp.user_settings_dir={folder / 'settings'}"],
        stderr=subprocess.PIPE, text=True, env=env, cwd=folder)
    url, log, t0 = None, [], time.time()
    while time.time() - t0 < 120 and url is None:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        log.append(line)
        m = re.search(r"(http://127\.0\.0\.1:[1-9]\d*)/", line)
        if m and "token" in line:
            url = m.group(1)
    if url is None:
        proc.kill()
        raise SystemExit("jupyter lab did not start:\n" + "".join(log[-30:]))
    threading.Thread(target=lambda: [log.append(x) for x in proc.stderr], daemon=True).start()
    req = urllib.request.Request(f"{url}/api/sessions?token={token}", method="POST",
                                 headers={"Content-Type": "application/json"},
                                 data=json.dumps({"path": "views.ipynb", "type": "notebook",
                                                  "name": "views.ipynb", "kernel": {"name": "python3"}}).encode())
    for attempt in range(60):
        try:
            urllib.request.urlopen(req, timeout=60).read()
            break
        except OSError:
            if attempt == 59:
                proc.kill()
                raise SystemExit("jupyter lab did not answer:\n" + "".join(log[-30:]))
            time.sleep(1)
    return proc, url, token


def _shoot(page, index: int, path: Path) -> None:
    page.locator(".js-plotly-plot").nth(index).scroll_into_view_if_needed(timeout=30_000)
    page.locator(".js-plotly-plot").nth(index).screenshot(path=str(path), timeout=60_000)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"), help="folder for the PNGs")
    ap.add_argument("--timeout", type=float, default=400, help="seconds for the whole notebook")
    args = ap.parse_args()
    if not os.path.exists(CHROMIUM):
        raise SystemExit("chromium is not installed: run `bash scripts/setup.sh --browser`")
    from playwright.sync_api import sync_playwright

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    taken: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        _notebook(folder / "views.ipynb")
        proc, url, token = _start_lab(folder)
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
                    "--headless", "--no-sandbox", "--disable-background-networking", "--disable-gpu"])
                page = browser.new_page(viewport={"width": 1200, "height": 1400})
                page.goto(f"{url}/lab/tree/views.ipynb?token={token}")
                page.wait_for_function("window.jupyterapp && document.querySelector('.jp-Notebook')",
                                       timeout=90_000)
                # Lab's toasts (the "Jupyter news?" question) float over the plots: hide them
                page.add_style_tag(content=".Toastify { display: none !important; }")
                t_dlg = time.time()
                while time.time() - t_dlg < 15:  # Lab sometimes still asks for a kernel
                    btn = page.locator(".jp-Dialog").get_by_role("button", name="Select")
                    if btn.count():
                        btn.first.click()
                        break
                    time.sleep(0.5)
                page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
                # not awaited (braces, no return value): the promise resolves only once every cell has run,
                # and the views are to be watched (and the chunk map shot) while they run
                page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
                # the kernel's busy/idle indicator (cell prompts can be virtualised away)
                status = "() => (document.querySelector('.jp-Notebook-ExecutionIndicator') || {}).dataset?.status"
                deadline, idle, was_busy, seen_maps = time.time() + args.timeout, 0, False, {}
                while time.time() < deadline:
                    busy = page.evaluate(status) == "busy"
                    # the chunk map mid-training, at a step where chunks changed tier
                    st = page.evaluate(JS_STATE)
                    if os.environ.get("SHOTS_DEBUG"):
                        print(round(time.time() - deadline + args.timeout, 1), busy,
                              [t[:70] for t in st["titles"]], flush=True)
                    for i, title in enumerate(st["titles"]):
                        if title.startswith("ChunkMap") and title not in seen_maps and len(seen_maps) < 40:
                            seen_maps[title] = st["legends"][i]
                        if title.startswith(f"Training · step {STEPS - 1} ") and "training.png" not in taken:
                            _shoot(page, i, out / "training.png")
                            taken["training.png"] = title
                            print(f"training.png: {title}", flush=True)
                        if title.startswith("ChunkMap") and "chunk_map.png" not in taken \
                                and _mid_step(title, st["legends"][i]):
                            _shoot(page, i, out / "chunk_map.next.png")
                            after = page.evaluate(JS_STATE)  # kept only if still mid-step once shot
                            if after["titles"][i] == title and _mid_step(title, after["legends"][i]):
                                os.replace(out / "chunk_map.next.png", out / "chunk_map.png")
                                taken["chunk_map.png"] = title
                                print(f"chunk_map.png: {title}", flush=True)
                    was_busy = was_busy or busy
                    idle = 0 if busy else idle + 1
                    if was_busy and idle >= 8:
                        break
                    time.sleep(0.5)
                # the relay may still be carrying the last steps: wait (a bounded while) until the expert
                # load view holds the MoE run's last step
                t_end = time.time()
                while time.time() - t_end < 60:
                    s = page.evaluate(JS_STATE)
                    if any(t.startswith("ExpertLoadView") and f"–{MOE_STEPS - 1} " in t for t in s["titles"]):
                        break
                    time.sleep(0.5)
                for i, title in enumerate(s["titles"]):
                    name = SHOTS.get(title.split(" ")[0])
                    # gauges are indicator traces (no points): drawn once they have a title
                    # (the chunk map only mid-step, above: the end of the run shows every chunk freed)
                    if name is not None and name not in taken and name != "chunk_map.png" \
                            and (s["bars"][i] or name == "memory_gauges.png"):
                        _shoot(page, i, out / name)
                        taken[name] = title
                        print(f"{name}: {title}", flush=True)
                outputs = page.evaluate("() => Array.from(document.querySelectorAll('.jp-OutputArea-output'))"
                                        ".map(e => e.innerText.slice(0, 600))")
                browser.close()
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    (out / "chunk_map.next.png").unlink(missing_ok=True)
    text = "\n".join(outputs)
    missing = sorted(set(SHOTS.values()) - set(taken))
    if re.search(r"Traceback|Error", text) or missing:
        print(text[-4000:], file=sys.stderr)
        print(f"missing pictures: {missing}", file=sys.stderr)
        if "chunk_map.png" in missing:
            print("chunk maps seen (title: legend):", *(f"  {t}: {l}" for t, l in seen_maps.items()),
                  sep="\n", file=sys.stderr)
        return 1
    print(f"wrote {len(taken)} pictures to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
