"""A transformers model built on the meta device, given storage for a checkpoint load to fill.

The lazy path (docs/hf_checkpoints.md): ``with lazy_init(): model = AutoModelForCausalLM.from_config(cfg)``
(or ``torch.device("meta")``), ``booster.boost(model)``, then ``booster.load_model(model, hf_dir)``.
A plugin that meets such a model calls :func:`to_empty_for_load` where it would have moved the model to
its device: torch's ``Module.to_empty`` gives every tensor uninitialised storage, after tensor
parallelism has sharded it, so a rank allocates its own shard only. Parameters are left for the load;
buffers are not in a checkpoint when they are non-persistent (rotary ``inv_freq``, ``position_ids``),
so the modules that own them are re-initialised with transformers' own rule, ``model._init_weights``.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def needs_empty(model: nn.Module) -> bool:
    """A transformers model with tensors still on the meta device (nothing imported to tell)."""
    from ...lazy import is_lazy
    from . import is_hf_model

    hf = getattr(model, "inner", model)  # a hybrid StageModule holds the model as ``inner``
    return is_hf_model(hf) and is_lazy(hf)


@torch.no_grad()
def to_empty_for_load(model: nn.Module, device) -> nn.Module:
    """``model`` (or a module holding it as ``inner``) with storage on ``device``: parameters
    uninitialised until ``load_model``, meta buffers recomputed by ``_init_weights``."""
    hf = getattr(model, "inner", model)
    owners = [m for m in hf.modules() if any(b is not None and b.is_meta for b in m._buffers.values())]
    model.to_empty(device=device)
    init = getattr(hf, "_init_weights", None)
    if owners and init is None:
        raise ValueError(f"{type(hf).__name__} built on the meta device has buffers and no _init_weights to "
                         "recompute them; build it on a real device")
    for m in owners:
        init(m)
    return model
