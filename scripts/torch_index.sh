#!/usr/bin/env bash
# Prints the package index torch should be installed from: torch's CPU wheel index when no
# NVIDIA GPU is visible and that index answers within 5 s, else "default" (pip's own index).
#   bash scripts/torch_index.sh       # -> https://download.pytorch.org/whl/cpu  or  default
# Why: with no GPU, `pip install torch` from PyPI still pulls the multi-GB CUDA build; the CPU
# index serves the CPU build. Why the probe: a machine that cannot reach that index (an offline
# mirror, a firewall) must still install from the index it is configured with.
# Environment: TORCH_CPU_INDEX overrides the CPU index URL; PYTHON is the interpreter for the probe.
# Only nvidia-smi and Python are run, so tests can arrange PATH to show or hide a GPU.
set -euo pipefail
CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
CPU_INDEX=${CPU_INDEX%/}

# `nvidia-smi -L` lists GPUs and fails when the driver sees none; absent: no NVIDIA GPU.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "torch index: default (an NVIDIA GPU is visible: its CUDA build is wanted)" >&2
  echo default
  exit 0
fi

# The probe runs in a thread joined for at most 5 s in all, name resolution included (urlopen's
# own timeout does not bound DNS).
if "${PYTHON:-python3}" - "$CPU_INDEX/torch/" <<'EOF' 2>/dev/null; then
import sys, threading, urllib.request

ok = []

def probe():
    with urllib.request.urlopen(sys.argv[1], timeout=5) as r:
        r.read(1)
        ok.append(r.status)

t = threading.Thread(target=probe, daemon=True)
t.start()
t.join(5)
sys.exit(0 if ok else 1)
EOF
  echo "torch index: $CPU_INDEX (no NVIDIA GPU visible)" >&2
  echo "$CPU_INDEX"
else
  echo "torch index: default ($CPU_INDEX unreachable)" >&2
  echo default
fi
