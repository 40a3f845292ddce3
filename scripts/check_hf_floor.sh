#!/usr/bin/env bash
# Run the Hugging Face tests against the oldest transformers and peft colossal-lab claims to support
# (engine/models/hf/version.py: TRANSFORMERS_FLOOR, PEFT_FLOOR; pyproject.toml's [hf] extra says the same).
#   bash scripts/check_hf_floor.sh [DIR] [pytest arguments...]
# DIR (default: a fresh temporary folder) gets a virtual environment that holds only the floor releases
# (and what they pin) and sees everything else of .venv behind them: so torch and the test tools are the
# project's own, and only transformers/peft (and their pins) are older. Needs `bash scripts/setup.sh` first.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DIR=${1:-$(mktemp -d /tmp/cl-hf-floor.XXXXXX)}
shift || true
TESTS=("$@")
[ ${#TESTS[@]} -gt 0 ] || TESTS=(tests/hybrid/test_hf_tp.py tests/hybrid/test_hf_pp.py tests/hybrid/test_hf_checkpoint.py tests/engine/test_lora.py
                                 tests/planner/test_memory_hf.py tests/planner/test_layout_hf.py
                                 tests/hybrid/test_hf_cp.py tests/hybrid/test_hf_tp_nd.py
                                 tests/engine/test_export_llama.py tests/hybrid/test_hf_pp_inputs.py
                                 tests/planner/test_memory_vocab.py tests/planner/test_shard_hf.py tests/engine/test_quant_hf.py)
floor() {  # "5.3.0" from the engine's constant, read without importing the engine
  .venv/bin/python -c "import runpy; g = runpy.run_path('engine/models/hf/version.py'); print('%d.%d.0' % g['$1'])"
}
TF=$(floor TRANSFORMERS_FLOOR)
PF=$(floor PEFT_FLOOR)
if [ ! -x "$DIR/bin/python" ]; then
  .venv/bin/python -m venv --system-site-packages "$DIR"
fi
OWN=$("$DIR/bin/python" -c "import site; print(site.getsitepackages()[0])")
# .venv's packages, after the floor environment's own (a .pth path line is appended to sys.path)
.venv/bin/python -c "import site; print(site.getsitepackages()[0])" > "$OWN/zz_project_venv.pth"
"$DIR/bin/python" -m pip install -q "transformers==$TF" "peft==$PF" 2>&1 | grep -v -i "warning\|requires\|incompatible" || true
"$DIR/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" 2>&1 | grep -v -i "warning" || true
"$DIR/bin/python" -c "import transformers, peft; print('floor: transformers', transformers.__version__, '| peft', peft.__version__)"
cd "$ROOT"
exec "$DIR/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
