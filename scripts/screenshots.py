"""Regenerate the pictures in docs/widgets.md: each view, as a real JupyterLab draws it.

Starts JupyterLab on a temporary notebook, opens it in headless Chromium (Debian's
``chromium``, driven by Playwright), runs every cell — a 4-rank gloo cluster with the live
dashboard, a "will it fit?" plan, Gemini training over CPU + NVMe, then a dp2 × pp2 pipeline —
and screenshots each plot (found by the first word of its title) into ``docs/img/``:

    chunk_map.png  memory_gauges.png  training.png  pipeline_timeline.png  fit_plan.png

The chunk map is taken mid-training at a step where chunks changed tier, the rest once
every cell has run, so they show what a user sees, not a drawing. Run it with
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

PARAMS = "STEPS, PP_STEPS, PAUSE = 24, 12, 0.4"
SETUP = """\
%load_ext colossal_lab
%colossal launch -n 4 --backend gloo --threads 1
%colossal dashboard"""
PLAN = """\
import colossal_lab as cl
from colossal_lab.engine.models import GPTConfig
from colossal_lab.engine.plugins import GeminiPlugin
from colossal_lab.widgets import FitPlan
cl.current_cluster().push({'STEPS': STEPS, 'PP_STEPS': PP_STEPS, 'PAUSE': PAUSE})
plan = cl.plan(GPTConfig.preset("small"), GeminiPlugin(placement_policy="auto", device_memory_limit=256 << 20),
               world_size=4, batch=8, seq=256, device_memory=256 << 20, host_memory=2 << 30)
FitPlan(plan)"""
GEMINI = """\
%%colossal
import tempfile, time, torch, torch.distributed as dist
from colossal_lab.engine import Booster
from colossal_lab.engine.plugins import GeminiPlugin
from colossal_lab.engine.models import GPT, GPTConfig
rank = dist.get_rank()
torch.manual_seed(0)
model = GPT(GPTConfig.preset("tiny"))
plugin = GeminiPlugin(placement_policy="auto", precision="fp32", device_memory_limit=1 << 20,
                      chunk_size_mb=0.0625, nvme_offload_dir=tempfile.mkdtemp(prefix=f"nv{rank}_"),
                      nvme_offload_frac=0.5)
booster = Booster(plugin=plugin)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
gm, gopt, *_ = booster.boost(model, opt)
g = torch.Generator().manual_seed(rank)
for step in range(STEPS):
    x = torch.randint(0, 256, (2, 32), generator=g)
    _, loss = gm(x, x.roll(-1, 1))
    booster.backward(loss, gopt)
    gopt.step(); gopt.zero_grad()
    time.sleep(PAUSE)
plugin.close()
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
g = torch.Generator().manual_seed(0)
for step in range(PP_STEPS):
    x = torch.randint(0, 256, (8, 32), generator=g)
    booster.execute_pipeline(iter([{"idx": x, "targets": x.roll(-1, 1)}]), pm, pcrit, popt)
    popt.zero_grad()
    time.sleep(PAUSE)
print("pipeline done")"""
CELLS = [PARAMS, SETUP, PLAN, GEMINI, PIPELINE, "%colossal stop"]

# title's first word -> file name
SHOTS = {"ChunkMap": "chunk_map.png", "MemoryGauges": "memory_gauges.png", "Training": "training.png",
         "PipelineTimeline": "pipeline_timeline.png", "FitPlan": "fit_plan.png"}

JS_STATE = """() => {
  const plots = Array.from(document.querySelectorAll('.js-plotly-plot'));
  const titles = plots.map(g => String((g.layout && g.layout.title && (g.layout.title.text || g.layout.title)) || ''));
  const prompts = Array.from(document.querySelectorAll('.jp-InputArea-prompt')).map(e => e.innerText);
  const bars = plots.map(g => g.querySelectorAll('.barlayer .point, .scatterlayer .point, .heatmaplayer image').length);
  return {titles, prompts, bars};
}"""


def _notebook(path: Path) -> None:
    import nbformat as nbf

    nb = nbf.v4.new_notebook()
    nb.cells = [nbf.v4.new_code_cell(c) for c in CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbf.write(nb, str(path))


def _start_lab(folder: Path):
    token = secrets.token_hex(16)
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
         "--port=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={folder}",
         "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None"],
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
                t_dlg = time.time()
                while time.time() - t_dlg < 15:  # Lab sometimes still asks for a kernel
                    btn = page.locator(".jp-Dialog").get_by_role("button", name="Select")
                    if btn.count():
                        btn.first.click()
                        break
                    time.sleep(0.5)
                page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
                page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
                # the kernel's busy/idle indicator (cell prompts can be virtualised away)
                status = "() => (document.querySelector('.jp-Notebook-ExecutionIndicator') || {}).dataset?.status"
                deadline, idle, was_busy = time.time() + args.timeout, 0, False
                while time.time() < deadline:
                    busy = page.evaluate(status) == "busy"
                    # the chunk map mid-training, at a step where chunks changed tier
                    st = page.evaluate(JS_STATE)
                    for i, title in enumerate(st["titles"]):
                        if title.startswith("ChunkMap") and "moved" in title and "no chunk moved" not in title \
                                and "chunk_map.png" not in taken:
                            _shoot(page, i, out / "chunk_map.png")
                            taken["chunk_map.png"] = title
                            print(f"chunk_map.png: {title}", flush=True)
                    was_busy = was_busy or busy
                    idle = 0 if busy else idle + 1
                    if was_busy and idle >= 8:
                        break
                    time.sleep(0.5)
                s = page.evaluate(JS_STATE)
                for i, title in enumerate(s["titles"]):
                    name = SHOTS.get(title.split(" ")[0])
                    # gauges are indicator traces (no points): drawn once they have a title
                    if name is not None and name not in taken and (s["bars"][i] or name == "memory_gauges.png"):
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
    text = "\n".join(outputs)
    missing = sorted(set(SHOTS.values()) - set(taken))
    if re.search(r"Traceback|Error", text) or missing:
        print(text[-4000:], file=sys.stderr)
        print(f"missing pictures: {missing}", file=sys.stderr)
        return 1
    print(f"wrote {len(taken)} pictures to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
