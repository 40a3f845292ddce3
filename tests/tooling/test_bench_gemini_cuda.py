"""``bench/gemini.py --cpu`` (the GPU comparison's harness at tiny sizes on CPU/gloo) runs end to end:
every contender has a row (ran, or skipped with its reason), ratios are computed, and the JSON and
markdown land in ``--out``. Its figures are not judged here: the goals are GPU ones (docs/gemini.md,
"At GPU scale: the harness")."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from support import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))

import gemini_cuda  # noqa: E402
from gemini_cuda_trial import merged_busy  # noqa: E402

RAN_ON_CPU = ["torch", "fsdp2_offload", "gemini_cpu", "gemini_auto", "gemini_auto_nvme"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gbench")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # two trials at a time (CI has 2 cores); one throughput size, a 3-rung capacity ladder
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gemini.py"), "--cpu", "--jobs", "2",
                        "--tput-rungs", "1", "--ladder-rungs", "3", "--steps", "2", "--budget", "240",
                        "--out", str(out)], capture_output=True, text=True, env=env, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


def test_every_contender_has_a_row_and_ratios(run):
    out, r = run
    res = json.loads((out / "gemini_cuda.json").read_text())
    assert json.loads(r.stdout.strip().splitlines()[-1])["bench"] == "gemini_cuda"  # the one JSON line
    assert res["contenders"] == gemini_cuda.CONTENDERS
    assert res["skipped"]["gemini_cuda"] == "skipped: needs CUDA"
    assert res["skipped_for_budget"] == 0
    tput = res["throughput"]["1"]
    for c in RAN_ON_CPU:
        v = tput[c]
        assert v["tokens_per_s"] > 0 and 0 < v["busy"] <= 1, (c, v)
        assert v["vs_fsdp2"] > 0 and v["vs_torch"] > 0
        cap = res["capacity"][c]
        assert cap["tried"] and not cap["incomplete"], (c, cap)
        assert cap["rung"] >= 0 and cap["params"] == res["params"][cap["rung"]]
        assert cap["vs_torch"] > 0
    assert tput["torch"]["vs_torch"] == 1.0 and tput["fsdp2_offload"]["vs_fsdp2"] == 1.0
    md = (out / "gemini_cuda.md").read_text()
    for c in gemini_cuda.CONTENDERS:
        assert gemini_cuda.LABELS[c] in md
    assert "skipped: needs CUDA" in md and md.startswith("### bench/gemini.py --device cpu: ")


def test_absent_libraries_are_skipped_by_name(run):
    out, _ = run
    res = json.loads((out / "gemini_cuda.json").read_text())
    for c, lib in gemini_cuda.NEEDS.items():
        if importlib.util.find_spec(lib) is None:
            assert res["skipped"][c] == f"skipped: not importable ({lib})"
            assert res["skipped"][c] in (out / "gemini_cuda.md").read_text()


def test_skip_reason_names_the_missing_library(monkeypatch):
    monkeypatch.setattr(gemini_cuda.importlib.util, "find_spec", lambda name: None)
    assert gemini_cuda.skip_reason("deepspeed_offload", "cuda") == "skipped: not importable (deepspeed)"
    assert gemini_cuda.skip_reason("colossalai_gemini", "cuda") == "skipped: not importable (colossalai)"
    assert gemini_cuda.skip_reason("torch", "cuda") is None
    assert gemini_cuda.skip_reason("gemini_cuda", "cpu") == "skipped: needs CUDA"


def test_busy_fraction_counts_overlaps_once():
    assert merged_busy([(0, 10), (5, 15), (20, 30)], 40) == pytest.approx(25 / 40)
    assert merged_busy([(0, 10), (2, 3)], 10) == 1.0
    assert merged_busy([], 10) == 0.0


def test_bisection_finds_the_last_rung_that_trains():
    class Fake:
        s = {"cap_bytes": 1}

        def __init__(self, limit):
            self.limit, self.calls = limit, []

        def trial(self, contender, rung, steps, cap):
            self.calls.append(rung)
            return {"ok": rung <= self.limit, "error": None if rung <= self.limit else "oom"}

    for limit in range(-1, 11):
        f = Fake(limit)
        b = gemini_cuda.bisect(f, "torch", 11, 2)
        assert b["rung"] == limit and len(f.calls) <= 4 and b["top"] == (limit == 10)
        f = Fake(limit)  # the first probe where the goal is (the NVMe contender): one trial more at most
        b = gemini_cuda.bisect(f, "gemini_auto_nvme", 11, 2, first=7)
        assert b["rung"] == limit and f.calls[0] == 7 and len(f.calls) <= 5


def test_plan_puts_the_goals_first():
    run = ["torch", "fsdp2_offload", "gemini_cuda", "gemini_cpu", "gemini_auto", "gemini_auto_nvme"]
    p = gemini_cuda.plan(run, [4, 5], True, True)
    assert p[0] == ("cap", "gemini_auto_nvme")
    assert p[1:9] == [("tput", c, k) for k in (4, 5) for c in ("torch", "fsdp2_offload", "gemini_cuda", "gemini_auto")]
    assert ("cap", "torch") not in p  # measured before the plan: the ratios' base
    assert len(p) == 1 + 6 * 2 + 4 and len(set(p)) == len(p)


def test_budget_skips_what_is_left():
    r = gemini_cuda.Runner({"ladder": [(64, 1)], "cap_bytes": 1}, budget=0, nvme_dir="/tmp")
    t = r.trial("torch", 0, 2, 1)
    assert t == {"ok": False, "skipped": True, "error": "skipped: budget"}
    b = gemini_cuda.bisect(r, "torch", 9, 2)
    assert b["incomplete"] and b["rung"] == -1
    assert [t["error"] for t in r.log] == ["skipped: budget"] * 2  # counted in skipped_for_budget


def test_gemini_py_dispatches_only_the_harness_flags():
    import gemini

    for argv in (["--device", "cuda"], ["--cpu"], ["--device", "cpu", "--tiny"]):
        assert gemini._wants_harness(argv), argv
    for argv in ([], ["--device", "cpu"], ["--budget-mib", "512"]):  # the CPU benchmarks, as before
        assert not gemini._wants_harness(argv), argv
