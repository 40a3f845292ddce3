"""One exception for "something failed on some ranks", with every failing rank's traceback.

ipyparallel raises a ``CompositeError`` keyed by *engine id*; users think in ranks, and a
collective timeout from gloo/NCCL ("Application timeout caused pair closure") says nothing
about its likely cause. ``RankError`` re-labels each remote error by rank and, when a rank
died in a collective timeout, says so in plain words.

``cl.launch``'s start-up errors live here too: ``LauncherSetupError`` (a launcher lacks a program,
package or setting on this host; raised before any process starts) and ``EngineStartError`` (an
engine exited while starting, with the end of its own log).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional

# Messages torch/gloo/NCCL use when a collective gives up waiting.
_TIMEOUT_RE = re.compile(r"timed out|timeout|Timeout|TIMEOUT|watchdog", re.I)
_COLLECTIVE_ENAMES = {"RuntimeError", "DistBackendError", "DistError", "DistNetworkError",
                      "DistStoreError", "TimeoutError"}


@dataclass
class RankFailure:
    """One rank's failure: the remote exception's name, message and formatted traceback."""

    rank: int
    ename: str
    evalue: str
    traceback: str
    collective_timeout: bool = False
    host: str = ""  # the host the rank ran on ('' when not known)


def is_collective_timeout(ename: str, evalue: str) -> bool:
    return ename in _COLLECTIVE_ENAMES and bool(_TIMEOUT_RE.search(evalue or ""))


class RankError(RuntimeError):
    """Raised in the notebook when one or more ranks raised.

    ``failures`` maps rank -> ``RankFailure``; ``note`` says what the cluster did to recover
    (interrupted the other ranks, rebuilt the process group, restarted the engines). When the
    ranks span hosts (``name_hosts``) each failing rank is named with its host.
    """

    def __init__(self, failures: Dict[int, RankFailure], note: str = "", timeout_s: Optional[float] = None,
                 name_hosts: bool = False):
        self.failures = dict(sorted(failures.items()))
        self.note = note
        self.timeout_s = timeout_s
        self.name_hosts = name_hosts  # the ranks span hosts: each failing rank is named with its host
        super().__init__(self._message())

    def _render_traceback_(self) -> List[str]:
        """IPython shows this instead of our own (uninteresting) local frames."""
        return [f"RankError: {self}"]

    @property
    def ranks(self) -> List[int]:
        return list(self.failures)

    @property
    def hosts(self) -> Dict[int, str]:
        """rank -> the host it ran on, for the failing ranks whose host is known."""
        return {r: f.host for r, f in self.failures.items() if f.host}

    def _message(self) -> str:
        heads = []
        for r, f in self.failures.items():
            on = f" on {f.host}" if f.host and self.name_hosts else ""
            who = f"rank {r}{on}"
            if f.collective_timeout:
                after = f" after {self.timeout_s:g}s" if self.timeout_s else ""
                heads.append(f"{who}: a torch.distributed collective timed out{after} — most likely "
                             f"another rank failed or not every rank called the same collective "
                             f"({f.ename}: {_first_line(f.evalue)})")
            else:
                heads.append(f"{who}: {f.ename}: {_first_line(f.evalue)}")
        lines = [f"{len(self.failures)} rank(s) failed: ranks {self.ranks}"] + ["  " + h for h in heads]
        if self.note:
            lines.append(self.note)
        for r, f in self.failures.items():
            on = f" on {f.host}" if f.host and self.name_hosts else ""
            lines.append(f"\n----- rank {r}{on} traceback -----\n{f.traceback.rstrip()}")
        return "\n".join(lines)


class LauncherSetupError(ValueError):
    """``cl.launch``'s launcher cannot start engines from here: something it needs is missing.

    Raised before any process starts. ``launcher`` is the ``launcher=`` argument, ``missing`` the
    program, package or setting it lacks, ``fix`` what to do about it."""

    def __init__(self, launcher: str, missing: str, fix: str, detail: str = ""):
        self.launcher, self.missing, self.fix = launcher, missing, fix
        why = f": {detail}" if detail else ""
        super().__init__(f"launcher={launcher!r} needs {missing}{why}. Fix: {fix}")


class EngineStartError(RuntimeError):
    """An engine (or the process that starts engines, such as ``mpiexec``) exited while
    ``cl.launch`` waited for the engines; ``log_tail`` is the end of that process's own log."""

    def __init__(self, message: str, log_tail: str = ""):
        self.log_tail = log_tail
        super().__init__(message)


def _first_line(s: str, limit: int = 300) -> str:
    s = (s or "").strip().splitlines()[0] if (s or "").strip() else ""
    return s if len(s) <= limit else s[:limit] + "…"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def clean_traceback(text: str) -> str:
    """Drop ipyparallel's own frames (``do_apply`` and the ``<string>`` shim) from a remote
    traceback, so the first frame shown is the user's code."""
    lines = strip_ansi(text).splitlines()
    out, skip = [], False
    for line in lines:
        if line.startswith("File "):
            skip = "ipyparallel/engine/kernel.py" in line or line.startswith("File <string>:1")
        elif line and not line.startswith(" ") and not line.startswith("-"):
            skip = False  # the final "Name: message" line, or the banner
        if not skip:
            out.append(line)
    return "\n".join(out)
