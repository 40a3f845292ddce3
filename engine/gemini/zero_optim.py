"""The Gemini optimizer: AdamW on fp32 master shards that live beside each chunk's home.

Why not the user's optimizer object as is: after ``boost`` the parameters are views into
chunks (possibly on NVMe, possibly a 1/world shard), so the update runs per chunk on this
rank's shard: gradient and state are loaded from the chunk's optimizer home (RAM, or NVMe with
read-ahead of the next chunk while this one updates and write-behind of the last), the update
is torch's own functional AdamW (``torch.optim.adam.adam`` with ``fused=True`` where the
device supports it — the fused CPU kernel on host/NVMe chunks), and the new fp32 master is cast
into the chunk's compute-dtype parameter shard. Hyper-parameters are read from the user's
optimizer's ``param_groups`` every step, so LR schedulers keep working unchanged.

fp16 uses a dynamic loss scale (skip the step and halve on inf/nan, double after
``growth_interval`` clean steps); bf16 and fp32 need none.

``clip_grad_by_norm`` (what ``Booster.clip_grad_by_norm`` calls) computes the global norm from
the gradient shards where they are (RAM, or the norms taken as NVMe-bound gradients were
written, so clipping adds no disk reads for p = 2 or inf), all-reduced over ranks (replicated
chunks counted once), and folds the clip coefficient into the update's gradient scale instead
of rewriting the gradients.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.optim.adam import adam as _adam
from torch.optim import Optimizer

from .. import comm
from .chunk_manager import ChunkManager

SUPPORTED = (torch.optim.Adam, torch.optim.AdamW)


def _fused_ok(device: torch.device) -> bool:
    return device.type in ("cpu", "cuda")


class GeminiOptimizer:
    """``step()``/``zero_grad()``/``backward(loss)``/``param_groups``/``state_dict()`` like an Optimizer."""

    def __init__(self, optimizer: Optimizer, manager: ChunkManager, precision: str = "fp32",
                 group=None, initial_scale: float = 2.0 ** 16, growth_interval: int = 1000):
        if not isinstance(optimizer, SUPPORTED):
            raise ValueError(
                f"GeminiPlugin: optimizer={type(optimizer).__name__} is not supported; Gemini updates "
                "chunk shards with fused AdamW — pass torch.optim.AdamW or torch.optim.Adam")
        for g in optimizer.param_groups:
            if g.get("amsgrad") or g.get("maximize"):
                raise ValueError("GeminiPlugin: amsgrad/maximize are not supported; set them to False")
        self.optim = optimizer
        self.mgr = manager
        self.precision = precision
        self.group = group
        self.decoupled = isinstance(optimizer, torch.optim.AdamW) or any(
            g.get("decoupled_weight_decay") for g in optimizer.param_groups)
        self._group_of: Dict[int, int] = {}
        for gi, g in enumerate(optimizer.param_groups):
            for p in g["params"]:
                self._group_of[id(p)] = gi
        for c in manager.chunks:
            for info in c.infos:
                info.group = self._group_of.get(id(info.param), -1)
        self.steps: Dict[int, int] = {c.id: 0 for c in manager.chunks}
        self.scale = initial_scale if precision == "fp16" else 1.0
        self.growth_interval = growth_interval
        self._clean = 0
        self.skipped = 0
        self._clip_coef = 1.0
        self.optim.state.clear()  # the user's optimizer never steps; its state would be stale
        manager.check_finite = precision == "fp16"
        manager.gemini_optimizer = self  # repack.py moves the per-chunk step counts with the chunks

    def relink(self, steps: Dict[int, int]) -> None:
        """After a re-pack (``repack.py``): per-chunk step counts and param groups of the new chunks."""
        for c in self.mgr.chunks:
            for info in c.infos:
                info.group = self._group_of.get(id(info.param), -1)
        self.steps = {c.id: steps.get(c.id, 0) for c in self.mgr.chunks}

    # ---- torch.optim.Optimizer-like surface ------------------------------------------------------
    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def defaults(self):
        return self.optim.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in chunk shards and are consumed by ``step``; nothing to clear."""

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.scale if self.scale != 1.0 else loss).backward()
        self.mgr.finish_backward()

    def _found_inf(self) -> bool:
        bad = torch.zeros(1, device=self.mgr.device)  # nccl reduces device tensors only
        if self.mgr.found_inf:  # an NVMe-resident gradient was non-finite when it was stored
            bad.fill_(1)
        for c in self.mgr.chunks:
            g = self.mgr._grad_shard.get(c.id)
            if g is not None and not torch.isfinite(g).all():
                bad.fill_(1)
                break
        if self.mgr.world > 1:
            comm.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        return bool(bad.item())

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm to ``max_norm`` for this step; returns the norm before
        clipping (of the unscaled gradients under fp16), like ``torch.nn.utils.clip_grad_norm_``."""
        p = float(norm_type)
        if not p > 0:
            raise ValueError(f"clip_grad_by_norm(norm_type={norm_type!r}): must be > 0 or inf")
        mgr = self.mgr
        mgr.finish_backward()
        inf = p == math.inf
        acc = 0.0
        for c in mgr.chunks:
            if not mgr.has_grad(c) or (mgr.world > 1 and not c.sharded and c.rank != 0 and not inf):
                continue  # a replicated chunk's gradient is the same on every rank: count it once
            part = mgr.grad_norm_part(c, p)
            acc = max(acc, part) if inf else acc + part
        t = torch.tensor([acc], dtype=torch.float64, device=mgr.device)
        if mgr.world > 1:
            comm.all_reduce(t, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=self.group)
        total = float(t.item()) if inf else float(t.item()) ** (1.0 / p)
        total /= self.scale
        self._clip_coef = min(1.0, max_norm / (total + 1e-6))
        return torch.tensor(total, dtype=torch.float32)

    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("GeminiOptimizer.step(closure): closures are not supported")
        mgr = self.mgr
        mgr.finish_backward()
        mgr.flush_writes()
        found_inf = self.precision == "fp16" and self._found_inf()
        mgr.found_inf = False
        if found_inf:
            self._clip_coef = 1.0
            self.skipped += 1
            self.scale /= 2
            self._clean = 0
            for c in mgr.chunks:
                if mgr.has_grad(c):
                    mgr.release_optim(mgr.load_optim(c).wait())
            mgr.end_step()
            return
        mgr.drop_cache()
        todo = [c for c in mgr.chunks if mgr.has_grad(c)]
        window = mgr.load_optim(todo[0]) if todo else None
        for i, c in enumerate(todo):
            cur = (window or mgr.load_optim(c)).wait()
            window = mgr.load_optim(todo[i + 1], ahead=True) if i + 1 < len(todo) else None  # read-ahead
            self._update(c, cur)
            mgr.write_params(c, cur.master)
            mgr.release_optim(cur)  # write-behind for NVMe homes
        mgr.end_step()
        self._clip_coef = 1.0
        if self.precision == "fp16":
            self._clean += 1
            if self._clean % self.growth_interval == 0:
                self.scale *= 2

    def _update(self, c, w) -> None:
        if w.grad is None:
            return
        self.steps[c.id] += 1
        step = self.steps[c.id]
        by_group: Dict[int, List] = {}
        for info, lo, hi in c.segments():
            if info.group < 0 or not info.param.requires_grad:
                continue
            by_group.setdefault(info.group, []).append((lo, hi))
        inv = self._clip_coef / self.scale
        for gi, segs in by_group.items():
            g = self.optim.param_groups[gi]
            beta1, beta2 = g["betas"]
            params = [w.master[lo:hi] for lo, hi in segs]
            grads = [w.grad[lo:hi] if inv == 1.0 else w.grad[lo:hi] * inv for lo, hi in segs]
            m = [w.exp_avg[lo:hi] for lo, hi in segs]
            v = [w.exp_avg_sq[lo:hi] for lo, hi in segs]
            steps = [torch.tensor(float(step - 1)) for _ in segs]
            kw = dict(amsgrad=False, beta1=beta1, beta2=beta2, lr=float(g["lr"]),
                      weight_decay=g["weight_decay"], eps=g["eps"], maximize=False,
                      decoupled_weight_decay=self.decoupled)
            with torch.no_grad():
                try:
                    _adam(params, grads, m, v, [], steps, fused=_fused_ok(w.master.device), **kw)
                except RuntimeError:
                    steps = [torch.tensor(float(step - 1)) for _ in segs]
                    _adam(params, grads, m, v, [], steps, foreach=False, **kw)

    # ---- checkpoint surface (see checkpoint.py) ------------------------------------------------
    def state_dict(self):
        from .checkpoint import gather_optim_state

        return gather_optim_state(self)

    def load_state_dict(self, sd) -> None:
        from .checkpoint import load_optim_state

        load_optim_state(self, sd)
