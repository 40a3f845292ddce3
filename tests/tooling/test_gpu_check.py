"""scripts/gpu-check.sh on this CPU machine (``--cpu``: tiny sizes, gloo, CUDA hidden).

The run happens the way a bare GPU image sees it: the Jupyter-side packages are made
unimportable (a ``sitecustomize`` on PYTHONPATH refuses them in every process of the run), so
``pytest-collect`` also proves that the suite's Jupyter modules skip cleanly where those
packages are absent. The table and the JSON file are read back and compared.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT

BASH = shutil.which("bash")
#: Not on a bare GPU image: the Jupyter-side packages and what comes only with them.
ABSENT = ("ipyparallel", "ipywidgets", "jupyterlab", "plotly", "anywidget", "nbclient", "papermill",
          "playwright", "nbformat", "ipykernel", "jupyter_client", "jupyter_core", "jupyter_server",
          "IPython", "zmq", "traitlets", "tornado", "cloudpickle", "psutil")
BLOCKER = """import sys
_ABSENT = set(%r)
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _ABSENT:
            raise ModuleNotFoundError("No module named %%r (absent on this image)" %% name, name=name)
sys.meta_path.insert(0, _Absent())
""" % (ABSENT,)

STALL = """import sys, time
class _Stall:
    def find_spec(self, name, path=None, target=None):
        if name == "colossal_lab.engine.quant" and sys.argv[1:3] == ["--scenario", %r]:
            time.sleep(600)  # the scenario is in its work (torch loaded) and stays there until killed
sys.meta_path.insert(0, _Stall())
"""

#: What the quick check leaves to the full one (the quick run below covers the rest of a subset)
SUBSET = ["pytest-collect", "fc-ddp-fp32", "bench-engine", "pytest-cuda-paths"]
QUICK = ["pytest-gpu",
         *(f"fc-{p}-{pr}" for p in ("ddp", "zero1", "zero2", "gemini", "hybrid") for pr in ("bf16", "fp16")),
         "gemini-cuda", "gemini-cpu", "gemini-auto", "gemini-auto-nvme", "int8-generate", "readme-snippet"]


def _env(tmp_path, blocked=True, stall=None):
    """``blocked``: a bare GPU image (BLOCKER); ``stall``: the scenario whose process hangs (STALL)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable)
    code = (BLOCKER if blocked else "") + (STALL % stall if stall else "")
    if code:
        site = tmp_path / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(code)
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _check(tmp_path, *args, blocked=True, stall=None, timeout=600):
    out = tmp_path / "gpu-check.json"
    r = subprocess.run([BASH, str(ROOT / "scripts" / "gpu-check.sh"), "--cpu", "--json", str(out), *args],
                       cwd=ROOT, env=_env(tmp_path, blocked, stall), capture_output=True, text=True,
                       timeout=timeout)
    return r, (json.loads(out.read_text()) if out.exists() else None)


def _running(needle):
    """Processes whose command line contains ``needle`` (arguments joined by NUL, as /proc has them)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if d.name.isdigit() and needle in cmd:
            found.append(d.name)
    return found


def _table_rows(stdout):
    lines = stdout.splitlines()
    head = next(i for i, l in enumerate(lines) if re.match(r"scenario\s+\| status\s+\| figure\s+\| seconds", l))
    rows = []
    for line in lines[head + 2:]:
        if not line.strip():
            break
        rows.append([c.strip() for c in line.split(" | ")])
    return rows


def _same_as_the_table(stdout, report, names):
    """The table says what the JSON says, row for row, in the runner's order."""
    by_name = {s["name"]: s for s in report["scenarios"]}
    assert [s["name"] for s in report["scenarios"]] == names  # the runner's order, each once
    rows = _table_rows(stdout)
    assert [row[0] for row in rows] == names
    for name, status, figure, seconds in rows:
        assert status == by_name[name]["status"]
        assert float(seconds) == pytest.approx(by_name[name]["seconds"], abs=0.06)
        assert by_name[name]["figure"].startswith(figure.rstrip("…"))
    return by_name


def test_cpu_run_of_a_subset_on_a_bare_image(tmp_path):
    r, report = _check(tmp_path, "--only", ",".join(SUBSET))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert report["mode"] == "cpu" and report["ok"] is True and report["cuda_available"] is False
    assert report["counts"] == {"ok": 4, "error": 0, "skipped": 0} and report["quick"] is False
    by_name = _same_as_the_table(r.stdout, report, SUBSET)
    assert re.search(r"\d+ tests collected", by_name["pytest-collect"]["figure"])
    d = by_name["fc-ddp-fp32"]["detail"]
    assert by_name["fc-ddp-fp32"]["status"] == "ok" and "tok/s" in by_name["fc-ddp-fp32"]["figure"]
    assert d["tokens_per_s"] > 0 and d["losses"][-1] < d["losses"][0]
    assert re.match(r"ours/plain [\d.]+ \(paired [\d.]+\), fp32", by_name["bench-engine"]["figure"])
    # run beside the others; without CUDA only collected (its files are the CPU suite's)
    assert re.match(r"\d+/\d+ tests collected \(\d+ deselected\)", by_name["pytest-cuda-paths"]["figure"])


def test_the_quick_check_on_a_bare_image_writes_its_json_and_markdown_where_told(tmp_path):
    out = tmp_path / "out"
    r, _ = _check(tmp_path, "--quick", "--out", str(out))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["quick"] is True and report["budget"] == 270 and report["ok"] is True
    by_name = _same_as_the_table(r.stdout, report, QUICK)
    for name in QUICK:
        if name.startswith("fc-") or name in ("gemini-cpu", "gemini-auto", "gemini-auto-nvme"):
            d = by_name[name]["detail"]
            assert by_name[name]["status"] == "ok" and "tok/s" in by_name[name]["figure"], name
            assert d["tokens_per_s"] > 0 and d["losses"][-1] < d["losses"][0], name
    assert by_name["gemini-auto-nvme"]["detail"]["plugin_kwargs"]["placement_policy"] == "auto"
    assert by_name["gemini-cuda"]["status"] == "skipped" and "needs a CUDA device" in by_name["gemini-cuda"]["figure"]
    assert by_name["pytest-gpu"]["status"] == "skipped"  # every gpu test skips without CUDA
    assert by_name["int8-generate"]["figure"].startswith("tokens == bf16")
    assert by_name["readme-snippet"]["status"] == "ok"
    # the markdown docs/gpu.md keeps: a heading with the commit, one row per scenario, the counts
    md = (out / "gpu-check.md").read_text().splitlines()
    assert md[0].startswith("### ") and f"commit {report['commit']}" in md[0] and "--quick" in md[0]
    table = [line for line in md if line.startswith("| ") and not line.startswith("| scenario")]
    assert [line.split(" | ")[0][2:] for line in table] == QUICK
    assert md[-1] == (f"{report['counts']['ok']} ok, 0 error, {report['counts']['skipped']} skipped in "
                      f"{report['seconds']:.0f} s")


def test_time_limits_a_scenario_past_its_limit_errors_and_a_spent_budget_skips_the_rest(tmp_path):
    # int8-generate (run first: the runner's order) is held in its work past the 3 s limit (STALL:
    # its real run, ~5 s on a 2-core box, could end inside the limit on a faster machine);
    # after it, less than the 5 s a scenario needs is left of the 7 s budget
    r, report = _check(tmp_path, "--only", "readme-snippet,int8-generate", "--timeout", "3", "--budget", "7",
                       blocked=False, stall="int8-generate")
    assert r.returncode == 1, r.stdout + r.stderr
    rows = {s["name"]: s for s in report["scenarios"]}
    assert rows["int8-generate"]["status"] == "error" and rows["int8-generate"]["figure"] == "timed out after 3 s"
    assert 3 <= rows["int8-generate"]["seconds"] < 6
    assert (rows["readme-snippet"]["status"], rows["readme-snippet"]["figure"]) == (
        "skipped", "skipped: the 7 s budget is spent")
    assert report["ok"] is False and report["counts"] == {"ok": 0, "error": 1, "skipped": 1}
    assert not _running("--scenario\0int8-generate"), "the timed-out scenario's process was left running"


def test_unknown_scenarios_and_a_missing_gpu_are_refused(tmp_path):
    r = subprocess.run([sys.executable, "scripts/gpu_check.py", "--only", "fc-ddp-fp64"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown scenario(s) ['fc-ddp-fp64']" in r.stderr
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "scripts/gpu_check.py", "--json", str(tmp_path / "x.json")], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "sees no CUDA device" in r.stderr and "--cpu" in r.stderr
    assert not (tmp_path / "x.json").exists()


def test_every_scenario_is_listed_and_the_readme_snippet_is_found():
    r = subprocess.run([sys.executable, "scripts/gpu_check.py", "--list"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    names = r.stdout.split()
    fc = [n for n in names if n.startswith("fc-")]
    assert len(fc) == 15 and {n.split("-")[1] for n in fc} == {"ddp", "zero1", "zero2", "gemini", "hybrid"}
    assert {"gemini-cuda", "gemini-cpu", "gemini-auto", "gemini-auto-nvme", "int8-generate", "readme-snippet",
            "bench-kernels", "bench-quant", "bench-engine", "pytest-gpu", "pytest-collect",
            "pytest-cuda-paths"} <= set(names)
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules["gpu_check"]
    code = mod.readme_snippet()
    readme = (ROOT / "README.md").read_text()
    assert "%%colossal\n" + code in readme  # verbatim, the magic line dropped
    assert "booster.backward(loss, optimizer)" in code
