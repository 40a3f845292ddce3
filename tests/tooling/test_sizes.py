"""Sizes a newcomer can read: no source file over 800 lines and no function over 120, in the
engine, kernels, widgets, the front, scripts and benchmarks (tests are left out: a test module is a
list of cases). A room that grows past these is split by idea, not by line count."""
from __future__ import annotations

import ast

from support import ROOT

FOLDERS = ("engine", "kernels", "widgets", "colossal_lab", "scripts", "bench")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 800, 120


def _sources():
    for folder in FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_source_file_over_800_lines():
    long = {str(p.relative_to(ROOT)): n for p in _sources()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES}
    assert long == {}


def test_no_function_over_120_lines():
    long = {}
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"), str(p))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    assert long == {}
