"""Expert parallelism under Gemini (``GeminiPlugin(ep_size=k)``): the checks, the groups, the experts cut.

The world (Gemini's data-parallel ranks) is cut into EP groups of ``k`` neighbours as the hybrid plugin
cuts its dp ranks (``hybrid.experts.ExpertGroups``, reused as is: rank ``e`` of an EP group holds experts
``[e*E/k, (e+1)*E/k)`` of every MoE block, tokens travel by ``moe.ExpertParallel``'s all-to-alls). Gemini
then packs those expert slices into chunks of their own whose group is the expert-dp group (the ``world/k``
ranks holding the same experts: ``chunk.ApartLayout``), sharded, gathered and reduced over it, the gradient
divided by the whole world as every other chunk's. Everything that can be refused is refused here before
any group exists. What is built and tested: docs/moe.md ("Expert parallelism under Gemini").
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn as nn


def _world() -> Optional[int]:
    from ..plugins.hybrid_parallel import _world_size

    return _world_size()


def check_plugin(plugin) -> None:
    """``GeminiPlugin``'s own arguments with ``ep_size`` (at construction)."""
    ep = plugin.ep_size
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"GeminiPlugin(ep_size={ep!r}): must be an int >= 1 (1: every expert on every rank)")
    if ep == 1:
        return
    if plugin.activation_checkpointing:
        raise ValueError(f"GeminiPlugin(ep_size={ep}, activation_checkpointing={plugin.activation_checkpointing!r}): "
                         "recomputing MoE blocks (their all-to-alls) inside Gemini's backward is not built; use "
                         "activation_checkpointing=False, or HybridParallelPlugin(ep_size=...) with it")
    check_world(ep, _world())


def check_world(ep: int, world: Optional[int]) -> None:
    if world is None or world % ep == 0:
        return
    ok = [d for d in range(1, world + 1) if world % d == 0]
    raise ValueError(f"GeminiPlugin(ep_size={ep}): expert-parallel groups are cut from the {world} data-parallel "
                     f"ranks; use an ep_size in {ok}")


def check_model(model: nn.Module, ep: int, world: int) -> None:
    """What ``ep_size`` needs of the model (at boost, before any group)."""
    from ..models.hf import moe as hf_moe
    from ..moe import moe_layers

    name = type(model).__name__
    layers = list(moe_layers(model))
    hf_layers = hf_moe.split_layers(model, ep, "GeminiPlugin")  # a transformers MoE family's, counts checked
    if not layers and not hf_layers:
        raise ValueError(f"GeminiPlugin(ep_size={ep}): {name} has no MoE block to split (engine/moe.MoE, or a "
                         "transformers MoE family's experts named by its config's base_model_ep_plan); build it "
                         "with experts (the reference model: n_expert=8, top_k=2 in its config) or set ep_size=1")
    for lname, moe in layers:
        if moe.n_expert % ep:
            ok = [d for d in range(1, moe.n_expert + 1) if moe.n_expert % d == 0]
            raise ValueError(f"GeminiPlugin(ep_size={ep}): n_expert={moe.n_expert} ({lname}) does not divide over "
                             f"{ep} ranks; use an ep_size in {ok}")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(f"GeminiPlugin(ep_size={ep}): {name} has parameters on the meta device (lazy init); "
                         "splitting experts over EP ranks needs them materialised: build the model on the CPU, "
                         "or use ep_size=1")
    check_world(ep, world)


def split_experts(model: nn.Module, optimizer, ep: int, world: int):
    """Make the EP and expert-dp groups (collective: every rank, in the same order), cut every MoE block's
    experts to this rank's share and put the new parameters in ``optimizer``'s groups in place of the whole ones.
    Returns the ``ExpertGroups``."""
    from ..plugins.hybrid.experts import ExpertGroups

    dims = SimpleNamespace(mesh=SimpleNamespace(mesh=torch.arange(world).view(world, 1, 1, 1)), pp=1, cp=1, tp=1)
    experts = ExpertGroups(ep).build(dims)
    before = dict(model.named_parameters())
    experts.shard(model)
    after = dict(model.named_parameters())
    new = {id(before[n]): after[n] for n in experts.names}
    if optimizer is not None:
        for g in optimizer.param_groups:
            g["params"] = [new.get(id(p), p) for p in g["params"]]
    return experts
