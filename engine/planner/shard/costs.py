"""What a strategy's pieces cost, in seconds: a rank's matmul rate and its group's collectives.

The cost model prices only what a choice changes: Σ linear FLOPs (``6·N·in·out``, ``/tp`` when
cut) at the matmul rate + Σ collectives (all-reduce and all-gather; a reduce-scatter priced as an
all-gather). Attention, norms and the optimizer cost the same under every choice and are left out.

Three sources: :class:`ShardCosts` (nominal figures, or measured by :func:`calibrate_shard_costs`
on the tp group's ranks with torch.distributed collectives), :class:`CalibratedCosts` (a
``cl.autoplan`` calibration, so both searches price a step from the same measurements), or any
object with ``compute(flops)``, ``allreduce(k, nbytes)`` and optionally ``allgather(k, nbytes)``
(:class:`CostAdapter` fills in the all-gather).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Dict, Sequence, Tuple

import torch


@dataclass
class ShardCosts:
    """Seconds for the pieces a strategy changes. ``flops``: one rank's matmul rate (flop/s); a
    collective over ``k > 1`` ranks of a tensor of ``nbytes`` (the whole tensor) costs ``latency +
    nbytes × s_per_byte``. The defaults are nominal (a CPU rank, loopback gloo), not measured:
    use :func:`calibrate_shard_costs` on the ranks for real figures."""

    flops: float = 20e9
    allreduce_s_per_byte: float = 1 / 1e9
    allreduce_latency: float = 50e-6
    allgather_s_per_byte: float = 1 / 2e9
    allgather_latency: float = 50e-6

    def compute(self, flops: float) -> float:
        return flops / self.flops

    def allreduce(self, k: int, nbytes: float) -> float:
        return 0.0 if k <= 1 or nbytes <= 0 else self.allreduce_latency + nbytes * self.allreduce_s_per_byte

    def allgather(self, k: int, nbytes: float) -> float:
        return 0.0 if k <= 1 or nbytes <= 0 else self.allgather_latency + nbytes * self.allgather_s_per_byte


def _latency_and_slope(points: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """``(latency, seconds per byte)`` of the line through the first and last ``(bytes, s)``
    points, neither below 0."""
    (b0, s0), (b1, s1) = points[0], points[-1]
    slope = max(0.0, (s1 - s0) / (b1 - b0)) if b1 != b0 else 0.0
    return max(0.0, s0 - slope * b0), slope


def calibrate_shard_costs(group=None, sizes: Sequence[int] = (64 << 10, 4 << 20), reps: int = 3,
                          matmul: int = 256) -> ShardCosts:
    """Measure :class:`ShardCosts` on the ranks of ``group`` (default: the world), with real
    torch.distributed collectives. Every rank of the group must call it; all return the same
    figures (the slowest rank's, agreed by an all-reduce MAX). (Not ``cl.autoplan``'s
    calibration, which measures a whole step's constants: pass that as :class:`CalibratedCosts`.)"""
    import torch.distributed as dist

    from ... import comm

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("autoshard: calibrate_shard_costs: torch.distributed is not initialised; "
                           "call it on the ranks (a %%colossal cell, a torchrun script) or pass costs=ShardCosts(...)")
    dev = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
           else torch.device("cpu"))

    def timed(fn) -> float:
        fn()
        best = math.inf
        for _ in range(reps):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            comm.barrier(group=group)
            t = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return best

    a = torch.randn(matmul, matmul, device=dev)
    k = dist.get_world_size(group)
    mm = timed(lambda: a @ a)
    ar, ag = [], []
    for n in sizes:
        x = torch.zeros(n // 4, device=dev)
        ar.append((float(n), timed(lambda: dist.all_reduce(x, group=group))))
        piece = torch.zeros(n // 4 // k, device=dev)
        out = [torch.empty_like(piece) for _ in range(k)]
        ag.append((float(n), timed(lambda: dist.all_gather(out, piece, group=group))))
    figures = torch.tensor([mm, *(s for _, s in ar), *(s for _, s in ag)], dtype=torch.float64, device=dev)
    comm.all_reduce(figures, op=dist.ReduceOp.MAX, group=group)
    f = figures.tolist()
    n = len(sizes)
    ar = [(b, s) for (b, _), s in zip(ar, f[1:1 + n])]
    ag = [(b, s) for (b, _), s in zip(ag, f[1 + n:])]
    (arl, ars), (agl, ags) = _latency_and_slope(ar), _latency_and_slope(ag)
    return ShardCosts(flops=2 * matmul ** 3 / max(f[0], 1e-9), allreduce_s_per_byte=ars, allreduce_latency=arl,
                      allgather_s_per_byte=ags, allgather_latency=agl)


def is_layout_calibration(costs) -> bool:
    """Whether ``costs`` is ``cl.autoplan``'s calibration (``AutoPlan.calibration``'s dict form)."""
    return isinstance(costs, dict) and "compute" in costs and "allreduce" in costs


class CalibratedCosts:
    """``cl.autoplan``'s cost model for the solver: an ``AutoPlan.calibration`` (measured on the
    ranks by ``colossal_lab.engine.planner.layout.calibrate``) read as :class:`ShardCosts`'s functions, so
    both searches price a step from the same measurements. The matmul rate is the whole model's
    linear FLOPs (``6·N·in·out`` at the graph's tokens) over its measured forward+backward there,
    which charges attention, norms and the rest to the linears (a rate on the low side: the
    compute a cut saves is, if anything, over-counted); all-reduces are the calibration's curve for
    the group size (piecewise through 1 KiB, 64 KiB and 4 MiB); an all-gather is the all-reduce of
    half the bytes (a ring all-reduce is a reduce-scatter plus an all-gather)."""

    def __init__(self, calibration: Dict[str, Any], linear_flops: float, tokens: int):
        from ..layout import Costs

        self.calibration, self._c = calibration, Costs(calibration)
        fb = self._c.forward_backward(1, tokens) if self._c.has_compute(1) else None
        if not fb:
            raise ValueError("autoshard(costs=calibration): it has no forward+backward timed at tp 1; pass an "
                             "AutoPlan.calibration from cl.autoplan on this model")
        self.flops = linear_flops / fb

    def compute(self, flops: float) -> float:
        return flops / self.flops

    def allreduce(self, k: int, nbytes: float) -> float:
        if k <= 1 or nbytes <= 0:
            return 0.0
        if not self._c.has_allreduce(k):
            raise ValueError(f"autoshard(costs=calibration): no all-reduce measured on groups of {k}; calibrate "
                             f"with cl.autoplan on a world where tp_size={k} is a candidate")
        return self._c.allreduce(k, nbytes)

    def allgather(self, k: int, nbytes: float) -> float:
        return self.allreduce(k, nbytes / 2)


class CostAdapter:
    """Any costs object as the three functions the solver uses (all-gather, if missing, priced as
    half an all-reduce: a ring all-reduce is a reduce-scatter plus an all-gather)."""

    def __init__(self, costs):
        for need in ("compute", "allreduce"):
            if not callable(getattr(costs, need, None)):
                raise TypeError(f"autoshard: costs={type(costs).__name__} has no {need}(); pass a "
                                "colossal_lab.engine.planner.shard.ShardCosts (or calibrate_shard_costs() on the "
                                "ranks), or an object with compute(flops), allreduce(k, nbytes) and "
                                "allgather(k, nbytes)")
        self.c = costs

    def compute(self, flops):
        return self.c.compute(flops)

    def allreduce(self, k, nbytes):
        return self.c.allreduce(k, nbytes) if k > 1 and nbytes > 0 else 0.0

    def allgather(self, k, nbytes):
        if k <= 1 or nbytes <= 0:
            return 0.0
        own = getattr(self.c, "allgather", None)
        return own(k, nbytes) if callable(own) else 0.5 * self.c.allreduce(k, nbytes)
