"""The model contract: all the engine may ask of a model, as optional methods.

The engine knows no model: it looks these methods up by name on the user's module (so a model
implements them without importing this file), and without one a model gets torch's default or
an error naming the method. The reference GPT implements them all, as torchtitan's models
bring their own parallel plans. Tied weights need no method: the engine finds a parameter
registered under two names itself. A pipeline stage keeps the full model's parameter names, so
checkpoints, optimizers and tied copies line up across layouts. 2D/2.5D/3D tensor parallelism
asks one more (:class:`NdTensorParallelContract`, ``tp_nd_plan``), and a model may ask the engine to
plan its activation checkpointing (:class:`CheckpointRequestContract`, ``checkpoint_budget``); each is
kept in its own protocol.

A ``transformers.PreTrainedModel`` is not asked these by name: the adapter in :mod:`.hf` answers for it,
asked first (``hf.is_hf_model``): its tensor-parallel plan (transformers 5's ``tp_plan`` is a dict
property, the one contract name ``PreTrainedModel`` also has), its pipeline stages (``base_model_pp_plan``)
and its activation checkpointing (:func:`checkpointing_method`); docs/hf.md.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Protocol, Union, runtime_checkable

import torch.nn as nn


@runtime_checkable
class ModelContract(Protocol):
    def init_module(self, name: str, module: nn.Module) -> None:
        """Fill ``module`` (``name`` in the model, ``""`` the model itself) after lazy init: its own
        tensors have storage, no values; called in ``named_modules()`` order. Default:
        ``module.reset_parameters()``."""

    def tp_plan(self, sequence_parallel: bool = False) -> Dict[str, object]:
        """A ``parallelize_module`` plan (module name -> ``ParallelStyle``) for this module or a
        pipeline stage of it; with ``sequence_parallel`` the stream between layers is cut along
        dim 1 and enters and leaves whole. Default: ``HybridParallelPlugin(tp_plan=...)`` or an error."""

    def check_tp(self, tp_size: int) -> None:
        """Raise ``ValueError`` if the model cannot be split over ``tp_size`` ranks (e.g. heads).
        Under 2D/2.5D/3D it is called with the number of ranks heads are split over (``q``)."""

    def num_layers(self) -> int:
        """How many units a pipeline divides among its stages. Default: an ``nn.Sequential``'s length."""

    def pipeline_stage(self, stage: int, num_stages: int) -> nn.Module:
        """A copy holding stage ``stage``'s part: it takes the previous stage's output (the first,
        the batch input) and returns a tensor or a tuple led by one. Default: a Sequential's slice."""

    def enable_activation_checkpointing(self, layers: Optional[Iterable[Union[int, str]]] = None) -> None:
        """Recompute layers in backward: every layer (``layers=None``; what the plugins ask for) or the
        listed layer indices (``0 <= i < num_layers()``), each one whole; ``[]`` recomputes nothing, and
        a call replaces the previous choice. ``autockpt.plan_checkpointing`` needs ``layers``. A model
        may also define ``checkpoint_parts() -> ("attn", "mlp")``, names of sub-modules of every layer
        that can recompute on their own, and then accept ``"i.attn"`` entries (GPT does); the planner
        weighs those too. A model with a ``checkpoint_budget()`` request gets the engine's plans (and the
        profiler's trials) through a list, which must not withdraw the request
        (:class:`CheckpointRequestContract`). Default: ``checkpoint_wrapper`` on a Sequential's children."""

    def enable_context_parallel(self, group, mode: str) -> None:
        """Context parallelism over ``group``, ``mode`` ``"ring"`` or ``"ulysses"``: from now on the
        model is fed this rank's shard of every sequence (``context_parallel.shard_batch``: dim 1,
        zig-zag for ring, contiguous for Ulysses) and must compute each attention over the whole
        sequence through ``ContextParallel(group, mode)`` (called as ``cp(q, k, v, causal=True)``
        on ``(B, H, T/cp, D)`` shards) and take positions from ``cp.positions(local_T, device)`` (or
        shard whole-sequence tables with ``cp.shard(table, dim)``).
        Raise ``ValueError`` if it cannot (``cp.check_heads(heads)`` for Ulysses). Default: an
        error naming this method (``context_parallel.apply_context_parallel``)."""


@runtime_checkable
class ModelConfig(Protocol):
    def build(self) -> nn.Module:
        """The model this config describes (``load_quantized(config, ...)`` builds it lazily)."""


@runtime_checkable
class NdTensorParallelContract(Protocol):
    """One more optional method, asked only under 2D/2.5D/3D tensor parallelism
    (``HybridParallelPlugin(tp_mode="2d" | "2.5d" | "3d")``); kept apart from :class:`ModelContract`
    so a model that never runs those modes satisfies that one without it."""

    def tp_nd_plan(self) -> Dict[str, object]:
        """Roles for 2D/2.5D/3D tensor parallelism (``HybridParallelPlugin(tp_mode=...)``) of this
        module or a pipeline stage of it: module name -> ``"colwise"`` (``nn.Linear`` from the
        residual stream into a sharded width), ``"rowwise"`` (back to the stream), ``"head"`` (the
        LM head: vocab-parallel logits), ``"embedding"`` (``nn.Embedding``), ``"rmsnorm"`` (or
        ``("rmsnorm", eps)``) or ``"layernorm"`` (weight and bias; likewise); every parameter must
        belong to a named module. Default: the
        ``Colwise``/``RowwiseParallel`` entries of ``tp_plan()`` plus every ``nn.Embedding``, and
        an error naming any parameter left without a role (``engine/tp_nd/apply.py``)."""


@runtime_checkable
class CheckpointRequestContract(Protocol):
    """One more optional method, for a model that asks the engine to plan which of its layers
    recompute (GPT: ``GPTConfig(activation_checkpointing="auto", activation_budget=...)``); kept apart
    from :class:`ModelContract` so a model that never asks satisfies that one without it."""

    def checkpoint_budget(self) -> Optional[int]:
        """The peak activation bytes of one training step the model asks its checkpointing be planned
        for, or None: no request now. Read at every training forward (and by a plugin at boost), so a
        model may make or drop the request at any time. The engine resolves it, never the model: a
        plugin plans it as its own ``activation_checkpointing="auto"`` (a pipeline stage its share of
        the budget), and elsewhere the hook the model registers once with
        ``autockpt_request.plan_on_request(model)`` (GPT does in ``__init__``) plans at the first
        training forward of each input shape. Either hands the plan back through the contract:
        ``enable_activation_checkpointing(layers=plan.layers)`` (so the model also needs ``layers``;
        while the request stands the model recomputes exactly those, and a list does not withdraw
        it) and ``model.checkpoint_plan = plan``. Default: None (no method: nothing is planned unless
        a plugin's own ``activation_checkpointing="auto"`` asks)."""

    def activation_checkpointing_enabled(self) -> bool:
        """Whether the model recomputes in backward by its own choice (its config: every layer, or a
        request the engine plans), so that ``cl.plan`` counts its step as checkpointed. Default:
        False (no method: only a plugin's ``activation_checkpointing`` turns it on)."""


def checkpointing_method(model: nn.Module):
    """The model's ``enable_activation_checkpointing(layers=None)``: its own, or for a transformers model the
    adapter's (``models.hf.checkpointing``: each decoder layer recomputes through transformers' own
    ``GradientCheckpointingLayer``), asked first as for ``tp_plan``; None when neither exists."""
    from .hf import is_hf_model

    if is_hf_model(model):
        import functools

        from .hf.checkpointing import enable_activation_checkpointing

        return functools.partial(enable_activation_checkpointing, model)
    own = getattr(model, "enable_activation_checkpointing", None)
    return own if callable(own) else None


def check_checkpointing(model: nn.Module, who: str, *, layers: bool, instead: str = "") -> None:
    """Refuse, naming ``who`` (the caller and its argument), a model that cannot recompute its layers:
    it needs ``enable_activation_checkpointing()`` (taking ``layers`` where ``layers``: a planner
    chooses which) or to be an ``nn.Sequential`` (whose children the engine wraps itself).
    ``instead``: the other way out to suggest when the method exists but takes no ``layers``."""
    import inspect

    name = type(model).__name__
    own = checkpointing_method(model)
    if own is not None:
        try:
            takes = "layers" in inspect.signature(own).parameters
        except (TypeError, ValueError):
            takes = False
        if takes or not layers:
            return
        raise ValueError(f"{who}: {name}.enable_activation_checkpointing() takes no `layers`; extend it as the model "
                         "contract says (engine/models/protocol.py): enable_activation_checkpointing(layers=None), "
                         "None = every layer, else the listed layers" + (f"; or {instead}" if instead else ""))
    if not isinstance(model, nn.Sequential):
        wanted = "enable_activation_checkpointing(layers=...)" if layers else "enable_activation_checkpointing()"
        raise ValueError(f"{who}: {name} has no {wanted} (the model contract) and is not an nn.Sequential; "
                         "implement it, wrap your layers in nn.Sequential or set activation_checkpointing=False")
