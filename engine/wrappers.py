"""What ``Booster.boost`` hands back: a model wrapper and an optimizer wrapper.

``ModelWrapper`` moves the forward's tensor inputs to the model's device, runs it under the
precision's autocast and counts its tokens; attributes it does not know fall through to the user's
model. ``OptimizerWrapper`` is the one step contract: every plugin's optimizer is one or subclasses
it (docs/engine.md, "The plugin contract").
"""

from __future__ import annotations

import inspect
import time
from typing import Dict, List, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

from . import comm, telemetry
from .checkpoint_io.checkpoint_io_base import unwrap_model
from .device import default_device, module_device, to_device
from .mixed_precision import DynamicLossScaler, autocast_dtype, needs_loss_scaling


def _count_tokens(args, kwargs) -> int:
    x = kwargs.get("idx", kwargs.get("input_ids"))
    if x is None:
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return 0
    if x.is_floating_point():  # embeddings / hidden states: tokens are all dims but the last
        return x.numel() // x.shape[-1]
    return x.numel()


class ModelWrapper(nn.Module):
    def __init__(self, module: nn.Module, mixed_precision: str = "fp32"):
        super().__init__()
        self.module = module
        self.mixed_precision = mixed_precision
        self._dtype = autocast_dtype(mixed_precision)
        self.device = module_device(module, default_device())
        self._device_type = self.device.type
        self.tokens = 0  # tokens seen since the last optimizer step
        self.first_forward: Optional[float] = None

    def unwrap(self) -> nn.Module:
        """The inner module (DDP/FSDP-wrapped where the plugin wrapped it)."""
        return self.module

    def _prepare(self, args, kwargs):
        """The forward's inputs moved to this model's device, their tokens counted (StepMetrics)."""
        args, kwargs = to_device((args, kwargs), self.device)
        self.tokens += _count_tokens(args, kwargs)
        if self.first_forward is None:
            self.first_forward = time.perf_counter()
        return args, kwargs

    def forward(self, *args, **kwargs):
        args, kwargs = self._prepare(args, kwargs)
        if self._dtype is None:
            return self.module(*args, **kwargs)
        with torch.autocast(device_type=self._device_type, dtype=self._dtype):
            return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = unwrap_model(self.module)
            inner = getattr(inner, "module", inner)  # DDP keeps the user's model in .module
            return getattr(inner, name)


def rebuild_optimizer(optimizer: Optimizer, old_names: Dict[int, Union[str, List[str]]],
                      new_params: Dict[str, nn.Parameter], optimizer_class=None, partial: bool = False,
                      **extra) -> Optimizer:
    """The same optimizer (class, hyper-parameters, param groups) over new parameter objects.

    Sharding (fully_shard, tensor parallelism) replaces parameters with DTensor ones, so the
    user's optimizer must be rebuilt; ``old_names`` maps ``id(old_param)`` to its name in the
    model (or its names: a tied weight has two). ``partial``: ``new_params`` holds only this
    rank's part (a pipeline stage), so a parameter found under none of its names is left out,
    and one found under two names is taken once.
    """
    if optimizer.state:
        raise ValueError("boost(optimizer=...): the optimizer has already stepped; boost it before "
                         "the first step and restore state with booster.load_optimizer()")
    groups = []
    for g in optimizer.param_groups:
        params, seen = [], set()
        for p in g["params"]:
            names = old_names.get(id(p))
            if names is None:
                raise ValueError("boost(optimizer=...): the optimizer holds a parameter that is not in "
                                 "the model; build it from model.parameters()")
            for n in [names] if isinstance(names, str) else names:
                q = new_params.get(n)
                if q is None and not partial:
                    raise ValueError(f"boost(optimizer=...): parameter {n!r} is not in the boosted model")
                if q is not None and id(q) not in seen:
                    seen.add(id(q))
                    params.append(q)
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
    cls = optimizer_class or type(optimizer)
    return cls(groups, **{**constructor_kwargs(type(optimizer), optimizer.defaults), **extra})


def constructor_kwargs(optimizer_class, settings: dict) -> dict:
    """The entries of ``settings`` (``defaults`` or a param group) the optimizer's ``__init__``
    accepts: ``defaults`` can hold derived keys (AdamW's ``decoupled_weight_decay``)."""
    params = inspect.signature(optimizer_class.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return {k: v for k, v in settings.items() if k != "params"}
    return {k: v for k, v in settings.items() if k in params and k != "params"}


class OptimizerWrapper:
    """The boosted optimizer and the base of every plugin's: the step contract (docs/engine.md,
    "The plugin contract"). ``checkpoint_optim`` is the torch optimizer whose ``state`` this rank
    holds (ZeRO-1: the local shard's optimizer)."""

    def __init__(self, optim: Optimizer, model: Optional[ModelWrapper] = None, mixed_precision: str = "fp32",
                 group: Optional["dist.ProcessGroup"] = None, checkpoint_optim: Optional[Optimizer] = None,
                 loss_scaler: Optional[DynamicLossScaler] = None):
        self.optim = optim
        self.model = model
        self.mixed_precision = mixed_precision
        self.checkpoint_optim = checkpoint_optim or optim
        self.loss_scaler = loss_scaler or (
            DynamicLossScaler(group=group) if needs_loss_scaling(mixed_precision) else None)
        self._unscaled = False
        self._found_inf = False
        self._last_loss: Optional[torch.Tensor] = None
        self._t_last: Optional[float] = None
        self.step_count = 0
        self.skipped_last = False

    # ---- torch.optim surface -------------------------------------------------------------
    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        """This rank's optimizer state (only its shard under ZeRO)."""
        return self.checkpoint_optim.state

    @property
    def defaults(self):
        return self.optim.defaults

    def params(self) -> List[torch.Tensor]:
        return [p for g in self.optim.param_groups for p in g["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        raise RuntimeError("optimizer.state_dict() of a boosted optimizer is ambiguous under sharding; "
                           "use booster.save_optimizer(optimizer, path)")

    def checkpoint_target(self):
        return self.checkpoint_optim, (unwrap_model(self.model) if self.model is not None else None)

    # ---- the step policy -----------------------------------------------------------------
    def record_loss(self, loss: Optional[torch.Tensor]) -> None:
        """The loss this step's StepMetrics reports (``backward`` records it; a pipeline, whose
        backward runs inside the schedule, records the batch loss it returns)."""
        self._last_loss = loss.detach() if isinstance(loss, torch.Tensor) else loss

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        self.record_loss(loss)
        if self.loss_scaler is not None:
            from .moe.layer import aux_loss_backward_scale  # MoE aux losses enter backward unscaled: scale them

            with aux_loss_backward_scale(self.loss_scaler.scale):
                self.loss_scaler.scale_loss(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)

    def unscale_grad(self) -> bool:
        """Unscale gradients once per step (fp16); returns whether any rank overflowed."""
        if self.loss_scaler is not None and not self._unscaled:
            self._found_inf = self._unscale()
            self._unscaled = True
        return self._found_inf

    def _unscale(self) -> bool:
        """Divide this rank's gradients by the loss scale; True when any rank of the scaler's
        group found inf/nan (every rank calls it). Overridden where gradients are not ``p.grad``."""
        return self.loss_scaler.unscale_(self.params())

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm (unscaled first under fp16); returns the norm before clipping."""
        self.unscale_grad()
        params = [p for p in self.params() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def step(self, *args, **kwargs):
        """The one step policy: the overflow vote (fp16, ``_unscale``), then the update
        (``_apply_step``) or the skip (``_skip_step``), the scale's backoff/growth, StepMetrics."""
        skip = self.unscale_grad()
        if skip:
            self._skip_step()
        else:
            self._apply_step(*args, **kwargs)
        if self.loss_scaler is not None:
            self.loss_scaler.update(skip)
        self.skipped_last = skip
        self._unscaled = self._found_inf = False
        self._emit()

    def _apply_step(self, *args, **kwargs) -> None:
        self.optim.step(*args, **kwargs)

    def _skip_step(self) -> None:
        self.optim.zero_grad(set_to_none=True)  # the overflowed gradients are garbage

    def _emit(self) -> None:
        now = time.perf_counter()
        start = self._t_last
        if start is None:
            start = self.model.first_forward if self.model is not None and self.model.first_forward else now
        tokens = 0
        if self.model is not None:
            tokens, self.model.tokens = self.model.tokens, 0
        if telemetry.has_subscribers():
            loss = float(self._last_loss) if self._last_loss is not None else None
            rank = dist.get_rank() if comm.initialized() else 0
            telemetry.emit(telemetry.StepMetrics(rank=rank, step=self.step_count, loss=loss,
                                                 tokens=int(tokens), seconds=now - start))
        self._last_loss = None
        self._t_last = now
        self.step_count += 1

    def sync_param_groups(self, to_checkpoint: bool = True) -> None:
        """ZeRO-1: the local shard optimizer's param groups mirror the global ones (lr,
        initial_lr, ...). Checkpoint IO calls this before saving/loading (``to_checkpoint``) and
        after loading (``False``) so hyper-parameters round-trip."""
        if self.checkpoint_optim is self.optim:
            return
        src, dst = self.optim.param_groups, self.checkpoint_optim.param_groups
        if not to_checkpoint:
            src, dst = dst, src
        for a, b in zip(src, dst):
            b.update({k: v for k, v in a.items() if k != "params"})

    def after_load(self) -> None:
        """Called by checkpoint IO after optimizer state was loaded."""
        self.sync_param_groups(to_checkpoint=False)

    def __repr__(self) -> str:
        return f"OptimizerWrapper({self.optim!r}, mixed_precision={self.mixed_precision!r})"
