"""The search space: every layout of ``world_size`` ranks a model and a global batch allow.

A :class:`Candidate` is one ``HybridParallelPlugin`` configuration: ``dp × tp × pp`` ranks, the
pipeline schedule and its microbatches, ZeRO stage, activation checkpointing and the
tensor-parallel mode (1D, or 2D / 2.5D / 3D where ``tp`` forms the mode's grid) and, for a
mixture-of-experts model, the expert-parallel size (``ep``: divisors of every MoE layer's expert count
and of ``dp``, the EP groups being cut from the data-parallel ranks). What the model
allows comes from its contract (``check_tp``, ``tp_plan``, ``tp_nd_plan``, ``num_layers``), or for a
transformers model from its adapter (``engine/models/hf``: its plan and head counts), read off a
meta-device copy, and pipelines and recomputation only where the engine's own checks take the model;
what the batch allows is divisibility (rows per data-parallel rank, per microbatch, per grid row).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

SCHEDULES = ("1f1b", "interleaved")
_KNOWN_SCHEDULES = ("1f1b", "gpipe", "interleaved", "zbv", "zero_bubble")


@dataclass(frozen=True)
class Candidate:
    """One layout: ``HybridParallelPlugin(**candidate.plugin_kwargs())``."""

    dp: int
    tp: int
    pp: int
    pp_style: str = "1f1b"
    num_microbatches: int = 1
    num_model_chunks: int = 1
    zero_stage: int = 0
    activation_checkpointing: bool = False
    tp_mode: str = "1d"
    tp_depth: int = 1  # 2.5D's d
    ep: int = 1  # expert parallelism (MoE models): experts split over groups of ep data-parallel ranks

    @property
    def label(self) -> str:
        mode = ("" if self.tp_mode == "1d"
                else f"({self.tp_mode}" + (f" d{self.tp_depth}" if self.tp_depth > 1 else "") + ")")
        s = f"dp{self.dp} tp{self.tp}{mode} pp{self.pp}"
        if self.pp > 1:
            s += f" {self.pp_style} m{self.num_microbatches}"
        if self.ep > 1:
            s += f" ep{self.ep}"
        if self.zero_stage:
            s += f" zero{self.zero_stage}"
        if self.activation_checkpointing:
            s += " ac"
        return s

    def plugin_kwargs(self) -> Dict[str, Any]:
        kw: Dict[str, Any] = {"tp_size": self.tp, "pp_size": self.pp, "zero_stage": self.zero_stage,
                              "activation_checkpointing": self.activation_checkpointing}
        if self.pp > 1:
            kw.update(pp_style=self.pp_style, num_microbatches=self.num_microbatches,
                      num_model_chunks=self.num_model_chunks)
        if self.tp_mode != "1d":
            kw["tp_mode"] = self.tp_mode
        if self.tp_depth > 1:
            kw["tp_depth"] = self.tp_depth
        if self.ep > 1:
            kw["ep_size"] = self.ep
        return kw

    def plugin(self):
        from ...plugins import HybridParallelPlugin

        return HybridParallelPlugin(**self.plugin_kwargs())


def cuts(mode: str, tp: int, depth: int = 1) -> Tuple[int, int]:
    """``(q, nb)``: the grid's hidden cut and batch cut (``q · nb = tp``); 1D: ``(tp, 1)``."""
    if mode == "1d":
        return tp, 1
    from ...tp_nd.grid import factor

    sizes = factor(mode, tp, depth)
    q = sizes["y"] if mode == "3d" else sizes["row"]
    return q, tp // q


def compute_tp(c: Candidate) -> int:
    """The tp size whose shrunk model times this layout's compute (N-d: the hidden cut q)."""
    return c.tp if c.tp_mode == "1d" else cuts(c.tp_mode, c.tp, c.tp_depth)[0]


def microbatches(c: Candidate) -> int:
    """Microbatches per step (1 without a pipeline)."""
    return c.num_microbatches if c.pp > 1 else 1


def model_facts(model_or_config) -> Tuple[Any, int]:
    """(a meta-device model, its number of pipeline units: the contract's ``num_layers()``, a
    Sequential's children, or a transformers model's decoder layers)."""
    from ..memory import _meta_model

    meta, _ = _meta_model(model_or_config)
    if callable(getattr(meta, "num_layers", None)):
        return meta, int(meta.num_layers())
    if _is_hf(meta):
        from ...models.hf.planning import decoder_layers

        return meta, int(decoder_layers(meta) or 1)
    return meta, len(meta)


def build_model(model_or_config):
    """A real model to run: the config's ``build()``, a transformers config's model, or a copy of the
    user's module (never theirs)."""
    import copy

    if callable(getattr(model_or_config, "build", None)):
        return model_or_config.build()
    from ...models.hf.planning import is_hf_config

    if is_hf_config(model_or_config):
        from ...models.hf.planning import build_model as build_hf

        return build_hf(model_or_config)
    return copy.deepcopy(model_or_config)


def vocab_of(model) -> Optional[int]:
    """Token ids the model takes: its config's ``vocab_size`` (ours or transformers')."""
    if _is_hf(model):
        from ...models.hf.planning import vocab_size

        return vocab_size(model)
    return getattr(getattr(model, "cfg", None), "vocab_size", None)


def width_of(model) -> Optional[int]:
    """The activation width the cost model needs: ``cfg.n_embd``, or a transformers model's hidden size."""
    if _is_hf(model):
        from ...models.hf.planning import hidden_width

        return hidden_width(model)
    return getattr(getattr(model, "cfg", None), "n_embd", None)


def can_pipeline(meta) -> bool:
    """Whether the engine cuts this model into pipeline stages (asked of the engine's own rule)."""
    from ...pipeline.stage import num_layers

    try:
        num_layers(meta)
    except TypeError:
        return False
    return True


def can_checkpoint(meta) -> bool:
    """Whether the plugin recomputes this model's layers (asked of the plugins' own check)."""
    from ...models.protocol import check_checkpointing

    try:
        check_checkpointing(meta, "autoplan", layers=False)
    except ValueError:
        return False
    return True


def _is_hf(model) -> bool:
    from ...models.hf import reads_dict_plan

    return reads_dict_plan(model)


def candidates(model_or_config, world_size: int, batch: int, *, schedules: Sequence[str] = SCHEDULES,
               microbatch_factors: Sequence[int] = (1, 2), zero_stages: Sequence[int] = (0, 1),
               activation_checkpointing: Sequence[bool] = (False, True),
               tp_modes: Optional[Sequence[str]] = None) -> List[Candidate]:
    """Every layout of ``world_size`` ranks the model and a global ``batch`` allow.

    ``batch`` is the samples of one step over all data-parallel ranks (each takes ``batch/dp``);
    microbatches are ``f·pp`` for ``f`` in ``microbatch_factors`` (at least one sample each).
    ``tp_modes`` (default: every mode the plugin offers and the model has a plan for: 1D always,
    2D/2.5D/3D with the contract's ``tp_nd_plan()``) where ``tp`` factors into the mode's grid,
    its heads split over the grid's hidden cut and each microbatch's rows over its batch cut."""
    _check_space(world_size, batch, schedules)
    meta, layers = model_facts(model_or_config)
    experts = expert_counts(meta)
    tp_modes = _modes(meta, tp_modes)
    if experts:  # MoE blocks stay whole on every tp rank, which only 1D gives them (plugins/hybrid/experts.py)
        tp_modes = [m for m in tp_modes if m == "1d"]
    pipelines = can_pipeline(meta)
    if not can_checkpoint(meta):
        activation_checkpointing = [ac for ac in activation_checkpointing if not ac]
    out: List[Candidate] = []
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp) if pipelines else [1]:
            dp = world_size // (tp * pp)
            if batch % dp == 0:
                out += _with_ep(_layouts(meta, layers, dp, tp, pp, batch // dp, tp_modes, schedules,
                                         microbatch_factors, zero_stages, activation_checkpointing), experts)
    if not out:
        raise ValueError(f"autoplan: no layout of world_size={world_size} fits this model and batch={batch} "
                         f"({layers} layers); try a batch divisible by the data-parallel sizes "
                         f"{_divisors(world_size)} or another world_size")
    return out


def expert_counts(meta) -> List[int]:
    """Every MoE layer's expert count, as the hybrid plugin finds the layers (empty for a dense model)."""
    from ..memory.experts import moe_layers

    return [layer.n_expert for layer in moe_layers(meta)]


def ep_sizes(experts: Sequence[int], dp: int) -> List[int]:
    """The expert-parallel sizes a layout of ``dp`` data-parallel ranks can take: divisors of ``dp`` and of
    every MoE layer's expert count (what the plugin accepts); ``[1]`` for a dense model."""
    if not experts:
        return [1]
    return [k for k in _divisors(dp) if all(e % k == 0 for e in experts)]


def _with_ep(layouts: List[Candidate], experts: Sequence[int]) -> List[Candidate]:
    """Each layout at every expert-parallel size its dp allows (the same layout, ep = 1, first)."""
    import dataclasses

    return [dataclasses.replace(c, ep=k) for c in layouts for k in ep_sizes(experts, c.dp)]


def _check_space(world_size, batch, schedules) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"autoplan(world_size={world_size!r}): must be an int >= 1")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"autoplan(batch={batch!r}): must be an int >= 1 (samples per step, all ranks)")
    bad = [s for s in schedules if s not in _KNOWN_SCHEDULES]
    if bad:
        raise ValueError(f"autoplan(schedules={list(schedules)!r}): unknown {bad}; use '1f1b', 'gpipe', 'interleaved'")


def _modes(meta, tp_modes: Optional[Sequence[str]]) -> Sequence[str]:
    """The tensor-parallel modes to search: those asked for, checked against what the plugin
    offers; by default every one the plugin offers when the model has ``tp_nd_plan()``, else 1D."""
    supported = _tp_modes_supported()
    if tp_modes is None:
        tp_modes = supported if callable(getattr(meta, "tp_nd_plan", None)) else ("1d",)
    unsupported = [m for m in tp_modes if m not in supported]
    if unsupported:
        raise ValueError(f"autoplan(tp_modes={list(tp_modes)!r}): this HybridParallelPlugin offers {list(supported)}")
    return tp_modes


def _layouts(meta, layers, dp, tp, pp, local, tp_modes, schedules, factors, zero_stages,
             activation_checkpointing) -> List[Candidate]:
    """The layouts of one ``dp × tp × pp`` shape, ``local`` samples per data-parallel rank."""
    from ...pipeline.schedules import validate_schedule

    out = []
    for mode, depth in _grids(tp, tp_modes):
        q, nb = cuts(mode, tp, depth)
        if not _tp_ok(meta, q) or mode != "1d" and not callable(getattr(meta, "tp_nd_plan", None)):
            continue  # the heads split over the hidden cut q (1D: q = tp)
        for style, m in _schedules(pp, layers, local, schedules, factors):
            if (local // m) % nb:  # N-d cuts each microbatch's rows nb ways
                continue
            chunks = 2 if style == "interleaved" else 1
            try:
                validate_schedule(style, pp, chunks, m)
            except ValueError:
                continue
            for z in zero_stages:
                if z == 1 and (dp == 1 or tp > 1):
                    continue
                for ac in activation_checkpointing:
                    out.append(Candidate(dp, tp, pp, style, m, chunks, z, bool(ac), mode, depth))
    return out


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_ok(meta, tp: int) -> bool:
    if tp == 1:
        return True
    if _is_hf(meta):  # its plan (own, or the built-in table), and whole heads on every rank
        from ...models.hf import resolve_plan
        from ...models.hf.plan import check_heads

        try:
            resolve_plan(meta, None, tp)
            check_heads(meta, tp)
        except ValueError:
            return False
        return True
    if not callable(getattr(meta, "tp_plan", None)):
        return False
    check = getattr(meta, "check_tp", None)
    if callable(check):
        try:
            check(tp)
        except ValueError:
            return False
    return True


def _tp_modes_supported() -> Tuple[str, ...]:
    from ...plugins import HybridParallelPlugin

    return ("1d", "2d", "2.5d", "3d") if "tp_mode" in inspect.signature(HybridParallelPlugin).parameters else ("1d",)


def _grids(tp: int, modes: Sequence[str]) -> Iterable[Tuple[str, int]]:
    """``(mode, depth)`` for each mode that ``tp`` ranks can form (2.5D: every depth d > 1 with
    ``tp = q² d``, q > 1; 1D only at tp = 1)."""
    from ...tp_nd.grid import factor

    for mode in modes:
        if mode == "1d":
            yield "1d", 1
        elif tp > 1 and mode == "2.5d":
            for d in range(2, tp + 1):
                if tp % d == 0 and tp // d > 1 and round(math.sqrt(tp // d)) ** 2 == tp // d:
                    yield "2.5d", d
        elif tp > 1 and _mode_fits(mode, tp):
            try:
                factor(mode, tp)
            except ValueError:
                continue
            yield mode, 1


def _mode_fits(mode: str, tp: int) -> bool:
    q2 = round(math.sqrt(tp))
    q3 = round(tp ** (1 / 3))
    if mode == "2d":
        return tp > 1 and q2 * q2 == tp
    if mode == "3d":
        return tp > 1 and q3 ** 3 == tp
    if mode == "2.5d":  # q*q*d with d > 1 and q > 1
        return any(tp % (q * q) == 0 and tp // (q * q) > 1 for q in range(2, tp + 1) if q * q <= tp)
    return True


def _schedules(pp, layers, local, schedules, factors) -> Iterable[Tuple[str, int]]:
    """``(style, microbatches)`` of each schedule a ``pp``-stage pipeline can run on ``local``
    samples (the layers divide into its chunks, the samples into its microbatches)."""
    if pp == 1:
        yield "1f1b", 1
        return
    for style in schedules:
        chunks = 2 if style == "interleaved" else 1
        if layers % (pp * chunks):
            continue
        for f in factors:
            m = f * pp
            if local % m == 0:
                yield style, m
