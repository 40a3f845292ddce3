"""Expert parallelism for transformers' mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, ...).

transformers 5 builds these models' experts as one module per MoE layer holding grouped weights
(``experts.gate_up_proj: [E, 2h, d]``, ``experts.down_proj: [E, d, h]``) whose forward takes
``(hidden_states (N, d), top_k_index (N, k), top_k_weights (N, k))`` with expert ids local to the module,
and ships an expert-parallel plan beside the tensor-parallel one (``config.base_model_ep_plan``):
``"grouped_gemm"`` on each grouped weight (rows = experts, sharded over EP) and ``"ep_dispatch_experts"``
on the experts module (its tokens reach the experts' ranks). We read that plan rather than re-type it,
and run it with our own pieces: the weights keep rows ``[e·E/ep, (e+1)·E/ep)`` as plain parameters (so the
plugin's expert gradient sync, clipping, ZeRO-1 split, ZeRO-2 units (:func:`split_modules`) and
``full_state_dict`` treat them as our GPT's, and
the gathered state dict has transformers' names and shapes), and the experts module's forward sends each
(token, expert) pair to the expert's rank through :class:`...moe.ExpertParallel` (the counted all-to-alls of
``engine/moe/parallel.py``), runs the module's own forward there on the arrived rows (local expert ids,
unit weights: whichever ``experts_implementation`` the config chose) and mixes the returned outputs by the
routing weights on the sending rank. That is transformers' ``AllToAllEP`` (``distributed/expert_parallel.py``)
with our counted collectives and groups cut from dp instead of its DeviceMesh and
``all_to_all_single_autograd``. The router (``mlp.gate``), shared experts and attention stay replicated.
Under 1D tensor parallelism the model's tp plan loses its expert entries (:func:`whole_experts`): the experts
stay whole on every tp rank, as our GPT's MoE blocks do. Checkpoints go through :func:`checkpoint_view`.
"""

from __future__ import annotations

import fnmatch
import weakref
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from ...moe.layer import counting
from .plan import _prefixed

#: transformers' expert-parallel style names this module runs (``config.base_model_ep_plan``)
WEIGHTS, DISPATCH = "grouped_gemm", "ep_dispatch_experts"


def _is_hf(module: nn.Module) -> bool:
    from . import is_hf_model

    return is_hf_model(module)


def ep_plan(model: nn.Module) -> Dict[str, str]:
    """Every transformers model inside ``model`` (itself, or a peft wrapper's base model): its
    ``base_model_ep_plan`` under the names ``model``'s ``named_modules`` gives (pattern -> style)."""
    plan: Dict[str, str] = {}
    for prefix, m in model.named_modules():
        own = getattr(getattr(m, "config", None), "base_model_ep_plan", None) if _is_hf(m) else None
        for k, v in _prefixed(m, own).items():
            plan[f"{prefix}.{k}" if prefix else k] = v
    return plan


def _matches(pattern: str, names: List[str]) -> List[str]:
    """Names matching ``pattern`` where each ``*`` is one dotted part (as transformers' plans mean it)."""
    return [n for n in names if n.count(".") == pattern.count(".") and fnmatch.fnmatchcase(n, pattern)]


def expert_modules(model: nn.Module, strict: bool = False) -> List[Tuple[str, nn.Module, List[str]]]:
    """``(module name, experts module, its grouped weights' attribute names)`` for every MoE layer the
    model's ep plan names. A style we do not run raises, naming it, when ``strict`` (the plugin splits the
    experts: ``ep_size > 1``); otherwise it is passed over (the model runs its own experts, as without a plan)."""
    plan = ep_plan(model)
    if not plan:  # not a transformers MoE family
        return []
    mods = dict(model.named_modules())
    params = [n for n, _ in model.named_parameters()]
    out, weights = [], {}
    for pattern, style in plan.items():
        if style == WEIGHTS:
            for n in _matches(pattern, params):
                owner, _, attr = n.rpartition(".")
                weights.setdefault(owner, []).append(attr)
        elif style != DISPATCH and strict:
            raise ValueError(f"expert parallelism: {type(model).__name__}'s ep plan entry {pattern!r} has style "
                             f"{style!r}; colossal-lab runs {WEIGHTS!r} and {DISPATCH!r} so far (issue 31)")
    for pattern, style in plan.items():
        if style == DISPATCH:
            for n in _matches(pattern, list(mods)):
                out.append((n, mods[n], sorted(weights.get(n, []))))
    return sorted(out, key=lambda t: t[0])


def n_experts(module: nn.Module, attrs: List[str]) -> int:
    """The experts of one module: its grouped weights' first dimension."""
    return getattr(module, attrs[0]).shape[0] if attrs else getattr(module, "num_experts")


def check(model: nn.Module, plugin) -> List[Tuple[str, int]]:
    """``[(experts module, its expert count)]`` of a transformers MoE model (empty for any other model),
    refusing what does not run yet, before any process group exists."""
    check_aux_loss(model, plugin)
    ep, tp = plugin.ep_size, plugin.tp_size
    if ep > 1:
        layers = split_layers(model, ep, "HybridParallelPlugin")
    else:  # the model runs its own experts: a plan style not run here is passed over
        layers = [(name, n_experts(mod, attrs)) for name, mod, attrs in expert_modules(model)]
    if not layers:
        return []
    if tp > 1 and plugin.tp_mode != "1d":
        raise ValueError(f"HybridParallelPlugin(tp_size={tp}, tp_mode={plugin.tp_mode!r}): {type(model).__name__}'s "
                         "experts stay whole on every tp rank, which only 1D tensor parallelism gives them so far; "
                         "use tp_mode='1d'")
    if tp > 1 and plugin.sequence_parallel:
        check_sequence_parallel(model, plugin)
    return layers


def split_layers(model: nn.Module, ep: int, who: str) -> List[Tuple[str, int]]:
    """``[(experts module, its expert count)]`` that ``ep_size=ep`` splits over EP ranks, refusing (``who``: the
    plugin, named in the message) an ep plan style not run here, an experts module with no grouped weights to
    split (peft's LoRA adapters on them) and expert counts ``ep`` does not divide. Both plugins ask it."""
    try:
        found = expert_modules(model, strict=True)
    except ValueError as exc:  # an ep plan style not run here
        raise ValueError(f"{who}(ep_size={ep}): {exc}; or set ep_size=1") from None
    out = []
    for name, mod, attrs in found:
        if not attrs and hasattr(mod, "base_layer"):  # peft's ParamWrapper around the experts
            raise ValueError(f"{who}(ep_size={ep}): {name} ({type(mod).__name__}) carries LoRA adapters on the grouped "
                             "expert weights (peft target_parameters), which are not split over EP yet; target the "
                             "attention (target_modules=['q_proj', 'v_proj', ...]) or set ep_size=1")
        if not attrs:
            raise ValueError(f"{who}(ep_size={ep}): {name} ({type(mod).__name__}) has no {WEIGHTS!r} weights in its "
                             "model's ep plan to split; set ep_size=1")
        n = n_experts(mod, attrs)
        if n % ep:
            ok = [d for d in range(1, n + 1) if n % d == 0]
            raise ValueError(f"{who}(ep_size={ep}): {n} experts ({name}) do not divide over {ep} ranks; use an "
                             f"ep_size in {ok}")
        out.append((name, n))
    return out


def check_sequence_parallel(model: nn.Module, plugin) -> None:
    """Under sequence parallelism an MoE block runs on this rank's shard of the tokens, as a norm does
    (:mod:`.sequence`): right only while it is a per-token function of whole weights. Refused, naming what
    works: expert parallelism beside it (not built with it yet), per-batch capacity (token dropping) and
    router statistics (``output_router_logits``: the aux loss would be taken over each shard's tokens)."""
    where = f"HybridParallelPlugin(tp_size={plugin.tp_size}, sequence_parallel=True"
    if plugin.ep_size > 1:
        raise ValueError(f"{where}, ep_size={plugin.ep_size}): {type(model).__name__}'s experts under expert "
                         "parallelism do not run beside sequence parallelism yet; use ep_size=1 (the experts whole "
                         "on every tp rank, each rank routing its own tokens) or sequence_parallel=False")
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    for field in ("expert_capacity", "capacity_factor", "moe_capacity_factor"):
        if getattr(config, field, None):
            raise ValueError(f"{where}): {type(model).__name__} drops tokens beyond an expert's capacity "
                             f"(config.{field}={getattr(config, field)!r}), which counts over the whole batch, not "
                             f"per token; set config.{field}=None (dropless) or sequence_parallel=False")
    if getattr(config, "output_router_logits", False):
        raise ValueError(f"{where}): {type(model).__name__}'s router aux loss (config.output_router_logits=True) "
                         "would be taken over each rank's shard of the tokens, not the whole batch; set "
                         "output_router_logits=False or sequence_parallel=False")


def check_aux_loss(model: nn.Module, plugin) -> None:
    """The families' own load-balancing loss (``config.output_router_logits=True``: transformers'
    ``load_balancing_loss_func`` over the router logits of every layer, weighted by ``router_aux_loss_coef``) runs
    inside the task model's forward, on the rows it is given: under dp / ep / tp each rank adds it over its own
    tokens, and the gradients' mean over dp is that of one process averaging it over the same split of the batch
    (docs/moe.md). A pipeline's last stage holds only its own layers' router logits and computes the LM loss alone
    (``models/hf/loss.py``): the aux loss would be silently dropped, so ``pp_size > 1`` refuses it, before any group."""
    cfg = getattr(model, "config", None)
    pp = getattr(plugin, "pp_size", 1)
    if pp > 1 and getattr(cfg, "output_router_logits", False) is True:
        raise ValueError(f"HybridParallelPlugin(pp_size={pp}): {type(model).__name__} has "
                         "config.output_router_logits=True, whose load-balancing loss (router_aux_loss_coef="
                         f"{getattr(cfg, 'router_aux_loss_coef', None)}) needs the router logits of every layer, "
                         "while a pipeline's last stage holds only its own layers' and computes the LM loss alone; "
                         "set config.output_router_logits=False under pp_size > 1, or use pp_size=1 (dp, ep_size, "
                         "tp_size and ZeRO add it over each dp rank's tokens)")


def whole_experts(model: nn.Module, plan: dict) -> dict:
    """The model's own tensor-parallel plan without its entries at or under an experts module (transformers'
    ``moe_tp_experts``, ``packed_colwise`` on the grouped weights): under tp the experts stay whole on every tp
    rank and take the replicated residual stream (after the row-parallel ``o_proj``) as a norm does; the
    router is in no plan. The same layout as our GPT's MoE blocks under tp (docs/moe.md)."""
    experts = [p for p, style in ep_plan(model).items() if style == DISPATCH]
    if not experts:
        return plan
    return {k: v for k, v in plan.items() if not any(k == e or k.startswith(e + ".") for e in experts)}


def shard(model: nn.Module, handle) -> Iterator[Tuple[str, nn.Parameter]]:
    """Cut every experts module's grouped weights to this EP rank's rows and route its forward through
    ``handle`` (an :class:`...moe.ExpertParallel`); yields each new parameter with its name in ``model``."""
    for name, mod, attrs in expert_modules(model):
        E = n_experts(mod, attrs)
        lo, hi = handle.local_experts(E)
        for attr in attrs:
            full = getattr(mod, attr)
            p = nn.Parameter(full.detach()[lo:hi].clone(), requires_grad=full.requires_grad)
            setattr(mod, attr, p)
            yield f"{name}.{attr}", p
        if hasattr(mod, "num_experts"):
            mod.num_experts = hi - lo  # what its own forward indexes (local ids)
        mod.forward = _ExpertParallelForward(mod, handle, E)


class _ExpertParallelForward:
    """The experts module's forward over an EP group: ``(hidden (N, d), top_k_index (N, k) global ids,
    top_k_weights (N, k)) -> (N, d)``, as the unsplit module computes it. ``tokens_per_expert`` holds the
    last call's assignments from this rank to each global expert; ``step_load`` adds them up over a step's
    training forwards (an activation checkpoint's recompute not counted), for ``moe.take_load``."""

    def __init__(self, module: nn.Module, handle, n_expert: int):
        self.local_forward, self.handle, self.n_expert = module.forward, handle, n_expert
        self.module = weakref.ref(module)  # its ``training`` flag (a strong reference would be a cycle)
        self.tokens_per_expert: Tuple[int, ...] = ()
        self.step_load: Optional[List[int]] = None
        self.step_dropped = 0  # dropless: always 0 (MoE's field, for the same event)

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)  # (N·k,) assignment a = token a // k, choice a % k
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, token order within one
        counts = torch.bincount(flat, minlength=self.n_expert)
        self.tokens_per_expert = tuple(counts.tolist())
        # a step's training forwards only: not a checkpoint's recompute, not a pipeline's shape inference
        if self.module().training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1 \
                and counting():
            load = self.step_load or [0] * self.n_expert
            self.step_load = [a + b for a, b in zip(load, self.tokens_per_expert)]
        token = order // k
        local, local_counts, state = self.handle.dispatch(hidden_states[token], counts)
        per = local_counts.numel()
        ids = torch.repeat_interleave(torch.arange(per, device=local.device), local_counts).unsqueeze(1)
        if local.shape[0]:  # each arrived row through its one expert, weight 1 (the weights apply at home)
            y = self.local_forward(local, ids, torch.ones_like(ids, dtype=local.dtype))
        else:  # no row for any of this rank's experts: a zero-row result still connected to backward, so the
            # grouped weights get a (zero) gradient and the reverse all-to-all runs as on every other rank
            y = self.local_forward(local.sum(0, keepdim=True), ids.new_zeros((1, 1)),
                                   local.new_ones((1, 1)))[:0]
        ys = self.handle.combine(y, state)  # (N·k, d) in ``order``
        w = top_k_weights.reshape(-1)[order].unsqueeze(1).to(ys.dtype)
        out = torch.zeros_like(hidden_states).index_add(0, token, (ys * w).to(hidden_states.dtype))
        return out


def split_modules(model: nn.Module) -> Iterator[Tuple[str, nn.Module, List[nn.Parameter]]]:
    """Every experts module :func:`shard` cut to this EP rank's rows: ``(name, module, its grouped weights)``.
    ZeRO-2 shards each such module apart, over the expert-dp group (plugins/hybrid/zero2.py)."""
    for name, mod, attrs in expert_modules(model):
        if isinstance(mod.forward, _ExpertParallelForward):
            yield name, mod, [getattr(mod, a) for a in attrs]


def load_counters(model: nn.Module) -> Iterator[Tuple[str, "_ExpertParallelForward"]]:
    """Per MoE layer under expert parallelism: its name (the block holding the experts, as an ``ExpertLoad``
    names it) and the counter of its routed tokens."""
    for name, mod, _ in expert_modules(model):
        if isinstance(mod.forward, _ExpertParallelForward):
            yield name.rpartition(".")[0], mod.forward


def tokens_per_expert(model: nn.Module) -> Dict[str, Tuple[int, ...]]:
    """Per experts module under expert parallelism: the last forward's assignments from this rank to each
    global expert (what the router chose, before any all-to-all)."""
    return {name: mod.forward.tokens_per_expert for name, mod, _ in expert_modules(model)
            if isinstance(mod.forward, _ExpertParallelForward)}


def checkpoint_view(hf: nn.Module, experts):
    """``checkpoint_io``'s view of ``hf`` whose grouped expert weights hold this EP rank's rows (``experts``:
    the plugin's ``ExpertGroups``): every expert weight listed whole, gathered over the EP group to save, and
    read back as this rank's rows only (``get_slice``), so ``save_model`` writes transformers' names and shapes
    and ``load_model`` loads any file at any ep_size."""
    from ...checkpoint_io.hf_layout import ModuleView

    class ExpertView(ModuleView):
        def entries(self):
            return [(n, experts.full_shape(t) if n in experts.names else tuple(t.shape), t.dtype)
                    for n, t in self.tensors.items()]

        def iter_full(self, keep):
            for n, t in super().iter_full(keep):  # every rank walks the same names: the gathers pair up
                yield n, experts.full(t).detach() if n in experts.names else t

        @torch.no_grad()
        def load(self, reader, source, done):
            mine = {n: t for n, t in self.tensors.items() if n in experts.names and n in source}
            self.tensors = {n: t for n, t in self.tensors.items() if n not in mine}
            try:
                super().load(reader, source, done)
            finally:
                self.tensors = {**self.tensors, **mine}
            for n, t in mine.items():  # rows [lo, hi) of the whole grouped weight: this rank's experts
                lo, hi = experts.rows(t)
                t.copy_(reader.read_runs(source[n], [[(lo, hi)]] + [[(0, s)] for s in t.shape[1:]]).to(t.dtype))

    return ExpertView(hf)
