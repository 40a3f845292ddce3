"""The two-host tests' driver: the process that calls ``cl.launch``, as a notebook kernel would,
run on rig host A (``python host_driver.py SPEC_JSON``).

It launches one cluster (``spec``: launcher, ranks per host, the rig's ssh config), prints one
JSON line when the ranks are up, then answers one JSON command per stdin line with one JSON line
on stdout, so a test module shares one cluster among its tests the way a notebook shares one among
its cells. A command that fails on the ranks answers with the error instead of a result.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: support

from traitlets.config import Config  # noqa: E402

import colossal_lab as cl  # noqa: E402
from support import host_work as W  # noqa: E402


def config(spec: dict, tmp: str) -> Config:
    """ipyparallel's own launcher configuration for the rig's hosts."""
    c = Config()
    ssh = ["-F", spec["ssh_config"]]
    if spec["launcher"] == "ssh":
        c.SSHEngineSetLauncher.engines = dict(spec["hosts"])
        c.SSHEngineSetLauncher.ssh_args = ssh
        c.SSHEngineSetLauncher.scp_args = ssh
        c.SSHEngineSetLauncher.remote_python = sys.executable
    else:
        hostfile = os.path.join(tmp, "hostfile")
        with open(hostfile, "w") as f:
            f.writelines(f"{h} slots={k}\n" for h, k in spec["hosts"].items())
        c.MPIEngineSetLauncher.mpi_args = [
            "--hostfile", hostfile, "--mca", "plm_rsh_agent", "ssh " + " ".join(ssh),
            "--map-by", "node", "--bind-to", "none"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    return c


def _relay(cluster, steps: int) -> dict:
    """Both hosts' telemetry through the relay onto this process's bus, where the dashboard reads."""
    from colossal_lab import relay as relay_mod
    from colossal_lab.engine import telemetry as T
    from colossal_lab.widgets import Dashboard
    from support.bus import BusSink

    sink = BusSink()
    dash = Dashboard(live=False, max_hz=10)
    relay = relay_mod.attach(cluster, memory_interval=None)
    try:
        hosts = cluster.run(W.emit_steps, steps)
        stats = relay.rank_stats()  # flushes what the ranks still hold
        deadline = time.time() + 30
        while time.time() < deadline:
            rows = sorted({(e.rank, e.step) for e in sink.events() if isinstance(e, T.StepMetrics)})
            if len(rows) >= steps * cluster.n:
                break
            time.sleep(0.05)
        dash.flush()
        return {"rows": rows, "hosts": hosts, "address": relay.address, "dash_ranks": sorted(dash.metrics.ranks),
                "stats": [{k: s[k] for k in ("sent", "dropped")} for s in stats]}
    finally:
        dash.close()
        sink.close()
        relay.detach()


def answer(cluster, cmd: dict):
    name = cmd["cmd"]
    if name == "where":
        return {"ranks": cluster.run(W.where), "local_rank": list(cluster._local_rank),
                "master_addr": cluster.master_addr}
    if name == "ddp":
        return cluster.run(W.ddp_losses, cmd["steps"])
    if name == "pp":
        return cluster.run(W.pp_losses, cmd["steps"])
    if name == "relay":
        return _relay(cluster, cmd["steps"])
    if name == "steps":
        print(json.dumps({"started": time.time()}), flush=True)
        return cluster.run(W.steps_for, cmd["seconds"], cmd["started"])
    if name == "stop":
        cluster.stop()
        return "stopped"
    raise ValueError(f"unknown command {name!r}")


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for stacks when we hang
    spec = json.loads(sys.argv[1])
    t0 = time.monotonic()
    cluster = cl.launch(n=sum(spec["hosts"].values()), backend="gloo", launcher=spec["launcher"],
                        config=config(spec, spec["tmp"]), threads=1, start_timeout=spec.get("start_timeout", 240),
                        timeout=spec.get("timeout", 120))
    print(json.dumps({"ready": True, "start_s": time.monotonic() - t0, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        t = time.monotonic()
        try:
            out = {"result": answer(cluster, cmd)}
        except cl.RankError as e:
            out = {"error": str(e), "type": "RankError", "ranks": e.ranks, "hosts": e.hosts}
        except KeyboardInterrupt as e:
            out = {"error": str(e), "type": "KeyboardInterrupt"}
        except Exception:  # anything else is the test's to show, with where it came from
            out = {"error": traceback.format_exc(), "type": "Exception"}
        out.update(at=time.time(), took=time.monotonic() - t)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
