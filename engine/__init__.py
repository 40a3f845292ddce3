"""colossal_lab.engine: Booster, plugins, Gemini, pipelines, checkpoints, telemetry, models."""

import re as _re
import sys as _sys

#: The oldest torch (major, minor) the engine runs on: the newest of the torch APIs it calls
#: (``PipelineSchedule.step(..., return_outputs=)``, 2.10). tests/tooling/test_packaging.py lists each API
#: with its release and holds this and pyproject.toml's ``torch>=`` together.
TORCH_FLOOR = (2, 10)


def _torch_version() -> str | None:
    """The torch in use: the imported module's version if torch is loaded, else the version file
    of the torch that ``import torch`` would load (found without importing it, so ``telemetry``
    users do not pay for importing torch); ``None`` when there is no torch."""
    mod = _sys.modules.get("torch")
    if mod is not None and isinstance(getattr(mod, "__version__", None), str):
        return mod.__version__
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None  # no torch: the parts that need it fail on their own import
    for folder in spec.submodule_search_locations or ():
        try:
            with open(os.path.join(folder, "version.py"), encoding="utf-8") as f:
                m = _re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), _re.M)
        except OSError:
            continue
        if m:
            return m.group(1)
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def _check_torch(version: str | None) -> None:
    """``ImportError`` naming the installed torch, the floor and the fix when torch is too old;
    only major.minor count, so pre-releases and vendor builds (``2.10.0a0+git…``) pass."""
    if version is None:
        return
    m = _re.match(r"(\d+)\.(\d+)", version)
    if m is None or (int(m.group(1)), int(m.group(2))) >= TORCH_FLOOR:
        return
    floor = ".".join(map(str, TORCH_FLOOR))
    raise ImportError(
        f"colossal_lab.engine needs torch >= {floor}, but torch {version} is installed. "
        f"Fix: pip install --upgrade 'torch>={floor}' (on a machine without a GPU add "
        "--index-url https://download.pytorch.org/whl/cpu for the CPU build), "
        "or re-run `bash scripts/setup.sh`, which installs one into .venv.")


_check_torch(_torch_version())

# Booster is imported lazily: `from colossal_lab.engine import telemetry` (widgets, the relay)
# must not pay for importing torch.
__all__ = ["Booster", "TORCH_FLOOR"]


def __getattr__(name):
    if name == "Booster":
        from .booster import Booster

        return Booster
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
