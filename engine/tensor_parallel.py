"""Megatron-style tensor parallelism through DTensor's ``parallelize_module``.

Built on ``torch.distributed.tensor.parallel``: column/row sharding, and the collectives
between them, are DTensor's. We add only the glue a pipeline needs:

* a plan is applied to a *stage* (a GPT cut by ``pipeline_stage``) that keeps only some
  blocks, so plan entries for modules the stage does not hold are dropped (exact names) instead
  of raising warnings per missing block;
* the reference GPT brings its own plan (``GPT.tp_plan()``); any other model passes one
  (``{"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}``, fnmatch patterns allowed);
* ``sequence_parallel=True`` (GPT only) keeps the residual stream sharded along the sequence
  between blocks: norms run as ``SequenceParallel``, the attention/MLP inputs are all-gathered
  and their row-parallel outputs reduce-scattered back to sequence shards, as in Megatron-SP.
  Pipeline boundaries carry the full sequence (GPT.forward sizes its rotary tables from its
  input), so the saving is in norm/dropout activations inside a stage.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch.nn as nn


def _gpt_sp_plan(module: nn.Module) -> Dict[str, object]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    keys = list(module.blocks.keys())
    plan: Dict[str, object] = {}
    # positional inputs as GPT calls them: Block(h, cos, sin[, cache, key]), Attention(x, cos, sin, cache, key)
    nb = 3 if module.cfg.activation_checkpointing else 5
    blk_in, blk_rest = (Replicate(),) + (None,) * (nb - 1), (None,) * (nb - 1)
    rest4 = (None,) * 4
    if getattr(module, "tok_emb", None) is not None:
        # replicated embedding; its output is cut into sequence shards for the blocks
        plan["tok_emb"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                              use_local_output=True)
    elif keys:
        # a later pipeline stage receives the full sequence (so GPT.forward sees the true length
        # for its rotary tables) and cuts it into shards before its first block
        plan[f"blocks.{keys[0]}"] = PrepareModuleInput(input_layouts=blk_in,
                                                       desired_input_layouts=(Shard(1),) + blk_rest,
                                                       use_local_output=True)
    for key in keys:
        p = f"blocks.{key}"
        plan[f"{p}.attn_norm"] = SequenceParallel()
        plan[f"{p}.mlp_norm"] = SequenceParallel()
        plan[f"{p}.attn"] = PrepareModuleInput(input_layouts=(Shard(1),) + rest4,
                                               desired_input_layouts=(Replicate(),) + rest4,
                                               use_local_output=True)
        plan[f"{p}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                              use_local_output=True)
        for n in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3"):
            plan[f"{p}.{n}"] = ColwiseParallel()
        for n in ("attn.wo", "mlp.w2"):
            plan[f"{p}.{n}"] = RowwiseParallel(output_layouts=Shard(1))
    if getattr(module, "norm", None) is not None:
        plan["norm"] = SequenceParallel()
        # the head stays replicated (it may be tied to the embedding): gather the sequence first
        plan["lm_head"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                             use_local_output=True)
    elif keys:
        # hand the next pipeline stage the full sequence
        last = f"blocks.{keys[-1]}"
        if last in plan:  # a one-block middle stage: shard on the way in, gather on the way out
            plan[last] = PrepareModuleInputOutput(
                input_layouts=blk_in, desired_input_layouts=(Shard(1),) + blk_rest,
                use_local_input=True, output_layouts=Shard(1), desired_output_layouts=Replicate(),
                use_local_output=True)
        else:
            plan[last] = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                             use_local_output=True)
    return plan


def apply_tensor_parallel(module: nn.Module, tp_mesh, plan: Optional[dict] = None,
                          sequence_parallel: bool = False) -> nn.Module:
    """Shard ``module`` in place over ``tp_mesh`` (a 1-D DeviceMesh) and return it."""
    from torch.distributed.tensor.parallel import parallelize_module

    if tp_mesh.size() == 1:
        return module
    if sequence_parallel:
        if not hasattr(module, "blocks"):
            raise ValueError("HybridParallelPlugin(sequence_parallel=True): sequence parallelism is "
                             "implemented for the reference GPT only; set sequence_parallel=False")
        plan = _gpt_sp_plan(module)
    elif plan is None:
        if not hasattr(module, "tp_plan"):
            raise ValueError(
                f"HybridParallelPlugin(tp_size={tp_mesh.size()}): {type(module).__name__} has no tp_plan(); "
                "pass tp_plan={'layer.name': ColwiseParallel() | RowwiseParallel(), ...}"
            )
        plan = module.tp_plan()
    names = {n for n, _ in module.named_modules()}
    kept = {k: v for k, v in plan.items() if any(c in k for c in "*?[") or k in names}
    parallelize_module(module, tp_mesh, kept)
    return module
