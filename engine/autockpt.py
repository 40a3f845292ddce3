"""Activation checkpointing within a memory budget: measure each layer once, then choose by a
dynamic program which layers (or which part of a layer) recompute in backward so that one
training step's peak activation memory stays under the budget with the least recompute time.

    from colossal_lab.engine.autockpt import plan_checkpointing, apply
    plan = plan_checkpointing(model, (idx, targets), budget=512 << 20)
    apply(model, plan)              # model.enable_activation_checkpointing(plan.layers)
    model.checkpoint_plan           # the plan: which layers, predicted peak and recompute seconds

    GPT(GPTConfig(..., activation_checkpointing="auto", activation_budget=512 << 20))
    # the same, planned on the first training forward's batch (again for a new batch shape)

**The budget** is the peak, over one training step (forward, loss, backward), of the bytes
allocated by the step and still live, above what was live when it began: activations, their
gradients and temporaries. The parameters, their ``.grad`` and the optimizer state are the
model's, not the step's (they are live before the step; ``cl.plan`` counts them), and so is the
batch. On CUDA these are ``torch.cuda.memory_allocated`` bytes; on CPU the bytes PyTorch's
allocator hands out (the profiler's allocation events). The caller is taken to hold the model's
output through backward, as ``logits, loss = model(idx, targets); loss.backward()`` does.

**The chain.** The model's layers run one after another: ``u = 0..n-1`` (a Sequential's children,
else the model's ModuleList/ModuleDict of ``num_layers()`` layers, e.g. GPT's ``blocks``), between
a *prefix* (embedding) and a *tail* (final norm, head, loss). Each layer takes one option: ``none``
(keep what it saves), ``layer`` (``torch.utils.checkpoint`` around the whole layer: keep its input,
recompute it in backward) or, for a model listing ``checkpoint_parts()`` (GPT: ``attn``, ``mlp``),
one sub-module checkpointed on its own (keep that sub-module's input, recompute only it).

**What is measured** (:func:`profile_checkpointing`, a few training steps on a sample batch, each
option applied to every layer once: ``K = 2 + len(parts)`` measured steps, layer ``u`` taking
option ``(u + r) % K`` in step ``r``, so no profiling step holds more than about the mean of the
options' memory, and never the whole no-checkpointing peak unless there is only one layer).
Marks are put in the allocator's event stream (or read off the CUDA allocator's counters) when
each layer's forward starts and ends and when the gradient of each layer's output and of the
first layer's input is ready, which cuts the step into intervals. Per layer and option:

* ``keep``      bytes live after the layer's forward minus before it (what stays for backward:
  its output plus what it saved or, checkpointed, nothing more; its input is the previous
  layer's output and was counted there); a layer's forward is taken from the end of the previous
  one's, so what its caller does before calling it (``checkpoint`` saving the RNG state) is its own,
* ``fwd_peak``  the peak within its forward above the bytes live when it began,
* ``bwd_delta`` live bytes after its backward minus before (negative: backward frees),
* ``bwd_peak``  the peak within its backward (recompute included) above the bytes live when it began,
* ``recompute_s`` the time of the recompute itself (the checkpointed module's forward, timed by
  its hooks while it runs inside backward, in a separate unprofiled step; the least of
  ``repeats``): wall seconds after a synchronize on CUDA, CPU seconds of the process
  (``time.process_time``, every intra-op thread) on CPU, which other work on a shared machine
  barely disturbs,
* ``overhead_s`` what the option costs beyond that recompute, one figure per option pooled over
  the layers: the same timed steps read the clock at the marks, so each layer's whole forward
  plus whole backward is timed under each option; the overhead is the median over layers of that
  time, less the same layer's time not checkpointed, less its recompute (the checkpoint wrapper,
  its saved RNG state, the recompute's own autograd graph; a few ms a region on a small GPT on CPU,
  where a whole block recomputes in ~43 ms),
* ``saved``     the bytes autograd saved for the layer, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` with storages deduplicated and parameters and
  buffers left out (reported, with the split into parts, to show where the memory is; the
  solver uses the allocator's figures, which also hold outputs, gradients and temporaries).

The prefix and the tail get the same figures once (the most over the profiling steps).

**What is modelled.** With ``s_u`` the live bytes when layer ``u``'s forward begins (prefix keep
plus ``keep`` of layers ``< u``) and ``K = tail keep + tail backward delta``:

* forward of ``u``:   ``s_u + fwd_peak_u``
* tail:               ``s_n + tail_peak`` and ``s_n + tail_keep + tail_bwd_peak``
* backward of ``u``:  ``s_u + keep_u + bwd_peak_u + K + sum_{v>u} r_v``, where
  ``r_v = keep_v + bwd_delta_v`` is what layer ``v`` leaves behind once its backward is done (its
  input's gradient instead of its output's); that barely depends on the option, and the model
  takes the largest over the options, so ``r`` is a constant of the layer
* prefix backward:    a constant.

Every figure of a layer is assumed to depend on its own option only (the additivity the plan
rests on; the tests and ``bench/activation_checkpoint.py`` check the measured peak of mixed plans
against the budget). The predicted recompute time of a plan is the sum over its checkpointed
layers of ``recompute_s + overhead_s`` (``OptionCost.cost_s``); what checkpointing adds to the
forward is in the overhead.

**The solver** (:func:`solve`). Every constraint is ``s_u + c_u(option) <= budget``, so the prefix
sum ``s`` is the whole state: a dynamic program over the chain (as Checkmate and rotor do for
memory-constrained recomputation) keeps, after each layer, the Pareto front of (``s``, recompute
seconds so far) among partial plans whose constraints held (a state with more bytes kept and no
less time is dropped, since every later constraint only gets harder with ``s``). The answer is
exact for the model above, and equal to trying every combination (the tests check it against
brute force). Were a front ever to exceed ``MAX_STATES`` states (long chains of unequal layers),
``s`` is rounded up to a grid, which only overestimates memory. The same program with "max" in
place of "+" gives the lowest peak any plan reaches (:func:`min_peak`), named in the error when a
budget is below it.

**Telemetry.** :func:`solve` (so :func:`plan_checkpointing` and everything planning through it) and
:func:`apply` put the plan on this process's telemetry bus as a ``CheckpointPlanEvent`` (rank from
``torch.distributed``, stage from the module's ``stage_index`` where it has one, per layer the option,
kept bytes and recompute seconds); nothing is built while nobody listens. ``solve(..., report=False)``
solves without reporting. ``colossal_lab.widgets.CheckpointPlanView`` draws it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from .telemetry.units import format_bytes

__all__ = ["CheckpointPlan", "CheckpointProfile", "OptionCost", "apply", "min_peak", "plan_checkpointing",
           "plan_event", "profile_checkpointing", "solve"]

NONE, LAYER = "none", "layer"
MAX_STATES = 20000
_MARK = 5_000_011  # odd byte counts no tensor of a step has: marks in the CPU allocator's event stream

Entry = Union[int, str]


_fmt = format_bytes


# ---------------------------------------------------------------------------------------------
# the profile
# ---------------------------------------------------------------------------------------------
@dataclass
class OptionCost:
    """One layer under one option (bytes; seconds). See the module docstring for each figure."""

    keep: int
    fwd_peak: int
    bwd_delta: int
    bwd_peak: int
    recompute_s: float
    saved: int
    overhead_s: float = 0.0          # the option's per-layer cost beyond the recompute (pooled over layers)

    @property
    def cost_s(self) -> float:
        """Seconds a step spends on this option beyond the layer not checkpointed: the recompute
        plus the option's overhead (never below zero)."""
        return max(0.0, self.recompute_s + self.overhead_s)


@dataclass
class UnitProfile:
    name: str
    index: int                       # what ``enable_activation_checkpointing(layers=...)`` calls it
    options: Dict[str, OptionCost]
    forward_s: float                 # its forward, not checkpointed
    saved: int                       # bytes autograd saves for it, not checkpointed
    parts: Dict[str, Tuple[int, float]] = field(default_factory=dict)  # part -> (saved bytes, forward s)

    def entry(self, option: str) -> Optional[Entry]:
        if option == NONE:
            return None
        return self.index if option == LAYER else f"{self.index}.{option}"


@dataclass
class CheckpointProfile:
    """What :func:`profile_checkpointing` measured; :func:`solve` turns it into a plan per budget."""

    units: List[UnitProfile]
    parts: Tuple[str, ...]
    prefix_keep: int
    prefix_peak: int
    prefix_bwd_peak: int
    tail_keep: int
    tail_peak: int
    tail_bwd_delta: int
    tail_bwd_peak: int
    device: str
    inputs: str
    profile_s: float = 0.0
    stage: int = 0                   # the model's pipeline stage, where it says (telemetry reports it)

    @property
    def options(self) -> Tuple[str, ...]:
        return (NONE, LAYER) + self.parts

    def _terms(self):
        n = len(self.units)
        r = [max(c.keep + c.bwd_delta for c in u.options.values()) for u in self.units]
        after = [0] * (n + 1)  # after[u] = sum of r_v for v >= u
        for u in range(n - 1, -1, -1):
            after[u] = after[u + 1] + r[u]
        k = self.tail_keep + self.tail_bwd_delta
        return k, after

    def unit_need(self, u: int, option: str, k: int, after: List[int]) -> int:
        """Bytes above ``s_u`` that layer ``u`` needs at its forward's and its backward's peaks."""
        c = self.units[u].options[option]
        return max(c.fwd_peak, c.keep + c.bwd_peak + k + after[u + 1])

    def fixed_peaks(self, k: int, after: List[int]) -> int:
        return max(self.prefix_peak, self.prefix_keep + k + after[0] + self.prefix_bwd_peak)

    def tail_need(self) -> int:
        return max(self.tail_peak, self.tail_keep + self.tail_bwd_peak)

    def predict(self, choice: Sequence[str]) -> Tuple[int, float]:
        """(predicted peak bytes, predicted recompute seconds) of one option per layer."""
        if len(choice) != len(self.units):
            raise ValueError(f"predict: {len(choice)} options for {len(self.units)} layers")
        k, after = self._terms()
        s, peak, t = self.prefix_keep, self.fixed_peaks(k, after), 0.0
        for u, o in enumerate(choice):
            peak = max(peak, s + self.unit_need(u, o, k, after))
            s += self.units[u].options[o].keep
            t += self.units[u].options[o].cost_s
        return max(peak, s + self.tail_need()), t

    @property
    def forward_s(self) -> float:
        return sum(u.forward_s for u in self.units)

    def table(self) -> str:
        opts = self.options
        head = f"{'layer':<14}{'saved':>11}{'fwd ms':>8}  " + "  ".join(f"{o + ' keep/rec ms':>22}" for o in opts)
        lines = [f"CheckpointProfile on {self.device}, inputs {self.inputs} (profiled in {self.profile_s:.2f} s)",
                 f"  prefix keeps {_fmt(self.prefix_keep)} (peak {_fmt(self.prefix_peak)}), tail keeps "
                 f"{_fmt(self.tail_keep)} (peak {_fmt(self.tail_peak)}, backward peak {_fmt(self.tail_bwd_peak)})",
                 "  " + head]
        if self.units:
            u0 = self.units[0].options
            lines.append("  overhead a region beyond its recompute (ms): "
                         + ", ".join(f"{o} {u0[o].overhead_s * 1e3:.1f}" for o in opts[1:]))
        for u in self.units:
            cells = [f"{_fmt(u.options[o].keep) + ' / ' + format(u.options[o].recompute_s * 1e3, '.1f'):>22}"
                     for o in opts]
            lines.append(f"  {u.name:<14}{_fmt(u.saved):>11}{u.forward_s * 1e3:>8.1f}  " + "  ".join(cells))
            for p, (b, s) in u.parts.items():
                lines.append(f"    {'.' + p:<12}{_fmt(b):>11}{s * 1e3:>8.1f}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.table()


# ---------------------------------------------------------------------------------------------
# finding the layers and switching their checkpointing
# ---------------------------------------------------------------------------------------------
def _unwrap(m: nn.Module) -> nn.Module:
    return getattr(m, "_checkpoint_wrapped_module", m)


def _find_layers(model: nn.Module) -> List[Tuple[int, str, nn.Module]]:
    """(index, name, module) of the chain's layers, in order."""
    if isinstance(model, nn.Sequential):
        return [(i, str(i), _unwrap(m)) for i, m in enumerate(model)]
    want = model.num_layers() if callable(getattr(model, "num_layers", None)) else None
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m)]
    if not found:
        raise ValueError(f"plan_checkpointing: {type(model).__name__} has no layers to checkpoint: it is not an "
                         "nn.Sequential and holds no nn.ModuleList/ModuleDict of layers")
    exact = [f for f in found if len(f[1]) == want]
    name, holder = (exact or sorted(found, key=lambda f: -len(f[1])))[0]
    items = holder.items() if isinstance(holder, nn.ModuleDict) else enumerate(holder)
    out = []
    for pos, (key, m) in enumerate(items):
        index = int(key) if isinstance(key, int) or str(key).isdigit() else pos
        out.append((index, f"{name}.{key}", _unwrap(m)))
    return out


def _parts_of(model: nn.Module, layers) -> Tuple[str, ...]:
    fn = getattr(model, "checkpoint_parts", None)
    if not callable(fn):
        return ()
    parts = tuple(fn())
    for _, name, m in layers:
        for p in parts:
            try:
                m.get_submodule(p)
            except AttributeError:
                raise ValueError(f"plan_checkpointing: {type(model).__name__}.checkpoint_parts() lists {p!r}, but "
                                 f"layer {name} has no sub-module {p!r}") from None
    return parts


def _setter(model: nn.Module) -> Callable[[List[Entry]], None]:
    """A function applying ``layers`` (entries as for ``enable_activation_checkpointing``)."""
    own = getattr(model, "enable_activation_checkpointing", None)
    if callable(own):
        import inspect

        try:
            params = inspect.signature(own).parameters
        except (TypeError, ValueError):
            params = {}
        if "layers" not in params:
            raise ValueError(
                f"plan_checkpointing: {type(model).__name__}.enable_activation_checkpointing() takes no `layers`; "
                "extend it as the model contract says (engine/models/protocol.py): "
                "enable_activation_checkpointing(layers=None), None = every layer, else the listed layer indices")
        return lambda entries: own(layers=list(entries))
    if isinstance(model, nn.Sequential):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        def set_seq(entries):
            bad = [e for e in entries if not isinstance(e, int) or isinstance(e, bool) or not 0 <= e < len(model)]
            if bad:
                raise ValueError(f"apply: layers {bad} are not indices of this Sequential's {len(model)} children")
            for i in range(len(model)):
                inner = _unwrap(model[i])
                model[i] = checkpoint_wrapper(inner) if i in entries else inner
        return set_seq
    raise ValueError(f"plan_checkpointing: {type(model).__name__} has no enable_activation_checkpointing(layers=...) "
                     "(the model contract) and is not an nn.Sequential; implement it or wrap the layers in nn.Sequential")


# ---------------------------------------------------------------------------------------------
# measuring: marks in the allocator's stream, hooks on the layers
# ---------------------------------------------------------------------------------------------
class _Meter:
    """Live bytes at each mark and the peak between consecutive marks."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.labels: List[Any] = []
        self.live: List[int] = []
        self.peak_after: List[int] = []

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def mark(self, label) -> None:
        if self.cuda:
            live = torch.cuda.memory_allocated()
            if self.labels:
                self.peak_after.append(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            self.live.append(live)
        else:
            torch.empty(_MARK + len(self.labels) + 1, dtype=torch.uint8)  # freed at once: a mark
        self.labels.append(label)

    def __exit__(self, *exc):
        if self.cuda:
            self.peak_after.append(torch.cuda.max_memory_allocated())
            return False
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self._replay()
        return False

    def _replay(self) -> None:
        from .telemetry.alloc_replay import cpu_allocations, replay

        marks = len(self.labels)
        r = replay(cpu_allocations(self._prof), _MARK, marks, live="running")
        self.live += r.live
        self.peak_after += r.peak_after
        if len(self.live) != marks:
            raise RuntimeError(f"autockpt: {len(self.live)} of {marks} marks found in the profiler's allocation events")

    def span(self, a, b) -> Tuple[int, int, int]:
        """(live at mark a, peak from a to b, live at mark b)."""
        i, j = self.labels.index(a), self.labels.index(b)
        return self.live[i], max(self.peak_after[i:j]), self.live[j]


def _first_tensor(obj) -> Optional[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        for o in obj:
            t = _first_tensor(o)
            if t is not None:
                return t
    if isinstance(obj, Mapping):
        for o in obj.values():
            t = _first_tensor(o)
            if t is not None:
                return t
    return None


def _default_loss(out, inputs):
    """A model's own loss (a 0-d tensor it returns, as GPT's ``(logits, loss)``), else the sum of
    its first output."""
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor) and o.dim() == 0 and o.requires_grad:
                return o
    t = _first_tensor(out)
    if t is None or not t.requires_grad:
        raise ValueError("plan_checkpointing: the model's output holds no tensor that needs a gradient; "
                         "pass loss_fn=(output, inputs) -> loss")
    return t.float().sum()


class _Probe:
    """Hooks on every layer (and part): marks, recompute timing and saved-tensor attribution."""

    def __init__(self, layers, parts: Tuple[str, ...], device: torch.device):
        self.layers, self.parts, self.device = layers, parts, device
        self.meter: Optional[_Meter] = None
        self.phase = "fwd"
        self.handles = []
        self.stack: List[Tuple[int, Optional[str]]] = []
        self.t0: Dict[tuple, float] = {}
        self.spans: Dict[tuple, float] = {}
        self.times: Dict[tuple, float] = {}  # label -> clock at the mark (timed steps, no meter)
        self.saved: Dict[Tuple[int, Optional[str]], Dict[int, int]] = {}
        self.skip_ptrs: set = set()
        self.tensor_hooks: List[Any] = []
        for u, (_, _, m) in enumerate(layers):
            self._hook(m, u, None)
            for p in parts:
                self._hook(m.get_submodule(p), u, p)

    def _now(self) -> float:
        if self.device.type == "cuda":
            if self.meter is None:
                torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()  # CPU seconds of this process's threads: a busy machine barely moves them

    def _hook(self, m: nn.Module, u: int, part: Optional[str]) -> None:
        def pre(mod, args):
            key = (self.phase, u, part)
            if self.phase == "fwd":
                if part is None:
                    self.mark(("pre", u))
                    t = _first_tensor(args)
                    if u == 0 and t is not None and t.requires_grad:  # may be the caller's leaf: removed after
                        self.tensor_hooks.append(t.register_hook(lambda g: self.mark(("bin",))))
                self.stack.append((u, part))
            self.t0[key] = self._now()

        def post(mod, args, out):
            key = (self.phase, u, part)
            if key in self.t0:
                self.spans[key] = self.spans.get(key, 0.0) + self._now() - self.t0.pop(key)
            if self.phase == "fwd":
                if self.stack and self.stack[-1] == (u, part):
                    self.stack.pop()
                if part is None:
                    self.mark(("post", u))
                    t = _first_tensor(out)
                    if t is None or not t.requires_grad:
                        raise ValueError(f"plan_checkpointing: layer {self.layers[u][1]}'s output does not need a "
                                         "gradient, so its backward cannot be found; checkpointing it saves nothing")
                    t.register_hook(lambda g: self.mark(("b", u)))

        self.handles.append(m.register_forward_pre_hook(pre))
        self.handles.append(m.register_forward_hook(post, always_call=True))

    def mark(self, label) -> None:
        if self.meter is None:
            self.times[label] = self._now()
        else:
            if label in self.meter.labels:
                raise ValueError(f"plan_checkpointing: {label} seen twice in one step: a layer ran twice "
                                 "(shared layers are not a chain)")
            self.meter.mark(label)

    def layer_seconds(self, n: int) -> List[float]:
        """Per layer, the clock from the end of the previous layer's forward to the end of its own
        plus from its output's gradient to its input's (its whole backward, recompute included);
        read off the last timed step's marks."""
        t = self.times
        out = []
        for u in range(n):
            fwd = t[("post", u)] - t[("post", u - 1) if u else ("pre", 0)]
            nxt = ("b", u - 1) if u > 0 else (("bin",) if ("bin",) in t else ("END",))
            out.append(fwd + t[nxt] - t[("b", u)])
        return out

    def begin(self, meter: Optional[_Meter]) -> None:
        self.meter, self.phase = meter, "fwd"
        self.stack, self.t0, self.spans, self.saved, self.times = [], {}, {}, {}, {}
        self.tensor_hooks = []
        self.mark(("S",))

    def end(self) -> None:
        for h in self.tensor_hooks:
            h.remove()
        self.tensor_hooks, self.phase = [], "fwd"

    @contextlib.contextmanager
    def saved_hooks(self):
        def pack(t):
            if self.phase == "fwd" and self.stack:
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr and ptr not in self.skip_ptrs:
                    u, part = self.stack[-1]
                    self.saved.setdefault((u, None), {})[ptr] = st.nbytes()
                    if part is not None:
                        self.saved.setdefault((u, part), {})[ptr] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def saved_bytes(self, u: int, part: Optional[str] = None) -> int:
        return sum(self.saved.get((u, part), {}).values())

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _as_args(sample_inputs) -> Tuple[tuple, dict]:
    if isinstance(sample_inputs, Mapping):
        return (), dict(sample_inputs)
    if isinstance(sample_inputs, (tuple, list)):
        return tuple(sample_inputs), {}
    return (sample_inputs,), {}


def _describe(args, kwargs) -> str:
    def one(x):
        return f"{tuple(x.shape)} {str(x.dtype).replace('torch.', '')}" if isinstance(x, torch.Tensor) else repr(x)
    return ", ".join([one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()])


def _alias(x):
    return x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.requires_grad else x


def _step(model, args, kwargs, loss_fn, probe: _Probe, meter: Optional[_Meter]) -> None:
    """One forward + backward on detached aliases of the parameters (their grads preallocated, as a
    model's are after its first step) and of the inputs: nothing reaches a real ``.grad`` or any
    gradient hook."""
    from torch.func import functional_call

    aliases = {}
    for name, p in model.named_parameters():
        a = p.detach().requires_grad_(p.requires_grad)
        if a.requires_grad:
            a.grad = torch.zeros_like(a)
        aliases[name] = a
    probe.skip_ptrs = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
    probe.skip_ptrs |= {a.grad.untyped_storage().data_ptr() for a in aliases.values() if a.grad is not None}
    # inputs that need a gradient (a pipeline stage's received activations) get aliases too
    args = tuple(_alias(a) for a in args)
    kwargs = {k: _alias(v) for k, v in kwargs.items()}
    ctx = meter if meter is not None else contextlib.nullcontext()
    try:
        with ctx:
            probe.begin(meter)
            with probe.saved_hooks() if meter is not None else contextlib.nullcontext():
                out = functional_call(model, aliases, args, kwargs)
                loss = loss_fn(out, args if args else kwargs)
            probe.mark(("F",))
            probe.phase = "bwd"
            loss.backward()
            probe.mark(("END",))
            del out, loss
    finally:
        probe.end()


def profile_checkpointing(model: nn.Module, sample_inputs, loss_fn: Optional[Callable] = None, *,
                          repeats: int = 1) -> CheckpointProfile:
    """Measure every layer under every option on ``sample_inputs`` (``model(*sample_inputs)``; a dict
    is passed as keyword arguments). ``loss_fn(output, inputs) -> loss``: by default the model's own
    0-d loss if it returns one (GPT's ``(logits, loss)``), else the sum of its first output.
    ``repeats`` timed steps per option (the fastest counts). The model must be in training mode as
    it will train; its parameters and ``.grad`` are not touched, its RNG state is restored, and it is
    left with checkpointing off: apply a plan after (:func:`apply`)."""
    if repeats < 1:
        raise ValueError(f"profile_checkpointing: repeats={repeats} must be >= 1")
    if not model.training:
        raise ValueError(f"profile_checkpointing: {type(model).__name__} is in eval mode, where nothing is "
                         "recomputed; call model.train() first")
    layers = _find_layers(model)
    parts = _parts_of(model, layers)
    setter = _setter(model)
    args, kwargs = _as_args(sample_inputs)
    loss_fn = loss_fn or _default_loss
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    device = first.device if first is not None else torch.device("cpu")
    options = (NONE, LAYER) + parts
    n, K = len(layers), len(options)

    def assign(r: int) -> List[str]:
        return [options[(u + r) % K] for u in range(n)]

    def entries(choice: List[str]) -> List[Entry]:
        out = []
        for u, o in enumerate(choice):
            if o != NONE:
                out.append(layers[u][0] if o == LAYER else f"{layers[u][0]}.{o}")
        return out

    got: Dict[Tuple[int, str], dict] = {}
    fixed: Dict[str, int] = {}
    fwd_time: Dict[Tuple[int, Optional[str]], float] = {}
    saved_none: Dict[Tuple[int, Optional[str]], int] = {}
    whole: Dict[Tuple[int, str], float] = {}  # (layer, option) -> its forward + backward seconds
    t_start = time.perf_counter()
    probe = _Probe(layers, parts, device)
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=rng_devices):
            setter(entries([LAYER] * n))
            _step(model, args, kwargs, loss_fn, probe, None)  # warm-up (allocator, kernels, lazy state)
            for r in range(K):
                choice = assign(r)
                setter(entries(choice))
                meter = _Meter(device)
                _step(model, args, kwargs, loss_fn, probe, meter)
                _collect(meter, probe, choice, n, got, fixed)
                for _ in range(repeats):
                    _step(model, args, kwargs, loss_fn, probe, None)
                    for u, sec in enumerate(probe.layer_seconds(n)):
                        whole[(u, choice[u])] = min(whole.get((u, choice[u]), math.inf), sec)
                    for u, o in enumerate(choice):
                        if o == NONE:
                            for p in (None,) + parts:
                                s = probe.spans.get(("fwd", u, p), 0.0)
                                fwd_time[(u, p)] = min(fwd_time.get((u, p), math.inf), s)
                            continue
                        key = ("bwd", u, None if o == LAYER else o)
                        if key not in probe.spans:
                            raise ValueError(
                                f"plan_checkpointing: enable_activation_checkpointing(layers={entries(choice)}) did not "
                                f"recompute layer {layers[u][1]}{'' if o == LAYER else '.' + o} in backward")
                        got[(u, o)]["recompute_s"] = min(got[(u, o)].get("recompute_s", math.inf), probe.spans[key])
                # saved bytes of a layer that keeps everything (this profiling step's saved hooks)
                for u, o in enumerate(choice):
                    if o == NONE:
                        for p in (None,) + parts:
                            saved_none[(u, p)] = got[(u, o)]["saved_parts"].get(p, 0)
    finally:
        probe.close()
        setter([])
    # an option's overhead: what a layer's whole forward + backward takes under it, beyond the same
    # layer not checkpointed and beyond the recompute its hooks timed (the checkpoint's wrapper, its
    # saved RNG state, the recompute's own autograd graph), pooled over the layers by the median
    overhead = {NONE: 0.0}
    for o in options[1:]:
        overhead[o] = statistics.median(whole[(u, o)] - whole[(u, NONE)] - got[(u, o)]["recompute_s"]
                                        for u in range(n))
    units = []
    for u, (index, name, _) in enumerate(layers):
        opts = {}
        for o in options:
            g = got[(u, o)]
            opts[o] = OptionCost(keep=g["keep"], fwd_peak=g["fwd_peak"], bwd_delta=g["bwd_delta"],
                                 bwd_peak=g["bwd_peak"], recompute_s=0.0 if o == NONE else g["recompute_s"],
                                 saved=g["saved_parts"].get(None, 0), overhead_s=overhead[o])
        units.append(UnitProfile(name=name, index=index, options=opts, forward_s=fwd_time.get((u, None), 0.0),
                                 saved=saved_none.get((u, None), 0),
                                 parts={p: (saved_none.get((u, p), 0), fwd_time.get((u, p), 0.0)) for p in parts}))
    return CheckpointProfile(units=units, parts=parts, device=str(device), inputs=_describe(args, kwargs),
                             profile_s=time.perf_counter() - t_start, stage=_stage_of(model), **fixed)


def _collect(meter: _Meter, probe: _Probe, choice: List[str], n: int, got: dict, fixed: Dict[str, int]) -> None:
    labels = set(meter.labels)
    for u in range(n):
        for want in (("pre", u), ("post", u), ("b", u)):
            if want not in labels:
                raise ValueError(f"plan_checkpointing: layer {probe.layers[u][1]} did not run in the step "
                                 f"(no {want[0]} mark); every layer of the chain must run once per forward")
    order = [lab for lab in meter.labels if lab[0] == "pre"]
    if order != [("pre", u) for u in range(n)]:
        raise ValueError("plan_checkpointing: the layers ran out of order; they must form a chain in "
                         "their ModuleList/ModuleDict order")

    def most(key, value):
        fixed[key] = max(fixed.get(key, value), value)

    a, pk, b = meter.span(("S",), ("pre", 0))
    most("prefix_keep", b - a)
    most("prefix_peak", pk - a)
    for u in range(n):
        # layer u's forward runs from the end of layer u-1's: what its caller does first (a
        # checkpoint's saved RNG state, say) is its own
        a, pk, b = meter.span(("post", u - 1) if u else ("pre", 0), ("post", u))
        nxt = ("b", u - 1) if u > 0 else (("bin",) if ("bin",) in labels else ("END",))
        ba, bpk, bb = meter.span(("b", u), nxt)
        parts = {p: probe.saved_bytes(u, p) for p in (None,) + probe.parts}
        got[(u, choice[u])] = dict(keep=b - a, fwd_peak=pk - a, bwd_delta=bb - ba, bwd_peak=bpk - ba,
                                   saved_parts=parts)
    a, pk, b = meter.span(("post", n - 1), ("F",))
    most("tail_keep", b - a)
    most("tail_peak", pk - a)
    a, pk, b = meter.span(("F",), ("b", n - 1))
    most("tail_bwd_delta", b - a)
    most("tail_bwd_peak", pk - a)
    if ("bin",) in labels:
        a, pk, _ = meter.span(("bin",), ("END",))
        most("prefix_bwd_peak", pk - a)
    else:
        most("prefix_bwd_peak", 0)


# ---------------------------------------------------------------------------------------------
# the plan and the solver
# ---------------------------------------------------------------------------------------------
@dataclass
class CheckpointPlan:
    """Which layers recompute, and what the profile predicts for a step under it."""

    budget: int
    choice: Tuple[str, ...]          # per layer: "none", "layer" or a part ("attn", "mlp")
    layers: List[Entry]              # for enable_activation_checkpointing(layers=...)
    predicted_peak: int
    predicted_recompute_s: float
    peak_none: int                   # predicted peak with no checkpointing
    peak_min: int                    # the lowest peak any plan reaches
    forward_s: float                 # the measured forward of the layers, for scale
    names: Tuple[str, ...]
    profile: Optional[CheckpointProfile] = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        return {"budget": self.budget, "layers": list(self.layers), "choice": dict(zip(self.names, self.choice)),
                "predicted_peak": self.predicted_peak, "predicted_recompute_s": self.predicted_recompute_s,
                "peak_none": self.peak_none, "peak_min": self.peak_min, "forward_s": self.forward_s}

    def __repr__(self) -> str:
        n_ck = sum(o != NONE for o in self.choice)
        lines = [f"CheckpointPlan: {n_ck}/{len(self.choice)} layers recompute; predicted peak "
                 f"{_fmt(self.predicted_peak)} within budget {_fmt(self.budget)}; recompute "
                 f"{self.predicted_recompute_s * 1e3:.1f} ms/step (layers' forward {self.forward_s * 1e3:.1f} ms)",
                 f"  no checkpointing: {_fmt(self.peak_none)}; lowest any plan reaches: {_fmt(self.peak_min)}",
                 f"  layers={self.layers}"]
        if self.profile is not None:
            lines.append(f"  {'layer':<14}{'recomputes':<12}{'keeps':>11}{'recompute ms':>14}")
            for u, o in zip(self.profile.units, self.choice):
                c = u.options[o]
                lines.append(f"  {u.name:<14}{'-' if o == NONE else o:<12}{_fmt(c.keep):>11}{c.cost_s * 1e3:>14.2f}")
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle) -> None:  # IPython
        p.text(repr(self))


def _frontier_dp(prof: CheckpointProfile, budget: float, objective: str):
    """The dynamic program of the module docstring. ``objective`` "recompute": least recompute
    seconds with every peak <= budget; "peak": least peak (budget ignored). Returns (value, choice)
    or None when nothing fits."""
    k, after = prof._terms()
    n = len(prof.units)
    opts = prof.options
    fixed = prof.fixed_peaks(k, after)
    if objective == "recompute" and fixed > budget:
        return None
    states: Dict[int, float] = {prof.prefix_keep: 0.0 if objective == "recompute" else float(fixed)}
    back: List[Dict[int, Tuple[int, str]]] = []
    for u in range(n):
        new: Dict[int, float] = {}
        ptr: Dict[int, Tuple[int, str]] = {}
        for s, val in states.items():
            for o in opts:
                c = prof.units[u].options[o]
                need = s + prof.unit_need(u, o, k, after)
                if objective == "recompute":
                    if need > budget:
                        continue
                    v = val + c.cost_s
                else:
                    v = max(val, float(need))
                s2 = s + c.keep
                if s2 not in new or v < new[s2]:
                    new[s2], ptr[s2] = v, (s, o)
        # the Pareto front: a state keeping more bytes and no less value can never do better
        front, best = {}, math.inf
        for s2 in sorted(new):
            if new[s2] < best:
                best = new[s2]
                front[s2] = new[s2]
        if len(front) > MAX_STATES:  # coarsen: round kept bytes up to a grid (overestimates memory)
            lo, hi = min(front), max(front)
            q = max(1, -(-(hi - lo) // MAX_STATES))
            coarse: Dict[int, float] = {}
            cptr: Dict[int, Tuple[int, str]] = {}
            for s2, v in front.items():
                c2 = lo + -(-(s2 - lo) // q) * q
                if c2 not in coarse or v < coarse[c2]:
                    coarse[c2], cptr[c2] = v, ptr[s2]
            front, ptr = coarse, cptr
        states = front
        back.append({s2: ptr[s2] for s2 in states})
        if not states:
            return None
    tail = prof.tail_need()
    best_s, best_v = None, math.inf
    for s, v in sorted(states.items()):
        v2 = v if objective == "recompute" else max(v, float(s + tail))
        if objective == "recompute" and s + tail > budget:
            continue
        if v2 < best_v:
            best_s, best_v = s, v2
    if best_s is None:
        return None
    choice, s = [], best_s
    for u in range(n - 1, -1, -1):
        s_prev, o = back[u][s]
        choice.append(o)
        s = s_prev
    return best_v, tuple(reversed(choice))


def min_peak(profile: CheckpointProfile) -> Tuple[int, Tuple[str, ...]]:
    """The lowest peak any plan reaches, and that plan's options."""
    v, choice = _frontier_dp(profile, math.inf, "peak")
    return profile.predict(choice)[0], choice


def solve(profile: CheckpointProfile, budget: int, *, report: bool = True) -> CheckpointPlan:
    """The plan with the least predicted recompute time whose predicted peak is <= ``budget`` bytes.

    With ``report`` (the default) the plan goes on this process's telemetry bus as a
    ``CheckpointPlanEvent`` (nothing is built when nobody listens): every route to a plan in use
    (``plan_checkpointing``, GPT's ``"auto"``, a plugin's agreed plan) ends here. A caller that
    solves what-ifs (a planner's search, a table over budgets) passes ``report=False``."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0 or math.isinf(budget):
        raise ValueError(f"solve: budget={budget!r} must be a number of bytes > 0 (the peak activation memory of "
                         "a training step), e.g. budget=512 << 20")
    budget = int(budget)
    lowest, lowest_choice = min_peak(profile)
    res = _frontier_dp(profile, budget, "recompute")
    if res is None:
        raise ValueError(
            f"plan_checkpointing: budget={budget} bytes ({_fmt(budget)}) is below the lowest peak activation memory "
            f"any checkpointing plan reaches on inputs {profile.inputs}: {lowest} bytes ({_fmt(lowest)}, recomputing "
            f"{sum(o != NONE for o in lowest_choice)} of {len(lowest_choice)} layers). Raise the budget to at least that, "
            "or make the step smaller (batch size, sequence length)")
    _, choice = res
    peak, t = profile.predict(choice)
    entries = [e for u, o in zip(profile.units, choice) if (e := u.entry(o)) is not None]
    plan = CheckpointPlan(budget=budget, choice=choice, layers=entries, predicted_peak=peak, predicted_recompute_s=t,
                          peak_none=profile.predict([NONE] * len(profile.units))[0], peak_min=lowest,
                          forward_s=profile.forward_s, names=tuple(u.name for u in profile.units), profile=profile)
    if report:
        _emit(plan, profile.stage)
    return plan


def plan_checkpointing(model: nn.Module, sample_inputs, budget: int, loss_fn: Optional[Callable] = None, *,
                       repeats: int = 1) -> CheckpointPlan:
    """Profile ``model`` on ``sample_inputs`` (:func:`profile_checkpointing`) and :func:`solve` for
    ``budget`` bytes. The model is left with checkpointing off; :func:`apply` the plan."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise ValueError(f"plan_checkpointing: budget={budget!r} must be a number of bytes > 0 (the peak activation "
                         "memory of a training step), e.g. budget=512 << 20")
    return solve(profile_checkpointing(model, sample_inputs, loss_fn, repeats=repeats), budget)  # reports it


def apply(model: nn.Module, plan: CheckpointPlan) -> nn.Module:
    """Switch ``plan``'s layers to recompute (``model.enable_activation_checkpointing(layers=plan.layers)``,
    or ``checkpoint_wrapper`` on a Sequential's children) and keep the plan as ``model.checkpoint_plan``."""
    if not isinstance(plan, CheckpointPlan):
        raise TypeError(f"apply(model, plan): plan is a {type(plan).__name__}, not a CheckpointPlan "
                        "(plan_checkpointing's result)")
    _setter(model)(plan.layers)
    model.checkpoint_plan = plan
    _emit(plan, _stage_of(model, plan.profile.stage if plan.profile is not None else 0))
    return model


# ---------------------------------------------------------------------------------------------
# telemetry
# ---------------------------------------------------------------------------------------------
def _stage_of(model: nn.Module, default: int = 0) -> int:
    """The model's pipeline stage where it says (an int ``stage_index``, as torch's
    ``PipelineStage`` names it, or ``pipeline_stage_index``), else ``default``."""
    for name in ("stage_index", "pipeline_stage_index"):
        v = getattr(model, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v
    return default


def plan_event(plan: CheckpointPlan, rank: int = 0, stage: int = 0):  # -> telemetry CheckpointPlanEvent
    """``plan`` as a telemetry ``CheckpointPlanEvent`` (per layer: option, bytes kept and predicted
    recompute seconds under it, overhead included (``OptionCost.cost_s``, so they sum to the plan's
    ``predicted_recompute_s``), from the plan's profile; without a profile those two are left empty)."""
    from .telemetry.events import CheckpointPlanEvent

    prof = plan.profile
    units = prof.units if prof is not None and len(prof.units) == len(plan.choice) else None
    return CheckpointPlanEvent(
        rank=int(rank), stage=int(stage), time=time.time(), budget=int(plan.budget),
        predicted_peak=int(plan.predicted_peak), predicted_recompute_s=float(plan.predicted_recompute_s),
        peak_none=int(plan.peak_none), peak_min=int(plan.peak_min), layers=tuple(str(e) for e in plan.layers),
        names=tuple(plan.names), options=tuple(plan.choice),
        keep=tuple(int(u.options[o].keep) for u, o in zip(units, plan.choice)) if units else (),
        recompute_s=tuple(float(u.options[o].cost_s) for u, o in zip(units, plan.choice)) if units else (),
        prefix_keep=int(prof.prefix_keep) if prof is not None else 0, forward_s=float(plan.forward_s),
        device=prof.device if prof is not None else "cpu")


def _emit(plan: CheckpointPlan, stage: int) -> None:
    """Put the plan on this process's telemetry bus (rank: this process's in the default group,
    else 0); one list check when nobody listens."""
    from .telemetry import bus

    if not bus.has_subscribers():
        return
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    bus.emit(plan_event(plan, rank, stage))
