"""The distribution maps four import packages from four folders; every subpackage is listed."""

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = cfg["package-dir"]
    found = set()
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    missing = found - listed
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def test_import_names():
    import colossal_lab
    import colossal_lab.engine
    import colossal_lab.kernels
    import colossal_lab.widgets
    from colossal_lab.engine import telemetry

    assert pathlib.Path(colossal_lab.engine.__file__).parent.name == "engine"
    assert pathlib.Path(colossal_lab.widgets.__file__).parent.name == "widgets"
    assert callable(telemetry.emit)
