"""transformers decoders under sequence and context parallelism *with* pipelines, on 4 ranks.

``HybridParallelPlugin(tp_size=2, sequence_parallel=True, pp_size=2)`` (tp2 + sp + pp2, as a Colossal-AI
user runs it) and ``HybridParallelPlugin(cp_size=2, pp_size=2)`` (ring and Ulysses), through
``booster.execute_pipeline`` with HF batches and the model's own loss. Tiny random 4-layer models (no hub),
fp32, 5 AdamW steps with clipping at 0.5 (below every gradient norm here, so the clip acts each step):
the loss on the ranks holding the last stage and the gradient norm on every rank follow the plain HF
loop in one process within 1e-4 relative at every step. Between the stages the p2p buffers carry the
rank's sequence shard (``(B/m, T/2, C)``, checked on every stage but the last); under sp every norm of
the stage's layers runs on half the tokens; under cp transformers dispatches attention to the engine's
ring / Ulysses function, which talks over the cp group, and each stage's rotary embedding (or learned
positions) takes the shard's global positions (a wrong position would move the curve). Bad input reaching
``execute_pipeline`` (a length that does not cut, a padding mask) is refused on every rank alike before
the schedule's first send (the world then runs on). One launch, every case inside the rank function.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from support import hf  # noqa: E402
from support.dist import run_distributed  # noqa: E402
from support.engine import GLOBAL_BATCH, SEQ, assert_follows, batch, param_groups  # noqa: E402

STEPS, LR, CLIP = 5, hf.LR, 0.5  # AdamW's lr: support.hf says why not 1e-2
ROWS, T, LAYERS, HIDDEN = GLOBAL_BATCH, SEQ, 4, 64  # 8 x 32: T cuts into 2 * cp zig-zag chunks and tp shards

# rotary + grouped kv heads (Llama), q/k/v biases (Qwen2), a sliding window longer than T (Mistral),
# Conv1D, learned positions and a tied head (GPT-2: built-in layout), flattened tokens in its MLP (OPT)
MODELS = {name: functools.partial(getattr(hf, name), layers=LAYERS)
          for name in ("llama", "qwen2", "mistral", "gpt2", "opt")}

MODES = {"sp": dict(tp_size=2, sequence_parallel=True, pp_size=2),
         "sp_ckpt": dict(tp_size=2, sequence_parallel=True, pp_size=2, activation_checkpointing=True),
         "ring": dict(cp_size=2, cp_mode="ring", pp_size=2),
         "ulysses": dict(cp_size=2, cp_mode="ulysses", pp_size=2),
         "ring_dp": dict(cp_size=2, cp_mode="ring")}  # no pipeline: cp2 x dp2, execute_pipeline's own loop
SCHEDULES = {"1f1b": dict(num_microbatches=2), "gpipe": dict(num_microbatches=2, pp_style="gpipe"),
             "interleaved": dict(num_microbatches=4, pp_style="interleaved", num_model_chunks=2),
             "zb": dict(num_microbatches=4, pp_style="zb", num_model_chunks=2)}

CASES = [("llama", "sp", "1f1b"), ("llama", "sp", "gpipe"), ("llama", "sp", "interleaved"), ("llama", "sp", "zb"),
         ("llama", "sp_ckpt", "1f1b"), ("qwen2", "sp", "1f1b"), ("gpt2", "sp", "1f1b"), ("opt", "sp", "1f1b"),
         ("llama", "ring", "1f1b"), ("llama", "ulysses", "1f1b"), ("llama", "ring", "interleaved"),
         ("qwen2", "ring", "1f1b"), ("mistral", "ulysses", "1f1b"), ("gpt2", "ring", "1f1b"),
         ("llama", "ring_dp", "1f1b")]


def _x(s):  # test_hf_pp.py's batches (docs/hf.md: why not hf.stream's)
    return batch(s)[0].contiguous()


def _batch(s):
    return {"input_ids": _x(s), "labels": _x(s)}


def _loss(model, s):
    return model(input_ids=_x(s), labels=_x(s)).loss


@functools.lru_cache(maxsize=None)
def _reference(name):
    """The plain HF loop in one process: losses and gradient norms before clipping."""
    model = MODELS[name]()
    return hf.loop(model, torch.optim.AdamW(param_groups(model), lr=LR), steps=STEPS, clip=CLIP, loss_of=_loss)


def _boost(name, mode, schedule):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    kw = dict(MODES[mode])
    kw.update(SCHEDULES[schedule] if kw.get("pp_size", 1) > 1 else dict(num_microbatches=2))
    plugin = HybridParallelPlugin(**kw)
    booster = Booster(plugin=plugin)
    model = MODELS[name]()
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    model, opt, *_ = booster.boost(model, opt)
    return plugin, booster, model, opt


def _tokens(t):  # (B, T, C), or (B*T, C) where a layer flattened them
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() // t.shape[-1]


def _train(name, mode, schedule):
    """One boosted run; the p2p shapes each non-last stage sent, the tokens each norm of a stage's layers saw
    (sp), the attention implementation and the bytes the cp group moved (cp)."""
    from colossal_lab.engine import context_parallel as cp
    from colossal_lab.engine.models.hf.pipeline import owned_layers
    from colossal_lab.engine.models.hf.sequence import is_norm

    plugin, booster, model, opt = _boost(name, mode, schedule)
    sent, seen, last = set(), {}, plugin.pp_size * plugin.num_model_chunks - 1
    for st in model.stage_modules:
        if st.inner.stage_index != last:
            st.register_forward_hook(lambda mod, a, out: sent.add(tuple(out.shape)))
        for _, lname, layer in owned_layers(st.inner):
            for n, m in layer.named_modules(prefix=lname):
                if is_norm(m):
                    m.register_forward_pre_hook(lambda mod, a, n=n: seen.setdefault(n, _tokens(a[0])) and None)
    cp.COMM.reset()
    losses, norms = hf.pipeline_loop(model, opt, booster, steps=STEPS, clip=CLIP, batch_of=_batch)
    out = {"losses": losses, "norms": norms, "sent": sorted(sent), "norm_tokens": seen, "cp_bytes": cp.COMM.total,
           "impl": model.stage_modules[0].inner.config._attn_implementation}
    plugin.close()
    return out


def _refusals():
    """Bad batches at execute_pipeline: refused on every rank before any send, and the pipeline runs on."""
    out = {}
    x = _x(0)
    plugin, booster, model, opt = _boost("llama", "sp", "1f1b")
    out["sp_length"] = hf.error_of(lambda: booster.execute_pipeline(
        iter([{"input_ids": x[:, :31], "labels": x[:, :31]}]), model, None, opt))
    out["sp_runs_on"] = booster.execute_pipeline(iter([_batch(0)]), model, None, opt)["loss"] is not None
    plugin.close()
    plugin, booster, model, opt = _boost("llama", "ring", "1f1b")
    mask = torch.ones_like(x)
    mask[0, -3:] = 0
    out["cp_padding"] = hf.error_of(lambda: booster.execute_pipeline(
        iter([{"input_ids": x, "attention_mask": mask, "labels": x}]), model, None, opt))
    out["cp_length"] = hf.error_of(lambda: booster.execute_pipeline(
        iter([{"input_ids": x[:, :30], "labels": x[:, :30]}]), model, None, opt))
    res = booster.execute_pipeline(iter([{**_batch(0), "attention_mask": torch.ones_like(x)}]), model, None, opt)
    out["cp_runs_on"] = res["loss"] is not None
    plugin.close()
    return out


def _all(rank, world):
    out = {case: _train(*case) for case in CASES}
    out["refused"] = _refusals()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all, 4, timeout=600, preload=True)


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_sp_and_cp_with_pipelines_follow_the_single_process_curve(runs, case):
    name, mode, schedule = case
    ref, ref_norms = _reference(name)
    last_ranks = 0
    for r in runs:
        got = r[case]
        assert got["norms"] == pytest.approx(ref_norms, rel=1e-4), (case, got["norms"], ref_norms)
        if got["losses"][0] is not None:
            last_ranks += 1
            assert_follows(case, got["losses"], got["norms"], ref, ref_norms)
        m = (SCHEDULES[schedule] if mode != "ring_dp" else {"num_microbatches": 2})["num_microbatches"]
        if mode != "ring_dp":  # the p2p buffers: this rank's sequence shard of each microbatch
            assert got["sent"] == [(ROWS // m, T // 2, HIDDEN)] or not got["sent"], (case, got["sent"])
        if mode.startswith("sp"):  # every norm of the stage's layers ran on half the tokens
            assert got["norm_tokens"] and set(got["norm_tokens"].values()) == {ROWS // m * T // 2}, got["norm_tokens"]
        else:
            assert got["impl"].startswith("colossal_lab_cp_" + MODES[mode]["cp_mode"]), got["impl"]
            assert got["cp_bytes"] > 0
    assert last_ranks == (4 if mode == "ring_dp" else 2)
    senders = 0 if mode == "ring_dp" else 4 if SCHEDULES[schedule].get("num_model_chunks", 1) > 1 else 2
    assert sum(bool(r[case]["sent"]) for r in runs) == senders
    assert min(ref[1:]) < ref[0] and min(ref_norms) > CLIP  # it learns; the clip acted every step


def test_bad_batches_are_refused_before_the_schedule(runs):
    for r in runs:
        got = r["refused"]
        assert "sequence_parallel=True" in got["sp_length"] and "31 tokens" in got["sp_length"], got["sp_length"]
        assert "attention_mask" in got["cp_padding"] and "padding" in got["cp_padding"], got["cp_padding"]
        assert "30" in got["cp_length"] and "cp_size=2" in got["cp_length"], got["cp_length"]
    assert sum(r["refused"]["sp_runs_on"] for r in runs) == 2 and sum(r["refused"]["cp_runs_on"] for r in runs) == 2


def test_what_does_not_compose_with_pipelines_is_refused_before_any_group():
    pp = dict(pp_size=2, num_microbatches=2)
    msg = hf.configure_error(hf.bert(layers=LAYERS), cp_size=2, **pp)  # an encoder: no causal ring
    assert "not causal" in msg and "cp_size=1" in msg, msg
    msg = hf.configure_error(hf.from_config("xlm", dff=128), tp_size=2, sequence_parallel=True, **pp)  # no layer list
    assert "base_model_pp_plan" in msg and "4 lists of 4 blocks" in msg, msg
    # Gemma 4's per-layer embeddings are looked up from the token ids in every layer: a later stage hung (the sweep)
    gemma4 = hf.from_config("gemma4_text", layers=LAYERS, hidden_size_per_layer_input=8, vocab_size_per_layer_input=256)
    msg = hf.configure_error(gemma4, **pp)
    assert "hidden_size_per_layer_input=8" in msg and "pp_size=1" in msg, msg
    msg = hf.configure_error(gemma4, tp_size=2, sequence_parallel=True)  # and under sp (the sweep: a shape crash)
    assert "hidden_size_per_layer_input" in msg and "sequence_parallel=False" in msg, msg
    # HY-V4's layers pass 4 hyper-connection streams and the previous layer's top-k indices on (the sweep: a crash);
    # older transformers (the floor, 5.5) do not ship the family: its refusals are checked where it exists
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "hy_v4" in CONFIG_MAPPING:
        _hy_v4_refused(pp)
    from colossal_lab.engine.plugins import HybridParallelPlugin

    with pytest.raises(ValueError, match="both cut the sequence"):  # sp and cp together, with or without pp
        HybridParallelPlugin(tp_size=2, sequence_parallel=True, cp_size=2, **pp)
    with pytest.raises(ValueError, match="sequence_parallel=False"):  # sp is 1D's
        HybridParallelPlugin(tp_size=4, tp_mode="2d", sequence_parallel=True, **pp)


def _hy_v4_refused(pp):
    """HY-V4 (transformers after 5.5): its pipeline refusals."""
    hy_v4 = hf.from_config("hy_v4", layers=LAYERS, n_routed_experts=4, moe_intermediate_size=32, q_lora_rank=32,
                           kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                           index_head_dim=16, index_n_heads=2, index_topk=8, qk_head_dim=32)
    msg = hf.configure_error(hy_v4, **pp)
    assert "config.hc_mult=4" in msg and "pp_size=1" in msg, msg
    hy_v4.config.hc_mult = 1  # without hyper-connections, the carried indices alone are refused
    msg = hf.configure_error(hy_v4, **pp)
    assert "['prev_topk_indices']" in msg and "pp_size=1" in msg, msg
