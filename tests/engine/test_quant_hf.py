"""Tensor-parallel int8 inference of transformers models: ``shard_int8_tp`` reads the model's own plan
(Llama's and Qwen2's ``tp_plan``; the built-in tables of GPT-2 with its packed q|k|v ``Conv1D``, OPT, BLOOM
with its packed per-head q|k|v and ALiBi, and the encoder BERT; the causal LMs' tied heads), and 2 gloo
ranks give the logits of int8 on one rank within the 1e-2 relative of ``test_quant.py`` and the same greedy
tokens (BERT: its MLM logits and last hidden state within 1e-2), whether sharded after ``quantize`` or while
loading a safetensors checkpoint (``load_quantized(..., tp_group=True)``: no rank holds the whole int8
model); heads that do not divide over the ranks, and a model sharded twice, are refused before any slicing."""

import copy

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from support import hf  # noqa: E402
from support.dist import run_distributed  # noqa: E402

from colossal_lab.engine.checkpoint_io.safetensors_shards import save_state_dict_shards  # noqa: E402
from colossal_lab.engine.models.hf import tied_weights  # noqa: E402
from colossal_lab.engine.quant import Int8Embedding, Int8Linear, load_quantized, quantize, shard_int8_tp  # noqa: E402

MODELS = {"llama": hf.llama, "gpt2": hf.gpt2, "qwen2": hf.qwen2, "opt": hf.opt, "bloom": hf.bloom, "bert": hf.bert}
ENCODERS = {"bert"}  # no generate: compared by their last hidden state as well as their logits
# a module each family's plan cuts by its outputs, with its whole output channels
COL = {"llama": ("model.layers.0.self_attn.q_proj", 64), "gpt2": ("transformer.h.0.attn.c_attn", 192),
       "qwen2": ("model.layers.0.mlp.up_proj", 128), "opt": ("model.decoder.layers.1.self_attn.k_proj", 64),
       "bloom": ("transformer.h.0.self_attention.query_key_value", 192),
       "bert": ("bert.encoder.layer.1.attention.self.value", 64)}


def _prompt():
    return torch.randint(2, 256, (2, 6), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _run(name, model, prompt):
    if name in ENCODERS:
        out = model(input_ids=prompt, output_hidden_states=True)
        return out.logits, out.hidden_states[-1]
    logits = model(input_ids=prompt).logits
    tokens = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    return logits, tokens


def _tp(rank, world, ckpts):
    out = {}
    for name, build in MODELS.items():
        model = quantize(build().eval(), "int8")  # the same seed on every rank: the same weights
        shard_int8_tp(model)
        col, whole = COL[name]
        assert model.get_submodule(col).weight_int8.shape[0] == whole // world
        out[name] = _run(name, model, _prompt())
        with pytest.raises(ValueError, match="shard only once"):  # refused before any further cut
            shard_int8_tp(model)
        assert model.get_submodule(col).weight_int8.shape[0] == whole // world
        cls, config = type(model), model.config
        loaded = load_quantized(lambda: cls(config), ckpts[name], tp_group=True)  # sliced as each tensor arrives
        assert loaded.get_submodule(col).weight_int8.shape[0] == whole // world
        out[name, "loaded"] = _run(name, loaded.eval(), _prompt())
        with pytest.raises(ValueError, match="shard only once"):
            shard_int8_tp(loaded)
    bad = quantize(hf.gpt2(n_head=1).eval(), "int8")
    try:
        shard_int8_tp(bad)
        out["error"] = "no error"
    except ValueError as exc:
        out["error"] = str(exc)
    return out


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory):
    ckpts = {}
    for name, build in MODELS.items():
        model = build()
        tied = {n for names in tied_weights(model) for n in names[1:]}  # saved once, as save_pretrained does
        state = {k: v for k, v in model.state_dict().items() if k not in tied}
        ckpts[name] = str(tmp_path_factory.mktemp(name))
        save_state_dict_shards(state, ckpts[name], size_per_shard=0.5)
    return run_distributed(_tp, 2, ckpts)


def _rel(got, want):
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("name", list(MODELS))
def test_two_rank_int8_tensor_parallel_equals_one_rank(tensor_parallel, name):
    single = quantize(copy.deepcopy(MODELS[name]().eval()), "int8")
    assert isinstance(single.get_submodule(COL[name][0]), Int8Linear)
    if name == "opt":  # a plain lookup is quantised; learned positions (a forward of their own) stay whole
        decoder = single.model.decoder
        assert isinstance(decoder.embed_tokens, Int8Embedding), decoder.embed_tokens
        assert not isinstance(decoder.embed_positions, Int8Embedding), decoder.embed_positions
    want_logits, want_second = _run(name, single, _prompt())
    for rank in range(2):
        for key in (name, (name, "loaded")):
            logits, second = tensor_parallel[rank][key]
            # same math, a different summation split: close, not bitwise
            print(f"{key} rank {rank}: logits {_rel(logits, want_logits):.2e}", end="")
            assert _rel(logits, want_logits) < 1e-2, (key, rank)
            if name in ENCODERS:
                print(f", last hidden state {_rel(second, want_second):.2e}")
                assert _rel(second, want_second) < 1e-2, (key, rank)
            else:
                print()
                assert torch.equal(second, want_second), (key, rank, second, want_second)


def test_heads_that_do_not_divide_are_refused(tensor_parallel):
    for rank in range(2):
        msg = tensor_parallel[rank]["error"]
        assert "tensor-parallel int8 over 2 ranks" in msg and "choose tp_size in [1]" in msg, msg
