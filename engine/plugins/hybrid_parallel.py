"""``HybridParallelPlugin``: tensor × pipeline × context × data parallelism on one ``(dp, pp, cp, tp)`` mesh.

Built on torch: pipelines are ``torch.distributed.pipelining`` (:mod:`..pipeline`), tensor
parallelism is DTensor's ``parallelize_module`` (:mod:`..tensor_parallel`), ZeRO-1 is torch's
``ZeroRedundancyOptimizer``. Written by hand, because torch has no piece for them: the gradient
sync at ``optimizer.step()`` (dp mean bucketed per dtype; the copies a split made of a tied weight
summed), the fp16 overflow vote over *all* ranks (a stage that skipped alone would desynchronise
the pipeline), and measured timelines. Arguments, model contract and details: docs/hybrid.md.

``tp_mode="2d" | "2.5d" | "3d"`` swaps DTensor for :mod:`..tp_nd` (SUMMA, Tesseract and 3D
layers on explicit collectives over a grid cut from each tp group of the same mesh); each rank then
takes its piece of every batch (``execute_pipeline`` cuts it) and the gradients are averaged over
those pieces as over data parallelism (docs/hybrid.md, "N-dimensional tensor parallelism").

``cp_size=k, cp_mode="ring" | "ulysses"`` is context parallelism (:mod:`..context_parallel`): each
of ``k`` ranks holds a shard of every sequence (zig-zag for ring), the model's attention passes K/V
around the ring or all-to-alls to heads, and gradients are averaged over dp × cp (every rank that
holds the same parameters). ``execute_pipeline`` and a direct forward cut the batch themselves.

``activation_checkpointing=True`` recomputes every layer; ``"auto"`` with ``activation_budget=<bytes>``
(the peak activation memory of one training step on one rank) plans, per stage and at its first
training forward, which layers recompute (:mod:`..autockpt`): a stage plans one microbatch for the
budget divided by the microbatches it holds in flight, and the ranks of its tp and cp groups merge
their profiles so they recompute the same layers (:mod:`..autockpt_dist`). A model whose own config
asks for ``"auto"`` (``GPTConfig(activation_checkpointing="auto", activation_budget=...)``) is planned the
same way, with its budget.

Where we differ from Colossal-AI on purpose: ``precision`` defaults to ``"fp32"`` (CPU-first;
Colossal-AI defaults to fp16), and ``execute_pipeline`` also returns ``"bubble"`` — this step's
measured bubble fraction per stage.
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

from .. import comm
from ..device import default_device, to_device
from ..mixed_precision import DynamicLossScaler, autocast_dtype, resolve_precision
from ..pipeline.schedules import ScheduleSpec, validate_schedule
from ..wrappers import OptimizerWrapper, _count_tokens, rebuild_optimizer
from .base import Plugin

_CKPT_INFIX = "_checkpoint_wrapped_module."  # torch's checkpoint_wrapper adds it to parameter names


def _world_size() -> Optional[int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    env = os.environ.get("WORLD_SIZE")
    return int(env) if env else None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _Groups(tuple):
    """Process groups a stage module carries (``_checkpoint_groups``): a deep copy of the module
    shares them (a process group cannot be copied)."""

    def __deepcopy__(self, memo):
        return self


def _check_checkpoint_contract(model: nn.Module) -> None:
    """``activation_checkpointing="auto"`` switches layers through the model contract: a ``ValueError``
    before any group exists when the model cannot take a list of layers."""
    import inspect

    own = getattr(model, "enable_activation_checkpointing", None)
    if callable(own):
        try:
            takes = "layers" in inspect.signature(own).parameters
        except (TypeError, ValueError):
            takes = False
        if takes:
            return
        raise ValueError(f"HybridParallelPlugin(activation_checkpointing='auto'): {type(model).__name__}."
                         "enable_activation_checkpointing() takes no `layers`; extend it as the model contract says "
                         "(engine/models/protocol.py: enable_activation_checkpointing(layers=None)) or use "
                         "activation_checkpointing=True")
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"HybridParallelPlugin(activation_checkpointing='auto'): {type(model).__name__} has no "
                         "enable_activation_checkpointing(layers=...) (the model contract) and is not an nn.Sequential; "
                         "implement it, wrap your layers in nn.Sequential or set activation_checkpointing=False")


class _AutoCheckpoint:
    """``HybridParallelPlugin(activation_checkpointing="auto")`` (or a model whose config asks for
    ``"auto"``): a forward pre-hook on a stage's module
    that, at its first training forward of each input shape, profiles the stage on that very input
    (a microbatch, or a received activation), merges the profile over the stage's tp and cp ranks,
    solves it for the stage's share of the budget (``activation_budget // in-flight microbatches``)
    and applies the plan (``autockpt.apply``: ``module.checkpoint_plan``). The last stage's loss is
    the criterion on the microbatch being run; an earlier stage's stands for the gradient it will
    receive (an output-sized tensor held through backward).

    In a pipeline a stage whose share is below the lowest peak any plan reaches does not raise inside
    the schedule (the other stages would wait for its activations until the collective timeout): it
    runs this step under that lowest-peak plan, and ``execute_pipeline`` raises the error on every
    rank after the step (``HybridParallelPlugin._vote_checkpoint_errors``)."""

    def __init__(self, plugin: "HybridParallelPlugin", runtime, groups, pp_rank: int, budget: int, is_last: bool):
        self.plugin, self.runtime, self.groups = plugin, runtime, groups
        self.pp_rank, self.step_budget, self.is_last = pp_rank, int(budget), is_last
        self.plans: Dict[tuple, Any] = {}
        self.busy = False  # profiling calls the module: the hook stays out of its own steps

    def budget(self) -> int:
        from ..autockpt_dist import stage_budget

        p = self.plugin
        m = p._pipeline_m or 1
        return stage_budget(self.step_budget, p.pp_style, p.pp_size, self.pp_rank, m, p.num_model_chunks)

    def loss_fn(self):
        if self.plugin._pipeline_m is None:
            return None  # a direct forward (pp_size == 1): the model's own loss, as the caller's backward
        rt = self.runtime
        if self.is_last:
            crit, mb = rt._criterion, rt._mbs[0]
            return lambda out, inputs: crit(out[0] if isinstance(out, tuple) else out, mb)

        def received(out, inputs):  # the next stage's gradient: an output-sized tensor through backward
            o = out[0] if isinstance(out, tuple) else out
            return (o * torch.ones_like(o)).sum()
        return received

    def __call__(self, module: nn.Module, args, kwargs):
        if self.busy or not (module.training and torch.is_grad_enabled()):
            return None
        from ..autockpt import apply, min_peak, solve
        from ..autockpt_dist import agreed_profile

        tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
        if not tensors or any(t.is_meta for t in tensors):
            return None  # torch's shape inference, on meta tensors
        key = tuple((tuple(t.shape), t.dtype) for t in tensors) + (torch.is_autocast_enabled(tensors[0].device.type),)
        plan = self.plans.get(key)
        if plan is None:
            if kwargs:
                import inspect

                sample = dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
            else:
                sample = tuple(args)
            self.busy = True
            try:
                prof = agreed_profile(module, sample, self.loss_fn(), groups=self.groups)
            finally:
                self.busy = False
            try:
                plan = solve(prof, self.budget())
            except ValueError as exc:
                if self.plugin._pipeline_m is None or self.plugin.pp_size == 1:
                    raise  # every rank of this stage (all of them, without a pipeline) raises alike
                self.plugin._ac_errors.append(f"pipeline stage on pp rank {self.pp_rank}: {exc}")
                apply(module, solve(prof, min_peak(prof)[0]))  # this step runs; execute_pipeline raises after
                return None
            self.plans[key] = plan
        if getattr(module, "checkpoint_plan", None) is not plan:
            apply(module, plan)
        return None


class HybridParallelModule(nn.Module):
    """The boosted model: this rank's ``stage_modules`` (parameters under the full model's names
    behind each stage's ``inner.``) and the runtime that drives them. Callable directly only
    without a pipeline (``pp_size == 1``); with one, use ``booster.execute_pipeline``."""

    def __init__(self, stage_modules: List[nn.Module], runtime, plugin: "HybridParallelPlugin"):
        super().__init__()
        self.stage_modules = nn.ModuleList(stage_modules)
        self.runtime = runtime
        self._plugin_pp = plugin.pp_size
        self.device = runtime.device
        self.tokens = 0  # tokens seen since the last optimizer step (StepMetrics)
        self.first_forward: Optional[float] = None
        self.nd = None  # a tp_nd.NdParallel under tp_mode 2d/2.5d/3d (set by configure)
        self.cp = None  # (group, mode) under context parallelism (set by configure)

    def forward(self, *args, **kwargs):
        if self.nd is not None:
            raise RuntimeError(f"HybridParallelPlugin(tp_mode={self.nd.grid.mode!r}): each rank holds a piece of the "
                               "batch and of the vocabulary; call booster.execute_pipeline(data_iter, model, criterion, "
                               "optimizer), which cuts every batch and hands the criterion this rank's rows")
        if self._plugin_pp > 1:
            raise RuntimeError("HybridParallelPlugin(pp_size>1): the model is split across ranks; "
                               "call booster.execute_pipeline(data_iter, model, criterion, optimizer)")
        args, kwargs = to_device((args, kwargs), self.device)
        if self.cp is not None:  # context parallel: every (B, T, ...) argument cut to this rank's shard of T
            from ..context_parallel import shard_sequence

            group, mode = self.cp
            r, n = dist.get_rank(group), dist.get_world_size(group)
            cut = lambda a: shard_sequence(a, r, n, mode) if isinstance(a, torch.Tensor) and a.dim() >= 2 else a  # noqa: E731
            args, kwargs = tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}
        self.count(args, kwargs)
        stage = self.stage_modules[0]
        if stage.autocast_dtype is None:
            return stage.inner(*args, **kwargs)
        # the whole output (GPT's (logits, loss) too), under the precision's autocast
        with torch.autocast(device_type=self.device.type, dtype=stage.autocast_dtype):
            return stage.inner(*args, **kwargs)

    def count(self, args, kwargs) -> None:
        """Count a forward's (or a pipeline batch's) tokens for this step's StepMetrics."""
        if self.first_forward is None:
            self.first_forward = time.perf_counter()
        self.tokens += _count_tokens(args, kwargs)

    def named_model_parameters(self, remove_duplicate: bool = True):
        """``(name, param)`` under the unsplit model's names (activation-checkpoint wrappers'
        infix dropped, as in ``state_dict``); ``remove_duplicate=False`` also yields the second
        name of a tied weight held by one stage."""
        for mod in self.stage_modules:
            for n, p in mod.inner.named_parameters(remove_duplicate=remove_duplicate):
                yield n.replace(_CKPT_INFIX, ""), p

    def unwrap(self) -> nn.Module:
        return self

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The unsplit model's state dict, gathered on every rank (DTensors made whole, every
        pipeline stage contributing its own parameters); names match the plain model."""
        local = {}
        for mod in self.stage_modules:
            for n, t in mod.inner.state_dict().items():
                t = t.full_tensor() if hasattr(t, "full_tensor") else t
                if self.nd is not None and n in self.nd.params:
                    t = self.nd.full(n, t)  # a collective over the tp group, in state-dict order
                local[n] = t.detach().to("cpu", copy=True)  # a snapshot, never the live tensor
        group = self.runtime.pp_group
        if group is None or dist.get_world_size(group) == 1:
            return local
        parts: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, local, group=group)
        return {n: t for part in parts for n, t in part.items()}


class HybridParallelOptimizer(OptimizerWrapper):
    """The boosted optimizer of a tensor × pipeline × data-parallel run: the base class's step
    policy, with gradients averaged over dp and tied copies summed before unscaling
    (``plugin._sync_grads``) and the clip norm summed over the pipeline stages, each holding only
    its own parameters (docs/engine.md, "The plugin contract")."""

    def __init__(self, optim: Optimizer, model: HybridParallelModule, plugin: "HybridParallelPlugin"):
        # the overflow vote is world-wide: a stage that skipped a step alone would desynchronise
        # the pipeline (group=None: the default group)
        super().__init__(optim, model, plugin.precision, loss_scaler=plugin._scaler)
        self.plugin = plugin
        self._synced = False

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, sd):
        return self.optim.load_state_dict(sd)

    def _sync(self) -> None:
        if not self._synced:
            self.plugin._sync_grads(self.model)
            self._synced = True

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm (all stages, tensor-parallel shards whole; unscaled
        first under fp16); returns the norm before clipping, like ``clip_grad_norm_``."""
        p = float(norm_type)
        if not p > 0:
            raise ValueError(f"clip_grad_by_norm(norm_type={norm_type!r}): must be > 0 or inf")
        self._sync()
        self.unscale_grad()
        named = [(n, q.grad) for n, q in self.model.named_model_parameters() if q.grad is not None]
        inf = p == math.inf
        acc = 0.0
        for g in [g for n, g in named if n not in self.plugin._tie_skip]:  # a tied weight counts once
            n = torch.linalg.vector_norm(g.float(), p)
            n = float(n.full_tensor() if hasattr(n, "full_tensor") else n)
            acc = max(acc, n) if inf else acc + n ** p
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        nd = self.model.nd
        if nd is not None and nd.grid.tp_group.pg is not None:  # N-d: each element has one owner in the grid
            (acc,) = comm.reduce_values([acc], op=op, group=nd.grid.tp_group.pg)
        pp_group = self.model.runtime.pp_group
        if pp_group is not None:
            (acc,) = comm.reduce_values([acc], op=op, group=pp_group)
        total = acc if inf else acc ** (1.0 / p)
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for _, g in named:
                _local(g).mul_(coef)
        return torch.tensor(total, dtype=torch.float32)

    def step(self, *args, **kwargs):
        rec = self.model.runtime.recorder
        rec.step = max(0, self.model.runtime.step_index - 1)
        with rec.timed("optim"):
            self._sync()
            self._synced = False
            return super().step(*args, **kwargs)


class HybridParallelPlugin(Plugin):
    """Tensor × pipeline × context × data parallelism: ``world = dp_size * pp_size * cp_size * tp_size``. Every
    argument, with what it needs of the model, is in docs/hybrid.md's table."""

    supports_pipeline = True
    controls_precision = True

    def __init__(self, tp_size: int = 1, pp_size: int = 1, zero_stage: int = 0,
                 num_microbatches: Optional[int] = None, microbatch_size: Optional[int] = None,
                 pp_style: str = "1f1b", num_model_chunks: int = 1, sequence_parallel: bool = False,
                 precision: str = "fp32", activation_checkpointing: Union[bool, str] = False, *,
                 tp_plan: Optional[dict] = None, input_key: str = "idx", tp_mode: str = "1d", tp_depth: int = 1,
                 cp_size: int = 1, cp_mode: str = "ring", activation_budget: Optional[int] = None):
        from ..autockpt_dist import check_budget
        from ..context_parallel import MODES as CP_MODES
        from ..tp_nd.grid import factor
        for name, v in (("tp_size", tp_size), ("pp_size", pp_size), ("num_microbatches", num_microbatches),
                        ("microbatch_size", microbatch_size), ("cp_size", cp_size)):
            optional = name in ("num_microbatches", "microbatch_size")
            if not (isinstance(v, int) and v >= 1 or optional and v is None):
                raise ValueError(f"HybridParallelPlugin({name}={v!r}): must be an int >= 1")
        check_budget("HybridParallelPlugin", activation_checkpointing, activation_budget)
        if zero_stage not in (0, 1):
            raise ValueError(f"HybridParallelPlugin(zero_stage={zero_stage!r}): choose 0 or 1 "
                             "(ZeRO-2/3 are LowLevelZeroPlugin / GeminiPlugin)")
        if precision not in self.supported_precisions:
            raise ValueError(f"HybridParallelPlugin(precision={precision!r}): choose one of {self.supported_precisions}")
        if pp_size > 1 and num_microbatches is None and microbatch_size is None:
            raise ValueError(f"HybridParallelPlugin(pp_size={pp_size}): set num_microbatches (e.g. "
                             f"num_microbatches={2 * pp_size}) or microbatch_size")
        validate_schedule(pp_style, pp_size, num_model_chunks, num_microbatches)
        self.tp_grid = factor(tp_mode, tp_size, tp_depth)  # ValueError naming sizes that factor
        if tp_mode != "1d" and sequence_parallel:
            raise ValueError(f"HybridParallelPlugin(tp_mode={tp_mode!r}, sequence_parallel=True): sequence parallelism "
                             "is 1D's (Megatron-SP); 2D/2.5D/3D already cut every activation over the grid; set "
                             "sequence_parallel=False")
        if sequence_parallel and tp_size == 1:
            raise ValueError("HybridParallelPlugin(sequence_parallel=True): needs tp_size > 1; "
                             "set tp_size=2 (or more) or sequence_parallel=False")
        if cp_mode not in CP_MODES:
            raise ValueError(f"HybridParallelPlugin(cp_mode={cp_mode!r}): choose one of {CP_MODES}")
        if cp_size > 1 and tp_mode != "1d" and tp_size > 1:
            raise ValueError(f"HybridParallelPlugin(cp_size={cp_size}, tp_mode={tp_mode!r}): context parallelism "
                             "composes with 1D tensor parallelism; use tp_mode='1d' or cp_size=1")
        if cp_size > 1 and sequence_parallel:
            raise ValueError(f"HybridParallelPlugin(cp_size={cp_size}, sequence_parallel=True): both cut the "
                             "sequence; context parallelism already holds 1/cp of it, set sequence_parallel=False")
        if zero_stage == 1 and tp_size > 1:
            raise ValueError("HybridParallelPlugin(zero_stage=1, tp_size>1): ZeRO-1 over DTensor "
                             "parameters is not supported; use zero_stage=0 with tensor parallelism")
        world = _world_size()
        if world is not None and world % (tp_size * pp_size * cp_size):
            raise ValueError(f"HybridParallelPlugin(tp_size={tp_size}, pp_size={pp_size}, cp_size={cp_size}): "
                             f"tp_size * pp_size * cp_size = {tp_size * pp_size * cp_size} does not divide the world "
                             f"size {world}; choose sizes whose product divides {world}")
        self.tp_size, self.pp_size, self.zero_stage = tp_size, pp_size, zero_stage
        self.num_microbatches, self.microbatch_size = num_microbatches, microbatch_size
        self.pp_style, self.num_model_chunks = pp_style, num_model_chunks
        self.sequence_parallel = sequence_parallel
        self.precision = precision
        self.activation_checkpointing = activation_checkpointing
        self.activation_budget = activation_budget
        self._pipeline_m: Optional[int] = None  # microbatches of the execute_pipeline call in progress
        self._ac_errors: List[str] = []  # "auto" plans that failed on this rank's stages in this call
        self._ac_vote = False  # "auto" under a pipeline: every execute_pipeline votes on _ac_errors
        self.tp_plan, self.input_key = tp_plan, input_key
        self.tp_mode, self.tp_depth = tp_mode, tp_depth
        self.cp_size, self.cp_mode = cp_size, cp_mode
        self._cp_group = None    # this rank's context-parallel group (cp_size > 1)
        self._grad_group = None  # the ranks that hold the same parameters: dp x cp
        self._nd_plan = None  # {module name: role} under tp_mode 2d/2.5d/3d, resolved in configure
        self.mesh = None
        self._dp_group = None
        self._scaler: Optional[DynamicLossScaler] = None
        self._ties: List[tuple] = []  # (this rank's copies of a tied weight, group of the ranks holding copies)
        # names of the copies of a tied weight whose gradient a norm counts on another copy (after
        # _sync_grads every copy holds the same gradient)
        self._tie_skip: set = set()
        self._model: Optional[HybridParallelModule] = None

    @classmethod
    def auto(cls, model_or_config, *, batch: int, world_size: Optional[int] = None, seq: Optional[int] = None,
             device_memory: Optional[int] = None, **kw) -> "HybridParallelPlugin":
        """The layout ``cl.autoplan`` chooses for this model on ``world_size`` ranks (default: the
        running process group's), as a plugin; its table is ``plugin.autoplan``. Call it on every rank
        (the ranks calibrate together) or in the notebook with ``cluster=``. Arguments:
        docs/autoplan.md. (The search lives beside ``cl.plan`` in ``colossal_lab.autoparallel``,
        imported here on use: it measures, and the engine does not depend on it.)"""
        from colossal_lab.autoparallel import autoplan

        world_size = world_size if world_size is not None else _world_size()
        if world_size is None:
            raise ValueError("HybridParallelPlugin.auto(world_size=None): no process group is running; pass "
                             "world_size= (and cluster=cl.launch(n=world_size) to calibrate on)")
        plan = autoplan(model_or_config, world_size=world_size, batch=batch, seq=seq,
                        device_memory=device_memory, **kw)
        plugin = plan.plugin()
        plugin.autoplan = plan
        return plugin

    # ---- groups -------------------------------------------------------------------------
    @property
    def dp_group(self):
        return self._dp_group

    @property
    def dp_size(self) -> int:
        if self.mesh is None:
            w = _world_size() or 1
            return w // (self.tp_size * self.pp_size * self.cp_size)
        return self.mesh["dp"].size()

    @property
    def dp_rank(self) -> int:
        if self.mesh is None:
            return 0
        return self.mesh["dp"].get_local_rank()

    # ---- the boost ------------------------------------------------------------------------
    def configure(self, model: nn.Module, optimizer: Optional[Optimizer] = None,
                  criterion: Optional[Callable] = None, dataloader=None, lr_scheduler=None,
                  mixed_precision: Optional[str] = None):
        from torch.distributed.device_mesh import init_device_mesh

        from ..pipeline.runtime import PipelineRuntime
        from ..pipeline.stage import StageModule, build_stages, check_divisible
        from ..tensor_parallel import apply_tensor_parallel

        if isinstance(model, HybridParallelModule):
            raise ValueError("HybridParallelPlugin.configure(model=...): this model is already boosted")
        self.precision = resolve_precision(mixed_precision, self.precision, "HybridParallelPlugin")
        spec = ScheduleSpec(self.pp_style, self.pp_size, self.num_model_chunks, self.num_microbatches or 1)
        # ---- every check that needs the model, still before any group exists ----
        if self.pp_size > 1:
            check_divisible(model, spec.num_stages)
        from ..autockpt_request import requested_budget, take

        auto_ac, ac_budget = self.activation_checkpointing == "auto", self.activation_budget
        asked = requested_budget(model)  # the model contract's checkpoint_budget()
        if self.activation_checkpointing is not True and asked is not None:
            # the model asks for "auto" itself (GPTConfig): planned here like the plugin's, with the criterion
            # a pipeline runs and the stage's share, for the model's budget unless the plugin gives one
            auto_ac, ac_budget = True, ac_budget if ac_budget is not None else asked
        if auto_ac:
            _check_checkpoint_contract(model)
        own_ac = self.activation_checkpointing is True and callable(getattr(model, "enable_activation_checkpointing", None))
        if self.activation_checkpointing is True and not own_ac and not isinstance(model, nn.Sequential):
            raise ValueError(f"HybridParallelPlugin(activation_checkpointing=True): {type(model).__name__} has no "
                             "enable_activation_checkpointing() (the model contract) and is not an nn.Sequential; "
                             "implement it, wrap your layers in nn.Sequential or set activation_checkpointing=False")
        nd = self.tp_mode != "1d" and self.tp_size > 1
        if nd:
            from ..tp_nd import apply as nd_apply

            self._nd_plan = nd_apply.resolve_plan(model, self.tp_plan)
            nd_apply.check(model, self._nd_plan, self.tp_mode, self.tp_grid, self.tp_size)
        elif self.tp_size > 1 and self.tp_plan is None and not callable(getattr(model, "tp_plan", None)):
            raise ValueError(f"HybridParallelPlugin(tp_size={self.tp_size}): {type(model).__name__} has no tp_plan() "
                             "(the model contract); pass tp_plan={'layer.name': ColwiseParallel() | RowwiseParallel(), ...}")
        if self.tp_size > 1 and callable(getattr(model, "check_tp", None)):
            # N-d: heads are cut over q ranks (a grid side), not over the whole tp group
            model.check_tp(self.tp_size if not nd else self.tp_grid.get("row", self.tp_grid.get("y")))
        if self.cp_size > 1:
            if not callable(getattr(model, "enable_context_parallel", None)):
                raise ValueError(f"HybridParallelPlugin(cp_size={self.cp_size}): {type(model).__name__} has no "
                                 "enable_context_parallel(group, mode) (the model contract); implement it or set cp_size=1")
            # Ulysses cuts each rank's heads (already cut over tp) over cp: asked through the contract's
            # check_tp, as the heads must divide over tp_size * cp_size ranks
            if self.cp_mode == "ulysses" and callable(getattr(model, "check_tp", None)):
                try:
                    model.check_tp(self.tp_size * self.cp_size)
                except ValueError as exc:
                    raise ValueError(f"HybridParallelPlugin(cp_size={self.cp_size}, cp_mode='ulysses', tp_size="
                                     f"{self.tp_size}): Ulysses cuts the heads over tp_size * cp_size = "
                                     f"{self.tp_size * self.cp_size} ranks ({exc}); use cp_mode='ring' or smaller "
                                     "sizes") from None
        if not dist.is_initialized():
            raise RuntimeError("HybridParallelPlugin: torch.distributed is not initialised; start the ranks "
                               "with cl.launch(n=...) or torchrun")
        world = dist.get_world_size()
        if world % (self.tp_size * self.pp_size * self.cp_size):
            raise ValueError(f"HybridParallelPlugin(tp_size={self.tp_size}, pp_size={self.pp_size}, cp_size="
                             f"{self.cp_size}): their product does not divide the world size {world}")
        # parameter names by identity, taken now: tensor parallelism replaces the parameters
        names_of: Dict[int, List[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), []).append(n)  # a tied weight has two names
        if own_ac:
            model.enable_activation_checkpointing()

        # ---- groups ----
        dp = world // (self.tp_size * self.pp_size * self.cp_size)
        device = default_device()
        # cp sits between pp and tp: a cp group's ranks are neighbours after tp's (tp is innermost)
        self.mesh = init_device_mesh(device.type, (dp, self.pp_size, self.cp_size, self.tp_size),
                                     mesh_dim_names=("dp", "pp", "cp", "tp"))
        self._dp_group = self.mesh["dp"].get_group() if dp > 1 else None
        self._grad_group = self._dp_group
        if self.cp_size > 1:
            from ..context_parallel import apply_context_parallel

            self._cp_group = self.mesh["cp"].get_group()
            # gradients are averaged over every rank holding the same parameters: dp x cp
            me = dist.get_rank()
            for p_ in range(self.pp_size):
                for t_ in range(self.tp_size):
                    ranks = self.mesh.mesh[:, p_, :, t_].flatten().tolist()
                    g = dist.new_group(ranks)  # every rank creates every group, in the same order
                    if me in ranks:
                        self._grad_group = g
            apply_context_parallel(model, self._cp_group, self.cp_mode)  # before the stages copy it
        pp_group = self.mesh["pp"].get_group()
        pp_rank = self.mesh["pp"].get_local_rank()
        tp_mesh = self.mesh["tp"]
        grid, nd_params = None, {}
        if nd:
            from ..tp_nd import Grid, NdParallel, convert, resolve_plan

            grid = Grid(self.tp_mode, self.tp_grid, self.mesh.mesh.reshape(-1, self.tp_size).tolist(), dist.get_rank())
        autocast = autocast_dtype(self.precision)
        # the ranks whose collectives run inside a stage's layers: its tp group, then its cp group;
        # every "auto" plan (the plugin's or the model's own) is agreed over them (autockpt_dist)
        ac_groups = _Groups(g for g, n in ((tp_mesh.get_group(), self.tp_size), (self._cp_group, self.cp_size))
                            if n > 1)
        # one overflow vote over every rank (group=None): see HybridParallelOptimizer
        self._scaler = DynamicLossScaler() if self.precision == "fp16" else None

        def prepare(part: nn.Module) -> nn.Module:
            if grid is not None:  # N-d: this part's (a stage's) planned modules become their grid form
                nd_params.update(convert(part, grid, resolve_plan(part, self.tp_plan)))
            else:
                part = apply_tensor_parallel(part, tp_mesh, self.tp_plan, self.sequence_parallel)
            part._checkpoint_groups = ac_groups
            if self.activation_checkpointing is True and not own_ac:
                # each child of the (stage's) Sequential recomputes in backward; wrapped after
                # tensor parallelism so a tp_plan sees the user's own module names
                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
                for i in range(len(part)):
                    part[i] = checkpoint_wrapper(part[i])
            return part

        if self.pp_size > 1:
            modules, stages = build_stages(model, spec.stage_indices(pp_rank), spec.num_stages, pp_group,
                                           device, autocast, prepare)
        else:
            modules, stages = [StageModule(prepare(model), autocast).to(device)], []
        runtime = PipelineRuntime(spec, modules, stages, device=device, rank=dist.get_rank(), pp_rank=pp_rank,
                                  pp_group=pp_group if self.pp_size > 1 else None,
                                  dp_rank=self.mesh["dp"].get_local_rank(), tp_rank=tp_mesh.get_local_rank(),
                                  input_key=self.input_key,
                                  loss_scale=lambda: self._scaler.scale if self._scaler else 1.0)
        hp_model = HybridParallelModule(modules, runtime, self)
        self._ac_vote = auto_ac and self.pp_size > 1
        ids = spec.stage_indices(pp_rank) if self.pp_size > 1 else [0]
        for sid, mod in zip(ids, modules):
            mod.inner.stage_index = sid  # which stage a plan (and its CheckpointPlanEvent) belongs to
        if auto_ac:
            for sid, mod in zip(ids, modules):
                take(mod.inner)  # the model's own request is planned here: its hook stands aside
                mod.inner.register_forward_pre_hook(
                    _AutoCheckpoint(self, runtime, ac_groups, pp_rank, ac_budget, is_last=sid == spec.num_stages - 1),
                    with_kwargs=True)
        if grid is not None:
            hp_model.nd = NdParallel(grid, nd_params)
        if self._cp_group is not None:
            hp_model.cp = (self._cp_group, self.cp_mode)
        self._model = hp_model
        tied = [names for names in names_of.values() if len(names) > 1]
        if tied and self.pp_size > 1:
            self._setup_tied(hp_model, tied)

        # ---- the user's optimizer over this rank's (stage's, tensor-parallel) parameters, same
        # groups and hyper-parameters; ZeRO-1 shards its state over the data-parallel group. An LR
        # scheduler is pointed at the rebuilt optimizer by Booster.boost ----
        hp_optim = None
        if optimizer is not None:
            cls = None
            if self.zero_stage == 1 and self.dp_size * self.cp_size > 1:
                from torch.distributed.optim import ZeroRedundancyOptimizer

                cls = functools.partial(ZeroRedundancyOptimizer, optimizer_class=type(optimizer),
                                        process_group=self._grad_group)
            optim = rebuild_optimizer(optimizer, names_of, dict(hp_model.named_model_parameters()),
                                      optimizer_class=cls, partial=True)
            hp_optim = HybridParallelOptimizer(optim, hp_model, self)
        if dataloader is not None and self.dp_size > 1 and hasattr(dataloader, "dataset"):
            dataloader = self.prepare_dataloader(dataloader.dataset, dataloader.batch_size,
                                                 drop_last=dataloader.drop_last)
        return hp_model, hp_optim, criterion, dataloader, lr_scheduler

    # ---- gradient sync ------------------------------------------------------------------
    def _setup_tied(self, model: HybridParallelModule, tied: List[List[str]]) -> None:
        """Find the copies the split made of each tied weight: copies on this rank are summed
        locally, copies on other ranks (same dp and tp coordinate) over a group of the ranks
        holding them; a norm counts one copy (the first of the lowest pipeline rank)."""
        self._ties, self._tie_skip = [], set()
        which = {n: i for i, names in enumerate(tied) for n in names}
        local: Dict[int, List[tuple]] = {}  # tied weight -> this rank's distinct copies (name, param)
        for n, p in model.named_model_parameters():
            if n in which and all(q is not p for _, q in local.get(which[n], [])):
                local.setdefault(which[n], []).append((n, p))
        held: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(held, sorted(local))
        ranks, me = self.mesh.mesh, dist.get_rank()  # (dp, pp, cp, tp) tensor of global ranks
        pipelines = ranks.permute(0, 2, 3, 1).reshape(-1, ranks.shape[1]).tolist()  # one per (dp, cp, tp)
        for i in range(len(tied)):
            for pipeline in pipelines:
                holders = [r for r in pipeline if i in held[r]]
                group = dist.new_group(holders) if len(holders) > 1 else None  # every rank, same order
                if me in holders:
                    self._ties.append(([p for _, p in local[i]], group))
                    self._tie_skip.update(n for n, _ in local[i][int(me == holders[0]):])

    def _sync_grads(self, model: HybridParallelModule) -> None:
        named = list(model.named_model_parameters())
        for params, group in self._ties:
            grads = [p.grad for p in params if p.grad is not None]
            if not grads:
                continue
            total = sum(grads[1:], grads[0])
            if group is not None:
                comm.all_reduce(_local(total), group=group)
            for g in grads:
                g.copy_(total)  # a no-op on the one copy a rank holds alone
        # N-d: each rank's loss is the mean over its piece of the batch and the grid's reductions sum
        # the pieces, so gradients are averaged over the nb pieces as over data parallelism
        nb = model.nd.grid.batch_shards if model.nd is not None else 1
        # (context parallelism likewise: each rank's loss is the mean over its shard of the sequence)
        group = self._grad_group
        if group is None and nb > 1:
            for _, p in named:
                if p.grad is not None:
                    p.grad.div_(nb)
        if group is not None:
            grads = [_local(p.grad) for _, p in named if p.grad is not None]
            by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
            for g in grads:
                by_dtype.setdefault(g.dtype, []).append(g)
            n = dist.get_world_size(group) * nb
            for gs in by_dtype.values():
                flat = torch.cat([g.reshape(-1) for g in gs])
                comm.all_reduce(flat, group=group)
                flat.div_(n)
                off = 0
                for g in gs:
                    g.copy_(flat[off:off + g.numel()].view_as(g))
                    off += g.numel()

    # ---- the pipeline ---------------------------------------------------------------------
    def execute_pipeline(self, data_iter: Iterator, model: HybridParallelModule, criterion: Callable,
                         optimizer=None, return_loss: bool = True, return_outputs: bool = False) -> dict:
        """Forward and backward of one batch (``next(data_iter)``; every rank of a pipeline
        iterates over the same batches). Returns ``loss`` (the batch mean) and ``outputs`` on the
        rank holding the last stage (None elsewhere), ``bubble`` ``{stage: fraction}`` and
        ``rank_bubble`` ``{rank: fraction}``; gradients are left for ``optimizer.step()``."""
        if not isinstance(model, HybridParallelModule):
            raise TypeError("execute_pipeline(model=...): pass the model returned by booster.boost / plugin.configure")
        batch = next(data_iter)
        if not isinstance(batch, dict):
            raise TypeError(f"execute_pipeline: batches must be dicts like {{'idx': x, 'targets': y}}, got {type(batch).__name__}")
        m = self.num_microbatches
        if m is None and self.microbatch_size is None:
            m = 1  # pp_size == 1 without a split: the whole batch at once
        if m is None:
            bs = batch[self.input_key].shape[0]
            if bs % self.microbatch_size:
                raise ValueError(f"execute_pipeline: batch size {bs} is not a multiple of microbatch_size={self.microbatch_size}")
            m = bs // self.microbatch_size
            validate_schedule(self.pp_style, self.pp_size, self.num_model_chunks, m)
        model.count((batch[self.input_key],) if self.input_key in batch else (), {})
        self._pipeline_m = m  # an "auto" plan made in this call divides the budget by what is in flight
        self._ac_errors = []
        try:
            if self._cp_group is not None:
                out = self._run_cp(model, batch, criterion, m, return_outputs)
            elif model.nd is None:
                out = model.runtime.run(batch, criterion, m, return_outputs=return_outputs)
            else:
                out = self._run_nd(model, batch, criterion, m, return_outputs)
        finally:
            self._pipeline_m = None
        if self._ac_vote:
            self._vote_checkpoint_errors()
        if isinstance(optimizer, HybridParallelOptimizer):
            optimizer.record_loss(out["loss"])
        if not return_loss:
            out["loss"] = None
        return out

    def _vote_checkpoint_errors(self) -> None:
        """After a pipeline step: if any stage could not plan within its share of the budget, raise its
        error on every rank (one MAX all-reduce per step; the messages gathered only then)."""
        (bad,) = comm.reduce_values([float(bool(self._ac_errors))], op=dist.ReduceOp.MAX)
        if not bad:
            return
        msgs: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(msgs, self._ac_errors)
        seen = list(dict.fromkeys(m for part in msgs for m in part))
        raise ValueError(f"HybridParallelPlugin(activation_checkpointing='auto'): {len(seen)} pipeline stage(s) cannot "
                         f"hold their share of the activation budget (this step ran under their lowest-peak plans): "
                         + " | ".join(seen) + ". Raise activation_budget (a stage plans one microbatch for the budget "
                         "divided by the microbatches it holds in flight), or use fewer microbatches in flight")

    def _run_nd(self, model: HybridParallelModule, batch: dict, criterion: Callable, m: int, return_outputs: bool):
        """One step under tp_mode 2d/2.5d/3d: this rank's rows of the batch, the criterion on its
        logits block (a ``vocab_parallel`` criterion) or on whole-vocab logits of its rows, every
        collective a ``comm`` span; the loss reported is the mean over the batch pieces."""
        from ..tp_nd import comm_spans, gather_vocab

        nd = model.nd
        batch = nd.shard_batch(batch, self.input_key)
        crit = criterion
        if not getattr(criterion, "vocab_parallel", False):
            def crit(outputs, mb):  # noqa: E306 - a criterion written for whole logits
                return criterion(gather_vocab(outputs), mb)
        with comm_spans(model.runtime.recorder):
            out = model.runtime.run(batch, crit, m, return_outputs=return_outputs)
        g = nd.grid.group(nd.grid.inner.batch)
        if out["loss"] is not None and g.pg is not None:
            (total,) = comm.reduce_values([float(out["loss"])], group=g.pg)
            out["loss"] = torch.tensor(total / g.size, dtype=out["loss"].dtype)
        return out

    def _run_cp(self, model: HybridParallelModule, batch: dict, criterion: Callable, m: int, return_outputs: bool):
        """One step under context parallelism: this rank's shard of every sequence (input and
        targets; zig-zag for ring), ring/all-to-all waits as ``comm`` spans; the loss reported is
        the mean over the cp group's shards (outputs stay this rank's shard)."""
        from .. import context_parallel as cp

        batch = cp.shard_batch(batch, self._cp_group, self.cp_mode, keys=(self.input_key, "targets"))
        with cp.comm_spans(model.runtime.recorder):
            out = model.runtime.run(batch, criterion, m, return_outputs=return_outputs)
        if out["loss"] is not None:
            (total,) = comm.reduce_values([float(out["loss"])], group=self._cp_group)
            out["loss"] = torch.tensor(total / self.cp_size, dtype=out["loss"].dtype)
        return out

    def close(self) -> None:
        """Destroy the process groups this plugin made (its mesh's, dp × cp, tied copies', the N-d
        grid's): every boost makes new ones, and gloo keeps threads and sockets per group, so a
        notebook that boosts again and again (a search, a sweep) should close the plugin it is done
        with. Every rank calls it; the boosted model and optimizer cannot step afterwards."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        groups: List[Any] = []
        if self.mesh is not None:
            groups += [self.mesh.get_group(n) for n in self.mesh.mesh_dim_names]
        groups += [self._grad_group, self._cp_group] + [g for _, g in self._ties]
        nd = getattr(self._model, "nd", None)
        if nd is not None:
            groups += [g.pg for g in nd.grid.groups.values()]
        seen = set()
        for g in groups:
            if g is None or g is dist.group.WORLD or id(g) in seen:
                continue
            seen.add(id(g))
            try:
                dist.destroy_process_group(g)
            except (ValueError, RuntimeError):  # already gone (torch tears down a mesh's own groups too)
                pass
        self.mesh, self._dp_group, self._grad_group, self._cp_group, self._ties = None, None, None, None, []
        self._model = None
        _forget_dtensor_shardings()

    def get_checkpoint_io(self):
        from ..pipeline.checkpoint import HybridCheckpointIO

        return HybridCheckpointIO()


def _forget_dtensor_shardings() -> None:
    """Drop DTensor's cached sharding propagations (the Python LRU and the C++ fast path's).

    A ``DeviceMesh`` compares equal to any mesh of the same shape and names, so a cached output
    spec made under a closed plugin's mesh is a hit for the next plugin's equal mesh, and its
    collectives then name a process group that ``close()`` destroyed ("Could not resolve the
    process group registered under the name ...")."""
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
        return
    except ImportError:  # an older torch: clear what it has
        pass
    from torch.distributed.tensor import DTensor

    clear = getattr(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding, "cache_clear", None)
    if clear is not None:
        clear()
    fast = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if fast is not None:
        fast()
