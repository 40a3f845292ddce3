"""``GeminiPlugin``: chunk-based ZeRO-3 with heterogeneous memory (device / host RAM / NVMe).

Colossal-AI's argument names and order; what each argument does and the trade-off it makes is
in docs/gemini.md ("Arguments and their trade-offs"), lazily built models ("Models larger than
RAM") included. The plugin validates its arguments before any work and hands the boost to
``gemini.build.build``. Call ``plugin.close()`` (or let the process exit) to remove the NVMe files.

``activation_checkpointing``: ``True`` recomputes every layer (``enable_activation_checkpointing()``, or
``checkpoint_wrapper`` on a Sequential's children); ``"auto"`` plans which layers recompute at the
first training forward (engine/autockpt/) for ``activation_budget`` bytes, or, without one, for
what the compute tier has left: ``device_memory_limit`` (or the device's memory) minus the bytes
Gemini keeps resident there (chunk homes and optimizer state on the compute tier) minus its
run-time working set (``placement.working_set_bytes``: chunks being computed and prefetched,
gradient buffers, optimizer windows). A model whose own config asks for ``"auto"`` (GPT's
``activation_checkpointing="auto"``) is planned here the same way, with its ``activation_budget``.
The profile runs with Gemini's hooks off and every chunk's parameters gathered for its few steps
(the whole model live once, as ``state_dict`` gathers it), on every data-parallel rank, merged over
them (a recompute gathers chunks again: the ranks must recompute the same layers).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Union

import torch
import torch.nn as nn

from ..gemini.build import build
from ..gemini.checkpoint import GeminiCheckpointIO
from ..gemini.nvme import check_direct_io
from ..gemini.placement import POLICIES
from ..gemini.repack import ORDERS
from ..mixed_precision import TORCH_DTYPE_MAP, resolve_precision
from ..models.protocol import check_checkpointing, checkpointing_method
from .base import Plugin


@dataclass
class GeminiPlugin(Plugin):
    placement_policy: str = "auto"
    shard_param_frac: float = 1.0
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0
    nvme_offload_dir: Optional[str] = None
    nvme_offload_frac: float = 0.0
    device_memory_limit: Optional[int] = None
    chunk_size_mb: Optional[float] = None
    max_prefetch: int = 2
    precision: str = "bf16"
    pin_memory: bool = True
    nvme_direct_io: bool = False
    pack_order: str = "execution"
    activation_checkpointing: Union[bool, str] = False
    activation_budget: Optional[int] = None
    ep_size: int = 1  # expert parallelism: the engine's MoE blocks' experts split over ep_size ranks
    _managers: List = field(default_factory=list, init=False, repr=False)
    _experts: List = field(default_factory=list, init=False, repr=False)

    controls_precision = True

    def __post_init__(self):
        if self.placement_policy not in POLICIES:
            raise ValueError(f"GeminiPlugin(placement_policy={self.placement_policy!r}): unknown policy; "
                             f"choose one of {list(POLICIES)}")
        for name in ("shard_param_frac", "offload_optim_frac", "offload_param_frac", "nvme_offload_frac"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"GeminiPlugin({name}={v!r}): must be a fraction in [0, 1]")
        if self.precision not in TORCH_DTYPE_MAP:
            raise ValueError(f"GeminiPlugin(precision={self.precision!r}): choose one of {list(TORCH_DTYPE_MAP)}")
        if self.placement_policy != "static" and (self.offload_optim_frac or self.offload_param_frac):
            raise ValueError("GeminiPlugin: offload_optim_frac/offload_param_frac apply to "
                             "placement_policy='static' only; set placement_policy='static' or leave them at 0")
        if self.placement_policy == "cuda" and not torch.cuda.is_available():
            raise ValueError("GeminiPlugin(placement_policy='cuda'): no CUDA device is available; use "
                             "placement_policy='cpu' or 'auto' (with device_memory_limit) on this machine")
        if self.nvme_offload_frac > 0 and not self.nvme_offload_dir:
            raise ValueError(f"GeminiPlugin(nvme_offload_frac={self.nvme_offload_frac}): needs nvme_offload_dir=... "
                             "(a writable directory on a fast disk), or set nvme_offload_frac=0")
        if self.device_memory_limit is not None and (not isinstance(self.device_memory_limit, int)
                                                     or self.device_memory_limit <= 0):
            raise ValueError(f"GeminiPlugin(device_memory_limit={self.device_memory_limit!r}): must be a positive "
                             "number of bytes (e.g. 2 << 30 for 2 GiB) or None")
        if self.chunk_size_mb is not None and not self.chunk_size_mb > 0:
            raise ValueError(f"GeminiPlugin(chunk_size_mb={self.chunk_size_mb!r}): must be > 0 or None (search)")
        if not isinstance(self.max_prefetch, int) or self.max_prefetch < 0:
            raise ValueError(f"GeminiPlugin(max_prefetch={self.max_prefetch!r}): must be an int >= 0")
        if self.pack_order not in ORDERS:
            raise ValueError(f"GeminiPlugin(pack_order={self.pack_order!r}): choose one of {list(ORDERS)}")
        if self.nvme_direct_io and not self.nvme_offload_dir:
            raise ValueError("GeminiPlugin(nvme_direct_io=True): needs nvme_offload_dir=... (a directory on a "
                             "local disk), or set nvme_direct_io=False")
        if self.ep_size != 1:
            from ..gemini.expert_parallel import check_plugin

            check_plugin(self)
        from ..autockpt_dist import check_budget

        check_budget("GeminiPlugin", self.activation_checkpointing, self.activation_budget, budget_optional=True)
        if self.activation_checkpointing == "auto" and self.activation_budget is None \
                and self.device_memory_limit is None and not torch.cuda.is_available():
            raise ValueError("GeminiPlugin(activation_checkpointing='auto'): without activation_budget the budget is "
                             "what device_memory_limit leaves after Gemini's resident chunks, "
                             "and on a CPU-only machine no limit is set; "
                             "pass activation_budget=<bytes> (e.g. 2 << 30) or device_memory_limit=<bytes>")
        if self.nvme_offload_dir is not None:
            self._check_dir(self.nvme_offload_dir)
            if self.nvme_direct_io:
                check_direct_io(self.nvme_offload_dir)

    @staticmethod
    def _check_dir(d: str) -> None:
        try:
            os.makedirs(d, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=d, prefix=".gemini-probe-"):
                pass
        except OSError as exc:
            raise ValueError(f"GeminiPlugin(nvme_offload_dir={d!r}): the directory is not writable ({exc.strerror}); "
                             "pass a directory you can write to on a fast local disk") from None

    # ---- the boost -----------------------------------------------------------------------
    def configure(self, model: nn.Module, optimizer, criterion, dataloader, lr_scheduler, mixed_precision=None):
        precision = resolve_precision(mixed_precision, self.precision, "GeminiPlugin")
        from ..autockpt_request import requested_budget

        ac, budget = self.activation_checkpointing, self.activation_budget
        asked = requested_budget(model)  # the model contract's checkpoint_budget()
        if ac is not True and asked is not None:
            # the model asks for "auto" itself: planned here, outside Gemini's hooks, with its own budget
            ac, budget = "auto", budget if ac == "auto" and budget is not None else asked
        if ac:
            check_checkpointing(model, f"GeminiPlugin(activation_checkpointing={ac!r})", layers=ac == "auto",
                                instead="use activation_checkpointing=True")
        skip = ("precision", "activation_checkpointing", "activation_budget", "ep_size")
        options = {f.name: getattr(self, f.name) for f in fields(self) if f.init and f.name not in skip}
        experts = None
        if self.ep_size > 1:  # checked before any group; then the groups, and the experts cut to this rank's
            from ..gemini.expert_parallel import check_model, split_experts

            check_model(model, self.ep_size, self.dp_size)
            experts = split_experts(model, optimizer, self.ep_size, self.dp_size)
            self._experts.append(experts)
        gmodel, goptim, manager = build(model, optimizer, precision, device=self.compute_device(),
                                        group=self.dp_group, world=self.dp_size, rank=self.dp_rank,
                                        experts=experts, **options)
        self._managers.append(manager)
        if ac is True:  # after packing: chunks keep the model's own parameter names (no wrapper infix)
            own = checkpointing_method(model)  # the model's, or the adapter's for a transformers model
            if own is not None:
                own()
            else:
                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
                for i in range(len(model)):
                    model[i] = checkpoint_wrapper(model[i])
        if ac == "auto":
            from ..autockpt_request import take

            take(model)  # the model's own request (if any) is planned here, not by its hook
            if budget is None:
                budget = self.resident_budget(manager)
            gmodel.register_forward_pre_hook(_AutoCheckpoint(gmodel, manager, budget, self.dp_group),
                                             with_kwargs=True)
        return gmodel, goptim, criterion, dataloader, lr_scheduler

    def resident_budget(self, manager) -> int:
        """The activation budget left on the compute tier: its capacity (``device_memory_limit``, or
        the device's memory) minus what Gemini keeps resident there now (chunk homes, optimizer state)
        minus its run-time working set. ``ValueError`` when nothing is left."""
        from ..gemini.placement import working_set_bytes
        from ..gemini.tiers import UNLIMITED

        tier = manager.stack.compute
        if tier.capacity >= UNLIMITED:
            raise ValueError("GeminiPlugin(activation_checkpointing='auto'): the compute tier has no capacity to take "
                             "a budget from; pass activation_budget=<bytes> or device_memory_limit=<bytes>")
        reserve = working_set_bytes(manager.chunks, self.max_prefetch, tier.capacity)
        left = tier.capacity - tier.used - reserve
        if left <= 0:
            raise ValueError(f"GeminiPlugin(activation_checkpointing='auto'): device_memory_limit={tier.capacity} "
                             f"bytes leaves nothing for activations: Gemini keeps {tier.used} bytes resident on the "
                             f"{tier.name} tier and reserves {reserve} for its working set; raise device_memory_limit, "
                             "offload more (placement_policy='cpu'/'static', offload_*_frac) or pass activation_budget")
        return int(left)

    def get_checkpoint_io(self):
        return GeminiCheckpointIO(self.dp_group)

    @property
    def ep_group(self):
        """This rank's expert-parallel group (the last boost's), None without ``ep_size``."""
        return self._experts[-1].ep_group if self._experts else None

    @property
    def experts(self):
        """The last boost's ``ExpertGroups`` (EP and expert-dp groups, the expert parameters), or None."""
        return self._experts[-1] if self._experts else None

    def close(self) -> None:
        """Finish pending IO and delete this plugin's NVMe files; destroy the expert groups it made."""
        for m in self._managers:
            m.close()
        self._managers.clear()
        import torch.distributed as dist

        for ex in self._experts:
            for g in ex.groups():
                try:
                    dist.destroy_process_group(g)
                except (ValueError, RuntimeError):
                    pass
        self._experts.clear()


@contextlib.contextmanager
def _every_chunk_live(manager):
    """Every parameter readable for a while, outside Gemini's schedule: a chunk not gathered gets its
    full buffer back and filled from its home (all-gathered when sharded: the same chunks in the same
    order on every rank), and is released again after; the tier accounting is not touched (the
    caller holds the model whole for a few profiling steps, outside any training step)."""
    filled = []
    manager.flush_writes()
    try:
        for c in manager.chunks:
            if c.gathered:
                continue
            if c.param_home == "nvme":
                src = manager.nvme.read(f"c{c.id}.param", torch.empty(c.shard_size, dtype=c.dtype)).result()
            else:
                src = c.shard
            full = manager.gather_full(c, src.to(manager.device))
            c.full.untyped_storage().resize_(c.full_bytes)
            filled.append(c)
            c.full.copy_(full.reshape(-1)[:c.size])
        yield
    finally:
        for c in filled:
            c.full.untyped_storage().resize_(0)


class _AutoCheckpoint:
    """A forward pre-hook on the Gemini model: at the first training forward of each input shape,
    profile the inner model on that batch with Gemini's hooks off and every chunk live (profiling
    runs on detached aliases of the parameters: no gradient reaches a chunk), merge the profile over
    the data-parallel ranks, solve it for ``budget`` and apply the plan."""

    def __init__(self, gmodel, manager, budget: int, group):
        self.gmodel, self.manager, self.budget, self.group = gmodel, manager, int(budget), group
        self.plans: Dict[tuple, Any] = {}

    def __call__(self, gmodel, args, kwargs):
        inner = gmodel.module
        if not (inner.training and torch.is_grad_enabled()) or self.manager.in_backward:
            return None
        from ..autockpt import apply
        from ..autockpt_dist import plan_agreed
        from ..device import to_device

        args, kwargs = to_device((args, kwargs), gmodel.device)
        tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
        key = tuple((tuple(t.shape), t.dtype) for t in tensors)
        plan = self.plans.get(key)
        if plan is None:
            if kwargs:
                import inspect

                sample = dict(inspect.signature(inner.forward).bind(*args, **kwargs).arguments)
            else:
                sample = tuple(args)
            gmodel.remove_hooks()
            try:
                with _every_chunk_live(self.manager):
                    plan = plan_agreed(inner, sample, self.budget, groups=[self.group])
            finally:
                gmodel.install_hooks()
            self.plans[key] = plan
        if getattr(inner, "checkpoint_plan", None) is not plan:
            apply(inner, plan)
        return None
