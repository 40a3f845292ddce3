"""Tiny transformers models for the tests, one builder per family.

Every builder seeds torch with ``seed`` and then builds the model from a small random config
(hidden 64, 4 heads, 2 key/value heads where the family has them, MLP 128, vocabulary 256, 64
positions, dropout off), in fp32. ``layers`` sets the depth; any other keyword overrides a
config field (``vocab_size=257``, ``tie_word_embeddings=True`` ...). transformers is imported
inside each builder, so ``support`` imports without it.

The training loops the HF tests compare (a boosted run against the same loop in one process) are here
too: :func:`loop`, the plain HF loop, and :func:`pipeline_loop`, the same through ``execute_pipeline``.
"""

from __future__ import annotations

import torch

from .engine import batch, global_mean, train_step

SEED = 11
#: AdamW's learning rate in the HF tests that compare a boosted curve with one process's. Not 1e-2: a first AdamW
#: step moves every weight by about lr whatever its gradient, and 1e-2 is half the initial weights' scale; after a
#: few such steps the one-process curves themselves moved by up to 3.3e-4 between float32 and float64, and on one
#: CPU tp runs parted from them by 1.2e-4 to 5e-4 on rounding alone. At 2e-3 float32 and float64 agree within 3.3e-6
#: for every model those tests train, each still learns and is clipped at every step (CLIP 0.5).
LR = 2e-3


def llama(layers: int = 2, seed: int = SEED, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
               num_hidden_layers=layers, vocab_size=256, max_position_embeddings=64)
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **kw}))


def qwen2(layers: int = 2, seed: int = SEED, **kw):  # a plan of its own, biases on q/k/v
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
               num_hidden_layers=layers, vocab_size=256)
    return Qwen2ForCausalLM(Qwen2Config(**{**cfg, **kw}))


def qwen3(layers: int = 2, seed: int = SEED, **kw):  # per-head q_norm / k_norm
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
               num_hidden_layers=layers, vocab_size=256)
    return Qwen3ForCausalLM(Qwen3Config(**{**cfg, **kw}))


def mistral(layers: int = 2, seed: int = SEED, sliding_window: int = 4096, **kw):
    """A sliding window (by default longer than any test's sequence: nothing to apply)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
               num_hidden_layers=layers, vocab_size=256, sliding_window=sliding_window)
    return MistralForCausalLM(MistralConfig(**{**cfg, **kw}))


def gpt2(layers: int = 2, seed: int = SEED, **kw):  # Conv1D weights, a packed q|k|v, learned positions
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = dict(n_embd=64, n_head=4, n_layer=layers, vocab_size=256, n_positions=64, resid_pdrop=0.0,
               embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(GPT2Config(**{**cfg, **kw}))


def opt(layers: int = 2, seed: int = SEED, fixed_key_bias: bool = False, **kw):
    """``fixed_key_bias``: the key projection's bias does not train. It adds the same score to every
    key of a query, so softmax cancels it and its gradient is rounding noise, which AdamW scales up
    to full-size steps: summed over ranks in another order, the curves would part on noise."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    cfg = dict(hidden_size=64, num_attention_heads=4, ffn_dim=128, num_hidden_layers=layers, vocab_size=256,
               word_embed_proj_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
               bos_token_id=0, eos_token_id=0, pad_token_id=1)
    model = OPTForCausalLM(OPTConfig(**{**cfg, **kw}))
    if fixed_key_bias:
        for name, p in model.named_parameters():
            if name.endswith("k_proj.bias"):
                p.requires_grad_(False)
    return model


def bert(layers: int = 2, seed: int = SEED, **kw):  # an encoder with a masked-LM head
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=layers,
               vocab_size=256, max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(BertConfig(**{**cfg, **kw}))


def bloom(layers: int = 2, seed: int = SEED, **kw):  # packed per-head q|k|v, ALiBi, a tied head
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(seed)
    cfg = dict(hidden_size=64, n_head=4, n_layer=layers, vocab_size=256, hidden_dropout=0.0, attention_dropout=0.0)
    return BloomForCausalLM(BloomConfig(**{**cfg, **kw}))


#: tiny decoder configs for families the other builders don't name (``from_config``): the fields each
#: family needs on top of the common ones
FAMILY_FIELDS = {
    "gemma": {}, "gemma2": {}, "gemma3_text": {"sliding_window": 4096}, "phi": {"num_key_value_heads": 4},
    "phi3": {}, "gpt_neox": {"num_key_value_heads": None}, "gptj": {}, "cohere": {}, "olmo2": {},
    "granite": {}, "starcoder2": {}, "exaone4": {}, "helium": {}, "glm": {},
    # from scripts/hf_sweep.py's findings: a per-head bare parameter (refused under tp), positions counted from
    # the token ids (RoBERTa's family, as a decoder), a mixture of experts (tp refused: issue 31)
    "doge": {}, "camembert": {"is_decoder": True, "num_key_value_heads": None, "head_dim": None,
                  "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    # built-in plans and a pipeline layout read from the module tree (engine/models/hf/tables.py, derive.py):
    # Falcon's grouped query_key_value (the 40B layout; multi-query is refused), CTRL (tp from the table; its base
    # forward scales and adds positions itself, so its derived layout is refused)
    "falcon": {"new_decoder_architecture": True, "num_kv_heads": 2, "head_dim": None},
    "ctrl": {"dff": 128},
    # multi-query attention (tables.py, multi_query.py): c_attn packs q | k | v with k and v one head each, shared
    "gpt_bigcode": {"num_key_value_heads": None, "head_dim": None},
    # Falcon's multi-query layout (Falcon-7B) with ALiBi (Falcon-RW) in one: q | k | v with one shared key/value
    # head, and a per-head bias folded into the mask each layer gets (a name of its own: ``model_type`` says whose)
    "falcon-mq-alibi": {"model_type": "falcon", "new_decoder_architecture": False, "multi_query": True,
                        "alibi": True, "num_kv_heads": None, "head_dim": None},
}


def from_config(model_type: str, layers: int = 4, seed: int = SEED, **kw):
    """A tiny causal LM of any family transformers ships, by its ``model_type``, through
    ``AutoConfig.for_model`` and ``AutoModelForCausalLM.from_config`` (dropout off)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
               num_hidden_layers=layers, vocab_size=256, max_position_embeddings=64,
               pad_token_id=0, bos_token_id=0, eos_token_id=0)
    cfg.update(FAMILY_FIELDS.get(model_type, {}))
    model_type = cfg.pop("model_type", model_type)  # a named variant of a family (falcon-mq-alibi)
    if model_type == "gptj":  # GPT-J names its sizes the GPT-2 way
        cfg = dict(n_embd=64, n_head=4, n_layer=layers, vocab_size=256, n_positions=64, rotary_dim=8,
                   bos_token_id=0, eos_token_id=0)
    for drop in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                 "residual_dropout", "embedding_dropout", "mlp_dropout"):
        cfg[drop] = 0.0
    cfg = {k: v for k, v in {**cfg, **kw}.items() if v is not None}
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))


def stream(step: int, rows: int, length: int, vocab: int = 256) -> torch.Tensor:
    """``rows x length`` token ids of a learnable stream (each token an affine function of the one before),
    seeded by ``step``: the same batch on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    cols = [torch.randint(0, vocab, (rows, 1), generator=g)]
    for _ in range(length - 1):
        cols.append((cols[-1] * 5 + 3) % vocab)
    return torch.cat(cols, 1)


def loop(model, opt, booster=None, *, steps: int, clip: float, first: int = 0, split=None, loss_of=None,
         mean_loss: bool = False):
    """The plain HF loop over steps ``first .. first + steps``: the step's loss, then
    :func:`support.engine.train_step` (the booster's backward and clip, or plain torch's). The loss is
    ``loss_of(model, s)``, by default the model's own with ``input_ids = labels = batch(s)[0]`` (the whole
    batch), or with ``split=(rank, world)`` this rank's slice of it (data parallel). Returns the losses
    (with ``split`` or ``mean_loss`` averaged over the ranks: each rank's loss is its share of the batch)
    and the gradient norms before clipping (every gradient, whole, in one number per step)."""
    if loss_of is None:
        def loss_of(model, s):
            x = (batch(s, *split)[0] if split else batch(s)[0]).contiguous()  # BERT's loss views its labels
            return model(input_ids=x, labels=x).loss

    losses, norms = [], []
    for s in range(first, first + steps):
        loss = loss_of(model, s)
        norms.append(train_step(model, opt, loss, clip, booster))
        losses.append(global_mean(loss) if split or mean_loss else loss.item())
    return losses, norms


def family_loop(model, opt, booster=None, *, steps: int, clip: float, rows: int, length: int,
                pipelined: bool = False, vocab: int = 256):
    """The loop ``test_hf_families.py`` and ``scripts/hf_sweep.py`` compare: ``steps`` steps of the plain HF
    loop on :func:`stream` batches (``rows x length``, the same on every rank), or ``execute_pipeline``, with the
    booster's (or torch's) clip at ``clip``. Returns the losses (the batch's: averaged over the ranks of a direct
    call, None on a rank without the last stage) and the gradient norms before clipping."""
    import torch.distributed as dist

    losses, norms = [], []
    for s in range(steps):
        x = stream(s, rows, length, vocab)
        if pipelined:
            loss = booster.execute_pipeline(iter([{"input_ids": x, "labels": x}]), model, None, opt)["loss"]
        else:
            loss = model(input_ids=x, labels=x).loss
            (booster.backward(loss, opt) if booster else loss.backward())
        norm = (booster.clip_grad_by_norm(opt, clip) if booster
                else torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
        if booster and not pipelined:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(None if loss is None else loss.item())
        norms.append(float(norm))
    return losses, norms


def pipeline_loop(model, opt, booster, *, steps: int, clip: float, first: int = 0, batch_of=None):
    """``booster.execute_pipeline`` over steps ``first .. first + steps`` with the model's own loss
    (criterion None), one batch dict a step (``batch_of(s)``, by default ``input_ids = labels = batch(s)[0]``),
    then the booster's clip, step and zero_grad. Returns the losses (None on a rank that holds no last
    stage) and the gradient norms before clipping."""
    if batch_of is None:
        def batch_of(s):
            x = batch(s)[0].contiguous()
            return {"input_ids": x, "labels": x}

    losses, norms = [], []
    for s in range(first, first + steps):
        out = booster.execute_pipeline(iter([batch_of(s)]), model, None, opt)
        norms.append(float(booster.clip_grad_by_norm(opt, clip)))
        opt.step()
        opt.zero_grad()
        losses.append(None if out["loss"] is None else float(out["loss"]))
    return losses, norms


def measured_run(build, plugin, data, lora_config=None, pipeline: bool = False, close: bool = False) -> dict:
    """What the memory planner's tests compare a plan with: under ``measure()``, ``build()`` boosted with
    AdamW under ``plugin`` (with ``lora_config``: its peft adapters first, ``booster.enable_lora``), then,
    in the meter's window, a step per batch of token ids in ``data``: the plain HF loop, or with
    ``pipeline`` ``execute_pipeline`` with HF batches and the model's own loss. Everything is freed (and
    with ``close`` the plugin closed) before the meter stops. Returns the peak bytes per tier and the
    losses (None on a rank that holds no last stage)."""
    import gc

    from colossal_lab.engine import Booster
    from colossal_lab.engine.planner.memory import measure

    with measure() as meter:
        model = build()
        booster = Booster(plugin=plugin)
        if lora_config is not None:
            model = booster.enable_lora(model, lora_config=lora_config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt, *_ = booster.boost(model, opt)
        meter.start_window()
        losses = []
        for x in data:
            if pipeline:  # HF batches, the model's own loss (criterion=None)
                res = booster.execute_pipeline(iter([{"input_ids": x, "labels": x}]), model, None, opt)
                losses.append(None if res["loss"] is None else float(res["loss"]))
            else:
                loss = model(input_ids=x, labels=x).loss
                booster.backward(loss, opt)
                losses.append(float(loss))
                del loss
            opt.step()
            opt.zero_grad()
        if close:
            plugin.close()
        del model, opt, booster
        gc.collect()
    return {"peak": dict(meter.peak), "losses": losses}


def error_of(fn) -> str:
    """The text of the ``ValueError`` ``fn()`` raises, or ``"no error"``: what a refusal test collects on each rank."""
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"


def configure_error(model, optimizer=None, **plugin_kw) -> str:
    """The ``ValueError`` text of ``HybridParallelPlugin(**plugin_kw).configure(model, ...)``, checked to come before
    any process group exists (the refusals' contract). ``optimizer`` defaults to AdamW over the model."""
    import pytest
    import torch.distributed as dist

    from colossal_lab.engine.plugins import HybridParallelPlugin

    optimizer = optimizer if optimizer is not None else torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError) as exc:
        HybridParallelPlugin(**plugin_kw).configure(model, optimizer)
    assert not dist.is_initialized()  # refused before any process group exists
    return str(exc.value)
