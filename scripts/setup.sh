#!/usr/bin/env bash
# Idempotent set-up on a fresh machine that has nothing but Python 3.10+.
#   bash scripts/setup.sh            # venv + torch + colossal-lab (editable) + test tools
#   bash scripts/setup.sh --browser  # ... plus Debian's chromium for the browser tests
# Why torch first: a bare `torch` requirement with nothing installed pulls a multi-GB CUDA
# build. We install torch==2.13.0 only when no torch is importable (or the importable one is
# below the engine's floor), so a machine's own build (CUDA or CPU, seen through
# --system-site-packages) is kept. Which build: with no NVIDIA GPU visible, the CPU build from
# torch's CPU wheel index (scripts/torch_index.sh probes it); with a GPU, or when that index is
# unreachable, pip's default index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
# engine/__init__.py holds the floor; running it checks the importable torch against it.
if ! "$VPY" -c "import runpy, torch; runpy.run_path('engine/__init__.py')" 2>/dev/null; then
  TORCH_SPEC="torch==${TORCH_VERSION:-2.13.0}"
  INDEX=$(PYTHON="$VPY" bash scripts/torch_index.sh)
  if [ "$INDEX" = default ]; then
    "$VPY" -m pip install -q "$TORCH_SPEC"
  elif ! "$VPY" -m pip install -q --index-url "$INDEX" "$TORCH_SPEC"; then
    echo "setup: installing $TORCH_SPEC from $INDEX failed; trying the default index" >&2
    "$VPY" -m pip install -q "$TORCH_SPEC"
  fi
fi
"$VPY" -m pip install -q -e ".[test]"

if [ "${1:-}" = "--browser" ] && ! command -v chromium >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
echo "colossal-lab set up in .venv ($("$VPY" -c 'import torch; print("torch", torch.__version__)'))"
