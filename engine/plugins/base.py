"""The plugin contract: what ``Booster`` asks of a parallelism strategy (docs/engine.md).

Defaults here serve the single-process case, so a plugin overrides only what it changes. A plugin
validates its arguments in ``__init__`` (before any process group or memory is touched) and raises
``ValueError`` naming the argument and a valid choice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, Dataset

if TYPE_CHECKING:  # pragma: no cover
    from ..checkpoint_io import CheckpointIO

from ..device import default_device


class Plugin:
    """Base class for Booster plugins.

    Subclasses set ``supported_precisions`` and implement ``configure``. A plugin that runs a
    pipeline sets ``supports_pipeline = True`` and implements ``execute_pipeline``.
    """

    supported_precisions: Tuple[str, ...] = ("fp32", "fp16", "bf16")
    supports_pipeline: bool = False
    #: True when the plugin applies mixed precision itself (Gemini, hybrid); Booster then only
    #: passes the precision string through ``configure``.
    controls_precision: bool = False

    def compute_device(self) -> torch.device:
        """Where the boosted model computes: its forward moves tensor inputs there, and the
        dataloader ``Booster.boost`` returns delivers batches there."""
        return default_device()

    # ---- process groups ------------------------------------------------------------------
    @property
    def dp_group(self) -> Optional[dist.ProcessGroup]:
        """The data-parallel group (None = the default world group, or no distributed run)."""
        return None

    @property
    def dp_size(self) -> int:
        if not dist.is_available() or not dist.is_initialized():
            return 1
        return dist.get_world_size(self.dp_group)

    @property
    def dp_rank(self) -> int:
        if not dist.is_available() or not dist.is_initialized():
            return 0
        return dist.get_rank(self.dp_group)

    # ---- the boost -----------------------------------------------------------------------
    def validate(self, mixed_precision: str) -> None:
        """Called by ``Booster.__init__`` before any work: raise ``ValueError`` for a precision
        (or precision/config combination) this plugin cannot run. Override to add checks."""
        if mixed_precision not in self.supported_precisions:
            raise ValueError(f"{type(self).__name__} does not support mixed_precision={mixed_precision!r}; "
                             f"it supports {list(self.supported_precisions)}")

    def configure(
        self,
        model: nn.Module,
        optimizer: Optional[Optimizer],
        criterion: Optional[Callable],
        dataloader: Optional[DataLoader],
        lr_scheduler: Optional[Any],
        mixed_precision: str,
    ):
        """Wrap and return ``(model, optimizer, criterion, dataloader, lr_scheduler)``."""
        raise NotImplementedError(f"{type(self).__name__}.configure")

    def backward(self, loss: torch.Tensor, optimizer) -> None:
        """Backward through the boosted optimizer (an ``OptimizerWrapper``: loss scaling, StepMetrics)."""
        optimizer.backward(loss)

    def no_sync(self, model: nn.Module, optimizer=None) -> ContextManager:
        """Skip gradient synchronisation inside the block (gradient accumulation)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not support no_sync(); accumulate gradients with "
            "DDPPlugin or LowLevelZeroPlugin"
        )

    def execute_pipeline(self, data_iter: Iterator, model, criterion, optimizer=None,
                         return_loss: bool = True, return_outputs: bool = False) -> dict:
        raise RuntimeError(
            f"{type(self).__name__} does not run pipelines; use HybridParallelPlugin(pp_size>1) "
            "for booster.execute_pipeline"
        )

    # ---- data ----------------------------------------------------------------------------
    def prepare_dataloader(self, dataset: Dataset, batch_size: int, shuffle: bool = False,
                           seed: int = 1024, drop_last: bool = False, pin_memory: bool = False,
                           num_workers: int = 0, **kwargs) -> DataLoader:
        """A DataLoader whose DistributedSampler splits ``dataset`` over the data-parallel ranks."""
        from torch.utils.data.distributed import DistributedSampler

        try:
            len(dataset)
        except TypeError:
            raise ValueError(
                "prepare_dataloader(dataset=...): the dataset has no length, so it cannot be split "
                "over data-parallel ranks; give it __len__ or shard an IterableDataset yourself"
            ) from None
        sampler = DistributedSampler(dataset, num_replicas=self.dp_size, rank=self.dp_rank,
                                     shuffle=shuffle, seed=seed, drop_last=drop_last)
        g = torch.Generator()
        g.manual_seed(seed)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                          pin_memory=pin_memory, num_workers=num_workers, generator=g, **kwargs)

    # ---- checkpoints ---------------------------------------------------------------------
    def get_checkpoint_io(self) -> "CheckpointIO":
        from ..checkpoint_io import GeneralCheckpointIO

        return GeneralCheckpointIO(self.dp_group)
