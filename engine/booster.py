"""``Booster``: the one entry point that turns a model/optimizer/dataloader into a trained one.

Colossal-AI's shape on purpose (same names, same argument order); everything is validated before
a process group, a device or a byte of memory is touched, and the plugin does the rest
(``plugin=None``: this process, wrapped the same way). Where we differ from Colossal-AI: mixed
precision keeps fp32 parameters as the master copy and computes under autocast (see
``colossal_lab.engine.mixed_precision``); ``save_optimizer`` always writes a resharding-friendly
torch.distributed.checkpoint directory.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Optional

import torch.nn as nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, Dataset

from .device import DeviceDataLoader
from .mixed_precision import require_fp8, validate_precision
from .plugins.base import Plugin


class _SingleProcess(Plugin):
    """``plugin=None``: the model stays a plain module in this process."""

    supported_precisions = ("fp32", "fp16", "bf16", "fp8")

    def configure(self, model, optimizer, criterion, dataloader, lr_scheduler, mixed_precision):
        from .mixed_precision import DynamicLossScaler, needs_loss_scaling
        from .plugins.ddp import prepare_module
        from .wrappers import ModelWrapper, OptimizerWrapper

        wrapped = ModelWrapper(prepare_module(model, mixed_precision), mixed_precision)
        if optimizer is not None:
            # even inside a multi-rank cluster this model trains alone: no cross-rank inf check
            scaler = DynamicLossScaler(sync=False) if needs_loss_scaling(mixed_precision) else None
            optimizer = OptimizerWrapper(optimizer, wrapped, mixed_precision, loss_scaler=scaler)
        return wrapped, optimizer, criterion, dataloader, lr_scheduler

    def no_sync(self, model, optimizer=None):
        return contextlib.nullcontext()


def _check_sized(dataloader: DataLoader, where: str) -> None:
    ds = getattr(dataloader, "dataset", None)
    try:
        len(ds)
    except TypeError:
        raise ValueError(
            f"{where}: the dataloader's dataset ({type(ds).__name__}) has no length, so it cannot be "
            "split over data-parallel ranks; give the dataset __len__ and use booster.prepare_dataloader()"
        ) from None


def _retarget_scheduler(lr_scheduler, optimizer) -> None:
    """Point a torch LR scheduler at a rebuilt optimizer, with the same step-order tracking
    wrapper torch installs at scheduler creation (else it warns on its first step)."""
    lr_scheduler.optimizer = optimizer
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return
    func = step.__func__

    def wrapper(*args, **kwargs):
        optimizer._opt_called = True
        return func(optimizer, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    optimizer.step = wrapper


class Booster:
    def __init__(self, plugin: Optional[Plugin] = None, mixed_precision: Optional[str] = None):
        """``mixed_precision``: ``"fp32" | "fp16" | "bf16" | "fp8"``, or None (the default) to let
        a plugin with a ``precision`` argument of its own (Gemini, hybrid) decide, and fp32
        elsewhere: see ``mixed_precision.resolve_precision``, the one rule."""
        if plugin is not None and not isinstance(plugin, Plugin):
            raise TypeError(f"Booster(plugin=...): expected a colossal_lab.engine.plugins.Plugin, "
                            f"got {type(plugin).__name__}")
        self.plugin = plugin if plugin is not None else _SingleProcess()
        if mixed_precision is None and not self.plugin.controls_precision:
            mixed_precision = "fp32"
        self.mixed_precision = None if mixed_precision is None else validate_precision(mixed_precision)
        if self.mixed_precision is not None:
            self.plugin.validate(self.mixed_precision)
        if self.mixed_precision == "fp8":
            require_fp8()
        self._boosted = False
        self._boosted_models: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # enable_lora refuses these

    # ---- boost ---------------------------------------------------------------------------
    def boost(self, model: nn.Module, optimizer: Optional[Optimizer] = None, criterion: Optional[Callable] = None,
              dataloader: Optional[DataLoader] = None, lr_scheduler: Optional[Any] = None):
        """Return ``(model, optimizer, criterion, dataloader, lr_scheduler)``, boosted."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"boost(model=...): expected a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise TypeError(f"boost(optimizer=...): expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if dataloader is not None:
            _check_sized(dataloader, "boost(dataloader=...)")
        from .models.hf import is_hf_model

        if is_hf_model(model):
            from .models.hf.version import check_floor

            check_floor("transformers")  # an older release's plans train differently: say so before any work
        from .lora import prepare_boost

        lora = prepare_boost(model, optimizer, self.plugin)  # a LoRA model: only adapters reach the optimizer
        out = self.plugin.configure(lora, optimizer, criterion, dataloader, lr_scheduler, self.mixed_precision)
        if out[3] is not None:
            device = self.plugin.compute_device()
            if device.type != "cpu":  # batches arrive where the model computes
                out = (*out[:3], DeviceDataLoader(out[3], device), out[4])
        boosted_opt, boosted_sched = out[1], out[4]
        if boosted_opt is not None and boosted_sched is not None \
                and getattr(boosted_sched, "optimizer", None) is optimizer and boosted_opt.optim is not optimizer:
            # the plugin rebuilt the optimizer (sharded params / ZeRO): the scheduler must drive
            # the new param groups (which carry over lr and initial_lr)
            _retarget_scheduler(boosted_sched, boosted_opt.optim)
        self._boosted = True
        self._boosted_models.add(model)
        return out

    # ---- LoRA (peft) -----------------------------------------------------------------------
    def enable_lora(self, model: nn.Module, pretrained_dir: Optional[str] = None, lora_config=None,
                    bnb_quantization_config=None, quantize: bool = False) -> nn.Module:
        """``model`` wrapped in peft LoRA adapters (a ``peft.PeftModel``; new ones from
        ``lora_config``, saved ones from ``pretrained_dir``), to pass to ``boost``: only the
        adapters train and reach the optimizer. Every argument is checked first (engine/lora.py)."""
        from .lora import enable_lora

        if model in self._boosted_models:
            raise ValueError("enable_lora(model=...): this booster already boosted the model; call "
                             "booster.enable_lora(model, ...) first, then booster.boost(lora_model, optimizer, ...)")
        return enable_lora(model, pretrained_dir=pretrained_dir, lora_config=lora_config,
                           bnb_quantization_config=bnb_quantization_config, quantize=quantize)

    def save_lora_as_pretrained(self, model, checkpoint, use_safetensors: bool = True) -> None:
        """The boosted LoRA model's adapters in directory ``checkpoint``, as peft writes them
        (``peft.PeftModel.from_pretrained(base, checkpoint)`` loads them); collective, rank 0 writes."""
        from .lora import save_lora_as_pretrained

        save_lora_as_pretrained(model, checkpoint, use_safetensors=use_safetensors)

    # ---- the training step ---------------------------------------------------------------
    def backward(self, loss, optimizer) -> None:
        """``optimizer.backward(loss)``: loss scaling, the loss StepMetrics reports, and whatever
        the plugin's backward needs."""
        self.plugin.backward(loss, optimizer)

    def no_sync(self, model: nn.Module = None, optimizer=None) -> contextlib.AbstractContextManager:
        """Skip gradient synchronisation inside the block (gradient accumulation)."""
        return self.plugin.no_sync(model, optimizer)

    def clip_grad_by_norm(self, optimizer, max_norm: float, norm_type: float = 2.0):
        return optimizer.clip_grad_by_norm(max_norm, norm_type=norm_type)

    def execute_pipeline(self, data_iter: Iterator, model, criterion, optimizer=None,
                         return_loss: bool = True, return_outputs: bool = False) -> dict:
        return self.plugin.execute_pipeline(data_iter, model, criterion, optimizer,
                                            return_loss=return_loss, return_outputs=return_outputs)

    def prepare_dataloader(self, dataset: Dataset, batch_size: int, shuffle: bool = False, seed: int = 1024,
                           drop_last: bool = False, pin_memory: bool = False, num_workers: int = 0,
                           **kwargs) -> DataLoader:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"prepare_dataloader(batch_size={batch_size!r}): must be a positive int")
        return self.plugin.prepare_dataloader(dataset, batch_size, shuffle=shuffle, seed=seed,
                                              drop_last=drop_last, pin_memory=pin_memory,
                                              num_workers=num_workers, **kwargs)

    # ---- checkpoints ---------------------------------------------------------------------
    def save_model(self, model, checkpoint, shard: bool = True, size_per_shard: float = 1024) -> None:
        """HF-style safetensors (shards + index JSON) in directory ``checkpoint``; ``size_per_shard``
        in MB. ``shard=False`` writes ``checkpoint/model.safetensors``, or exactly ``checkpoint``
        when that path ends in ``.safetensors``."""
        self.plugin.get_checkpoint_io().save_model(model, checkpoint, shard=shard, size_per_shard=size_per_shard)

    def load_model(self, model, checkpoint, strict: bool = True) -> None:
        self.plugin.get_checkpoint_io().load_model(model, checkpoint, strict=strict)

    def save_optimizer(self, optimizer, checkpoint, **_ignored) -> None:
        """A torch.distributed.checkpoint directory; loads on any number of ranks."""
        self.plugin.get_checkpoint_io().save_optimizer(optimizer, checkpoint)

    def load_optimizer(self, optimizer, checkpoint) -> None:
        self.plugin.get_checkpoint_io().load_optimizer(optimizer, checkpoint)

    def save_lr_scheduler(self, lr_scheduler, checkpoint) -> None:
        self.plugin.get_checkpoint_io().save_lr_scheduler(lr_scheduler, checkpoint)

    def load_lr_scheduler(self, lr_scheduler, checkpoint) -> None:
        self.plugin.get_checkpoint_io().load_lr_scheduler(lr_scheduler, checkpoint)
