#!/usr/bin/env bash
# The main job: set up, then launch a 2-rank CPU cluster from Python and run a distributed
# training step on it (later: the training tutorial, executed headless).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m colossal_lab.demo "$@"
