"""scripts/hf_sweep.py, the checker of every causal-LM family transformers ships, run as a user runs it on two
families: its table has one row per family and one column per mode, a known-good family (Llama) follows under
the modes asked, and a family it cannot build tiny (BART, an encoder-decoder) is skipped with its reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_sweep_table_and_json(tmp_path):
    out = tmp_path / "sweep.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "hf_sweep.py"), "--families", "llama,bart",
                           "--modes", "tp2,pp2", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows[0] == "| family | tp2 | pp2 |"
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| llama", "| bart"]
    assert rows[1] == "| llama | follows | follows |"
    got = json.loads(out.read_text())
    assert got["modes"] == ["tp2", "pp2"]
    assert got["results"]["llama"]["tp2"]["status"] == "follows"
    assert got["results"]["llama"]["pp2"]["status"] == "follows"
    assert "encoder-decoder" in got["results"]["bart"]["skipped"]
    assert got["summary"]["modes"]["tp2"] == {"follows": 1, "refused": 0, "FAILS": 0}


def test_sweep_refuses_an_unknown_family_or_mode():
    script = os.path.join(ROOT, "scripts", "hf_sweep.py")
    for args, words in ((["--families", "no_such_family"], "--families"), (["--modes", "tp3"], "--modes")):
        proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr[-2000:]


def test_compact_cells_name_the_new_refusals():
    """The compact table's words for the refusals of layouts read from the module tree and of built-in plans."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_sweep", os.path.join(ROOT, "scripts", "hf_sweep.py"))
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    cells = {"no config.base_model_pp_plan, and the layout read from its module tree does not hold: its base "
             "forward ... does not hand x back": "base forward does more than its modules",
             "it has no config.base_model_pp_plan, and its base model holds 4 lists of 4 blocks (...), not one "
             "layer list to cut between": "no single layer list",
             "BitNetForCausalLM (model_type='bitnet') is not cut by tensor parallelism: ...": "blocks tp cannot cut",
             "carries no tensor-parallel plan (no model.tp_plan, ...)": "no tp plan"}
    for detail, words in cells.items():
        assert sweep.short({"status": "refused", "detail": detail}) == f"refused: {words}", detail
