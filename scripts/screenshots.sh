#!/usr/bin/env bash
# Regenerate docs/img/*.png: every widget as a real JupyterLab in headless Chromium draws it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --browser
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python scripts/screenshots.py "$@"
