"""The Gemini optimizer: Adam/AdamW on fp32 master shards that live beside each chunk's home.

The base ``OptimizerWrapper``'s step policy (loss scale, overflow vote, StepMetrics) with hooks that
work on chunk shards: gradients never are ``p.grad``, so ``_unscale`` only votes on inf/nan, 1/scale
and the clip coefficient are folded into the update, and ``_apply_step`` runs torch's functional
Adam per chunk with read-ahead/write-behind of NVMe homes. Hyper-parameters are read from the
user's ``param_groups`` every step (LR schedulers work). See docs/gemini.md, ``zero_optim.py`` row.
"""

from __future__ import annotations

import math
from typing import Dict, List

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from torch.optim.adam import adam as _adam

from .. import comm
from ..wrappers import OptimizerWrapper
from . import experts as expert_state
from .chunk_manager import ChunkManager

SUPPORTED = (torch.optim.Adam, torch.optim.AdamW)


def _fused_ok(device: torch.device) -> bool:
    return device.type in ("cpu", "cuda")


def check_optimizer(optimizer: Optimizer) -> None:
    """Raise ``ValueError`` unless Gemini can run ``optimizer`` (called before any work)."""
    if not isinstance(optimizer, SUPPORTED):
        raise ValueError(f"GeminiPlugin: optimizer={type(optimizer).__name__} is not supported; pass "
                         "torch.optim.AdamW or torch.optim.Adam (Gemini runs fused AdamW on chunk shards)")
    if any(g.get("amsgrad") or g.get("maximize") for g in optimizer.param_groups):
        raise ValueError("GeminiPlugin: amsgrad/maximize are not supported; set them to False")


class GeminiOptimizer(OptimizerWrapper):
    """The boosted optimizer of a Gemini model: the base's step policy over chunk shards."""

    def __init__(self, optimizer: Optimizer, manager: ChunkManager, precision: str = "fp32",
                 group=None, model=None, experts=None):
        check_optimizer(optimizer)
        super().__init__(optimizer, model, precision, group=group)
        self.mgr = manager
        self.group = group
        self.experts = experts  # hybrid.experts.ExpertGroups under expert parallelism
        self.decoupled = isinstance(optimizer, torch.optim.AdamW) or any(
            g.get("decoupled_weight_decay") for g in optimizer.param_groups)
        group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        for c in manager.chunks:
            for info in c.infos:
                info.group = group_of.get(id(info.param), -1)
        self._clip_coef = 1.0
        self.optim.state.clear()  # the user's optimizer never steps; its state would be stale
        manager.check_finite = self.loss_scaler is not None

    @property
    def steps(self) -> Dict[int, int]:
        """Adam's step count per chunk id (kept by the manager, which moves it on a re-pack)."""
        return self.mgr.steps

    @property
    def scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @scale.setter
    def scale(self, value: float) -> None:
        self.loss_scaler.scale = float(value)

    @property
    def skipped(self) -> int:
        return self.loss_scaler.skipped_steps if self.loss_scaler is not None else 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in chunk shards until ``step`` consumes them: drop any still waiting."""
        self.mgr.discard_grads()

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        super().backward(loss, **kwargs)
        self.mgr.finish_backward()

    def _unscale(self) -> bool:
        """Nothing is rewritten (1/scale is folded into the update): only the vote on inf/nan."""
        bad = not self.mgr.grads_finite()
        return comm.any_rank(bad, self.group) if self.mgr.world > 1 else bad

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
        self.mgr.finish_backward()
        self.mgr.flush_writes()
        super().step()
        if self.experts is not None and self.model is not None:  # this step's ExpertLoad per MoE block
            from ..moe import emit_load

            emit_load(self.model.module, self.mgr.rank, self.mgr.step - 1)

    def _skip_step(self) -> None:
        self._clip_coef = 1.0
        self.mgr.discard_grads()
        self.mgr.end_step()

    def _apply_step(self) -> None:
        mgr = self.mgr
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

    # ---- checkpoint surface (checkpoint.py) ---------------------------------------------------
    def state_dict(self) -> Dict[str, torch.Tensor]:
        """``state.<name>.exp_avg|exp_avg_sq|step``, full tensors on CPU (collective on every rank)."""
        out: Dict[str, torch.Tensor] = {}
        for c in self.mgr.chunks:
            if c.frozen:  # no moments (the same chunks on every rank, so the gathers still pair up)
                continue
            full = self.mgr.gather_full(c, self.mgr.read_state(c))
            m, v = full[c.size:2 * c.size], full[2 * c.size:]
            for info in c.trainable:
                out[f"state.{info.name}.exp_avg"] = m[info.offset:info.end].view(info.shape).clone()
                out[f"state.{info.name}.exp_avg_sq"] = v[info.offset:info.end].view(info.shape).clone()
                out[f"state.{info.name}.step"] = torch.tensor(float(self.steps[c.id]))
        if self.experts is not None:  # every expert's moments, gathered over the EP group
            expert_state.gather(out, self.experts, expert_state.OPTIM)
        return out

    def load_state_dict(self, sd: Dict[str, torch.Tensor]) -> None:
        if self.experts is not None:  # whole expert moments: this rank's rows
            sd = expert_state.cut(sd, self.experts, {i.name: i.shape for c in self.mgr.chunks for i in c.infos},
                                  expert_state.OPTIM)
        for c in self.mgr.chunks:
            if c.frozen:
                continue
            state = self.mgr.read_state(c)
            full = self.mgr.gather_full(c, state).clone()
            n, (s0, s1) = c.shard_size, c.shard_range
            for row in (1, 2):
                moments = full[row * c.size:(row + 1) * c.size]
                for info in c.infos:
                    key = f"state.{info.name}.{'exp_avg' if row == 1 else 'exp_avg_sq'}"
                    if key in sd:
                        moments[info.offset:info.end].copy_(sd[key].reshape(-1))
                        self.steps[c.id] = int(sd[f"state.{info.name}.step"].item())
                state[row * n:(row + 1) * n].copy_(moments[s0:s1])
            self.mgr.write_state(c, state)
