"""Mixture of experts: a top-k router, experts as one grouped weight, and expert parallelism.

One idea per file: :mod:`.router` (which experts each token goes to, with what weight),
:mod:`.losses` (the load-balancing and router z-losses), :mod:`.dispatch` (tokens sorted into
expert groups, dropless or under a capacity), :mod:`.experts` (the grouped SwiGLU over those
groups), :mod:`.parallel` (experts sharded over an EP group, tokens moved by all-to-all),
:mod:`.layer` (the block that composes them), :mod:`.load` (its per-step
expert-load telemetry). What is built and tested: docs/moe.md.
"""

from .dispatch import Routing, route
from .experts import GroupedExperts, grouped_swiglu
from .layer import MoE, aux_loss_backward_scale, aux_loss_scale, moe_layers
from .load import emit_load, take_load
from .losses import load_balancing_loss, router_z_loss
from .parallel import ExpertParallel
from .router import TopKRouter

__all__ = ["ExpertParallel", "GroupedExperts", "MoE", "Routing", "TopKRouter", "aux_loss_backward_scale",
           "aux_loss_scale", "grouped_swiglu", "emit_load", "load_balancing_loss", "moe_layers", "route",
           "router_z_loss", "take_load"]
