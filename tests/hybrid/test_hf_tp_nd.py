"""2D / 2.5D / 3D tensor parallelism for transformers models, and the plain loop under every mode.

Tiny random Llama (grouped-query attention), Qwen2 (q/k/v biases), OPT (LayerNorm with bias, learned
positions with an offset, heads reshaped by ``num_heads``) and GPT-2 (``Conv1D`` weights stored (in, out),
``c_attn`` packing q | k | v) take their 2D/2.5D/3D roles from their own 1D plan and train with the plain
HF loop (``loss = model(input_ids=x, labels=x).loss; booster.backward(loss, optimizer)``), every rank
handed the whole batch: loss and gradient norm follow the single-process fp32 curve within 1e-4 relative
over 5 AdamW steps, under 2D and 2.5D (depth 1) on four ranks and 3D on eight. ``execute_pipeline`` with
the model's own loss does the same under 2D, and the reference GPT's plain loop
(``logits, loss = model(x, y)``) too. Families and inputs the layouts cannot run are refused before any
process group exists, naming the reason and the sizes that work.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from support import hf  # noqa: E402
from support.dist import run_distributed  # noqa: E402
from support.engine import assert_follows, batch, param_groups  # noqa: E402

STEPS = 5
LR = hf.LR  # AdamW's: support.hf says why not 1e-2
SEED = 11
CLIP = 0.5  # below every gradient norm here: the clip acts at every step, so a wrong norm moves the curve


def _opt(**kw):  # the built-in table; LayerNorm with bias; its own head (a tied one is refused below)
    return hf.opt(**{"tie_word_embeddings": False, **kw})


def _gpt2(**kw):  # the built-in table: Conv1D weights (in, out), c_attn packing q | k | v; its own head
    return hf.gpt2(**{"tie_word_embeddings": False, **kw})


def _gpt():
    from colossal_lab.engine.models import GPT, GPTConfig

    torch.manual_seed(SEED)
    return GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64))


MODELS = {"llama": hf.llama, "qwen2": hf.qwen2, "opt": _opt, "gpt2": _gpt2, "gpt": _gpt}


def _gpt_loss(model, s):  # the GPT's own loop: its forward takes the targets
    return model(*batch(s))[1]


def _loop(model, opt, booster, hf_model=True):
    """The plain loop (transformers' or the GPT's), the whole batch on every rank; returns the losses
    and the gradient norms before clipping."""
    return hf.loop(model, opt, booster, steps=STEPS, clip=CLIP, loss_of=None if hf_model else _gpt_loss)


def _pipeline_loop(model, opt, booster, hf_model=True):
    """``execute_pipeline`` with the model's own loss (criterion None)."""
    return hf.pipeline_loop(model, opt, booster, steps=STEPS, clip=CLIP)


def _reference(name):
    model = MODELS[name]()
    return _loop(model, torch.optim.AdamW(param_groups(model), lr=LR), None, hf_model=name != "gpt")


def _train(name, mode, depth=1, loop=_loop):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    plugin = HybridParallelPlugin(tp_size=dist.get_world_size(), tp_mode=mode, tp_depth=depth)
    booster = Booster(plugin=plugin)
    model = MODELS[name]()
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    model, opt, *_ = booster.boost(model, opt)
    whole, plain = model.full_state_dict(), MODELS[name]().state_dict()
    same = whole.keys() == plain.keys() and all(torch.equal(whole[k], plain[k]) for k in plain)
    losses, norms = loop(model, opt, booster, hf_model=name != "gpt")
    inner = model.stage_modules[0].inner
    kinds = sorted({type(m).__name__ for m in inner.modules()})
    plugin.close()
    return {"losses": losses, "norms": norms, "whole_equals_plain": same, "kinds": kinds}


FOUR = [(n, m) for m in ("2d", "2.5d") for n in ("llama", "qwen2", "opt", "gpt2")] + [("gpt", "2d")]
EIGHT = [("llama", "3d"), ("qwen2", "3d"), ("opt", "3d"), ("gpt2", "3d")]


def _four(rank, world):
    out = {case: _train(*case) for case in FOUR}
    out[("llama", "2d_pipeline")] = _train("llama", "2d", loop=_pipeline_loop)
    return out


def _eight(rank, world):
    return {case: _train(*case) for case in EIGHT}


@pytest.fixture(scope="module")
def four():
    return run_distributed(_four, 4, timeout=600, preload=True)


@pytest.fixture(scope="module")
def eight():
    return run_distributed(_eight, 8, timeout=600, preload=True)


def _check(runs, case, name):
    ref, ref_norms = _reference(name)
    assert ref[-1] < ref[0] and min(ref_norms) > CLIP  # it learned, and the clip acted on every step
    for r in runs:
        got = r[case]
        assert_follows(case, got["losses"], got["norms"], ref, ref_norms)
        assert got["whole_equals_plain"], case  # the blocks gather back to the model's own tensors


@pytest.mark.parametrize("case", FOUR + [("llama", "2d_pipeline")], ids=lambda c: "-".join(c))
def test_four_ranks_follow_the_single_process_curve(four, case):
    _check(four, case, case[0])


@pytest.mark.parametrize("case", EIGHT, ids=lambda c: "-".join(c))
def test_3d_on_eight_ranks_follows_the_single_process_curve(eight, case):
    _check(eight, case, case[0])


def test_the_layers_became_grid_layers(four):
    kinds = four[0][("opt", "2d")]["kinds"]
    assert {"Linear2D", "LayerNorm", "Embedding", "NdOPTLearnedPositionalEmbedding"} <= set(kinds), kinds
    assert "Linear" not in kinds  # every nn.Linear, the head too, is a grid layer
    assert {"Linear2p5D", "RMSNorm"} <= set(four[0][("llama", "2.5d")]["kinds"])
    assert "Conv1D" not in four[0][("gpt2", "2d")]["kinds"]  # stored (in, out) in its blocks: transposed


# ---- refused before any process group exists ---------------------------------------------------------

def _configure(model, **kw):
    from colossal_lab.engine.plugins import HybridParallelPlugin

    assert not dist.is_initialized()
    HybridParallelPlugin(**kw).configure(model)


def test_heads_that_do_not_divide_over_the_grid_side_name_the_sizes_that_work():
    with pytest.raises(ValueError, match=r"6 attention heads and 6 key/value heads.*q=4.*grid side in "
                                         r"\[1, 2, 3, 6\] \(tp_size in \[1, 4, 9, 36\]"):
        _configure(hf.llama(num_attention_heads=6, num_key_value_heads=6, hidden_size=96), tp_size=16, tp_mode="2d")
    with pytest.raises(ValueError, match=r"4 attention heads and 2 key/value heads.*q=4"):
        _configure(hf.llama(hidden_size=128), tp_size=64, tp_mode="3d")


def test_what_the_layouts_cannot_run_is_named():
    with pytest.raises(ValueError, match=r"one tied parameter.*untie"):
        _configure(_opt(tie_word_embeddings=True), tp_size=4, tp_mode="2d")
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*one tied parameter"):
        _configure(_gpt2(tie_word_embeddings=True), tp_size=4, tp_mode="2d")
    from transformers import BloomConfig, BloomForCausalLM

    bloom = BloomForCausalLM(BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=256))
    with pytest.raises(ValueError, match=r"BloomForCausalLM.*ALiBi.*tp_mode='1d'"):
        _configure(bloom, tp_size=4, tp_mode="2d")
    with pytest.raises(ValueError, match=r"pipeline stages.*pp_size=1"):
        _configure(hf.llama(), tp_size=4, tp_mode="2d", pp_size=2, num_microbatches=2)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    qwen3 = Qwen3ForCausalLM(Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         intermediate_size=128, num_hidden_layers=2, vocab_size=256))
    with pytest.raises(ValueError, match=r"Qwen3ForCausalLM.*q_norm.*per-head norm.*tp_mode='1d'"):
        _configure(qwen3, tp_size=4, tp_mode="2d")
    from transformers import GemmaConfig, GemmaForCausalLM

    gemma = GemmaForCausalLM(GemmaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         intermediate_size=128, num_hidden_layers=2, vocab_size=256))
    with pytest.raises(ValueError, match=r"GemmaRMSNorm\) does not compute rmsnorm"):
        _configure(gemma, tp_size=4, tp_mode="2d")


def test_blocks_that_do_not_cut_evenly_are_refused():
    with pytest.raises(ValueError, match=r"lm_head.weight has size 257.*multiple of 2"):
        _configure(hf.llama(vocab_size=257), tp_size=4, tp_mode="2d")
