"""``export_llama`` (engine/models/hf/export.py): our reference GPT written as a transformers Llama
checkpoint loads with ``LlamaForCausalLM.from_pretrained`` and gives the GPT's logits (fp32, 1e-5), from
a GPT, a state dict or a sharded checkpoint directory, tied or untied, with non-default rotary base,
norm eps and MLP width. One process, real transformers."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from colossal_lab.engine.checkpoint_io.safetensors_shards import save_state_dict_shards  # noqa: E402
from colossal_lab.engine.models import GPT, GPTConfig  # noqa: E402
from colossal_lab.engine.models.hf import export_llama  # noqa: E402
from colossal_lab.engine.models.hf.export import interleaved_to_halves  # noqa: E402

ATOL = 1e-5


def gpt(**overrides) -> GPT:
    cfg = GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=32, **overrides)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows in the logits, and
        for name, p in model.named_parameters():  # sharp attention, so a wrong rotary pairing does too
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            if name.endswith(("wq.weight", "wk.weight")):
                p.mul_(10.0)
    return model


def logits_both(model: GPT, out_dir):
    hf = transformers.LlamaForCausalLM.from_pretrained(out_dir).eval()
    x = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.block_size), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(x)[0], hf(input_ids=x).logits, hf


@pytest.mark.parametrize("overrides", [dict(), dict(tie_embeddings=True),
                                       dict(rope_theta=500.0, norm_eps=1e-5, mlp_hidden=48)],
                         ids=["untied", "tied", "theta-eps-mlp"])
def test_from_pretrained_gives_the_gpts_logits(overrides, tmp_path):
    model = gpt(**overrides)
    export_llama(model, tmp_path)
    ours, theirs, hf = logits_both(model, tmp_path)
    assert (ours - theirs).abs().max().item() < ATOL
    c = hf.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) \
        == (32, model.cfg.hidden, 2, 4, 4)
    assert c.rms_norm_eps == model.cfg.norm_eps and c.rope_parameters["rope_theta"] == model.cfg.rope_theta
    assert c.tie_word_embeddings == model.cfg.tie_embeddings
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr() or not c.tie_word_embeddings
    # greedy decoding agrees token for token (transformers' cache against ours)
    prompt = torch.tensor([[5, 17, 3]])
    want = model.generate(prompt, 12, temperature=0)
    got = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(want, got)


def test_from_a_sharded_checkpoint_directory(tmp_path):
    model = gpt()
    save_state_dict_shards(model.state_dict(), tmp_path / "ckpt", size_per_shard=0.01)  # several shards + index
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").exists()
    export_llama(tmp_path / "ckpt", tmp_path / "hf", cfg=model.cfg)
    ours, theirs, _ = logits_both(model, tmp_path / "hf")
    assert (ours - theirs).abs().max().item() < ATOL
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(auto).__name__ == "LlamaForCausalLM"


def test_rewrites_the_directory_whole(tmp_path):
    """A second export replaces the directory: no file of an earlier checkpoint (an index) is left."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors.index.json").write_text("{}")
    model = gpt()
    export_llama(model, tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    ours, theirs, _ = logits_both(model, tmp_path / "hf")
    assert (ours - theirs).abs().max().item() < ATOL


def test_rotary_permutation_is_needed(tmp_path):
    """Without the q/k row permutation the logits differ: the two rotary conventions are really different."""
    model = gpt()
    state = model.state_dict()
    for key in [k for k in state if k.endswith(("attn.wq.weight", "attn.wk.weight"))]:
        # undo what export_llama will do, so the file holds the rows unpermuted
        halves = interleaved_to_halves(torch.eye(state[key].shape[0]), model.cfg.n_head)
        state[key] = halves.T @ state[key]
    export_llama(state, tmp_path, cfg=model.cfg)
    ours, theirs, _ = logits_both(model, tmp_path)
    assert (ours - theirs).abs().max().item() > 1e-2


def test_bad_input_is_refused_before_writing(tmp_path):
    model = gpt()
    with pytest.raises(TypeError, match="cfg="):
        export_llama(model.state_dict(), tmp_path / "a")
    with pytest.raises(ValueError, match="tie_embeddings|missing"):
        export_llama(model.state_dict(), tmp_path / "b", cfg=GPTConfig(vocab_size=96, block_size=32, n_layer=3,
                                                                       n_head=4, n_embd=32))
    with pytest.raises(ValueError, match="shapes differ"):
        export_llama(model.state_dict(), tmp_path / "b", cfg=GPTConfig(vocab_size=128, block_size=32, n_layer=2,
                                                                       n_head=4, n_embd=32))
    with pytest.raises(TypeError, match="source="):
        export_llama(42, tmp_path / "c")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
