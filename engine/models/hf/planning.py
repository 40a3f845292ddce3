"""What the planners ask of a transformers model or config: the model on the meta device, and one
tensor-parallel rank's parameter shapes under the model's own plan.

``cl.plan`` traces a step on fake tensors of the model; for an HF *config* (a ``PreTrainedConfig``) the
model is built here, on the meta device, by the class the config names (``config.architectures``),
else by transformers' ``AutoModelForCausalLM`` (``AutoModel`` for a config no causal-LM class takes).
That is the one place the engine imports transformers, and only once it holds an HF config (so
transformers is already loaded). Shard shapes are read from the same plan the plugin applies
(:func:`.plan.read_plan` / the user's ``tp_plan=``), by :func:`.styles.weight_shard_dim`.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn as nn

from .local_linear import is_conv1d
from .plan import _matches, torch_plan
from .styles import weight_shard_dim


def is_hf_config(obj) -> bool:
    """True for a transformers config (``PreTrainedConfig``; ``PretrainedConfig`` before transformers 5), by
    its class's MRO: no import of transformers."""
    return any(c.__name__ in ("PreTrainedConfig", "PretrainedConfig") and c.__module__.startswith("transformers")
               for c in type(obj).__mro__)


def meta_model(config) -> nn.Module:
    """The model ``config`` describes, built on the meta device (no memory): see :func:`build_model`."""
    with torch.device("meta"):
        return build_model(config)


def build_model(config) -> nn.Module:
    """The model ``config`` describes, with transformers' own initialisation: the class named first in
    ``config.architectures`` when transformers has it, else the causal-LM class for its model type,
    else the bare model."""
    import transformers

    arch = next(iter(getattr(config, "architectures", None) or []), None)
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if cls is not None:
        return cls(config)
    try:
        return transformers.AutoModelForCausalLM.from_config(config)
    except ValueError:  # an encoder (BERT) or a family without a causal-LM head
        return transformers.AutoModel.from_config(config)


def _config_int(model: nn.Module, names) -> Optional[int]:
    """The first positive int among ``names`` on the model's (text) config; None if none is set."""
    cfg = getattr(model, "config", None)
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    for name in names:
        n = getattr(cfg, name, None)
        if isinstance(n, int) and n > 0:
            return n
    return None


def hidden_width(model: nn.Module) -> Optional[int]:
    """The activation width of a transformers model (``hidden_size``, GPT-2's ``n_embd``, OPT's
    ``word_embed_proj_dim`` aside), from its (text) config."""
    return _config_int(model, ("hidden_size", "n_embd", "d_model"))


def vocab_size(model: nn.Module) -> Optional[int]:
    return _config_int(model, ("vocab_size",))


def decoder_layers(model: nn.Module) -> Optional[int]:
    """How many transformer blocks the (text) config names (``num_hidden_layers``, GPT-2's ``n_layer``)."""
    return _config_int(model, ("num_hidden_layers", "n_layer", "num_layers"))


def shrink(model: nn.Module, plan: dict, tp: int) -> nn.Module:
    """``model`` (real tensors) cut in place to one tensor-parallel rank's shapes under ``plan``: what one
    rank computes, for timing (the first slice of each cut weight; the values do not matter).
    Embeddings stay whole (their lookups cost no compute, and whole they take every token id)."""
    shapes = shard_shapes(model, plan, tp)
    for name, shape in shapes.items():
        owner, _, attr = name.rpartition(".")
        mod = model.get_submodule(owner)
        if isinstance(mod, nn.Embedding):
            continue  # a lookup costs no time worth timing, and every id must still find its row
        old = getattr(mod, attr)
        cut = old.data[tuple(slice(0, n) for n in shape)].clone()
        setattr(mod, attr, nn.Parameter(cut, requires_grad=old.requires_grad))
    for mod in model.modules():  # nn.Linear keeps its feature counts as attributes too
        if isinstance(mod, nn.Linear):
            mod.out_features, mod.in_features = mod.weight.shape
    per_rank(model, plan, tp)
    return model


def shard_shapes(model: nn.Module, plan: dict, tp: int) -> Dict[str, torch.Size]:
    """Each parameter's shape on one of ``tp`` ranks under ``plan`` (module pattern -> transformers style
    name), as the plugin cuts it: the weight along its style's dimension (rounded up: the first ranks'
    share of an uneven cut), a bias with it when the output features are cut (colwise)."""
    out: Dict[str, torch.Size] = {}
    for pattern, name, mod in _matches(plan, model):
        entry = plan[pattern]
        if not isinstance(entry, (str, tuple)):
            continue  # a torch ParallelStyle from the user: its cut is its own (planned whole)
        dim = weight_shard_dim(entry, mod)
        if dim is None:
            continue
        for pn, p in mod.named_parameters(recurse=False):
            shape = list(p.shape)
            if pn == "weight":
                d = dim
            elif p.dim() == 1 and (dim == 0 and not is_conv1d(mod) or dim == 1 and is_conv1d(mod)):
                d = 0  # the bias of a layer whose outputs are cut
            else:
                continue
            shape[d] = -(-shape[d] // tp)
            out[f"{name}.{pn}" if name else pn] = torch.Size(shape)
    return out


def per_rank(model: nn.Module, plan: dict, tp: int) -> None:
    """The built-in table's head counts as one rank's share (GPT-2's ``split_size``/``num_heads``, OPT's
    ``num_heads``), so a forward runs on shard shapes: the rule the plugin applies, on the same modules;
    and each ``Conv1D``'s output width as its (shard-shaped) weight's."""
    from . import _per_rank

    _per_rank(model, {name.rpartition(".")[0] for name in torch_plan(model, plan)}, tp)
    for mod in model.modules():
        if is_conv1d(mod):  # Conv1D shapes its output by ``nf``, its (in, out) weight's out
            mod.nf = mod.weight.shape[1]
