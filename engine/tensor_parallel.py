"""Megatron-style tensor parallelism through DTensor's ``parallelize_module``.

Column/row sharding and the collectives between them are DTensor's. The plan is the model's
own (``tp_plan(sequence_parallel=...)``, the model contract) or the user's (``{"fc1":
ColwiseParallel(), "fc2": RowwiseParallel()}``, fnmatch patterns allowed); a transformers model's
plan is read and applied by the adapter (:mod:`.models.hf`). We add only glue: a
plan is applied to a pipeline *stage* holding some layers, so entries for modules it lacks are
dropped (exact names) instead of warned about; :func:`seq_boundary` is the style a
sequence-parallel plan puts where activations move between the whole sequence and its shards.
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn


def seq_boundary(n_inputs: int = 1, into: Optional[str] = None, out: Optional[str] = None):
    """A style moving a module's first positional input (of ``n_inputs``; ``into``) or its output
    (``out``) between the whole sequence and shards of it (dim 1): ``"shard"`` or ``"gather"``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput

    moves, rest, kw = ({"shard": (Replicate(), Shard(1)), "gather": (Shard(1), Replicate())},
                       (None,) * (n_inputs - 1), {})
    if into:
        kw.update(input_layouts=(moves[into][0],) + rest, desired_input_layouts=(moves[into][1],) + rest)
    if out:
        kw.update(output_layouts=moves[out][0], desired_output_layouts=moves[out][1], use_local_output=True)
    if into and out:
        return PrepareModuleInputOutput(use_local_input=True, **kw)
    return PrepareModuleInput(use_local_output=True, **kw) if into else PrepareModuleOutput(**kw)


def apply_tensor_parallel(module: nn.Module, tp_mesh, plan: Optional[dict] = None,
                          sequence_parallel: bool = False, loss_parallel: bool = False) -> nn.Module:
    """Shard ``module`` in place over ``tp_mesh`` (a 1-D DeviceMesh) and return it.

    ``plan`` (the user's) wins over the module's ``tp_plan()`` and then carries any sequence
    parallelism itself. ``loss_parallel``: a transformers model's LM head keeps vocabulary-sharded logits
    for a call with labels (``models/hf/vocab_parallel.py``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if tp_mesh.size() == 1:
        return module
    from .models.hf import reads_dict_plan

    if reads_dict_plan(module):  # transformers' tp_plan is a dict property, read by the adapter
        from .models.hf import apply_tensor_parallel as apply_hf

        return apply_hf(module, tp_mesh, plan, sequence_parallel, loss_parallel=loss_parallel)
    if plan is None:
        own = getattr(module, "tp_plan", None)
        if not callable(own):
            raise ValueError(
                f"HybridParallelPlugin(tp_size={tp_mesh.size()}): {type(module).__name__} has no tp_plan() "
                "(the model contract); pass tp_plan={'layer.name': ColwiseParallel() | RowwiseParallel(), ...}")
        plan = own(sequence_parallel=True) if sequence_parallel else own()
    names = {n for n, _ in module.named_modules()}
    kept = {k: v for k, v in plan.items() if any(c in k for c in "*?[") or k in names}
    parallelize_module(module, tp_mesh, kept)
    return module
