"""What ``cl.plan`` returns: per rank group and tier, the peak bytes by category, as plain data
and as a fixed-width table (``repr``). ``colossal_lab.widgets.FitPlan`` draws ``to_dict()``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from ...telemetry.units import format_bytes

TIERS = ("cuda", "cpu", "nvme")
CATEGORIES = ("params", "grads", "optimizer", "activations", "working")


_fmt = format_bytes  # the planner's tables and notes


@dataclass
class TierPlan:
    """One tier of one rank group at its predicted peak: bytes by category, and when it happens."""

    tier: str
    capacity: Optional[int]
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    working: int = 0
    phase: str = ""

    @property
    def peak(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.working

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.peak <= self.capacity

    def to_dict(self) -> dict:
        d = {c: int(getattr(self, c)) for c in CATEGORIES}
        d.update(tier=self.tier, capacity=self.capacity, peak=self.peak, fits=self.fits, phase=self.phase)
        return d


@dataclass
class RankPlan:
    """Ranks that hold the same bytes (e.g. every data-parallel replica, or one pipeline stage)."""

    ranks: List[int]
    role: str
    tiers: Dict[str, TierPlan]
    # model states each rank of the group holds after a step, in bytes (hybrid plugin): params, grads,
    # optimizer; under expert parallelism also expert_params / expert_grads / expert_optimizer (this rank's
    # share, included in the totals), moe_layers and all_to_all (the step's all-to-all bytes sent)
    states: Dict[str, int] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return all(t.fits for t in self.tiers.values())

    def to_dict(self) -> dict:
        return {"ranks": list(self.ranks), "role": self.role, "fits": self.fits,
                "tiers": {k: v.to_dict() for k, v in self.tiers.items()}, "states": dict(self.states)}


@dataclass
class FitPlan:
    """What ``cl.plan`` predicts: per rank group and tier, the peak bytes by category.

    ``activations`` holds one rank's activation bytes with and without activation checkpointing
    (the larger stage under a pipeline); ``traffic`` the bytes a step moves per rank (``"nvme->cpu"``,
    ``"cpu->nvme"``, ``"allreduce"``, ``"allgather"``, ``"reduce_scatter"``, ``"broadcast"``, ``"p2p"``,
    ``"all_to_all"``: an MoE model's expert dispatch and combine under ``ep_size``);
    ``advice`` concrete changes, best first; ``notes`` what the estimate assumed.
    """

    plugin: str
    world_size: int
    batch: int
    seq: int
    precision: str
    device: str
    model: dict
    layout: dict
    ranks: List[RankPlan]
    activations: dict
    traffic: Dict[str, int]
    advice: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    blocked: Optional[str] = None   # the plugin itself would refuse this (e.g. Gemini's plan_homes)

    @property
    def fits(self) -> bool:
        return self.blocked is None and all(r.fits for r in self.ranks)

    @property
    def tiers(self) -> List[str]:
        present = {t for r in self.ranks for t in r.tiers}
        return [t for t in TIERS if t in present]

    def rank_plan(self, rank: int) -> RankPlan:
        for r in self.ranks:
            if rank in r.ranks:
                return r
        raise KeyError(f"FitPlan.rank_plan({rank}): ranks are 0..{self.world_size - 1}")

    def peak(self, tier: str, rank: Optional[int] = None) -> int:
        """Predicted peak bytes of ``tier`` on ``rank`` (None: the largest over ranks)."""
        groups = self.ranks if rank is None else [self.rank_plan(rank)]
        return max((g.tiers[tier].peak for g in groups if tier in g.tiers), default=0)

    def to_dict(self) -> dict:
        return {"plugin": self.plugin, "world_size": self.world_size, "batch": self.batch, "seq": self.seq,
                "precision": self.precision, "device": self.device, "fits": self.fits, "model": dict(self.model),
                "layout": dict(self.layout), "ranks": [r.to_dict() for r in self.ranks],
                "activations": dict(self.activations), "traffic": dict(self.traffic),
                "advice": list(self.advice), "notes": list(self.notes), "blocked": self.blocked,
                "categories": list(CATEGORIES),
                "tiers": self.tiers}

    def table(self) -> str:
        """The plan as a fixed-width text table (what ``repr`` shows)."""
        head = (f"FitPlan: {self.model.get('name', 'model')} ({self.model.get('params', 0) / 1e6:.2f}M params) · "
                f"{self.plugin} · world {self.world_size} · batch {self.batch} × seq {self.seq} · "
                f"{self.precision} on {self.device} · {'FITS' if self.fits else 'DOES NOT FIT'}")
        cols = ["ranks", "tier"] + list(CATEGORIES) + ["peak", "capacity", "fits"]
        rows = []
        for g in self.ranks:
            for t in self.tiers:
                if t not in g.tiers:
                    continue
                tp = g.tiers[t]
                rows.append([_ranks_str(g.ranks) + (f" ({g.role})" if g.role else ""), t]
                            + [_fmt(getattr(tp, c)) for c in CATEGORIES]
                            + [_fmt(tp.peak), _fmt(tp.capacity), "yes" if tp.fits else "NO"])
        widths = [max(len(str(r[i])) for r in rows + [cols]) for i in range(len(cols))]

        def line(r):  # the first two columns left-aligned, the numbers right-aligned
            return "  ".join(str(v).rjust(w) if i > 1 else str(v).ljust(w) for i, (v, w) in enumerate(zip(r, widths)))

        out = [head, line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows]
        act = self.activations
        if act:
            w = act.get("with_checkpointing")
            out.append(f"activations per rank: {_fmt(act.get('without_checkpointing'))} without checkpointing, "
                       f"{_fmt(w) if w is not None else 'n/a'} with"
                       + (" (checkpointing on)" if act.get("checkpointing") else ""))
        if self.traffic:
            out.append("per step per rank: " + ", ".join(f"{k} {_fmt(v)}" for k, v in self.traffic.items()))
        out += [f"advice: {a}" for a in self.advice]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    def __repr__(self) -> str:
        return self.table()

    def _repr_pretty_(self, p, cycle) -> None:  # IPython
        p.text(self.table())


def _ranks_str(ranks: Sequence[int]) -> str:
    rs = sorted(ranks)
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"ranks {rs[0]}-{rs[-1]}"
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(map(str, rs))
