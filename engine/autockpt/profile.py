"""What a profile holds: per layer and option the bytes kept, the peaks and the recompute cost
(:func:`.measure.profile_checkpointing` fills it, :func:`.solve.solve` reads it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..telemetry.units import format_bytes

NONE, LAYER = "none", "layer"
_MARK = 5_000_011  # odd byte counts no tensor of a step has: marks in the CPU allocator's event stream

Entry = Union[int, str]


_fmt = format_bytes


@dataclass
class OptionCost:
    """One layer under one option (bytes; seconds). See the module docstring for each figure."""

    keep: int
    fwd_peak: int
    bwd_delta: int
    bwd_peak: int
    recompute_s: float
    saved: int
    overhead_s: float = 0.0          # the option's per-layer cost beyond the recompute (pooled over layers)

    @property
    def cost_s(self) -> float:
        """Seconds a step spends on this option beyond the layer not checkpointed: the recompute
        plus the option's overhead (never below zero)."""
        return max(0.0, self.recompute_s + self.overhead_s)


@dataclass
class UnitProfile:
    name: str
    index: int                       # what ``enable_activation_checkpointing(layers=...)`` calls it
    options: Dict[str, OptionCost]
    forward_s: float                 # its forward, not checkpointed
    saved: int                       # bytes autograd saves for it, not checkpointed
    parts: Dict[str, Tuple[int, float]] = field(default_factory=dict)  # part -> (saved bytes, forward s)

    def entry(self, option: str) -> Optional[Entry]:
        if option == NONE:
            return None
        return self.index if option == LAYER else f"{self.index}.{option}"


@dataclass
class CheckpointProfile:
    """What :func:`profile_checkpointing` measured; :func:`solve` turns it into a plan per budget."""

    units: List[UnitProfile]
    parts: Tuple[str, ...]
    prefix_keep: int
    prefix_peak: int
    prefix_bwd_peak: int
    tail_keep: int
    tail_peak: int
    tail_bwd_delta: int
    tail_bwd_peak: int
    device: str
    inputs: str
    profile_s: float = 0.0
    stage: int = 0                   # the model's pipeline stage, where it says (telemetry reports it)

    @property
    def options(self) -> Tuple[str, ...]:
        return (NONE, LAYER) + self.parts

    def terms(self):
        """``(k, after)``: the tail's bytes kept through backward, and ``after[u]``, the most bytes the
        layers from ``u`` on can add back in their backward (what every peak formula below adds)."""
        n = len(self.units)
        r = [max(c.keep + c.bwd_delta for c in u.options.values()) for u in self.units]
        after = [0] * (n + 1)  # after[u] = sum of r_v for v >= u
        for u in range(n - 1, -1, -1):
            after[u] = after[u + 1] + r[u]
        k = self.tail_keep + self.tail_bwd_delta
        return k, after

    def unit_need(self, u: int, option: str, k: int, after: List[int]) -> int:
        """Bytes above ``s_u`` that layer ``u`` needs at its forward's and its backward's peaks."""
        c = self.units[u].options[option]
        return max(c.fwd_peak, c.keep + c.bwd_peak + k + after[u + 1])

    def fixed_peaks(self, k: int, after: List[int]) -> int:
        return max(self.prefix_peak, self.prefix_keep + k + after[0] + self.prefix_bwd_peak)

    def tail_need(self) -> int:
        return max(self.tail_peak, self.tail_keep + self.tail_bwd_peak)

    def predict(self, choice: Sequence[str]) -> Tuple[int, float]:
        """(predicted peak bytes, predicted recompute seconds) of one option per layer."""
        if len(choice) != len(self.units):
            raise ValueError(f"predict: {len(choice)} options for {len(self.units)} layers")
        k, after = self.terms()
        s, peak, t = self.prefix_keep, self.fixed_peaks(k, after), 0.0
        for u, o in enumerate(choice):
            peak = max(peak, s + self.unit_need(u, o, k, after))
            s += self.units[u].options[o].keep
            t += self.units[u].options[o].cost_s
        return max(peak, s + self.tail_need()), t

    @property
    def forward_s(self) -> float:
        return sum(u.forward_s for u in self.units)

    def table(self) -> str:
        opts = self.options
        head = f"{'layer':<14}{'saved':>11}{'fwd ms':>8}  " + "  ".join(f"{o + ' keep/rec ms':>22}" for o in opts)
        lines = [f"CheckpointProfile on {self.device}, inputs {self.inputs} (profiled in {self.profile_s:.2f} s)",
                 f"  prefix keeps {_fmt(self.prefix_keep)} (peak {_fmt(self.prefix_peak)}), tail keeps "
                 f"{_fmt(self.tail_keep)} (peak {_fmt(self.tail_peak)}, backward peak {_fmt(self.tail_bwd_peak)})",
                 "  " + head]
        if self.units:
            u0 = self.units[0].options
            lines.append("  overhead a region beyond its recompute (ms): "
                         + ", ".join(f"{o} {u0[o].overhead_s * 1e3:.1f}" for o in opts[1:]))
        for u in self.units:
            cells = [f"{_fmt(u.options[o].keep) + ' / ' + format(u.options[o].recompute_s * 1e3, '.1f'):>22}"
                     for o in opts]
            lines.append(f"  {u.name:<14}{_fmt(u.saved):>11}{u.forward_s * 1e3:>8.1f}  " + "  ".join(cells))
            for p, (b, s) in u.parts.items():
                lines.append(f"    {'.' + p:<12}{_fmt(b):>11}{s * 1e3:>8.1f}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.table()
