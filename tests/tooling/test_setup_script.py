"""Which index scripts/setup.sh installs torch from, decided by real processes.

``scripts/torch_index.sh`` runs with PATH holding only a folder that has a fake ``nvidia-smi``
or not, so the GPU question is answered the way the script asks it; the CPU index is a real
HTTP server on 127.0.0.1 serving a ``/torch/`` page, a closed port, or a socket that accepts and
never answers. ``setup.sh`` itself runs from a copy of the scripts whose ``.venv/bin/python``
is the real interpreter except for ``-m pip``, which is recorded instead of run (the one thing
not done for real: downloading torch).
"""

import functools
import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
from support import ROOT

SCRIPT = ROOT / "scripts" / "torch_index.sh"
BASH = shutil.which("bash")


@pytest.fixture
def index_server(tmp_path):
    """A PEP 503-shaped index with a torch page, served over HTTP on 127.0.0.1."""
    root = tmp_path / "index"
    (root / "whl" / "cpu" / "torch").mkdir(parents=True)
    (root / "whl" / "cpu" / "torch" / "index.html").write_text(
        '<html><body><a href="torch-2.13.0%2Bcpu-cp311-cp311-linux_x86_64.whl">torch</a></body></html>')
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a, **k: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/whl/cpu"
    srv.shutdown()
    srv.server_close()


def _closed_port_url():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connection refused
    return f"http://127.0.0.1:{port}"


def _bin(tmp_path, gpu):
    """A PATH folder: no nvidia-smi (gpu=None), one listing a GPU (True), one that fails (False)."""
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    if gpu is not None:
        f = d / "nvidia-smi"
        f.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n" if gpu else
                     "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate"
                     " with the NVIDIA driver.'\nexit 9\n")
        f.chmod(0o755)
    return d


def _choose(tmp_path, index_url, gpu):
    env = {"PATH": str(_bin(tmp_path, gpu)), "PYTHON": sys.executable, "TORCH_CPU_INDEX": index_url,
           "HOME": os.environ.get("HOME", "/tmp")}
    t = time.monotonic()
    r = subprocess.run([BASH, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip(), r.stderr, time.monotonic() - t


def test_no_gpu_and_cpu_index_reachable_picks_the_cpu_index(tmp_path, index_server):
    out, err, _ = _choose(tmp_path, index_server, gpu=None)
    assert out == index_server, err


def test_no_gpu_and_trailing_slash_still_probes_the_torch_page(tmp_path, index_server):
    out, err, _ = _choose(tmp_path, index_server + "/", gpu=None)
    assert out == index_server, err


def test_failing_nvidia_smi_counts_as_no_gpu(tmp_path, index_server):
    out, err, _ = _choose(tmp_path, index_server, gpu=False)
    assert out == index_server, err


def test_visible_gpu_keeps_the_default_index(tmp_path, index_server):
    out, err, _ = _choose(tmp_path, index_server, gpu=True)
    assert out == "default" and "GPU is visible" in err


def test_unreachable_cpu_index_falls_back_to_the_default(tmp_path):
    out, err, _ = _choose(tmp_path, _closed_port_url(), gpu=None)
    assert out == "default" and "unreachable" in err


def test_index_without_a_torch_page_falls_back_to_the_default(tmp_path, index_server):
    out, err, _ = _choose(tmp_path, index_server + "/nothing-here", gpu=None)  # 404
    assert out == "default", err


def test_a_silent_index_is_given_up_on_within_five_seconds(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)  # the kernel completes the handshake; nobody ever answers
    try:
        out, err, seconds = _choose(tmp_path, f"http://127.0.0.1:{s.getsockname()[1]}", gpu=None)
    finally:
        s.close()
    assert out == "default", err
    assert 4.0 < seconds < 8.0, seconds


# ---- setup.sh end to end, pip recorded -------------------------------------------------------

FAKE_TORCH = """import os
_state = os.environ["FAKE_TORCH_STATE"]
if not os.path.exists(_state):
    raise ImportError("No module named 'torch' (fake)")
__version__ = open(_state).read().strip()
"""

FAKE_PYTHON = """#!/bin/sh
# the real interpreter, except `-m pip`: record it; an `install torch==X` makes torch X importable
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "$*" >> "$PIP_LOG"
  case "$*" in *--index-url*) [ "${PIP_INDEX_RC:-0}" = 0 ] || exit "$PIP_INDEX_RC";; esac
  for a in "$@"; do case "$a" in torch==*) echo "${a#torch==}" > "$FAKE_TORCH_STATE";; esac; done
  exit 0
fi
exec %s "$@"
"""


def _setup_tree(tmp_path, installed_torch):
    """A checkout with setup.sh, torch_index.sh, engine/__init__.py and a .venv whose pip is recorded."""
    tree = tmp_path / "repo"
    (tree / "scripts").mkdir(parents=True)
    (tree / "engine").mkdir()
    for f in ("scripts/setup.sh", "scripts/torch_index.sh", "engine/__init__.py"):
        shutil.copy(ROOT / f, tree / f)
    py = tree / ".venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(FAKE_PYTHON % sys.executable)
    py.chmod(0o755)
    fake = tmp_path / "fake_site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_TORCH)
    state = tmp_path / "torch_version"
    if installed_torch:
        state.write_text(installed_torch)
    return tree, state


def _run_setup(tmp_path, installed_torch, index_url, pip_index_rc=0):
    tree, state = _setup_tree(tmp_path, installed_torch)
    bin_dir = _bin(tmp_path, gpu=False)  # a failing nvidia-smi first on PATH: no GPU, on any machine
    log = tmp_path / "pip.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(tmp_path / "fake_site"),
           "FAKE_TORCH_STATE": str(state), "PIP_LOG": str(log), "PIP_INDEX_RC": str(pip_index_rc),
           "TORCH_CPU_INDEX": index_url}
    env.pop("TORCH_VERSION", None)
    r = subprocess.run([BASH, str(tree / "scripts" / "setup.sh")], env=env, capture_output=True, text=True,
                       timeout=120)
    pip = log.read_text().splitlines() if log.exists() else []
    return r, pip


def test_setup_with_no_torch_installs_the_cpu_build_from_the_cpu_index(tmp_path, index_server):
    r, pip = _run_setup(tmp_path, None, index_server)
    assert r.returncode == 0, r.stderr
    assert pip[0] == f"-m pip install -q --index-url {index_server} torch==2.13.0", pip
    assert pip[1:] == ["-m pip install -q -e .[test]"], pip
    assert "torch 2.13.0" in r.stdout


def test_setup_with_the_cpu_index_unreachable_uses_the_default_index(tmp_path):
    r, pip = _run_setup(tmp_path, None, _closed_port_url())
    assert r.returncode == 0, r.stderr
    assert pip == ["-m pip install -q torch==2.13.0", "-m pip install -q -e .[test]"], pip


def test_setup_falls_back_when_the_cpu_index_install_fails(tmp_path, index_server):
    r, pip = _run_setup(tmp_path, None, index_server, pip_index_rc=1)
    assert r.returncode == 0, r.stderr
    assert pip[:2] == [f"-m pip install -q --index-url {index_server} torch==2.13.0",
                       "-m pip install -q torch==2.13.0"], pip
    assert "trying the default index" in r.stderr


def test_setup_keeps_a_torch_at_or_above_the_floor(tmp_path, index_server):
    r, pip = _run_setup(tmp_path, "2.11.0+cu130", index_server)
    assert r.returncode == 0, r.stderr
    assert pip == ["-m pip install -q -e .[test]"], pip
    assert "torch 2.11.0+cu130" in r.stdout


def test_setup_replaces_a_torch_below_the_floor(tmp_path, index_server):
    r, pip = _run_setup(tmp_path, "2.5.1", index_server)
    assert r.returncode == 0, r.stderr
    assert pip[0] == f"-m pip install -q --index-url {index_server} torch==2.13.0", pip
