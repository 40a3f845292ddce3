"""Our reference GPT written as a transformers Llama checkpoint directory.

The reference GPT (:mod:`colossal_lab.engine.models.gpt`) is the Llama architecture: RMSNorm, rotary
positions, a SwiGLU MLP, no biases, optionally tied embeddings. :func:`export_llama` renames its weights
to ``LlamaForCausalLM``'s and writes ``config.json`` (``transformers.LlamaConfig``'s own
``save_pretrained``) and ``model.safetensors`` (``safetensors``), so
``LlamaForCausalLM.from_pretrained(dir)`` gives the GPT's logits, and peft, ``generate`` and the
booster's HF path take it from there.

One real difference: our ``apply_rope`` rotates interleaved channel pairs ``(2i, 2i+1)`` of a head,
transformers' ``rotate_half`` pairs ``(i, i + head_dim/2)``, both by the angle of frequency ``i``. The
rows of ``wq`` and ``wk`` are therefore permuted within each head (even channels first, then odd ones):
queries and keys are permuted alike, so their dot products (the attention scores) are unchanged.

transformers is imported inside the function only (``import colossal_lab`` imports no transformers).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Mapping, Optional, Union

import torch

from ..gpt import GPT, GPTConfig

# our block's names -> LlamaDecoderLayer's (inside model.layers.<i>.)
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}


def interleaved_to_halves(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of a q/k projection ``(n_head * head_dim, in)`` reordered per head from interleaved rotary
    pairs (ours) to rotate-half pairs (transformers'): channel ``2i`` to ``i``, ``2i+1`` to ``i + hd/2``."""
    out_features, in_features = weight.shape
    hd = out_features // n_head
    # (H, hd/2, 2, in) -> (H, 2, hd/2, in): evens, then odds, within every head
    return weight.view(n_head, hd // 2, 2, in_features).transpose(1, 2).reshape(out_features, in_features)


def llama_state_dict(state: Mapping[str, torch.Tensor], cfg: GPTConfig) -> Dict[str, torch.Tensor]:
    """Our GPT's state dict under ``LlamaForCausalLM``'s names (q/k rows permuted; with tied embeddings
    no ``lm_head.weight``, as transformers saves a tied model)."""
    expected = set(_gpt_names(cfg))
    got = set(state)
    if cfg.tie_embeddings and "lm_head.weight" in got:  # a tied GPT's state dict names the shared weight twice
        if not torch.equal(state["lm_head.weight"], state.get("tok_emb.weight", state["lm_head.weight"])):
            raise ValueError("export_llama: tie_embeddings=True but lm_head.weight differs from tok_emb.weight; "
                             "pass the config the checkpoint was trained with (tie_embeddings=False)")
        got.discard("lm_head.weight")
    if got != expected:
        missing, extra = sorted(expected - got)[:4], sorted(got - expected)[:4]
        raise ValueError(f"export_llama: the state does not match GPTConfig(n_layer={cfg.n_layer}, "
                         f"tie_embeddings={cfg.tie_embeddings}): missing {missing}, unexpected {extra}; pass the "
                         "config the checkpoint was trained with")
    wrong = [f"{n} {tuple(state[n].shape)} (expected {shape})" for n, shape in _gpt_shapes(cfg).items()
             if tuple(state[n].shape) != shape]
    if wrong:
        raise ValueError(f"export_llama: shapes differ from GPTConfig(vocab_size={cfg.vocab_size}, "
                         f"n_embd={cfg.n_embd}, mlp_hidden={cfg.mlp_hidden}): {wrong[:3]}; pass the config the "
                         "checkpoint was trained with")
    out = {"model.embed_tokens.weight": state["tok_emb.weight"], "model.norm.weight": state["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.n_layer):
        for ours, theirs in _BLOCK.items():
            t = state[f"blocks.{i}.{ours}"]
            if ours in ("attn.wq.weight", "attn.wk.weight"):
                t = interleaved_to_halves(t, cfg.n_head)
            out[f"model.layers.{i}.{theirs}"] = t
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def _gpt_names(cfg: GPTConfig):
    """The parameter names of ``GPT(cfg)``'s state dict (without building the model)."""
    return list(_gpt_shapes(cfg))


def _gpt_shapes(cfg: GPTConfig) -> Dict[str, tuple]:
    """``GPT(cfg)``'s parameter shapes by name (the tied head named once, as ``tok_emb.weight``)."""
    E, H, V = cfg.n_embd, cfg.hidden, cfg.vocab_size
    block = {"attn_norm.weight": (E,), "mlp_norm.weight": (E,), "mlp.w1.weight": (H, E), "mlp.w3.weight": (H, E),
             "mlp.w2.weight": (E, H), **{f"attn.{w}.weight": (E, E) for w in ("wq", "wk", "wv", "wo")}}
    shapes = {"tok_emb.weight": (V, E), "norm.weight": (E,)}
    shapes.update({f"blocks.{i}.{k}": block[k] for i in range(cfg.n_layer) for k in _BLOCK})
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, E)
    return shapes


def llama_config(cfg: GPTConfig, dtype: torch.dtype = torch.float32):
    """The ``transformers.LlamaConfig`` of the same architecture (one key/value head per query head)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.hidden,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head,
        head_dim=cfg.n_embd // cfg.n_head, hidden_act="silu", max_position_embeddings=cfg.block_size,
        rms_norm_eps=cfg.norm_eps, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_bias=False, mlp_bias=False, attention_dropout=cfg.dropout,
        tie_word_embeddings=cfg.tie_embeddings, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        dtype=dtype, architectures=["LlamaForCausalLM"],
    )


def export_llama(source: Union[GPT, Mapping[str, torch.Tensor], str, os.PathLike], out_dir: Union[str, os.PathLike],
                 cfg: Optional[GPTConfig] = None) -> Path:
    """Write our GPT as a transformers Llama checkpoint: ``out_dir/config.json`` + ``model.safetensors``.

    ``source`` is a ``GPT`` (its own config is used), a state dict, or a checkpoint directory as
    ``booster.save_model(model, dir, shard=True)`` writes it (one file or shards with an index); the last
    two need ``cfg``, the ``GPTConfig`` it was trained with. ``out_dir`` is replaced whole (written under a
    temporary name, then renamed). Returns ``out_dir``;
    ``transformers.LlamaForCausalLM.from_pretrained(out_dir)`` then gives the GPT's logits.
    """
    if isinstance(source, GPT):
        cfg = cfg or source.cfg
        if source.tok_emb is None or source.lm_head is None:
            raise ValueError("export_llama: source is a pipeline stage; export the whole GPT")
        state = source.state_dict()
    elif isinstance(source, Mapping):
        state = dict(source)
    elif isinstance(source, (str, os.PathLike)):
        from ...checkpoint_io.safetensors_shards import load_state_dict_shards

        state = load_state_dict_shards(source)
    else:
        raise TypeError(f"export_llama(source={type(source).__name__}): pass a GPT, a state dict or a checkpoint "
                        "directory written by booster.save_model")
    if not isinstance(cfg, GPTConfig):
        raise TypeError("export_llama(cfg=...): a state dict or a checkpoint directory needs the GPTConfig it was "
                        "trained with, e.g. cfg=GPTConfig.preset('small')")
    from safetensors.torch import save_file

    from ...checkpoint_io.atomic import atomic_dir

    tensors = llama_state_dict(state, cfg)
    config = llama_config(cfg, tensors["model.embed_tokens.weight"].dtype)
    with atomic_dir(out_dir) as tmp:  # out_dir becomes exactly these two files, or stays as it was
        config.save_pretrained(tmp)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return Path(out_dir)


__all__ = ["export_llama", "interleaved_to_halves", "llama_config", "llama_state_dict"]
