"""Functions defined in a notebook run on real ranks with the notebook names they use.

A Jupyter kernel runs cells in a namespace whose ``__name__`` is ``"__main__"``, which the
ranks cannot import. ``notebook()`` executes "cells" into such a namespace here, so the
functions below are shipped exactly as a notebook's would be. One 2-rank gloo cluster (the
``cluster`` fixture of tests/conftest.py) serves the module.
"""

import linecache
import os
import threading

import pytest

ipp = pytest.importorskip("ipyparallel")
IPython = pytest.importorskip("IPython")

import colossal_lab as cl  # noqa: E402  (after the importorskips)

#: the module's ``cluster`` (tests/conftest.py). Both ranks of ``fails`` raise on their own: a long
#: ``failure_grace`` lets the slower one finish formatting its traceback: interrupted inside it, a rank
#: sends a traceback without the cell's lines, or none (seen with a 0 s grace). The wait ends when both are done.
CLUSTER_ARGS = dict(timeout=60, failure_grace=30.0, interrupt_grace=3.0)

CELLS = [
    # cell 1: top-level imports, one under an alias, and a constant
    "import threading\nimport numpy as np\nimport torch\nimport torch.distributed as dist\nSCALE = 10\n",
    # cell 2: helpers calling helpers
    "def rank():\n    return dist.get_rank()\n\n"
    "def scaled():\n    return rank() * SCALE\n\n"
    "def chain():\n    return scaled() + 1\n",
    # cell 3: functions that use cells 1-2
    "def uses_alias():\n    return float(np.sum(np.arange(rank() + 3)))\n\n"
    "def reduce_rank():\n    t = torch.tensor([float(rank() + 1)])\n    dist.all_reduce(t)\n    return t.item()\n\n"
    "def make_adder(k):\n    def add(x):\n        return x + k + SCALE\n    return add\n\n"
    "square = lambda x: x * x + rank()\n\n"
    "def call(f, *args):\n    return f(*args)\n\n"
    "def fails():\n    raise ValueError(f'bad on {rank()}')\n",
    # cell 4: names that exist only on the ranks, and objects that cannot be pickled
    "def rank_only():\n    return only_on_ranks + SCALE\n\n"
    "def reads_rank_namespace():\n    return get_ipython().user_ns.get('only_on_ranks')\n\n"
    "def mark(arg):\n    get_ipython().user_ns['touched'] = True\n\n"
    "LOCK = threading.Lock()\n\n"
    "def locked():\n    with LOCK:\n        return 1\n\n"
    "def outer():\n    return locked() + scaled()\n",
]


def notebook():
    """Run CELLS as IPython does: each under its own file name, its lines in linecache."""
    ns = {"__name__": "__main__"}
    for i, cell in enumerate(CELLS):
        filename = f"/tmp/ipykernel_{os.getpid()}/cell{i}-{id(ns)}.py"  # no such file, as in a kernel
        linecache.cache[filename] = (len(cell), None, cell.splitlines(keepends=True), filename)
        exec(compile(cell, filename, "exec"), ns)
    return ns


# --- functions importable on the ranks (this folder is on their path): shipped by reference

_calls = 0


def count_calls():
    global _calls
    _calls += 1
    return _calls


def defined_on_ranks(name):
    from IPython import get_ipython

    return name in get_ipython().user_ns


@pytest.fixture(scope="module")
def nb():
    return notebook()


def test_helpers_constants_and_aliased_modules(cluster, nb):
    assert nb["chain"].__module__ == "__main__"
    assert cluster.run(nb["chain"]) == [1, 11]  # chain -> scaled -> rank, and SCALE
    assert cluster.run(nb["scaled"]) == [0, 10]
    assert cluster.run(nb["uses_alias"]) == [3.0, 6.0]  # np from "import numpy as np"


def test_collective_inside_a_shipped_function(cluster, nb):
    assert cluster.run(nb["reduce_rank"]) == [3.0, 3.0]


def test_lambdas_closures_and_functions_as_arguments(cluster, nb):
    assert cluster.run(nb["square"], 3) == [9, 10]
    assert cluster.run(nb["make_adder"](5), 1) == [16, 16]
    assert cluster.run(nb["call"], nb["square"], 2) == [4, 5]
    assert cluster.run_on([1], nb["call"], f=nb["chain"]) == [11]


def test_names_only_on_the_ranks_and_the_rank_namespace_unchanged(cluster, nb):
    cluster.push({"only_on_ranks": 7, "SCALE": 1000})
    assert cluster.run(nb["rank_only"]) == [17, 17]  # the notebook's SCALE wins, the rank fills in the rest
    assert cluster.run(nb["reads_rank_namespace"]) == [7, 7]  # get_ipython() is the rank's shell
    assert cluster.pull("SCALE") == [1000, 1000]  # shipping did not overwrite rank variables
    assert cluster.run(defined_on_ranks, "scaled") == [False, False]  # nor define the helpers there


def test_ipyparallel_reference_still_resolves_on_the_rank(cluster, nb):
    cluster.push({"rank_value": 5})
    assert cluster.run(nb["square"], ipp.Reference("rank_value")) == [25, 26]


def test_notebook_shell_becomes_the_rank_shell(cluster, monkeypatch):
    class Shell:  # stands in for the notebook kernel's shell, which cannot be pickled
        def __init__(self):
            self.lock = threading.Lock()
            self.user_ns = {"only_on_ranks": "notebook"}

        def get_ipython(self):
            return self

    shell = Shell()
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    ns = {"__name__": "__main__", "get_ipython": shell.get_ipython}
    exec("def peek():\n    return get_ipython().user_ns.get('only_on_ranks')\n", ns)
    cluster.push({"only_on_ranks": "rank"})
    assert cluster.run(ns["peek"]) == ["rank", "rank"]


def test_importable_functions_ship_by_reference(cluster):
    first = cluster.run(count_calls)
    assert cluster.run(count_calls) == [c + 1 for c in first]  # module state kept on the rank


def test_errors_and_tracebacks_per_rank(cluster, nb):
    pids = cluster.pids
    with pytest.raises(cl.RankError) as ei:
        cluster.run(nb["fails"])
    e = ei.value
    assert e.ranks == [0, 1]
    assert "rank 0: ValueError: bad on 0" in str(e) and "rank 1: ValueError: bad on 1" in str(e)
    for rank in (0, 1):
        tb = e.failures[rank].traceback
        assert "in fails()" in tb and "raise ValueError(f'bad on {rank()}')" in tb, (rank, tb)  # the cell's line
        assert "ipyparallel" not in tb, tb  # from the function's own frame on
    assert cluster.pids == pids and cluster.run(nb["chain"]) == [1, 11]


def test_an_interrupt_does_not_cut_a_ranks_own_traceback(cluster, nb, monkeypatch):
    """No grace: the slower rank is interrupted at once, often while its own error is being reported. A
    rank's error is rendered as it is raised, with SIGINT held off: every rank that reports the error
    reports the cell's line, and none stops answering (no restart)."""
    monkeypatch.setattr(cluster.config, "failure_grace", 0.0)
    pids = cluster.pids
    for _ in range(12):
        with pytest.raises(cl.RankError) as ei:
            cluster.run(nb["fails"])
        for rank, failure in ei.value.failures.items():
            if failure.ename == "ValueError":
                assert "raise ValueError(f'bad on {rank()}')" in failure.traceback, (rank, failure.traceback)
        assert cluster.pids == pids, str(ei.value)
    assert cluster.run(nb["chain"]) == [1, 11]


def test_cell_lines_come_from_ipython_history_when_linecache_lost_them(cluster, monkeypatch):
    """In a real IPython shell: a cell's lines dropped from ``linecache`` (``linecache.clearcache()``)
    are found again in the shell's input history, and the rank's traceback shows them."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell()
    try:
        shell.run_cell("import torch.distributed as dist\n\ndef cell_fails():\n"
                       "    raise KeyError(f'key {dist.get_rank()}')\n", store_history=True)
        fn = shell.user_ns["cell_fails"]
        linecache.cache.pop(fn.__code__.co_filename)
        monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
        with pytest.raises(cl.RankError) as ei:
            cluster.run(fn)
    finally:
        shell.restore_sys_module_state()
    for rank, failure in ei.value.failures.items():
        assert "raise KeyError(f'key {dist.get_rank()}')" in failure.traceback, (rank, failure.traceback)


def test_unpicklable_values_are_named_before_any_rank_starts(cluster, nb):
    with pytest.raises(TypeError, match=r"cannot send the function outer\(\) to the ranks: "
                                        r"global 'LOCK' of locked\(\) cannot be pickled .*lock.*"
                                        r"create them inside the function"):
        cluster.run(nb["outer"])
    with pytest.raises(TypeError, match=r"args\[0\] \(a lock\) cannot be pickled to send it to the ranks"):
        cluster.run(nb["mark"], threading.Lock())
    with pytest.raises(TypeError, match=r"kwargs\['arg'\] \(a lock\) cannot be pickled"):
        cluster.run(nb["mark"], arg=threading.Lock())
    assert cluster.run(defined_on_ranks, "touched") == [False, False]  # mark never ran
    cluster.run(nb["mark"], 0)
    assert cluster.run(defined_on_ranks, "touched") == [True, True]
