"""The oldest transformers and peft the engine's Hugging Face paths are tested with, and the check.

The floors are the oldest releases the Hugging Face tests of what the adapter reads from transformers and
peft pass on (``scripts/check_hf_floor.sh`` runs them there): older transformers 5 releases ship plans
the adapter reads as written but that train differently (before 5.3, Qwen3's per-head
``q_norm``/``k_norm`` carry no ``replicated_with_grad_allreduce`` entry, so their gradients stay partial
under tensor parallelism), base forwards that a pipeline stage cannot run as cut before 5.5 (OLMo 2's),
and peft before 0.18 does not import beside transformers 5. pyproject.toml's ``[hf]`` extra states the
same floors (tests/tooling/test_packaging.py holds them together). The check reads the version of the
package already loaded (an HF model exists, so transformers is): nothing is imported here.
"""

from __future__ import annotations

import re
import sys
from typing import Optional, Tuple

TRANSFORMERS_FLOOR = (5, 5)
PEFT_FLOOR = (0, 18)


def _major_minor(version: str) -> Optional[Tuple[int, int]]:
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_floor(package: str = "transformers", version: Optional[str] = None) -> None:
    """``ImportError`` naming the installed release, the floor and the fix when ``package`` (loaded, or
    ``version`` given) is older than its floor; a development build of the floor passes."""
    floor = {"transformers": TRANSFORMERS_FLOOR, "peft": PEFT_FLOOR}[package]
    if version is None:
        mod = sys.modules.get(package)
        version = getattr(mod, "__version__", None) if mod is not None else None
    got = _major_minor(version) if isinstance(version, str) else None
    if got is None or got >= floor:
        return
    want = ".".join(map(str, floor))
    raise ImportError(f"colossal-lab's Hugging Face support needs {package} >= {want}, but {package} {version} is "
                      f"installed; fix: pip install --upgrade '{package}>={want}' (or pip install "
                      "'colossal-lab[hf]', which brings both transformers and peft)")
