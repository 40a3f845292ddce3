"""ZeRO-2 in the hybrid plugin (``zero_stage=2``): FSDP2's ``fully_shard``, as ``LowLevelZeroPlugin(stage=2)``.

Each block and the stage's root are sharded over the data-parallel ranks with
``reshard_after_forward=False`` (parameters gathered once per forward and kept for backward, gradients
reduce-scattered in backward, optimizer state on each rank's shard only: ZeRO-2's memory, as the repo's
ZeRO-2 plugin has it). Nothing of the reduction is hand-written.

Under expert parallelism the grouped expert weights of every MoE block (ours, or a transformers MoE family's
experts module, found through its ep plan by ``models/hf/moe.py``) are sharded apart, over the
expert-dp group (the ranks holding the same experts, :mod:`.experts`), before their block is: a block's
``fully_shard`` then leaves them to their own unit. Their reduce-scatter sums over the expert-dp group and
divides by the whole dp size (``set_gradient_divide_factor``; a plain sum forced, which gloo runs): the
gradient the unsharded plugin makes (an expert's gradient already sums its EP group's tokens). When
``dp == ep`` there is one copy of each expert: they are left out of FSDP (``ignored_params``) and reduced
by :class:`.grads.GradSync` as without ZeRO. torchtitan shards MoE experts the same way (its ``dp_shard_mod_ep`` mesh).
"""

from __future__ import annotations

from typing import Set


def check_zero2(plugin) -> None:
    """What ZeRO-2 composes with so far, refused at construction (before any group exists)."""
    bad = [(a, v) for a, v in (("pp_size", plugin.pp_size), ("tp_size", plugin.tp_size), ("cp_size", plugin.cp_size))
           if v > 1]
    if bad:
        a, v = bad[0]
        raise ValueError(f"HybridParallelPlugin(zero_stage=2, {a}={v}): ZeRO-2 (FSDP2 over dp) composes with data and "
                         f"expert parallelism only so far; use zero_stage=1 with {a}={v}, or {a}=1")
    if plugin.precision == "fp16":
        raise ValueError("HybridParallelPlugin(zero_stage=2, precision='fp16'): the loss scaler is not built over "
                         "FSDP2's sharded gradients here; use precision='fp32' or 'bf16', or zero_stage=1")


def apply_zero2(model, dims, experts) -> Set[int]:
    """Shard every stage module of ``model`` (a ``HybridParallelModule``); returns the ids of the parameters
    whose gradients FSDP2 reduces (``GradSync`` leaves them alone)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from ..low_level_zero import fsdp_blocks

    dev = model.device.type
    dp_mesh = DeviceMesh.from_group(dims.grad_group, dev)
    ex_mesh = None
    if experts is not None and experts.expert_dp_group is not None:
        ex_mesh = DeviceMesh.from_group(experts.expert_dp_group, dev)
    for mod in model.stage_modules:
        inner = mod.inner
        ignored = set()
        for unit, grouped in _expert_units(inner):
            if ex_mesh is not None:
                # anything else the unit holds stays out of it: a dense parameter, averaged over dp as the rest
                rest = {p for p in unit.parameters() if all(p is not q for q in grouped)}
                fully_shard(unit, mesh=ex_mesh, reshard_after_forward=False, ignored_params=rest or None)
                unit.set_gradient_divide_factor(float(dims.dp))
                unit.set_force_sum_reduction_for_comms(True)  # SUM, then divide (gloo has no PREMUL_SUM)
            else:
                ignored.update(grouped)
        kw = dict(mesh=dp_mesh, reshard_after_forward=False, ignored_params=ignored or None)
        for _, block in fsdp_blocks(inner):
            fully_shard(block, **kw)
        fully_shard(inner, **kw)
    if experts is not None:  # fully_shard made new (DTensor) parameters: the expert set by name again
        experts.params = {id(p) for n, p in model.named_model_parameters() if n in experts.names}
    return {id(p) for _, p in model.named_model_parameters() if hasattr(p, "device_mesh")}


def _expert_units(inner):
    """``(module, its grouped expert weights)`` for every experts module split over EP: our MoE blocks'
    ``experts`` and a transformers MoE family's experts modules (``models/hf/moe.py`` finds them through the
    model's ep plan)."""
    from ...models.hf import moe as hf_moe
    from ...moe import moe_layers

    units = [(moe.experts, list(moe.experts.parameters())) for _, moe in moe_layers(inner) if moe.ep is not None]
    return units + [(m, grouped) for _, m, grouped in hf_moe.split_modules(inner)]
