"""One training step of a model on fake tensors, followed storage by storage: the activation and
gradient trace every plugin's memory model is laid over.

The step runs under ``torch._subclasses.FakeTensorMode`` (meta storage, but the device's kernel
choices, so SDPA saves what it saves on that device) inside a ``TorchDispatchMode`` that follows
every storage's life (a weakref per storage: uncounted when the last tensor using it dies) and a
``torch.autograd.graph.saved_tensors_hooks`` pair that counts what autograd keeps for backward.
That gives, op by op, the bytes of activations and temporaries, of the parameter gradients made so
far, and of saved tensors; ``torch.utils.checkpoint`` runs under the fake mode too.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn


def _unique_params(m: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    seen, out = set(), []
    for n, p in m.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((n, p))
    return out


def _nbytes(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> int:
    return t.numel() * (dtype or t.dtype).itemsize


def _fake_copy(meta: nn.Module, mode, dtype: Optional[torch.dtype] = None, device: str = "cpu",
               shapes: Optional[Dict[str, torch.Size]] = None) -> nn.Module:
    """``meta`` with fake tensors on ``device`` (floating parameters cast to ``dtype`` if given;
    parameters named in ``shapes`` take that shape, a tensor-parallel shard)."""
    names = {}
    for n, p in meta.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    memo: Dict[int, Any] = {}
    with mode:
        for t in list(meta.parameters()) + list(meta.buffers()):
            if id(t) in memo:
                continue
            shape = (shapes or {}).get(names.get(id(t), ""), t.shape)
            dt = dtype if (dtype is not None and isinstance(t, nn.Parameter) and t.is_floating_point()) else t.dtype
            f = torch.empty(shape, dtype=dt, device=device)
            memo[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
    return copy.deepcopy(meta, memo)


@dataclass
class _Trace:
    """One forward + backward of one (micro)batch: bytes after every op.

    ``other``: live tensors that are neither parameters, buffers nor parameter gradients
    (activations, their gradients, temporaries); ``grad``: parameter gradients produced so far;
    ``saved``: what autograd holds for backward."""

    phase: List[str] = field(default_factory=list)
    other: List[int] = field(default_factory=list)
    grad: List[int] = field(default_factory=list)
    saved: List[int] = field(default_factory=list)
    act_end: int = 0          # live non-state bytes at the end of the forward (what a microbatch in flight holds)
    saved_end: int = 0
    grads: int = 0
    out_meta: Optional[Tuple[torch.Size, torch.dtype]] = None
    order: List[str] = field(default_factory=list)   # parameter names in order of first use
    calls: List[List[str]] = field(default_factory=list)  # the parameters of each module call, in order
    error: Optional[str] = None
    param_bytes: Optional[Dict[str, int]] = None  # N-d traces: this rank's parameter blocks, by name
    buffer_bytes: int = 0

    def saved_ahead(self) -> List[int]:
        """For every op, the most saved bytes from there to the end of the step."""
        out, m = [0] * len(self.saved), 0
        for i in range(len(self.saved) - 1, -1, -1):
            m = max(m, self.saved[i])
            out[i] = m
        return out


#: above 0 while ops run that hold no rank's memory (``hf_tp.quiet_propagation``): not followed
MUTED = [0]


def _wait_tensor():
    """The functional collectives' wait (an alias of its input), or None without them."""
    ops = getattr(torch.ops, "_c10d_functional", None)
    try:
        return ops.wait_tensor.default if ops is not None else None
    except AttributeError:
        return None


def _tracker_cls():
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.weak import WeakIdKeyDictionary

    class _StorageTracker(TorchDispatchMode):
        """Follows every storage created under it (weakref: uncounted when the last user dies)."""

        def __init__(self, trace: _Trace):
            super().__init__()
            self.trace = trace
            self.info = WeakIdKeyDictionary()
            self.bytes = {"state": 0, "grad": 0, "other": 0}
            self.saved = 0
            self.phase = "fwd"

        def register(self, t: torch.Tensor, cat: str) -> None:
            st = _local(t).untyped_storage()
            ent = self.info.get(st)
            if ent is not None:
                if ent[1] != cat:
                    self.bytes[ent[1]] -= ent[0]
                    ent[1] = cat
                    self.bytes[cat] += ent[0]
                return
            ent = [st.nbytes(), cat]
            self.info[st] = ent
            self.bytes[cat] += ent[0]
            weakref.finalize(st, self._free, ent)

        def _free(self, ent) -> None:
            self.bytes[ent[1]] -= ent[0]

        def sample(self) -> None:
            tr = self.trace
            tr.phase.append(self.phase)
            tr.other.append(self.bytes["other"])
            tr.grad.append(self.bytes["grad"])
            tr.saved.append(self.saved)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if MUTED[0]:  # metadata work on global-shape placeholders (DTensor's sharding propagation)
                return func(*args, **(kwargs or {}))
            if any(t is not _local(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)):
                # a DTensor op: its own dispatch runs the local ops, with this mode still active (what a
                # rank allocates, temporaries of a sharded loss included, is followed op by op)
                return NotImplemented
            out = func(*args, **(kwargs or {}))
            if func is _wait_tensor() and isinstance(out, torch.Tensor):
                # eager returns its input; the fake kernel a new tensor: the same bytes, counted once
                ent = self.info.get(_local(args[0]).untyped_storage())
                if ent is not None:
                    self.info[out.untyped_storage()] = ent
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and _local(t).untyped_storage() not in self.info:
                    self.register(t, "other")
            self.sample()
            return out

        def saved_hooks(self):
            live: Dict[int, List[int]] = {}
            info = self.info

            def pack(t):
                st = _local(t).untyped_storage()
                ent = info.get(st)
                if ent is None or ent[1] != "other":
                    return (t, None)
                k = id(st)
                if k in live:
                    live[k][1] += 1
                else:
                    live[k] = [ent[0], 1]
                    self.saved += ent[0]
                return (t, k)

            def unpack(packed):
                t, k = packed
                if k is not None and k in live:
                    live[k][1] -= 1
                    if live[k][1] == 0:
                        self.saved -= live.pop(k)[0]
                return t

            return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    return _StorageTracker


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds), any other tensor itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    if isinstance(out, dict):
        for v in out.values():
            if isinstance(v, torch.Tensor):
                return v
    raise TypeError(f"cl.plan: the model returned {type(out).__name__}; pass loss_fn=(output, inputs) -> loss")


def _default_loss(out, inputs):
    y = _first_tensor(out)
    if y.dim() == 3 and y.is_floating_point() and inputs and isinstance(inputs[0], torch.Tensor) \
            and inputs[0].dim() == 2 and not inputs[0].is_floating_point():
        tgt = inputs[0]  # next-token targets have the shape and dtype of the ids
        return torch.nn.functional.cross_entropy(y.flatten(0, 1).float(), tgt.flatten())
    return y.float().sum()


def _follow(fake: nn.Module, tracker, trace: _Trace, params) -> list:
    """Count ``fake``'s parameters and buffers as state, each gradient as it lands, and record the
    order parameters are first used and each module call's own parameters; the hooks' handles."""
    for _, p in params:
        tracker.register(p, "state")
    for b in fake.buffers():
        tracker.register(b, "state")
    handles = []
    for _, p in params:
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(lambda q: tracker.register(q.grad, "grad")))
    name_of = {id(p): n for n, p in params}
    seen: set = set()

    def pre_hook(module, args):
        own = [name_of[id(p)] for p in module.parameters(recurse=False) if id(p) in name_of]
        if own:
            trace.calls.append(own)
        for p in module.parameters(recurse=False):
            if id(p) in name_of and id(p) not in seen:
                seen.add(id(p))
                trace.order.append(name_of[id(p)])

    for mod in fake.modules():
        handles.append(mod.register_forward_pre_hook(pre_hook))
    return handles


def _simulate(fake: nn.Module, mode, make_inputs: Callable[[], tuple], *, autocast: Optional[torch.dtype],
              device: str, loss_fn: Optional[Callable], last: bool = True, input_grad: bool = False,
              forward: Optional[Callable] = None, backward_ctx: Callable = contextlib.nullcontext) -> _Trace:
    """One forward + backward of ``fake`` (fake tensors) traced op by op. ``forward(model, inputs)``
    replaces ``model(*inputs)`` (whose output then lives only while the loss needs it: the caller keeps
    the loss alone); ``backward_ctx()`` is entered around the backward."""
    trace = _Trace()
    tracker = _tracker_cls()(trace)
    params = _unique_params(fake)
    handles = _follow(fake, tracker, trace, params)
    try:
        with mode, tracker:
            inputs = make_inputs()
            if input_grad:  # a later pipeline stage: its input is a receive buffer (counted as such)
                inputs = tuple(t.requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                               for t in inputs)
                for t in inputs:
                    if isinstance(t, torch.Tensor):
                        tracker.register(t, "state")
            ctx = (torch.autocast(device_type=device, dtype=autocast) if autocast is not None
                   else contextlib.nullcontext())
            with tracker.saved_hooks():
                with ctx:
                    out = fake(*inputs) if forward is None else forward(fake, inputs)
                    y = _first_tensor(out)
                    trace.out_meta = (y.shape, y.dtype)
                    loss = (loss_fn or _default_loss)(out, inputs) if last else None
                    if forward is not None:
                        out = y = None
                tracker.sample()
                trace.act_end = tracker.bytes["other"]
                trace.saved_end = tracker.saved
                tracker.phase = "bwd"
                # the output lives through backward: the caller holds it (``logits, loss = model(...)``),
                # as a pipeline stage's forward cache does until that microbatch's backward
                if last:
                    with backward_ctx():
                        loss.backward()
                    del loss
                else:
                    g = torch.empty_like(y)
                    tracker.register(g, "state")  # the received gradient: a pipeline buffer, counted there
                    y.backward(g)
                    del g
                tracker.sample()
                del out, y
            del inputs
            tracker.sample()
    finally:
        for h in handles:
            h.remove()
    trace.grads = tracker.bytes["grad"]
    for _, p in params:
        p.grad = None
    return trace


def _enable_ac(m: nn.Module) -> None:
    from ...models.protocol import checkpointing_method

    own = checkpointing_method(m)  # the model's own, or a transformers model's adapter
    if own is not None:
        own()
    elif isinstance(m, nn.Sequential):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i in range(len(m)):
            m[i] = checkpoint_wrapper(m[i])
