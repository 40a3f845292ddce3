"""``cl.plan``: will it fit? Bytes per rank and tier, predicted before anything is launched.

:func:`plan` checks its arguments, builds the model without memory (``model.py``), sizes the tiers
(``env.py``), hands both to the plugin's memory model (``dispatch.py``) and wraps what it returns
in a :class:`FitPlan` with advice (``advice.py``). :class:`TraceCache` plans many layouts of one
model on shared traces (a layout search plans dozens).
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Dict, Optional

from .advice import _advice
from .dispatch import _compose, _precision, memory_model, plugin_name
from .env import _env
from .model import _Model
from .nd import _NoFakeWorld
from .peaks import _OPT_STATE, _Result
from .result import FitPlan


def plan(model_or_config, plugin=None, *, world_size: int = 1, batch: int = 1, seq: Optional[int] = None,
         device_memory: Optional[int] = None, host_memory: Optional[int] = None, nvme_dir: Optional[str] = None,
         precision: Optional[str] = None, optimizer: str = "adamw", activation_checkpointing: Optional[bool] = None,
         device: Optional[str] = None, inputs: Optional[Callable] = None,
         loss_fn: Optional[Callable] = None) -> FitPlan:
    """Predict, per rank and tier, the peak bytes one training step of ``model_or_config`` takes
    under ``plugin`` on ``world_size`` ranks — without allocating the model.

    Args:
        model_or_config: an ``nn.Module`` (real, meta, or built under ``lazy_init()``; a transformers
            model too), a ``GPTConfig``, any config with ``build()`` (the model contract), or a
            transformers config (its model built on the meta device).
        plugin: ``None`` (one process), ``DDPPlugin``, ``LowLevelZeroPlugin``, ``GeminiPlugin`` or
            ``HybridParallelPlugin`` — the object you would hand to ``Booster``; its arguments count.
        world_size: ranks in the run.
        batch: samples each data-parallel rank takes per step (the dataloader's ``batch_size``; under
            a pipeline, the batch ``execute_pipeline`` splits into microbatches).
        seq: tokens per sample (default: the model's context, ``block_size`` or a transformers
            config's ``max_position_embeddings``).
        device_memory: bytes of the compute device per rank (default: the GPU's total memory; on a
            CPU-only machine the compute device is host RAM, so this caps the ``cpu`` tier).
        host_memory: bytes of host RAM per rank (default: this machine's RAM / ``world_size``).
        nvme_dir: a directory for the NVMe tier (default: the plugin's ``nvme_offload_dir``); its free
            space / ``world_size`` is the tier's capacity.
        precision: ``Booster(mixed_precision=...)`` as you will pass it (None: the plugin's own).
        optimizer: ``"adamw"`` (default), ``"adam"``, ``"sgd"`` or ``"sgd_momentum"`` (state per parameter).
        activation_checkpointing: None takes it from the model (``GPTConfig.activation_checkpointing``)
            or the hybrid plugin; True/False forces it.
        device: ``"cuda"`` or ``"cpu"`` (None: this machine's).
        inputs: ``inputs(batch, seq) -> tuple`` of one sample batch for models that do not take token
            ids (built on fake tensors, so ``torch.randn`` is free); ``loss_fn(output, inputs) -> loss``.

    Returns a :class:`FitPlan`. Raises ``ValueError``/``TypeError`` naming the argument for bad input.
    """
    return _plan(model_or_config, plugin, world_size=world_size, batch=batch, seq=seq, device_memory=device_memory,
                 host_memory=host_memory, nvme_dir=nvme_dir, precision=precision, optimizer=optimizer,
                 activation_checkpointing=activation_checkpointing, device=device, inputs=inputs, loss_fn=loss_fn,
                 cache=None)


class TraceCache:
    """Plans many layouts of one model, sharing the step traces of those with the same per-rank
    batch, sequence and device (a layout search plans dozens). ``cache.plan(...)`` takes
    :func:`plan`'s arguments and returns its :class:`FitPlan` without the advice (which re-plans)."""

    def __init__(self):
        self._models: Dict[tuple, "_Model"] = {}

    def plan(self, model_or_config, plugin=None, **kw) -> FitPlan:
        return _plan(model_or_config, plugin, cache=self._models, **kw)


def _plan(model_or_config, plugin=None, *, world_size: int = 1, batch: int = 1, seq: Optional[int] = None,
          device_memory: Optional[int] = None, host_memory: Optional[int] = None, nvme_dir: Optional[str] = None,
          precision: Optional[str] = None, optimizer: str = "adamw", activation_checkpointing: Optional[bool] = None,
          device: Optional[str] = None, inputs: Optional[Callable] = None, loss_fn: Optional[Callable] = None,
          cache: Optional[dict] = None) -> FitPlan:
    from ...plugins import GeminiPlugin

    name = plugin_name(plugin)
    _check(plugin, world_size, batch, optimizer)
    if nvme_dir is None and isinstance(plugin, GeminiPlugin):
        nvme_dir = plugin.nvme_offload_dir
    if seq is None:
        from .model import context_length

        seq = context_length(model_or_config)
        if seq is None:
            raise ValueError("cl.plan(seq=None): the model names no context length (block_size, "
                             "max_position_embeddings); pass seq= (tokens per sample)")
    if not isinstance(seq, int) or seq < 1:
        raise ValueError(f"cl.plan(seq={seq!r}): must be an int >= 1")
    env = _env(device, world_size, device_memory, host_memory, nvme_dir)
    prec = _precision(plugin, precision)
    key = (batch, seq, env.device)
    m = cache.get(key) if cache is not None else None
    if m is None:
        m = _Model(model_or_config, inputs, loss_fn, batch, seq, env.device)
        if cache is not None:
            cache[key] = m
    ac = activation_checkpointing
    if ac is None:
        ac = m.ac_enabled() or bool(getattr(plugin, "activation_checkpointing", False))
    if ac and not m.supports_ac():
        raise ValueError(f"cl.plan(activation_checkpointing=True): {m.name} has no enable_activation_checkpointing() "
                         "and is not an nn.Sequential; pass activation_checkpointing=False")
    try:
        res = _compose(m, plugin, env, prec, optimizer, ac)
    except _NoFakeWorld as why:
        res = _nd_as_1d(model_or_config, plugin, world_size, batch, seq, env, prec, optimizer, ac, inputs, loss_fn,
                        str(why))
    if m.traced_elsewhere:
        res.notes.append(f"traced with CPU kernels (this torch has no CUDA): activations on {env.device} may "
                         "differ where its kernels save other tensors (e.g. flash attention)")
    fp = FitPlan(plugin=name, world_size=world_size, batch=batch, seq=seq, precision=prec, device=env.device,
                 model={"name": m.name, "params": m.numel,
                        "param_bytes": m.param_bytes, "buffer_bytes": m.buffer_bytes},
                 layout=res.layout, ranks=res.ranks, activations=res.act, traffic=res.traffic, notes=res.notes)
    if res.layout.get("refused"):
        fp.blocked = res.layout["refused"]
    fp.advice = _advice(fp, m, plugin, env, prec, optimizer, ac) if cache is None else []
    return fp


def _check(plugin, world_size, batch, optimizer) -> None:
    """The arguments no model needs to be built for, each error naming the argument and the fix."""
    from ...plugins import HybridParallelPlugin

    if memory_model(plugin) is None:
        raise TypeError(f"cl.plan(plugin={plugin_name(plugin)}): unknown plugin; pass None, DDPPlugin, "
                        "LowLevelZeroPlugin, GeminiPlugin or HybridParallelPlugin (from ..plugins)")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"cl.plan(world_size={world_size!r}): must be an int >= 1")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"cl.plan(batch={batch!r}): must be an int >= 1 (samples per data-parallel rank per step)")
    if optimizer not in _OPT_STATE:
        raise ValueError(f"cl.plan(optimizer={optimizer!r}): choose one of {list(_OPT_STATE)}")
    if isinstance(plugin, HybridParallelPlugin):
        tp, pp = plugin.tp_size, plugin.pp_size
        if world_size % (tp * pp):
            ok = [k * tp * pp for k in range(1, 5)]
            raise ValueError(f"cl.plan(world_size={world_size}): HybridParallelPlugin(tp_size={tp}, pp_size={pp}) "
                             f"needs a world size divisible by tp_size * pp_size = {tp * pp}; "
                             f"use world_size in {ok} or smaller tp_size/pp_size")


def _nd_as_1d(model_or_config, plugin, world_size, batch, seq, env, prec, opt, ac, inputs, loss_fn, why) -> _Result:
    """An N-d layout where no fake process group can be made (this process already has a group):
    the rank planned as 1D over the grid's hidden cut ``q`` on its ``1/nb`` of the rows, an upper
    bound (N-d holds ``1/tp`` of the linears' parameters, 1D over q ``1/q``; and N-d cuts the stream
    between blocks ``q`` ways, 1D keeps it whole)."""
    import dataclasses

    from ...tp_nd.grid import layouts

    sizes = plugin.tp_grid
    q = sizes["y" if plugin.tp_mode == "3d" else "row"]
    nb = math.prod(sizes[a] for a in layouts(plugin.tp_mode)[0].batch)
    as_1d = copy.copy(plugin)
    as_1d.tp_size, as_1d.tp_mode, as_1d.tp_depth, as_1d.tp_grid = q, "1d", 1, {"tp": q}
    m = _Model(model_or_config, inputs, loss_fn, max(1, batch // nb), seq, env.device)
    env1 = dataclasses.replace(env, world=max(1, world_size // nb))
    res = _compose(m, as_1d, env1, prec, opt, ac)
    res.notes.append(f"tensor parallel {plugin.tp_mode}: planned as 1D over q={q} on 1/{nb} of the rows, an upper "
                     f"bound ({why}; call cl.plan where no process group exists for the N-d trace)")
    res.layout.update(tp=plugin.tp_size, tp_mode=plugin.tp_mode, tp_grid=dict(sizes))
    return res
