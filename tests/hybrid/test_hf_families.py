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
read from its module tree; under sp its blocks pair the region opening features with the sibling closing
them, as do BERT's, RoBERTa's and pre-LN XLM-R-XL's, and BERT's with a padding mask) and Qwen3-MoE (tp2
splits attention and keeps the experts whole on each tp rank; under sequence parallelism its MoE blocks run on
each rank's shard of the tokens; cp2 and pp2 run). Two with built-in tables
(engine/models/hf/tables.py) and layouts read from the module tree: Falcon (grouped query_key_value) and CTRL,
whose derived layout is refused by its check (its base forward scales the hidden states and adds positions
itself). Three the sweep could not build tiny before: DeepSeek-V3 and DeepSeek-V2 (multi-head latent attention;
V2's plan runs the ``mla_kv_a_proj`` style, engine/models/hf/mla.py; experts whole per tp rank, their MoE blocks
on the sequence shard under sp) and
GPT-Neo (global and local attention layers; a built-in tp table; cp refused: no attention registry). Two given
built-in tp tables later: XLM (four parallel layer lists: sp and pp refused) and XLNet (its relative attention holds
bare parameters: only its MLP is cut). Doge's cp2 is refused (its attention adds a mask computed from its values,
which the ring would drop). Multi-query attention's packed weight (GPT-BigCode, Falcon) is a row shard per tp rank
that ``save_model`` writes whole and ``load_model`` reads back (``test_multi_query_...``, in the same world).
Qwen2-MoE (a shared expert the plan cuts, fed flattened tokens) and Mixtral run under sp only.
Each tiny, random, fp32, on 2 ranks under tp2, tp2 with sequence parallelism, cp2 (ring) and pp2 (1F1B, 2
microbatches). Three steps of plain SGD with clipping at 0.1 (acting every step) follow the same loop in one process
within 1e-4 relative, loss and gradient norm. SGD, not AdamW: AdamW scales a gradient that is rounding noise (a key
bias's, whose effect softmax cancels) up to a full step, and the curves would part on noise, not on a fault. A mode
a family's config rules out is refused, named.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from support import hf  # noqa: E402
from support.dist import run_distributed  # noqa: E402
from support.engine import assert_follows  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

STEPS, LR, CLIP, ROWS, T = 3, 3.0, 0.1, 2, 16  # each step moves the weights by LR * CLIP = 0.3 in norm
# families the sweep first built tiny in its third session, with the fields hf.from_config's defaults miss:
# DeepSeek-V3 (multi-head latent attention: key/value heads = heads, head_dim = the rotary part's width; its plan
# cuts the MLPs only, attention stays whole; experts whole per tp rank), DeepSeek-V2 (its plan's mla_kv_a_proj:
# the down-projection whole, its rotary part's gradient summed over tp), GPT-Neo (global and local attention
# layers; the built-in tp table)
_MLA = dict(num_key_value_heads=4, head_dim=8, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
EXTRA = {"deepseek_v3": _MLA, "deepseek_v2": _MLA,
         "gpt_neo": dict(attention_types=[[["global", "local"], 2]], num_key_value_heads=None, head_dim=None),
         "xlm": dict(dff=128), "xlnet": dict(d_inner=128, d_head=16, max_position_embeddings=None, dropout=0.0)}
FAMILIES = tuple(hf.FAMILY_FIELDS) + tuple(EXTRA)
MODES = {"tp2": dict(tp_size=2), "sp": dict(tp_size=2, sequence_parallel=True),
         "cp2": dict(cp_size=2, cp_mode="ring"), "pp2": dict(pp_size=2, num_microbatches=2)}
# what a config rules out, refused before any group: (family, mode) -> words of the error
REFUSED = {("doge", "tp2"): "one value per attention head", ("doge", "sp"): "one value per attention head",
           ("doge", "cp2"): "prepare_dynamic_mask",
           ("falcon", "cp2"): "AttentionInterface",
           ("ctrl", "sp"): "does not hand x back", ("ctrl", "pp2"): "does not hand x back",
           ("gpt_neo", "cp2"): "AttentionInterface",
           ("falcon-mq-alibi", "cp2"): "AttentionInterface",
           ("xlm", "sp"): "has no layer list", ("xlm", "cp2"): "AttentionInterface",
           ("xlm", "pp2"): "has no pipeline layout",
           ("xlnet", "sp"): "does not hold", ("xlnet", "cp2"): "AttentionInterface", ("xlnet", "pp2"): "does not hold"}
# MoE blocks on the sequence shard (engine/models/hf/sequence.py): Qwen2-MoE's shared expert (cut by the plan,
# fed the tokens flattened to (B*T, C)) and its whole shared_expert_gate; Mixtral's plain router and experts
# BERT-style blocks (sequence.py pairs the region that opens features with the sibling that closes them and
# adds the residual): BERT and RoBERTa post-LN, XLM-R-XL pre-LN (its LayerNorm inside attention), as decoders;
# "bert-padded": BERT with a padding mask (its first row's first tokens), which the base forward builds whole
_BERT = dict(is_decoder=True, num_key_value_heads=None, head_dim=None, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0)
SP_ONLY = {"qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=64),
           "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
           "bert": _BERT, "roberta": _BERT, "xlm-roberta-xl": _BERT, "bert-padded": _BERT}
EXTRA.update(SP_ONLY)
# attention sinks planned colwise on a module planned local_params (local_params.py): Granite-SWA under tp2 and sp;
# a derived layout whose norm runs before and after the layers (pipeline.BothEnds): NanoChat under pp2 and sp
SOME_MODES = {"granite_swa": ("tp2", "sp"), "nanochat": ("pp2", "sp")}
CASES = [(f, m) for f in FAMILIES for m in MODES] + [(f, "sp") for f in SP_ONLY] + \
    [(f, m) for f, modes in SOME_MODES.items() if f in CONFIG_MAPPING for m in modes]  # (5.5 lacks Granite-SWA)
# under sp each rank's norms see its shard of the tokens: their weights after the steps equal one process's only
# with their gradients summed over tp (a pre-LN norm's share of the gradient norm is too small for the curve)
NORM_WEIGHTS = ("bert", "roberta", "xlm-roberta-xl", "bert-padded")
PAD = 5  # padded (masked, unlabelled) tokens at the start of the first row of each "bert-padded" batch


def _loop(family, model, opt, booster=None, pipelined=False):
    if family == "bert-padded":
        return _padded_loop(model, opt, booster)
    return hf.family_loop(model, opt, booster, steps=STEPS, clip=CLIP, rows=ROWS, length=T, pipelined=pipelined)


def _padded_loop(model, opt, booster=None):
    """hf.family_loop's steps with an attention mask: the first ``PAD`` tokens of the first row masked out and
    unlabelled, so every later token's attention (and the loss) depends on the mask being applied."""
    losses, norms = [], []
    for s in range(STEPS):
        x = hf.stream(s, ROWS, T)
        mask = torch.ones_like(x)
        mask[0, :PAD] = 0
        loss = model(input_ids=x, attention_mask=mask, labels=x.masked_fill(mask == 0, -100)).loss
        (booster.backward(loss, opt) if booster else loss.backward())
        norm = (booster.clip_grad_by_norm(opt, CLIP) if booster
                else torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())  # tp: the same loss on every rank
        norms.append(float(norm))
    return losses, norms


def _build(family):
    if family == "bert-padded":
        return hf.from_config("bert", **EXTRA[family])
    model = hf.from_config(family, **EXTRA.get(family, {}))
    g = torch.Generator().manual_seed(hf.SEED)
    with torch.no_grad():  # sinks start at zero, alike for every head: a rank reading the wrong heads' would pass
        for name, p in model.named_parameters():
            if name.endswith(".sinks"):
                p.copy_(2 * torch.randn(p.shape, generator=g))
    return model


def _norm_weights(family, params):
    """The norms' weights and biases by name (whole on every tp rank; ``params()`` lists them), for the families
    of ``NORM_WEIGHTS``."""
    return {n: p.detach().clone() for n, p in params() if "norm" in n.lower()} if family in NORM_WEIGHTS else {}


@functools.lru_cache(maxsize=None)  # seeded model, fixed batches: the same curve for every mode of a family
def _reference(family, lr=LR):
    model = _build(family)
    curve = _loop(family, model, torch.optim.SGD(model.parameters(), lr=lr))
    return (*curve, _norm_weights(family, model.named_parameters))


def _train(family, mode):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    try:
        plugin = HybridParallelPlugin(**MODES[mode])
        booster = Booster(plugin=plugin)
        model = _build(family)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        model, opt, *_ = booster.boost(model, opt)
    except ValueError as e:
        return {"refused": str(e)}
    losses, norms = _loop(family, model, opt, booster, pipelined=mode == "pp2")
    weights = _norm_weights(family, model.named_model_parameters)
    plugin.close()
    return {"losses": losses, "norms": norms, "weights": weights}


# multi-query attention's packed q | k | v (multi_query.py): stored as a row shard, checkpointed whole
MULTI_QUERY = {"gpt_bigcode": "transformer.h.0.attn.c_attn.weight",
               "falcon-mq-alibi": "transformer.h.0.self_attention.query_key_value.weight"}
CKPT_IDS = torch.arange(2 * T).view(2, T) * 7 % 250 + 1


def _logits(model):
    model.eval()
    with torch.no_grad():
        return model(input_ids=CKPT_IDS).logits.detach().float().cpu()


def _checkpoint(family, root):
    """tp2: the packed weight's rows on this rank, the logits of the model saved with ``save_model``, and those of
    another seed's model after ``load_model`` of that directory."""
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    plugin = HybridParallelPlugin(tp_size=2)
    booster = Booster(plugin=plugin)
    model, *_ = booster.boost(_build(family))
    local = dict(model.named_model_parameters())[MULTI_QUERY[family]].to_local().shape[0]
    path = f"{root}/{family}"
    booster.save_model(model, path, shard=True, size_per_shard=0.05)
    saved = _logits(model)
    other, *_ = booster.boost(hf.from_config(family, seed=hf.SEED + 1))
    before = _logits(other)
    booster.load_model(other, path)
    out = {"rows": local, "saved": saved, "before": before, "loaded": _logits(other)}
    plugin.close()
    return out


def _all(rank, world, root):
    out = {case: _train(*case) for case in CASES}
    out["checkpoints"] = {f: _checkpoint(f, root) for f in MULTI_QUERY}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("multi_query"))
    return root, run_distributed(_all, 2, root, timeout=900)


@functools.lru_cache(maxsize=None)
def _meta(family):
    with torch.device("meta"):  # the plans and flags only: no weights
        return _build(family)


def _release_refusal(case):
    """What the installed transformers lacks for the case, as the refusal the engine then gives (words of it), or
    None. The floor (5.5) has no expert-parallel plan to tell MoE experts by (the plan's moe_tp_experts style is
    named), ships no tp plan for GPT-J, and has CTRL and GPT-J bypass the attention registry; 5.24 has all three."""
    from colossal_lab.engine.models.hf.context import dispatches_attention
    from colossal_lab.engine.models.hf.moe import ep_plan
    from colossal_lab.engine.models.hf.plan import read_plan

    family, mode = case
    model = _meta(family)
    if mode in ("tp2", "sp") and not read_plan(model)[0]:
        return "carries no tensor-parallel plan"
    # Qwen2-MoE's 5.5 plan names no experts (its experts a list of plain MLPs): it runs there as a dense model
    if mode in ("tp2", "sp") and not ep_plan(model) and "moe_tp_experts" in map(str, read_plan(model)[0].values()):
        return "'moe_tp_experts'"
    if mode == "cp2" and not dispatches_attention(model):  # (5.5's GPT-BigCode dispatches without declaring it)
        return "AttentionInterface"
    return None


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_family_follows_its_single_process_curve_or_is_refused(runs, case):
    runs = runs[1]
    want = _release_refusal(case) or REFUSED.get(case)
    if want:
        for r in runs:
            assert want in r[case].get("refused", ""), (case, r[case])
        return
    ref, ref_norms, ref_weights = _reference(case[0])
    assert min(ref_norms) > CLIP  # the clip acted every step, so a wrong norm would move the curve
    frozen, frozen_norms, _ = _reference(case[0], lr=0.0)
    # the steps moved the curve beyond the tolerance: a rank that did not update fails
    assert frozen != pytest.approx(ref, rel=1e-4) or frozen_norms != pytest.approx(ref_norms, rel=1e-4)
    for r in runs:
        got = r[case]
        assert "refused" not in got, (case, got.get("refused"))
        losses = [v if v is not None else w for v, w in zip(got["losses"], ref)]  # pp: the other stage's rank
        assert_follows(case, losses, got["norms"], ref, ref_norms)
        assert got["weights"].keys() == ref_weights.keys(), (case, sorted(got["weights"]))
        for name, want in ref_weights.items():
            torch.testing.assert_close(got["weights"][name], want, rtol=0, atol=1e-5,
                                       msg=lambda m, name=name: f"{case} {name}: {m}")
    assert any(v is not None for r in runs for v in r[case]["losses"])  # some rank computed the loss


@pytest.mark.parametrize("family", tuple(MULTI_QUERY))
def test_multi_query_weight_is_a_row_shard_and_checkpoints_whole(runs, family):
    """Multi-query's packed q | k | v holds (q + tail) / tp rows per rank; ``save_model`` writes the model's whole
    packed weight (transformers loads it into one process: the plain model's logits, which the tp2 model gave
    too), and ``load_model`` reads it back into another seed's tp2 model."""
    from transformers import AutoModelForCausalLM

    root, ranks = runs
    model = _build(family)
    rows = dict(model.named_parameters())[MULTI_QUERY[family]].shape[0]
    plain = _logits(model)
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(f"{root}/{family}")), plain,
                               rtol=0, atol=1e-5)
    for r in ranks:
        got = r["checkpoints"][family]
        assert got["rows"] == rows // 2, (got["rows"], rows)
        torch.testing.assert_close(got["saved"], plain, rtol=0, atol=1e-5)
        assert not torch.allclose(got["before"], plain, atol=1e-3)  # another seed: the load has work to do
        torch.testing.assert_close(got["loaded"], plain, rtol=0, atol=1e-5)


def _configure_error(model, **kw) -> str:
    from colossal_lab.engine.plugins import HybridParallelPlugin

    with pytest.raises(ValueError) as exc:
        HybridParallelPlugin(**kw).configure(model, torch.optim.SGD(model.parameters(), lr=LR))
    assert not dist.is_initialized()  # refused before any process group exists
    return str(exc.value)


def test_layouts_the_sweep_found_are_refused_before_any_group():
    """What scripts/hf_sweep.py found crashing or hanging, now refused by name before any group: a decoder
    layer reading the token ids under a pipeline (DeepSeek-V4's hash routing), a causal convolution outside
    attention under cp (a Mamba hybrid), a region opening features no sibling closes under sequence parallelism."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "deepseek_v4" in CONFIG_MAPPING:  # not in the floor release (5.5)
        msg = _configure_error(hf.from_config("deepseek_v4", num_hidden_layers=2, n_routed_experts=4,
                                              num_experts_per_tok=2, moe_intermediate_size=32), pp_size=2,
                               num_microbatches=2)
        assert "take input_ids" in msg and "pp_size=1" in msg, msg
    msg = _configure_error(hf.from_config("granitemoehybrid", num_local_experts=4, num_experts_per_tok=2),
                           cp_size=2, cp_mode="ring")
    assert "mixes tokens outside attention" in msg and "cp_size=1" in msg, msg
    # a region that opens features (column layers) with no sibling after it to close them: nothing to pair it with
    plan = {"bert.encoder.layer.*.intermediate.dense": "colwise"}
    msg = _configure_error(hf.bert(), tp_size=2, tp_plan=plan, sequence_parallel=True)
    assert "intermediate" in msg and "no later sibling closes" in msg and "sequence_parallel=False" in msg, msg


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


def test_layers_reading_what_a_stage_lacks_or_features_tp_cuts_are_refused_before_any_group():
    """Found by the sweep's third session: Zamba's hybrid layers take the embedding output
    (``original_hidden_states``), which a later pipeline stage does not have (Zamba 2 hung under pp2); Gemma 3n's
    activation sparsity takes a top-k over the MLP's intermediate features by their mean and std, which tp would
    compute on each rank's share (a wrong curve)."""
    msg = _configure_error(hf.from_config("zamba", layers_block_type=["mamba", "hybrid"] * 2,
                                          attention_hidden_size=128, mamba_dt_rank=8), pp_size=2, num_microbatches=2)
    assert "original_hidden_states" in msg and "pp_size=1" in msg, msg
    sparse = dict(intermediate_size=[128] * 4, layer_types=["sliding_attention", "full_attention"] * 2,
                  num_kv_shared_layers=2, laurel_rank=8, vocab_size_per_layer_input=256,
                  hidden_size_per_layer_input=16)
    msg = _configure_error(hf.from_config("gemma3n_text", activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
                                          **sparse), tp_size=2)
    assert "activation_sparsity_pattern" in msg and "tp_size=1" in msg, msg
    # the same model without sparsity passes every tp check (the sweep: it follows under tp2 then)
    from colossal_lab.engine.models.hf import check_tensor_parallel
    from colossal_lab.engine.plugins import HybridParallelPlugin

    check_tensor_parallel(hf.from_config("gemma3n_text", activation_sparsity_pattern=[0.0] * 4, **sparse),
                          HybridParallelPlugin(tp_size=2))
    assert not dist.is_initialized()


def test_hyper_connection_streams_are_refused_under_sequence_parallelism_before_any_group():
    """HY-V4's layers pass ``config.hc_mult`` streams between them, which its base forward widens and folds on the
    whole sequence (the sweep saw sp crash on a shape). The check reads the config alone: a Llama told it has four
    streams is refused by name; with one it is not."""
    from colossal_lab.engine.models.hf import check_sequence_parallel
    from colossal_lab.engine.plugins import HybridParallelPlugin

    model = hf.llama()
    check_sequence_parallel(model, HybridParallelPlugin(tp_size=2, sequence_parallel=True))
    model.config.hc_mult = 4
    msg = _configure_error(model, tp_size=2, sequence_parallel=True)
    assert "hc_mult=4" in msg and "sequence_parallel=False" in msg, msg
