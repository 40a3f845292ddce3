"""The steps ``HybridParallelPlugin.configure`` composes, one parallelism each, over one :class:`ParallelDims`.

Each ``apply_*`` takes the model (or a stage's part of it) and the dims that own the mesh and groups,
and does one thing: cut the sequence over cp, convert a part to 1D or N-d tensor parallelism, wrap
layers to recompute, split the pipeline stages, hook the per-stage checkpoint planning, find tied
copies, rebuild the optimizer. The order they run in is ``configure``'s (docs/hybrid.md).
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional

import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

from ...device import default_device
from ...wrappers import rebuild_optimizer
from .auto_checkpoint import PipelineStep, StageCheckpointHook
from .dims import ParallelDims
from .grads import GradSync, TiedCopies
from .module import HybridParallelModule
from .optimizer import HybridParallelOptimizer


def parameter_names(model: nn.Module) -> Dict[int, List[str]]:
    """Parameter names by identity (a tied weight has two), taken before tensor parallelism replaces them."""
    names_of: Dict[int, List[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(n)
    return names_of


def apply_context_parallel(model: nn.Module, dims: ParallelDims, mode: str) -> None:
    """Every attention of ``model`` over the cp group (before the stages copy it)."""
    if dims.cp > 1:
        from ...context_parallel import apply_context_parallel as enable
        from ...models.hf import is_hf_model

        if is_hf_model(model):  # its attention function swapped through transformers' registry
            from ...models.hf.context import enable_context_parallel as enable
        enable(model, dims.cp_group, mode)


def nd_grid(dims: ParallelDims, tp_mode: str, sizes: Dict[str, int]):
    """The 2D/2.5D/3D grid cut from each tp group of the mesh (collective: its groups), or None under 1D."""
    if tp_mode == "1d" or dims.tp == 1:
        return None
    from ...tp_nd import Grid

    return Grid(tp_mode, sizes, dims.tp_rank_lists(), dist.get_rank())


def apply_tp(part: nn.Module, dims: ParallelDims, grid, tp_plan: Optional[dict], sequence_parallel: bool,
             nd_params: dict, loss_parallel: bool = False) -> nn.Module:
    """This part's planned modules in their N-d grid form (their specs added to ``nd_params``), or
    DTensor's 1D tensor parallelism over the tp mesh (``loss_parallel``: a vocabulary-parallel LM head
    and loss where the model's plan allows; under a pipeline, on the last stage)."""
    if grid is not None:
        from ...models import hf
        from ...tp_nd import convert, resolve_plan

        roles = hf.nd_plan(part, tp_plan, grid.mode) if hf.reads_dict_plan(part) else None
        nd_params.update(convert(part, grid, resolve_plan(part, tp_plan, roles=roles)))
        if roles is not None:  # the table's head counts: one rank's share of the grid side
            from ...models.hf.nd import divide_per_rank

            divide_per_rank(part, roles, grid.q)
        return part
    from ...tensor_parallel import apply_tensor_parallel

    return apply_tensor_parallel(part, dims.tp_mesh, tp_plan, sequence_parallel,
                                 loss_parallel=loss_parallel)


def apply_checkpoint_wrappers(part: nn.Sequential) -> None:
    """Each child of a (stage's) Sequential recomputes in backward (after tensor parallelism, so a
    ``tp_plan`` sees the user's own module names)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i in range(len(part)):
        part[i] = checkpoint_wrapper(part[i])


def prepare_part(part: nn.Module, *, dims: ParallelDims, grid, tp_plan, sequence_parallel: bool, wrap: bool,
                 nd_params: dict, loss_parallel: bool = False) -> nn.Module:
    """What every part (the model, or a stage's copy) goes through before it becomes a stage."""
    part = apply_tp(part, dims, grid, tp_plan, sequence_parallel, nd_params, loss_parallel)
    # the ranks whose collectives run inside the part's layers: every "auto" plan is agreed over them
    part._checkpoint_groups = dims.checkpoint_groups
    if wrap:
        apply_checkpoint_wrappers(part)
    return part


def apply_pipeline(model: nn.Module, spec, dims: ParallelDims, prepare: Callable[[nn.Module], nn.Module],
                   autocast, input_key: str, loss_scale: Callable[[], float]) -> HybridParallelModule:
    """This rank's stage modules (the whole model without a pipeline) and the runtime driving them;
    each stage's module carries its ``stage_index`` (a checkpoint plan's event reports it)."""
    from ...models.hf.empty import needs_empty, to_empty_for_load
    from ...pipeline.runtime import PipelineRuntime
    from ...pipeline.stage import StageModule, build_stages

    device, pp_rank = default_device(), dims.rank("pp")
    if dims.pp > 1:
        ids = spec.stage_indices(pp_rank)
        modules, stages = build_stages(model, ids, spec.num_stages, dims.pp_group, device, autocast, prepare)
    else:
        stage = StageModule(prepare(model), autocast)
        # a transformers model built on meta: storage for this rank's shards only, for load_model to fill
        stage = to_empty_for_load(stage, device) if needs_empty(stage) else stage.to(device)
        ids, modules, stages = [0], [stage], []
    runtime = PipelineRuntime(spec, modules, stages, device=device, rank=dist.get_rank(), pp_rank=pp_rank,
                              pp_group=dims.pp_group if dims.pp > 1 else None, dp_rank=dims.rank("dp"),
                              tp_rank=dims.rank("tp"), input_key=input_key, loss_scale=loss_scale)
    for sid, mod in zip(ids, modules):
        mod.inner.stage_index = sid
    return HybridParallelModule(modules, runtime, dims.pp)


def apply_auto_checkpointing(model: HybridParallelModule, spec, dims: ParallelDims, budget: int,
                             step: PipelineStep, pp_style: str, num_model_chunks: int) -> None:
    """A :class:`StageCheckpointHook` on every stage of this rank, planning its share of ``budget``;
    a model's own request is planned here, so its own hook stands aside."""
    from ...autockpt_request import take

    pp_rank = dims.rank("pp")
    share = functools.partial(_share, budget, pp_style, dims.pp, pp_rank, num_model_chunks)
    for mod in model.stage_modules:
        take(mod.inner)
        hook = StageCheckpointHook(step, model.runtime, dims.checkpoint_groups, pp_rank, share,
                                   is_last=mod.inner.stage_index == spec.num_stages - 1, pipelined=dims.pp > 1)
        mod.inner.register_forward_pre_hook(hook, with_kwargs=True)


def _share(budget: int, style: str, pp: int, pp_rank: int, chunks: int, m: int) -> int:
    """A stage's budget per microbatch when ``m`` run (``autockpt_dist.stage_budget``)."""
    from ...autockpt_dist import stage_budget

    return stage_budget(budget, style, pp, pp_rank, m, chunks)


def apply_ties(model: HybridParallelModule, names_of: Dict[int, List[str]], dims: ParallelDims) -> TiedCopies:
    """The copies a pipeline split made of each tied weight (none without a pipeline: one rank holds them)."""
    tied = [names for names in names_of.values() if len(names) > 1]
    return TiedCopies.find(model, tied, dims) if tied and dims.pp > 1 else TiedCopies()


def apply_optimizer(optimizer: Optional[Optimizer], names_of: Dict[int, List[str]], model: HybridParallelModule,
                    dims: ParallelDims, zero_stage: int, precision: str, loss_scaler,
                    grads: GradSync) -> Optional[HybridParallelOptimizer]:
    """The user's optimizer over this rank's (stage's, tensor-parallel) parameters, same groups and
    hyper-parameters; ZeRO-1 shards its state over dp × cp. (``Booster.boost`` points an LR scheduler
    at the rebuilt optimizer.)"""
    if optimizer is None:
        return None
    cls = None
    if zero_stage == 1 and grads.experts is not None:  # experts shard over their own group (expert_zero.py)
        from .expert_zero import split_zero

        optim = split_zero(optimizer, names_of, model, dims, grads.experts)
        return HybridParallelOptimizer(optim, model, precision, loss_scaler, grads)
    if zero_stage == 1 and dims.dp * dims.cp > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        cls = functools.partial(ZeroRedundancyOptimizer, optimizer_class=type(optimizer),
                                process_group=dims.grad_group)
    optim = rebuild_optimizer(optimizer, names_of, dict(model.named_model_parameters()),
                              optimizer_class=cls, partial=True)
    return HybridParallelOptimizer(optim, model, precision, loss_scaler, grads)
