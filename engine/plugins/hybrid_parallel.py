"""``HybridParallelPlugin``: tensor × pipeline × context × data parallelism on one ``(dp, pp, cp, tp)`` mesh.

Built on torch: pipelines are ``torch.distributed.pipelining`` (:mod:`..pipeline`), tensor
parallelism is DTensor's ``parallelize_module`` (:mod:`..tensor_parallel`), ZeRO-1 is torch's
``ZeroRedundancyOptimizer``, ZeRO-2 FSDP2's ``fully_shard`` (:mod:`.hybrid.zero2`; dp and ep only).
Written by hand, because torch has no piece for them: the gradient sync at ``optimizer.step()`` (dp
mean bucketed per dtype; the copies a split made of a tied weight summed), the fp16 overflow vote over
*all* ranks (a stage that skipped alone would desynchronise the pipeline), and measured timelines.
Arguments, model contract and details: docs/hybrid.md.

``tp_mode="2d" | "2.5d" | "3d"`` swaps DTensor for :mod:`..tp_nd` (SUMMA, Tesseract and 3D
layers on explicit collectives over a grid cut from each tp group of the same mesh); each rank then
takes its piece of every batch (``execute_pipeline`` cuts it) and the gradients are averaged over
those pieces as over data parallelism (docs/hybrid.md, "N-dimensional tensor parallelism").

``cp_size=k, cp_mode="ring" | "ulysses"`` is context parallelism (:mod:`..context_parallel`): each
of ``k`` ranks holds a shard of every sequence (zig-zag for ring), the model's attention passes K/V
around the ring or all-to-alls to heads, and gradients are averaged over dp × cp (every rank that
holds the same parameters). ``execute_pipeline`` and a direct forward cut the batch themselves.

``ep_size=k`` is expert parallelism for a model with MoE blocks (:mod:`..moe`): the dp ranks are cut
into EP groups of ``k`` that each hold ``E / k`` experts and exchange tokens by all-to-all; expert
gradients reduce over the ranks holding the same experts (:mod:`.hybrid.experts`, docs/moe.md). Under a
pipeline the EP groups are cut from each stage's dp ranks, which run the same schedule, so their
all-to-alls meet in the same order.

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
import os
from typing import Any, Callable, Iterator, List, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

from .. import comm
from ..device import default_device
from ..mixed_precision import DynamicLossScaler, autocast_dtype, resolve_precision
from ..models import hf
from ..models.hf.inputs import check_rows_agree, label_items
from ..models.protocol import checkpointing_method
from ..pipeline.schedules import ScheduleSpec, validate_schedule
from .base import Plugin
from .hybrid.apply import (
    apply_auto_checkpointing,
    apply_context_parallel,
    apply_optimizer,
    apply_pipeline,
    apply_ties,
    nd_grid,
    parameter_names,
    prepare_part,
)
from .hybrid.auto_checkpoint import PipelineStep
from .hybrid.checks import (
    Checkpointing,
    check_checkpointing,
    check_context_parallel,
    check_running,
    check_tensor_parallel,
    resolve_checkpointing,
)
from .hybrid.dims import ParallelDims
from .hybrid.grads import GradSync, TiedCopies, _local  # noqa: F401 - _local: tests read it here
from .hybrid.module import HybridParallelModule
from .hybrid.optimizer import HybridParallelOptimizer

__all__ = ["HybridParallelModule", "HybridParallelOptimizer", "HybridParallelPlugin", "ParallelDims"]


def _world_size() -> Optional[int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    env = os.environ.get("WORLD_SIZE")
    return int(env) if env else None


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
                 cp_size: int = 1, cp_mode: str = "ring", activation_budget: Optional[int] = None,
                 loss_parallel: bool = True, ep_size: int = 1):
        from ..autockpt_dist import check_budget
        from ..context_parallel import MODES as CP_MODES
        from ..tp_nd.grid import factor
        for name, v in (("tp_size", tp_size), ("pp_size", pp_size), ("num_microbatches", num_microbatches),
                        ("microbatch_size", microbatch_size), ("cp_size", cp_size), ("ep_size", ep_size)):
            optional = name in ("num_microbatches", "microbatch_size")
            if not (isinstance(v, int) and v >= 1 or optional and v is None):
                raise ValueError(f"HybridParallelPlugin({name}={v!r}): must be an int >= 1")
        check_budget("HybridParallelPlugin", activation_checkpointing, activation_budget)
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"HybridParallelPlugin(zero_stage={zero_stage!r}): choose 0, 1 or 2 "
                             "(ZeRO-3 is GeminiPlugin, which has no ep_size: with experts split use zero_stage=2)")
        if precision not in self.supported_precisions:
            raise ValueError(f"HybridParallelPlugin(precision={precision!r}): "
                             f"choose one of {self.supported_precisions}")
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
        if ep_size > 1:  # expert parallelism: EP groups cut from dp (hybrid/experts.py)
            from .hybrid.experts import check_world

            check_world(ep_size, tp_size * pp_size * cp_size, world)
        self.ep_size = ep_size
        self.experts = None  # hybrid.experts.ExpertGroups once configured with ep_size > 1
        self.tp_size, self.pp_size, self.zero_stage = tp_size, pp_size, zero_stage
        self.num_microbatches, self.microbatch_size = num_microbatches, microbatch_size
        self.pp_style, self.num_model_chunks = pp_style, num_model_chunks
        self.sequence_parallel = sequence_parallel
        self.precision = precision
        self.activation_checkpointing = activation_checkpointing
        self.activation_budget = activation_budget
        self._step = PipelineStep()  # the execute_pipeline call in progress, as the "auto" stage hooks see it
        self._ac_vote = False  # "auto" under a pipeline: every execute_pipeline votes on the step's errors
        self.tp_plan, self.input_key = tp_plan, input_key
        self.tp_mode, self.tp_depth = tp_mode, tp_depth
        self.cp_size, self.cp_mode = cp_size, cp_mode
        self.loss_parallel = bool(loss_parallel)
        self.dims: Optional[ParallelDims] = None  # the mesh and its groups, once configured
        self._scaler: Optional[DynamicLossScaler] = None
        self.grads = GradSync(TiedCopies(), None)  # the gradient sync at optimizer.step(), once configured
        self._model: Optional[HybridParallelModule] = None
        self._hf = False  # a transformers model: HF batches and criterion (models/hf/loss.py)
        if zero_stage == 2:
            from .hybrid.zero2 import check_zero2

            check_zero2(self)

    @classmethod
    def auto(cls, model_or_config, *, batch: int, world_size: Optional[int] = None, seq: Optional[int] = None,
             device_memory: Optional[int] = None, **kw) -> "HybridParallelPlugin":
        """The layout ``cl.autoplan`` chooses for this model on ``world_size`` ranks (default: the
        running process group's), as a plugin; its table is ``plugin.autoplan``. Call it on every rank
        (the ranks calibrate together) or in the notebook with ``cluster=``. Arguments:
        docs/autoplan.md. (The search is ``planner/layout``, imported here on use.)"""
        from ..planner.layout import autoplan

        world_size = world_size if world_size is not None else _world_size()
        if world_size is None:
            raise ValueError("HybridParallelPlugin.auto(world_size=None): no process group is running; pass "
                             "world_size= (and cluster=cl.launch(n=world_size) to calibrate on)")
        plan = autoplan(model_or_config, world_size=world_size, batch=batch, seq=seq,
                        device_memory=device_memory, **kw)
        plugin = plan.plugin()
        plugin.autoplan = plan
        return plugin

    # ---- groups ---------------------------------------------------------------------------
    def _built(self) -> bool:
        return self.dims is not None and self.dims.mesh is not None

    @property
    def mesh(self):
        """The ``(dp, pp, cp, tp)`` DeviceMesh (None before configure and after close)."""
        return self.dims.mesh if self.dims is not None else None

    @property
    def dp_group(self):
        return self.dims.dp_group if self._built() else None

    @property
    def tp_group(self):
        return self.dims.tp_group if self._built() else None

    @property
    def pp_group(self):
        return self.dims.pp_group if self._built() else None

    @property
    def cp_group(self):
        return self.dims.cp_group if self._built() else None

    @property
    def ep_group(self):
        """This rank's expert-parallel group (None without expert parallelism)."""
        return self.experts.ep_group if self.experts is not None else None

    @property
    def dp_size(self) -> int:
        if not self._built():
            w = _world_size() or 1
            return w // (self.tp_size * self.pp_size * self.cp_size)
        return self.dims.dp

    @property
    def dp_rank(self) -> int:
        return self.dims.rank("dp") if self._built() else 0

    # ---- the boost ------------------------------------------------------------------------
    def configure(self, model: nn.Module, optimizer: Optional[Optimizer] = None,
                  criterion: Optional[Callable] = None, dataloader=None, lr_scheduler=None,
                  mixed_precision: Optional[str] = None):
        """Checks on the model (before any group exists), the mesh, then one ``apply_*`` step per
        parallelism (engine/plugins/hybrid/apply.py), in the order each needs the one before."""
        if isinstance(model, HybridParallelModule):
            raise ValueError("HybridParallelPlugin.configure(model=...): this model is already boosted")
        self.precision = resolve_precision(mixed_precision, self.precision, "HybridParallelPlugin")
        spec = ScheduleSpec(self.pp_style, self.pp_size, self.num_model_chunks, self.num_microbatches or 1)
        ckpt = self._check(model, spec)
        self._hf = hf.is_hf_model(model)
        if self._hf and self.input_key == "idx":  # transformers' batches: {"input_ids": x, "labels": y}
            self.input_key = "input_ids"
        dims = ParallelDims.for_world(check_running(), self.pp_size, self.cp_size, self.tp_size)
        names_of = parameter_names(model)  # taken now: tensor parallelism replaces the parameters
        if ckpt.own:  # the model's own method, or the adapter's for a transformers model
            checkpointing_method(model)()
        self.dims = dims.build(default_device().type)
        apply_context_parallel(model, dims, self.cp_mode)  # before the stages copy it
        grid, nd_params = nd_grid(dims, self.tp_mode, self.tp_grid), {}
        # one overflow vote over every rank (group=None): see HybridParallelOptimizer
        self._scaler = DynamicLossScaler() if self.precision == "fp16" else None
        prepare = functools.partial(prepare_part, dims=dims, grid=grid, tp_plan=self.tp_plan, nd_params=nd_params,
                                    sequence_parallel=self.sequence_parallel, wrap=ckpt.every and not ckpt.own,
                                    loss_parallel=self.loss_parallel)
        hp_model = apply_pipeline(model, spec, dims, prepare, autocast_dtype(self.precision), self.input_key,
                                  loss_scale=lambda: self._scaler.scale if self._scaler else 1.0)
        self._ac_vote = ckpt.auto and self.pp_size > 1
        if ckpt.auto:
            apply_auto_checkpointing(hp_model, spec, dims, ckpt.budget, self._step, self.pp_style,
                                     self.num_model_chunks)
        if grid is not None:
            from ..tp_nd import NdParallel

            hp_model.nd = NdParallel(grid, nd_params)
        if dims.cp > 1:
            hp_model.cp = (dims.cp_group, self.cp_mode)
        self._model = hp_model
        if self.ep_size > 1:  # this rank's share of the experts, before the optimizer is rebuilt over them
            from .hybrid.experts import ExpertGroups

            self.experts = ExpertGroups(self.ep_size).build(dims)
            for mod in hp_model.stage_modules:
                self.experts.shard(mod.inner)
            hp_model.experts = self.experts
        reduced = frozenset()
        if self.zero_stage == 2 and dims.dp * dims.cp > 1:  # FSDP2: gradients reduce-scattered in backward
            from .hybrid.zero2 import apply_zero2

            reduced = frozenset(apply_zero2(hp_model, dims, self.experts))
        self.grads = GradSync(apply_ties(hp_model, names_of, dims), dims.grad_group, self.experts, reduced)
        hp_optim = apply_optimizer(optimizer, names_of, hp_model, dims, self.zero_stage, self.precision,
                                   self._scaler, self.grads)
        if dataloader is not None and self.dp_size > 1 and hasattr(dataloader, "dataset"):
            dataloader = self.prepare_dataloader(dataloader.dataset, dataloader.batch_size,
                                                 drop_last=dataloader.drop_last)
        return hp_model, hp_optim, criterion, dataloader, lr_scheduler

    def _check(self, model: nn.Module, spec: ScheduleSpec) -> Checkpointing:
        """Every check that needs the model, still before any group exists; the checkpointing to apply."""
        from ..pipeline.stage import check_divisible

        if self.pp_size > 1:
            check_divisible(model, spec.num_stages)
        ckpt = resolve_checkpointing(self.activation_checkpointing, self.activation_budget, model)
        check_checkpointing(model, ckpt)
        check_tensor_parallel(model, self)
        check_context_parallel(model, self)
        from .hybrid.experts import check_expert_parallel

        check_expert_parallel(model, self, _world_size())
        return ckpt

    # ---- the pipeline ---------------------------------------------------------------------
    def backward(self, loss, optimizer) -> None:
        """As every plugin's, inside ``loss_parallel()`` where a transformers model's loss was computed on
        vocabulary-sharded logits (its backward needs the same context)."""
        from ..models.hf.vocab_parallel import backward_context

        with backward_context():
            super().backward(loss, optimizer)

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
            raise TypeError("execute_pipeline: batches must be dicts like {'idx': x, 'targets': y}, "
                            f"got {type(batch).__name__}")
        m = self.num_microbatches
        if m is None and self.microbatch_size is None:
            m = 1  # pp_size == 1 without a split: the whole batch at once
        if m is None:
            bs = batch[self.input_key].shape[0]
            if bs % self.microbatch_size:
                raise ValueError(f"execute_pipeline: batch size {bs} "
                                 f"is not a multiple of microbatch_size={self.microbatch_size}")
            m = bs // self.microbatch_size
            validate_schedule(self.pp_style, self.pp_size, self.num_model_chunks, m)
        keys, whole = (), batch
        if self._hf:  # the stages' per-token inputs; outputs.logits / outputs.loss for the criterion (docs/hf.md)
            last = model.stage_modules[-1].inner
            self._check_sequence_cut(batch)
            batch, keys = hf.check_batch(batch, last, self.input_key)
            if model.nd is not None and model.nd.grid.mode == "3d":
                check_rows_agree(batch, keys, "3d")
            items = label_items(last, batch, m) if model.nd is None else None
            if model.cp is not None:  # this rank's shard: global positions, shifted labels (models/hf/context.py)
                from ..models.hf.context import shard_pipeline_batch

                batch, items = shard_pipeline_batch(batch, *model.cp, self.input_key, m,
                                                    model.stage_modules[0].inner)
                batch, keys = hf.check_batch(batch, last, self.input_key)
            criterion = hf.pipeline_criterion(last, criterion, items)
        model.count((whole[self.input_key],) if self.input_key in whole else (), {})
        self._step.microbatches = m  # an "auto" plan made in this call divides the budget by what is in flight
        self._step.errors = []
        try:
            if model.cp is not None:
                out = self._run_cp(model, batch, criterion, m, return_outputs, keys)
            elif model.nd is None:
                from ..models.hf.vocab_parallel import backward_context

                with backward_context():  # a vocabulary-parallel loss: its forward and backward run in the schedule
                    out = model.runtime.run(batch, criterion, m, return_outputs=return_outputs, stage_keys=keys)
                if self._hf and out["outputs"] is not None:
                    out["outputs"] = hf.whole_outputs(model.stage_modules[-1].inner, out["outputs"])
            else:
                out = self._run_nd(model, batch, criterion, m, return_outputs, keys)
        finally:
            self._step.microbatches = None
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
        (bad,) = comm.reduce_values([float(bool(self._step.errors))], op=dist.ReduceOp.MAX)
        if not bad:
            return
        msgs: List[Any] = [None] * dist.get_world_size()
        comm.all_gather_object(msgs, self._step.errors)
        seen = list(dict.fromkeys(m for part in msgs for m in part))
        raise ValueError(f"HybridParallelPlugin(activation_checkpointing='auto'): {len(seen)} pipeline stage(s) cannot "
                         f"hold their share of the activation budget (this step ran under their lowest-peak plans): "
                         + " | ".join(seen) + ". Raise activation_budget (a stage plans one microbatch for the budget "
                         "divided by the microbatches it holds in flight), or use fewer microbatches in flight")

    def _run_nd(self, model: HybridParallelModule, batch: dict, criterion: Callable, m: int, return_outputs: bool,
                keys: tuple = ()):
        """One step under tp_mode 2d/2.5d/3d: this rank's rows of the batch, the criterion on its
        logits block (a ``vocab_parallel`` criterion) or on whole-vocab logits of its rows, every
        collective a ``comm`` span; the loss reported is the mean over the batch pieces."""
        from ..tp_nd import comm_spans, gather_vocab

        nd = model.nd
        whole, batch = batch, nd.shard_batch(batch, self.input_key)
        for k in keys:  # a model input (a transformers model's attention_mask, ...): the input's rows
            batch[k] = nd.grid.batch_piece(whole[k], nd.grid.stream, f"batch[{k!r}]")
        crit = criterion
        if not getattr(criterion, "vocab_parallel", False):
            def crit(outputs, mb):  # noqa: E306 - a criterion written for whole logits
                return criterion(gather_vocab(outputs), mb)
        with comm_spans(model.runtime.recorder):
            out = model.runtime.run(batch, crit, m, return_outputs=return_outputs, stage_keys=keys)
        g = nd.grid.group(nd.grid.inner.batch)
        if out["loss"] is not None and g.pg is not None:
            (total,) = comm.reduce_values([float(out["loss"])], group=g.pg)
            out["loss"] = torch.tensor(total / g.size, dtype=out["loss"].dtype)
        return out

    def _check_sequence_cut(self, batch: dict) -> None:
        """Under a pipeline a length sequence parallelism cannot cut would fail on one stage while the next
        waits for its send: refused here, on every rank alike, before the schedule starts."""
        x = batch.get(self.input_key)
        tp = self.tp_size
        if self.sequence_parallel and isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] % tp:
            raise ValueError(f"HybridParallelPlugin(sequence_parallel=True, tp_size={tp}): batch[{self.input_key!r}] "
                             f"has {x.shape[1]} tokens, which do not cut into {tp} equal sequence shards; use a "
                             f"length divisible by tp_size={tp}")

    def _run_cp(self, model: HybridParallelModule, batch: dict, criterion: Callable, m: int, return_outputs: bool,
                keys: tuple = ()):
        """One step under context parallelism: this rank's shard of every sequence (input and
        targets; zig-zag for ring; a transformers batch was cut with its positions and shifted labels
        before), ring/all-to-all waits as ``comm`` spans; the loss reported is the mean over the cp
        group's shards (outputs stay this rank's shard)."""
        from .. import context_parallel as cp
        from ..models.hf.vocab_parallel import backward_context

        group = model.cp[0]
        if not self._hf:
            batch = cp.shard_batch(batch, group, self.cp_mode, keys=(self.input_key, "targets"))
        with cp.comm_spans(model.runtime.recorder), backward_context():
            out = model.runtime.run(batch, criterion, m, return_outputs=return_outputs, stage_keys=keys)
        if self._hf and out["outputs"] is not None:
            out["outputs"] = hf.whole_outputs(model.stage_modules[-1].inner, out["outputs"])
        if out["loss"] is not None:
            (total,) = comm.reduce_values([float(out["loss"])], group=group)
            out["loss"] = torch.tensor(total / self.cp_size, dtype=out["loss"].dtype)
        return out

    def close(self) -> None:
        """Destroy the process groups this plugin made (its mesh's, dp × cp, tied copies', the N-d
        grid's): every boost makes new ones, and gloo keeps threads and sockets per group, so a
        notebook that boosts again and again (a search, a sweep) should close the plugin it is done
        with. Every rank calls it; the boosted model and optimizer cannot step afterwards."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        groups: List[Any] = self.dims.groups() if self.dims is not None else []
        groups += self.grads.ties.groups()
        if self.experts is not None:
            groups += self.experts.groups()
            self.experts = None
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
        if self.dims is not None:
            self.dims.forget()
        self.grads = GradSync(TiedCopies(), None)
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
