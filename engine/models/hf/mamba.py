"""Megatron-style tensor parallelism for a Mamba (selective state-space) block's mixer (Mamba 2's:
:class:`Mamba2MixerParallel`, by heads and groups).

A Mamba mixer's work is per channel of its inner width ``I`` (``intermediate_size``): ``in_proj`` (H -> 2I) packs
``[x | gate]``, a depthwise ``conv1d`` runs over the x channels, ``x_proj`` (I -> dt_rank + 2N) reads all of them to
make the step sizes and the input-dependent B and C, ``dt_proj`` (dt_rank -> I) widens the step size back to one per
channel, the scan runs each channel on its own with ``A_log`` (I, N) and ``D`` (I,), and ``out_proj`` (I -> H)
mixes the channels back. So each rank keeps ``I/tp`` channels of everything:

* ``in_proj``: column-parallel with each half cut alike (the table's ``packed_colwise``, parts 2);
* ``conv1d`` weight (I, 1, k) and bias, ``dt_proj`` weight and bias, ``A_log`` and ``D``: ``Shard(0)``;
* ``x_proj``: row-parallel, its partial output summed over tp (every rank needs the whole B, C and step sizes;
  FalconMamba's weightless RMS norms over them then run on whole values), and, unlike a row-parallel layer
  before the residual, the gradient of that output summed over tp in backward as well: its consumers (``dt_proj``
  and the scan) are cut by channel, so each rank's gradient of B, C and the step sizes covers its channels only;
* ``out_proj``: row-parallel (the table's ``rowwise``; under sequence parallelism its reduce-scatter cuts the
  tokens, and the scan itself runs on the whole sequence the region gathers on entry: :mod:`.sequence`).

transformers' mixer uses some of these parameters directly, not through their module (``self.dt_proj.weight @ t``,
``self.conv1d.weight`` handed to ``causal_conv1d_fn``, ``self.A_log``, ``self.D``), so they stay DTensors (their
``full_tensor()`` is the model's own layout: checkpoints, clipping and the optimizer see them whole) and, for the
duration of each mixer forward only, the mixer's attributes hold their differentiable ``to_local()`` shards (the
gradients come back to the DTensors). The style is applied to the block, not to its mixer: sequence parallelism
(:mod:`.sequence`) reads a style on a layer's child as a bare linear, while a mixer without one is a region that
gathers the tokens on entry and is closed by its row-parallel ``out_proj``. Built on ``distribute_tensor``,
``DTensor.from_local`` / ``to_local`` (with ``Partial`` placements for the two sums).
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

#: the mixer's parameters cut along their first (channel) dimension: (child module or "" for the mixer, name)
CHANNEL_PARAMS = (("conv1d", "weight"), ("conv1d", "bias"), ("dt_proj", "weight"), ("dt_proj", "bias"),
                  ("", "A_log"), ("", "D"))


def _owner(mixer: nn.Module, child: str) -> nn.Module:
    return getattr(mixer, child) if child else mixer


class MambaMixerParallel(ParallelStyle):
    """A Mamba block's mixer cut by its inner channels (``in_proj`` and ``out_proj`` have table entries of their
    own); applied to the block, whose ``mixer`` it cuts."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        mixer = getattr(module, "mixer", None)
        if mixer is None or not all(hasattr(_owner(mixer, c), n) for c, n in CHANNEL_PARAMS if c != "conv1d"):
            raise ValueError(f"mamba_mixer: {type(module).__name__} has no Mamba mixer (a 'mixer' with conv1d, "
                             "x_proj, dt_proj, A_log and D)")
        held = []
        for child, name in CHANNEL_PARAMS:
            owner = _owner(mixer, child)
            p = getattr(owner, name, None)
            if p is None:  # conv1d without a bias
                continue
            owner.register_parameter(name, nn.Parameter(distribute_tensor(p.data, device_mesh, [Shard(0)]),
                                                        requires_grad=p.requires_grad))
            held.append((owner, name, _local))
        conv = mixer.conv1d  # depthwise: one group per channel, this rank's channels
        conv.in_channels = conv.out_channels = conv.groups = conv.weight.to_local().shape[0]
        _x_proj_parallel(mixer.x_proj, device_mesh)
        mixer.forward = _with_local(mixer.forward, held)
        return module


def _x_proj_parallel(linear: nn.Linear, mesh) -> None:
    """``x_proj`` row-parallel with a sum over tp both ways: its output in forward (every rank's channels'
    contribution to B, C and the step sizes) and that output's gradient in backward (each rank's consumers read
    them for their channels only)."""
    linear.weight = nn.Parameter(distribute_tensor(linear.weight.data, mesh, [Shard(1)]),
                                 requires_grad=linear.weight.requires_grad)
    if linear.bias is not None:  # none in transformers' mixers; whole, added once after the sum
        linear.bias = nn.Parameter(distribute_tensor(linear.bias.data, mesh, [Replicate()]),
                                   requires_grad=linear.bias.requires_grad)

    def forward(mod, x):
        y = F.linear(x, mod.weight.to_local())
        y = DTensor.from_local(y, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()
        y = y + mod.bias.to_local() if mod.bias is not None else y
        # forward unchanged; backward: the ranks' partial gradients summed (a Partial gradient made Replicate)
        return DTensor.from_local(y, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])

    linear.forward = types.MethodType(forward, linear)


def _local(p: DTensor) -> torch.Tensor:
    return p.to_local()


def _with_local(forward, held):
    """``forward`` run with each of ``held``'s ``(owner, name, local)`` DTensor parameters replaced by ``local(p)``
    (its differentiable local shard, or the rows this rank computes with), restored after."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        saved = [(owner, name, owner._parameters[name], local) for owner, name, local in held]
        for owner, name, p, local in saved:
            owner._parameters[name] = local(p)
        try:
            return forward(*args, **kwargs)
        finally:
            for owner, name, p, _ in saved:
                owner._parameters[name] = p

    return run


def _rank_rows(parts, rank: int, tp: int) -> torch.Tensor:
    """The rows of a weight packing ``parts`` (their sizes, in order) that rank ``rank`` of ``tp`` computes with: its
    ``1/tp`` of each part, contiguous within the part."""
    idx, start = [], 0
    for size in parts:
        idx.append(torch.arange(start + rank * size // tp, start + (rank + 1) * size // tp))
        start += size
    return torch.cat(idx)


def _gathered_rows(rows: torch.Tensor):
    """A ``local`` for :func:`_with_local`: a ``Shard(0)`` DTensor gathered whole (an all-gather; backward: the
    ranks' partial gradients reduce-scattered onto the shards), then this rank's ``rows`` (as :mod:`.multi_query`)."""
    return lambda p: p.full_tensor(grad_placements=[Partial()]).index_select(0, rows.to(p.device))


class Mamba2MixerParallel(ParallelStyle):
    """A Mamba 2 block's mixer cut by heads and groups: rank ``r`` computes with its heads' ``1/tp`` of the gate, x
    and step-size channels and its groups' ``1/tp`` of B and C. ``in_proj`` packs ``[gate | x | B | C | dt]`` and
    ``conv1d`` runs over ``[x | B | C]``, parts of unequal sizes, so no DTensor placement stores a rank's rows of each
    part: both are stored ``Shard(0)`` in the model's own layout and gathered whole in each forward, where the rank
    takes its rows (an all-gather of each, and a reduce-scatter of their gradients). ``dt_bias``, ``A_log``, ``D``
    (one per head) and the gated norm's weight (over ``I``, normalized per group: a rank holds whole groups) are
    ``Shard(0)``; ``out_proj`` has a table entry of its own (``rowwise``)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        mixer = getattr(module, "mixer", None)
        if mixer is None or not all(hasattr(mixer, n) for n in ("in_proj", "conv1d", "dt_bias", "A_log", "D", "norm")):
            raise ValueError(f"mamba2_mixer: {type(module).__name__} has no Mamba 2 mixer (a 'mixer' with in_proj, "
                             "conv1d, dt_bias, A_log, D and a gated norm)")
        tp, r = device_mesh.size(), device_mesh.get_local_rank()
        inner, gn, heads = mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size, mixer.num_heads
        extra = mixer.in_proj.out_features - (2 * inner + 2 * gn + heads)
        if extra:
            raise ValueError(f"mamba2_mixer: {type(mixer).__name__}.in_proj has {extra} features besides [gate | x | "
                             "B | C | dt] (an MLP part), which this cut does not take")
        held = []
        for owner, name, rows in ((mixer.in_proj, "weight", (inner, inner, gn, gn, heads)),
                                  (mixer.in_proj, "bias", (inner, inner, gn, gn, heads)),
                                  (mixer.conv1d, "weight", (inner, gn, gn)), (mixer.conv1d, "bias", (inner, gn, gn)),
                                  (mixer, "dt_bias", None), (mixer, "A_log", None), (mixer, "D", None),
                                  (mixer.norm, "weight", None)):
            p = getattr(owner, name, None)
            if p is None:
                continue
            owner.register_parameter(name, nn.Parameter(distribute_tensor(p.data, device_mesh, [Shard(0)]),
                                                        requires_grad=p.requires_grad))
            held.append((owner, name, _gathered_rows(_rank_rows(rows, r, tp)) if rows else _local))
        conv = mixer.conv1d  # depthwise over [x | B | C]: this rank's channels of each
        conv.in_channels = conv.out_channels = conv.groups = (inner + 2 * gn) // tp
        proj = mixer.in_proj

        def in_proj_forward(mod, x):  # replicated input: backward sums the ranks' partial input gradients
            x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
            return F.linear(x, mod.weight, mod.bias)  # the rank's rows, swapped in for the mixer's forward

        proj.forward = types.MethodType(in_proj_forward, proj)
        mixer.forward = _with_local(mixer.forward, held)
        return module


def check_mixers(model: nn.Module, tp: int, names) -> None:
    """Before any group: :func:`check_divides`, and a Mamba 2 mixer's gated norm must normalize per group (a
    ``group_size``): transformers 5.5's spans the whole inner width, which each rank would see only its share of."""
    check_divides(model, tp, names)
    for name, mod in model.named_modules():
        norm = getattr(mod, "norm", None) if hasattr(mod, "n_groups") and hasattr(mod, "in_proj") else None
        if norm is not None and not hasattr(norm, "group_size"):
            raise ValueError(f"HybridParallelPlugin(tp_size={tp}): {name}.norm ({type(norm).__name__}) normalizes over "
                             "the mixer's whole inner width, not per group (this transformers release's Mamba 2), so "
                             "tensor parallelism, which gives each rank a share of that width, cannot cut it; use a "
                             "transformers release whose gated norm takes group_size, or tp_size=1")


def check_divides(model: nn.Module, tp: int, names) -> None:
    """Each config size in ``names`` (a Mamba mixer's ``intermediate_size``, Mamba 2's ``num_heads`` and
    ``n_groups``) must cut into ``tp`` equal shares: otherwise an error naming the sizes that do (up to 64)."""
    config = getattr(model, "config", None)
    for key in names:
        width = getattr(config, key, None)
        if isinstance(width, int) and width % tp:
            valid = [d for d in range(1, min(width, 64) + 1) if width % d == 0]
            raise ValueError(f"HybridParallelPlugin(tp_size={tp}): {type(model).__name__} has config.{key}={width} "
                             "(each Mamba mixer's inner channels, heads or groups), which tensor parallelism cuts into "
                             "equal shares; "
                             f"choose tp_size in {valid}")
