"""A transformers tensor-parallel plan for a peft LoRA model: where each adapter's A and B go.

Built on peft's LoRA layers (``lora.Linear``: ``base_layer`` plus ``lora_A[name]``/``lora_B[name]``,
``y = base(x) + B(A(x)) * scaling``) and the HF adapter's plan reading (``models/hf``). peft wraps
each targeted Linear, so the base model's plan (``model.layers.*.self_attn.q_proj: colwise``) names a
wrapper, not the Linear; :func:`lora_tp_plan` writes the plan in the peft model's names, one entry per
module, so the sum ``base(x) + B(A(x))`` is sharded exactly like ``base(x)`` and equals the
single-process result:

* colwise base (output features sharded, input whole): A stays whole (its input is whole), B is
  colwise: its output slice adds to the base's slice. A's gradient is whole on every rank: B's
  ``ColwiseParallel`` all-reduces the gradient of its input in backward, as for the base's input.
* rowwise base (input features sharded, outputs summed): A is rowwise (its input is the same
  slice; its output is summed over tp), B stays whole on the whole ``A(x)``.
* gathered colwise (an LM head): A whole, B colwise with its output gathered.

``enable_lora`` stores the plan as the peft model's ``tp_plan`` (the dict form the engine reads for
any model), so ``HybridParallelPlugin(tp_size=k)`` shards a LoRA model with no argument.
"""

from __future__ import annotations

import fnmatch
from typing import Dict, Optional

import torch.nn as nn

# base style -> (style of A, style of B); None: the adapter Linear stays whole
_ADAPTER_STYLES = {
    "colwise": (None, "colwise"), "local_colwise": (None, "colwise"),
    "colwise_rep": (None, "colwise_rep"), "colwise_gather_output": (None, "colwise_rep"),
    "rowwise": ("rowwise", None), "local_rowwise": ("rowwise", None),
}


def _is_lora_layer(module: nn.Module) -> bool:
    """A peft LoRA wrapper (a Linear's, an Embedding's, ...): a base layer plus adapters."""
    return hasattr(module, "base_layer") and (hasattr(module, "lora_A") or hasattr(module, "lora_embedding_A"))


def _is_lora_linear(module: nn.Module) -> bool:
    return isinstance(getattr(module, "base_layer", None), nn.Linear) and isinstance(
        getattr(module, "lora_A", None), nn.ModuleDict)


def lora_tp_plan(peft_model: nn.Module, base_names: bool = False) -> Optional[Dict[str, object]]:
    """The base model's plan in ``peft_model``'s module names (``base_names=True``: in the base model's
    own, for a pipeline, which splits the base model), with every LoRA-wrapped Linear split into its
    base layer and its adapters (None when the base model has no plan). A LoRA layer whose base style
    has no adapter rule (an embedding, packed weights) raises ``ValueError`` naming it."""
    from .models.hf.plan import read_plan

    base = peft_model.get_base_model()
    plan, _ = read_plan(base)
    if not plan:
        return None
    prefix = next(n for n, m in peft_model.named_modules() if m is base)
    names = [(n[len(prefix) + 1:], m) for n, m in peft_model.named_modules() if n.startswith(prefix + ".")]
    out: Dict[str, object] = {}
    for pattern, entry in plan.items():
        depth = pattern.count(".")
        for name, mod in names:
            if name.count(".") != depth or not fnmatch.fnmatchcase(name, pattern):
                continue
            full = name if base_names else f"{prefix}.{name}"
            if not _is_lora_layer(mod):
                out[full] = entry
                continue
            style = entry[0] if isinstance(entry, tuple) else entry
            if not _is_lora_linear(mod) or not isinstance(style, str) or style not in _ADAPTER_STYLES:
                raise ValueError(f"enable_lora under tensor parallelism: {name!r} ({type(mod).__name__}) carries "
                                 f"LoRA adapters and the plan shards it with {style!r}, which has no adapter rule; "
                                 f"leave it out of LoraConfig(target_modules=...) or run tp_size=1. Rules exist "
                                 f"for Linear layers under {sorted(_ADAPTER_STYLES)}")
            a_style, b_style = _ADAPTER_STYLES[style]
            out[f"{full}.base_layer"] = entry
            for adapter in mod.lora_A:
                if a_style is not None:
                    out[f"{full}.lora_A.{adapter}"] = a_style
                if b_style is not None:
                    out[f"{full}.lora_B.{adapter}"] = b_style
    return out
