"""Ranks on two hosts through ipyparallel's SSH and MPI launchers, on the rig's two network
namespaces (``support.hosts``): each rank's host, LOCAL_RANK counted per host, the rendezvous and
gloo crossing the hosts' addresses, DDP and a 2-stage pipeline (one stage per host) on the
one-process curve, and both hosts' telemetry through the relay. One cluster per launcher, driven
like a notebook by ``support.host_driver`` on host A. Also: the SSH launcher's first ssh to a host
waits ``start_timeout``, not ipyparallel's fixed 10 s."""

import json
import subprocess
import sys

import pytest
from support import host_work as W
from support.engine import reference_losses

STEPS = 5


@pytest.fixture(scope="module")
def ssh(rig):
    """Two ranks, one per host, through the SSH launcher (sshd on both hosts)."""
    with rig.cluster("ssh", {rig.a.name: 1, rig.b.name: 1}) as d:
        yield d


def test_ssh_ranks_on_both_hosts_and_gloo_across(rig, ssh):
    out = ssh.result("where")
    ranks = out["ranks"]
    assert [(r["host"], r["addr"]) for r in ranks] == [(rig.a.name, rig.a.addr), (rig.b.name, rig.b.addr)]
    assert out["local_rank"] == [0, 0] == [r["local_rank"] for r in ranks]
    # master_addr defaulted to host A's address on the route to host B, which B reaches
    assert out["master_addr"] == rig.a.addr and {r["master_addr"] for r in ranks} == {rig.a.addr}
    assert [r["sum"] for r in ranks] == [3.0, 3.0]  # 1 + 2: gloo between 10.250.x.1 and .2
    assert ranks[0]["pid"] in rig.a.pids() and ranks[1]["pid"] in rig.b.pids()


def test_ddp_across_hosts_follows_one_process(ssh):
    ref = reference_losses(STEPS)
    got = ssh.result("ddp", steps=STEPS)
    for rank_losses in got:
        assert rank_losses == pytest.approx(ref, rel=1e-4), (rank_losses, ref)
    print("ddp worst relative difference:",
          max(abs(a - b) / abs(b) for r in got for a, b in zip(r, ref)))


def test_pipeline_one_stage_per_host_follows_one_process(rig, ssh):
    ref = W.pp_reference(STEPS)
    got = ssh.result("pp", steps=STEPS)
    assert [(g["host"], g["stage"]) for g in got] == [(rig.a.name, 0), (rig.b.name, 1)]
    assert got[0]["losses"] == [None] * STEPS  # the first stage computes no loss
    assert got[1]["losses"] == pytest.approx(ref, rel=1e-4), (got[1]["losses"], ref)
    assert ref[-1] < ref[0]  # it trained
    print("pp worst relative difference:", max(abs(a - b) / abs(b) for a, b in zip(got[1]["losses"], ref)))


def test_both_hosts_telemetry_reaches_the_dashboard(rig, ssh):
    out = ssh.result("relay", steps=10)
    assert out["hosts"] == [rig.a.name, rig.b.name]
    assert out["rows"] == [[r, s] for r in (0, 1) for s in range(10)]  # every row from both hosts
    assert out["dash_ranks"] == [0, 1]
    assert [s["dropped"] for s in out["stats"]] == [0, 0] and all(s["sent"] >= 10 for s in out["stats"])
    assert out["address"].startswith(f"tcp://{rig.a.addr}:")  # the PULL socket on the address B reaches


@pytest.fixture(scope="module")
def mpi(rig):
    """Three ranks through the MPI launcher: Open MPI's mpiexec on host A with a hostfile, starting
    host B's share over ssh (its plm_rsh_agent); one rank on A, two on B."""
    with rig.cluster("mpi", {rig.a.name: 1, rig.b.name: 2}) as d:
        yield d


def test_mpi_ranks_on_both_hosts_local_rank_per_host(rig, mpi):
    out = mpi.result("where")
    ranks = out["ranks"]
    assert [(r["host"], r["addr"]) for r in ranks] == [(rig.a.name, rig.a.addr)] + [(rig.b.name, rig.b.addr)] * 2
    assert out["local_rank"] == [0, 0, 1] == [r["local_rank"] for r in ranks]  # counted per host
    assert {r["master_addr"] for r in ranks} == {rig.a.addr}
    assert [r["sum"] for r in ranks] == [6.0] * 3
    assert ranks[0]["pid"] in rig.a.pids() and {r["pid"] for r in ranks[1:]} <= set(rig.b.pids())


# On host A: the SSH engine launcher's shell probe of host B through a real ssh that starts 11 s late (a
# loaded machine's first contact; ipyparallel's own probe gives up at 10 s), once with probe_timeout=2 and
# once with 60 (what cl.launch passes: start_timeout)
_PROBE = r"""
import json, sys
from colossal_lab.ssh_launcher import PatientSSHEngineLauncher
late_ssh = ["sh", "-c", 'sleep 11 >/dev/null 2>&1; exec ssh "$@"', "ssh"]
out = {}
for limit in (2.0, 60.0):
    el = PatientSSHEngineLauncher(ssh_cmd=late_ssh, ssh_args=["-F", sys.argv[1]], location=sys.argv[2],
                                  remote_python=sys.executable, probe_timeout=limit)
    try:
        out[str(limit)] = list(el.ssh_sender.get_shell_info())
    except Exception as exc:
        out[str(limit)] = str(exc)
print(json.dumps(out))
"""


def test_the_first_ssh_to_a_host_waits_start_timeout(rig):
    r = subprocess.run(rig.a.prefix() + [sys.executable, "-c", _PROBE, str(rig.ssh_config), rig.b.name],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "did not answer within 2 s" in out["2.0"] and "start_timeout" in out["2.0"], out  # the limit given fires
    assert out["60.0"][0].startswith("linux") and out["60.0"][1].endswith("sh"), out
