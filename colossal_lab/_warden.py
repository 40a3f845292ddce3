"""``python -m colossal_lab._warden KERNEL_PID KERNEL_START PID...``: a small process on the
notebook's host that stops what the kernel started there when the kernel dies without cleanup.

With the ``local`` launcher rank 0 shares the kernel's host and takes the controller down itself
(``_rank.watch_parent``). With ``ssh``, ``mpi`` or ``slurm`` no rank need be on the kernel's host,
so ``Cluster.start`` starts this warden beside the ipyparallel controller: it polls the kernel once
a second, kills the given processes and their children (the controller and its schedulers) once the
kernel is gone, and exits by itself when they exit first (the cluster was stopped). The ranks, on
whatever host, leave by themselves when the kernel's rendezvous store goes (``_rank.watch_store``).
"""

from __future__ import annotations

import sys

from ._rank import wait_for_kernel


def main(argv) -> int:
    pid, start, *others = argv
    wait_for_kernel(int(pid), float(start), [int(p) for p in others], until_they_exit=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
