"""Advice for a plan that does not fit: concrete changes, best first, each with what it saves on the
tightest tier, re-planned with the same traces where that is cheap (activation checkpointing,
ZeRO-2, Gemini), else estimated (half the batch) or named (``nvme_offload_dir``, ``tp_size``...)."""

from __future__ import annotations

from typing import Callable, List, Optional

from .dispatch import _compose
from .env import _Env
from .result import FitPlan, _fmt


def _worst_over(fp: FitPlan, tier: str) -> int:
    return max((g.tiers[tier].peak - g.tiers[tier].capacity for g in fp.ranks
                if tier in g.tiers and g.tiers[tier].capacity is not None), default=0)


def _advice(fp: FitPlan, m, plugin, env: _Env, prec: str, opt: str, ac: bool) -> List[str]:
    """Concrete changes, each with what it saves on the tightest tier (re-planned where cheap)."""
    out: List[str] = []
    dev = env.compute_tier
    blocked = getattr(fp, "blocked", None)
    over = _worst_over(fp, dev)
    peak = fp.peak(dev)

    def replan(pl, ac_) -> Optional[int]:
        try:
            r = _compose(m, pl, env, prec, opt, ac_)
        except Exception:
            return None
        return max((g.tiers[dev].peak for g in r.ranks if dev in g.tiers), default=0)

    if fp.fits and not blocked:
        return out
    if over > 0 or blocked:
        out += _smaller_step(fp, m, plugin, ac, peak, dev, replan)
        out += _sharding(fp, plugin, env, prec, ac, peak, dev, replan)
        out += _gemini_knobs(m, plugin, env)
        out += _parallel(m, plugin, env)
        if env.device != "cpu" and env.compute is not None:
            out.append(f"a device with more than {_fmt(peak)} per rank, "
                       f"or world_size={2 * env.world} with a sharding plugin")
    if "nvme" in fp.tiers and _worst_over(fp, "nvme") > 0:
        out.append(f"free {_fmt(_worst_over(fp, 'nvme') * env.world)} on nvme_dir, choose a larger disk, or lower "
                   "nvme_offload_frac")
    if blocked and not out:
        out.append(blocked)
    return out


def _smaller_step(fp: FitPlan, m, plugin, ac: bool, peak: int, dev: str,
                  replan: Callable) -> List[str]:
    """Fewer activations: checkpointing (re-planned), half the batch (estimated)."""
    from ...plugins import HybridParallelPlugin

    out: List[str] = []
    if not ac and m.supports_ac():
        alt = replan(plugin, True)
        if alt is not None and alt < peak:
            out.append(f"activation checkpointing saves {_fmt(peak - alt)} per rank on {dev} "
                       f"(peak {_fmt(peak)} -> {_fmt(alt)}): {m.name}.enable_activation_checkpointing() (a config's "
                       "activation_checkpointing=True)"
                       + (" or HybridParallelPlugin(activation_checkpointing=True)"
                          if isinstance(plugin, HybridParallelPlugin) else ""))
    act = fp.activations.get("with_checkpointing" if ac else "without_checkpointing") or 0
    if fp.batch > 1 and act:
        out.append(f"batch={fp.batch // 2} (half) saves about {_fmt(act / 2)} of activations per rank; keep the "
                   f"global batch with gradient accumulation (booster.no_sync) or more ranks")
    return out


def _replicated(plugin) -> bool:
    """Every rank holds the whole model state: one process, DDP, ZeRO-1."""
    from ...plugins import DDPPlugin, LowLevelZeroPlugin

    return plugin is None or isinstance(plugin, DDPPlugin) or (isinstance(plugin, LowLevelZeroPlugin)
                                                                and plugin.stage == 1)


def _sharding(fp: FitPlan, plugin, env: _Env, prec: str, ac: bool, peak: int, dev: str,
              replan: Callable) -> List[str]:
    """A replicated layout's state sharded: ZeRO-2, or Gemini (both re-planned)."""
    from ...plugins import GeminiPlugin, LowLevelZeroPlugin

    out: List[str] = []
    if not _replicated(plugin):
        return out
    if env.world > 1:
        alt = replan(LowLevelZeroPlugin(stage=2), ac)
        if alt is not None and alt < peak:
            out.append(f"LowLevelZeroPlugin(stage=2) shards gradients and optimizer state: peak {_fmt(peak)} -> "
                       f"{_fmt(alt)} per rank")
    gp = GeminiPlugin(placement_policy="auto", precision=prec if prec in ("fp32", "bf16", "fp16") else "bf16",
                      nvme_offload_dir=env.nvme_dir, nvme_offload_frac=1.0 if env.nvme_dir else 0.0,
                      device_memory_limit=(env.compute // 2) if env.compute else None)
    alt = replan(gp, ac)
    if alt is not None and alt < peak:
        out.append("GeminiPlugin(placement_policy='auto'"
                   f"{', nvme_offload_dir=' + repr(env.nvme_dir) if env.nvme_dir else ''}"
                   f") moves parameters and optimizer state off the {dev} tier: peak -> {_fmt(alt)}")
    return out


def _gemini_knobs(m, plugin, env: _Env) -> List[str]:
    """A Gemini plan's own settings that move bytes down the tier stack."""
    from ...plugins import GeminiPlugin

    out: List[str] = []
    if not isinstance(plugin, GeminiPlugin):
        return out
    if plugin.nvme_offload_dir is None:
        need = 16 * m.numel // env.world
        out.append(f"add nvme_offload_dir=... (GeminiPlugin(placement_policy='auto', nvme_offload_dir=...)): "
                   f"the optimizer state ({_fmt(need)} per rank with gradients) can live on disk")
    elif plugin.nvme_offload_frac < 1.0:
        out.append("nvme_offload_frac=1.0 keeps all optimizer state on NVMe")
    if plugin.placement_policy != "auto":
        out.append("placement_policy='auto' fills the compute tier and spills the rest down the stack")
    return out


def _parallel(m, plugin, env: _Env) -> List[str]:
    """Model parallelism where the model and the world allow it: more tensor or pipeline ranks."""
    from ...plugins import DDPPlugin, HybridParallelPlugin

    out: List[str] = []
    if not (isinstance(plugin, HybridParallelPlugin)
            or ((plugin is None or isinstance(plugin, DDPPlugin)) and env.world > 1)):
        return out
    tp = getattr(plugin, "tp_size", 1)
    if callable(getattr(m.meta, "tp_plan", None)) and env.world % (2 * tp) == 0 and _tp_fits(m.meta, 2 * tp):
        out.append(f"tp_size={2 * tp} (HybridParallelPlugin) splits every block's weights and activations "
                   f"over {2 * tp} ranks")
    pp = getattr(plugin, "pp_size", 1)
    if callable(getattr(m.meta, "num_layers", None)) and m.meta.num_layers() % (2 * pp) == 0 \
            and env.world % (2 * pp * tp) == 0:
        out.append(f"pp_size={2 * pp} (HybridParallelPlugin) holds 1/{2 * pp} of the layers per rank")
    return out


def _tp_fits(meta, tp: int) -> bool:
    """The model contract's ``check_tp`` accepts ``tp`` ranks (no such method: nothing to check)."""
    check = getattr(meta, "check_tp", None)
    if not callable(check):
        return True
    try:
        check(tp)
    except (ValueError, TypeError):
        return False
    return True
