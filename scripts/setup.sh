#!/usr/bin/env bash
# Idempotent set-up on a fresh machine that has nothing but Python 3.10+.
#   bash scripts/setup.sh            # venv + torch + colossal-lab (editable) + test tools
#   bash scripts/setup.sh --browser  # ... plus Debian's chromium for the browser tests
#   bash scripts/setup.sh --hosts    # ... plus what the launcher tests start as root: Debian's Slurm
#                                    # (slurmctld, slurmd, client, munge), for a one-node Slurm; sshd,
#                                    # ssh, iproute2 and Open MPI with the [mpi] extra (mpi4py), for the
#                                    # two hosts tests/multihost makes of network namespaces
# (flags combine: scripts/test.sh passes both).
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
BROWSER=(); HOSTS=(); EXTRAS=test  # Debian packages the flags ask for and this machine lacks
for flag in "$@"; do
  case "$flag" in
    --browser) command -v chromium >/dev/null 2>&1 || BROWSER=(chromium) ;;
    --hosts) for p in slurmctld slurmd slurm-client munge openssh-server openssh-client iproute2 openmpi-bin; do
               dpkg -s "$p" >/dev/null 2>&1 || HOSTS+=("$p")
             done
             EXTRAS=test,mpi ;;
    *) echo "setup: unknown flag $flag (known: --browser, --hosts)" >&2; exit 2 ;;
  esac
done
if [ $((${#BROWSER[@]} + ${#HOSTS[@]})) -gt 0 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  [ ${#BROWSER[@]} -eq 0 ] || DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${BROWSER[@]}" >/dev/null
  # the daemons only: no documentation, no plugins they do not load
  [ ${#HOSTS[@]} -eq 0 ] || DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${HOSTS[@]}" >/dev/null
fi
"$VPY" -m pip install -q -e ".[$EXTRAS]"  # after the system packages (mpi4py uses the MPI)
echo "colossal-lab set up in .venv ($("$VPY" -c 'import torch; print("torch", torch.__version__)'))"
