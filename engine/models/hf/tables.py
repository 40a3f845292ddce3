"""Built-in tensor-parallel plans for transformers families that ship none, in one place.

Keyed by ``config.model_type``; names are the base model's (as transformers' ``base_model_tp_plan``),
and a head's entries (``lm_head``) are the task model's own. ``per_rank`` names the attributes of a
module that count heads or widths and must hold one rank's share once its linears are sharded (a
forward that reshapes with ``-1`` needs none); ``alibi`` names the attention modules whose ALiBi bias is
sliced to the rank's heads (:mod:`.alibi`), and ``head_bias`` the modules handed another per-head bias (pattern
-> argument name). Values are style names (:mod:`.styles`) or
``(name, options)``. ``pp`` is the pipeline layout transformers' ``base_model_pp_plan`` gives other
families: the modules before the layer list (``pre``) and after it (``post``), each with what a stage that
does not own it runs instead (:mod:`.pipeline`), and the task head (``head``); families with neither a
``base_model_pp_plan`` nor a ``pp`` entry get a layout read from their module tree (:mod:`.derive`).
``divides`` names config sizes a tp cut must divide besides the heads (Mamba's
``intermediate_size``: :func:`.mamba.check_mixers`).
``refuse_tp`` names why a family's blocks cannot be cut by a 1-D plan at all (the error says it), ``refuse_sp`` why
its residual stream cannot be cut for sequence parallelism;
``refuse_if`` maps a config flag to what it switches on that the entry's plan cannot cut (or to ``(what, other
flag)``: unless that other flag is set too).

An entry ``{"like": other, ...}`` is ``other``'s with its own keys on top. An entry marked ``by_structure`` also
serves every family whose base model has a linear for each of its ``base`` patterns and no entry of its own
(BERT's serves RoBERTa, CamemBERT, XLM-R, ELECTRA, ERNIE, ...: the same ``encoder.layer.*.attention.self.query``
blocks in each family's copy of BERT's classes); :func:`table_for` is the one lookup.
"""

from __future__ import annotations


def _opt_blocks(layers: str) -> dict:
    """OPT's block layout (OPT, XGLM, BioGPT): q/k/v column-parallel, out_proj row-parallel, fc1 then fc2."""
    attn = {f"{layers}.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")}
    return {**attn, f"{layers}.*.self_attn.out_proj": "rowwise", f"{layers}.*.fc1": "colwise",
            f"{layers}.*.fc2": "rowwise"}


TABLES = {
    # GPT-2's Conv1D weights are (in, out); c_attn packs q | k | v in its output, each sharded alike
    "gpt2": {
        "base": {
            "wte": "embedding_rowwise",
            "h.*.attn.c_attn": ("packed_colwise", {"parts": 3}),
            "h.*.attn.c_proj": "rowwise",
            "h.*.mlp.c_fc": "colwise",
            "h.*.mlp.c_proj": "rowwise",
        },
        "head": {"lm_head": "colwise_gather_output"},
        # GPT2Attention splits c_attn's output into q, k, v by split_size (the hidden width)
        "per_rank": {"h.*.attn": ("split_size", "num_heads")},
        # position embeddings and the dropout run once, on the first stage (the stages' forward: pipeline.py)
        "pp": {"pre": {"wte": "none", "wpe": "zeros", "drop": "identity"}, "layers": "h",
               "post": {"ln_f": "identity"}, "head": ["lm_head"]},
    },
    # OPT: nn.Linear projections; its attention reshapes by num_heads; the head is tied to embed_tokens
    "opt": {
        "base": {"decoder.embed_tokens": "embedding_rowwise", **_opt_blocks("decoder.layers")},
        "head": {"lm_head": "colwise_gather_output"},
        "per_rank": {"decoder.layers.*.self_attn": ("num_heads",)},
        "pp": {"pre": {"decoder.embed_tokens": "none", "decoder.embed_positions": "zeros",
                       "decoder.project_in": "none"},
               "layers": "decoder.layers",
               "post": {"decoder.final_layer_norm": "none", "decoder.project_out": "none"}, "head": ["lm_head"]},
    },
    # BLOOM: query_key_value packs each head's q, k, v together ((heads, 3, head_dim) outputs), so a
    # contiguous cut by output features gives a rank whole heads; ALiBi's per-head bias is sliced to them
    "bloom": {
        "base": {
            "word_embeddings": "embedding_rowwise",
            "h.*.self_attention.query_key_value": "colwise",
            "h.*.self_attention.dense": "rowwise",
            "h.*.mlp.dense_h_to_4h": "colwise",
            "h.*.mlp.dense_4h_to_h": "rowwise",
        },
        "head": {"lm_head": "colwise_gather_output"},
        "per_rank": {"h.*.self_attention": ("num_heads",)},
        "alibi": ("h.*.self_attention",),
    },
    # BERT and, by structure, its copies: the encoder only (its attention reshapes with -1); embeddings and task
    # heads stay whole, as the MLM head ties both the decoder's weight and its bias. Its pipeline layout is read
    # from the module tree (derive.py): embeddings block, encoder.layer, pooler
    "bert": {
        "by_structure": True,
        "base": {
            "encoder.layer.*.attention.self.query": "colwise",
            "encoder.layer.*.attention.self.key": "colwise",
            "encoder.layer.*.attention.self.value": "colwise",
            "encoder.layer.*.attention.output.dense": "rowwise",
            "encoder.layer.*.intermediate.dense": "colwise",
            "encoder.layer.*.output.dense": "rowwise",
        },
        "head": {},
    },
    # BERT's blocks whose attention reshapes by its head counts (BERT's own with -1): BERT's entry ("like"), and
    # these counts per rank
    **{model_type: {"like": "bert",
                    "per_rank": {"encoder.layer.*.attention.self": ("num_attention_heads", "all_head_size")}}
       for model_type in ("megatron-bert", "rembert", "roformer")},
    # BigBird: BERT's blocks, but its attention module is replaced at run time (block-sparse <-> full by the
    # sequence length: set_attention_type), by a new one holding whole head counts around the cut linears
    "big_bird": {
        "refuse_tp": "its attention module is replaced at run time (block-sparse or full, by the sequence length) "
                     "with one counting every head around the cut projections",
    },
    # XGLM and BioGPT: OPT-like blocks (q/k/v/out_proj, fc1/fc2); XGLM's attention reshapes by num_heads and
    # embed_dim, BioGPT's with -1
    "xglm": {
        "base": _opt_blocks("layers"),
        "head": {},
        "per_rank": {"layers.*.self_attn": ("num_heads", "embed_dim")},
    },
    "biogpt": {
        "base": _opt_blocks("layers"),
        "head": {},
    },
    # StableLM: Llama-like projections, views by num_heads / num_key_value_heads; its optional per-head q/k norms
    # are one LayerNorm per head in a list, which a rank would have to slice
    "stablelm": {
        "base": {
            "layers.*.self_attn.q_proj": "colwise",
            "layers.*.self_attn.k_proj": "colwise",
            "layers.*.self_attn.v_proj": "colwise",
            "layers.*.self_attn.o_proj": "rowwise",
            "layers.*.mlp.gate_proj": "colwise",
            "layers.*.mlp.up_proj": "colwise",
            "layers.*.mlp.down_proj": "rowwise",
        },
        "head": {"lm_head": "colwise_gather_output"},
        "per_rank": {"layers.*.self_attn": ("num_heads", "num_key_value_heads")},
        "refuse_if": {"qk_layernorm": "per-head q/k norms (StableLmLayerNormPerHead: one LayerNorm per head)"},
    },
    # Persimmon: query_key_value packs each head's q, k, v together ((heads, 3, head_dim) outputs), so a
    # contiguous cut gives a rank whole heads (as BLOOM); its q/k LayerNorms span one head's width, shared by all
    # heads: whole, their gradients summed over tp
    "persimmon": {
        "base": {
            "layers.*.self_attn.query_key_value": "colwise",
            "layers.*.self_attn.dense": "rowwise",
            "layers.*.self_attn.q_layernorm": "replicated_with_grad_allreduce",
            "layers.*.self_attn.k_layernorm": "replicated_with_grad_allreduce",
            "layers.*.mlp.dense_h_to_4h": "colwise",
            "layers.*.mlp.dense_4h_to_h": "rowwise",
        },
        "head": {"lm_head": "colwise_gather_output"},
        "per_rank": {"layers.*.self_attn": ("num_heads",)},
    },
    # CTRL: Wq/Wk/Wv/dense and a Sequential MLP (ffn.0, ffn.2); its attention views with -1 (5.24)
    "ctrl": {
        "base": {
            "h.*.multi_head_attention.Wq": "colwise",
            "h.*.multi_head_attention.Wk": "colwise",
            "h.*.multi_head_attention.Wv": "colwise",
            "h.*.multi_head_attention.dense": "rowwise",
            "h.*.ffn.0": "colwise",
            "h.*.ffn.2": "rowwise",
        },
        "head": {},
        # transformers 5.5 (the floor) reshapes by num_heads and d_model_size, not -1: one rank's share
        "per_rank": {"h.*.multi_head_attention": ("num_heads", "d_model_size")},
    },
    # GPT-Neo: nn.Linear q/k/v/out_proj under attn.attention (global or local, one mask per layer, not per head),
    # reshaped by num_heads; its head is tied to wte, so both stay whole
    "gpt_neo": {
        "base": {
            "h.*.attn.attention.q_proj": "colwise",
            "h.*.attn.attention.k_proj": "colwise",
            "h.*.attn.attention.v_proj": "colwise",
            "h.*.attn.attention.out_proj": "rowwise",
            "h.*.mlp.c_fc": "colwise",
            "h.*.mlp.c_proj": "rowwise",
        },
        "head": {},
        "per_rank": {"h.*.attn.attention": ("num_heads",)},
    },
    # GPT (openai-gpt): GPT-2's Conv1D blocks; c_attn packs q | k | v, split by split_size, heads by n_head
    "openai-gpt": {
        "base": {
            "h.*.attn.c_attn": ("packed_colwise", {"parts": 3}),
            "h.*.attn.c_proj": "rowwise",
            "h.*.mlp.c_fc": "colwise",
            "h.*.mlp.c_proj": "rowwise",
        },
        "head": {},
        "per_rank": {"h.*.attn": ("split_size", "n_head")},
    },
    # GPT-NeoX-Japanese: query_key_value packs each head's q, k, v together ((heads, 3 * head_dim) outputs): a
    # contiguous cut gives whole heads; its dense bias is a separate whole parameter the layer adds once
    "gpt_neox_japanese": {
        "base": {
            "layers.*.attention.query_key_value": "colwise",
            "layers.*.attention.dense": "rowwise",
            "layers.*.mlp.dense_h_to_4h": "colwise",
            "layers.*.mlp.dense_4h_to_h": "rowwise",
        },
        "head": {},
        "per_rank": {"layers.*.attention": ("num_attention_heads",)},
        "refuse_sp": "its attention hands its dense bias out whole to the layer, which adds it after the region "
                     "(on a sequence shard, where the bias's gradient covers only this rank's tokens)",
    },
    # ModernBERT decoder: q/k/v/Wo (views with -1); its MLP's Wi packs input | gate, each cut alike
    "modernbert-decoder": {
        "base": {
            "layers.*.attn.q_proj": "colwise",
            "layers.*.attn.k_proj": "colwise",
            "layers.*.attn.v_proj": "colwise",
            "layers.*.attn.Wo": "rowwise",
            "layers.*.mlp.Wi": ("packed_colwise", {"parts": 2}),
            "layers.*.mlp.Wo": "rowwise",
        },
        "head": {},
    },
    # Falcon: query_key_value packs per key/value group ((kv, heads/kv + 2, head_dim) outputs, the 40B "new decoder
    # architecture") or per head ((heads, 3, head_dim), without multi-query), so a contiguous cut gives a rank whole
    # groups or heads; multi-query's q | k | v (one shared key/value head) cannot be cut so
    "falcon": {
        "base": {
            "h.*.self_attention.query_key_value": "colwise",
            "h.*.self_attention.dense": "rowwise",
            "h.*.mlp.dense_h_to_4h": "colwise",
            "h.*.mlp.dense_4h_to_h": ("rowwise", {"owned": True}),  # the block adds the attention into it in place
        },
        "head": {},
        "per_rank": {"h.*.self_attention": ("num_heads", "num_kv_heads")},
        # multi-query (Falcon-7B): q | k | v with one key/value head every rank computes with (multi_query.py;
        # its num_kv_heads of 1 stays 1); ALiBi: each rank's heads' bias, and the mask the bias is folded into
        "base_if": {"multi_query": ({"h.*.self_attention.query_key_value": ("colwise", {"multi_query": True})},
                                    "new_decoder_architecture")},
        "alibi": ("h.*.self_attention",),
    },
    # BitNet: an RMSNorm over the whole attention output (attn_sub_norm) and over the whole MLP width
    # (ffn_sub_norm) sits between each column cut and its row cut, so no 1-D cut of either block is sound
    "bitnet": {
        "refuse_tp": "its attn_sub_norm and ffn_sub_norm normalize over the very width a tensor-parallel cut "
                     "splits (between q/k/v and o_proj, between up and down)",
    },
    # GPT-BigCode (StarCoder): GPT-2's blocks as nn.Linear. Without multi-query c_attn packs each head's q, k, v
    # together ((heads, 3 * head_dim) outputs): a contiguous cut gives whole heads. With multi-query (every
    # released checkpoint) it is q | k | v, k and v one head each that every query head reads: each rank computes
    # its q rows and all of k | v (multi_query.py: the weight stored as a row shard), and the attention's
    # key/value-group count becomes one rank's share too
    "gpt_bigcode": {
        "base": {
            "wte": "embedding_rowwise",
            "h.*.attn.c_attn": "colwise",
            "h.*.attn.c_proj": "rowwise",
            "h.*.mlp.c_fc": "colwise",
            "h.*.mlp.c_proj": "rowwise",
        },
        "base_if": {"multi_query": {"h.*.attn.c_attn": ("colwise", {"multi_query": True})}},
        "head": {"lm_head": "colwise_gather_output"},
        # the attention splits c_attn's output by embed_dim, views its heads by num_heads and repeats its one
        # key/value head num_key_value_groups times (1 without multi-query: left so)
        "per_rank": {"h.*.attn": ("embed_dim", "num_heads", "num_key_value_groups")},
    },
    # XLM: four parallel lists (attentions, layer_norm1, ffns, layer_norm2; no pipeline layout), nn.Linear q/k/v/out
    # reshaped by n_heads; its head (pred_layer.proj) is tied to the embeddings: both stay whole
    "xlm": {
        "base": {
            "attentions.*.q_lin": "colwise",
            "attentions.*.k_lin": "colwise",
            "attentions.*.v_lin": "colwise",
            "attentions.*.out_lin": "rowwise",
            "ffns.*.lin1": "colwise",
            "ffns.*.lin2": "rowwise",
        },
        "head": {},
        "per_rank": {"attentions.*": ("n_heads",)},
    },
    # CPM-Ant: q/k/v/attention_out reshaped by num_heads, a gated MLP (w_in.w_0 gate, w_in.w_1 up, w_out); the base
    # model builds one relative position bias for every head, (batch, heads, q, k), handed to each attention by
    # position: sliced to the rank's heads (head_bias, alibi.py); its head is tied to the embeddings: both whole
    "cpmant": {
        "base": {
            "encoder.layers.*.self_att.self_attention.project_q": "colwise",
            "encoder.layers.*.self_att.self_attention.project_k": "colwise",
            "encoder.layers.*.self_att.self_attention.project_v": "colwise",
            "encoder.layers.*.self_att.self_attention.attention_out": "rowwise",
            "encoder.layers.*.ffn.ffn.w_in.w_0": "colwise",
            "encoder.layers.*.ffn.ffn.w_in.w_1": "colwise",
            "encoder.layers.*.ffn.ffn.w_out": "rowwise",
        },
        "head": {},
        "per_rank": {"encoder.layers.*.self_att.self_attention": ("num_heads",)},
        "head_bias": {"encoder.layers.*.self_att.self_attention": "position_bias"},
    },
    # Mamba: each block's mixer is cut by its inner channels (mamba.py): in_proj packs [x | gate], each half cut
    # alike; conv1d, x_proj, dt_proj, A_log and D by the block's "mamba_mixer" (on the block, not its mixer: a
    # mixer without a style of its own is a sequence-parallel region, closed by its row-parallel out_proj); the
    # mixer's intermediate_size is one rank's share (the slow path's state is shaped by it); embeddings and the
    # head stay whole (tied by default)
    "mamba": {
        "base": {
            "layers.*": "mamba_mixer",
            "layers.*.mixer.in_proj": ("packed_colwise", {"parts": 2}),
            "layers.*.mixer.out_proj": "rowwise",
        },
        "head": {},
        "per_rank": {"layers.*.mixer": ("intermediate_size",)},
        "divides": ("intermediate_size",),
    },
    # FalconMamba: Mamba's mixer plus weightless RMS norms over B, C and the step sizes, after x_proj's sum (whole)
    "falcon_mamba": {"like": "mamba"},
    # Mamba 2: each block's mixer cut by heads and groups (mamba.py): in_proj packs [gate | x | B | C | dt] and conv1d
    # runs over [x | B | C], parts of unequal sizes, gathered whole each forward for the rank's rows; the gated norm
    # normalizes per group, whole groups on a rank; out_proj row-parallel
    "mamba2": {
        "base": {
            "layers.*": "mamba2_mixer",
            "layers.*.mixer.out_proj": "rowwise",
        },
        "head": {},
        "per_rank": {"layers.*.mixer": ("num_heads", "n_groups", "intermediate_size", "conv_dim")},
        "divides": ("num_heads", "n_groups"),
    },
    # XLNet: its two-stream relative attention holds bare (d_model, heads, head_dim) parameters (q, k, v, o, r) and
    # per-head biases, no linear to cut: attention stays whole, the MLP is cut (as DeepSeek-V3's own plan does)
    "xlnet": {
        "base": {
            "layer.*.ff.layer_1": "colwise",
            "layer.*.ff.layer_2": "rowwise",
        },
        "head": {},
    },
}


def _has_linear(model, names) -> bool:
    import fnmatch

    import torch.nn as nn

    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return all(any(n.count(".") == p.count(".") and fnmatch.fnmatchcase(n, p) for n, _ in mods) for p in names)


def table_for(model) -> dict:
    """The built-in entry for ``model``: its ``config.model_type``'s, else (the first) ``by_structure`` entry
    whose every ``base`` pattern names a linear of the model; ``{}`` when none."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in TABLES:
        entry = TABLES[model_type]
        like = {k: v for k, v in TABLES[entry["like"]].items() if k != "by_structure"} if "like" in entry else {}
        return {**like, **{k: v for k, v in entry.items() if k != "like"}}
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    base = base if base is not None and base is not model else model
    for entry in TABLES.values():
        if entry.get("by_structure") and _has_linear(base, entry["base"]):
            return entry
    return {}
