"""The Gemini model wrapper: gather a module's chunks before it runs, release them after.

Hooks modelled on FSDP2's, on the modules that own parameters (gather before forward, re-gather
before backward, gradients into the chunk, one end-of-backward callback on every rank), re-installed
after the warm-up's re-pack (``repack.py``); see docs/gemini.md, ``zero_model.py`` row. Being a
``wrappers.ModelWrapper`` it moves inputs to the compute device and counts tokens; it runs no
autocast: the parameters already are in the chunks' compute dtype.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..wrappers import ModelWrapper
from . import experts as expert_state
from .chunk import Chunk, TensorInfo, TensorState
from .chunk_manager import ChunkManager
from .repack import PackSpec, learn_and_repack


class GeminiModel(ModelWrapper):
    """Wraps ``module``; call it like the module. ``unwrap()`` returns the original module."""

    def __init__(self, module: nn.Module, manager: ChunkManager, pack: Optional[PackSpec] = None, experts=None):
        super().__init__(module)
        self.experts = experts  # hybrid.experts.ExpertGroups under expert parallelism (state_dict gathers them)
        self.device = manager.device
        self._mgr = manager
        # chunks are re-packed in execution order at the first training forward (repack.py)
        self.pack = pack if pack is not None else PackSpec(order="registration")
        self._handles = []
        self.install_hooks()

    def install_hooks(self) -> None:
        """Hooks for the manager's current chunk list (again after a re-pack)."""
        manager, module = self._mgr, self.module
        self._where: Dict[int, Tuple[Chunk, TensorInfo]] = {}
        for c in manager.chunks:
            for info in c.infos:
                self._where[id(info.param)] = (c, info)
        for m in module.modules():
            own = [p for p in m.parameters(recurse=False) if id(p) in self._where]
            if own:
                self._handles.append(m.register_forward_pre_hook(self._make_pre_fwd(own)))
                self._handles.append(m.register_forward_hook(self._make_post_fwd(own)))
                if any(not p.requires_grad for p in own):
                    self._handles.append(m.register_forward_pre_hook(self._make_frozen_release(own),
                                                                     with_kwargs=True))
        for c in manager.chunks:
            for info in c.trainable:
                self._handles.append(info.param.register_post_accumulate_grad_hook(self._make_grad_hook(c, info)))

    # ---- hooks ---------------------------------------------------------------------------------
    def _by_chunk(self, params) -> List[Tuple[Chunk, List[TensorInfo]]]:
        groups: Dict[int, Tuple[Chunk, List[TensorInfo]]] = {}
        for p in params:
            c, info = self._where[id(p)]
            groups.setdefault(c.id, (c, []))[1].append(info)
        return list(groups.values())

    def _make_pre_fwd(self, params):
        groups = self._by_chunk(params)

        def hook(module, args):
            for c, infos in groups:
                self._mgr.access(c, infos, TensorState.COMPUTE)

        return hook

    def _make_post_fwd(self, params):
        groups = self._by_chunk(params)

        def hook(module, args, output):
            for c, infos in groups:
                self._mgr.done(c, infos, TensorState.HOLD)
            if torch.is_grad_enabled():
                self._register_pre_backward(groups, output)
            return output

        return hook

    def _register_pre_backward(self, groups, output) -> None:
        tensors = [t for t in _flatten(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return
        fired = [False]

        def pre_bwd(grad):
            if not fired[0]:
                fired[0] = True
                self._mgr.begin_backward()
                for c, infos in groups:
                    train = [i for i in infos if i.param.requires_grad and i.state != TensorState.READY_FOR_REDUCE]
                    frozen = [i for i in infos if not i.param.requires_grad]
                    self._mgr.access(c, train, TensorState.COMPUTE)
                    if frozen:
                        c.set_state(TensorState.HOLD_AFTER_BWD, frozen)
            return grad

        for t in tensors:
            t.register_hook(pre_bwd)

    def _make_frozen_release(self, params):
        """Frozen parameters (a LoRA base) get no gradient, so no gradient hook says when backward is done
        with them: the module's inputs pass through :class:`_PostBackward`, whose backward runs once the
        gradients of those inputs exist, i.e. once the module's backward is over; its frozen tensors then
        leave the pinned state and the chunk may be released, instead of staying gathered to the end of
        backward. A module none of whose inputs needs a gradient (an embedding) keeps them to the end."""
        frozen = [(c, [i for i in infos if not i.param.requires_grad]) for c, infos in self._by_chunk(params)]
        frozen = [(c, infos) for c, infos in frozen if infos]

        def release():
            for c, infos in frozen:
                held = [i for i in infos if i.state == TensorState.HOLD_AFTER_BWD]
                if held:
                    self._mgr.done(c, held, TensorState.HOLD)

        def hook(module, args, kwargs):
            if not (torch.is_grad_enabled() and module.training):
                return None
            flat = [t for t in _flatten((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not flat:
                return None
            swapped = dict(zip(map(id, flat), _PostBackward.apply(release, *flat)))
            return _swap((args, kwargs), swapped)

        return hook

    def _make_grad_hook(self, c: Chunk, info: TensorInfo):
        def hook(param):
            self._mgr.on_grad(c, info)

        return hook

    # ---- module API --------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        args, kwargs = self._prepare(args, kwargs)
        if torch.is_grad_enabled() and self.module.training and not self._mgr.in_backward:
            if not self.pack.done:  # the warm-up: learn the execution order, re-pack before running
                learn_and_repack(self, args, kwargs)
            self._mgr.begin_step()
            if not self._mgr.trace.ready:
                with self._mgr.nonmodel.hooks():
                    return self.module(*args, **kwargs)
        return self.module(*args, **kwargs)

    @property
    def manager(self) -> ChunkManager:
        return self._mgr

    def state_dict(self, *args, **kwargs) -> Dict[str, torch.Tensor]:
        """Full (gathered) fp32 master tensors by parameter name, on CPU — collective on every rank;
        under expert parallelism every expert too (gathered over the EP group: ``experts.py``)."""
        out: Dict[str, torch.Tensor] = {}
        for c in self._mgr.chunks:
            full = self._mgr.gather_full(c, self._mgr.read_state(c)[:c.shard_size].contiguous())
            for info in c.infos:
                out[info.name] = full[info.offset:info.end].view(info.shape).clone()
        if self.experts is not None:
            expert_state.gather(out, self.experts)
        return out

    def load_state_dict(self, state_dict, strict: bool = True):
        mgr, sd = self._mgr, state_dict
        if self.experts is not None:  # whole expert tensors (one process's, any EP size's): this rank's rows
            sd = expert_state.cut(sd, self.experts, {i.name: i.shape for c in mgr.chunks for i in c.infos})
        names = {i.name for c in mgr.chunks for i in c.infos}
        missing, unexpected = sorted(names - set(sd)), sorted(set(sd) - names)
        if strict and (missing or unexpected):
            raise RuntimeError(f"Gemini load_model: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}; "
                               "pass strict=False to skip them")
        for c in mgr.chunks:
            state = mgr.read_state(c)
            full = mgr.gather_full(c, state[:c.shard_size].contiguous()).clone()
            for info in c.infos:
                if info.name in sd:
                    t = sd[info.name]
                    if tuple(t.shape) != tuple(info.shape):
                        raise RuntimeError(f"Gemini load_model: {info.name} has shape {tuple(t.shape)} in the "
                                           f"checkpoint but {tuple(info.shape)} in the model")
                    full[info.offset:info.end].copy_(t.reshape(-1).float())
            state[:c.shard_size].copy_(full[slice(*c.shard_range)])
            mgr.write_state(c, state, params=True)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _flatten(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _flatten(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _flatten(o)


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward calls ``callback`` (FSDP2's
    ``RegisterPostBackwardFunction``): it runs once the gradients of those inputs exist."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def _swap(obj, new: Dict[int, torch.Tensor]):
    """``obj`` (nested tuples/lists/dicts of tensors) with the tensors whose ids are keys of ``new`` replaced."""
    if isinstance(obj, torch.Tensor):
        return new.get(id(obj), obj)
    if isinstance(obj, tuple):
        return tuple(_swap(o, new) for o in obj)
    if isinstance(obj, list):
        return [_swap(o, new) for o in obj]
    if isinstance(obj, dict):
        return {k: _swap(o, new) for k, o in obj.items()}
    return obj
