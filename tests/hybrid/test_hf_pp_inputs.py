"""A user's padded batch through a transformers pipeline: masks, positions and token types on every stage.

Tiny random 4-layer models (no hub), fp32, 5 steps of AdamW with clipping at 0.5 (acting every step), through
``booster.execute_pipeline(iter([batch]), model, None, optimizer)`` with ``batch`` holding ``input_ids``, a padded
``attention_mask`` (right or left padding, rows of different lengths), ``labels`` set to -100 at the padding, and
``position_ids`` (GPT-2, Llama) or ``token_type_ids`` (BERT): the loss on the rank holding the last stage and the
gradient norm on every rank within 1e-4 relative of the unsplit model on the whole batch in one process, at every
step. Two ranks run pp2 (1F1B with 2 and 4 microbatches, interleaved, zero bubble) for Llama, Qwen2, GPT-2, OPT
(positions from the mask) and BERT (an encoder), and tp2 without a pipeline (execute_pipeline's own loop), with
and without sequence parallelism. The
same runs with the mask, the positions or the token types dropped must part from the padded curve (and follow
the unsplit model fed the same reduced batch), so an input silently left behind fails. Bad input is refused at
the call, naming the key.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from support import hf  # noqa: E402
from support.dist import run_distributed  # noqa: E402
from support.engine import batch, param_groups  # noqa: E402

STEPS = 5
LR = 1e-2  # not support.hf.LR: at 2e-3 a dropped input parts from the curve by 1.8e-4 only, too near the 1e-4
CLIP = 0.5  # below every gradient norm here, so clipping acts at every step
LAYERS = 4

MODELS = {"llama": functools.partial(hf.llama, layers=LAYERS), "qwen2": functools.partial(hf.qwen2, layers=LAYERS),
          "gpt2": functools.partial(hf.gpt2, layers=LAYERS), "bert": functools.partial(hf.bert, layers=LAYERS),
          # the key bias's gradient is rounding noise (softmax cancels it) that AdamW would make full steps of
          "opt": functools.partial(hf.opt, layers=LAYERS, fixed_key_bias=True)}

PLUGINS = {
    "1f1b": dict(pp_size=2, num_microbatches=2),
    "1f1b_m4": dict(pp_size=2, num_microbatches=4),
    "interleaved": dict(pp_size=2, num_microbatches=4, pp_style="interleaved", num_model_chunks=2),
    "zb": dict(pp_size=2, num_microbatches=4, pp_style="zb", num_model_chunks=2),
    "tp2": dict(tp_size=2, num_microbatches=2),  # no pipeline: execute_pipeline's own microbatch loop
    "tp2_sp": dict(tp_size=2, sequence_parallel=True, num_microbatches=2),
}

LENGTHS = [32, 20, 27, 9, 32, 15, 24, 30]  # tokens per row (of 32): microbatches count unequal label tokens


def _batch(step, model, side, keys="mask"):
    """A padded batch as a user's tokenizer and collator give it: pad id 0 at the padding, labels -100 there
    (BERT's: 30% of the real tokens, masked-LM); ``keys`` says what else it holds: ``mask`` the padding mask,
    ``pos`` position ids counted from the mask (as ``generate`` counts them), ``types`` random token types."""
    x = batch(step)[0].contiguous()
    lengths = torch.tensor(LENGTHS).roll(step)[:, None]
    at = torch.arange(x.shape[1])
    mask = (at < lengths) if side == "right" else (at >= x.shape[1] - lengths)
    x = x.masked_fill(~mask, 0)
    g = torch.Generator().manual_seed(50 + step)
    out = {"input_ids": x, "labels": x.masked_fill(~mask, -100)}
    if "mask" in keys:
        out["attention_mask"] = mask.long()
    if "pos" in keys:
        out["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
    types = torch.randint(0, 2, x.shape, generator=g)
    if "types" in keys:
        out["token_type_ids"] = types
    if model == "bert":
        out["labels"] = out["labels"].masked_fill(torch.rand(x.shape, generator=g) > 0.3, -100)
    return out


def _reference(model, side, keys="mask"):
    """The unsplit model on the whole batch in one process: losses and gradient norms before clipping."""
    net = MODELS[model]()
    return hf.loop(net, torch.optim.AdamW(param_groups(net), lr=LR), steps=STEPS, clip=CLIP,
                   loss_of=lambda net, s: net(**_batch(s, model, side, keys)).loss)


def _boost(model, plugin_name):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    plugin = HybridParallelPlugin(**PLUGINS[plugin_name])
    booster = Booster(plugin=plugin)
    net = MODELS[model]()
    opt = torch.optim.AdamW(param_groups(net), lr=LR)
    net, opt, *_ = booster.boost(net, opt)
    return plugin, booster, net, opt


def _train(model, side, plugin_name, keys="mask"):
    """One boosted run through execute_pipeline: the loss on the rank holding the last stage (None elsewhere)
    and the clip's global norm on every rank."""
    plugin, booster, net, opt = _boost(model, plugin_name)
    losses, norms = hf.pipeline_loop(net, opt, booster, steps=STEPS, clip=CLIP,
                                     batch_of=lambda s: _batch(s, model, side, keys))
    plugin.close()
    return {"losses": losses, "norms": norms}


def _refusals():
    """Bad batches at the call of a boosted pipeline: the messages, by what was wrong."""
    plugin, booster, net, opt = _boost("llama", "1f1b")
    good = _batch(0, "llama", "left", "mask")
    bad = {"mask_shape": {**good, "attention_mask": good["attention_mask"][:, :-1]},
           "mask_4d": {**good, "attention_mask": good["attention_mask"][:, None, None, :]},
           "token_type_ids": {**good, "token_type_ids": torch.zeros_like(good["input_ids"])},
           "inputs_embeds": {**good, "inputs_embeds": torch.zeros(8, 32, 64)}}
    out = {}
    for what, b in bad.items():
        try:
            booster.execute_pipeline(iter([b]), net, None, opt)
            out[what] = None
        except ValueError as exc:
            out[what] = str(exc)
    plugin.close()
    return out


# (model, padding side, plugin, what the batch holds beside input_ids and labels)
CASES = [("llama", "right", "1f1b", "mask"), ("llama", "left", "1f1b_m4", "mask"),
         ("llama", "left", "1f1b_m4", "mask+pos"), ("llama", "left", "interleaved", "mask"),
         ("llama", "left", "zb", "mask+pos"), ("qwen2", "left", "1f1b", "mask"),
         ("gpt2", "left", "1f1b_m4", "mask+pos"),
         ("opt", "left", "1f1b_m4", "mask"), ("opt", "right", "interleaved", "mask"),
         ("bert", "right", "1f1b", "mask+types"), ("bert", "left", "1f1b_m4", "mask+types"),
         ("llama", "left", "tp2", "mask+pos"), ("llama", "left", "tp2_sp", "mask")]
# the same batches with one input left out: (case, what the padded reference holds)
DROPPED = [(("llama", "left", "1f1b_m4", "-"), "mask"), (("bert", "right", "1f1b", "types"), "mask+types"),
           (("gpt2", "left", "1f1b_m4", "mask"), "mask+pos"), (("bert", "right", "1f1b", "mask"), "mask+types")]


def _all(rank, world):
    out = {case: _train(*case) for case in CASES + [c for c, _ in DROPPED]}
    out["refusals"] = _refusals()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all, 2, timeout=600, preload=True)


def _close(got, ref, rel=1e-4):
    return all(abs(a - b) <= rel * abs(b) for a, b in zip(got, ref))


def _follows(runs, case, ref, ref_norms):
    """Every rank's norms and the last stage's losses on the reference curve (1e-4 relative)."""
    got = [r[case]["losses"] for r in runs if r[case]["losses"][0] is not None]
    assert got, case  # some rank holds the last stage
    return all(_close(g, ref) for g in got) and all(_close(r[case]["norms"], ref_norms) for r in runs)


def _ids(cases):
    return ["-".join(c) for c in cases]


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_a_padded_batch_follows_the_unsplit_curve(runs, case):
    ref, ref_norms = _reference(case[0], case[1], case[3])
    for r in runs:
        got = r[case]
        assert got["norms"] == pytest.approx(ref_norms, rel=1e-4), (case, got["norms"], ref_norms)
        if got["losses"][0] is not None:
            assert got["losses"] == pytest.approx(ref, rel=1e-4), (case, got["losses"], ref)
    assert _follows(runs, case, ref, ref_norms)
    assert min(ref[1:]) < ref[0]  # it learned: the curve is not flat
    assert min(ref_norms) > CLIP  # the clip acted every step, so a wrong norm would move the curve


@pytest.mark.parametrize("case,full", DROPPED, ids=[f"{_ids([c])[0]}-of-{f}" for c, f in DROPPED])
def test_a_dropped_input_parts_from_the_padded_curve(runs, case, full):
    """The pipeline fed the batch without one input must not follow the padded reference (an input the
    stages silently ignored would), while it follows the unsplit model fed the same reduced batch."""
    model, side, _, keys = case
    ref, ref_norms = _reference(model, side, full)
    assert not _follows(runs, case, ref, ref_norms)
    got = [r[case]["losses"] for r in runs if r[case]["losses"][0] is not None][0]
    assert max(abs(a - b) / b for a, b in zip(got, ref)) > 1e-3  # ten times the tolerance: not rounding
    assert _follows(runs, case, *_reference(model, side, keys))


def test_bad_inputs_are_refused_at_the_call_naming_the_key(runs):
    for r in runs:
        msg = r["refusals"]
        assert msg["mask_shape"] and "batch['attention_mask'] has shape (8, 31)" in msg["mask_shape"]
        assert msg["mask_4d"] and "batch['attention_mask'] has shape (8, 1, 1, 32)" in msg["mask_4d"]
        assert "4-D mask is not carried" in msg["mask_4d"]
        assert msg["token_type_ids"] and "LlamaForCausalLM.forward takes no token_type_ids" in msg["token_type_ids"]
        assert msg["inputs_embeds"] and "batch['inputs_embeds'] is an input of LlamaForCausalLM.forward that " \
            "pipeline stages do not take" in msg["inputs_embeds"]


def test_inputs_the_stages_take_and_what_3d_refuses():
    """Without processes: which keys go to the stages, one row of positions widened to every row, and
    under 3D tensor parallelism a mask that pads (rows differ) refused, naming it."""
    from colossal_lab.engine.models.hf.inputs import check_rows_agree, stage_inputs

    b = _batch(0, "gpt2", "left", "mask+pos")
    b["position_ids"] = torch.arange(32)[None]
    b["weights"] = torch.ones(8)  # not a model input: the criterion's only
    out, keys = stage_inputs(hf.gpt2(layers=LAYERS), b)
    assert keys == ("attention_mask", "position_ids") and out["position_ids"].shape == (8, 32)
    with pytest.raises(ValueError, match=r"tp_mode='3d'.*batch\['attention_mask'\] differs by row"):
        check_rows_agree(out, keys, "3d")
    flat = {**out, "attention_mask": torch.ones(8, 32, dtype=torch.long)}
    check_rows_agree(flat, keys, "3d")  # no padding, one row of positions: nothing differs by row
    with pytest.raises(ValueError, match=r"batch\['input_ids'\] must be a \(batch, tokens\) tensor"):
        stage_inputs(None, {"input_ids": torch.zeros(32, dtype=torch.long)})
