"""LoRA through PEFT: wrap a model in adapters before ``boost``, train only them, save them as PEFT does.

Built on ``peft`` (``get_peft_model``, ``PeftModel.from_pretrained``, ``get_peft_model_state_dict``,
``PeftModel.save_pretrained``): peft owns the adapter math and the file format, so an adapter saved
here loads with ``peft.PeftModel.from_pretrained`` anywhere. What this module adds is what a
distributed run needs around it: every argument checked before any work (peft importable, a
``LoraConfig``, target modules that exist, a model not yet boosted), the optimizer trimmed to the
trainable parameters at boost (frozen base weights get no optimizer state under any plugin), and a
save that gathers the adapter tensors from whatever the plugin made of them (DDP, FSDP2 DTensors,
Gemini chunks) before rank 0 writes them atomically. peft and transformers are imported inside the
functions that need them: importing the engine never imports them.
"""

from __future__ import annotations

import os
import re
import weakref
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

from . import comm

#: set on the PeftModel ``enable_lora`` returns: ``boost`` trims the optimizer of such a model
LORA_MARK = "_colossal_lab_lora"
#: set on the base model a pipeline splits instead of its PeftModel: a weak reference back to it
PEFT_REF = "_colossal_lab_peft"
PEFT_PREFIX = "base_model.model."  # a peft model's names of its base model's parameters


def _require_peft():
    try:
        import peft
    except ImportError:
        raise ImportError("booster.enable_lora needs peft: `pip install peft` "
                          "(or `pip install 'colossal-lab[hf]'`, which brings peft and transformers)") from None
    from .models.hf.version import check_floor

    check_floor("peft")  # the oldest peft the LoRA tests pass on beside transformers 5
    return peft


def _is_boosted(model: nn.Module) -> bool:
    from .wrappers import ModelWrapper

    return isinstance(model, (ModelWrapper, nn.parallel.DistributedDataParallel)) or hasattr(model, "unwrap")


def _module_names(model: nn.Module) -> List[str]:
    return [n for n, _ in model.named_modules() if n]


def _suggestions(model: nn.Module, k: int = 8) -> List[str]:
    """Distinct last name parts of the model's Linear/Embedding/Conv layers: what
    ``target_modules`` usually names."""
    seen: Dict[str, None] = {}
    for n, m in model.named_modules():
        if n and (isinstance(m, (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d)) or type(m).__name__ == "Conv1D"):
            seen.setdefault(n.rsplit(".", 1)[-1], None)
    return list(seen)[:k]


def missing_targets(model: nn.Module, target_modules) -> List[str]:
    """The entries of ``target_modules`` that match no module of ``model`` under peft's rule (a
    name matches a module whose dotted name equals it or ends in ``.name``; a string is a regex
    that must fully match some name; ``"all-linear"`` always matches)."""
    if target_modules is None:
        return []
    names = _module_names(model)
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            return []
        return [] if any(re.fullmatch(target_modules, n) for n in names) else [target_modules]
    return [t for t in target_modules if not any(n == t or n.endswith("." + t) for n in names)]


def check_lora_args(model, pretrained_dir, lora_config, bnb_quantization_config, quantize) -> None:
    """Every check ``enable_lora`` makes, before any work: ``ValueError``/``TypeError`` naming the
    argument and the fix."""
    peft = _require_peft()
    if quantize or bnb_quantization_config is not None:
        raise ValueError("enable_lora(quantize=True / bnb_quantization_config=...): QLoRA (bitsandbytes "
                         "quantization) is not supported; pass quantize=False and no bnb_quantization_config, "
                         "or quantize the base model yourself outside the booster")
    if not isinstance(model, nn.Module):
        raise TypeError(f"enable_lora(model=...): expected a torch.nn.Module, got {type(model).__name__}")
    if _is_boosted(model):
        raise ValueError("enable_lora(model=...): the model is already boosted; call "
                         "booster.enable_lora(model, ...) first, then booster.boost(lora_model, optimizer, ...)")
    if isinstance(model, peft.PeftModel):
        raise ValueError("enable_lora(model=...): the model already is a peft.PeftModel; pass its base model "
                         "(model.get_base_model()), or boost it directly")
    if pretrained_dir is None and lora_config is None:
        raise ValueError("enable_lora: pass lora_config=peft.LoraConfig(...) for new adapters or "
                         "pretrained_dir=<adapter directory> to load saved ones")
    if pretrained_dir is not None:
        if not os.path.isfile(os.path.join(pretrained_dir, "adapter_config.json")):
            raise ValueError(f"enable_lora(pretrained_dir={str(pretrained_dir)!r}): no adapter_config.json there; "
                             "pass a directory written by booster.save_lora_as_pretrained or "
                             "PeftModel.save_pretrained")
        return
    if not isinstance(lora_config, peft.LoraConfig):
        raise TypeError(f"enable_lora(lora_config=...): expected a peft.LoraConfig, got "
                        f"{type(lora_config).__name__}; build one with peft.LoraConfig(r=8, target_modules=[...])")
    missing = missing_targets(model, lora_config.target_modules)
    if missing:
        raise ValueError(f"enable_lora(lora_config=LoraConfig(target_modules=...)): {sorted(missing)} match no module "
                         f"of {type(model).__name__}; name modules it has, e.g. {_suggestions(model)}")


def enable_lora(model: nn.Module, pretrained_dir: Optional[str] = None, lora_config=None,
                bnb_quantization_config=None, quantize: bool = False) -> nn.Module:
    """``model`` wrapped in LoRA adapters (a ``peft.PeftModel``): new ones from ``lora_config``, or
    saved ones from ``pretrained_dir`` (trainable). Only the adapters require gradients."""
    check_lora_args(model, pretrained_dir, lora_config, bnb_quantization_config, quantize)
    peft = _require_peft()
    if pretrained_dir is not None:
        lora = peft.PeftModel.from_pretrained(model, pretrained_dir, is_trainable=True)
    else:
        lora = peft.get_peft_model(model, lora_config)
    setattr(lora, LORA_MARK, True)
    return lora


def prepare_boost(model: nn.Module, optimizer: Optional[Optimizer], plugin) -> nn.Module:
    """What ``boost`` does first for a model from ``enable_lora`` (nothing for any other model), and
    the model to hand the plugin: the optimizer trimmed to the adapters; under tensor parallelism
    (a plugin with ``tp_size > 1`` and no ``tp_plan=`` of the user's) the base model's plan written
    for the LoRA layers (``lora_tp.lora_tp_plan``), stored as the model's ``tp_plan``; under a
    pipeline (``pp_size > 1``) the base model itself, adapters injected in its layers, since the
    pipeline splits a model by its own contract (``num_layers``, ``pipeline_stage``). Both together: the
    base model, carrying the LoRA plan in its own module names, which every stage copy keeps."""
    if not getattr(model, LORA_MARK, False):
        return model
    trim_optimizer(model, optimizer)
    pipelined = getattr(plugin, "pp_size", 1) > 1
    plan = None
    if getattr(plugin, "tp_size", 1) > 1 and getattr(plugin, "tp_plan", None) is None:
        from .lora_tp import lora_tp_plan

        plan = lora_tp_plan(model, base_names=pipelined)
    if pipelined:
        base = model.get_base_model()
        setattr(base, PEFT_REF, weakref.ref(model))
        if plan is not None:
            # what transformers' tp_plan property returns (and plan.read_plan reads next), without its
            # setter's validation, which differs between releases
            base._tp_plan = plan
        return base
    if plan is not None:
        model.tp_plan = plan  # an instance attribute: read before peft forwards to the base model
    return model


def trim_optimizer(model: nn.Module, optimizer: Optional[Optimizer]) -> None:
    """Drop frozen parameters from ``optimizer``'s param groups, in place (the user built it from
    ``model.parameters()``; the groups, their hyper-parameters and the optimizer object stay, so an
    LR scheduler keeps driving it). Only a model from ``enable_lora`` is touched."""
    if optimizer is None or not getattr(model, LORA_MARK, False):
        return
    if optimizer.state:
        raise ValueError("boost(optimizer=...): the optimizer has already stepped; boost it before the first step")
    for g in optimizer.param_groups:
        g["params"] = [p for p in g["params"] if p.requires_grad]


# ---- saving -------------------------------------------------------------------------------------
def find_peft_model(model: nn.Module):
    """The ``peft.PeftModel`` inside a boosted model (whatever wraps it: ModelWrapper, DDP, Gemini,
    the hybrid plugin's stage modules)."""
    peft = _require_peft()
    for m in model.modules():
        if isinstance(m, peft.PeftModel):
            return m
        ref = getattr(m, PEFT_REF, None)  # a pipeline split the base model (prepare_boost)
        if ref is not None and ref() is not None:
            return ref()
    raise ValueError("save_lora_as_pretrained(model=...): no peft.PeftModel inside; pass the model "
                     "booster.boost returned for the model booster.enable_lora gave you")


def _gemini_manager(model: nn.Module):
    from .gemini.zero_model import GeminiModel

    return model.manager if isinstance(model, GeminiModel) else None


def full_trainable_state(model: nn.Module, peft_model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every trainable tensor of ``peft_model`` by its name in it, whole, on CPU: gathered from
    Gemini chunks or FSDP2 DTensors when the plugin sharded it. Collective: every rank calls it."""
    mgr = _gemini_manager(model)
    out: Dict[str, torch.Tensor] = {}
    if hasattr(model, "named_model_parameters") and hasattr(model, "runtime"):
        return _hybrid_trainable_state(model)
    if mgr is not None:  # only the chunks holding adapters are gathered, in the same order on every rank
        for c in mgr.chunks:
            if not c.trainable:
                continue
            full = mgr.gather_full(c, mgr.read_state(c)[:c.shard_size].contiguous())
            for info in c.trainable:
                out[info.name] = full[info.offset:info.end].view(info.shape).clone()
        return out
    for name, p in peft_model.named_parameters():
        if p.requires_grad:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = t.detach().to("cpu", copy=True)
    return out


def _hybrid_trainable_state(model) -> Dict[str, torch.Tensor]:
    """The hybrid plugin's adapters: DTensors made whole over tp, every pipeline stage's gathered
    over pp; names as the peft model's (a split base model's get ``PEFT_PREFIX``)."""
    peft = _require_peft()
    split = not any(isinstance(m, peft.PeftModel) for m in model.modules())
    local = {}
    for n, p in model.named_model_parameters():
        if p.requires_grad:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            local[(PEFT_PREFIX + n) if split else n] = t.detach().to("cpu", copy=True)
    group = model.runtime.pp_group
    if group is None or dist.get_world_size(group) == 1:
        return local
    parts: List = [None] * dist.get_world_size(group)
    comm.all_gather_object(parts, local, group=group)
    return {n: t for part in parts for n, t in part.items()}


def save_lora_as_pretrained(model: nn.Module, checkpoint, use_safetensors: bool = True) -> None:
    """Write the adapters of a boosted LoRA model to directory ``checkpoint`` as
    ``PeftModel.save_pretrained`` does (``adapter_config.json`` + ``adapter_model.safetensors``).
    Collective: every rank calls it; rank 0 writes, into a temporary directory swapped in whole."""
    from .checkpoint_io.atomic import atomic_dir

    peft_model = find_peft_model(model)
    state = full_trainable_state(model, peft_model)
    lead = not comm.initialized() or dist.get_rank() == 0
    with atomic_dir(checkpoint, collective=True) as tmp:
        if lead:
            peft_model.save_pretrained(str(tmp), state_dict=state, safe_serialization=use_safetensors)
