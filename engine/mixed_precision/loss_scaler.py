"""Dynamic loss scaling for fp16, with a cross-rank inf/nan check.

Same schedule as ``torch.amp.GradScaler`` (start at 2**16, halve on overflow, double after
``growth_interval`` clean steps) but the found-inf flag is all-reduced (MAX) over ``group``:
under ZeRO-2/Gemini/pipelines a rank holds only part of the gradients, and every rank must
skip the same step or the replicas diverge. Gradients may be plain tensors or DTensors.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from .. import comm


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, min_scale: float = 1.0,
                 max_scale: float = 2.0 ** 24, group: Optional["dist.ProcessGroup"] = None,
                 sync: bool = True):
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval >= 1):
            raise ValueError("DynamicLossScaler: need growth_factor > 1, 0 < backoff_factor < 1, "
                             "growth_interval >= 1")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale, self.max_scale = growth_interval, min_scale, max_scale
        self.group = group
        self.sync = sync  # False: this process trains alone (plugin=None), no cross-rank check
        self._good_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @torch.no_grad()
    def unscale_(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide every gradient by the scale in place; True when any rank found inf/nan."""
        inv = 1.0 / self.scale
        grads = [_local(p.grad) for p in params if p.grad is not None]
        found = False
        if grads:
            by_dev = {}
            for g in grads:
                by_dev.setdefault((g.device, g.dtype), []).append(g)
            for gs in by_dev.values():
                torch._foreach_mul_(gs, inv)
                norms = torch._foreach_norm(gs)  # inf/nan in a tensor -> inf/nan norm
                total = torch.stack([n.float() for n in norms]).sum()
                found = found or not torch.isfinite(total).item()
        if self.sync:
            found = comm.any_rank(found, self.group)  # on the group's device (nccl: cuda)
        return found

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self._good_steps = 0
            self.skipped_steps += 1
        else:
            self._good_steps += 1
            if self._good_steps % self.growth_interval == 0:
                self.scale = min(self.scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self._good_steps = int(sd.get("good_steps", 0))
        self.skipped_steps = int(sd.get("skipped_steps", 0))
