"""Built-in tensor-parallel plans for transformers families that ship none, in one place.

Keyed by ``config.model_type``; names are the base model's (as transformers' ``base_model_tp_plan``),
and a head's entries (``lm_head``) are the task model's own. ``per_rank`` names the attributes of a
module that count heads or widths and must hold one rank's share once its linears are sharded (a
forward that reshapes with ``-1`` needs none); ``alibi`` names the attention modules whose ALiBi bias is
sliced to the rank's heads (:mod:`.alibi`). Values are style names (:mod:`.styles`) or
``(name, options)``. ``pp`` is the pipeline layout transformers' ``base_model_pp_plan`` gives other
families: the modules before the layer list (``pre``) and after it (``post``), each with what a stage that
does not own it runs instead (:mod:`.pipeline`), and the task head (``head``).
"""

from __future__ import annotations

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
        "base": {
            "decoder.embed_tokens": "embedding_rowwise",
            "decoder.layers.*.self_attn.q_proj": "colwise",
            "decoder.layers.*.self_attn.k_proj": "colwise",
            "decoder.layers.*.self_attn.v_proj": "colwise",
            "decoder.layers.*.self_attn.out_proj": "rowwise",
            "decoder.layers.*.fc1": "colwise",
            "decoder.layers.*.fc2": "rowwise",
        },
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
    # BERT: the encoder only (its attention reshapes with -1); embeddings and task heads stay whole, as
    # the MLM head ties both the decoder's weight and its bias
    "bert": {
        "base": {
            "encoder.layer.*.attention.self.query": "colwise",
            "encoder.layer.*.attention.self.key": "colwise",
            "encoder.layer.*.attention.self.value": "colwise",
            "encoder.layer.*.attention.output.dense": "rowwise",
            "encoder.layer.*.intermediate.dense": "colwise",
            "encoder.layer.*.output.dense": "rowwise",
        },
        "head": {},
        # the embeddings block (word + position + type, norm, dropout) runs on the first stage only
        "pp": {"pre": {"embeddings": "pass_embeds"}, "layers": "encoder.layer", "post": {"pooler": "none"},
               "head": ["cls"]},
    },
}
