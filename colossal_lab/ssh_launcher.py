"""ipyparallel's SSH engine launchers, with ``cl.launch``'s one start-up timeout for the first contact.

Before it starts an engine, ipyparallel's SSH engine launcher probes the host's shell with one ``ssh host
echo ...`` (``ShellCommandSend.initialize``) under a fixed 10 s limit of its own. On a loaded machine that
first contact (the key exchange, a busy sshd) can take longer, and the launch then failed with "Timeout of
10s reached while retrieving remote shell information" whatever ``start_timeout`` the user gave. These
subclasses give that probe ``probe_timeout`` (``cl.launch`` sets it to ``start_timeout``) and change nothing
else: every other ssh command and option is ipyparallel's. Configuration written for ipyparallel's own
``SSHEngineSetLauncher`` applies to them unchanged (traitlets applies a class's section to its subclasses).
Imported only for ``launcher="ssh"``.
"""

from __future__ import annotations

from ipyparallel.cluster.launcher import SSHEngineLauncher, SSHEngineSetLauncher
from ipyparallel.cluster.shellcmd import ShellCommandSend
from traitlets import Float

_HELP = "seconds the first ssh to a host (ipyparallel's shell probe) may take; cl.launch sets start_timeout"


class PatientSSHEngineLauncher(SSHEngineLauncher):
    """One engine on one host over ssh; its shell probe waits ``probe_timeout`` seconds, not 10."""

    probe_timeout = Float(120.0, config=True, help=_HELP)

    @property
    def ssh_sender(self) -> ShellCommandSend:
        if self._ssh_sender is None:  # built as SSHLauncher.ssh_sender builds it, initialised here
            sender = ShellCommandSend(self.ssh_cmd, self.ssh_args + [self.location], self.remote_python,
                                      initialize=False, log=self.log)
            probe = sender._check_output
            # initialize() passes its own timeout=10 to its one command: ours replaces it
            sender._check_output = lambda cmd, **kw: probe(cmd, **{**kw, "timeout": self.probe_timeout})
            try:
                sender.initialize()
            except Exception as exc:  # its message names its own 10 s, whatever the limit was
                if "Timeout of" not in str(exc):
                    raise
                raise TimeoutError(f"the first ssh to {self.location} ({' '.join(self.ssh_cmd + self.ssh_args)}) "
                                   f"did not answer within {self.probe_timeout:g} s (probe_timeout, cl.launch's "
                                   "start_timeout): check that the host is up and reachable, or pass a larger "
                                   "start_timeout") from exc
            finally:
                del sender._check_output  # every later command as ipyparallel runs it
            self._ssh_sender = sender
        return self._ssh_sender


class PatientSSHEngineSetLauncher(SSHEngineSetLauncher):
    """ipyparallel's ``ssh`` engine set; ``probe_timeout`` reaches each engine's launcher (a shared trait)."""

    launcher_class = PatientSSHEngineLauncher
    probe_timeout = Float(120.0, config=True, help=_HELP)
