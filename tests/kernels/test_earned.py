"""On a GPU, ``backend=None`` runs a Triton kernel only where it was measured at least as fast as torch's
path for the same call on that device (``kernels/earned.py`` over ``kernels/measured.py``), and says why;
the benchmark writes those records. The rule is a pure function of the records, tested here on CPU."""

import json
import os
import subprocess
import sys

import pytest
from support import ROOT

from colossal_lab.kernels import earned
from colossal_lab.kernels.measured import RECORDS

H100 = "NVIDIA H100 80GB HBM3"
RECS = [{"op": "flash_attention", "klass": "any", "device": H100, "ratio": 1.07, "when": "d1"},
        {"op": "fused_adamw", "klass": "any", "device": H100, "ratio": 0.95, "when": "d1"},
        {"op": "int8_linear", "klass": "decode", "device": H100, "ratio": 1.9, "when": "d1"},
        {"op": "int8_linear", "klass": "any", "device": H100, "ratio": 0.7, "when": "d1"}]


def test_triton_only_where_it_measured_at_least_as_fast_on_this_device():
    assert earned.verdict("flash_attention", H100, records=RECS, rule="measured")[0] == "triton"
    who, why = earned.verdict("fused_adamw", H100, records=RECS, rule="measured")
    assert who == "torch" and "0.950x" in why
    # a record of the call's own shape class wins over the op's general one
    assert earned.verdict("int8_linear", H100, "decode", records=RECS, rule="measured")[0] == "triton"
    assert earned.verdict("int8_linear", H100, "prefill", records=RECS, rule="measured")[0] == "torch"
    # another GPU, or an op never measured: torch, and the reason says so
    who, why = earned.verdict("flash_attention", "NVIDIA A100-SXM4-40GB", records=RECS, rule="measured")
    assert who == "torch" and "not measured on NVIDIA A100" in why
    assert earned.verdict("rms_norm", H100, records=RECS, rule="measured")[0] == "torch"


def test_the_environment_can_force_either_backend_and_a_bad_value_is_named(monkeypatch):
    monkeypatch.setenv(earned.ENV, "triton")
    assert earned.verdict("fused_adamw", H100, records=RECS) == ("triton", f"{earned.ENV}=triton")
    monkeypatch.setenv(earned.ENV, "torch")
    assert earned.verdict("flash_attention", H100, records=RECS)[0] == "torch"
    monkeypatch.setenv(earned.ENV, "fast")
    with pytest.raises(ValueError, match=r"COLOSSAL_LAB_KERNELS='fast': choose one of \('measured', 'triton'"):
        earned.verdict("flash_attention", H100, records=RECS)


def test_the_shipped_records_name_real_ops_and_keep_the_slower_kernels_off():
    ops = {"flash_attention", "fused_adamw", "int8_linear", "rms_norm"}
    for r in RECORDS:
        assert r["op"] in ops and isinstance(r["ratio"], float) and r["device"] and r["when"], r
    # every kernel measured on the H200 so far lost to torch: none of them runs there by default
    for r in RECORDS:
        assert earned.verdict(r["op"], r["device"], r["klass"], rule="measured")[0] == (
            "triton" if r["ratio"] >= 1 else "torch")


def test_the_benchmark_writes_records_in_the_dispatchers_form_and_refuses_to_on_cpu():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "bench" / "kernels.py")
    bench_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_kernels)
    out = {"device": H100, "flash_attention_fwd_bwd": {"speed_ratio": 1.2, "baseline": "sdpa"},
           "int8_linear_decode_M1": {"speed_ratio": 0.8, "baseline": "bfloat16_linear"}}
    recs = bench_kernels.records(out, when="2026-12-01 abc1234")
    assert recs == [{"op": "flash_attention", "klass": "any", "device": H100, "ratio": 1.2, "baseline": "sdpa",
                     "when": "2026-12-01 abc1234"},
                    {"op": "int8_linear", "klass": "decode", "device": H100, "ratio": 0.8,
                     "baseline": "bfloat16_linear", "when": "2026-12-01 abc1234"}]
    assert earned.verdict("flash_attention", H100, records=json.loads(json.dumps(recs)), rule="measured")[0] == "triton"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels.py"), "--record", "x.json"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "--record" in p.stderr and "no CUDA device here" in p.stderr
