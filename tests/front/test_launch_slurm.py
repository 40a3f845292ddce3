"""``cl.launch(launcher="slurm")`` end to end on a real one-node Slurm (Debian's slurmctld, slurmd and
munge, started by the module in a folder of its own: tests/support/slurm.py): ipyparallel's Slurm
launcher submits the engines as one ``sbatch`` job whose ``srun`` starts the ranks.

What a Slurm user meets is tested here: ranks that are the job's tasks and train DDP on the
one-process curve; ``stop`` that cancels the job; a job Slurm refuses, one that waits in the queue
and one whose engines exit at once, each reported with Slurm's own words."""

import os
import sys
import time

import pytest

pytest.importorskip("psutil")
pytest.importorskip("ipyparallel")

from support import slurm  # noqa: E402

import colossal_lab as cl  # noqa: E402

pytestmark = pytest.mark.skipif(slurm.missing() is not None, reason=f"no one-node Slurm here: {slurm.missing()}")

STEPS = 5


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    s = slurm.OneNodeSlurm(tmp_path_factory.mktemp("slurm")).start()
    old = os.environ.get("SLURM_CONF")
    os.environ.update(s.env)  # sbatch/squeue/scancel, as ipyparallel runs them, find this cluster
    try:
        yield s
    finally:
        s.stop()
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


def _config(**slurm_traits):
    from traitlets.config import Config

    c = Config()
    for k, v in slurm_traits.items():
        setattr(c.SlurmEngineSetLauncher, k, v)
    return c


def _wait_no_jobs(one_node, wait=20.0):
    end = time.monotonic() + wait
    while one_node.jobs() and time.monotonic() < end:
        time.sleep(0.2)
    return one_node.jobs()


def _ddp_losses():
    """On a rank: the tiny GPT under DDP, each rank half of every global batch, AdamW, clip 1.0."""
    import torch
    import torch.distributed as dist
    from support.engine import LR, batch, lm_loss, param_groups, tiny_model

    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import DDPPlugin

    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model()
    booster = Booster(plugin=DDPPlugin())
    model, opt, crit, _, _ = booster.boost(model, torch.optim.AdamW(param_groups(model), lr=LR), criterion=lm_loss)
    losses = []
    for s in range(STEPS):
        idx, tgt = batch(s, rank, world)
        logits, _ = model(idx)
        loss = crit(logits, {"targets": tgt})
        booster.backward(loss, opt)
        booster.clip_grad_by_norm(opt, 1.0)
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _where():
    import os

    import torch.distributed as dist

    return {"rank": dist.get_rank(), "job": os.environ.get("SLURM_JOB_ID"), "task": os.environ.get("SLURM_PROCID"),
            "local_rank": int(os.environ.get("LOCAL_RANK", -1)), "pid": os.getpid()}


def test_ranks_are_the_jobs_tasks_and_train_on_the_one_process_curve(one_node):
    from support.engine import reference_losses

    with cl.launch(n=2, backend="gloo", launcher="slurm", threads=1, start_timeout=120,
                   config=_config(timelimit="10")) as cluster:
        script = cluster._ipp.config.BatchSystemLauncher.batch_file_name
        assert os.path.isfile(script) and not os.path.exists("slurm_engine.sbatch")  # not in the cwd
        where = cluster.run(_where)
        assert [w["rank"] for w in where] == [0, 1]
        assert where[0]["job"] is not None and where[0]["job"] == where[1]["job"], where  # one job
        assert sorted(w["task"] for w in where) == ["0", "1"], where  # srun's two tasks
        assert [w["local_rank"] for w in where] == [0, 1]  # one node: local ranks count from 0
        assert [line.split()[0] for line in one_node.jobs()] == [where[0]["job"]]
        losses = cluster.run(_ddp_losses)
        pids = [w["pid"] for w in where]
    ref = reference_losses(STEPS)
    assert losses[0] == losses[1]
    assert losses[0] == pytest.approx(ref, rel=1e-4), (losses[0], ref)
    assert _wait_no_jobs(one_node) == []  # stop cancelled the job
    assert not os.path.exists(script)  # and removed its script
    import psutil

    assert [p for p in pids if psutil.pid_exists(p)] == []  # and its engines are gone


def test_more_ranks_than_the_node_has_is_reported_at_once_with_slurms_reason(one_node):
    """Slurm (with its default EnforcePartLimits=NO) queues a job the partition can never run, pending
    for "PartitionConfig": the launch says so instead of waiting out start_timeout."""
    n = os.cpu_count() + 1
    t = time.perf_counter()
    with pytest.raises(cl.EngineStartError, match=r"Slurm job \d+ is PENDING \(PartitionConfig\): Slurm will not run"):
        cl.launch(n=n, backend="gloo", launcher="slurm", threads=1, start_timeout=120)
    assert time.perf_counter() - t < 60, "reported when Slurm gave its reason, not after start_timeout=120"
    assert _wait_no_jobs(one_node) == []  # the queued job was cancelled with the launch


def test_a_job_slurm_refuses_is_reported_with_slurms_words(one_node):
    t = time.perf_counter()
    with pytest.raises(cl.EngineStartError, match=r"refused.*sbatch.*exited with 1.*[Ii]nvalid partition") as e:
        cl.launch(n=2, backend="gloo", launcher="slurm", threads=1, start_timeout=120,
                  config=_config(queue="nosuchpartition"))
    assert time.perf_counter() - t < 60  # at submission, not after start_timeout=120
    assert "#SBATCH --partition=nosuchpartition" in str(e.value)  # the job script as submitted
    assert _wait_no_jobs(one_node) == []


def test_a_job_waiting_in_the_queue_times_out_naming_its_state(one_node):
    t = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"Slurm job \d+ is PENDING \(BeginTime\)") as e:
        cl.launch(n=2, backend="gloo", launcher="slurm", threads=1, start_timeout=6,
                  config=_config(submit_command=["sbatch", "--begin=now+3600"]))
    assert time.perf_counter() - t < 60
    assert "start_timeout=6" in str(e.value)
    assert _wait_no_jobs(one_node) == []  # the waiting job was cancelled with the launch


def test_options_ipyparallel_would_drop_are_refused_before_any_job():
    with pytest.raises(cl.LauncherSetupError, match=r"options.*submit_command = \['sbatch', '--begin=now\+3600'\]"):
        cl.launch(n=2, backend="gloo", launcher="slurm", config=_config(options="--begin=now+3600"))


def test_a_job_whose_engines_exit_is_reported_at_once_with_its_output(one_node, tmp_path):
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nprint('engine start failed: no GPU here', file=sys.stderr)\nsys.exit(3)\n")
    t = time.perf_counter()
    with pytest.raises(cl.EngineStartError, match=r"Slurm job \d+ ended") as e:
        cl.launch(n=2, backend="gloo", launcher="slurm", threads=1, start_timeout=120,
                  config=_config(engine_cmd=[sys.executable, str(crash)]))
    assert time.perf_counter() - t < 60, "reported when the job ended, not after start_timeout=120"
    assert "engine start failed: no GPU here" in str(e.value)  # the job's own output
    assert _wait_no_jobs(one_node) == []
