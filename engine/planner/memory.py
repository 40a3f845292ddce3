"""``cl.plan``: will it fit? Bytes per rank and tier, predicted before anything is launched.

    plan = cl.plan(GPTConfig.preset("small"), GeminiPlugin(placement_policy="auto",
                   device_memory_limit=64 << 20, nvme_offload_dir="/scratch"),
                   world_size=2, batch=8, seq=256)
    plan.fits, plan.advice          # bool, list of concrete changes
    plan                            # a table: rank group x tier x category, capacity, fits
    plan.to_dict()                  # plain data (what colossal_lab.widgets.FitPlan draws)

``cl.plan`` is :func:`plan` (``cl.plan.measure`` its meter, ``cl.plan.FitPlan`` its result);
``import colossal_lab`` stays free of torch until the planner is first touched.

What it is built on, and why:

* **The model is never allocated.** A module's parameters and buffers are mapped to meta tensors
  (``copy.deepcopy`` with a memo: tied weights stay tied, a ``lazy_init`` model is used as it is);
  a ``GPTConfig`` or any config with ``build()`` (the model contract, ``engine/models/protocol.py``)
  is built under the meta device.
* **Activations are measured, not guessed from a formula.** One training step's forward and backward
  runs on that copy under ``torch._subclasses.FakeTensorMode`` (meta storage, but the CPU/CUDA
  device's kernel choices, so SDPA saves what it saves on the real device) inside a
  ``TorchDispatchMode`` that follows every storage's life (a weakref per storage: freed when the
  last tensor using it dies) and a ``torch.autograd.graph.saved_tensors_hooks`` pair that counts what
  autograd keeps for backward. That gives, op by op, the bytes of activations and temporaries and
  of the gradients produced so far, with and without activation checkpointing (``torch.utils.
  checkpoint`` runs under the fake mode too). It works for any model whose forward runs on fake
  tensors; a pipeline stage is simulated on its own part (``pipeline_stage``), a tensor-parallel
  rank on parameters of its shard's shape (the model's ``tp_plan()``). A 2D / 2.5D / 3D rank runs
  the grid-form layers themselves (``engine/tp_nd``: SUMMA, Tesseract, 3D) on its parameter blocks
  and its rows, their broadcasts, reduces and gathers on torch's ``fake`` process group
  (``torch.testing._internal.distributed.fake_pg``: collectives that move nothing), so the blocks
  a rank receives and the logits it gathers are in the trace. One process holds one default group,
  so this needs a process without one (the notebook, a planner); on a rank of a running job the
  layout is planned as 1D over the grid's hidden cut instead, an upper bound that says so.
* **Each plugin's own allocations are read off its code** and laid over that trace: DDP's gradient
  buckets (views or copies), ``ZeroRedundancyOptimizer``'s greedy partition, FSDP2's padded shards
  and unsharded groups, Gemini's chunks packed and placed by the engine's own functions
  (``chunk.pack_chunks``, ``placement.plan_homes``, ``working_set_bytes``) and its ``auto`` cache
  rule (keep a chunk while used + activations still ahead fit the budget), the pipeline's
  microbatches in flight and receive buffers. The optimizer step (AdamW's two fp32 moments, the
  single-tensor update's temporary, a flattened data-parallel all-reduce) is a second moment whose
  peak is compared with the backward's.

``measure()`` is the other half: the peak of live tensor bytes a run really allocates (the PyTorch
profiler's allocator events, ``profile_memory=True``, replayed pointer by pointer: not RSS, which
holds allocator slack and libraries) and the most bytes an NVMe offload directory held (its files,
sampled). ``bench/plan.py`` and ``tests/test_plan.py`` compare the two; ``docs/plan.md`` has the
table and what is not modelled.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

TIERS = ("cuda", "cpu", "nvme")
CATEGORIES = ("params", "grads", "optimizer", "activations", "working")
GiB, MiB = float(1 << 30), float(1 << 20)
_OPT_STATE = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}  # fp32 tensors per parameter


def _fmt(n: Optional[float]) -> str:
    if n is None:
        return "-"
    n = float(n)
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.1f} MiB"
    if abs(n) >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{int(n)} B"


# ---------------------------------------------------------------------------------------------
# the plan's plain data
# ---------------------------------------------------------------------------------------------
@dataclass
class TierPlan:
    """One tier of one rank group at its predicted peak: bytes by category, and when it happens."""

    tier: str
    capacity: Optional[int]
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    working: int = 0
    phase: str = ""

    @property
    def peak(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.working

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.peak <= self.capacity

    def to_dict(self) -> dict:
        d = {c: int(getattr(self, c)) for c in CATEGORIES}
        d.update(tier=self.tier, capacity=self.capacity, peak=self.peak, fits=self.fits, phase=self.phase)
        return d


@dataclass
class RankPlan:
    """Ranks that hold the same bytes (e.g. every data-parallel replica, or one pipeline stage)."""

    ranks: List[int]
    role: str
    tiers: Dict[str, TierPlan]

    @property
    def fits(self) -> bool:
        return all(t.fits for t in self.tiers.values())

    def to_dict(self) -> dict:
        return {"ranks": list(self.ranks), "role": self.role, "fits": self.fits,
                "tiers": {k: v.to_dict() for k, v in self.tiers.items()}}


@dataclass
class FitPlan:
    """What ``cl.plan`` predicts: per rank group and tier, the peak bytes by category.

    ``activations`` holds one rank's activation bytes with and without activation checkpointing
    (the larger stage under a pipeline); ``traffic`` the bytes a step moves per rank (``"nvme->cpu"``,
    ``"cpu->nvme"``, ``"allreduce"``, ``"allgather"``, ``"reduce_scatter"``, ``"broadcast"``, ``"p2p"``);
    ``advice`` concrete changes, best first; ``notes`` what the estimate assumed.
    """

    plugin: str
    world_size: int
    batch: int
    seq: int
    precision: str
    device: str
    model: dict
    layout: dict
    ranks: List[RankPlan]
    activations: dict
    traffic: Dict[str, int]
    advice: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    blocked: Optional[str] = None   # the plugin itself would refuse this (e.g. Gemini's plan_homes)

    @property
    def fits(self) -> bool:
        return self.blocked is None and all(r.fits for r in self.ranks)

    @property
    def tiers(self) -> List[str]:
        present = {t for r in self.ranks for t in r.tiers}
        return [t for t in TIERS if t in present]

    def rank_plan(self, rank: int) -> RankPlan:
        for r in self.ranks:
            if rank in r.ranks:
                return r
        raise KeyError(f"FitPlan.rank_plan({rank}): ranks are 0..{self.world_size - 1}")

    def peak(self, tier: str, rank: Optional[int] = None) -> int:
        """Predicted peak bytes of ``tier`` on ``rank`` (None: the largest over ranks)."""
        groups = self.ranks if rank is None else [self.rank_plan(rank)]
        return max((g.tiers[tier].peak for g in groups if tier in g.tiers), default=0)

    def to_dict(self) -> dict:
        return {"plugin": self.plugin, "world_size": self.world_size, "batch": self.batch, "seq": self.seq,
                "precision": self.precision, "device": self.device, "fits": self.fits, "model": dict(self.model),
                "layout": dict(self.layout), "ranks": [r.to_dict() for r in self.ranks],
                "activations": dict(self.activations), "traffic": dict(self.traffic),
                "advice": list(self.advice), "notes": list(self.notes), "blocked": self.blocked,
                "categories": list(CATEGORIES),
                "tiers": self.tiers}

    def table(self) -> str:
        """The plan as a fixed-width text table (what ``repr`` shows)."""
        head = (f"FitPlan: {self.model.get('name', 'model')} ({self.model.get('params', 0) / 1e6:.2f}M params) · "
                f"{self.plugin} · world {self.world_size} · batch {self.batch} × seq {self.seq} · "
                f"{self.precision} on {self.device} · {'FITS' if self.fits else 'DOES NOT FIT'}")
        cols = ["ranks", "tier"] + list(CATEGORIES) + ["peak", "capacity", "fits"]
        rows = []
        for g in self.ranks:
            for t in self.tiers:
                if t not in g.tiers:
                    continue
                tp = g.tiers[t]
                rows.append([_ranks_str(g.ranks) + (f" ({g.role})" if g.role else ""), t]
                            + [_fmt(getattr(tp, c)) for c in CATEGORIES]
                            + [_fmt(tp.peak), _fmt(tp.capacity), "yes" if tp.fits else "NO"])
        widths = [max(len(str(r[i])) for r in rows + [cols]) for i in range(len(cols))]
        line = lambda r: "  ".join(str(v).rjust(w) if i > 1 else str(v).ljust(w) for i, (v, w) in enumerate(zip(r, widths)))
        out = [head, line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows]
        act = self.activations
        if act:
            w = act.get("with_checkpointing")
            out.append(f"activations per rank: {_fmt(act.get('without_checkpointing'))} without checkpointing, "
                       f"{_fmt(w) if w is not None else 'n/a'} with"
                       + (" (checkpointing on)" if act.get("checkpointing") else ""))
        if self.traffic:
            out.append("per step per rank: " + ", ".join(f"{k} {_fmt(v)}" for k, v in self.traffic.items()))
        out += [f"advice: {a}" for a in self.advice]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    def __repr__(self) -> str:
        return self.table()

    def _repr_pretty_(self, p, cycle) -> None:  # IPython
        p.text(self.table())


def _ranks_str(ranks: Sequence[int]) -> str:
    rs = sorted(ranks)
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"ranks {rs[0]}-{rs[-1]}"
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(map(str, rs))


# ---------------------------------------------------------------------------------------------
# the model, without memory
# ---------------------------------------------------------------------------------------------
def _meta_model(model_or_config) -> Tuple[nn.Module, str]:
    """A copy of the model whose parameters and buffers are meta tensors (no memory)."""
    if isinstance(model_or_config, nn.Module):
        m = model_or_config
        tensors = list(m.parameters()) + list(m.buffers())
        memo: Dict[int, Any] = {}
        for t in tensors:
            if id(t) in memo:
                continue
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
        return copy.deepcopy(m, memo), type(m).__name__
    build = getattr(model_or_config, "build", None)
    if callable(build):
        cfg = copy.deepcopy(model_or_config)  # enabling checkpointing on the copy must not touch the user's
        with torch.device("meta"):
            m = cfg.build()
        if not isinstance(m, nn.Module):
            raise TypeError(f"cl.plan(model_or_config=...): {type(model_or_config).__name__}.build() returned "
                            f"{type(m).__name__}, not an nn.Module")
        return m, type(m).__name__
    raise TypeError(f"cl.plan(model_or_config={type(model_or_config).__name__}): pass an nn.Module (real, meta or "
                    "lazy_init), a GPTConfig, or a config with build() (the model contract, "
                    "colossal_lab.engine.models.protocol.ModelConfig)")


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


# ---------------------------------------------------------------------------------------------
# one step on fake tensors: the activation and gradient trace
# ---------------------------------------------------------------------------------------------
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
            st = t.untyped_storage()
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
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage() not in self.info:
                    self.register(t, "other")
            self.sample()
            return out

        def saved_hooks(self):
            live: Dict[int, List[int]] = {}
            info = self.info

            def pack(t):
                st = t.untyped_storage()
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


def _simulate(fake: nn.Module, mode, make_inputs: Callable[[], tuple], *, autocast: Optional[torch.dtype],
              device: str, loss_fn: Optional[Callable], last: bool = True, input_grad: bool = False) -> _Trace:
    """One forward + backward of ``fake`` (fake tensors) traced op by op."""
    trace = _Trace()
    tracker = _tracker_cls()(trace)
    params = _unique_params(fake)
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
    try:
        with mode, tracker:
            inputs = make_inputs()
            if input_grad:  # a later pipeline stage: its input is a receive buffer (counted as such)
                inputs = tuple(t.requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                               for t in inputs)
                for t in inputs:
                    if isinstance(t, torch.Tensor):
                        tracker.register(t, "state")
            ctx = torch.autocast(device_type=device, dtype=autocast) if autocast is not None else contextlib.nullcontext()
            with tracker.saved_hooks():
                with ctx:
                    out = fake(*inputs)
                    y = _first_tensor(out)
                    trace.out_meta = (y.shape, y.dtype)
                    loss = (loss_fn or _default_loss)(out, inputs) if last else None
                tracker.sample()
                trace.act_end = tracker.bytes["other"]
                trace.saved_end = tracker.saved
                tracker.phase = "bwd"
                # the output lives through backward: the caller holds it (``logits, loss = model(...)``),
                # as a pipeline stage's forward cache does until that microbatch's backward
                if last:
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


# ---------------------------------------------------------------------------------------------
# the model side, shared by every plugin
# ---------------------------------------------------------------------------------------------
class _Model:
    """The meta model plus what every plugin asks of it; fake traces are cached by key."""

    def __init__(self, model_or_config, inputs, loss_fn, batch: int, seq: int, device: str):
        self.meta, self.name = _meta_model(model_or_config)
        self.inputs, self.loss_fn, self.batch, self.seq = inputs, loss_fn, batch, seq
        # fake tensors run the device's kernel choices; a torch without CUDA cannot fake a CUDA
        # tensor, so a GPU plan made on such a machine traces with the CPU's kernels (noted)
        self.device = device if device == "cpu" or torch.cuda.is_available() else "cpu"
        self.traced_elsewhere = self.device != device
        self.params = _unique_params(self.meta)
        self.numel = sum(p.numel() for _, p in self.params)
        self.param_bytes = sum(_nbytes(p) for _, p in self.params)
        self.trainable_bytes = sum(_nbytes(p) for _, p in self.params if p.requires_grad)
        self.buffer_bytes = sum(_nbytes(b) for b in self.meta.buffers())
        self._traces: Dict[tuple, _Trace] = {}
        cfg = getattr(self.meta, "cfg", None)
        self.vocab = getattr(cfg, "vocab_size", None)
        if self.vocab is None:
            emb = next((m for m in self.meta.modules() if isinstance(m, nn.Embedding)), None)
            self.vocab = emb.num_embeddings if emb is not None else None
        block = getattr(cfg, "block_size", None)
        if block is not None and seq > block:
            raise ValueError(f"cl.plan(seq={seq}): the model's block_size is {block}; pass seq <= {block}")

    def supports_ac(self) -> bool:
        return callable(getattr(self.meta, "enable_activation_checkpointing", None)) or isinstance(self.meta, nn.Sequential)

    def ac_enabled(self) -> bool:
        cfg = getattr(self.meta, "cfg", None)
        return bool(getattr(cfg, "activation_checkpointing", False))

    def token_inputs(self, b: int):
        if self.inputs is not None:
            def make():
                out = self.inputs(b, self.seq)
                return tuple(out) if isinstance(out, (tuple, list)) else (out,)
            return make
        if self.vocab is None:
            raise ValueError(f"cl.plan: cannot tell what {self.name} takes as input (no vocab_size, no nn.Embedding); "
                             "pass inputs=lambda batch, seq: (torch.randn(batch, seq, d),) and, if needed, loss_fn=")
        dev = self.device
        return lambda: (torch.zeros(b, self.seq, dtype=torch.long, device=dev),)

    def trace(self, *, ac: bool, autocast: Optional[torch.dtype] = None, dtype: Optional[torch.dtype] = None,
              micro: Optional[int] = None, stage: Optional[Tuple[int, int]] = None,
              tp: Optional[Tuple[int, dict]] = None) -> _Trace:
        """The trace of one (micro)batch; ``stage=(s, n)`` a pipeline stage's part, ``tp=(size, plan)``
        a tensor-parallel rank's shard shapes."""
        b = micro or self.batch
        if dtype is not None and all(p.dtype == dtype for _, p in self.params if p.is_floating_point()):
            dtype = None  # casting to the dtype the parameters have changes nothing: share the trace
        nd = tp[1] if tp and isinstance(tp[1], _NdKey) else None
        key = (ac, autocast, dtype, b, stage, tp[0] if tp else 1, nd.mode if nd else "1d", nd.depth if nd else 1)
        if key in self._traces:
            return self._traces[key]
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=False)
        shapes = _tp_shapes(self.meta, tp[0], tp[1].plan) if tp and nd is None else None
        part = self.meta
        # N-d: this rank's piece of the (micro)batch, cut over the stream layout's batch axes
        first, last, make = True, True, self.token_inputs(b // nd.batch_shards if nd else b)
        if stage is not None:
            s, n = stage
            from ..pipeline.stage import split_stage

            part = split_stage(self.meta, s, n)  # a copy of meta tensors: free
            first, last = s == 0, s == n - 1
            if not first:
                prev = self.trace(ac=ac, autocast=autocast, dtype=dtype, micro=micro, stage=(s - 1, n), tp=tp)
                shape, dt = prev.out_meta
                dev = self.device
                make = lambda: (torch.empty(shape, dtype=dt, device=dev),)
        with contextlib.ExitStack() as scope:  # the fake process group (N-d) ends with the trace, however it ends
            tr = self._trace_on(scope, part, mode, shapes, nd, make, first, last, ac, autocast, dtype, micro, stage, b)
        self._traces[key] = tr
        return tr

    def _trace_on(self, scope, part, mode, shapes, nd, make, first, last, ac, autocast, dtype, micro, stage, b) -> _Trace:
        """:meth:`trace`'s fake step on ``part`` (the whole model or a stage); an N-d layout's fake
        process group is entered on ``scope``, so it ends with the trace however the trace ends."""
        fake = _fake_copy(part, mode, dtype=dtype, device=self.device, shapes=shapes)
        gloo = contextlib.nullcontext()
        if nd is not None:
            # the real N-d modules (SUMMA / Tesseract / 3D) on this rank's blocks, their collectives on
            # a fake process group: the blocks they receive and the buffers they gather are traced too
            from ..tp_nd import Grid, convert, resolve_plan

            scope.enter_context(_fake_world(nd.tp_size))
            grid = Grid(nd.mode, dict(nd.sizes), [list(range(nd.tp_size))], 0)
            with mode:
                convert(fake, grid, resolve_plan(fake, nd.plan))
        if ac:
            _enable_ac(fake)
        elif getattr(getattr(fake, "cfg", None), "activation_checkpointing", False):
            fake.cfg.activation_checkpointing = False  # the copy's own config: the user's is untouched
        fake.train()
        loss_fn = self.loss_fn
        if nd is not None and last:
            # the plugin's step with a criterion for whole logits: the vocab pieces gathered
            # (``gather_vocab``), the targets this rank's rows (the logits' own batch cut)
            from ..tp_nd import gather_vocab

            user_loss, dev = self.loss_fn, self.device

            def loss_fn(out, inputs):
                y = gather_vocab(_first_tensor(out))
                if user_loss is not None:
                    return user_loss(y, inputs)
                tgt = torch.zeros(y.shape[:-1], dtype=torch.long, device=dev)
                return torch.nn.functional.cross_entropy(y.flatten(0, -2).float(), tgt.flatten())
        elif loss_fn is None and not first and self.vocab is not None:
            dev, n = self.device, b * self.seq  # a later stage's loss still compares against token ids

            def loss_fn(out, inputs):
                y = _first_tensor(out)
                return torch.nn.functional.cross_entropy(y.flatten(0, 1).float(),
                                                         torch.zeros(n, dtype=torch.long, device=dev))
        if nd is not None and self.device == "cpu":
            from ..tp_nd import counter

            gloo = counter.simulate_gloo()  # CPU ranks talk gloo, which copies a reduce-scatter's input
        try:
            with gloo:
                tr = _simulate(fake, mode, make, autocast=autocast, device=self.device, loss_fn=loss_fn,
                               last=last, input_grad=not first)
            if nd is not None:
                tr.param_bytes = {n: _nbytes(p) for n, p in _unique_params(fake)}
                tr.buffer_bytes = sum(_nbytes(t) for t in fake.buffers())
        except Exception as exc:
            if not shapes:
                raise
            # the forward cannot run on its shard's shapes (e.g. a fixed head count): whole shapes
            tr = self.trace(ac=ac, autocast=autocast, dtype=dtype, micro=micro, stage=stage)
            tr = _Trace(**{**tr.__dict__, "error": f"tensor parallel: the forward failed on shard shapes "
                                                    f"({type(exc).__name__}); activations traced unsharded"})
        return tr


def _enable_ac(m: nn.Module) -> None:
    if callable(getattr(m, "enable_activation_checkpointing", None)):
        m.enable_activation_checkpointing()
    elif isinstance(m, nn.Sequential):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i in range(len(m)):
            m[i] = checkpoint_wrapper(m[i])


def _tp_shapes(meta: nn.Module, tp: int, plan: dict) -> Dict[str, torch.Size]:
    """Shapes of one tensor-parallel rank's parameters under a Colwise/Rowwise plan."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out: Dict[str, torch.Size] = {}
    mods = dict(meta.named_modules())
    for name, style in plan.items():
        mod = mods.get(name)
        if mod is None or not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            continue
        col = isinstance(style, ColwiseParallel)
        for pn, p in mod.named_parameters(recurse=False):
            shape = list(p.shape)
            if isinstance(mod, nn.Embedding):
                dim = 1 if col else 0
            else:  # Linear: weight (out, in); Colwise shards out (and the bias), Rowwise shards in
                dim = 0 if col else (1 if pn == "weight" else None)
            if dim is None:
                continue
            shape[dim] = -(-shape[dim] // tp)
            out[f"{name}.{pn}" if name else pn] = torch.Size(shape)
    return out


# ---------------------------------------------------------------------------------------------
# composing a peak from a trace and a plugin's persistent bytes
# ---------------------------------------------------------------------------------------------
def _peak_over(trace: _Trace, fn: Callable[[int, int, int, int], Dict[str, int]]) -> Tuple[Dict[str, int], str, int]:
    """``fn(i, other, grad, saved)`` -> categories at op ``i``; the categories at the largest total."""
    best, best_i = None, 0
    for i in range(len(trace.other)):
        cats = fn(i, trace.other[i], trace.grad[i], trace.saved[i])
        tot = sum(cats.values())
        if best is None or tot > sum(best.values()):
            best, best_i = cats, i
    phase = trace.phase[best_i] if trace.phase else "fwd"
    return best or {}, ("backward" if phase == "bwd" else "forward"), best_i


def _tier(tier: str, capacity: Optional[int], cats: Dict[str, int], phase: str) -> TierPlan:
    return TierPlan(tier=tier, capacity=capacity, phase=phase,
                    **{c: int(max(0, cats.get(c, 0))) for c in CATEGORIES})


def _max_cats(*cands: Tuple[Dict[str, int], str]) -> Tuple[Dict[str, int], str]:
    return max(cands, key=lambda c: sum(c[0].values()))


# ---------------------------------------------------------------------------------------------
# where each rank's tiers are, and how big
# ---------------------------------------------------------------------------------------------
@dataclass
class _Env:
    device: str                       # compute device type: "cuda" or "cpu"
    world: int
    compute: Optional[int]            # capacity of the compute tier per rank
    host: Optional[int]               # host RAM per rank (the cpu tier on a GPU machine)
    nvme: Optional[int]               # free bytes per rank in the NVMe directory
    nvme_dir: Optional[str]

    @property
    def compute_tier(self) -> str:
        return self.device

    def capacity(self, tier: str) -> Optional[int]:
        if tier == "nvme":
            return self.nvme
        if tier == self.device:
            return self.compute
        return self.host


def _check_dir(d: str) -> int:
    """Free bytes of a writable directory, or a ValueError naming ``nvme_dir``."""
    try:
        os.makedirs(d, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".plan-probe-"):
            pass
    except OSError as exc:
        raise ValueError(f"cl.plan(nvme_dir={d!r}): the directory is not writable ({exc.strerror}); pass a "
                         "directory you can write to on a fast local disk, or nvme_dir=None") from None
    return shutil.disk_usage(d).free


def _env(device, world, device_memory, host_memory, nvme_dir) -> _Env:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"cl.plan(device={device!r}): choose 'cuda', 'cpu' or None (this machine's)")
    for name, v in (("device_memory", device_memory), ("host_memory", host_memory)):
        if v is not None and (not isinstance(v, int) or v <= 0):
            raise ValueError(f"cl.plan({name}={v!r}): a positive number of bytes per rank (e.g. 8 << 30) or None")
    if host_memory is None:
        try:
            import psutil

            host_memory = psutil.virtual_memory().total // world  # ranks share this machine's RAM
        except ImportError:  # pragma: no cover
            host_memory = None
    if device == "cuda":
        if device_memory is None and torch.cuda.is_available():
            device_memory = torch.cuda.get_device_properties(0).total_memory
        compute = device_memory
    else:  # CPU-only: the compute device *is* host RAM (Gemini's device_memory_limit plays this role)
        given = [v for v in (device_memory, host_memory) if v is not None]
        compute = min(given) if given else None
    nvme = _check_dir(nvme_dir) // world if nvme_dir is not None else None
    return _Env(device=device, world=world, compute=compute, host=host_memory if device == "cuda" else compute,
                nvme=nvme, nvme_dir=nvme_dir)


# ---------------------------------------------------------------------------------------------
# plugins
# ---------------------------------------------------------------------------------------------
@dataclass
class _Result:
    ranks: List[RankPlan]
    traffic: Dict[str, int]
    act: Dict[str, Any]
    layout: Dict[str, Any]
    notes: List[str] = field(default_factory=list)


def _opt_bytes(numel: int, opt: str) -> int:
    return _OPT_STATE[opt] * 4 * numel


def _step_temp(largest: int, total: int, device: str, opt: str) -> int:
    """Bytes torch's optimizer step allocates on top of its state: on CPU (no foreach) AdamW's
    single-tensor update makes ``exp_avg_sq.sqrt()`` and its quotient for one parameter at a time;
    on CUDA the foreach path makes the square roots of every state at once."""
    if opt in ("sgd",):
        return 0
    return 2 * largest if device == "cpu" else total


def _acts_summary(m: _Model, ac: bool, **kw) -> Dict[str, Any]:
    """Activation bytes per rank with and without checkpointing (end of forward, one microbatch
    times what is in flight is the caller's business)."""
    off = m.trace(ac=False, **kw).act_end
    on = m.trace(ac=True, **kw).act_end if m.supports_ac() else None
    return {"without_checkpointing": off, "with_checkpointing": on, "checkpointing": bool(ac)}


def _plan_replicated(m: _Model, plugin, env: _Env, precision: str, opt: str, ac: bool) -> _Result:
    """plugin=None, DDPPlugin, LowLevelZeroPlugin(stage=1|2): every rank runs the whole model."""
    from ..mixed_precision import autocast_dtype

    w, dev = env.world, env.compute_tier
    name = type(plugin).__name__ if plugin is not None else "None"
    stage = getattr(plugin, "stage", 0) if name == "LowLevelZeroPlugin" else 0
    if name == "LowLevelZeroPlugin" and w == 1:
        stage = -1  # one process: ZeRO has nothing to shard (stage 1 is DDP-less ZeroRedundancyOptimizer)
    low = autocast_dtype(precision) if precision != "fp32" else None
    tr = m.trace(ac=ac, autocast=low)
    P, Bf = m.param_bytes, m.buffer_bytes
    train = [(n, p) for n, p in m.params if p.requires_grad]
    G = sum(_nbytes(p) for _, p in train)
    numel = sum(p.numel() for _, p in train)
    S = _opt_bytes(numel, opt)
    largest = max((_nbytes(p) for _, p in train), default=0)
    notes, traffic = [], {}
    groups: List[RankPlan] = []
    cap = env.capacity(dev)

    def one(ranks, role, params, grads_fb, grads_step, optim, working_fb, working_step, step_largest):
        fb, ph, _ = _peak_over(tr, lambda i, o, g, s: {"params": params, "grads": grads_fb(g), "optimizer": optim,
                                                         "activations": o, "working": working_fb(g)})
        step = {"params": params, "grads": grads_step, "optimizer": optim,
                "working": working_step + _step_temp(step_largest, optim // max(1, _OPT_STATE[opt]), dev, opt)}
        cats, phase = _max_cats((fb, ph), (step, "optimizer step"))
        groups.append(RankPlan(list(ranks), role, {dev: _tier(dev, cap, cats, phase)}))

    if name == "None" or (name == "DDPPlugin" and w == 1) or stage == -1:
        # no wrapper: gradients are made by autograd and freed by zero_grad(set_to_none=True)
        one(range(w), "replica" if w > 1 else "", P + Bf, lambda g: g, G, S, lambda g: 0, 0, largest)
        if w > 1:
            notes.append(f"plugin={name} on world_size={w}: every rank is an unsynchronised replica")
    elif name == "DDPPlugin":
        view = getattr(plugin, "gradient_as_bucket_view", True)
        if view:  # gradients are views into DDP's buckets: the buckets *are* the gradients
            one(range(w), "data parallel", P + Bf, lambda g: G, G, S, lambda g: 0, 0, largest)
        else:     # buckets beside the gradients
            one(range(w), "data parallel", P + Bf, lambda g: g, G, S, lambda g: G, G, largest)
        traffic["allreduce"] = int(2 * (w - 1) / w * G)
        notes.append(f"DDP: gradient buckets {_fmt(G)} ({'views of' if view else 'copies beside'} the gradients)")
    elif stage == 1:
        # DDP without bucket views + ZeroRedundancyOptimizer's greedy partition of the states
        sizes, big = [0] * w, [0] * w
        for _, p in sorted(train, key=lambda t: t[1].numel(), reverse=True):
            r = sizes.index(min(sizes))
            sizes[r] += p.numel()
            big[r] = max(big[r], _nbytes(p))
        by: Dict[tuple, List[int]] = {}
        for r in range(w):
            by.setdefault((sizes[r], big[r]), []).append(r)
        for (n_r, big_r), ranks in sorted(by.items(), key=lambda kv: kv[1][0]):
            one(ranks, f"ZeRO-1 partition ({n_r / 1e6:.2f}M params)", P + Bf, lambda g: g, G,
                _opt_bytes(n_r, opt), lambda g: G, G, big_r)
        traffic["allreduce"] = int(2 * (w - 1) / w * G)
        traffic["broadcast"] = int(P * (w - 1) / w)
        notes.append(f"ZeRO-1: DDP buckets {_fmt(G)} beside the gradients; optimizer state split greedily by "
                     "parameter size (ZeroRedundancyOptimizer)")
    else:  # stage 2: FSDP2 fully_shard per block and the root, reshard_after_forward=False
        groups_fsdp = _fsdp_groups(m)
        ud = low.itemsize if (low is not None and precision != "fp8") else None

        def shard(p):  # FSDP2 pads dim 0 to a multiple of the world
            rows = p.shape[0] if p.dim() else 1
            return -(-rows // w) * (p.numel() // max(1, rows)) * p.dtype.itemsize

        Ps = sum(shard(p) for _, p in m.params)
        Gs = sum(shard(p) for _, p in train)
        numel_s = sum(shard(p) // p.dtype.itemsize for _, p in train)
        Ss = _opt_bytes(numel_s, opt)
        unsh = {gname: sum(p.numel() * (ud or p.dtype.itemsize) for _, p in ps) for gname, ps in groups_fsdp.items()}
        U = sum(unsh.values())
        big_group = max((sum(_nbytes(p) for _, p in ps if p.requires_grad) for ps in groups_fsdp.values()), default=0)
        done_at = _group_release(m, tr, groups_fsdp)

        def unsharded(g):
            return U - sum(unsh[gn] for gn in done_at(g))

        def grads_live(g):  # sharded gradients so far + the current groups' unsharded ones
            done = done_at(g)
            gdone = sum(sum(_nbytes(p) for _, p in groups_fsdp[gn] if p.requires_grad) for gn in done)
            return g - gdone + int(gdone / w)

        def params_at(g):
            return Ps + Bf + unsharded(g)

        fb, ph, _ = _peak_over(tr, lambda i, o, g, s: {"params": params_at(g), "grads": grads_live(g),
                                                         "optimizer": Ss, "activations": o, "working": big_group})
        step = {"params": Ps + Bf, "grads": Gs, "optimizer": Ss,
                "working": _step_temp(-(-largest // w), Gs, dev, opt)}
        cats, phase = _max_cats((fb, ph), (step, "optimizer step"))
        groups.append(RankPlan(list(range(w)), "ZeRO-2 shard", {dev: _tier(dev, cap, cats, phase)}))
        traffic["allgather"] = int(U * (w - 1) / w)
        traffic["reduce_scatter"] = int(G * (w - 1) / w)
        notes.append(f"ZeRO-2 (FSDP2): {len(groups_fsdp)} groups gathered in forward and kept through backward "
                     f"({_fmt(U)} unsharded), shards padded to the world")
        if getattr(plugin, "cpu_offload", False) and dev == "cuda":
            notes.append("cpu_offload=True: sharded parameters, gradients and states live in host memory "
                         "(not split out by tier in this estimate)")
    layout = {"dp": w if name != "None" else 1, "tp": 1, "pp": 1, "zero_stage": max(stage, 0)}
    return _Result(groups, traffic, _acts_summary(m, ac, autocast=low), layout, notes)


def _fsdp_groups(m: _Model) -> Dict[str, List[Tuple[str, nn.Parameter]]]:
    """FSDP2's parameter groups as ``LowLevelZeroPlugin`` shards: each child of the model's
    ModuleList/ModuleDicts, then the root with what is left."""
    groups: Dict[str, List[Tuple[str, nn.Parameter]]] = {}
    owner: Dict[int, str] = {}
    for cname, child in m.meta.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            for k, block in child.named_children():
                for _, p in block.named_parameters():
                    owner.setdefault(id(p), f"{cname}.{k}")
    for n, p in m.params:
        groups.setdefault(owner.get(id(p), ""), []).append((n, p))
    return groups


def _group_release(m: _Model, tr: _Trace, groups) -> Callable[[int], List[str]]:
    """``done(g)``: the groups whose every gradient has arrived once ``g`` gradient bytes exist
    (gradients arrive in reverse order of first use)."""
    order = [n for n in tr.order] + [n for n, _ in m.params if n not in set(tr.order)]
    sizes = {n: _nbytes(p) for n, p in m.params if p.requires_grad}
    arrival = [n for n in reversed(order) if n in sizes]
    cum, acc = [], 0
    for n in arrival:
        acc += sizes[n]
        cum.append(acc)
    gof = {n: gn for gn, ps in groups.items() for n, _ in ps}
    last_needed: Dict[str, int] = {}
    for i, n in enumerate(arrival):
        last_needed[gof[n]] = i
    thresholds = sorted((cum[i], gn) for gn, i in last_needed.items())

    def done(g: int) -> List[str]:
        return [gn for t, gn in thresholds if t <= g]

    return done


def _plan_gemini(m: _Model, plugin, env: _Env, precision: str, opt: str, ac: bool) -> _Result:
    """GeminiPlugin: chunks packed and homed by the engine's own functions, then the step's
    bytes per tier: homes, gathered chunks (and ``auto``'s cache), gradient buffers, activations,
    the optimizer's windows."""
    from ..gemini.build import max_chunk_elems
    from ..gemini.chunk import TensorInfo, pack_chunks, search_chunk_size
    from ..gemini.placement import (PlacementConfig, optim_block_bytes, plan_homes,
                                                      shares_master, working_set_bytes)
    from ..gemini.tiers import UNLIMITED, Tier, TierStack
    from ..mixed_precision import TORCH_DTYPE_MAP

    if opt not in ("adamw", "adam"):
        raise ValueError(f"cl.plan(optimizer={opt!r}): GeminiPlugin runs torch.optim.AdamW/Adam only; pass "
                         "optimizer='adamw'")
    w, dev = env.world, env.compute_tier
    dtype = TORCH_DTYPE_MAP[precision]
    limit = plugin.device_memory_limit
    nvme_dir = plugin.nvme_offload_dir
    tr = m.trace(ac=ac, dtype=dtype)
    notes: List[str] = []
    # ---- the packing build() and the execution-order re-pack make -----------------------------
    named = [(n, p) for n, p in m.params]
    if plugin.pack_order == "execution" and tr.order:
        pos = {n: i for i, n in enumerate(tr.order)}
        named = sorted(named, key=lambda t: pos.get(t[0], len(pos) + [n for n, _ in m.params].index(t[0])))
    infos = [TensorInfo(name=n, param=p, offset=0, numel=p.numel(), shape=p.shape) for n, p in named]
    numels = [t.numel for t in infos]
    if plugin.chunk_size_mb is not None:
        size = int(plugin.chunk_size_mb * 2 ** 20) // dtype.itemsize
        if size < max(numels):
            raise ValueError(f"GeminiPlugin(chunk_size_mb={plugin.chunk_size_mb}): smaller than the largest parameter "
                             f"({max(numels)} elements); set chunk_size_mb >= {max(numels) * dtype.itemsize / MiB:.3f}")
        size = -(-size // w) * w
    else:
        size = search_chunk_size(numels, w, max_size=max_chunk_elems(dtype.itemsize, limit, plugin.max_prefetch))
    chunks = pack_chunks(infos, size, dtype, w, 0, plugin.shard_param_frac)
    # ---- the tier stack Gemini would build on each rank --------------------------------------
    tiers = []
    if dev == "cuda":
        tiers.append(Tier("cuda", min(x for x in (env.compute, limit, UNLIMITED) if x is not None), torch.device("cuda")))
        tiers.append(Tier("cpu", UNLIMITED, torch.device("cpu")))
    else:
        tiers.append(Tier("cpu", limit or UNLIMITED, torch.device("cpu")))
    if nvme_dir is not None:
        tiers.append(Tier("nvme", env.nvme if env.nvme is not None else _check_dir(nvme_dir) // w, None))
    stack = TierStack(tiers)
    cfg = PlacementConfig(policy=plugin.placement_policy, offload_optim_frac=plugin.offload_optim_frac,
                          offload_param_frac=plugin.offload_param_frac, nvme_offload_frac=plugin.nvme_offload_frac,
                          max_prefetch=plugin.max_prefetch)
    refused = None
    try:
        plan_homes(chunks, stack, cfg)
    except ValueError as exc:  # show where it would go with room everywhere, and say it does not fit
        refused = str(exc)
        roomy = TierStack([Tier(t.name, UNLIMITED, t.device) for t in tiers])
        plan_homes(chunks, roomy, cfg)
        notes.append(f"Gemini refuses this at boost: {refused}")
    comp = stack.compute
    # ---- per chunk: homes, files, sizes ---------------------------------------------------
    cats = {t.name: {c: 0 for c in CATEGORIES} for t in tiers}
    files = {"param": 0, "state": 0, "grad": 0}
    nonalias_full, grads_ram, nvme_param_chunks, full_sizes = 0, {}, [], []
    cid_of: Dict[str, Any] = {}
    for c in chunks:
        for info in c.infos:
            cid_of[info.name] = c
        alias = c.param_home == comp.name and (not c.sharded or w == 1)
        share = shares_master(c, c.param_home, c.optim_home, stack)
        n = c.shard_size
        if c.param_home == "nvme":
            files["param"] += c.shard_bytes
            nvme_param_chunks.append(c)
        else:
            cats[c.param_home]["params"] += c.shard_bytes
        if c.optim_home == "nvme":
            files["state"] += 12 * n
            files["grad"] += 4 * n
        else:
            cats[c.optim_home]["optimizer"] += 12 * n - (c.shard_bytes if share else 0)
            grads_ram[c.id] = 4 * n
        if not alias:
            nonalias_full += c.full_bytes
            full_sizes.append(c.full_bytes)
    homes_comp = sum(cats[comp.name][k] for k in ("params", "optimizer"))
    # ---- the forward/backward on the compute tier -----------------------------------------
    order = list(tr.order) + [n for n, _ in m.params if n not in set(tr.order)]
    arrival = [n for n in reversed(order) if dict(m.params)[n].requires_grad]
    cum, acc = [], 0
    for n in arrival:  # in the compute dtype, as the trace's gradients (Gemini's buffers are fp32)
        acc += _nbytes(dict(m.params)[n], dtype)
        cum.append(acc)
    chunk_last: Dict[int, int] = {}
    chunk_first: Dict[int, int] = {}
    for i, n in enumerate(arrival):
        c = cid_of[n]
        chunk_last[c.id] = i
        chunk_first.setdefault(c.id, i)
    by_id = {c.id: c for c in chunks}

    pending_host = dev == "cpu"  # NVMe-bound gradients wait in host buffers (accounted) until the step

    def held(c) -> int:
        """Gradient bytes chunk ``c`` keeps on the compute tier once reduced, until the step: its
        shard in a RAM home there, or (host = compute tier) the host copy its NVMe write keeps
        alive in the write-behind queue, which only the step's ``flush_writes`` empties."""
        if c.optim_home == comp.name:
            return grads_ram.get(c.id, 0)
        if c.optim_home == "nvme" and pending_host:
            return 4 * c.shard_size
        return 0

    nonalias = {c.id for c in chunks if not (c.param_home == comp.name and (not c.sharded or w == 1))}

    def grad_state(g: int) -> Tuple[int, int, int]:
        """(gradient bytes held on the compute tier, fp32 chunk gradient buffers in flight, gathered
        bytes of the chunks those buffers pin: a chunk awaiting gradients stays in use)."""
        k = _count_le(cum, g)  # parameters whose gradient has arrived
        stored, buffers, pinned = 0, 0, 0
        for cid, last in chunk_last.items():
            c = by_id[cid]
            if last < k:  # reduced: handed to the optimizer home
                stored += held(c)
            elif chunk_first[cid] < k:  # some gradients in: the full fp32 buffer exists
                buffers += c.size * 4
                pinned += c.full_bytes if cid in nonalias else 0
        return stored, buffers, pinned

    # chunks gathered at once: under ``auto`` the one computing, the next and ``max_prefetch`` in
    # flight; the other policies never prefetch and drop a chunk as soon as its module is done
    biggest = max(full_sizes, default=0)
    in_use = min(nonalias_full, ((2 + plugin.max_prefetch) if plugin.placement_policy == "auto" else 1) * biggest)
    ahead = tr.saved_ahead()
    cap = comp.capacity if comp.capacity < UNLIMITED else None
    auto = plugin.placement_policy == "auto"
    gloo = dev == "cpu" and w > 1  # gloo's reduce_scatter clones its input on the calling thread

    def spike(c) -> Tuple[int, int]:
        """``(accounted, unaccounted)`` compute-tier bytes beyond ``held(c)`` the moment chunk
        ``c``'s last gradient lands (``_reduce``, then ``_store_grad``). Accounted (Gemini counts
        them against its budget): the fp32 chunk buffer, the host copy an NVMe write takes, the
        RAM copy a RAM home takes (none when the buffer itself is adopted). Unaccounted: the
        reduce-scatter output, gloo's copy of its input, and for an NVMe home the float64 square
        taken for the clipping norm. gloo's copy is freed by whichever thread drops the work last
        (its worker or ours, a race): it is taken as alive until the gradient is stored, the worst
        case, which is what a budget must hold."""
        n4, full4 = 4 * c.shard_size, 4 * c.size
        split = c.sharded and w > 1
        out = n4 if split else 0
        clone = full4 if gloo and split else 0
        rs = (full4, clone + out)
        if dev != "cpu":  # the hand-off copies go to host RAM, another tier: only the device's part here
            store = (full4, out)
        elif c.optim_home == "nvme":
            host = 0 if not split else n4  # adopted: the buffer itself is written
            store = (full4 + host, clone + out + 4 * n4)
        else:
            store = (full4 + (0 if not split else n4), clone + out)
        acc, unacc = max(rs, store, key=sum)
        return acc - held(c), unacc

    at_reduce: Dict[int, List[Any]] = {}
    bwd_idx = [i for i, ph in enumerate(tr.phase) if ph == "bwd"]
    for cid, last in chunk_last.items():
        need = cum[last]
        i = next((j for j in bwd_idx if tr.grad[j] >= need), bwd_idx[-1] if bwd_idx else 0)
        at_reduce.setdefault(i, []).append(by_id[cid])

    def fb(i, other, g, saved):
        stored, buffers, pinned = grad_state(g)
        extra = [spike(c) for c in at_reduce.get(i, ())]
        stored += sum(a for a, _ in extra)
        work = min(nonalias_full, in_use + pinned)
        if auto:  # after warm-up: a used chunk stays cached while Gemini's bytes + activations ahead fit
            room = nonalias_full if cap is None else cap - homes_comp - stored - buffers - ahead[i]
            work = max(work, min(nonalias_full, room))
        return {"params": cats[comp.name]["params"], "optimizer": cats[comp.name]["optimizer"],
                "grads": stored + buffers, "activations": other, "working": work + sum(u for _, u in extra)}

    fbc, ph, _ = _peak_over(tr, fb)
    # ---- the optimizer step: cache dropped, then chunk by chunk (GeminiOptimizer._apply_step):
    # an NVMe home's state+gradient window is read (the next one read ahead), updated, and written
    # behind; a written-behind buffer stays in the write queue, alive and accounted on the host tier,
    # until room is needed (``_reserve``/``load_optim`` finish the oldest writes) or the step ends.
    host_name = "cpu"
    on_host = {"params": cats[host_name]["params"], "optimizer": cats[host_name]["optimizer"]}
    host_homes = on_host["params"] + on_host["optimizer"]
    host_cap = cap if host_name == comp.name else None
    ram_grads = {cid: v for cid, v in grads_ram.items() if by_id[cid].optim_home == host_name}
    left_grads = sum(ram_grads.values())
    pending, best = 0, None
    todo = [c for c in chunks if any(i.param.requires_grad for i in c.infos)]
    for j, c in enumerate(todo):
        nxt = todo[j + 1] if j + 1 < len(todo) else None
        wcur = optim_block_bytes(c) if c.optim_home == "nvme" else 0
        wnext = optim_block_bytes(nxt) if nxt is not None and nxt.optim_home == "nvme" else 0
        windows = wcur + wnext
        if host_cap is not None:  # the oldest writes are finished to make room for the windows
            pending = max(0, min(pending, host_cap - host_homes - left_grads - windows))
        cand = {**on_host, "grads": left_grads, "working": windows + pending}
        if best is None or sum(cand.values()) > sum(best.values()):
            best = cand
        left_grads -= ram_grads.get(c.id, 0)
        if c.optim_home == "nvme":
            pending += 12 * c.shard_size + (c.shard_bytes if c.param_home == "nvme" and dtype != torch.float32 else 0)
    step_host = best or {**on_host, "grads": 0, "working": 0}
    step = step_host if host_name == comp.name else {"params": cats[comp.name]["params"],
                                                      "optimizer": cats[comp.name]["optimizer"]}
    comp_cats, comp_phase = _max_cats((fbc, ph), (step, "optimizer step"))
    out_tiers = {comp.name: _tier(comp.name, env.capacity(comp.name), comp_cats, comp_phase)}
    if dev == "cuda":  # host RAM: homes there, the gradients handed to them, the step's windows
        out_tiers["cpu"] = _tier("cpu", env.capacity("cpu"), step_host, "optimizer step")
    if nvme_dir is not None:
        out_tiers["nvme"] = _tier("nvme", env.capacity("nvme") or stack.nvme.capacity,
                                  {"params": files["param"], "optimizer": files["state"], "grads": files["grad"]},
                                  "end of backward")
    # ---- traffic -------------------------------------------------------------------------
    traffic: Dict[str, int] = {}
    if nvme_dir is not None:
        # an NVMe-homed parameter chunk is read each time it is gathered: once a step when every
        # chunk stays cached, else at every run of accesses to it — forward in module order,
        # backward in reverse (Gemini gathers per module that owns parameters)
        keep = auto and (cap is None or nonalias_full + homes_comp + max(ahead, default=0) <= cap)
        seq_ids = [cid_of[n].id for call in tr.calls for n in call if n in cid_of]
        runs: Dict[int, int] = {}
        for s_ in (seq_ids, seq_ids[::-1]):
            for j, cid in enumerate(s_):
                if j == 0 or s_[j - 1] != cid:
                    runs[cid] = runs.get(cid, 0) + 1
        reads = sum(c.shard_bytes * (1 if keep else max(2, runs.get(c.id, 2))) for c in nvme_param_chunks)
        traffic["nvme->cpu"] = reads + files["state"] + files["grad"]
        traffic["cpu->nvme"] = files["grad"] + files["state"] + sum(c.shard_bytes for c in nvme_param_chunks)
    sharded = [c for c in chunks if c.sharded and w > 1]
    if sharded:
        keep_all = auto and cap is None
        traffic["allgather"] = int(sum(c.full_bytes for c in sharded) * (1 if keep_all else 2) * (w - 1) / w)
        traffic["reduce_scatter"] = int(sum(c.size * 4 for c in sharded) * (w - 1) / w)
    repl = [c for c in chunks if not c.sharded and w > 1]
    if repl:
        traffic["allreduce"] = int(sum(c.size * 4 for c in repl) * 2 * (w - 1) / w)
    homes = {}
    for c in chunks:
        homes.setdefault(f"param:{c.param_home}", 0)
        homes[f"param:{c.param_home}"] += 1
        homes.setdefault(f"optim:{c.optim_home}", 0)
        homes[f"optim:{c.optim_home}"] += 1
    notes.append(f"Gemini: {len(chunks)} chunks of {_fmt(size * dtype.itemsize)} ({plugin.pack_order} order), homes "
                 + ", ".join(f"{k} {v}" for k, v in sorted(homes.items()))
                 + f"; working-set reserve {_fmt(working_set_bytes(chunks, plugin.max_prefetch, comp.capacity))}")
    if limit is not None:
        notes.append(f"Gemini keeps its own bytes on the {comp.name} tier under device_memory_limit={_fmt(limit)}; "
                     "activations come on top (it leaves them room when caching)")
    rp = RankPlan(list(range(w)), "ZeRO-3 chunks" if sharded else "", out_tiers)
    layout = {"dp": w, "tp": 1, "pp": 1, "chunks": len(chunks), "chunk_bytes": size * dtype.itemsize,
              "placement": plugin.placement_policy, "refused": refused}
    return _Result([rp], traffic, _acts_summary(m, ac, dtype=dtype), layout, notes)


def _count_le(cum: List[int], g: int) -> int:
    import bisect

    return bisect.bisect_right(cum, g)


def _in_flight(style: str, pp: int, s: int, m: int, j: int) -> int:
    """Microbatches forwarded but not yet backwarded on pipeline rank ``s`` when backward ``j``
    starts: GPipe holds all of them, 1F1B (and, approximately, the interleaved and zero-bubble
    schedules) ``pp - s`` at most."""
    if pp == 1:
        return 1
    if style == "gpipe":
        return m - j
    return max(1, min(m - j, pp - s))


def _plan_hybrid(m: _Model, plugin, env: _Env, precision: str, opt: str, ac: bool) -> _Result:
    """HybridParallelPlugin: per pipeline stage (and tensor-parallel shard) the stage's own
    parameters, its microbatches in flight, receive buffers, and the data-parallel gradient sync."""
    from ..mixed_precision import autocast_dtype
    from ..pipeline.schedules import ScheduleSpec

    w, dev = env.world, env.compute_tier
    tp, pp, v = plugin.tp_size, plugin.pp_size, plugin.num_model_chunks
    dp = w // (tp * pp)
    b = m.batch
    if plugin.num_microbatches is not None:
        mb_n = plugin.num_microbatches
    elif plugin.microbatch_size is not None:
        mb_n = b // plugin.microbatch_size
    else:
        mb_n = 1
    if b % mb_n:
        raise ValueError(f"cl.plan(batch={b}): HybridParallelPlugin splits it into {mb_n} microbatches; pass a batch "
                         f"that is a multiple of {mb_n}")
    micro = b // mb_n
    low = autocast_dtype(precision) if precision != "fp32" else None
    tp_arg = None
    notes: List[str] = []
    nd_mode = getattr(plugin, "tp_mode", "1d")
    if tp > 1 and nd_mode != "1d":
        from ..tp_nd import apply as nd_apply

        nd_plan = nd_apply.resolve_plan(m.meta, plugin.tp_plan)  # ValueError naming what has no role
        nd_apply.check(m.meta, nd_plan, nd_mode, plugin.tp_grid, tp)  # blocks that do not cut evenly
        if callable(getattr(m.meta, "check_tp", None)):
            m.meta.check_tp(plugin.tp_grid["y" if nd_mode == "3d" else "row"])  # heads over the hidden cut
        key_nd = _NdKey(nd_mode, plugin.tp_grid, plugin.tp_depth, plugin.tp_plan)
        if b % (mb_n * key_nd.batch_shards):
            raise ValueError(f"cl.plan(batch={b}): HybridParallelPlugin(tp_mode={nd_mode!r}) cuts each batch into "
                             f"{key_nd.batch_shards} row pieces, then {mb_n} microbatches; pass a batch that is a "
                             f"multiple of {key_nd.batch_shards * mb_n}")
        tp_arg = (tp, key_nd)
    elif tp > 1:
        tplan = plugin.tp_plan if plugin.tp_plan is not None else (
            m.meta.tp_plan(sequence_parallel=plugin.sequence_parallel) if callable(getattr(m.meta, "tp_plan", None)) else None)
        if tplan is None:
            raise ValueError(f"cl.plan: HybridParallelPlugin(tp_size={tp}) needs the model's tp_plan() or tp_plan=...")
        if callable(getattr(m.meta, "check_tp", None)):
            m.meta.check_tp(tp)
        tp_arg = (tp, _PlanKey(tplan))
        if plugin.sequence_parallel:
            notes.append("sequence_parallel: activations estimated as without it (norm inputs taken whole)")
    spec = ScheduleSpec(plugin.pp_style, pp, v, mb_n)
    n_stages = spec.num_stages
    groups: List[RankPlan] = []
    traffic: Dict[str, int] = {}
    cap = env.capacity(dev)
    worst_act = {"without_checkpointing": 0, "with_checkpointing": 0 if m.supports_ac() else None, "checkpointing": ac}
    for s in range(pp):
        stage_ids = spec.stage_indices(s)
        traces, params, bufs = [], {}, 0
        for sid in stage_ids:
            key = (sid, n_stages) if n_stages > 1 else None
            tr = m.trace(ac=ac, autocast=low, micro=micro, stage=key, tp=tp_arg)
            traces.append((sid, tr))
            part = (dict(tr.param_bytes), tr.buffer_bytes) if tr.param_bytes is not None else _stage_params(m, key, tp_arg)
            params.update(part[0])
            bufs += part[1]
            summ = _acts_summary(m, ac, autocast=low, micro=micro, stage=key, tp=tp_arg)
            worst_act["without_checkpointing"] = max(worst_act["without_checkpointing"], summ["without_checkpointing"])
            if worst_act["with_checkpointing"] is not None and summ["with_checkpointing"] is not None:
                worst_act["with_checkpointing"] = max(worst_act["with_checkpointing"], summ["with_checkpointing"])
        P = sum(params.values())
        G = sum(params.values())  # gradients in the parameters' dtype (fp32 masters)
        numel = sum(n // 4 for n in params.values())
        largest = max(params.values(), default=0)
        if plugin.zero_stage == 1 and dp > 1:
            S = _opt_bytes(-(-numel // dp), opt)
            notes.append("ZeRO-1 over dp: optimizer state taken as an even split (ZeroRedundancyOptimizer's greedy partition)")
        else:
            S = _opt_bytes(numel, opt)
        # receive buffers, one per microbatch, kept by torch's PipelineStage: activations in, gradients in
        recv = 0
        for sid, tr in traces:
            if sid > 0:
                prev = m.trace(ac=ac, autocast=low, micro=micro, stage=(sid - 1, n_stages), tp=tp_arg)
                recv += mb_n * _meta_bytes(prev.out_meta)
            if sid < n_stages - 1:
                recv += mb_n * _meta_bytes(tr.out_meta)
        cands = []
        for sid, tr in traces:
            act = tr.act_end
            n0 = _in_flight(plugin.pp_style, pp, s, mb_n, 0) * (v if v > 1 else 1)
            n1 = _in_flight(plugin.pp_style, pp, s, mb_n, 1) * (v if v > 1 else 1) if mb_n > 1 else 0

            def at(grads_fn, k):
                return lambda i, o, g, sv: {"params": P + bufs, "grads": grads_fn(g), "optimizer": S,
                                            "activations": o + (k - 1) * act, "working": recv}

            cands.append(_peak_over(tr, at(lambda g: g, n0))[:2])  # the first backward: gradients arriving
            if n1:
                cands.append(_peak_over(tr, at(lambda g: G, n1))[:2])  # later ones: every gradient exists
        flat = G if dp > 1 else 0  # _sync_grads concatenates the gradients per dtype for one all-reduce
        step = {"params": P + bufs, "grads": G, "optimizer": S,
                "working": recv + flat + _step_temp(largest, G, dev, opt)}
        cats, phase = _max_cats(*cands, (step, "optimizer step"))
        ranks = [d * pp * tp + s * tp + t for d in range(dp) for t in range(tp)]
        role = f"stage {s}" + (f" (stages {stage_ids})" if len(stage_ids) > 1 else "") if pp > 1 else ""
        if tp > 1:
            role = (role + " · " if role else "") + f"tp shard 1/{tp}" + (f" ({nd_mode})" if nd_mode != "1d" else "")
        groups.append(RankPlan(ranks, role, {dev: _tier(dev, cap, cats, phase)}))
        if dp > 1:
            traffic["allreduce"] = max(traffic.get("allreduce", 0), int(2 * (dp - 1) / dp * G))
        if pp > 1:
            p2p = 0
            for sid, tr in traces:
                if sid > 0:
                    prev = m.trace(ac=ac, autocast=low, micro=micro, stage=(sid - 1, n_stages), tp=tp_arg)
                    p2p += 2 * mb_n * _meta_bytes(prev.out_meta)  # activations in, gradients out
                if sid < n_stages - 1:
                    p2p += 2 * mb_n * _meta_bytes(tr.out_meta)
            traffic["p2p"] = max(traffic.get("p2p", 0), p2p)
    if tp > 1 and nd_mode != "1d":
        notes.append(f"tensor parallel {nd_mode}: each rank's layers traced in their grid form on its blocks and rows, "
                     "collectives on a fake process group (what they receive and gather is counted)")
    elif tp > 1:
        tr0 = m.trace(ac=ac, autocast=low, micro=micro, stage=(0, n_stages) if n_stages > 1 else None, tp=tp_arg)
        notes.append("tensor parallel: parameters of the plan's Linear/Embedding layers at their shard's shape; "
                     "the all-reduce of row-parallel outputs is not in the trace")
        if tr0.error:
            notes.append(tr0.error)
    layout = {"dp": dp, "tp": tp, "pp": pp, "microbatches": mb_n, "microbatch": micro, "pp_style": plugin.pp_style,
              "zero_stage": plugin.zero_stage}
    if tp > 1 and nd_mode != "1d":
        layout.update(tp_mode=nd_mode, tp_grid=dict(plugin.tp_grid))
    return _Result(groups, traffic, worst_act, layout, notes)


class _NdKey:
    """An N-d tensor-parallel layout (``tp_mode`` 2d/2.5d/3d) in a trace's key: the mode, the grid's
    axis sizes, and the plugin's 1D ``tp_plan`` override (the model's ``tp_nd_plan()`` first)."""

    def __init__(self, mode: str, sizes: Dict[str, int], depth: int, plan: Optional[dict]):
        from ..tp_nd.grid import layouts

        self.mode, self.sizes, self.depth, self.plan = mode, tuple(sorted(sizes.items())), depth, plan
        self.tp_size = math.prod(sizes.values())
        self.batch_shards = math.prod(sizes[a] for a in layouts(mode)[0].batch)

    def __hash__(self):
        return hash((self.mode, self.sizes))

    def __eq__(self, other):
        return isinstance(other, _NdKey) and (self.mode, self.sizes) == (other.mode, other.sizes)


@contextlib.contextmanager
def _fake_world(size: int):
    """A default process group of ``size`` ranks that never communicates (torch's ``fake`` backend,
    ``torch.testing._internal.distributed.fake_pg``): this process plays rank 0 of an N-d grid while
    the fake tensors run its layers. Only where no process group exists (the notebook, a planner):
    one process can hold one default group."""
    import torch.distributed as dist

    if not dist.is_available():
        raise _NoFakeWorld("torch.distributed is not available")
    if dist.is_initialized():
        raise _NoFakeWorld("a process group exists in this process")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _NoFakeWorld(RuntimeError):
    pass


class _PlanKey:
    """A tp plan that can sit in a cache key (plans hold unhashable styles)."""

    def __init__(self, plan: dict):
        self.plan = plan

    def __hash__(self):
        return hash(tuple(sorted(self.plan)))

    def __eq__(self, other):
        return isinstance(other, _PlanKey) and sorted(self.plan) == sorted(other.plan)


def _meta_bytes(meta) -> int:
    shape, dtype = meta
    return math.prod(shape) * dtype.itemsize


def _stage_params(m: _Model, stage, tp_arg) -> Tuple[Dict[str, int], int]:
    """``({name: bytes}, buffer bytes)`` of one pipeline stage's part on one tensor-parallel rank."""
    if tp_arg and isinstance(tp_arg[1], _NdKey):  # the converted modules' own blocks
        tr = m.trace(ac=False, stage=stage, tp=tp_arg)
        return dict(tr.param_bytes), tr.buffer_bytes
    part = m.meta
    if stage is not None:
        from ..pipeline.stage import split_stage

        part = split_stage(m.meta, *stage)
    shapes = _tp_shapes(m.meta, tp_arg[0], tp_arg[1].plan) if tp_arg else {}
    out = {}
    for n, p in _unique_params(part):
        shape = shapes.get(n, p.shape)
        out[n] = math.prod(shape) * p.dtype.itemsize
    return out, sum(_nbytes(b) for b in part.buffers())


# ---------------------------------------------------------------------------------------------
# the entry point
# ---------------------------------------------------------------------------------------------
_PLUGINS = ("None", "DDPPlugin", "LowLevelZeroPlugin", "GeminiPlugin", "HybridParallelPlugin")


def _precision(plugin, precision: Optional[str]) -> str:
    from ..mixed_precision import PRECISIONS, resolve_precision

    name = type(plugin).__name__ if plugin is not None else "None"
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"cl.plan(precision={precision!r}): choose one of {list(PRECISIONS)} or None (the plugin's)")
    if name in ("GeminiPlugin", "HybridParallelPlugin"):
        return resolve_precision(precision, plugin.precision, name)
    return precision or "fp32"


def _compose(m: _Model, plugin, env: _Env, precision: str, opt: str, ac: bool) -> _Result:
    name = type(plugin).__name__ if plugin is not None else "None"
    if name == "GeminiPlugin":
        return _plan_gemini(m, plugin, env, precision, opt, ac)
    if name == "HybridParallelPlugin":
        return _plan_hybrid(m, plugin, env, precision, opt, ac)
    return _plan_replicated(m, plugin, env, precision, opt, ac)


def plan(model_or_config, plugin=None, *, world_size: int = 1, batch: int = 1, seq: Optional[int] = None,
         device_memory: Optional[int] = None, host_memory: Optional[int] = None, nvme_dir: Optional[str] = None,
         precision: Optional[str] = None, optimizer: str = "adamw", activation_checkpointing: Optional[bool] = None,
         device: Optional[str] = None, inputs: Optional[Callable] = None,
         loss_fn: Optional[Callable] = None) -> FitPlan:
    """Predict, per rank and tier, the peak bytes one training step of ``model_or_config`` takes
    under ``plugin`` on ``world_size`` ranks — without allocating the model.

    Args:
        model_or_config: an ``nn.Module`` (real, meta, or built under ``lazy_init()``), a ``GPTConfig``,
            or any config with ``build()`` (the model contract).
        plugin: ``None`` (one process), ``DDPPlugin``, ``LowLevelZeroPlugin``, ``GeminiPlugin`` or
            ``HybridParallelPlugin`` — the object you would hand to ``Booster``; its arguments count.
        world_size: ranks in the run.
        batch: samples each data-parallel rank takes per step (the dataloader's ``batch_size``; under
            a pipeline, the batch ``execute_pipeline`` splits into microbatches).
        seq: tokens per sample (default: the config's ``block_size``).
        device_memory: bytes of the compute device per rank (default: the GPU's total memory; on a
            CPU-only machine the compute device is host RAM, so this caps the ``cpu`` tier).
        host_memory: bytes of host RAM per rank (default: this machine's RAM / ``world_size``).
        nvme_dir: a directory for the NVMe tier (default: the plugin's ``nvme_offload_dir``); its free
            space / ``world_size`` is the tier's capacity.
        precision: ``Booster(mixed_precision=...)`` as you will pass it (None: the plugin's own).
        optimizer: ``"adamw"`` (default), ``"adam"``, ``"sgd"`` or ``"sgd_momentum"`` (state per parameter).
        activation_checkpointing: None takes it from the model (``GPTConfig.activation_checkpointing``)
            or the hybrid plugin; True/False forces it.
        device: ``"cuda"`` or ``"cpu"`` (None: this machine's).
        inputs: ``inputs(batch, seq) -> tuple`` of one sample batch for models that do not take token
            ids (built on fake tensors, so ``torch.randn`` is free); ``loss_fn(output, inputs) -> loss``.

    Returns a :class:`FitPlan`. Raises ``ValueError``/``TypeError`` naming the argument for bad input.
    """
    return _plan(model_or_config, plugin, world_size=world_size, batch=batch, seq=seq, device_memory=device_memory,
                 host_memory=host_memory, nvme_dir=nvme_dir, precision=precision, optimizer=optimizer,
                 activation_checkpointing=activation_checkpointing, device=device, inputs=inputs, loss_fn=loss_fn,
                 cache=None)


class TraceCache:
    """Plans many layouts of one model, sharing the step traces of those with the same per-rank
    batch, sequence and device (a layout search plans dozens). ``cache.plan(...)`` takes
    :func:`plan`'s arguments and returns its :class:`FitPlan` without the advice (which re-plans)."""

    def __init__(self):
        self._models: Dict[tuple, "_Model"] = {}

    def plan(self, model_or_config, plugin=None, **kw) -> FitPlan:
        return _plan(model_or_config, plugin, cache=self._models, **kw)


def _plan(model_or_config, plugin=None, *, world_size: int = 1, batch: int = 1, seq: Optional[int] = None,
          device_memory: Optional[int] = None, host_memory: Optional[int] = None, nvme_dir: Optional[str] = None,
          precision: Optional[str] = None, optimizer: str = "adamw", activation_checkpointing: Optional[bool] = None,
          device: Optional[str] = None, inputs: Optional[Callable] = None, loss_fn: Optional[Callable] = None,
          cache: Optional[dict] = None) -> FitPlan:
    name = type(plugin).__name__ if plugin is not None else "None"
    if name not in _PLUGINS:
        raise TypeError(f"cl.plan(plugin={name}): unknown plugin; pass None, DDPPlugin, LowLevelZeroPlugin, "
                        "GeminiPlugin or HybridParallelPlugin (from ..plugins)")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"cl.plan(world_size={world_size!r}): must be an int >= 1")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"cl.plan(batch={batch!r}): must be an int >= 1 (samples per data-parallel rank per step)")
    if optimizer not in _OPT_STATE:
        raise ValueError(f"cl.plan(optimizer={optimizer!r}): choose one of {list(_OPT_STATE)}")
    if name == "HybridParallelPlugin":
        tp, pp = plugin.tp_size, plugin.pp_size
        if world_size % (tp * pp):
            ok = [k * tp * pp for k in range(1, 5)]
            raise ValueError(f"cl.plan(world_size={world_size}): HybridParallelPlugin(tp_size={tp}, pp_size={pp}) needs "
                             f"a world size divisible by tp_size * pp_size = {tp * pp}; use world_size in {ok} or "
                             "smaller tp_size/pp_size")
    if nvme_dir is None and name == "GeminiPlugin":
        nvme_dir = plugin.nvme_offload_dir
    if seq is None:
        seq = getattr(getattr(model_or_config, "cfg", model_or_config), "block_size", None)
        if seq is None:
            raise ValueError("cl.plan(seq=None): the model has no block_size; pass seq= (tokens per sample)")
    if not isinstance(seq, int) or seq < 1:
        raise ValueError(f"cl.plan(seq={seq!r}): must be an int >= 1")
    env = _env(device, world_size, device_memory, host_memory, nvme_dir)
    prec = _precision(plugin, precision)
    key = (batch, seq, env.device)
    m = cache.get(key) if cache is not None else None
    if m is None:
        m = _Model(model_or_config, inputs, loss_fn, batch, seq, env.device)
        if cache is not None:
            cache[key] = m
    ac = activation_checkpointing
    if ac is None:
        ac = m.ac_enabled() or bool(getattr(plugin, "activation_checkpointing", False))
    if ac and not m.supports_ac():
        raise ValueError(f"cl.plan(activation_checkpointing=True): {m.name} has no enable_activation_checkpointing() "
                         "and is not an nn.Sequential; pass activation_checkpointing=False")
    try:
        res = _compose(m, plugin, env, prec, optimizer, ac)
    except _NoFakeWorld as why:
        res = _nd_as_1d(model_or_config, plugin, world_size, batch, seq, env, prec, optimizer, ac, inputs, loss_fn,
                        str(why))
    if m.traced_elsewhere:
        res.notes.append(f"traced with CPU kernels (this torch has no CUDA): activations on {env.device} may "
                         "differ where its kernels save other tensors (e.g. flash attention)")
    fp = FitPlan(plugin=name, world_size=world_size, batch=batch, seq=seq, precision=prec, device=env.device,
                 model={"name": m.name, "params": m.numel, "param_bytes": m.param_bytes, "buffer_bytes": m.buffer_bytes},
                 layout=res.layout, ranks=res.ranks, activations=res.act, traffic=res.traffic, notes=res.notes)
    if res.layout.get("refused"):
        fp.blocked = res.layout["refused"]
    fp.advice = _advice(fp, m, plugin, env, prec, optimizer, ac) if cache is None else []
    return fp


def _nd_as_1d(model_or_config, plugin, world_size, batch, seq, env, prec, opt, ac, inputs, loss_fn, why) -> _Result:
    """An N-d layout where no fake process group can be made (this process already has a group):
    the rank planned as 1D over the grid's hidden cut ``q`` on its ``1/nb`` of the rows, an upper
    bound (N-d holds ``1/tp`` of the linears' parameters, 1D over q ``1/q``; and N-d cuts the stream
    between blocks ``q`` ways, 1D keeps it whole)."""
    import dataclasses

    from ..tp_nd.grid import layouts

    sizes = plugin.tp_grid
    q = sizes["y" if plugin.tp_mode == "3d" else "row"]
    nb = math.prod(sizes[a] for a in layouts(plugin.tp_mode)[0].batch)
    as_1d = copy.copy(plugin)
    as_1d.tp_size, as_1d.tp_mode, as_1d.tp_depth, as_1d.tp_grid = q, "1d", 1, {"tp": q}
    m = _Model(model_or_config, inputs, loss_fn, max(1, batch // nb), seq, env.device)
    env1 = dataclasses.replace(env, world=max(1, world_size // nb))
    res = _compose(m, as_1d, env1, prec, opt, ac)
    res.notes.append(f"tensor parallel {plugin.tp_mode}: planned as 1D over q={q} on 1/{nb} of the rows, an upper "
                     f"bound ({why}; call cl.plan where no process group exists for the N-d trace)")
    res.layout.update(tp=plugin.tp_size, tp_mode=plugin.tp_mode, tp_grid=dict(sizes))
    return res


def _worst_over(fp: FitPlan, tier: str) -> int:
    return max((g.tiers[tier].peak - g.tiers[tier].capacity for g in fp.ranks
                if tier in g.tiers and g.tiers[tier].capacity is not None), default=0)


def _advice(fp: FitPlan, m: _Model, plugin, env: _Env, prec: str, opt: str, ac: bool) -> List[str]:
    """Concrete changes, each with what it saves on the tightest tier (re-planned where cheap)."""
    out: List[str] = []
    name = fp.plugin
    dev = env.compute_tier
    blocked = getattr(fp, "blocked", None)
    over = _worst_over(fp, dev)
    peak = fp.peak(dev)

    def replan(pl, ac_):
        try:
            r = _compose(m, pl, env, prec, opt, ac_)
        except Exception:
            return None
        return max((g.tiers[dev].peak for g in r.ranks if dev in g.tiers), default=0)

    if fp.fits and not blocked:
        return out
    if over > 0 or blocked:
        if not ac and m.supports_ac():
            alt = replan(plugin, True)
            if alt is not None and alt < peak:
                out.append(f"activation checkpointing saves {_fmt(peak - alt)} per rank on {dev} "
                           f"(peak {_fmt(peak)} -> {_fmt(alt)}): GPTConfig(activation_checkpointing=True)"
                           + (" or HybridParallelPlugin(activation_checkpointing=True)" if name == "HybridParallelPlugin" else ""))
        act = fp.activations.get("with_checkpointing" if ac else "without_checkpointing") or 0
        if fp.batch > 1 and act:
            out.append(f"batch={fp.batch // 2} (half) saves about {_fmt(act / 2)} of activations per rank; keep the "
                       f"global batch with gradient accumulation (booster.no_sync) or more ranks")
        from ..plugins import GeminiPlugin, LowLevelZeroPlugin

        if name in ("None", "DDPPlugin") or (name == "LowLevelZeroPlugin" and plugin.stage == 1):
            if env.world > 1:
                alt = replan(LowLevelZeroPlugin(stage=2), ac)
                if alt is not None and alt < peak:
                    out.append(f"LowLevelZeroPlugin(stage=2) shards gradients and optimizer state: peak {_fmt(peak)} -> "
                               f"{_fmt(alt)} per rank")
            gp = GeminiPlugin(placement_policy="auto", precision=prec if prec in ("fp32", "bf16", "fp16") else "bf16",
                              nvme_offload_dir=env.nvme_dir, nvme_offload_frac=1.0 if env.nvme_dir else 0.0,
                              device_memory_limit=(env.compute // 2) if env.compute else None)
            alt = replan(gp, ac)
            if alt is not None and alt < peak:
                out.append(f"GeminiPlugin(placement_policy='auto'{', nvme_offload_dir=' + repr(env.nvme_dir) if env.nvme_dir else ''}"
                           f") moves parameters and optimizer state off the {dev} tier: peak -> {_fmt(alt)}")
        if name == "GeminiPlugin":
            if plugin.nvme_offload_dir is None:
                need = 16 * m.numel // env.world
                out.append(f"add nvme_offload_dir=... (GeminiPlugin(placement_policy='auto', nvme_offload_dir=...)): "
                           f"the optimizer state ({_fmt(need)} per rank with gradients) can live on disk")
            elif plugin.nvme_offload_frac < 1.0:
                out.append("nvme_offload_frac=1.0 keeps all optimizer state on NVMe")
            if plugin.placement_policy != "auto":
                out.append("placement_policy='auto' fills the compute tier and spills the rest down the stack")
        if name == "HybridParallelPlugin" or (name in ("None", "DDPPlugin") and env.world > 1):
            tp = getattr(plugin, "tp_size", 1)
            heads = getattr(getattr(m.meta, "cfg", None), "n_head", None)
            if callable(getattr(m.meta, "tp_plan", None)) and env.world % (2 * tp) == 0 and (heads is None or heads % (2 * tp) == 0):
                out.append(f"tp_size={2 * tp} (HybridParallelPlugin) splits every block's weights and activations "
                           f"over {2 * tp} ranks")
            pp = getattr(plugin, "pp_size", 1)
            if callable(getattr(m.meta, "num_layers", None)) and m.meta.num_layers() % (2 * pp) == 0 \
                    and env.world % (2 * pp * tp) == 0:
                out.append(f"pp_size={2 * pp} (HybridParallelPlugin) holds 1/{2 * pp} of the layers per rank")
        if env.device == "cpu" or env.compute is None:
            pass
        else:
            out.append(f"a device with more than {_fmt(peak)} per rank, or world_size={2 * env.world} with a sharding plugin")
    if "nvme" in fp.tiers and _worst_over(fp, "nvme") > 0:
        out.append(f"free {_fmt(_worst_over(fp, 'nvme') * env.world)} on nvme_dir, choose a larger disk, or lower "
                   "nvme_offload_frac")
    if blocked and not out:
        out.append(blocked)
    return out


# ---------------------------------------------------------------------------------------------
# measuring the real thing
# ---------------------------------------------------------------------------------------------
_MARK = 7_999_993  # odd byte counts no tensor of ours has: a mark in the allocator's event stream


def _count_every_thread() -> None:
    """Turn on c10's process-wide CPU allocation counter (``FLAGS_caffe2_report_cpu_memory_usage``,
    an exported flag of ``libc10``). With it, ``ProfiledCPUMemoryReporter`` keeps one table and one
    running total of live CPU blocks for *every* thread — gloo's and Gemini's IO workers included —
    and the profiler's allocation events carry that total. It stays on for the process (turning it
    off would leave the table with blocks it can no longer uncount); its per-block log line is at
    INFO level, below c10's default WARNING."""
    import ctypes

    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True


class measure:
    """Peak bytes a run really holds, per tier, on this process.

        with measure(nvme_dir=d) as meter:
            model, optim, *_ = booster.boost(model, optim)
            meter.start_window()            # optional: peaks from here on (e.g. after boost)
            train()
        meter.peak                           # {"cpu": bytes, "nvme": bytes} (and "cuda" on a GPU)

    * ``cpu``: the peak of live tensor bytes held through PyTorch's CPU allocator, counted from the
      ``with`` (what was live before is not counted). ``torch.profiler.profile(profile_memory=True)``
      records this thread's allocations and frees; with c10's process-wide counter on
      (:func:`_count_every_thread`) each event carries the live total of every thread, so a block
      another thread frees (gloo's worker dropping a collective's buffer) or allocates is in it.
      Not RSS (allocator slack, the Python heap, libraries). Between two events of this thread a
      short-lived block of another thread can be missed.
    * ``cuda``: ``torch.cuda.max_memory_allocated`` over the window.
    * ``nvme``: the most bytes of files this process's offload directory held (Gemini's
      ``gemini-<pid>-*`` under ``nvme_dir``), sampled every ``interval`` seconds on a thread.

    ``samples(rank)`` gives the peaks as ``MemorySample`` events (``used = peak = bytes``) for the
    dashboard's FitPlan overlay.
    """

    def __init__(self, nvme_dir: Optional[str] = None, interval: float = 0.002):
        self.nvme_dir, self.interval = nvme_dir, interval
        self.peak: Dict[str, int] = {}
        self.final = 0
        self._marks = 0
        self._nvme_peak = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "measure":
        from torch.profiler import ProfilerActivity, profile

        _count_every_thread()
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        self._mark()  # the baseline: the live total when the with began
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        if self.nvme_dir is not None:
            self._thread = threading.Thread(target=self._sample_nvme, name="plan-measure-nvme", daemon=True)
            self._thread.start()
        return self

    def _mark(self) -> None:
        self._marks += 1
        torch.empty(_MARK + self._marks, dtype=torch.uint8)  # freed at once: a mark in the event stream

    def start_window(self) -> None:
        """Peaks count from here (what was allocated since the ``with`` began still counts as live)."""
        self._mark()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._nvme_peak = self._nvme_now()

    def _nvme_now(self) -> int:
        root, pid = self.nvme_dir, f"gemini-{os.getpid()}-"
        try:
            mine = [os.path.join(root, d) for d in os.listdir(root) if d.startswith(pid)]
        except FileNotFoundError:
            return 0
        total = 0
        for d in mine:
            for base, _, files in os.walk(d):
                for f in files:
                    try:
                        total += os.stat(os.path.join(base, f)).st_size
                    except FileNotFoundError:  # removed while we walk
                        pass
        return total

    def _sample_nvme(self) -> None:
        while not self._stop.is_set():
            self._nvme_peak = max(self._nvme_peak, self._nvme_now())
            self._stop.wait(self.interval)

    def __exit__(self, *exc) -> bool:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._nvme_peak = max(self._nvme_peak, self._nvme_now())
            self.peak["nvme"] = self._nvme_peak
        self._prof.__exit__(*exc)
        if torch.cuda.is_available():
            self.peak["cuda"] = int(torch.cuda.max_memory_allocated())
        self.peak["cpu"] = self._replay()
        return False

    def _replay(self) -> int:
        from torch._C._profiler import _EventType

        events, stack = [], list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            if e.tag == _EventType.Allocation:
                f = e.extra_fields
                if f.device.type == "cpu":
                    events.append((e.start_time_ns, f.alloc_size, f.total_allocated))
            else:
                stack.extend(e.children)
        events.sort(key=lambda x: x[0])
        base = peak = None
        cur = 0
        for _, size, total in events:
            if _MARK < size <= _MARK + self._marks:
                if base is None:  # the first mark: the live total before the with's work
                    base = total - size
                peak = total - size - base  # a window starts: from what is live now
                continue
            if base is None:
                continue
            cur = total - base
            peak = max(peak, cur)
        self.final = cur
        return int(peak or 0)

    def samples(self, rank: int = 0) -> list:
        """The peaks as telemetry ``MemorySample`` events (``used`` and ``peak`` = the peak)."""
        from ..telemetry import MemorySample

        now = time.time()
        return [MemorySample(rank=rank, time=now, tier=t, used=int(v), capacity=0, peak=int(v))
                for t, v in self.peak.items()]


# ``cl.plan.measure`` / ``cl.plan.FitPlan``: the meter and the result type, reached from the planner itself
plan.measure = measure
plan.FitPlan = FitPlan
