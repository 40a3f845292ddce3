#!/usr/bin/env bash
# The test command: set up everything, then run the whole suite (CPU, gloo, real processes,
# real notebooks, a real JupyterLab in headless Chromium, a one-node Slurm, two hosts made of network
# namespaces running sshd and Open MPI), after ruff. GPU tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --browser --hosts
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/ruff check .  # lint first (pyproject.toml [tool.ruff]): a finding fails the run in seconds
exec .venv/bin/python -m pytest -ra --durations=40 "$@"  # the 40 slowest tests named in every log
