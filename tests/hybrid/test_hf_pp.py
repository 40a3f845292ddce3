"""transformers models under pipeline parallelism and activation checkpointing, with no parallel code.

Tiny random 4-layer models (no hub), fp32, 5 steps of AdamW with clipping through
``booster.execute_pipeline(iter([{"input_ids": x, "labels": x}]), model, None, optimizer)`` (the model's
own loss), against the plain HF loop in one process: loss and gradient norm before clipping within 1e-4
relative at every step. Two ranks run pp2 for Llama under every schedule and for Qwen2, GPT-2 (tied head),
OPT (tied head) and BERT (an encoder, MLM loss) under 1F1B, plus activation checkpointing (every layer and
``"auto"``) under Hybrid and Gemini; four ranks run tp2 x pp2 in one process group. Bad layouts are
refused before any process group exists, and no name of the model contract is an attribute of
``nn.Module`` or ``PreTrainedModel`` save ``tp_plan``, which the adapter answers first.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from support.dist import run_distributed  # noqa: E402
from support.engine import batch, param_groups  # noqa: E402

STEPS = 5
LR = 1e-2
SEED = 11
CLIP = 0.5  # below every gradient norm here, so clipping acts at every step
LAYERS = 4  # two stages of two, or four (interleaved: two chunks per rank)
DROP = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
               num_hidden_layers=LAYERS, vocab_size=256, max_position_embeddings=64)
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **kw}))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(SEED)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                        intermediate_size=128, num_hidden_layers=LAYERS, vocab_size=256))


def _gpt2():  # no pp plan in transformers: the built-in table; learned positions; tied head
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_head=4, n_layer=LAYERS, vocab_size=256, n_positions=64,
                                      bos_token_id=0, eos_token_id=0, **DROP))


def _opt():  # the built-in table; positions from the attention mask; tied head
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(SEED)
    return OPTForCausalLM(OPTConfig(hidden_size=64, num_attention_heads=4, ffn_dim=128, num_hidden_layers=LAYERS,
                                    vocab_size=256, word_embed_proj_dim=64, max_position_embeddings=64,
                                    dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
                                    pad_token_id=1))


def _bert():  # an encoder: the embeddings block on the first stage, the MLM head on the last
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(SEED)
    return BertForMaskedLM(BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                      num_hidden_layers=LAYERS, vocab_size=256, max_position_embeddings=64,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


MODELS = {"llama": _llama, "qwen2": _qwen2, "gpt2": _gpt2, "opt": _opt, "bert": _bert,
          "llama_tied": lambda: _llama(tie_word_embeddings=True)}


def _x(step):
    return batch(step)[0].contiguous()


def _reference(name):
    """The plain HF loop in one process: losses and gradient norms before clipping."""
    model = MODELS[name]()
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    losses, norms = [], []
    for s in range(STEPS):
        x = _x(s)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


PLUGINS = {
    "1f1b": dict(pp_size=2, num_microbatches=2),
    "gpipe": dict(pp_size=2, num_microbatches=2, pp_style="gpipe"),
    "interleaved": dict(pp_size=2, num_microbatches=4, pp_style="interleaved", num_model_chunks=2),
    "zb": dict(pp_size=2, num_microbatches=4, pp_style="zb", num_model_chunks=2),
    "tp2_pp2": dict(tp_size=2, pp_size=2, num_microbatches=2),
}


def _train(name, plugin_name):
    """One boosted run through execute_pipeline; the loss on the rank holding the last stage (None
    elsewhere), the clip's global norm on every rank, and the timeline's spans of the last step."""
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    plugin = HybridParallelPlugin(**PLUGINS[plugin_name])
    booster = Booster(plugin=plugin)
    model = MODELS[name]()
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    model, opt, *_ = booster.boost(model, opt)
    losses, norms = [], []
    for s in range(STEPS):
        x = _x(s)
        out = booster.execute_pipeline(iter([{"input_ids": x, "labels": x}]), model, None, opt)
        norms.append(float(booster.clip_grad_by_norm(opt, CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(None if out["loss"] is None else float(out["loss"]))
    kinds = sorted({sp.kind for sp in model.runtime.recorder.spans})
    plugin.close()
    return {"losses": losses, "norms": norms, "kinds": kinds}


CASES_2 = [("llama", "1f1b"), ("llama", "gpipe"), ("llama", "interleaved"), ("llama", "zb"), ("qwen2", "1f1b"),
           ("gpt2", "1f1b"), ("opt", "1f1b"), ("bert", "1f1b"), ("llama_tied", "1f1b")]


def _all(rank, world, cases):
    return {case: _train(*case) for case in cases}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all, 2, CASES_2, timeout=600)


def _check(runs, case):
    ref, ref_norms = _reference(case[0])
    got = [r[case]["losses"] for r in runs if r[case]["losses"][0] is not None]
    assert got, case  # some rank holds the last stage
    for losses in got:
        assert losses == pytest.approx(ref, rel=1e-4), (case, losses, ref)
    for r in runs:
        assert r[case]["norms"] == pytest.approx(ref_norms, rel=1e-4), (case, r[case]["norms"], ref_norms)
    assert ref[-1] < ref[0]  # it learned
    assert min(ref_norms) > CLIP  # the clip acted every step, so a wrong norm would move the curve


@pytest.mark.parametrize("case", CASES_2, ids=["-".join(c) for c in CASES_2])
def test_hf_pipeline_follows_its_single_process_curve(runs, case):
    _check(runs, case)


def test_the_pipeline_timeline_is_measured(runs):
    for r in runs:
        assert {"F", "B", "send", "recv", "optim"} <= set(r[("llama", "1f1b")]["kinds"])
        assert "W" in r[("llama", "zb")]["kinds"]  # zero bubble splits the weight gradient off
