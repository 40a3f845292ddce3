"""What the two-host tests run on ranks (shipped by reference: the driver's ``sys.path`` reaches
the ranks), and the one-process references they are compared with."""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist

PP_MICRO = 4


def where() -> dict:
    """Which host this rank is on, as the rank sees it: its hostname, its address on the route to
    the rendezvous store (MASTER_ADDR), its LOCAL_RANK, and a gloo all_reduce of every rank's
    rank + 1 (it can only cross between the hosts' addresses: nothing else joins them)."""
    from colossal_lab.startup import route_address

    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    return {"rank": dist.get_rank(), "host": socket.gethostname(), "pid": os.getpid(),
            "addr": route_address(os.environ["MASTER_ADDR"]), "master_addr": os.environ["MASTER_ADDR"],
            "local_rank": int(os.environ["LOCAL_RANK"]), "sum": x.item()}


def ddp_losses(steps: int) -> list:
    """The engine's DDPPlugin on the tiny GPT, this rank's half of each global batch; the mean
    loss over the ranks at each step (support.engine's recipe, as tests/engine runs it)."""
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import DDPPlugin
    from support.engine import LR, boosted_losses, param_groups, tiny_model

    booster = Booster(plugin=DDPPlugin())
    model = tiny_model()
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    model, opt, *_ = booster.boost(model, opt)
    return boosted_losses(model, opt, booster, steps, dist.get_rank(), dist.get_world_size())


def _pp_model():
    from colossal_lab.engine.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", n_layer=4))


def pp_data(steps: int) -> list:
    """support.engine's learnable stream (each token an affine function of the previous one)."""
    from support.engine import batch

    return [dict(zip(("idx", "targets"), batch(s))) for s in range(steps)]


def pp_losses(steps: int) -> dict:
    """HybridParallelPlugin with pp_size=2 (1F1B, one stage per rank); the loss at each step (on
    the last stage; None on the first) and this rank's stage."""
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin
    from support.engine import lm_loss

    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=PP_MICRO)
    booster = Booster(plugin=plugin)
    model = _pp_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, *_ = booster.boost(model, opt, lm_loss)
    it = iter(pp_data(steps))
    losses = []
    for _ in range(steps):
        out = booster.execute_pipeline(it, model, lm_loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(None if out["loss"] is None else out["loss"].item())
    return {"losses": losses, "stage": plugin.mesh["pp"].get_local_rank(), "host": socket.gethostname()}


def pp_reference(steps: int) -> list:
    """One process, plain torch: the curve ``pp_losses`` must follow."""
    from support.engine import plain_losses

    return plain_losses(_pp_model(), pp_data(steps), lambda params: torch.optim.SGD(params, lr=0.1))


def emit_steps(n: int) -> str:
    """Emit ``n`` StepMetrics on this rank's telemetry bus (what a training loop emits)."""
    from colossal_lab.engine import telemetry as T

    r = dist.get_rank()
    for i in range(n):
        T.emit(T.StepMetrics(rank=r, step=i, loss=float(i + r), tokens=100, seconds=0.01))
    return socket.gethostname()


def steps_for(seconds: float, started: str) -> int:
    """Training-like steps (an all_reduce every few ms) for ``seconds``: a rank to kill or interrupt
    mid-step. Each rank writes ``started/<rank>`` once it is in the loop (the hosts share files)."""
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        x = torch.ones(1000)
        dist.all_reduce(x)
        if n == 0:
            open(os.path.join(started, str(dist.get_rank())), "w").close()
        n += 1
        time.sleep(0.005)
    return n
