"""Host memory as the kernel counts it, for the benchmarks that cap peak RSS (``bench/gemini.py`` and its
GPU harness's CPU mode): the current and peak resident set (``/proc/self/status``) and a reset of the peak
mark, so that what a process allocated at import does not count against a trial."""

from __future__ import annotations


def rss_mib(field: str = "VmRSS") -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (the peak since start or the last :func:`reset_peak`), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return 0.0


def reset_peak() -> None:
    """Reset the kernel's peak-RSS mark (VmHWM); a kernel that refuses it leaves the mark as is."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
