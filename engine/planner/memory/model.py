"""The model side every plugin's memory model asks of: the model without memory, and its traced
steps, cached by what changes them.

The model is never allocated. A module's parameters and buffers are mapped to meta tensors
(``copy.deepcopy`` with a memo: tied weights stay tied, a ``lazy_init`` model is used as it is); a
``GPTConfig`` or any config with ``build()`` (the model contract, ``engine/models/protocol.py``) is
built under the meta device. A step is traced (``trace.py``) on a fake copy of the whole model, of a
pipeline stage's part (``pipeline_stage``), of a 1D tensor-parallel rank's parameters at its shard's
shape (the model's ``tp_plan()``), or of an N-d rank's grid-form layers (``nd.py``).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn

from .nd import _fake_world, _NdKey
from .trace import _enable_ac, _fake_copy, _first_tensor, _nbytes, _simulate, _Trace, _unique_params


def _meta_model(model_or_config) -> Tuple[nn.Module, str]:
    """A copy of the model whose parameters and buffers are meta tensors (no memory)."""
    from ...models.hf import is_hf_model
    from ...models.hf.planning import is_hf_config

    if is_hf_model(model_or_config) or is_hf_config(model_or_config):
        from ...models.hf.version import check_floor

        check_floor("transformers")
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
    if is_hf_config(model_or_config):  # a transformers config: its model class, built on meta
        from ...models.hf.planning import meta_model

        m = meta_model(model_or_config)
        return m, type(m).__name__
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
                    "lazy_init), a transformers config, or a config with build() (the model contract, "
                    "colossal_lab.engine.models.protocol.ModelConfig)")


def _config_of(model):
    """The model's config: ours (``cfg``) or transformers' (``config``), None without one."""
    cfg = getattr(model, "cfg", None)
    return cfg if cfg is not None else getattr(model, "config", None)


def context_length(model_or_config) -> Optional[int]:
    """Tokens per sample the model takes at most: our config's ``block_size``, a transformers config's
    ``max_position_embeddings`` (``n_positions`` for GPT-2); None when it names none."""
    cfg = _config_of(model_or_config)
    if cfg is None:
        cfg = model_or_config
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    return _context(cfg)[0]


def _context(cfg) -> Tuple[Optional[int], str]:
    for name in ("block_size", "max_position_embeddings", "n_positions"):
        n = getattr(cfg, name, None)
        if isinstance(n, int) and n > 0:
            return n, name
    return None, ""


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
        self.shapes_only = False  # an HF tp rank by shard shapes: its sharding failed to trace, or no fake world
        cfg = _config_of(self.meta)
        if hasattr(cfg, "get_text_config"):
            cfg = cfg.get_text_config()
        self.vocab = getattr(cfg, "vocab_size", None)
        if self.vocab is None:
            emb = next((m for m in self.meta.modules() if isinstance(m, nn.Embedding)), None)
            self.vocab = emb.num_embeddings if emb is not None else None
        block, name = _context(cfg)
        if block is not None and seq > block:
            raise ValueError(f"cl.plan(seq={seq}): the model's {name} is {block} (tokens per sample at most); "
                             f"pass seq <= {block}")

    def supports_ac(self) -> bool:
        from ...models.protocol import checkpointing_method

        return (checkpointing_method(self.meta) is not None
                or isinstance(self.meta, nn.Sequential))

    def ac_enabled(self) -> bool:
        """The model checkpoints by its own choice (the model contract's ``activation_checkpointing_enabled``)."""
        return _checkpoints_itself(self.meta)

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
        opts = (tp[1].sequence_parallel, tp[1].loss_parallel) if tp and isinstance(tp[1], _PlanKey) else ()
        key = (ac, autocast, dtype, b, stage, tp[0] if tp else 1, nd.mode if nd else "1d", nd.depth if nd else 1, opts)
        if key in self._traces:
            return self._traces[key]
        from torch._subclasses.fake_tensor import FakeTensorMode

        from ...models.hf import reads_dict_plan

        mode = FakeTensorMode(allow_non_fake_inputs=False)
        shapes = _tp_shapes(self.meta, tp[0], tp[1].plan) if tp and nd is None else None
        part = self.meta
        # N-d: this rank's piece of the (micro)batch, cut over the stream layout's batch axes
        first, last, make = True, True, self.token_inputs(b // nd.batch_shards if nd else b)
        if stage is not None:
            s, n = stage
            from ...pipeline.stage import split_stage

            part = split_stage(self.meta, s, n)  # a copy of meta tensors: free
            first, last = s == 0, s == n - 1
            if not first:
                prev = self.trace(ac=ac, autocast=autocast, dtype=dtype, micro=micro, stage=(s - 1, n), tp=tp)
                shape, dt = prev.out_meta
                dev = self.device

                def make():  # the previous stage's output, as this stage's input
                    return (torch.empty(shape, dtype=dt, device=dev),)

        with contextlib.ExitStack() as scope:  # the fake process group (N-d) ends with the trace, however it ends
            hf_tp = None
            if shapes is not None and reads_dict_plan(self.meta):
                from .hf_tp import HfTp

                hf_tp = HfTp(tp[0], tp[1].plan, tp[1].sequence_parallel, tp[1].loss_parallel)
            tr = self._trace_on(scope, part, mode, shapes, nd, make, first, last, ac, autocast, dtype, micro, stage, b,
                                hf_tp)
        self._traces[key] = tr
        return tr

    def _trace_on(self, scope, part, mode, shapes, nd, make, first, last,
                  ac, autocast, dtype, micro, stage, b, hf_tp=None) -> _Trace:
        """:meth:`trace`'s fake step on ``part`` (the whole model or a stage); an N-d layout's fake
        process group is entered on ``scope``, so it ends with the trace however the trace ends."""
        from . import hf_tp as hft

        # a transformers model's 1D rank, whole: sharded as the plugin shards it (DTensor, on a fake mesh)
        real_tp = hf_tp is not None and stage is None and not self.shapes_only
        if real_tp and not hft.can_fake_world():  # a process group exists here (a rank): the shard shapes
            self.shapes_only, real_tp = True, False
        fake = _fake_copy(part, mode, dtype=dtype, device=self.device, shapes=None if real_tp else shapes)
        from .moe_trace import balanced

        balanced(fake)  # MoE blocks: routing taken as balanced (their counts are data-dependent)
        forward, backward_ctx = None, contextlib.nullcontext
        if real_tp:
            hft.shard_as_plugin(scope, fake, mode, self.device, hf_tp)
            if self.inputs is None and self.loss_fn is None and self.vocab is not None:
                forward, backward_ctx = hft.labelled_forward, hft.backward_context
        elif shapes and hf_tp is not None:  # a transformers model counting heads by attribute: one rank's share
            from ...models.hf.planning import per_rank

            per_rank(fake, hf_tp.plan, hf_tp.size)
        gloo = contextlib.nullcontext()
        if nd is not None:
            _convert_nd(scope, fake, mode, nd)
        if ac:
            _enable_ac(fake)
        elif _checkpoints_itself(fake):  # switched off on the copy (the user's model is untouched)
            from ...autockpt_request import take

            take(fake)  # no request planned on fake tensors
            fake.enable_activation_checkpointing([])
        fake.train()
        loss_fn = self._loss_for(nd, first, last, b) if forward is None else hft.model_loss
        if nd is not None and self.device == "cpu":
            from ...tp_nd import counter

            gloo = counter.simulate_gloo()  # CPU ranks talk gloo, which copies a reduce-scatter's input
        elif real_tp:
            gloo = hft.quiet_propagation()  # DTensor's global-shape placeholders are no rank's memory
        try:
            with gloo:
                tr = _simulate(fake, mode, make, autocast=autocast, device=self.device, loss_fn=loss_fn,
                               last=last, input_grad=not first, forward=forward, backward_ctx=backward_ctx)
            if nd is not None:
                tr.param_bytes = {n: _nbytes(p) for n, p in _unique_params(fake)}
                tr.buffer_bytes = sum(_nbytes(t) for t in fake.buffers())
        except Exception as exc:
            if real_tp:  # the plugin's sharding did not trace on fake tensors: the shard shapes instead
                self.shapes_only = True
                tr = self._trace_on(contextlib.ExitStack(), part, mode, shapes, nd, make, first, last, ac,
                                    autocast, dtype, micro, stage, b, hf_tp)
                return _Trace(**{**tr.__dict__, "error": tr.error or (
                    f"tensor parallel: the plugin's sharding did not trace on fake tensors ({type(exc).__name__}: "
                    f"{exc}); parameters at their shard's shape, logits as the shapes give them")})
            if not shapes:
                raise
            # the forward cannot run on its shard's shapes (e.g. a fixed head count): whole shapes
            tr = self.trace(ac=ac, autocast=autocast, dtype=dtype, micro=micro, stage=stage)
            tr = _Trace(**{**tr.__dict__, "error": f"tensor parallel: the forward failed on shard shapes "
                                                    f"({type(exc).__name__}); activations traced unsharded"})
        return tr

    def _loss_for(self, nd, first: bool, last: bool, b: int) -> Optional[Callable]:
        """The criterion of a traced part: the user's, or one that needs no targets from the caller."""
        loss_fn = self.loss_fn
        if nd is not None and last:
            # the plugin's step with a criterion for whole logits: the vocab pieces gathered
            # (``gather_vocab``), the targets this rank's rows (the logits' own batch cut)
            from ...tp_nd import gather_vocab

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
        return loss_fn


def _convert_nd(scope, fake: nn.Module, mode, nd: _NdKey) -> None:
    """The real N-d modules (SUMMA / Tesseract / 3D) on this rank's blocks, their collectives on a
    fake process group entered on ``scope``: the blocks they receive and the buffers they gather
    are traced too."""
    from ...tp_nd import Grid, convert, resolve_plan

    scope.enter_context(_fake_world(nd.tp_size))
    grid = Grid(nd.mode, dict(nd.sizes), [list(range(nd.tp_size))], 0)
    with mode:
        convert(fake, grid, resolve_plan(fake, nd.plan))


def _tp_shapes(meta: nn.Module, tp: int, plan: dict) -> Dict[str, torch.Size]:
    """Shapes of one tensor-parallel rank's parameters under a Colwise/Rowwise plan (a transformers
    model's plan, of style names, is read by its adapter)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ...models.hf import reads_dict_plan

    if reads_dict_plan(meta):
        from ...models.hf.planning import shard_shapes

        return shard_shapes(meta, plan, tp)

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


class _PlanKey:
    """A tp plan that can sit in a cache key (plans hold unhashable styles), with the plugin's options
    that change what a rank holds (a transformers model's sequence parallelism and vocabulary-parallel
    loss)."""

    def __init__(self, plan: dict, sequence_parallel: bool = False, loss_parallel: bool = False):
        self.plan, self.sequence_parallel, self.loss_parallel = plan, bool(sequence_parallel), bool(loss_parallel)

    def _id(self):
        return tuple(sorted(self.plan)), self.sequence_parallel, self.loss_parallel

    def __hash__(self):
        return hash(self._id())

    def __eq__(self, other):
        return isinstance(other, _PlanKey) and self._id() == other._id()


def _checkpoints_itself(model: nn.Module) -> bool:
    own = getattr(model, "activation_checkpointing_enabled", None)
    return bool(own()) if callable(own) else False
