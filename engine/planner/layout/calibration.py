"""What a search keeps of the machine: the measured figures (:class:`Calibration`) and, apart from
them, the search's own bookkeeping (:class:`SearchRecord`: the layouts it ran, the overheads it
fitted, its last verification margin and run-off).

Outside the search both travel as one plain dict, ``AutoPlan.calibration``: the form users keep,
pass back as ``calibration=``, hand to ``cl.autoshard(costs=...)``, pickle or write as JSON. JSON
turns the int keys of the per-size tables (tp size, group size) into strings, so
:func:`read_calibration` (and :meth:`Calibration.of`) is the one place that turns them back;
inside, every table is keyed by int. :func:`write_calibration` gives the dict form again.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .space import Candidate

#: the figures' keys in the dict form; the bookkeeping's are ``SearchRecord``'s fields
FIGURES = ("compute", "allreduce", "zero_sync", "p2p", "adam_s_per_elem", "alone")
RECORD = ("overheads", "measured", "probes", "runoff", "margin")


@dataclass
class Calibration:
    """The cost model's constants as measured on the ranks (:func:`calibrate`), in seconds.

    ``compute[tp] = {"tokens": [...], "f": [...], "fb": [...]}``: the forward and
    forward+backward of the model shrunk to a tp rank, per microbatch token count;
    ``allreduce[k] = [(bytes, s), ...]`` on groups of ``k``; ``zero_sync[k] = [(calls, bytes, s),
    ...]`` (batches of asynchronous broadcasts; None: not measured); ``p2p = [(bytes, s), ...]``
    one way; ``adam_s_per_elem``; ``alone = {"busy": s, "alone": s}`` (None: not measured).
    ``other``: keys of the dict form this version does not read, carried along unchanged."""

    compute: Dict[int, Dict[str, List[float]]]
    allreduce: Dict[int, List[Tuple[float, float]]]
    p2p: Optional[List[Tuple[float, float]]] = None
    adam_s_per_elem: Optional[float] = None
    zero_sync: Optional[Dict[int, List[Tuple[int, float, float]]]] = None
    alone: Optional[Dict[str, float]] = None
    other: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, calibration) -> "Calibration":
        """``calibration`` as figures: a :class:`Calibration` as is, a dict form read."""
        return calibration if isinstance(calibration, Calibration) else _figures(calibration)

    def to_dict(self) -> Dict[str, Any]:
        out = {"compute": self.compute, "allreduce": self.allreduce}
        for key in ("p2p", "adam_s_per_elem", "zero_sync", "alone"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return {**out, **self.other}


@dataclass
class SearchRecord:
    """A search's bookkeeping: ``measured`` (each layout run for real: ``{"seconds", "peak"}``,
    plus ``"median"`` and a run-off's ``"runs"``), the fitted ``overheads`` (None before any fit),
    the last verification ``margin`` and the layouts of the ``runoff`` (labels)."""

    measured: Dict[Candidate, Dict[str, Any]] = field(default_factory=dict)
    overheads: Optional[List[float]] = None
    margin: Optional[float] = None
    runoff: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {} if self.margin is None else {"margin": self.margin}
        out.update(runoff=self.runoff, overheads=self.overheads,
                   measured=[{"candidate": asdict(c), **v} for c, v in self.measured.items()],
                   probes=[(asdict(c), v["seconds"]) for c, v in self.measured.items()])
        return out


def _int_keys(table: Optional[Dict[Any, Any]]) -> Optional[Dict[int, Any]]:
    return None if table is None else {int(k): v for k, v in table.items()}


def read_calibration(d: Dict[str, Any]) -> Tuple[Calibration, SearchRecord]:
    """The dict form (``AutoPlan.calibration``, :func:`merge_calibrations`' result, or either after
    a trip through JSON) as figures and bookkeeping. A layout that ran keeps its time and peak;
    the run-off is this search's own (none yet)."""
    measured = {Candidate(**e["candidate"]): {"seconds": e["seconds"], "peak": e["peak"]}
                for e in d.get("measured", [])}
    return _figures(d), SearchRecord(measured, d.get("overheads"), d.get("margin"))


def _figures(d: Dict[str, Any]) -> Calibration:
    return Calibration(compute=_int_keys(d["compute"]), allreduce=_int_keys(d["allreduce"]),
                       p2p=d.get("p2p"), adam_s_per_elem=d.get("adam_s_per_elem"),
                       zero_sync=_int_keys(d.get("zero_sync")), alone=d.get("alone"),
                       other={k: v for k, v in d.items() if k not in FIGURES + RECORD})


def write_calibration(figures: Calibration, record: SearchRecord) -> Dict[str, Any]:
    """The dict form of both: ``AutoPlan.calibration``."""
    return {**figures.to_dict(), **record.to_dict()}
