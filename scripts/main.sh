#!/usr/bin/env bash
# The main job: set up, then run the training tutorial headless (2 ranks, Gemini with the NVMe
# tier, a real stdlib corpus) and write the executed notebook and an HTML copy to out/.
#   bash scripts/main.sh                       # laptop size (a few minutes on a CPU)
#   bash scripts/main.sh -p preset tiny -p steps 30   # any papermill parameter overrides
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p out
# The HTML copy cannot run widgets: they render as static figures there.
export COLOSSAL_LAB_WIDGETS=${COLOSSAL_LAB_WIDGETS:-static}
( cd out && ../.venv/bin/papermill ../tutorials/01_training.ipynb 01_training.ipynb -k python3 "$@" )
.venv/bin/jupyter nbconvert --to html out/01_training.ipynb --output 01_training.html >/dev/null
echo "main job done: out/01_training.ipynb and out/01_training.html"
