"""The one dispatch rule every kernel in this package follows.

``backend=None``  → on CUDA, Triton where it has earned its place (:mod:`.earned`: measured at least
                    as fast as torch's path for that op on this GPU), else the best plain-torch path
                    for that op (SDPA for attention, ``aten._weight_int8pack_mm`` for int8 on CPU,
                    ...). A shape or dtype the Triton kernel lacks falls back to the torch path here
                    (documented fallback, never silent wrong numbers).
``"triton"``      → force the Triton kernel. On CPU tensors this needs ``TRITON_INTERPRET=1``
                    set before the first kernel is built (Triton decides at decoration time).
                    A shape or dtype the kernel lacks is a ``ValueError``.
``"torch"``       → the plain-torch reference (the numbers the kernels are tested against).

Triton is imported lazily, on first use: ``colossal_lab.kernels`` imports fine without it.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Optional, TypeVar

import torch

BACKENDS = ("triton", "torch")

T = TypeVar("T")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True if ``import triton`` works here (it is optional: CPU-only installs may lack it)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def interpret_mode() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def check_backend(op: str, backend: Optional[str]) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"{op}: backend={backend!r} is not one of None, 'triton', 'torch' "
                         "(None picks Triton on CUDA and the best torch path elsewhere)")


def choose(op: str, x: torch.Tensor, backend: Optional[str], triton_ok: Optional[str] = None,
           klass: str = "any") -> str:
    """Resolve ``backend`` to ``"triton"`` or ``"torch"`` for tensor ``x``.

    ``triton_ok`` is None when the Triton kernel supports this call, else the reason it does
    not: with ``backend=None`` that means the torch path, with ``backend="triton"`` an error.
    ``klass`` names the call's shape class for the measurements (``earned.verdict``).
    """
    check_backend(op, backend)
    if backend == "torch":
        return "torch"
    if backend is None:
        if not x.is_cuda:
            return "torch"
        from . import earned

        if not triton_available() or triton_ok is not None:
            earned.note(op, "torch", "triton is not importable" if triton_ok is None else triton_ok)
            return "torch"
        who, why = earned.verdict(op, torch.cuda.get_device_name(x.device), klass)
        earned.note(op, who, why)
        return who
    # forced Triton
    if not triton_available():
        raise RuntimeError(f"{op}: backend='triton' but triton is not importable here; "
                           "install triton or pass backend=None/'torch'")
    if triton_ok is not None:
        raise ValueError(f"{op}: the Triton kernel does not support this call: {triton_ok}; "
                         "pass backend=None for the torch fallback")
    if not x.is_cuda and not interpret_mode():
        raise ValueError(f"{op}: backend='triton' on a {x.device.type} tensor needs TRITON_INTERPRET=1 "
                         "in the environment before the first kernel is built; or move the tensors to CUDA")
    return "triton"


def lazy_kernels(build: Callable[[], T]) -> Callable[[torch.Tensor], T]:
    """Cache ``build()`` (which imports triton and decorates the kernels) per interpret mode.

    Triton picks interpreter vs compiler when a function is decorated, so we decorate on
    first use and keep one build per mode.
    """
    cache: dict = {}

    def get(x: torch.Tensor) -> T:
        mode = not x.is_cuda  # CPU tensors run under the interpreter
        if mode not in cache:
            if mode and not interpret_mode():
                raise ValueError("Triton on CPU tensors needs TRITON_INTERPRET=1")
            cache[mode] = build()
        return cache[mode]

    return get
