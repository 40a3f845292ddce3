"""The layers' import directions, read off the code (every ``import`` and ``from ... import`` in every
file, inside functions too, and ``importlib.import_module`` / ``__import__`` of a literal name):

* the engine never imports the notebook front (``colossal_lab``'s own modules), the widgets, or
  Jupyter (IPython, ipywidgets, ipyparallel, ...);
* the widgets import, of the engine, only its telemetry (the event types and their bus: the one
  contract between the two), and never the front or the kernels;
* the kernels import none of the others, and no Jupyter.

``docs/architecture.md`` draws the same picture. Each rule is also shown to fail on a violation
planted in a copy of the tree, so this test cannot pass by checking nothing.
"""
from __future__ import annotations

import ast
import shutil
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pytest
from support import ROOT

# folder -> the import name it is installed as (pyproject.toml's package-dir)
PACKAGES = {"engine": "colossal_lab.engine", "kernels": "colossal_lab.kernels", "widgets": "colossal_lab.widgets",
            "colossal_lab": "colossal_lab"}
JUPYTER = ("IPython", "ipykernel", "ipywidgets", "ipyparallel", "jupyter", "jupyterlab", "jupyter_client",
           "jupyter_server", "nbformat", "nbclient", "anywidget", "traitlets", "plotly", "zmq", "papermill")
SUBPACKAGES = ("colossal_lab.engine", "colossal_lab.kernels", "colossal_lab.widgets")


def _module_name(folder: str, path: Path, root: Path) -> Tuple[str, bool]:
    """(dotted name, is a package's ``__init__``) of a file under one of the four folders."""
    rel = path.relative_to(root / folder).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([PACKAGES[folder], *parts]), path.name == "__init__.py"


def _resolve(module: str, is_pkg: bool, level: int, target: Optional[str]) -> str:
    """The absolute name of a relative import (``from ..x import y`` inside ``module``)."""
    if level == 0:
        return target or ""
    base = module.split(".")
    base = base if is_pkg else base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports(path: Path, module: str, is_pkg: bool) -> Iterator[Tuple[int, str]]:
    """``(line, absolute name)`` of every import in a file; ``from a import b`` is ``a.b`` (a
    submodule or a name of ``a``: either way what ``a`` gives), ``from a import *`` is ``a``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_pkg, node.level, node.module)
            for alias in node.names:
                yield node.lineno, base if alias.name == "*" else f"{base}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__"):
                yield node.lineno, node.args[0].value


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _is_front(name: str) -> bool:
    """A module of the notebook front: ``colossal_lab`` itself or one of its own modules."""
    return _under(name, "colossal_lab") and not any(_under(name, p) for p in SUBPACKAGES)


def _is_jupyter(name: str) -> bool:
    return any(_under(name, j) for j in JUPYTER)


def _broken_rule(folder: str, name: str) -> Optional[str]:
    if folder == "engine":
        if _is_front(name) or _under(name, "colossal_lab.widgets") or _is_jupyter(name):
            return "the engine imports the front, the widgets or Jupyter"
    elif folder == "widgets":
        if _is_front(name) or _under(name, "colossal_lab.kernels"):
            return "the widgets import the front or the kernels"
        if _under(name, "colossal_lab.engine") and name != "colossal_lab.engine" \
                and not _under(name, "colossal_lab.engine.telemetry"):
            return "the widgets import the engine's internals (only colossal_lab.engine.telemetry is theirs)"
    elif folder == "kernels":
        if (_under(name, "colossal_lab") and not _under(name, "colossal_lab.kernels")) or _is_jupyter(name):
            return "the kernels import the engine, the widgets, the front or Jupyter"
    return None


def violations(root: Path = ROOT) -> List[str]:
    out = []
    for folder in ("engine", "widgets", "kernels"):
        for path in sorted((root / folder).rglob("*.py")):
            module, is_pkg = _module_name(folder, path, root)
            for line, name in imports(path, module, is_pkg):
                why = _broken_rule(folder, name)
                if why:
                    out.append(f"{path.relative_to(root)}:{line}: imports {name}: {why}")
    return out


def test_every_import_points_the_way_the_layers_allow():
    assert violations() == []


def test_relative_imports_resolve_to_the_installed_names():
    assert _resolve("colossal_lab.engine.planner.layout", False, 2, "plugins") == "colossal_lab.engine.plugins"
    assert _resolve("colossal_lab.engine.planner", True, 1, "memory") == "colossal_lab.engine.planner.memory"
    assert _resolve("colossal_lab.engine.booster", False, 2, None) == "colossal_lab"  # `from .. import x`: the front


PLANTED = [  # (file, line planted, what the violation names)
    ("engine/booster.py", "from colossal_lab.cluster import Cluster", "colossal_lab.cluster.Cluster"),
    ("engine/planner/layout/search.py", "def _planted():\n    import colossal_lab as cl", "colossal_lab"),
    ("engine/gemini/chunk.py", "from ... import magics", "colossal_lab.magics"),
    ("engine/telemetry/bus.py", "from IPython.display import display", "IPython.display.display"),
    ("engine/comm.py", "import importlib; importlib.import_module('colossal_lab.relay')", "colossal_lab.relay"),
    ("widgets/gauges.py", "from colossal_lab.engine.gemini import ChunkManager",
     "colossal_lab.engine.gemini.ChunkManager"),
    ("widgets/timeline.py", "from colossal_lab import launch", "colossal_lab.launch"),
    ("kernels/rms_norm.py", "from colossal_lab.engine import comm", "colossal_lab.engine.comm"),
]


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory):
    dst = tmp_path_factory.mktemp("tree")
    for folder in ("engine", "widgets", "kernels"):
        shutil.copytree(ROOT / folder, dst / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


@pytest.mark.parametrize("rel,line,name", PLANTED, ids=[p[0] for p in PLANTED])
def test_a_planted_violation_is_named(tree_copy, rel, line, name):
    path = tree_copy / rel
    before = path.read_text(encoding="utf-8")
    try:
        path.write_text(before + "\n" + line + "\n", encoding="utf-8")
        found = violations(tree_copy)
    finally:
        path.write_text(before, encoding="utf-8")
    assert any(v.startswith(rel + ":") and f"imports {name}:" in v for v in found), found
