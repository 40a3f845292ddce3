"""Families the other HF tests don't name, under every parallel mode of HybridParallelPlugin, with no
parallel code: for most, what the adapter reads from transformers (each model's own ``tp_plan`` and
``base_model_pp_plan``, its attention through ``AttentionInterface``) is all it has; for the last three below,
the built-in tables and the pipeline layout read from the module tree.

Gemma (scaled embeddings, ``1 + weight`` norms), Gemma 2 (logit soft-capping), Gemma 3 (per-head q/k norms,
sliding windows), Phi (partial rotary, biases), Phi-3 (packed ``qkv_proj`` and ``gate_up_proj``), GPT-NeoX
(packed per-head q|k|v, parallel residual), GPT-J (parallel attention and MLP), Cohere (LayerNorm, logit
scale), OLMo 2 (full-width q/k norms), Granite (multipliers), StarCoder2 (biases, LayerNorm), EXAONE 4,
Helium and GLM; and three the sweep (``scripts/hf_sweep.py``) turned up: Doge (a bare per-head parameter in its
attention, which its plan leaves whole: tp refused), CamemBERT as a decoder (positions counted from the token ids:
cp2 counts them on the whole sequence; BERT's built-in tp plan, shared by structure, and a pipeline layout
read from its module tree; sp refused: BERT-style blocks) and Qwen3-MoE (tp2 splits attention and keeps the
experts whole on each tp rank; sequence parallelism refused; cp2 and pp2 run). Two with built-in tables
(engine/models/hf/tables.py) and layouts read from the module tree: Falcon (grouped query_key_value) and CTRL,
whose derived layout is refused by its check (its base forward scales the hidden states and adds positions
itself). Each tiny, random, fp32, on 2 ranks under tp2, tp2 with sequence
parallelism, cp2 (ring) and pp2 (1F1B, 2 microbatches). Three steps of plain SGD with clipping at 0.1 (acting
every step) follow the same loop in one process within 1e-4 relative, loss and gradient norm. SGD, not AdamW:
AdamW scales a gradient that is rounding noise (a key bias's, whose effect softmax cancels) up to a full step,
and the curves would part on noise, not on a fault. A mode a family's config rules out is refused, named.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from support import hf  # noqa: E402
from support.dist import run_distributed  # noqa: E402
from support.engine import assert_follows  # noqa: E402

STEPS, LR, CLIP, ROWS, T = 3, 3.0, 0.1, 2, 16  # each step moves the weights by LR * CLIP = 0.3 in norm
FAMILIES = tuple(hf.FAMILY_FIELDS)
MODES = {"tp2": dict(tp_size=2), "sp": dict(tp_size=2, sequence_parallel=True),
         "cp2": dict(cp_size=2, cp_mode="ring"), "pp2": dict(pp_size=2, num_microbatches=2)}
# what a config rules out, refused before any group: (family, mode) -> words of the error
REFUSED = {("gemma2", "cp2"): "attn_logit_softcapping",
           ("doge", "tp2"): "one value per attention head", ("doge", "sp"): "one value per attention head",
           ("camembert", "sp"): "closes them outside itself",
           ("qwen3_moe", "sp"): "experts stay whole on every tp rank",
           ("falcon", "cp2"): "AttentionInterface",
           ("ctrl", "sp"): "does not hand x back", ("ctrl", "pp2"): "does not hand x back",
           ("falcon-mq-alibi", "cp2"): "AttentionInterface"}
CASES = [(f, m) for f in FAMILIES for m in MODES]
# what the floor release (transformers 5.5) lacks for a case that runs on later ones: (family, mode) -> (words of
# the refusal it gives there, the missing feature)
FLOOR_LACKS = {("gpt_bigcode", "cp2"): ("_supports_attention_backend is False",
                                        "GPT-BigCode dispatching its attention through AttentionInterface"),
               ("ctrl", "cp2"): ("_supports_attention_backend is False",
                                 "CTRL dispatching its attention through AttentionInterface")}


def _loop(model, opt, booster=None, pipelined=False):
    return hf.family_loop(model, opt, booster, steps=STEPS, clip=CLIP, rows=ROWS, length=T, pipelined=pipelined)


def _reference(family, lr=LR):
    model = hf.from_config(family)
    return _loop(model, torch.optim.SGD(model.parameters(), lr=lr))


def _train(family, mode):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    try:
        plugin = HybridParallelPlugin(**MODES[mode])
        booster = Booster(plugin=plugin)
        model = hf.from_config(family)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        model, opt, *_ = booster.boost(model, opt)
    except ValueError as e:
        return {"refused": str(e)}
    losses, norms = _loop(model, opt, booster, pipelined=mode == "pp2")
    plugin.close()
    return {"losses": losses, "norms": norms}


def _all(rank, world):
    return {case: _train(*case) for case in CASES}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all, 2, timeout=900)


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_family_follows_its_single_process_curve_or_is_refused(runs, case):
    if case in REFUSED:
        for r in runs:
            assert REFUSED[case] in r[case].get("refused", ""), (case, r[case])
        return
    if case in FLOOR_LACKS and FLOOR_LACKS[case][0] in runs[0][case].get("refused", ""):
        pytest.skip(f"this transformers release lacks {FLOOR_LACKS[case][1]}")
    ref, ref_norms = _reference(case[0])
    assert min(ref_norms) > CLIP  # the clip acted every step, so a wrong norm would move the curve
    frozen, frozen_norms = _reference(case[0], lr=0.0)
    # the steps moved the curve beyond the tolerance: a rank that did not update fails
    assert frozen != pytest.approx(ref, rel=1e-4) or frozen_norms != pytest.approx(ref_norms, rel=1e-4)
    for r in runs:
        got = r[case]
        assert "refused" not in got, (case, got.get("refused"))
        losses = [v if v is not None else w for v, w in zip(got["losses"], ref)]  # pp: the other stage's rank
        assert_follows(case, losses, got["norms"], ref, ref_norms)
    assert any(v is not None for r in runs for v in r[case]["losses"])  # some rank computed the loss


def _configure_error(model, **kw) -> str:
    from colossal_lab.engine.plugins import HybridParallelPlugin

    with pytest.raises(ValueError) as exc:
        HybridParallelPlugin(**kw).configure(model, torch.optim.SGD(model.parameters(), lr=LR))
    assert not dist.is_initialized()  # refused before any process group exists
    return str(exc.value)


def test_layouts_the_sweep_found_are_refused_before_any_group():
    """What scripts/hf_sweep.py found crashing or hanging, now refused by name before any group: a decoder
    layer reading the token ids under a pipeline (DeepSeek-V4's hash routing), a causal convolution outside
    attention under cp (a Mamba hybrid), BERT-style blocks under sequence parallelism."""
    msg = _configure_error(hf.from_config("deepseek_v4", num_hidden_layers=2, n_routed_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=32), pp_size=2,
                           num_microbatches=2)
    assert "take input_ids" in msg and "pp_size=1" in msg, msg
    msg = _configure_error(hf.from_config("granitemoehybrid", num_local_experts=4, num_experts_per_tok=2),
                           cp_size=2, cp_mode="ring")
    assert "mixes tokens outside attention" in msg and "cp_size=1" in msg, msg
    msg = _configure_error(hf.bert(is_decoder=True), tp_size=2, sequence_parallel=True)
    assert "intermediate" in msg and "sequence_parallel=False" in msg, msg


def test_blocks_the_built_in_plans_cannot_cut_are_refused_before_any_group():
    """BitNet's sub-norms span the width tp cuts."""
    msg = _configure_error(hf.from_config("bitnet"), tp_size=2)
    assert "is not cut by tensor parallelism" in msg and "attn_sub_norm" in msg and "tp_size=1" in msg, msg


def test_pipelines_a_stage_cut_would_train_wrong_are_refused_before_any_group():
    """TrOCR: its base forward applies a dropout itself before the layers (a later stage would apply it again:
    the derived layout's check sees it with dropout on), and its own loss is not model.loss_function (unshifted),
    which the last stage computes; the sweep saw the latter as a wrong curve."""
    pp = dict(pp_size=2, num_microbatches=2)
    msg = _configure_error(hf.from_config("trocr", decoder_ffn_dim=128, dropout=0.1), **pp)
    assert "does not hand x back" in msg and "pp_size=1" in msg, msg
    msg = _configure_error(hf.from_config("trocr", decoder_ffn_dim=128, dropout=0.0), **pp)
    assert "computes its loss itself" in msg and "pp_size=1" in msg, msg
