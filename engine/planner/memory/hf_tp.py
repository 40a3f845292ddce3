"""A transformers model's 1D tensor-parallel rank, traced as ``HybridParallelPlugin`` runs it.

Rather than a formula for what tensor parallelism changes, the fake copy of the model is sharded by the
plugin's own code (``models.hf.apply_tensor_parallel``: torch's ``parallelize_module`` with the model's
plan, the vocabulary-parallel head and its hooks when ``loss_parallel``) over a device mesh of torch's
``fake`` process group (``nd._fake_world``: collectives that move nothing, their outputs still allocated).
The step then runs as the plain HF loop does, ``model(input_ids=x, labels=x).loss`` and its backward inside
``loss_parallel()``: with ``loss_parallel=True`` the logits stay ``B x T x V/tp`` per rank and the loss's
log-softmax runs on the shards; with ``loss_parallel=False`` the head's output is gathered ``B x T x V``
and the whole cross-entropy is traced. The storage tracker (``trace.py``) counts a DTensor by its local
tensor, this rank's bytes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class HfTp:
    """What the plugin's 1D sharding of an HF model depends on: size, plan, and its two options."""

    size: int
    plan: dict
    sequence_parallel: bool = False
    loss_parallel: bool = True


def can_fake_world() -> bool:
    """A fake process group can be made here: none exists yet in this process (the notebook, a planner)."""
    import torch.distributed as dist

    return dist.is_available() and not dist.is_initialized()


def shard_as_plugin(scope: contextlib.ExitStack, fake: nn.Module, mode, device: str, hf: HfTp) -> None:
    """``fake`` (whole shapes, fake tensors) sharded in place as the plugin shards its model, on a mesh
    of a fake process group entered on ``scope`` (it ends with the trace)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ...models.hf import apply_tensor_parallel
    from .nd import _fake_world

    scope.enter_context(_fake_world(hf.size))
    mesh = init_device_mesh(device, (hf.size,))
    with mode:
        apply_tensor_parallel(fake, mesh, hf.plan, hf.sequence_parallel, loss_parallel=hf.loss_parallel)


def labelled_forward(model: nn.Module, inputs: tuple):
    """The plain HF loop's call: the ids are the labels, the model computes its own loss."""
    return model(input_ids=inputs[0], labels=inputs[0])


def model_loss(out, inputs) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise TypeError("cl.plan: the transformers model returned no loss for labels=input_ids; "
                        "pass inputs= and loss_fn=")
    return loss


def backward_context():
    """The plugin's backward context: ``loss_parallel()`` where a vocabulary-parallel head is installed."""
    from ...models.hf.vocab_parallel import backward_context as ctx

    return ctx()


@contextlib.contextmanager
def quiet_propagation():
    """DTensor infers each op's global output shape by running the op on empty global-shape placeholders
    (``ShardingPropagator._propagate_tensor_meta_non_cached``); no rank holds those, so the storage tracker
    does not follow them. Without that method (another torch) nothing is muted: placeholders are counted
    for an instant, the plan errs high."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    from .trace import MUTED

    name = "_propagate_tensor_meta_non_cached"
    orig = ShardingPropagator.__dict__.get(name)
    if orig is None:
        yield
        return

    def muted(self, *args, **kwargs):
        MUTED[0] += 1
        try:
            return orig(self, *args, **kwargs)
        finally:
            MUTED[0] -= 1

    setattr(ShardingPropagator, name, muted)
    try:
        yield
    finally:
        setattr(ShardingPropagator, name, orig)
