"""The GPU check: the GPU tests, the first-contact scenarios and the GPU benchmarks, one table.

What runs, each in a fresh subprocess under its own time limit (a CUDA error, a hang or a crash
costs one row, not the run), within an overall budget:

* ``pytest-collect`` — the whole suite collects: modules that need Jupyter-side packages skip
  cleanly where those are absent (a bare GPU image);
* ``pytest-gpu`` — every ``gpu``-marked test;
* ``fc-<plugin>-<precision>`` — what a user writes first: the reference GPT, ``Booster`` with
  DDP, ZeRO-1, ZeRO-2, Gemini or HybridParallel × fp32/bf16/fp16, batches made on the CPU, a few
  steps with gradient clipping on a one-rank process group (nccl on CUDA, gloo on CPU); the loss
  must be finite and fall; figure: tokens/s;
* ``gemini-<placement>`` — Gemini ``cuda``/``cpu``/``auto``/``auto`` + NVMe on a GPT of at least
  1.4B parameters (d=2048, 24 layers, vocab 50304, bf16); figure: tokens/s;
* ``int8-generate`` — a GPT trained until its next token is certain, quantized to int8 with
  bf16 activations; greedy generation must give bf16's tokens; figure: int8 decode tokens/s;
* ``readme-snippet`` — README's "A first session" ``%%colossal`` cell, verbatim, on one rank;
* ``bench-kernels``, ``bench-quant``, ``bench-engine`` — the benchmarks at sizes that take a
  minute or two; figure: their ratios;
* ``pytest-cuda-paths`` — the other tests of the files whose code takes CUDA paths when CUDA is
  present; mostly gloo ranks on the CPU, so they run beside the rest from the start.

Prints ``scenario | status | figure | seconds`` and writes the rows (with each error's tail)
as JSON; exits 1 if any scenario errored. ``--cpu`` runs the same runner at tiny sizes on
gloo with CUDA hidden, so CI proves the runner itself; scenarios that need CUDA are skipped
there with the reason.

    python scripts/gpu_check.py [--json gpu-check.json | --out DIR] [--cpu] [--quick] [--only NAME,NAME] [--list]

``--quick`` runs the short check (the gpu tests, every plugin × bf16/fp16, Gemini in every
placement at 1.4B, README's cell, int8 generation) within 270 s of scenarios; ``--out DIR`` writes
``gpu-check.json`` and ``gpu-check.md`` (the markdown table docs/gpu.md keeps) there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
PLUGINS = ("ddp", "zero1", "zero2", "gemini", "hybrid")
PRECISIONS = ("fp32", "bf16", "fp16")
PLACEMENTS = ("cuda", "cpu", "auto", "auto-nvme")
#: Test files (under tests/) whose code takes CUDA paths when CUDA is present (models placed by the engine's
#: default device, kernels dispatched to Triton), beside every file with a ``gpu`` test.
CUDA_PATH_FILES = ("engine/test_mixed_precision.py", "kernels/test_triton_kernels.py", "engine/test_quant.py",
                   "engine/gemini/test_gemini_plugin.py", "engine/test_booster.py", "engine/test_checkpoint_io.py",
                   "hybrid/test_plugin.py")


class Skip(Exception):
    """Raised by a scenario that cannot run here; the row says why."""


# ================================================================================================
# Scenarios that run in the child process (``--scenario NAME``)
# ================================================================================================

def _torch_setup(cpu: bool):
    import torch

    if cpu:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return torch


def _init_rank(cpu: bool):
    """A one-rank process group, as every rank of ``cl.launch`` has: nccl on CUDA, gloo on CPU."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not cpu
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=120))
    if cuda:
        torch.cuda.set_device(0)
    return cuda


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def _plugin(name: str, precision: str, **gemini_kw):
    """The plugin as a Colossal-AI user writes it: Gemini and HybridParallel take ``precision``
    themselves (the Booster's ``mixed_precision`` is passed as well, with the same value)."""
    from colossal_lab.engine.plugins import DDPPlugin, GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin

    return {"ddp": lambda: DDPPlugin(), "zero1": lambda: LowLevelZeroPlugin(stage=1),
            "zero2": lambda: LowLevelZeroPlugin(stage=2),
            "gemini": lambda: GeminiPlugin(precision=precision, **gemini_kw),
            "hybrid": lambda: HybridParallelPlugin(precision=precision)}[name]()


def _train(plugin, precision: str, cfg, batch: int, seq: int, steps: int, cuda: bool, lr: float = 1e-3,
           lazy: bool = False):
    """The user's first loop: model and optimizer made plainly, boosted, fed one CPU batch
    repeatedly (so the loss must fall), clipped, stepped. Returns (losses, tokens/s after warm-up).
    ``lazy``: the model is built under ``lazy_init()`` (shapes only) and Gemini materialises it chunk
    by chunk, as a user does for a model the host could not hold whole (and in seconds, not minutes)."""
    import contextlib

    import torch

    from colossal_lab.engine import Booster
    from colossal_lab.engine.lazy import lazy_init
    from colossal_lab.engine.models import GPT

    torch.manual_seed(0)
    with lazy_init() if lazy else contextlib.nullcontext():
        model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    booster = Booster(plugin=plugin, mixed_precision=precision)
    model, optimizer, *_ = booster.boost(model, optimizer)
    x = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    want = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    losses, t0 = [], None
    warm = min(2, steps - 1)
    for i in range(steps):
        if i == warm:
            _sync(cuda)
            t0 = time.perf_counter()
        logits, loss = model(x[:, :-1], x[:, 1:])
        if i == 0 and logits.dtype != want:
            raise AssertionError(f"precision {precision!r} did not take effect: the model computed its "
                                 f"logits in {logits.dtype}")
        booster.backward(loss, optimizer)
        optimizer.clip_grad_by_norm(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach().float().item()))
    _sync(cuda)
    tps = batch * seq * (steps - warm) / (time.perf_counter() - t0)
    if hasattr(plugin, "close"):
        plugin.close()
    return losses, tps


def _check_losses(losses: List[float]) -> None:
    if not all(math.isfinite(v) for v in losses):
        raise AssertionError(f"loss not finite: {losses}")
    if not min(losses[-2:]) < losses[0]:
        raise AssertionError(f"loss did not fall: {[round(v, 4) for v in losses]}")


def _fmt_tps(tps: float) -> str:
    return f"{tps / 1000:,.1f}k tok/s" if tps >= 1000 else f"{tps:,.0f} tok/s"


def scenario_first_contact(plugin_name: str, precision: str, cpu: bool) -> dict:
    torch = _torch_setup(cpu)
    from colossal_lab.engine.models import GPTConfig

    cuda = _init_rank(cpu)
    if cuda:
        cfg, batch, seq, steps = GPTConfig.preset("124m", block_size=512), 8, 512, 8
    else:
        cfg, batch, seq, steps = GPTConfig.preset("tiny"), 4, 32, 6
    if precision == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        raise Skip("this GPU has no bf16")
    losses, tps = _train(_plugin(plugin_name, precision), precision, cfg, batch, seq, steps, cuda)
    _check_losses(losses)
    return {"figure": f"{_fmt_tps(tps)}, loss {losses[0]:.2f}->{losses[-1]:.2f}",
            "tokens_per_s": tps, "losses": losses, "batch": batch, "seq": seq}


def scenario_gemini(placement: str, cpu: bool) -> dict:
    torch = _torch_setup(cpu)
    from colossal_lab.engine.models import GPTConfig

    if placement == "cuda" and (cpu or not torch.cuda.is_available()):
        raise Skip("placement 'cuda' needs a CUDA device")
    cuda = _init_rank(cpu)
    if cuda:
        cfg = GPTConfig(vocab_size=50304, block_size=512, n_layer=24, n_head=16, n_embd=2048)
        batch, seq, steps, limit = 4, 512, 3, 8 << 30
    else:  # the RAM compute tier: "auto" must fit in it, "auto-nvme" spills past it to disk
        cfg = GPTConfig.preset("tiny")
        batch, seq, steps, limit = 4, 32, 4, (1 << 20) if placement == "auto-nvme" else (8 << 20)
    kw = {"placement_policy": placement.split("-")[0]}
    if placement.startswith("auto"):
        kw["device_memory_limit"] = limit
    nvme = None
    if placement == "auto-nvme":
        nvme = tempfile.mkdtemp(prefix="gpu-check-nvme-")
        kw.update(nvme_offload_dir=nvme, nvme_offload_frac=0.25 if cuda else 1.0)
    try:
        from colossal_lab.engine.models import GPT

        with torch.device("meta"):
            n_params = sum(p.numel() for p in GPT(cfg).parameters())
        # a gentler step for 1.4B parameters, whose loss an lr of 1e-3 can push up at first
        losses, tps = _train(_plugin("gemini", "bf16", **kw), "bf16", cfg, batch, seq, steps, cuda,
                             lr=3e-4 if cuda else 1e-3, lazy=True)
    finally:
        if nvme:
            import shutil

            shutil.rmtree(nvme, ignore_errors=True)
    _check_losses(losses)
    size = f"{n_params / 1e9:.2f}B" if n_params >= 1e8 else f"{n_params / 1e6:.2f}M"
    return {"figure": f"{_fmt_tps(tps)}, {size} params, loss {losses[0]:.2f}->{losses[-1]:.2f}",
            "tokens_per_s": tps, "params": n_params, "losses": losses,
            "plugin_kwargs": {k: str(v) for k, v in kw.items()}}


def scenario_int8_generate(cpu: bool) -> dict:
    """Train until the next token is certain (a fixed random successor per token), then int8 with
    bf16 activations must generate exactly bf16's tokens (quantization error far below the margin)."""
    import copy

    torch = _torch_setup(cpu)
    from colossal_lab.engine.models import GPT, GPTConfig
    from colossal_lab.engine.quant import model_bytes, quantize

    cuda = torch.cuda.is_available() and not cpu
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:
        cfg, steps, batch, seq, new = GPTConfig.preset("small", n_embd=512, n_head=8), 200, 32, 64, 64
    else:
        cfg, steps, batch, seq, new = GPTConfig.preset("tiny"), 150, 16, 32, 24
    g = torch.Generator().manual_seed(0)
    succ = torch.randperm(cfg.vocab_size, generator=g)

    def chain(starts, n):
        out = [starts]
        for _ in range(n - 1):
            out.append(succ[out[-1]])
        return torch.stack(out, 1)

    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        x = chain(torch.randint(0, cfg.vocab_size, (batch,), generator=g), seq + 1).to(dev)
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    final = float(loss.item())
    if final > 0.5:
        raise AssertionError(f"the model did not learn the successor map (loss {final:.3f}); nothing to compare")
    model.eval()
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    int8 = quantize(copy.deepcopy(model), "int8", dtype=torch.bfloat16)
    prompt = chain(torch.randint(0, cfg.vocab_size, (4,), generator=g), 8).to(dev)
    with torch.no_grad():
        want = bf16.generate(prompt, new, temperature=0)
        _sync(cuda)
        t = time.perf_counter()
        got = int8.generate(prompt, new, temperature=0)
        _sync(cuda)
        seconds = time.perf_counter() - t
    same = (got == want).float().mean().item()
    if not torch.equal(got, want):
        raise AssertionError(f"int8 tokens differ from bf16's: {same:.1%} equal")
    tps = prompt.shape[0] * new / seconds
    ratio = model_bytes(bf16) / model_bytes(int8)
    return {"figure": f"tokens == bf16 ({got.numel() - prompt.numel()}), {_fmt_tps(tps)} int8, "
                      f"bytes bf16/int8 {ratio:.2f}",
            "tokens_per_s": tps, "train_loss": final, "bytes_ratio_bf16_over_int8": ratio}


def readme_snippet() -> str:
    """README's "A first session" ``%%colossal`` cell body, read from README.md at run time."""
    text = (ROOT / "README.md").read_text()
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        lines = block.splitlines()
        if lines and lines[0].strip() == "%%colossal":
            return "\n".join(lines[1:]) + "\n"
    raise LookupError("README.md has no ```python block starting with %%colossal")


def scenario_readme(cpu: bool) -> dict:
    torch = _torch_setup(cpu)
    _init_rank(cpu)
    code = readme_snippet()
    ns: Dict[str, object] = {"__name__": "__main__"}
    t = time.perf_counter()
    exec(compile(code, "README.md (%%colossal cell)", "exec"), ns)
    seconds = time.perf_counter() - t
    loss = ns.get("loss")
    if isinstance(loss, torch.Tensor) and not math.isfinite(float(loss.detach().float())):
        raise AssertionError(f"README snippet: loss is {loss}")
    fig = f"ran {len(code.splitlines())} lines in {seconds:.1f} s"
    if isinstance(loss, torch.Tensor):
        fig += f", loss {float(loss.detach().float()):.3f}"
    return {"figure": fig}


CHILD: Dict[str, Callable[[bool], dict]] = {}
for _p in PLUGINS:
    for _pr in PRECISIONS:
        CHILD[f"fc-{_p}-{_pr}"] = (lambda p, pr: lambda cpu: scenario_first_contact(p, pr, cpu))(_p, _pr)
for _pl in PLACEMENTS:
    CHILD[f"gemini-{_pl}"] = (lambda pl: lambda cpu: scenario_gemini(pl, cpu))(_pl)
CHILD["int8-generate"] = scenario_int8_generate
CHILD["readme-snippet"] = scenario_readme


def run_child(name: str, result_path: str, cpu: bool) -> int:
    try:
        out = CHILD[name](cpu)
        status = "ok"
    except Skip as e:
        out, status = {"figure": f"skipped: {e}"}, "skipped"
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    Path(result_path).write_text(json.dumps({"status": status, **out}, default=str))
    return 0


# ================================================================================================
# The parent: what to run, in which order, with which limits
# ================================================================================================

@dataclass
class Scenario:
    name: str
    timeout: float  # seconds, on a GPU (the --cpu run uses cpu_timeout)
    cpu_timeout: float
    argv: Optional[Callable[[bool], List[str]]] = None  # external command; None = a CHILD scenario
    figure: Optional[Callable[[str], str]] = None  # figure from the command's output
    #: runs beside the others from the start (CPU-bound work that would not fit the budget after
    #: them); its seconds and the others' figures then overlap
    background: bool = False


@dataclass
class Row:
    name: str
    status: str
    figure: str
    seconds: float
    error: str = ""
    detail: dict = field(default_factory=dict)
    command: List[str] = field(default_factory=list)


def _pytest_summary(out: str) -> str:
    summary = r"\b(passed|failed|skipped|error|errors|deselected|collected|no tests ran)\b"
    lines = [l for l in out.strip().splitlines() if re.search(summary, l)]
    if not lines:
        return ""
    return re.sub(r"^=+\s*|\s*=+$", "", lines[-1]).strip()


def _gpu_test_files() -> List[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "mark.gpu" in p.read_text(errors="replace"))


def _cuda_path_files() -> List[str]:
    files = [f"tests/{f}" for f in CUDA_PATH_FILES if (ROOT / "tests" / f).exists()]
    return sorted(set(files) | set(_gpu_test_files()))


def _pytest(*args: str) -> List[str]:
    return [PY, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", *args]


def _last_json(out: str) -> dict:
    for line in reversed(out.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the benchmark's output")


def _fig_kernels(out: str) -> str:
    d = _last_json(out)
    short = {"flash_attention_fwd_bwd": "fa", "rms_norm_fwd_bwd": "rms", "int8_linear_decode_M1": "i8 M1",
             "int8_linear_decode_M8": "i8 M8", "fused_adamw": "adamw"}
    parts = [f"{s} x{d[k]['speed_ratio']}" for k, s in short.items() if k in d]
    return f"{d.get('dispatched_backend', '?')}: " + ", ".join(parts)


def _fig_quant(out: str) -> str:
    d = _last_json(out)
    return (f"bytes fp32/int8 {d['bytes_ratio_fp32_over_int8']}, tok/s int8/bf16 {d['tps_ratio_int8_over_bf16']}, "
            f"ppl int8 {d['ppl_rel_increase_int8_vs_fp32']:+.2%}")


def _fig_engine(out: str) -> str:
    d = _last_json(out)
    return f"ours/plain {d['ratio']} (paired {d['paired_ratio_median']}), {d['precision']}"


#: ``--quick``: what a short GPU loan must answer first (issue: about 5 minutes on one H100, install
#: included): the gpu tests, every plugin in reduced precision, Gemini at 1.4B in every placement,
#: README's cell, int8 generation. The benchmarks and the long CUDA-path files are the full check's.
QUICK = ("pytest-gpu", *(f"fc-{p}-{pr}" for p in PLUGINS for pr in ("bf16", "fp16")),
         *(f"gemini-{pl}" for pl in PLACEMENTS), "readme-snippet", "int8-generate")
QUICK_BUDGET = 270.0  # seconds of scenarios, leaving the install and the machine's start their share of 5 min


def scenarios() -> List[Scenario]:
    s = [
        Scenario("pytest-collect", 90, 120, lambda cpu: _pytest("--collect-only", "tests"), _pytest_summary),
        Scenario("pytest-gpu", 180, 120, lambda cpu: _pytest("-m", "gpu", *_gpu_test_files()), _pytest_summary),
    ]
    for p in PLUGINS:
        for pr in PRECISIONS:
            s.append(Scenario(f"fc-{p}-{pr}", 90, 120))
    for pl in PLACEMENTS:
        s.append(Scenario(f"gemini-{pl}", 180, 120))
    s += [
        Scenario("int8-generate", 120, 150),
        Scenario("readme-snippet", 90, 120),
        Scenario("bench-kernels", 150, 300, lambda cpu: [PY, "bench/kernels.py", "--repeats", "2" if cpu else "7"],
                 _fig_kernels),
        Scenario("bench-quant", 180, 300,
                 lambda cpu: [PY, "bench/quant.py", *(["--steps", "4", "--batch", "4", "--seq", "32",
                                                       "--corpus-bytes", "200000", "--eval-windows", "2",
                                                       "--new-tokens", "4", "--repeats", "1", "--wide-embd", "128"]
                                                      if cpu else ["--steps", "150", "--repeats", "5"])],
                 _fig_quant),
        Scenario("bench-engine", 150, 300,
                 lambda cpu: [PY, "bench/engine.py", *(["--preset", "tiny", "--batch", "4", "--seq", "32",
                                                        "--steps", "2", "--repeats", "2"] if cpu else
                                                       ["--preset", "124m", "--batch", "8", "--seq", "512",
                                                        "--steps", "3", "--repeats", "7", "--precision", "bf16"])],
                 _fig_engine),
        # the gpu tests already ran above; the rest of these files are mostly gloo ranks on the CPU
        # without CUDA these files are the CPU suite's (scripts/test.sh): --cpu only collects them
        Scenario("pytest-cuda-paths", 420, 120,
                 lambda cpu: _pytest(*(["--collect-only"] if cpu else []), "-m", "not gpu", *_cuda_path_files()),
                 _pytest_summary, background=True),
    ]
    return s


def _tail(text: str, n: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def _run(argv: List[str], timeout: float, env: dict) -> tuple:
    """(returncode or None on timeout, combined output). The command gets its own session, and
    the whole session is killed on timeout, so ranks and workers it spawned go too."""
    with tempfile.TemporaryFile(mode="w+") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of a finished run, or the timed-out one
        except (ProcessLookupError, PermissionError):
            pass
        if rc is None:
            proc.wait()
        out.seek(0)
        return rc, out.read()


def run_one(sc: Scenario, cpu: bool, limit: float, env: dict) -> Row:
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        result = Path(tmp) / "result.json"
        if sc.argv is None:
            argv = [PY, str(Path(__file__).resolve()), "--scenario", sc.name, "--result", str(result)]
            argv += ["--cpu"] if cpu else []
        else:
            argv = sc.argv(cpu)
        rc, out = _run(argv, limit, env)
        seconds = time.perf_counter() - t
        shown = [a if a != PY else "python" for a in argv]
        if rc is None:
            return Row(sc.name, "error", f"timed out after {limit:.0f} s", seconds, _tail(out), command=shown)
        if sc.argv is None:
            if rc != 0 or not result.exists():
                return Row(sc.name, "error", _last_error(out), seconds, _tail(out), command=shown)
            detail = json.loads(result.read_text())
            status = detail.pop("status")
            return Row(sc.name, status, str(detail.pop("figure", "")), seconds, detail=detail, command=shown)
    figure = ""
    try:
        figure = sc.figure(out) if sc.figure else ""
    except Exception as e:  # noqa: BLE001 - a figure that cannot be read is part of the error
        figure = f"(no figure: {e})"
        if rc == 0:
            return Row(sc.name, "error", figure, seconds, _tail(out), command=shown)
    if sc.name.startswith("pytest"):
        if rc == 5 or (rc == 0 and "passed" not in figure and "collected" not in figure and "skipped" in figure):
            return Row(sc.name, "skipped", figure or "no tests ran", seconds, command=shown)
    if rc != 0:
        return Row(sc.name, "error", figure or _last_error(out), seconds, _tail(out), command=shown)
    return Row(sc.name, "ok", figure, seconds, command=shown)


def _last_error(out: str) -> str:
    for line in reversed(out.strip().splitlines()):
        line = re.sub(r"^\[rank\d+\]:\s*", "", line.strip())  # torch's per-rank prefix
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b|^[\w.]+Error:", line):
            return line[:200]
    lines = out.strip().splitlines()
    return lines[-1][:200] if lines else "failed without output"


def _environment(env: dict) -> dict:
    code = ("import json, sys, torch\n"
            "c = torch.cuda.is_available()\n"
            "print(json.dumps({'python': sys.version.split()[0], 'torch': torch.__version__,\n"
            "  'torch_cuda': torch.version.cuda, 'cuda_available': c,\n"
            "  'device': torch.cuda.get_device_name(0) if c else 'cpu',\n"
            "  'devices': torch.cuda.device_count() if c else 0}))\n")
    rc, out = _run([PY, "-c", code], 120, env)
    if rc != 0:
        raise SystemExit(f"gpu-check: torch does not import with {PY}:\n{_tail(out)}")
    return _last_json(out)


def table(rows: List[Row]) -> str:
    def cut(s: str, n: int) -> str:
        s = s.replace("\n", " ")
        return s if len(s) <= n else s[:n - 1] + "…"

    data = [("scenario", "status", "figure", "seconds")]
    data += [(r.name, r.status, cut(r.figure, 80), f"{r.seconds:.1f}") for r in rows]
    w = [max(len(d[i]) for d in data) for i in range(4)]
    lines = [" | ".join(d[i].ljust(w[i]) if i < 3 else d[i].rjust(w[i]) for i in range(4)) for d in data]
    lines.insert(1, "-+-".join("-" * x for x in w))
    return "\n".join(lines)


def markdown(rows: List[Row], report: dict) -> str:
    """The run as docs/gpu.md keeps it: when, where, which commit, then one row per scenario."""
    head = (f"### {time.strftime('%Y-%m-%d')} · {report['device']} · torch {report['torch']} "
            f"(CUDA {report['torch_cuda']}) · commit {report['commit']} · {report['mode']}"
            f"{' --quick' if report.get('quick') else ''}\n\n")
    lines = ["| scenario | status | figure | seconds |", "|---|---|---|---:|"]
    for r in rows:
        fig = r.figure.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.name} | {r.status} | {fig} | {r.seconds:.1f} |")
    c = report["counts"]
    return head + "\n".join(lines) + f"\n\n{c['ok']} ok, {c['error']} error, {c['skipped']} skipped in " \
        f"{report['seconds']:.0f} s\n"


def _commit() -> str:
    rc, out = _run(["git", "rev-parse", "--short", "HEAD"], 30, dict(os.environ))
    return out.strip() if rc == 0 and out.strip() else "unknown"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="gpu-check.json", help="where the rows go (default: gpu-check.json)")
    ap.add_argument("--cpu", "--tiny", dest="cpu", action="store_true",
                    help="tiny sizes on gloo with CUDA hidden: proves the runner on a CPU machine")
    ap.add_argument("--only", default="", help="comma-separated scenario names (or prefixes ending in *)")
    ap.add_argument("--list", action="store_true", help="print the scenario names and exit")
    ap.add_argument("--quick", action="store_true",
                    help=f"the short check ({len(QUICK)} scenarios, budget {QUICK_BUDGET:.0f} s): " + ", ".join(QUICK))
    ap.add_argument("--out", default=None,
                    help="a folder for gpu-check.json and gpu-check.md (the markdown table docs/gpu.md keeps)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run (default 570, --quick 270); scenarios left when it is spent "
                         "are skipped")
    ap.add_argument("--timeout", type=float, default=None, help="one time limit for every scenario (seconds)")
    ap.add_argument("--scenario", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.scenario:
        return run_child(args.scenario, args.result, args.cpu)

    todo = scenarios()
    if args.budget is None:
        args.budget = QUICK_BUDGET if args.quick else 570.0
    if args.quick:
        todo = [sc for sc in todo if sc.name in QUICK]
    if args.list:
        print("\n".join(s.name for s in todo))
        return 0
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        names = [s.name for s in todo]
        unknown = [w for w in wanted if not any(n == w or (w.endswith("*") and n.startswith(w[:-1])) for n in names)]
        if unknown:
            ap.error(f"--only: unknown scenario(s) {unknown}; see --list")
        todo = [s for s in todo if any(s.name == w or (w.endswith("*") and s.name.startswith(w[:-1])) for w in wanted)]

    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", "1")
    info = _environment(env)
    if not args.cpu and not info["cuda_available"]:
        print(f"gpu-check: torch {info['torch']} sees no CUDA device (torch.version.cuda={info['torch_cuda']}); "
              "run on a GPU machine with a CUDA build of torch, or pass --cpu for the tiny CPU run", file=sys.stderr)
        return 2
    mode = "cpu" if args.cpu else "gpu"
    print(f"gpu-check ({mode}): torch {info['torch']} (CUDA {info['torch_cuda']}), {info['device']}, "
          f"python {info['python']}; {len(todo)} scenarios, budget {args.budget:.0f} s", flush=True)

    start = time.perf_counter()
    done: Dict[str, Row] = {}

    def report(row: Row) -> None:
        done[row.name] = row
        print(f"  {row.name}: {row.status} ({row.seconds:.1f} s) {row.figure}", flush=True)
        if row.status == "error" and row.error:
            print("    " + "\n    ".join(row.error.splitlines()[-8:]), flush=True)

    def left() -> float:
        return args.budget - (time.perf_counter() - start)

    def limit(sc: Scenario) -> float:
        return min(args.timeout or (sc.cpu_timeout if args.cpu else sc.timeout), left())

    import threading

    beside = [threading.Thread(target=lambda sc=sc: report(run_one(sc, args.cpu, limit(sc), env)), daemon=True)
              for sc in todo if sc.background]
    for t in beside:
        t.start()
    for sc in todo:
        if sc.background:
            continue
        if left() < 5:
            report(Row(sc.name, "skipped", f"skipped: the {args.budget:.0f} s budget is spent", 0.0))
        else:
            report(run_one(sc, args.cpu, limit(sc), env))
    for t in beside:
        t.join()
    rows = [done[sc.name] for sc in todo]

    total = time.perf_counter() - start
    ok = not any(r.status == "error" for r in rows)
    print()
    print(table(rows))
    counts = {s: sum(r.status == s for r in rows) for s in ("ok", "error", "skipped")}
    print(f"\n{counts['ok']} ok, {counts['error']} error, {counts['skipped']} skipped in {total:.0f} s")
    report = {"mode": mode, **info, "commit": _commit(), "quick": args.quick, "seconds": round(total, 1),
              "budget": args.budget, "ok": ok, "counts": counts,
              "scenarios": [{"name": r.name, "status": r.status, "figure": r.figure, "seconds": round(r.seconds, 2),
                             "error": r.error, "detail": r.detail, "command": r.command} for r in rows]}
    json_path = Path(args.out) / "gpu-check.json" if args.out else Path(args.json)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"written: {json_path}")
    if args.out:
        md = Path(args.out) / "gpu-check.md"
        md.write_text(markdown(rows, report))
        print(f"written: {md}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
