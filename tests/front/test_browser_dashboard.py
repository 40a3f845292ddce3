"""A real JupyterLab in headless Chromium: a notebook launches a 2-rank cluster, shows the
dashboard (``%colossal dashboard``), trains the tiny GPT with Gemini (CPU + NVMe tiers), then
with a 2-stage pipeline, then an MoE GPT under expert parallelism; while the cells run, the page
must show chunks on more than one tier, pipeline bars, values that change, and the expert-load
heatmap once (and only once) the MoE cell runs. Screenshots go to ``artifacts/``.

Every event drawn comes from a real engine component on a rank (Gemini's chunk manager,
the pipeline runtime's timers, the boosted optimizer's StepMetrics, the memory sampler the
relay starts on each rank, the hybrid optimizer's per-layer ExpertLoad) through the relay; no
cell starts anything for the gauges.
"""

import pytest

# Jupyter-side packages this module needs: absent (a bare GPU image), it skips.
pytest.importorskip("psutil")
pytest.importorskip("nbformat")
pytest.importorskip("jupyterlab")
pytest.importorskip("ipyparallel")

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from support import ROOT

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

ART = ROOT / "artifacts" / "browser"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

SETUP = """\
%load_ext colossal_lab
%colossal launch -n 2 --backend gloo --threads 1
%colossal dashboard"""

GEMINI = """\
%%colossal
import os, shutil, tempfile, time, torch, torch.distributed as dist
from colossal_lab.engine import Booster
from colossal_lab.engine.plugins import GeminiPlugin
from colossal_lab.engine.models import GPT, GPTConfig
rank = dist.get_rank()
torch.manual_seed(0)
nvme = tempfile.mkdtemp(prefix=f"nv{rank}_")
model = GPT(GPTConfig.preset("tiny"))
plugin = GeminiPlugin(placement_policy="auto", precision="fp32", device_memory_limit=1 << 20,
                      chunk_size_mb=0.125, nvme_offload_dir=nvme, nvme_offload_frac=1.0)
booster = Booster(plugin=plugin, mixed_precision="fp32")
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
shutil.rmtree(nvme, ignore_errors=True)
print("gemini done", rank, float(loss.detach()))"""

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
    out = booster.execute_pipeline(iter([{"idx": x, "targets": x.roll(-1, 1)}]), pm, pcrit, popt)
    popt.zero_grad()
    time.sleep(PAUSE)
print("pipeline done")"""

MOE = """\
%%colossal
import time, torch
from colossal_lab.engine import Booster
from colossal_lab.engine.plugins import HybridParallelPlugin
from colossal_lab.engine.models import GPT, GPTConfig
torch.manual_seed(0)
model = GPT(GPTConfig.preset("tiny", n_expert=4, top_k=2, capacity_factor=0.5))
plugin = HybridParallelPlugin(ep_size=2)
booster = Booster(plugin=plugin)
mm, mopt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
g = torch.Generator().manual_seed(plugin.dp_rank)
for step in range(MOE_STEPS):
    x = torch.randint(0, 256, (2, 32), generator=g)
    _, loss = mm(x, x.roll(-1, 1))
    booster.backward(loss, mopt)
    mopt.step(); mopt.zero_grad()
    time.sleep(PAUSE)
print("moe done")"""

JS_STATE = """() => {
  // read the rendered page: plotly's gd.data/layout plus the SVG it drew
  const plots = Array.from(document.querySelectorAll('.js-plotly-plot'));
  const out = {};
  for (const g of plots) {
    const t = (g.layout && g.layout.title && (g.layout.title.text || g.layout.title)) || '';
    const key = String(t).split(' ')[0];
    out[key] = {title: String(t),
      svg_points: g.querySelectorAll('.scatterlayer .point').length,
      // heatmap cells drawn with a value (the chunk map's strip: one cell per chunk)
      cells: (g.data || []).filter(d => d.type === 'heatmap')
        .reduce((n, d) => n + (d.z || []).flat().filter(v => v !== null && v !== undefined).length, 0),
      heatmaps: g.querySelectorAll('.heatmaplayer image').length,
      svg_bars: g.querySelectorAll('.barlayer .point').length,
      legend: Array.from(g.querySelectorAll('.legendtext')).map(e => e.textContent),
      ticks: Array.from(g.querySelectorAll('.ytick text')).map(e => e.textContent),
      data: (g.data || []).map(d => ({name: d.name, type: d.type,
        n: (d.x || []).length, y: d.y, value: d.value,
        title: d.type === 'indicator' && d.title ? String(d.title.text) : undefined}))};
  }
  const prompts = Array.from(document.querySelectorAll('.jp-InputArea-prompt')).map(e => e.innerText);
  return {plots: out, prompts: prompts, frames: globalThis.__colossalFrames || 0};
}"""


def _notebook(path: Path) -> None:
    import nbformat as nbf

    nb = nbf.v4.new_notebook()
    nb.cells = [nbf.v4.new_code_cell("STEPS, PP_STEPS, MOE_STEPS, PAUSE = 16, 16, 6, 0.6"),
                nbf.v4.new_code_cell(SETUP),
                nbf.v4.new_code_cell("import colossal_lab as cl\n"
                                     "cl.current_cluster().push("
                                     "{'STEPS': STEPS, 'PP_STEPS': PP_STEPS, 'MOE_STEPS': MOE_STEPS, "
                                     "'PAUSE': PAUSE})"),
                nbf.v4.new_code_cell(GEMINI),
                nbf.v4.new_code_cell(PIPELINE),
                nbf.v4.new_code_cell(MOE),
                nbf.v4.new_code_cell("%colossal stop")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbf.write(nb, str(path))


@pytest.fixture
def lab(tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.fail("chromium is not installed: run `bash scripts/setup.sh --browser`")
    _notebook(tmp_path / "dash.ipynb")
    token = secrets.token_hex(16)
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
         "--port=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}",
         "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None"],
        stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
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
        pytest.fail("jupyter lab did not start:\n" + "".join(log[-30:]))
    # keep draining the server log so it never blocks on a full pipe
    import threading

    threading.Thread(target=lambda: [log.append(l) for l in proc.stderr], daemon=True).start()
    # start the notebook's kernel through the REST API so Lab attaches to it without asking
    req = urllib.request.Request(f"{url}/api/sessions?token={token}", method="POST",
                                 headers={"Content-Type": "application/json"},
                                 data=json.dumps({"path": "dash.ipynb", "type": "notebook",
                                                  "name": "dash.ipynb",
                                                  "kernel": {"name": "python3"}}).encode())
    for attempt in range(60):
        try:
            urllib.request.urlopen(req, timeout=60).read()
            break
        except OSError:
            if attempt == 59 or proc.poll() is not None:
                proc.kill()
                pytest.fail("jupyter lab did not answer:\n" + "".join(log[-30:]))
            time.sleep(1)
    seen = {}  # pid -> psutil.Process of everything lab started (kernel, ipyparallel, ranks)

    def snapshot():
        for c in psutil.Process(proc.pid).children(recursive=True):
            seen.setdefault(c.pid, c)

    try:
        yield url, token, log, snapshot
    finally:
        snapshot()
        proc.terminate()  # jupyter server shuts its kernels down; the kernel's exit hook stops ranks
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        _, alive = psutil.wait_procs(list(seen.values()), timeout=20)
        for p in alive:  # a leak is a failure below, but never leave it running
            p.kill()
        leaked = [f"{p.pid} {' '.join(p.cmdline()[:4])}" for p in alive if p.is_running()]
        assert not alive, f"processes left after the test: {leaked}"


def _shot(page, name, full=False):
    # the viewport only while cells run: a full-page capture of a busy page can stall the
    # sampling loop for many seconds on a loaded 2-core machine
    page.screenshot(path=str(ART / name), full_page=full, timeout=60_000)


def test_dashboard_live_in_jupyterlab(lab):
    from playwright.sync_api import sync_playwright

    url, token, log, snapshot = lab
    ART.mkdir(parents=True, exist_ok=True)
    for old in ART.glob("*.png"):
        old.unlink()
    samples = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-background-networking", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 2000})
        try:
            page.goto(f"{url}/lab/tree/dash.ipynb?token={token}")
            page.wait_for_function("window.jupyterapp && document.querySelector('.jp-Notebook')",
                                   timeout=90_000)
            # Lab sometimes still asks which kernel to use although the session has one
            t_dlg = time.time()
            while time.time() - t_dlg < 15:
                btn = page.locator(".jp-Dialog").get_by_role("button", name="Select")
                if btn.count():
                    btn.first.click()
                    break
                time.sleep(0.5)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            page.wait_for_function("() => Array.from(document.querySelectorAll('.jp-InputArea-prompt'))"
                                   ".some(e => /[*\\d]/.test(e.innerText))", timeout=60_000)
            t0, deadline = time.time(), time.time() + 200
            idle_for, gem_shots = 0, 0
            while time.time() < deadline:
                s = page.evaluate(JS_STATE)
                s["t"] = time.time() - t0
                samples.append(s)
                busy = [i for i, p in enumerate(s["prompts"]) if "*" in p]
                cm = s["plots"].get("ChunkMap")
                if busy and busy[0] == 3 and cm and cm["cells"]:
                    snapshot()  # the ranks are up: remember them for the leak check
                    n_gem = len([x for x in _during(samples, 3) if "ChunkMap" in x["plots"]])
                    if (gem_shots, n_gem) in ((0, 3), (1, 8)):
                        _shot(page, f"gemini_running_{gem_shots}.png")
                        gem_shots += 1
                tl = s["plots"].get("PipelineTimeline")
                if busy and busy[0] == 4 and tl and tl["svg_bars"] and not (ART / "pipeline_running.png").exists():
                    _shot(page, "pipeline_running.png")
                idle_for = 0 if busy else idle_for + 1
                if idle_for >= 4:  # run-all finished (or stopped at an error)
                    break
                time.sleep(0.5)
            _shot(page, "dashboard_final.png", full=True)
            outputs = page.evaluate("() => Array.from(document.querySelectorAll('.jp-OutputArea-output'))"
                                    ".map(e => e.innerText.slice(0, 400))")
            before = page.evaluate(JS_STATE)["plots"]
            # a view created later (reloaded tab) must draw the latest picture, not the one the
            # widget was displayed with (what plotly's FigureWidget gets wrong: see _frontend.py)
            page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
            time.sleep(2)
            page.reload()
            page.wait_for_function("window.jupyterapp && document.querySelector('.jp-Notebook')",
                                   timeout=90_000)
            after, t_re = {}, time.time()
            while time.time() - t_re < 60:
                after = page.evaluate(JS_STATE)["plots"]
                if all(k in after for k in before):
                    break
                time.sleep(1)
        finally:
            browser.close()
    (ART / "samples.json").write_text(json.dumps(samples)[:2_000_000])
    busy = _during(samples, 3)
    if len(busy) >= 2:  # the browser's own redraw rate while Gemini trained, for the record
        rate = (busy[-1]["frames"] - busy[0]["frames"]) / max(1e-9, busy[-1]["t"] - busy[0]["t"])
        print(f"browser frames/s while the Gemini cell ran (4 plots): {rate:.1f}")
    text = "\n".join(outputs)
    assert "gemini done" in text and "pipeline done" in text and "moe done" in text, text[-3000:]
    assert not re.search(r"Traceback|Error", text), text[-3000:]

    gem = [s for s in _during(samples, 3) if "ChunkMap" in s["plots"]]
    assert len(gem) >= 2, "the dashboard was not drawn while the Gemini cell ran"
    # chunk cells are drawn (the strip's heatmap image), on more than one tier (legend names them)
    assert max(s["plots"]["ChunkMap"]["cells"] for s in gem) >= 4
    assert max(s["plots"]["ChunkMap"]["heatmaps"] for s in gem) >= 1
    tiers = {d["name"] for s in gem for d in s["plots"]["ChunkMap"]["data"]
             if d["type"] == "scatter" and d["n"] > 0}
    assert {"cpu", "nvme"} <= tiers, tiers
    assert {"cpu", "nvme"} <= set().union(*(s["plots"]["ChunkMap"]["legend"] for s in gem))
    # values change while the cell runs: the loss curve grows, the chunk map's title moves on
    n_loss = [s["plots"]["Training"]["svg_points"] for s in gem if "Training" in s["plots"]]
    assert len(set(n_loss)) >= 2 and max(n_loss) > min(n_loss), n_loss
    titles = {s["plots"]["ChunkMap"]["title"] for s in gem}
    assert len(titles) >= 2, titles
    # the timeline has bars while the pipeline cell runs, with the bubble fraction per stage
    pp = [s for s in _during(samples, 4) if "PipelineTimeline" in s["plots"]]
    bars = [s["plots"]["PipelineTimeline"]["svg_bars"] for s in pp]
    assert bars and max(bars) > 0, bars
    assert any("bubble" in t for s in pp for t in s["plots"]["PipelineTimeline"]["ticks"]), \
        "no bubble fraction on the timeline rows"
    # memory gauges filled with no sampler in any cell: the relay's sampler on each rank reports
    # its RSS (with its peak, which only the sampler measures) next to Gemini's own accounting
    rss = {d["name"] for s in samples if "MemoryGauges" in s["plots"]
           for d in s["plots"]["MemoryGauges"]["data"]
           if d["type"] == "indicator" and (d["value"] or 0) > 0 and "peak" in (d.get("title") or "")}
    assert {"rank 0 cpu", "rank 1 cpu"} <= rss, rss
    # the expert-load heatmap: absent while the dense cells ran, drawn once the MoE cell emits
    # ExpertLoad (one heatmap and one dropped-bars trace per MoE layer; capacity 0.5 drops tokens)
    assert not any("ExpertLoadView" in s["plots"] for s in _during(samples, 3) + _during(samples, 4))
    ep = [s["plots"]["ExpertLoadView"] for s in samples if "ExpertLoadView" in s["plots"]]
    assert ep and max(p["heatmaps"] for p in ep) >= 2 and max(p["cells"] for p in ep) >= 2 * 4, ep[-1:]
    names = {d["name"] for d in ep[-1]["data"]}
    assert {"blocks.0.mlp", "blocks.1.mlp", "dropped · blocks.0.mlp", "dropped · blocks.1.mlp"} <= names, names
    assert max(p["svg_bars"] for p in ep) > 0, "no dropped-token bars drawn"
    # after a reload every plot is drawn again from the kernel's latest state
    assert set(before) >= {"Training", "ChunkMap", "PipelineTimeline", "MemoryGauges",
                           "ExpertLoadView"}, before.keys()
    for k in before:
        assert k in after, f"{k} not drawn after reloading the page: {sorted(after)}"
        assert after[k]["title"] == before[k]["title"], (k, before[k]["title"], after[k]["title"])
        assert after[k]["data"] == before[k]["data"], k
    # the browser drew the live updates in place (Plotly.react per redraw, counted by the ESM)
    gem_frames = [s["frames"] for s in gem]
    assert max(gem_frames) > min(gem_frames), gem_frames


def _during(samples, cell):
    return [s for s in samples if any("*" in p for p in s["prompts"][cell:cell + 1])]


def _first(samples, cell):
    return next(s for s in _during(samples, cell) if "ChunkMap" in s["plots"])
