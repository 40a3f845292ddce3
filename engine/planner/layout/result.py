"""What ``cl.autoplan`` returns: every layout's row (predicted and measured step, planned and
measured peak, whether it fits), the chosen layout and its plugin, and a table for the notebook."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from .space import Candidate


@dataclass
class AutoPlan:
    """What :func:`autoplan` found: ``rows`` (every candidate, best first among those that fit),
    ``best`` (a :class:`Candidate`), ``plugin()`` (the chosen ``HybridParallelPlugin``).
    ``calibration``: what was measured, and the layouts run, as plain data (reuse it:
    ``cl.autoplan(..., calibration=plan.calibration)``, ``cl.autoshard(..., costs=...)``)."""

    rows: List[Dict[str, Any]]
    best: Optional[Candidate]
    world_size: int
    batch: int
    seq: int
    device_memory: Optional[int]
    calibration: Dict[str, Any]
    seconds: Dict[str, float]
    _fits: Optional[Callable[[Candidate], bool]] = field(default=None, repr=False, compare=False)
    _peak_of: Optional[Callable[[Candidate], Tuple[int, bool]]] = field(default=None, repr=False, compare=False)

    def fill_peaks(self) -> "AutoPlan":
        """Plan the memory of the rows the search did not need (``peak_bytes`` None); the answer
        stays: every faster layout was planned and did not fit."""
        if self._fits is not None:
            for r in self.rows:
                if r["fits"] is None:
                    r["fits"] = self._fits(r["candidate"])
                    r["peak_bytes"] = self._peak_of(r["candidate"])[0]
            self.rows = ordered(self.rows)
        return self

    def plugin(self):
        if self.best is None:
            raise ValueError("autoplan: no candidate fits device_memory; see the table's peaks, raise "
                             "device_memory or lower batch/seq")
        return self.best.plugin()

    def to_dict(self) -> dict:
        return {"best": asdict(self.best) if self.best else None, "world_size": self.world_size,
                "batch": self.batch, "seq": self.seq, "device_memory": self.device_memory,
                "seconds": self.seconds,
                "rows": [{**{k: v for k, v in r.items() if k != "candidate"}, "candidate": asdict(r["candidate"])}
                         for r in self.rows]}

    def table(self, top: Optional[int] = None) -> str:
        from ...telemetry.units import format_bytes as _fmt

        head = ("layout", "step (model)", "step (run)", "tokens/s", "peak/rank (plan)", "peak (run)", "fits")
        rows = [(r["label"], f"{r['predicted_s'] * 1e3:.1f} ms",
                 f"{r['measured_s'] * 1e3:.1f} ms" if r.get("measured_s") is not None else "-",
                 f"{r['tokens_per_s']:.0f}", _fmt(r["peak_bytes"]) if r["peak_bytes"] is not None else "-",
                 _fmt(r["measured_peak"]) if r.get("measured_peak") is not None else "-",
                 {True: "yes", False: "no", None: "-"}[r["fits"]]) for r in self.rows[:top]]
        w = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
        lines = [f"AutoPlan: world {self.world_size} · batch {self.batch} × seq {self.seq} · device_memory "
                 f"{_fmt(self.device_memory)} · best: {self.best.label if self.best else 'none fits'}",
                 "  ".join(h.ljust(w[i]) for i, h in enumerate(head)),
                 "  ".join("-" * x for x in w)]
        lines += ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows]
        lines.append(f"search: calibration {self.seconds.get('calibration', 0):.1f} s, layouts run "
                     f"{self.seconds.get('runs', 0):.1f} s, memory plans {self.seconds.get('memory', 0):.1f} s")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.table()

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(self.table())


def ordered(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Those that fit first, fastest first; then those not planned (slower than the answer); then
    those that do not fit."""
    return sorted(rows, key=lambda r: ({True: 0, None: 1, False: 2}[r["fits"]], r["seconds"]))
