"""The Hugging Face tests of what the adapter reads from transformers and peft (the list in
``scripts/check_hf_floor.sh``, which says why each) pass on the oldest transformers and peft the project
claims (the floors in engine/models/hf/version.py and pyproject.toml's ``[hf]``): the script builds an
environment with exactly those releases in front of the project's own and runs them there."""

import os
import subprocess

import pytest
from support import ROOT

pytest.importorskip("transformers")


def test_the_hf_tests_pass_on_the_floor_releases(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "check_hf_floor.sh"), str(tmp_path / "floor")],
                       capture_output=True, text=True, env=env, timeout=1500, cwd=ROOT)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    from colossal_lab.engine.models.hf.version import PEFT_FLOOR, TRANSFORMERS_FLOOR

    tf, pf = "%d.%d.0" % TRANSFORMERS_FLOOR, "%d.%d.0" % PEFT_FLOOR
    assert f"floor: transformers {tf} | peft {pf}" in out, out[-2000:]  # it really ran on the floors
    assert " passed" in out and " failed" not in out and "error" not in out.splitlines()[-1]
