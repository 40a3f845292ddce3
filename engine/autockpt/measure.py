"""Measuring a step layer by layer: marks in the allocator's event stream (CPU) or its counters
(CUDA), hooks on the layers, each option applied to every layer once (:func:`profile_checkpointing`)."""
from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn as nn

from .chain import _find_layers, _parts_of, _setter
from .events import _stage_of
from .profile import _MARK, LAYER, NONE, CheckpointProfile, Entry, OptionCost, UnitProfile


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
        from ..telemetry.alloc_replay import cpu_allocations, replay

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
                                f"plan_checkpointing: enable_activation_checkpointing(layers={entries(choice)}) "
                                f"did not recompute layer {layers[u][1]}{'' if o == LAYER else '.' + o} in backward")
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
