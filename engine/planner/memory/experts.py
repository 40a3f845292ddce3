"""The mixture-of-experts part of a plan: which parameters are experts, and the all-to-all bytes of a step.

Under ``HybridParallelPlugin(ep_size=k)`` each rank of an EP group holds ``E / k`` experts of every MoE
layer (``plugins/hybrid/experts.py``), so the planner counts the expert parameters (and their gradients
and optimizer state) at ``1/k`` per rank and the rest as before. The MoE layers are found as the plugin
finds them: the engine's ``MoE`` blocks (``moe.moe_layers``) and a transformers family's experts modules
named by its ep plan (``models.hf.moe.expert_modules``); the refusals are the plugin's own
(``check_expert_parallel``), raised before anything is traced.

Traffic: every rank routes its ``N`` rows per forward to ``top_k`` experts each and sends the rows for
other ranks' experts by all-to-all (dispatch), and gets their outputs back (combine); backward sends the
gradients the reverse way. With the routing balanced over the EP group (``(k - 1) / k`` of the
assignments leave the rank, as many arrive), each of the four is the engine's own all-to-all count
(``traffic.sent_bytes``) of ``N * top_k`` rows of ``d`` values, plus the per-expert counts (``E`` int64)
once per forward: the bytes ``engine.moe.parallel.COMM`` counts (docs/moe.md, "Bytes"). A routing that
favours some experts moves more or less; a capacity factor below 1 drops rows (fewer bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Set

import torch.nn as nn


@dataclass
class _MoeLayer:
    name: str          # the engine's MoE block, or a transformers family's experts module
    n_expert: int
    top_k: int
    dim: int           # the width of a routed row
    params: List[str]  # its grouped expert weights' names in the model


def moe_layers(model: nn.Module) -> List[_MoeLayer]:
    """The model's MoE layers as the hybrid plugin splits them (empty for a dense model)."""
    from ...models.hf import moe as hf_moe
    from ...moe import moe_layers as engine_layers

    out = []
    for name, moe in engine_layers(model):
        ex = moe.experts
        out.append(_MoeLayer(name, moe.n_expert, moe.top_k, ex.w1.shape[1],
                             [f"{name}.experts.{w}" for w in ("w1", "w3", "w2")]))
    found = hf_moe.expert_modules(model)
    if found:
        cfg = getattr(model, "config", None)
        k = getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "moe_topk", None)
        d = getattr(cfg, "hidden_size", None)
        for name, mod, attrs in found:
            top_k = k if k is not None else getattr(mod, "top_k", 1)
            out.append(_MoeLayer(name, hf_moe.n_experts(mod, attrs), int(top_k), int(d),
                                 [f"{name}.{a}" for a in attrs]))
    return out


def expert_names(layers: List[_MoeLayer]) -> Set[str]:
    return {p for layer in layers for p in layer.params}


def is_expert(name: str, names: Set[str]) -> bool:
    """A traced parameter name is an expert weight (a pipeline stage's part may carry a prefix or lose one)."""
    if name in names:
        return True
    return any(name.endswith("." + n) or n.endswith("." + name) for n in names)


def layers_in(layers: List[_MoeLayer], stage_params) -> List[_MoeLayer]:
    """The MoE layers whose expert weights a stage holds."""
    names = list(stage_params)
    return [layer for layer in layers if any(is_expert(n, {layer.params[0]}) for n in names)]


def all_to_all_bytes(layers: List[_MoeLayer], rows: int, ep: int, itemsize: int, forwards: int) -> int:
    """Bytes one rank sends in one step's expert all-to-alls: per MoE layer and forward (microbatch), the
    dispatch and the combine, forward and backward, of ``rows * top_k`` rows of ``dim`` values (balanced
    routing), plus the counts; each through ``traffic.sent_bytes`` as ``comm`` counts them."""
    from ...traffic import sent_bytes

    if ep <= 1:
        return 0
    total = 0
    for layer in layers:
        per_fwd = 4 * sent_bytes("all_to_all", rows * layer.top_k * layer.dim * itemsize, ep)
        per_fwd += sent_bytes("all_to_all", layer.n_expert * 8, ep)  # int64 counts, equal slots
        total += forwards * per_fwd
    return int(total)


def check(meta: nn.Module, plugin, world: int) -> Optional[List[_MoeLayer]]:
    """The plugin's own expert-parallel refusals (before any group), then the layers; None without ep."""
    ep = getattr(plugin, "ep_size", 1)
    if ep <= 1:
        return None
    from ...plugins.hybrid.experts import check_expert_parallel

    check_expert_parallel(meta, plugin, world)
    return moe_layers(meta)
