"""A vocabulary-parallel LM head and loss for transformers models under 1D tensor parallelism.

A transformers plan gathers the LM head's logits whole on every rank (``colwise_gather_output``), so
each rank holds ``B x T x V`` logits and computes the whole cross-entropy. Here, when the model is called
with ``labels``, the head keeps its logits sharded over the vocabulary (a ``DTensor`` placed
``Shard(-1)``: ``B x T x V/tp`` per rank) and the model's own loss function (``ForCausalLMLoss``,
``ForMaskedLMLoss``, ...) runs on the shards inside torch's ``loss_parallel()``, whose log-softmax and
NLL reduce the max, the sum and the target logit over tp instead of gathering. ``outputs.loss`` comes back a
plain tensor; ``outputs.logits`` stays the sharded DTensor (``.full_tensor()`` gathers it). A call without
``labels`` (evaluation, ``generate``) gets its logits gathered whole, as the plan says. Backward must run
inside ``loss_parallel()`` too: ``HybridParallelPlugin.backward`` enters :func:`backward_context`.

Under a pipeline the last stage's head is the same sharded head, always (:func:`install_stage`): the stage
hands torch's schedule its logits block (``B x T x V/tp``, a plain tensor) and the criterion
(:func:`.loss.pipeline_criterion`) puts it back into a ``Shard(-1)`` DTensor (:func:`sharded_logits`); the model's
own loss runs on it inside ``loss_parallel()`` (``HybridParallelPlugin.execute_pipeline`` runs the schedule, forward
and backward, in :func:`backward_context`), and a criterion that reads ``outputs.logits`` gets them gathered whole.

Built on torch's ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`` and
``torch.distributed.tensor.parallel.loss_parallel``; written here: which module is the head, and the hooks
that choose per call between sharded and gathered logits.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List

import torch
import torch.nn as nn

#: styles that gather a colwise head's output whole: the heads this module keeps sharded instead
GATHERING = ("colwise_gather_output", "colwise_rep")

_INSTALLED = [0]  # models with a vocabulary-parallel head in this process (backward_context)


def head_names(model: nn.Module, plan: Dict[str, object]) -> List[str]:
    """Names (in ``plan``) of the model's output embedding when the plan gathers it: an ``nn.Linear``
    that ``model.get_output_embeddings()`` returns, styled ``colwise_gather_output`` / ``colwise_rep``."""
    stage = getattr(model, "_cl_stage", None)
    if stage is not None and not stage[1]:  # a pipeline stage before the last: its head is a stand-in (or None)
        return []
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear):
        return []
    from .plan import _matches

    for pattern, name, mod in _matches(plan, model):
        entry = plan[pattern]
        if mod is head and (entry[0] if isinstance(entry, tuple) else entry) in GATHERING:
            return [name]
    return []


def head_style():
    """The torch style for a vocabulary-parallel head: logits stay a ``Shard(-1)`` DTensor."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)


def install(model: nn.Module, name: str) -> None:
    """Hooks on ``model`` and its head ``name`` (already parallelized with :func:`head_style`): a call with
    ``labels`` runs under ``loss_parallel()`` with sharded logits; any other call gets them whole."""
    from torch.distributed.tensor.parallel import loss_parallel

    head = model.get_submodule(name)
    state = {"sharded": False, "ctx": None}

    def enter(module, args, kwargs):
        labelled = kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None  # (cp: shifted)
        if labelled and state["ctx"] is None:
            state["ctx"] = loss_parallel()
            state["ctx"].__enter__()
            state["sharded"] = True

    def leave(module, args, kwargs, output):
        ctx, state["ctx"], state["sharded"] = state["ctx"], None, False
        if ctx is None:
            return output
        ctx.__exit__(None, None, None)
        loss = getattr(output, "loss", None)
        if loss is not None and hasattr(loss, "to_local"):  # a replicated DTensor scalar -> a plain tensor
            output.loss = loss.to_local()
        return output

    def gather(module, args, output):
        return output if state["sharded"] else output.full_tensor()

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)
    head.register_forward_hook(gather)
    _INSTALLED[0] += 1


def install_stage(model: nn.Module, name: str) -> None:
    """A pipeline's last stage ``model`` (its head ``name`` parallelized with :func:`head_style`): every call
    returns the head's logits block as a plain tensor (what torch's schedule carries; its gradient goes back
    to the ``Shard(-1)`` DTensor), and the stage knows its tp mesh for :func:`sharded_logits`."""
    from torch.distributed.tensor import DTensor

    head = model.get_submodule(name)

    def local(module, args, kwargs, output):
        return output.to_local() if isinstance(output, DTensor) else output

    model._cl_vocab_mesh = head.weight.device_mesh
    model._cl_vocab_size = head.weight.shape[0]  # the whole vocabulary (the DTensor's global rows)
    model.register_forward_hook(local, with_kwargs=True)
    _INSTALLED[0] += 1


def sharded_logits(stage: nn.Module, logits):
    """``logits`` (the last stage's output) as the ``Shard(-1)`` DTensor they are a block of, where ``stage``
    has a vocabulary-parallel head (:func:`install_stage`); else None."""
    mesh = getattr(stage, "_cl_vocab_mesh", None)
    if mesh is None or not isinstance(logits, torch.Tensor) or hasattr(logits, "placements"):
        return None
    from torch.distributed.tensor import DTensor, Shard

    shape = (*logits.shape[:-1], stage._cl_vocab_size)  # an odd vocabulary's blocks differ by one column
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(logits, mesh, [Shard(-1)], run_check=False, shape=torch.Size(shape), stride=stride)


def backward_context():
    """``loss_parallel()`` where this process has a vocabulary-parallel head (its loss's backward needs it),
    else nothing."""
    if not _INSTALLED[0]:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
