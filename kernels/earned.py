"""Which backend ``backend=None`` runs on a GPU: a Triton kernel only where it has earned its place.

A Triton kernel slower than what torch gives for the same call (SDPA, torch's fused AdamW, a bf16
linear) is a loss to every user who did not ask for it. So on CUDA the dispatcher looks up the
measurements of :mod:`.measured` (written by ``bench/kernels.py --record`` on a GPU) for this op, this
call's shape class and this device: Triton where the record's ratio (torch's time / ours) is at least 1,
torch where it is below or where nothing was measured on this device. ``COLOSSAL_LAB_KERNELS=triton``
takes Triton on every CUDA call it supports (for measuring); ``=torch`` never. :func:`chosen` says what
each op ran last and why.
"""

from __future__ import annotations

import os
from typing import Dict, Iterable, Optional, Tuple

POLICIES = ("measured", "triton", "torch")
ENV = "COLOSSAL_LAB_KERNELS"

_CHOSEN: Dict[str, Tuple[str, str]] = {}


def policy() -> str:
    """``COLOSSAL_LAB_KERNELS`` (default ``measured``); an unknown value is an error naming the choices."""
    value = os.environ.get(ENV, "measured") or "measured"
    if value not in POLICIES:
        raise ValueError(f"{ENV}={value!r}: choose one of {POLICIES} ('measured': Triton only where "
                         "bench/kernels.py measured it at least as fast as torch on this GPU)")
    return value


def verdict(op: str, device: str, klass: str = "any", records: Optional[Iterable[dict]] = None,
            rule: Optional[str] = None) -> Tuple[str, str]:
    """``(backend, reason)`` for ``op`` on a CUDA device named ``device`` (``torch.cuda.get_device_name``)
    for a call of shape class ``klass``, by ``rule`` (default: :func:`policy`) over ``records`` (default:
    :data:`.measured.RECORDS`)."""
    rule = rule or policy()
    if rule != "measured":
        return rule, f"{ENV}={rule}"
    if records is None:
        from .measured import RECORDS as records
    found = [r for r in records if r["op"] == op and r["device"] == device and r.get("klass", "any") in (klass, "any")]
    if not found:
        return "torch", f"{op} ({klass}) not measured on {device}: torch until bench/kernels.py --record says otherwise"
    best = min(found, key=lambda r: r.get("klass", "any") == "any")  # a record of this shape class first
    ratio = float(best["ratio"])
    who = "triton" if ratio >= 1.0 else "torch"
    return who, f"{op} ({klass}) on {device}: Triton {ratio:.3f}x torch ({best.get('when', '')})"


def note(op: str, backend: str, reason: str) -> None:
    _CHOSEN[op] = (backend, reason)


def chosen() -> Dict[str, Tuple[str, str]]:
    """What each op's last ``backend=None`` call on CUDA ran, with the reason: ``{op: (backend, reason)}``."""
    return dict(_CHOSEN)
