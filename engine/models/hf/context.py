"""Context parallelism (ring / Ulysses) for a transformers decoder, through its attention-function registry.

Each of the ``cp`` ranks holds a shard of every sequence (zig-zag for the ring, contiguous for Ulysses,
:mod:`...context_parallel`); only attention needs the whole sequence. transformers dispatches every
attention of a model that declares ``_supports_attention_backend`` through ``AttentionInterface`` by
``config._attn_implementation``: :func:`enable_context_parallel` registers one attention function per
handle there (a closure over the :class:`ContextParallel` handle) and points the model at it with
``model.set_attn_implementation``, so the model's own projections, rotary embedding, norms and head run
unchanged on the shard. What the model must see of the shard, :func:`shard_inputs` gives it before the
forward (a direct call of the boosted model):

* ``position_ids``: the shard's *global* positions, so the model's own rotary tables (or learned
  position embeddings) take the right angles (a model that counts positions from its token ids, RoBERTa's
  family, has them counted on the whole sequence by its own embeddings' function first);
* ``shift_labels``: the labels shifted on the whole sequence, then sharded (``ForCausalLMLoss`` would
  otherwise shift inside the shard, pairing each chunk's last token with the wrong target), and
  ``num_items_in_batch``: the global count of target tokens divided by ``cp``, so a rank's loss is its
  share of the batch sum and the mean over the cp group (how the plugin averages gradients) is the
  batch mean even when the ranks hold unequal numbers of targets (the last position has none);
* no ``attention_mask``: the attention function is causal by itself (zig-zag shards make a mask built
  from the local length wrong), and transformers builds no mask for an implementation absent from
  its mask registry; a padding mask (zeros) is refused.

Under ``booster.execute_pipeline`` (with or without pipeline stages) :func:`shard_pipeline_batch` cuts the
batch the same way before the schedule splits it into microbatches: the first stage takes the shard's
``input_ids``, every stage its global ``position_ids`` (a carried per-token input, :mod:`.inputs`), so each
stage's own rotary embedding (or learned positions) takes the shard's angles, and the last stage's criterion
its ``shift_labels``; the model's own loss divides by the batch's target count over microbatches and ``cp``
(the same share as above). Stages hand on ``(B, T/cp, C)``: the p2p buffers are the rank's shard.

Refused before any work, naming the option: a model outside the registry, non-causal attention
(encoders), token mixing outside attention (a causal ``nn.Conv1d``: state-space and linear-attention layers; a
``config.layer_types`` naming linear, hybrid, convolution or indexed-sparse layers),
attention dropout, a sliding window shorter than the sequence, a cache (generation), an attention that adds a mask
it computes from its values to its scores (``prepare_dynamic_mask``: the ring drops the mask it is handed), and
Ulysses heads that do not divide over tp_size * cp_size.
Attention sinks (``s_aux``: GPT-OSS, one logit per head of the module) and logit soft-capping (``softcap``: Gemma 2)
go to the ring / Ulysses functions, which apply them (:mod:`...context_parallel`'s docstring; a soft-capped block
takes the fp32 reference attention, O(T^2) memory per block). Under tp the sink vector must be one logit per query
head the rank holds (GPT-OSS's plan leaves its attention whole, so it is the whole vector); one that is not is
refused at the forward.
transformers is imported only inside the functions that need it (an HF model exists).
"""

from __future__ import annotations

import inspect
import itertools
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .plan import head_counts

_NAMES = itertools.count()
_DROPOUT = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def _var_keyword(model: nn.Module) -> Optional[str]:
    """The name of ``model.forward``'s ``**kwargs`` (None without one)."""
    return next((p.name for p in inspect.signature(model.forward).parameters.values()
                 if p.kind is inspect.Parameter.VAR_KEYWORD), None)


def _where(plugin) -> str:
    return f"HybridParallelPlugin(cp_size={plugin.cp_size}, cp_mode={plugin.cp_mode!r})"


#: words in a ``config.layer_types`` entry that mark a layer whose token mixing ring / Ulysses cannot reach:
#: "linear_attention" (MiniMax, Jamba, ...), "hybrid" / "hybrid_sliding" (Zamba, Falcon-H1), "conv" (LFM),
#: "indexed_attention" (DeepSeek-V3.2's sparse indexer), "compressed_sparse_attention" (DeepSeek-V4)
_NOT_ATTENTION = ("linear", "hybrid", "conv", "mamba", "indexed", "compressed")


def _layer_types(cfg) -> list:
    """``layer_types`` of the config and of its text config (composite models), as strings."""
    out = []
    for c in (cfg, getattr(cfg, "text_config", None)):
        types = getattr(c, "layer_types", None) if c is not None else None
        out += [str(t) for t in types or ()]
    return out


def dispatches_attention(model: nn.Module) -> bool:
    """Whether every attention of ``model`` goes through transformers' ``AttentionInterface``: the class says so
    (``_supports_attention_backend``), or, for a family that dispatches without declaring it (StableLM, BioGPT),
    every innermost module class named ``...Attention`` calls the registry in its forward (the source test
    transformers' own ``_can_set_attn_implementation`` makes, per class rather than per file)."""
    if getattr(model, "_supports_attention_backend", False):
        return True
    kinds = {type(m) for m in model.modules() if "Attention" in type(m).__name__
             and not any("Attention" in type(c).__name__ for c in m.modules() if c is not m)}
    try:
        return bool(kinds) and all("ALL_ATTENTION_FUNCTIONS" in inspect.getsource(k.forward) for k in kinds)
    except (OSError, TypeError):
        return False


def check_context_parallel(model: nn.Module, plugin) -> None:
    """Everything ring / Ulysses attention needs of an HF model, before any process group exists."""
    where, cp, tp = _where(plugin), plugin.cp_size, plugin.tp_size
    name = type(model).__name__
    if not dispatches_attention(model):
        raise ValueError(f"{where}: {name} does not dispatch its attention through transformers' "
                         "AttentionInterface (_supports_attention_backend is False), which is how context "
                         "parallelism reaches its attention; set cp_size=1")
    cfg = model.config
    if getattr(cfg, "is_encoder_decoder", False):
        raise ValueError(f"{where}: {name} is an encoder-decoder model; context parallelism runs decoder-only "
                         "(causal) models; set cp_size=1")
    non_causal = sorted({type(m).__name__ for m in model.modules() if getattr(m, "is_causal", None) is False})
    if non_causal:
        raise ValueError(f"{where}: {name}'s attention is not causal ({non_causal} have is_causal=False, e.g. an "
                         "encoder such as BERT); the ring and Ulysses here run causal decoder attention only; "
                         "set cp_size=1")
    mixers = sorted({type(m).__name__ for m in model.modules()
                     if any(isinstance(c, nn.Conv1d) for c in m.children())})
    if mixers:
        raise ValueError(f"{where}: {name} mixes tokens outside attention ({mixers} hold a causal convolution: "
                         "state-space or linear-attention layers), which would run on each rank's shard alone; "
                         "ring / Ulysses reach attention only; set cp_size=1")
    others = sorted({t for t in _layer_types(cfg) if any(w in t for w in _NOT_ATTENTION)})
    if others:
        raise ValueError(f"{where}: {name}'s config.layer_types names {others}: layers that mix tokens other than "
                         "through the attention function (linear attention, state-space or convolution mixers, or a "
                         "sparse indexer choosing keys over the whole sequence), which would run on each rank's shard "
                         "alone; ring / Ulysses reach attention only; set cp_size=1")
    for key in _DROPOUT:
        if float(getattr(cfg, key, 0.0) or 0.0) > 0:
            raise ValueError(f"{where}: config.{key}={getattr(cfg, key)} (attention dropout) is not applied by "
                             f"ring / Ulysses attention; set config.{key}=0.0 or cp_size=1")
    dynamic = sorted({type(m).__name__ for m in model.modules() if callable(getattr(m, "prepare_dynamic_mask", None))})
    if dynamic:
        raise ValueError(f"{where}: {name}'s attention adds a mask it computes from its values to the scores "
                         f"({dynamic} prepare_dynamic_mask: a learned bias per key), which ring / Ulysses attention "
                         "does not apply; set cp_size=1")
    if _var_keyword(model) is None:
        raise ValueError(f"{where}: {name}.forward takes no **kwargs, so the shard's shift_labels and "
                         "num_items_in_batch cannot reach its loss; set cp_size=1")
    heads, _ = head_counts(model)
    if plugin.cp_mode == "ulysses" and heads is not None and heads % (tp * cp):
        ok = [n for n in range(1, heads + 1) if heads % (tp * n) == 0]
        raise ValueError(f"{where}, tp_size={tp}: Ulysses gives each rank whole attention heads, but {name} has "
                         f"{heads} heads and tp_size * cp_size = {tp * cp} does not divide them; use cp_size in "
                         f"{ok} or cp_mode='ring'")


def _refuse(handle, what: str) -> None:
    raise ValueError(f"HybridParallelPlugin(cp_size={handle.size}, cp_mode={handle.mode!r}): {what}")


def _attention_function(handle):
    """transformers' attention contract: ``(module, query (B, H, T/cp, D), key/value (B, H_kv, T/cp, D),
    attention_mask, scaling=, dropout=, sliding_window=, softcap=, **kwargs) -> ((B, T/cp, H, D), None)``,
    computed over the whole sequence by ``handle`` (ring or Ulysses over the cp group)."""
    def attention(module, query, key, value, attention_mask, scaling: Optional[float] = None, dropout: float = 0.0,
                  sliding_window: Optional[int] = None, softcap: Optional[float] = None, **kwargs):
        whole = query.shape[2] * handle.size
        if dropout:
            _refuse(handle, f"attention dropout={dropout} is not applied by ring / Ulysses attention; set the "
                            "config's attention dropout to 0.0")
        sinks = kwargs.get("s_aux")
        if sinks is not None:
            sinks = sinks.to_local() if hasattr(sinks, "to_local") else sinks
            if tuple(sinks.shape) != (query.shape[1],):
                _refuse(handle, f"{type(module).__name__}'s attention sinks (s_aux) have shape {tuple(sinks.shape)}, "
                                f"not one logit per query head ({query.shape[1]}) of this rank; leave the attention's "
                                "heads whole under tensor parallelism (tp_plan) or set cp_size=1")
        if sliding_window is not None and sliding_window < whole:
            _refuse(handle, f"sliding_window={sliding_window} is shorter than the sequence ({whole} tokens) and is "
                            "not applied by ring / Ulysses attention; use sequences of at most sliding_window tokens")
        causal = kwargs.get("is_causal")
        if not (getattr(module, "is_causal", True) if causal is None else causal):
            _refuse(handle, f"{type(module).__name__} is not causal; ring / Ulysses here run causal attention only")
        if key.shape[1] != query.shape[1]:  # grouped-query attention: every query head its key/value head
            rep = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        out = handle(query, key, value, causal=True, scale=scaling, sinks=sinks, softcap=softcap)  # (B, H, T/cp, D)
        return out.transpose(1, 2), None
    return attention


def enable_context_parallel(model: nn.Module, group, mode: str) -> nn.Module:
    """Route every attention of ``model`` through ring / Ulysses over ``group``: one function registered in
    transformers' ``AttentionInterface`` (a name of its own per call) and set as the model's implementation."""
    from transformers import AttentionInterface

    from ...context_parallel import ContextParallel

    handle = ContextParallel(group, mode)
    name = f"colossal_lab_cp_{mode}_{next(_NAMES)}"
    AttentionInterface.register(name, _attention_function(handle))
    model.set_attn_implementation(name)
    model._colossal_cp = handle  # a deep copy shares it (ContextParallel.__deepcopy__)
    return model


def _counted_positions(model: nn.Module, ids: torch.Tensor) -> Optional[torch.Tensor]:
    """``(B, T)`` positions a model counts from its token ids where none are given (RoBERTa's family, by its
    embeddings' own ``create_position_ids_from_input_ids``: real tokens from ``padding_idx + 1``), on the whole
    sequence, so the shards take the unsplit model's; None for a model whose positions are ``0 .. T-1``."""
    for m in model.modules():
        count = getattr(m, "create_position_ids_from_input_ids", None)
        if callable(count) and getattr(m, "padding_idx", None) is not None:
            return count(ids, m.padding_idx)
    return None


def shard_inputs(model: nn.Module, args: tuple, kwargs: dict, group, mode: str) -> dict:
    """The keyword arguments of a direct forward on this rank's shard (see the module docstring): every
    ``(B, T, ...)`` input cut along T, global ``position_ids``, shifted and sharded labels; ``ValueError``
    (before any communication) for a padding mask, a cache, or a length that does not cut."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    where = f"HybridParallelPlugin(cp_size={n}, cp_mode={mode!r})"
    bound, var = inspect.signature(model.forward).bind_partial(*args, **kwargs), _var_keyword(model)
    kw = {k: v for k, v in bound.arguments.items() if k != var}
    kw.update(bound.arguments.get(var, {}))
    ids = kw.get("input_ids") if kw.get("input_ids") is not None else kw.get("inputs_embeds")
    if ids is None:
        raise ValueError(f"{where}: the forward needs input_ids (or inputs_embeds) to cut into sequence shards")
    if kw.get("past_key_values") is not None:
        raise ValueError(f"{where}: past_key_values (a cache, generation) is not run under context parallelism; "
                         "generate with the plain model")
    if "use_cache" in inspect.signature(model.forward).parameters:
        kw["use_cache"] = False
    return _cut(kw, ids, r, n, mode, where, model)


def shard_pipeline_batch(batch: dict, group, mode: str, input_key: str, num_microbatches: int,
                         model: Optional[nn.Module] = None) -> tuple:
    """``(batch, items)``: ``execute_pipeline``'s HF batch on this rank's shard, as :func:`shard_inputs` cuts
    a direct call's (every ``(B, T, ...)`` entry cut along T, global ``position_ids``, ``shift_labels``; no
    ``attention_mask``), and the ``num_items_in_batch`` each microbatch's own loss divides by: the batch's
    target count over ``num_microbatches * cp``, so the schedule's mean over microbatches, averaged over the
    cp group, is the batch mean. Every rank checks the same whole batch, so a refusal is raised alike
    everywhere, before the schedule's first send. ``model``: this rank's (first) stage, where a model that counts
    positions from its token ids has the embeddings that count them."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    where = f"HybridParallelPlugin(cp_size={n}, cp_mode={mode!r})"
    kw = _cut(dict(batch), batch[input_key], r, n, mode, where, model)
    count = kw.pop("num_items_in_batch", None)
    return kw, (count / num_microbatches if count else None)


def _cut(kw: dict, ids: torch.Tensor, r: int, n: int, mode: str, where: str,
         model: Optional[nn.Module] = None) -> dict:
    """``kw`` (a forward's keyword arguments, or a batch) on rank ``r``'s shard of ``n`` (module docstring);
    ``model``: the module whose embeddings may count positions from the token ids."""
    from ...context_parallel import _check_len, positions, shard_sequence

    B, T = ids.shape[:2]
    try:
        _check_len(T, n, mode, where)
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    mask = kw.pop("attention_mask", None)
    if isinstance(mask, torch.Tensor) and not bool(mask.all()):
        raise ValueError(f"{where}: attention_mask masks padding, which ring / Ulysses attention does not apply "
                         "(each rank attends causally over the whole sequence); pack sequences without padding")
    labels = kw.get("labels")
    if labels is not None:
        shifted = kw.get("shift_labels")
        if shifted is None:  # what ForCausalLMLoss does, on the whole sequence
            shifted = torch.nn.functional.pad(labels[..., 1:], (0, 1), value=-100)
        count = kw.get("num_items_in_batch")
        count = (shifted != -100).sum().item() if count is None else count
        kw["shift_labels"], kw["num_items_in_batch"] = shifted, count / n
    pos = kw.pop("position_ids", None)  # the user's (B or 1, T) positions, those the model counts, or 0..T-1
    if pos is None and model is not None and kw.get("input_ids") is not None:
        pos = _counted_positions(model, kw["input_ids"])
    for k, v in list(kw.items()):
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[:2] == (B, T):
            kw[k] = shard_sequence(v, r, n, mode, dim=1).contiguous()  # (HF views labels flat)
    kw["position_ids"] = (positions(T, r, n, mode, device=ids.device).unsqueeze(0) if pos is None
                          else shard_sequence(pos, r, n, mode, dim=pos.dim() - 1))
    return kw
