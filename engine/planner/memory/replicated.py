"""Memory models of the layouts where every rank runs the whole model: one process (``plugin=None``),
``DDPPlugin`` and ``LowLevelZeroPlugin`` (ZeRO-1 here; ZeRO-2 in ``fsdp.py``).

Each plugin's own allocations are read off its code and laid over the step's trace: DDP's gradient
buckets (views of the gradients, or copies beside them), ``ZeroRedundancyOptimizer``'s greedy
partition of the optimizer state. The optimizer step (AdamW's two fp32 moments, the single-tensor
update's temporary) is the second moment whose peak is compared with the backward's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .env import _Env
from .peaks import _OPT_STATE, _acts_summary, _max_cats, _opt_bytes, _peak_over, _Result, _step_temp, _tier
from .result import RankPlan, _fmt
from .trace import _nbytes, _Trace


@dataclass
class _Replica:
    """One rank's whole model: its step's trace (under ``low`` autocast) and the step's totals."""

    m: Any
    env: _Env
    opt: str
    low: Optional[torch.dtype]
    tr: _Trace
    train: List[Tuple[str, Any]]   # (name, parameter) of what is trained
    P: int                          # parameter bytes
    Bf: int                         # buffer bytes
    G: int                          # gradient bytes
    S: int                          # optimizer state bytes
    largest: int                    # the largest trained parameter's bytes

    @classmethod
    def of(cls, m, env: _Env, precision: str, opt: str, ac: bool) -> "_Replica":
        from ...mixed_precision import autocast_dtype

        low = autocast_dtype(precision) if precision != "fp32" else None
        tr = m.trace(ac=ac, autocast=low)
        train = [(n, p) for n, p in m.params if p.requires_grad]
        numel = sum(p.numel() for _, p in train)
        return cls(m, env, opt, low, tr, train, m.param_bytes, m.buffer_bytes, sum(_nbytes(p) for _, p in train),
                   _opt_bytes(numel, opt), max((_nbytes(p) for _, p in train), default=0))

    @property
    def world(self) -> int:
        return self.env.world

    def group(self, ranks, role: str, params: int, grads_fb: Callable[[int], int], grads_step: int, optim: int,
              working_fb: Callable[[int], int], working_step: int, step_largest: int) -> RankPlan:
        """Ranks holding these bytes: the forward/backward peak over the trace (``grads_fb`` and
        ``working_fb`` of the gradient bytes made so far) against the optimizer step's."""
        dev, opt = self.env.compute_tier, self.opt
        fb, ph, _ = _peak_over(self.tr, lambda i, o, g, s: {"params": params, "grads": grads_fb(g), "optimizer": optim,
                                                              "activations": o, "working": working_fb(g)})
        step = {"params": params, "grads": grads_step, "optimizer": optim,
                "working": working_step + _step_temp(step_largest, optim // max(1, _OPT_STATE[opt]), dev, opt)}
        cats, phase = _max_cats((fb, ph), (step, "optimizer step"))
        return RankPlan(list(ranks), role, {dev: _tier(dev, self.env.capacity(dev), cats, phase)})

    def unsynced(self, role: str) -> RankPlan:
        """No wrapper: gradients are made by autograd and freed by zero_grad(set_to_none=True)."""
        return self.group(range(self.world), role, self.P + self.Bf, lambda g: g, self.G, self.S, lambda g: 0, 0,
                          self.largest)

    def result(self, groups: List[RankPlan], traffic: Dict[str, int], notes: List[str], ac: bool, dp: int,
               zero_stage: int) -> _Result:
        layout = {"dp": dp, "tp": 1, "pp": 1, "zero_stage": zero_stage}
        return _Result(groups, traffic, _acts_summary(self.m, ac, autocast=self.low), layout, notes)


def plan_single(m, plugin, env: _Env, precision: str, opt: str, ac: bool) -> _Result:
    """``plugin=None``: one process, or every rank an unsynchronised replica."""
    rep = _Replica.of(m, env, precision, opt, ac)
    w = rep.world
    notes = [f"plugin=None on world_size={w}: every rank is an unsynchronised replica"] if w > 1 else []
    return rep.result([rep.unsynced("replica" if w > 1 else "")], {}, notes, ac, dp=1, zero_stage=0)


def plan_ddp(m, plugin, env: _Env, precision: str, opt: str, ac: bool) -> _Result:
    """``DDPPlugin``: gradient buckets are the gradients (``gradient_as_bucket_view``) or beside them."""
    rep = _Replica.of(m, env, precision, opt, ac)
    w, P, Bf, G, S = rep.world, rep.P, rep.Bf, rep.G, rep.S
    if w == 1:  # one process: no DDP wrapper
        return rep.result([rep.unsynced("")], {}, [], ac, dp=w, zero_stage=0)
    view = getattr(plugin, "gradient_as_bucket_view", True)
    if view:  # gradients are views into DDP's buckets: the buckets *are* the gradients
        g = rep.group(range(w), "data parallel", P + Bf, lambda g: G, G, S, lambda g: 0, 0, rep.largest)
    else:     # buckets beside the gradients
        g = rep.group(range(w), "data parallel", P + Bf, lambda g: g, G, S, lambda g: G, G, rep.largest)
    traffic = {"allreduce": int(2 * (w - 1) / w * G)}
    notes = [f"DDP: gradient buckets {_fmt(G)} ({'views of' if view else 'copies beside'} the gradients)"]
    return rep.result([g], traffic, notes, ac, dp=w, zero_stage=0)


def plan_low_level_zero(m, plugin, env: _Env, precision: str, opt: str, ac: bool) -> _Result:
    """``LowLevelZeroPlugin``: stage 1 here, stage 2 (FSDP2) in ``fsdp.py``; one process shards nothing
    (stage 1 is a DDP-less ZeroRedundancyOptimizer there)."""
    from .fsdp import zero2

    rep = _Replica.of(m, env, precision, opt, ac)
    w = rep.world
    if w == 1:
        return rep.result([rep.unsynced("")], {}, [], ac, dp=w, zero_stage=0)
    stage = getattr(plugin, "stage", 0)
    groups, traffic, notes = _zero1(rep) if stage == 1 else zero2(rep, plugin, precision)
    return rep.result(groups, traffic, notes, ac, dp=w, zero_stage=max(stage, 0))


def _zero1(rep: _Replica) -> Tuple[List[RankPlan], Dict[str, int], List[str]]:
    """DDP without bucket views + ZeroRedundancyOptimizer's greedy partition of the states."""
    w, P, Bf, G, opt = rep.world, rep.P, rep.Bf, rep.G, rep.opt
    sizes, big = [0] * w, [0] * w
    for _, p in sorted(rep.train, key=lambda t: t[1].numel(), reverse=True):
        r = sizes.index(min(sizes))
        sizes[r] += p.numel()
        big[r] = max(big[r], _nbytes(p))
    by: Dict[tuple, List[int]] = {}
    for r in range(w):
        by.setdefault((sizes[r], big[r]), []).append(r)
    groups = [rep.group(ranks, f"ZeRO-1 partition ({n_r / 1e6:.2f}M params)", P + Bf, lambda g: g, G,
                        _opt_bytes(n_r, opt), lambda g: G, G, big_r)
              for (n_r, big_r), ranks in sorted(by.items(), key=lambda kv: kv[1][0])]
    traffic = {"allreduce": int(2 * (w - 1) / w * G), "broadcast": int(P * (w - 1) / w)}
    notes = [f"ZeRO-1: DDP buckets {_fmt(G)} beside the gradients; optimizer state split greedily by "
             "parameter size (ZeroRedundancyOptimizer)"]
    return groups, traffic, notes
