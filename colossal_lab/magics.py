"""``%colossal`` magics: launch/inspect/stop ranks and run cells on them from a notebook.

Built on IPython's ``Magics`` and argparse. ipyparallel has ``%px``, but it labels output by
engine id and knows nothing of torch.distributed; ``%%colossal`` runs the cell through
``Cluster.execute`` (rank labels, rank-ordered errors, Ctrl-C reaching every rank).

    %load_ext colossal_lab
    %colossal launch -n 2 [--backend auto|gloo|nccl] [--launcher local|mpi|ssh|slurm] [--timeout S]
                     [--start-timeout S]
    %colossal status | stop | restart | dashboard
    %%colossal [--targets 0,2] [--no-stream]

Wrong flags give IPython's one-line ``UsageError``, never an argparse ``SystemExit``.
"""

from __future__ import annotations

import argparse
import shlex
import time
from typing import List, Optional

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

COMMANDS = ("launch", "status", "stop", "restart", "dashboard")


class _HelpShown(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as ``UsageError`` (one clean line in the notebook)."""

    def error(self, message):  # noqa: D401 - argparse hook
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")

    def exit(self, status=0, message=None):
        if message:
            raise UsageError(f"{self.prog}: {message.strip()}")
        raise _HelpShown()


def _launch_parser() -> _Parser:
    p = _Parser(prog="%colossal launch", add_help=True,
                description="Start N ranks with torch.distributed up (see cl.launch).")
    p.add_argument("-n", "--n", type=int, default=None, help="number of ranks (required)")
    p.add_argument("--backend", default="auto", help="auto (nccl on GPUs, else gloo), gloo or nccl")
    p.add_argument("--launcher", default="local", help="ipyparallel engine launcher: local, mpi, ssh, slurm, ...")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for rendezvous and each collective")
    p.add_argument("--start-timeout", type=float, default=120.0, help="seconds for the engines to start")
    p.add_argument("--threads", type=int, default=None, help="OMP/torch threads per rank")
    p.add_argument("--master-addr", default=None, help="address ranks use to reach this notebook's store")
    return p


def _cell_parser() -> _Parser:
    p = _Parser(prog="%%colossal", add_help=True, description="Run this cell on every rank (or --targets).")
    p.add_argument("--targets", default=None, help="comma-separated ranks, e.g. 0,2 (default: all)")
    p.add_argument("--no-stream", action="store_true", help="show output when the cell ends, not live")
    return p


def _parse_targets(text: Optional[str]) -> Optional[List[int]]:
    if text is None or text.strip() in ("", "all"):
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"%%colossal: --targets {text!r} must be comma-separated rank numbers, "
                         "e.g. --targets 0,2") from None


def _split(line: str, prog: str) -> List[str]:
    try:
        return shlex.split(line)
    except ValueError as e:
        raise UsageError(f"{prog}: cannot parse {line!r}: {e}") from None


@magics_class
class ColossalMagics(Magics):
    """The ``%colossal`` line magic and ``%%colossal`` cell magic."""

    @line_cell_magic
    def colossal(self, line: str, cell: Optional[str] = None):
        try:
            if cell is None:
                return self._line(line)
            return self._cell(line, cell)
        except _HelpShown:
            return None

    # ---------------------------------------------------------------- line commands
    def _line(self, line: str):
        args = _split(line, "%colossal")
        if not args:
            raise UsageError(f"%colossal needs a command: one of {', '.join(COMMANDS)} "
                             f"(e.g. %colossal launch -n 2); run a cell on the ranks with %%colossal")
        cmd, rest = args[0], args[1:]
        if cmd in ("-h", "--help", "help"):
            print(__doc__)
            return None
        if cmd not in COMMANDS:
            raise UsageError(f"%colossal: unknown command {cmd!r}: use one of {', '.join(COMMANDS)}")
        if cmd != "launch" and rest:
            raise UsageError(f"%colossal {cmd} takes no arguments (got {' '.join(rest)!r})")
        return getattr(self, f"_cmd_{cmd}")(rest)

    def _cmd_launch(self, rest: List[str]):
        from . import cluster as _cluster
        from .launch import launch, make_config

        parser = _launch_parser()
        a, extra = parser.parse_known_args(rest)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if a.n is None:
            parser.error("the number of ranks is required, e.g. %colossal launch -n 2")
        try:  # validate before stopping anything or starting any process
            make_config(a.n, a.backend, a.launcher, timeout=a.timeout, start_timeout=a.start_timeout,
                        threads=a.threads, master_addr=a.master_addr)
        except ValueError as e:
            raise UsageError(f"%colossal launch: {e}") from None
        old = _cluster._current
        if old is not None and old.running:
            print(f"stopping the running cluster ({old.n} ranks) first")
            old.stop()
        t0 = time.perf_counter()
        c = launch(a.n, a.backend, a.launcher, timeout=a.timeout, start_timeout=a.start_timeout,
                   threads=a.threads, master_addr=a.master_addr)
        print(f"{c.n} ranks up in {time.perf_counter() - t0:.1f}s: backend={c.backend}, "
              f"launcher={c.config.launcher}, MASTER_ADDR={c.master_addr}, MASTER_PORT={c.master_port}")
        return None

    def _cmd_status(self, rest):
        return self._current().status()

    def _cmd_stop(self, rest):
        c = self._current()
        c.stop()
        print(f"stopped {c.n} ranks")

    def _cmd_restart(self, rest):
        c = self._current()
        t0 = time.perf_counter()
        c.restart()
        print(f"restarted {c.n} ranks in {time.perf_counter() - t0:.1f}s (variables on the ranks were reset)")

    def _cmd_dashboard(self, rest):
        c = self._current()
        try:
            from IPython.display import display

            from .relay import attach
            from .widgets import Dashboard
        except ImportError as e:
            raise UsageError(f"%colossal dashboard needs colossal_lab.relay.attach and "
                             f"colossal_lab.widgets.Dashboard, which are not available here: {e}") from None
        attach(c)
        # One dashboard per cluster: showing it again (e.g. after training) shows everything it
        # has gathered since the first call, not an empty new one.
        dash = getattr(c, "_dashboard", None)
        if dash is None:
            dash = c._dashboard = Dashboard()
        else:
            dash.flush()
        display(dash)

    @staticmethod
    def _current():
        from .cluster import current_cluster

        try:
            return current_cluster()
        except RuntimeError as e:
            raise UsageError(str(e)) from None

    # ---------------------------------------------------------------- cell
    def _cell(self, line: str, cell: str):
        parser = _cell_parser()
        a, extra = parser.parse_known_args(_split(line, "%%colossal"))
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        targets = _parse_targets(a.targets)
        c = self._current()
        try:
            ranks = c._check(targets)
        except ValueError as e:
            raise UsageError(f"%%colossal --targets: {e}") from None
        c.execute(cell, ranks=ranks, stream=not a.no_stream)
        return None
