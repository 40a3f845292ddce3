"""bench/hf.py runs end to end at a tiny size (its figures are not judged here: they live in the
benchmark's output): every case trains beside the one-process baseline and gets its ratios, or is
reported as refused with the plugin's reason."""

import json
import os
import subprocess
import sys

import pytest
from support import ROOT

pytest.importorskip("transformers")


def test_bench_runs_every_case_beside_the_baseline():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "hf.py"), "--hidden", "64", "--layers", "2",
                        "--heads", "4", "--kv-heads", "2", "--vocab", "256", "--batch", "4", "--seq", "32",
                        "--steps", "2"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["one"]["tokens_per_s"] > 0 and report["one"]["peak"] > 0
    assert set(report["cases"]) == {"tp2", "zero2", "pp2"}
    for case, row in report["cases"].items():
        if "refused" in row:  # only a layout the engine refuses for this model, with its reason
            assert case == "pp2" and "pipeline" in row["refused"], row
            continue
        assert row["tokens_per_s"] > 0 and row["tokens_per_s_ratio"] > 0
        assert 0 < row["peak_ratio"] < 1.5 and row["peak_ideal"] == 0.5
    # tensor parallelism holds half of every sharded weight and its optimizer state per rank
    assert report["cases"]["tp2"]["peak_ratio"] < 0.9
