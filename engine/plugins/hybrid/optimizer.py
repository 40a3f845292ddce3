"""``HybridParallelOptimizer``: the boosted optimizer of a tensor × pipeline × context × data-parallel run.

The step policy is ``OptimizerWrapper``'s; before unscaling, gradients go through the plugin's
:class:`.grads.GradSync` (tied copies summed, dp × cp mean), and the clip norm is summed over the
pipeline stages (each holds only its own parameters) and the N-d grid.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ... import comm
from ...wrappers import OptimizerWrapper
from .grads import GradSync, _local
from .module import HybridParallelModule


class HybridParallelOptimizer(OptimizerWrapper):
    """The base class's step policy, with ``grads(model)`` (tied copies summed, gradients averaged over
    dp × cp) before unscaling and the clip norm summed over the pipeline stages, each holding only its
    own parameters (docs/engine.md, "The plugin contract")."""

    def __init__(self, optim: Optimizer, model: HybridParallelModule, precision: str, loss_scaler,
                 grads: GradSync):
        # the overflow vote is world-wide: a stage that skipped a step alone would desynchronise
        # the pipeline (group=None: the default group)
        super().__init__(optim, model, precision, loss_scaler=loss_scaler)
        self.grads = grads
        self._synced = False

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, sd):
        return self.optim.load_state_dict(sd)

    def _sync(self) -> None:
        if not self._synced:
            self.grads(self.model)
            self._synced = True

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm (all stages, tensor-parallel shards whole; unscaled
        first under fp16); returns the norm before clipping, like ``clip_grad_norm_``."""
        p = float(norm_type)
        if not p > 0:
            raise ValueError(f"clip_grad_by_norm(norm_type={norm_type!r}): must be > 0 or inf")
        self._sync()
        self.unscale_grad()
        named = [(n, q.grad) for n, q in self.model.named_model_parameters() if q.grad is not None]
        inf = p == math.inf
        acc = 0.0
        skip = self.grads.ties.skip
        experts = self.grads.experts  # expert parallelism: each EP rank holds other experts
        own = experts.params if experts is not None else set()
        ids = {n: id(q) for n, q in self.model.named_model_parameters()}
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        acc_ex = 0.0
        for name, g in [(n, g) for n, g in named if n not in skip]:  # a tied weight counts once
            n = torch.linalg.vector_norm(g.float(), p)
            n = float(n.full_tensor() if hasattr(n, "full_tensor") else n)
            if ids.get(name) in own:
                acc_ex = max(acc_ex, n) if inf else acc_ex + n ** p
            else:
                acc = max(acc, n) if inf else acc + n ** p
        if experts is not None:
            (acc_ex,) = comm.reduce_values([acc_ex], op=op, group=experts.ep_group)
            acc = max(acc, acc_ex) if inf else acc + acc_ex
        nd = self.model.nd
        if nd is not None and nd.grid.tp_group.pg is not None:  # N-d: each element has one owner in the grid
            (acc,) = comm.reduce_values([acc], op=op, group=nd.grid.tp_group.pg)
        pp_group = self.model.runtime.pp_group
        if pp_group is not None:
            (acc,) = comm.reduce_values([acc], op=op, group=pp_group)
        total = acc if inf else acc ** (1.0 / p)
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for _, g in named:
                _local(g).mul_(coef)
        return torch.tensor(total, dtype=torch.float32)

    def step(self, *args, **kwargs):
        rec = self.model.runtime.recorder
        rec.step = max(0, self.model.runtime.step_index - 1)
        with rec.timed("optim"):
            self._sync()
            self._synced = False
            out = super().step(*args, **kwargs)
        if self.grads.experts is not None or self._has_moe():  # each MoE layer's load of this step
            from ...moe import emit_load

            for mod in self.model.stage_modules:
                emit_load(mod.inner, dist.get_rank(), self.step_count - 1)
        return out

    def _has_moe(self) -> bool:
        if not hasattr(self, "_moe"):
            from ...moe import moe_layers

            self._moe = any(True for mod in self.model.stage_modules for _ in moe_layers(mod.inner))
        return self._moe
