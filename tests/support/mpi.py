"""Which MPI ``mpiexec`` is: the tests that pass Open MPI's own flags (a hostfile, ``plm_rsh_agent``,
``--allow-run-as-root``) run only under Open MPI."""

from __future__ import annotations

import shutil
import subprocess


def open_mpi() -> bool:
    """Whether the ``mpiexec`` on the PATH is Open MPI's."""
    exe = shutil.which("mpiexec")
    if exe is None:
        return False
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    return "Open MPI" in out.stdout + out.stderr or "OpenRTE" in out.stdout + out.stderr
