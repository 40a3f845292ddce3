#!/usr/bin/env bash
# The GPU check, one command, for a machine where a CUDA build of torch is already importable and
# nothing else may be reachable (a typical GPU image): installs this package without its
# dependencies when it is not importable yet, then runs scripts/gpu_check.py — the GPU tests,
# the first-contact scenarios, Gemini at 1.4B parameters, int8 generation, the README snippet and
# the GPU benchmarks — prints one table and writes gpu-check.json. Exit status 1 if any errored.
#   bash scripts/gpu-check.sh                           # all of it (bounded to ~10 min)
#   bash scripts/gpu-check.sh --json out/gpu.json --only 'fc-*,int8-generate'
#   bash scripts/gpu-check.sh --cpu                     # the same runner, tiny, on a CPU
# Python: $PYTHON if set, else .venv/bin/python when it imports torch, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x .venv/bin/python ] && .venv/bin/python -c "import torch" 2>/dev/null; then
  PY=.venv/bin/python
else
  PY=python3
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "gpu-check: $PY cannot import torch; use a machine image with torch installed, or run bash scripts/setup.sh" >&2
  exit 2
fi
# This checkout's engine importable? (a copy installed from elsewhere would test other code)
if ! "$PY" - <<'EOF' 2>/dev/null; then
import pathlib, sys
import colossal_lab.engine as e
sys.exit(pathlib.Path(e.__file__).resolve().parent != pathlib.Path("engine").resolve())
EOF
  echo "gpu-check: installing colossal-lab from this checkout (editable, no dependencies)" >&2
  "$PY" -m pip install -q --no-deps --no-build-isolation -e .
fi
exec "$PY" scripts/gpu_check.py "$@"
