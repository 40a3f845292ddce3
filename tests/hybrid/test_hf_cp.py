"""transformers models under HybridParallelPlugin(cp_size=2) (ring and Ulysses) and (tp_size=2,
sequence_parallel=True), with the plain HF loop.

Tiny random models in fp32, trained 5 AdamW steps with ``loss = model(**batch).loss;
booster.backward(loss, optimizer)``, follow the single-process loss and gradient-norm curves within 1e-4
relative. Context parallelism (Llama, Qwen2, Mistral: grouped-query attention, rotary positions, q/k/v
biases, a sliding window longer than the sequence; GPT-2 and OPT: learned absolute positions, OPT's
taken from the attention mask; GPT-OSS: attention sinks, a mixture of experts, sliding layers with a window longer
than the sequence; Gemma 2: logit soft-capping): each rank holds a shard of every sequence (zig-zag
for the ring), the model's own rotary embedding takes the shard's global positions, and its loss the
labels shifted on the whole sequence; ring and Ulysses also with tp_size=2 (cp2 x tp2 on 4 ranks; GPT-OSS's ring
too).
Sequence parallelism (the same three, plus OPT's bare fc1/fc2 and
flattened tokens and GPT-2's Conv1D styles and reshape after the layers): every norm of the decoder
layers runs on half the tokens. Bad input is refused with an error naming the fix: at configure (before
any process group) Ulysses heads that do not divide, a non-causal encoder (BERT), attention dropout;
at the forward (before the collectives of the layer it reaches) a length that does not cut, a padding
mask (also through ``execute_pipeline``), a sliding window shorter than the sequence. With pipelines:
tests/hybrid/test_hf_pp_sp.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from support import hf  # noqa: E402
from support.dist import run_distributed  # noqa: E402
from support.engine import assert_follows, param_groups  # noqa: E402

STEPS, LR, CLIP = 5, hf.LR, 0.5  # AdamW's lr: support.hf says why not 1e-2
ROWS, T = 2, 16  # T divides 2 * cp (the ring's zig-zag chunks)
SOFTCAP = 0.02


# q/k/v biases (Qwen2), a sliding window (Mistral), Conv1D weights and learned positions (GPT-2), bare
# fc1/fc2 linears in the decoder layer and a final LayerNorm (OPT)
MODELS = {"llama": hf.llama, "qwen2": hf.qwen2, "mistral": hf.mistral, "gpt2": hf.gpt2, "opt": hf.opt,
          # attention sinks (one learned logit per head; their gradient reaches them through ring / Ulysses)
          "gpt_oss": functools.partial(hf.from_config, "gpt_oss", layers=2, num_local_experts=4, num_experts_per_tok=2),
          # logit soft-capping; a cap of SOFTCAP bends this tiny model's scores (the default 50 would not). Eager:
          # transformers 5.5 defaults Gemma 2 to SDPA, which drops the cap (5.24 picks eager itself)
          "gemma2": lambda: hf.from_config("gemma2", layers=2, attn_logit_softcapping=SOFTCAP,
                                           attn_implementation="eager"),
          # dispatches through AttentionInterface without declaring _supports_attention_backend (context.py)
          "stablelm": functools.partial(hf.from_config, "stablelm", layers=2)}


def _dispatches(name) -> bool:
    from colossal_lab.engine.models.hf.context import dispatches_attention

    with torch.device("meta"):
        return dispatches_attention(MODELS[name]())


def _loss(model, s):
    x = hf.stream(s, ROWS, T)
    return model(input_ids=x, labels=x, attention_mask=torch.ones_like(x)).loss


# the plain HF loop; a rank's loss is its share (the mean over ranks is the batch's; in one process, the loss)
_loop = functools.partial(hf.loop, steps=STEPS, clip=CLIP, loss_of=_loss, mean_loss=True)


def _reference(name):
    model = MODELS[name]()
    return _loop(model, torch.optim.AdamW(param_groups(model), lr=LR))


def _sink_grads(model, loop):
    """``(loop's result, [the attention sinks' gradients at each optimizer step])``: what reaches AdamW (averaged
    over cp, clipped), concatenated over the layers. The loss and norm curves alone would not show a sink gradient
    dropped (a sink's gradient is a small part of the norm, and 5 steps of AdamW move the sinks by little)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    sinks = [p for n, p in model.named_parameters() if n.endswith("sinks")]
    seen = []
    if not sinks:
        return loop(), seen
    handle = register_optimizer_step_pre_hook(lambda *_: seen.append(torch.cat([
        (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().flatten() for p in sinks])))
    try:
        out = loop()
    finally:
        handle.remove()
    return out, seen


def _reference_sink_grads(name):
    model = MODELS[name]()
    return _sink_grads(model, lambda: _loop(model, torch.optim.AdamW(param_groups(model), lr=LR)))[1]


def _boost(name, **plugin_kw):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    plugin = HybridParallelPlugin(**plugin_kw)
    booster = Booster(plugin=plugin)
    model = MODELS[name]() if isinstance(name, str) else name()
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    model, opt, *_ = booster.boost(model, opt)
    return plugin, booster, model, opt


def _train(name, mode, **extra):
    from colossal_lab.engine import context_parallel as cp

    if mode == "sp":
        return _train_sp(name)
    plugin, booster, model, opt = _boost(name, cp_size=2, cp_mode=mode, **extra)
    cp.COMM.reset()
    (losses, norms), sinks = _sink_grads(model, lambda: _loop(model, opt, booster))
    out = {"losses": losses, "norms": norms, "cp_bytes": cp.COMM.total, "sink_grads": sinks,
           "impl": model.stage_modules[0].inner.config._attn_implementation}
    plugin.close()
    return out


def _tokens(t):  # (B, T, C), or (B*T, C) where a layer flattened them
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() // t.shape[-1]


def _train_sp(name):
    """tp2 with sequence parallelism; records how many tokens each norm of the decoder layers saw."""
    from colossal_lab.engine.models.hf.pipeline import layout
    from colossal_lab.engine.models.hf.sequence import is_norm

    plugin, booster, model, opt = _boost(name, tp_size=2, sequence_parallel=True)
    inner = model.stage_modules[0].inner
    seen, layers = {}, layout(inner).layers + "."
    for n, m in inner.named_modules():
        if is_norm(m) and n.startswith(layers):
            m.register_forward_pre_hook(lambda mod, a, n=n: seen.setdefault(n, _tokens(a[0])) and None)
    losses, norms = _loop(model, opt, booster)
    plugin.close()
    return {"losses": losses, "norms": norms, "norm_tokens": seen}


def _refusals_at_forward():
    """Bad input at the forward of a boosted model: each refused before any collective, on every rank alike."""
    out = {}
    x = hf.stream(0, ROWS, T)
    plugin, booster, model, opt = _boost("llama", cp_size=2, cp_mode="ring")
    out["odd_length"] = hf.error_of(lambda: model(input_ids=x[:, :14], labels=x[:, :14]))
    mask = torch.ones_like(x)
    mask[0, -3:] = 0
    out["padding"] = hf.error_of(lambda: model(input_ids=x, attention_mask=mask, labels=x))
    out["pipeline"] = hf.error_of(lambda: booster.execute_pipeline(
        iter([{"input_ids": x, "attention_mask": mask, "labels": x}]), model, None, opt))
    out["still_runs"] = model(x, labels=x).loss.item()  # positional input_ids too, after the refusals
    plugin.close()
    plugin, booster, model, opt = _boost(lambda: hf.mistral(sliding_window=8), cp_size=2, cp_mode="ulysses")
    out["window"] = hf.error_of(lambda: model(input_ids=x, labels=x))
    plugin.close()
    plugin, booster, model, opt = _boost("llama", tp_size=2, sequence_parallel=True)
    out["sp_length"] = hf.error_of(lambda: model(input_ids=x[:, :15], labels=x[:, :15]))
    plugin.close()
    return out


CASES = [("llama", "ring"), ("llama", "ulysses"), ("qwen2", "ring"), ("qwen2", "ulysses"), ("mistral", "ring"),
         ("gpt2", "ring"), ("gpt2", "ulysses"), ("opt", "ring"), ("opt", "ulysses"),  # learned positions
         ("gpt_oss", "ring"), ("gpt_oss", "ulysses"), ("gemma2", "ring"), ("gemma2", "ulysses"),  # sinks, softcap
         ("llama", "sp"), ("qwen2", "sp"), ("mistral", "sp"), ("opt", "sp"), ("gpt2", "sp")]
CASES += [("stablelm", "ring")]  # run where the installed release dispatches StableLM's attention (_all)


def _all(rank, world):
    out = {case: _train(*case) if case[0] != "stablelm" or _dispatches(case[0]) else None for case in CASES}
    out["refused"] = _refusals_at_forward()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all, 2, timeout=500, preload=True)


TP_CASES = [("llama", "ring"), ("llama", "ulysses"), ("gpt_oss", "ring")]  # with tp_size=2: cp2 x tp2 on 4 ranks


def _no_tp_plan(name):
    """transformers 5.5 (the floor) ships no tensor-parallel plan for GPT-OSS (5.24 cuts its embedding only)."""
    with torch.device("meta"):
        model = MODELS[name]()
    return not (getattr(model, "tp_plan", None) or getattr(model.config, "base_model_tp_plan", None))


def _all_tp(rank, world):
    return {case: {"no_plan": True} if _no_tp_plan(case[0]) else _train(*case, tp_size=2) for case in TP_CASES}


@pytest.fixture(scope="module")
def runs_tp():
    return run_distributed(_all_tp, 4, timeout=500, preload=True)


@pytest.mark.parametrize("case", TP_CASES, ids=["-".join(c) for c in TP_CASES])
def test_cp_composes_with_tensor_parallelism(runs_tp, case):
    """Each tp rank's attention holds half the heads (Ulysses cuts those again over cp)."""
    if runs_tp[0][case].get("no_plan"):
        import transformers

        pytest.skip(f"transformers {transformers.__version__} ships no tensor-parallel plan for {case[0]}")
    ref, ref_norms = _reference(case[0])
    for r in runs_tp:
        assert_follows(case, r[case]["losses"], r[case]["norms"], ref, ref_norms)
        assert r[case]["cp_bytes"] > 0
        if case[0] == "gpt_oss":
            _assert_sink_grads(case, r[case]["sink_grads"], _reference_sink_grads(case[0]))


def _assert_sink_grads(case, got, want):
    assert len(got) == len(want) == STEPS and want[0].numel() > 0, (case, len(got), len(want))
    for s, (g, w) in enumerate(zip(got, want)):
        scale = w.abs().max().item()
        assert scale > 1e-5 and (g - w).abs().max().item() <= 1e-4 * scale, (case, s, g, w)


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_hf_decoder_under_cp_follows_its_single_process_curve(runs, case):
    if any(r[case] is None for r in runs):
        pytest.skip(f"the installed transformers' {case[0]} does not dispatch its attention through the registry")
    ref, ref_norms = _reference(case[0])
    for r in runs:
        got = r[case]
        assert_follows(case, got["losses"], got["norms"], ref, ref_norms)
        if case[1] == "sp":  # every norm between the regions ran on this rank's half of the sequence
            seen = got["norm_tokens"]
            assert len(seen) == 4 and set(seen.values()) == {ROWS * T // 2}, seen
            continue
        assert got["impl"].startswith("colossal_lab_cp_" + case[1])  # transformers dispatched to ours
        assert got["cp_bytes"] > 0  # and it talked over the cp group
        if case[0] == "gpt_oss":  # the sinks' gradients, step by step, within 1e-4 of their largest
            _assert_sink_grads(case, got["sink_grads"], _reference_sink_grads(case[0]))
    assert ref[-1] < ref[0]
    assert min(ref_norms) > CLIP  # the clip acted on every step, so a wrong norm would move the curve


def test_bad_input_at_the_forward_is_refused(runs):
    for r in runs:
        got = r["refused"]
        assert "16 equal" not in got["odd_length"] and "14 tokens" in got["odd_length"], got["odd_length"]
        assert "divisible by 4" in got["odd_length"]
        assert "attention_mask" in got["padding"] and "padding" in got["padding"]
        assert "attention_mask" in got["pipeline"] and "padding" in got["pipeline"], got["pipeline"]
        assert "sliding_window=8" in got["window"]
        assert "sequence_parallel=True" in got["sp_length"] and "15 tokens" in got["sp_length"], got["sp_length"]
        assert got["still_runs"] > 0
    # a shard's loss: the two ranks' differ (unequal shards of the sum), their mean is the batch's
    assert runs[0]["refused"]["still_runs"] != runs[1]["refused"]["still_runs"]


def test_bad_layouts_are_refused_before_any_group():
    msg = hf.configure_error(hf.llama(num_attention_heads=6, num_key_value_heads=6, hidden_size=48), cp_size=4,
                             cp_mode="ulysses")
    assert "6 heads" in msg and "cp_mode='ring'" in msg and "[1, 2, 3, 6]" in msg, msg
    msg = hf.configure_error(hf.bert(), cp_size=2)
    assert "not causal" in msg and "BERT" in msg, msg
    msg = hf.configure_error(hf.llama(attention_dropout=0.1), cp_size=2)
    assert "config.attention_dropout=0.1" in msg, msg
    # layers mixing tokens outside the attention function, named by config.layer_types (the sweep found MiniMax's
    # linear attention giving a wrong curve under cp2, and no Conv1d to tell it by)
    msg = hf.configure_error(hf.from_config("minimax", layers=2), cp_size=2)
    assert "['linear_attention']" in msg and "cp_size=1" in msg, msg
