"""The engines' batch job, as ``cl.launch`` sees it while the engines start.

ipyparallel's batch launchers submit the engines as one job (``sbatch`` for Slurm) and then only
wait for engines to register: they never look at the job again (their ``poll`` is a stub), and a
refused submission leaves the scheduler's message on the notebook's stderr, not in the exception.
For Slurm this module reads the job with ``squeue`` (its state and Slurm's reason for it), so the
wait can end as soon as the job has ended and a timeout can say that the job still waits in the
queue and why; and it explains a refused submission by asking ``sbatch --test-only`` about the same
job script, which checks the request against the cluster and submits nothing.

Other schedulers (PBS, SGE, LSF) keep ipyparallel's behaviour: the wait ends at ``start_timeout``.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Any, List, Optional

#: Slurm states of a job that will start no engine any more (``squeue`` shows them for a while).
ENDED = frozenset({"COMPLETED", "COMPLETING", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                   "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED", "GONE"})


#: Reasons Slurm gives for a pending job that the cluster as configured will never run (a partition
#: without the cores or nodes asked for, a time limit above the partition's, an account or QOS not
#: allowed): waiting for them is waiting for nothing.
HOPELESS = frozenset({"PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints",
                      "InvalidAccount", "InvalidQOS", "AccountNotAllowed", "QOSNotAllowed"})


@dataclass(frozen=True)
class JobState:
    """One Slurm job's state (``PENDING``, ``RUNNING``, ... or ``GONE`` once ``squeue`` no longer
    knows it) and Slurm's reason (``BeginTime``, ``Resources``, ``NonZeroExitCode``, ...)."""

    job_id: str
    state: str
    reason: str = ""

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    @property
    def hopeless(self) -> bool:
        """Pending for a reason the cluster as configured will not change."""
        return self.state == "PENDING" and self.reason.split(",")[0].strip() in HOPELESS

    def __str__(self) -> str:
        reason = f" ({self.reason})" if self.reason and self.reason != "None" else ""
        return f"Slurm job {self.job_id} is {self.state}{reason}"


def slurm_jobs(ipp_cluster) -> List[Any]:
    """The cluster's engine sets that are Slurm jobs already submitted (they have a job id)."""
    from ipyparallel.cluster import launcher as L

    return [es for es in list(getattr(ipp_cluster, "engines", {}).values())
            if isinstance(es, L.SlurmLauncher) and getattr(es, "job_id", "")]


def job_state(es) -> JobState:
    """The state of engine set ``es``'s job, from ``squeue`` (run with the launcher's environment)."""
    job = str(es.job_id)
    try:
        r = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T|%r"], capture_output=True, text=True,
                           timeout=30, env=_env(es))
    except (OSError, subprocess.TimeoutExpired) as e:
        return JobState(job, "UNKNOWN", f"squeue failed: {e}")
    line = r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else ""
    if not line:  # "Invalid job id specified": the controller has forgotten the ended job
        return JobState(job, "GONE", "no longer in the queue")
    state, _, reason = line.partition("|")
    return JobState(job, state.strip(), reason.strip())


def stuck_job(ipp_cluster) -> Optional[tuple]:
    """``(JobState, output_file)`` of the first engines' job that will start no engine any more:
    it has ended, or it waits for a reason that will not change (:data:`HOPELESS`); else None."""
    for es in slurm_jobs(ipp_cluster):
        st = job_state(es)
        if st.ended or st.hopeless:
            return st, getattr(es, "output_file", "") or ""
    return None


def waiting_note(ipp_cluster) -> str:
    """``"; Slurm job 7 is PENDING (BeginTime)"`` for each engines' job, or ``""``."""
    return "".join(f"; {job_state(es)}" for es in slurm_jobs(ipp_cluster))


SCRIPT_PREFIX = "colossal-lab-engines-"


def place_job_script(ipp_cluster) -> None:
    """Write the engines' job script into the profile's ``log/`` folder (beside the job's output)
    rather than ipyparallel's default, the notebook's working folder, unless the user named it
    (``batch_file_name``); :func:`remove_job_scripts` deletes it when the cluster stops."""
    cfg = ipp_cluster.config
    if any("batch_file_name" in cfg[section] for section in
           ("BatchSystemLauncher", "SlurmLauncher", "SlurmEngineSetLauncher")):
        return
    log_dir = os.path.join(ipp_cluster.profile_dir, "log")
    os.makedirs(log_dir, exist_ok=True)
    cfg.BatchSystemLauncher.batch_file_name = os.path.join(
        log_dir, f"{SCRIPT_PREFIX}{ipp_cluster.cluster_id}.sh")


def remove_job_scripts(ipp_cluster) -> None:
    """Delete the job scripts :func:`place_job_script` placed for ``ipp_cluster``."""
    path = str(ipp_cluster.config.BatchSystemLauncher.get("batch_file_name", ""))
    if os.path.basename(path).startswith(SCRIPT_PREFIX):
        try:
            os.remove(path)
        except OSError:
            pass


def forget_ended(ipp_cluster) -> None:
    """Drop from ``ipp_cluster`` the batch engine sets with no job left to cancel: never submitted
    (the scheduler refused them) or ended. ipyparallel keeps an engine set whose cancel failed and
    retries the cancel when the cluster object is collected, where a cancel of an ended job fails
    again, noisily, possibly after the scheduler's configuration is gone."""
    from ipyparallel.cluster import launcher as L

    engines = getattr(ipp_cluster, "engines", {})
    for key, es in list(engines.items()):
        if not isinstance(es, L.BatchSystemLauncher):
            continue
        if not getattr(es, "job_id", "") or (isinstance(es, L.SlurmLauncher) and job_state(es).ended):
            engines.pop(key, None)


def refused_submission(ipp_cluster, exc: BaseException) -> Optional[str]:
    """When ``exc`` is the Slurm submit command failing, Slurm's reason for refusing the job, read
    from ``sbatch --test-only`` on the same job script; None for any other failure."""
    from ipyparallel.cluster import launcher as L

    if not isinstance(exc, subprocess.CalledProcessError):
        return None
    for es in list(getattr(ipp_cluster, "engines", {}).values()):
        if not isinstance(es, L.SlurmLauncher) or list(exc.cmd)[:1] != list(es.submit_command)[:1]:
            continue
        script = getattr(es, "batch_file", "") or ""
        try:
            r = subprocess.run(list(es.submit_command) + ["--test-only", script], capture_output=True, text=True,
                       timeout=30, env=_env(es))
            said = (r.stderr + r.stdout).strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            said = f"(asking it again with --test-only failed: {e})"
        try:
            with open(script, errors="replace") as f:
                text = "".join(f.readlines()[:30]).rstrip()
        except OSError:
            text = "(not readable)"
        return (f"the Slurm job for the engines was refused: `{' '.join(map(str, exc.cmd))}` exited "
                f"with {exc.returncode}; Slurm says: {said or '(nothing)'}\nthe job script ({script}):\n{text}")
    return None


def _env(es):
    env = os.environ.copy()
    try:
        env.update(es.get_env())
    except Exception:  # an older ipyparallel without get_env: the notebook's environment
        pass
    return env
