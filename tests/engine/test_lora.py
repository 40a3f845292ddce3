"""``Booster.enable_lora`` / ``save_lora_as_pretrained`` (engine/lora.py) with real peft on a tiny random
Llama: under DDP, ZeRO-1/2, Gemini, hybrid tp=2 and pp=2 on 2 real ranks and tp=2 x pp=2 on 4 (and our GPT
under pp=2), LoRA
training follows single-process PEFT training (fp32, 5 steps), only adapters are in the optimizer
state, the frozen base weights stay bit-for-bit, and the saved adapter loads with
``peft.PeftModel.from_pretrained`` to the same logits. Bad arguments fail before any process group."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from support.dist import run_distributed  # noqa: E402

from colossal_lab.engine import Booster  # noqa: E402

STEPS, LR, BATCH, SEQ, VOCAB = 5, 1e-2, 4, 16, 128
TARGETS = ["q_proj", "v_proj", "down_proj"]
PLUGINS = ("ddp", "zero1", "zero2", "gemini", "tp2")
RTOL = 1e-4


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def lora_config():
    # random A and B (not B = 0), so the adapters change the logits from the first step on
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)


def lora_llama():
    base = tiny_llama()
    torch.manual_seed(1)
    return peft.get_peft_model(base, lora_config())


def batches():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def adapters(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def reference():
    """Single-process PEFT training on the full batches: losses, final adapters, logits on batch 0."""
    model = lora_llama()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for x in batches():
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, adapters(model)


def make_plugin(name):
    from colossal_lab.engine.plugins import DDPPlugin, GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin

    return {"ddp": lambda: DDPPlugin(), "zero1": lambda: LowLevelZeroPlugin(stage=1),
            "zero2": lambda: LowLevelZeroPlugin(stage=2),
            "gemini": lambda: GeminiPlugin(placement_policy="cpu", precision="fp32"),
            "tp2": lambda: HybridParallelPlugin(tp_size=2, precision="fp32")}[name]()


def state_names(model, optimizer) -> list:
    """Names of the parameters this rank holds optimizer state for (Gemini: its checkpoint keys)."""
    from colossal_lab.engine.gemini.zero_optim import GeminiOptimizer

    if isinstance(optimizer, GeminiOptimizer):
        return sorted({k.split(".", 1)[1].rsplit(".", 1)[0] for k in optimizer.state_dict()})
    names = {id(p): n for n, p in model.named_parameters()}
    return sorted(names.get(id(p), "?") for p in optimizer.state)


def train_one(rank, world, name, out_dir):
    """One plugin: boost a fresh LoRA Llama, train STEPS steps on this rank's rows, save the adapters."""
    base = tiny_llama()
    frozen = {n: p.detach().clone() for n, p in base.named_parameters()}
    booster = Booster(plugin=make_plugin(name), mixed_precision="fp32")
    torch.manual_seed(1)
    model = booster.enable_lora(base, lora_config=lora_config())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)  # the usual way: boost keeps only the adapters
    gm, gopt, *_ = booster.boost(model, opt)
    dp = 1 if name == "tp2" else world  # tp2 on 2 ranks: one data-parallel rank, the whole batch
    b, rank_dp = BATCH // dp, rank % dp
    losses, chunks = [], None
    for x in batches():
        rows = x[rank_dp * b:(rank_dp + 1) * b]
        loss = gm(input_ids=rows, labels=rows).loss
        booster.backward(loss, gopt)
        if name == "gemini" and chunks is None:
            chunks = _chunk_facts(gm.manager)
        gopt.step()
        gopt.zero_grad()
        losses.append(loss.item())
    from colossal_lab.engine.lora import find_peft_model, full_trainable_state

    peft_model = find_peft_model(gm)
    # before any forward outside training: FSDP2 keeps the root unsharded after a forward
    held = state_names(peft_model, gopt)
    in_groups = [p.requires_grad for g in gopt.param_groups for p in g["params"]]
    booster.save_lora_as_pretrained(gm, out_dir)
    trained = full_trainable_state(gm, peft_model)
    full = _full_params(gm)
    base_now = {n.replace("base_model.model.", "", 1).replace(".base_layer", ""): t
                for n, t in full.items() if "lora_" not in n}
    changed = sorted(n for n, t in frozen.items() if not torch.equal(t, base_now[n]))
    x = batches()[0]
    with torch.no_grad():
        logits = gm(input_ids=x).logits.detach().cpu()
    placements = {n: str(getattr(p, "placements", "whole")) for n, p in peft_model.named_parameters()}
    out = dict(losses=losses, state=held, in_groups=in_groups, chunks=chunks, placements=placements,
               trained=trained, changed=changed, logits=logits)
    if hasattr(booster.plugin, "close"):
        booster.plugin.close()
    return out


def _full_params(gm) -> dict:
    """Every parameter of the boosted model, whole, on CPU (collective under Gemini/FSDP2)."""
    from colossal_lab.engine.gemini.zero_model import GeminiModel

    if isinstance(gm, GeminiModel):
        return gm.state_dict()
    from colossal_lab.engine.lora import find_peft_model

    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to("cpu", copy=True)
            for n, p in find_peft_model(gm).named_parameters()}


def _chunk_facts(mgr) -> list:
    """Per Gemini chunk after a backward: (frozen, trainable params, frozen params, state block
    elements, shard elements, holds a gradient)."""
    out = []
    for c in mgr.chunks:
        block = mgr.state_block(c)
        n_train = sum(i.param.requires_grad for i in c.infos)
        out.append((c.frozen, n_train, len(c.infos) - n_train, None if block is None else block.numel(),
                    c.shard_size, mgr.has_grad(c)))
    return out


# ---- our GPT under pp=2 (peft on a plain nn.Module; the pipeline splits the base model) -------------
GPT_TARGETS = ["wq", "wv", "w2"]


def gpt_lora_config():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=GPT_TARGETS, lora_dropout=0.0, init_lora_weights=False)


def tiny_gpt():
    from support.engine import tiny_model

    m = tiny_model()
    torch.manual_seed(1)  # the adapters' random init
    return m


def gpt_batches():
    g = torch.Generator().manual_seed(3)
    xs = [torch.randint(0, 256, (BATCH, SEQ), generator=g) for _ in range(STEPS)]
    return [(x, torch.roll(x, -1, 1)) for x in xs]


def gpt_reference():
    """Single-process peft on the GPT: losses, final adapters, logits on batch 0."""
    model = peft.get_peft_model(tiny_gpt(), gpt_lora_config())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for x, y in gpt_batches():
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        logits, _ = model(gpt_batches()[0][0])
    return losses, adapters(model), logits


def train_pp(rank, world, out_dir):
    from support.engine import lm_loss

    from colossal_lab.engine.plugins import HybridParallelPlugin

    base = tiny_gpt()
    frozen = {n: p.detach().clone() for n, p in base.named_parameters()}
    booster = Booster(plugin=HybridParallelPlugin(pp_size=2, num_microbatches=2, precision="fp32"),
                      mixed_precision="fp32")
    model = booster.enable_lora(base, lora_config=gpt_lora_config())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    gm, gopt, *_ = booster.boost(model, opt, lm_loss)
    losses = _pipeline_steps(booster, gm, gopt, [{"idx": x, "targets": y} for x, y in gpt_batches()], lm_loss)
    return dict(losses=losses, **_pipelined_facts(booster, gm, gopt, frozen, out_dir))


def _pipeline_steps(booster, gm, gopt, batches_, criterion=None) -> list:
    """One ``execute_pipeline`` step per batch; the losses (None on a rank without the last stage)."""
    losses = []
    for b in batches_:
        out = booster.execute_pipeline(iter([b]), gm, criterion, gopt)
        gopt.step()
        gopt.zero_grad()
        losses.append(None if out.get("loss") is None else float(out["loss"]))
    return losses


def _pipelined_facts(booster, gm, gopt, frozen, out_dir) -> dict:
    """After training a pipelined LoRA model: the parameters holding optimizer state (PEFT's names), the
    trained adapters, the base weights that changed (none should), and the adapter saved to ``out_dir``."""
    from colossal_lab.engine.lora import find_peft_model, full_trainable_state

    names = {id(p): n for n, p in gm.named_model_parameters()}
    held = sorted("base_model.model." + names.get(id(p), "?") for p in gopt.state)
    trained = full_trainable_state(gm, find_peft_model(gm))
    booster.save_lora_as_pretrained(gm, out_dir)
    full = gm.full_state_dict()
    changed = sorted(n for n, t in frozen.items()
                     if not torch.equal(t, full[n if n in full else n.replace(".weight", ".base_layer.weight")]))
    return dict(state=held, trained=trained, changed=changed)


# ---- the Llama under pp=2 and tp=2 x pp=2 (the pipeline splits the base model, adapters in its layers) ---
HF_PP = {"hf_pp2": dict(pp_size=2, num_microbatches=2), "tp2_pp2": dict(tp_size=2, pp_size=2, num_microbatches=2)}


def train_hf_pp(rank, world, name, out_dir):
    """One pipelined run of the LoRA Llama through execute_pipeline (the model's own loss), the whole batch
    (no data parallelism): losses on the last stage, the adapters' placements, the trained adapters, the
    saved adapter, the trained logits (eval) on the last stage."""
    from colossal_lab.engine.plugins import HybridParallelPlugin

    base = tiny_llama()
    frozen = {n: p.detach().clone() for n, p in base.named_parameters()}
    plugin = HybridParallelPlugin(precision="fp32", **HF_PP[name])
    booster = Booster(plugin=plugin, mixed_precision="fp32")
    torch.manual_seed(1)
    model = booster.enable_lora(base, lora_config=lora_config())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    gm, gopt, *_ = booster.boost(model, opt)
    losses = _pipeline_steps(booster, gm, gopt, [{"input_ids": x, "labels": x} for x in batches()])
    placements = {"base_model.model." + n: str(getattr(p, "placements", "whole"))
                  for n, p in gm.named_model_parameters()}
    facts = _pipelined_facts(booster, gm, gopt, frozen, out_dir)
    gm.eval()
    x = batches()[0]
    logits = booster.execute_pipeline(iter([{"input_ids": x, "labels": x}]), gm, None, gopt,
                                      return_outputs=True)["outputs"]
    if logits is not None:
        logits = (logits.full_tensor() if hasattr(logits, "full_tensor") else logits).detach().cpu()
    plugin.close()
    return dict(losses=losses, placements=placements, logits=logits, **facts)


def rank_fn(rank, world, root):
    out = {name: train_one(rank, world, name, f"{root}/{name}") for name in PLUGINS}
    out["pp2"] = train_pp(rank, world, f"{root}/pp2")
    out["hf_pp2"] = train_hf_pp(rank, world, "hf_pp2", f"{root}/hf_pp2")
    return out


def rank_fn4(rank, world, root):
    return {"tp2_pp2": train_hf_pp(rank, world, "tp2_pp2", f"{root}/tp2_pp2")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return root, run_distributed(rank_fn, 2, str(root), timeout=600, preload=True), reference()


@pytest.fixture(scope="module")
def runs4(runs):
    root = runs[0]
    return root, run_distributed(rank_fn4, 4, str(root), timeout=600, preload=True), runs[2]


def _close(a, b):
    return torch.allclose(torch.as_tensor(a), torch.as_tensor(b), rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("name", PLUGINS)
def test_lora_follows_single_process_peft(runs, name):
    _, ranks, (ref_losses, ref_adapters) = runs
    losses = [sum(r[name]["losses"][i] for r in ranks) / len(ranks) for i in range(STEPS)]
    assert _close(losses, ref_losses), (name, losses, ref_losses)
    trained = ranks[0][name]["trained"]
    assert set(trained) == set(ref_adapters)
    for n, t in ref_adapters.items():
        assert _close(trained[n], t), (name, n, (trained[n] - t).abs().max())


@pytest.mark.parametrize("name", PLUGINS)
def test_only_adapters_have_optimizer_state(runs, name):
    _, ranks, (_, ref_adapters) = runs
    held = set().union(*(r[name]["state"] for r in ranks))
    assert held == set(ref_adapters), (name, sorted(held - set(ref_adapters))[:4])
    # boost trimmed the user's AdamW(model.parameters()): no frozen parameter in any param group
    assert all(r[name]["in_groups"] and all(r[name]["in_groups"]) for r in ranks), name


@pytest.mark.parametrize("name", PLUGINS)
def test_frozen_base_weights_unchanged(runs, name):
    _, ranks, _ = runs
    assert all(r[name]["changed"] == [] for r in ranks), name


@pytest.mark.parametrize("name", PLUGINS)
def test_saved_adapter_loads_in_peft(runs, name):
    root, ranks, _ = runs
    loaded = peft.PeftModel.from_pretrained(tiny_llama(), str(root / name)).eval()
    with torch.no_grad():
        logits = loaded(input_ids=batches()[0]).logits
    assert torch.allclose(logits, ranks[0][name]["logits"], rtol=RTOL, atol=1e-5)


def test_gemini_frozen_chunks_hold_no_optimizer_state_or_gradients(runs):
    _, ranks, _ = runs
    for r in ranks:
        facts = r["gemini"]["chunks"]
        assert any(f[0] for f in facts) and not all(f[0] for f in facts)  # both kinds exist
        for frozen, n_train, n_frozen, block, shard, has_grad in facts:
            assert not (n_train and n_frozen), "a chunk mixes adapters and frozen weights"
            if frozen:
                assert n_train == 0 and block == shard and not has_grad  # the master alone, no moments
            else:
                assert n_frozen == 0 and block == 3 * shard and has_grad


def test_tp2_shards_adapters_like_their_base_layer(runs):
    """colwise q_proj/v_proj: A whole, B's output rows sharded; rowwise down_proj: A's input columns
    sharded, B whole (engine/lora_tp.py)."""
    _, ranks, _ = runs
    got = ranks[0]["tp2"]["placements"]
    for layer in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"):
        pre = f"base_model.model.model.layers.0.{layer}"
        base, a, b = (got[f"{pre}.{k}.weight"] for k in ("base_layer", "lora_A.default", "lora_B.default"))
        if layer.startswith("mlp"):
            assert (base, a, b) == ("(Shard(dim=1),)", "(Shard(dim=1),)", "whole"), layer
        else:
            assert (base, a, b) == ("(Shard(dim=0),)", "whole", "(Shard(dim=0),)"), layer


def test_pp2_gpt_follows_single_process_peft(runs):
    root, ranks, _ = runs
    ref_losses, ref_adapters, ref_logits = gpt_reference()
    last = ranks[-1]["pp2"]  # the last stage reports the loss
    assert _close(last["losses"], ref_losses), (last["losses"], ref_losses)
    trained = ranks[0]["pp2"]["trained"]
    assert set(trained) == set(ref_adapters)
    for n, t in ref_adapters.items():
        assert _close(trained[n], t), (n, (trained[n] - t).abs().max())
    held = set().union(*(r["pp2"]["state"] for r in ranks))
    assert held == set(ref_adapters)  # the two stages' optimizers together: the adapters, nothing else
    assert all(r["pp2"]["changed"] == [] for r in ranks)
    loaded = peft.PeftModel.from_pretrained(tiny_gpt(), str(root / "pp2")).eval()
    with torch.no_grad():
        logits, _ = loaded(gpt_batches()[0][0])
    assert torch.allclose(logits, ref_logits, rtol=RTOL, atol=1e-5)


def test_enable_lora_from_pretrained_dir(runs):
    root, ranks, _ = runs
    model = Booster().enable_lora(tiny_llama(), pretrained_dir=str(root / "ddp"))
    assert isinstance(model, peft.PeftModel)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(ranks[0]["ddp"]["trained"])
    with torch.no_grad():
        logits = model(input_ids=batches()[0]).logits
    assert torch.allclose(logits, ranks[0]["ddp"]["logits"], rtol=RTOL, atol=1e-5)


# ---- bad arguments: errors before any process group or wrapping --------------------------------
def test_bad_target_modules_names_missing_and_real_ones():
    import torch.distributed as dist

    base = tiny_llama()
    with pytest.raises(ValueError, match=r"target_modules.*\['qkv_proj'\].*q_proj"):
        Booster().enable_lora(base, lora_config=peft.LoraConfig(target_modules=["q_proj", "qkv_proj"]))
    assert not dist.is_initialized()
    assert not any("lora_" in n for n, _ in base.named_parameters())  # nothing was wrapped


def test_not_a_lora_config():
    with pytest.raises(TypeError, match=r"lora_config.*peft.LoraConfig"):
        Booster().enable_lora(tiny_llama(), lora_config={"r": 8, "target_modules": ["q_proj"]})
    with pytest.raises(ValueError, match="lora_config=peft.LoraConfig"):
        Booster().enable_lora(tiny_llama())


def test_quantize_refused():
    with pytest.raises(ValueError, match="quantize=False"):
        Booster().enable_lora(tiny_llama(), lora_config=lora_config(), quantize=True)


def test_after_boost_refused():
    booster = Booster()
    base = tiny_llama()
    boosted, *_ = booster.boost(base)
    for m in (boosted, base):
        with pytest.raises(ValueError, match="enable_lora.*already boosted.*first"):
            booster.enable_lora(m, lora_config=lora_config())


def test_merged_model_gives_trained_logits(runs):
    root, ranks, _ = runs
    merged = peft.PeftModel.from_pretrained(tiny_llama(), str(root / "gemini")).merge_and_unload()
    assert type(merged).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        logits = merged(input_ids=batches()[0]).logits
    assert torch.allclose(logits, ranks[0]["gemini"]["logits"], rtol=RTOL, atol=1e-5)


def test_tp_refuses_lora_on_a_module_without_an_adapter_rule():
    from transformers import BloomConfig, BloomForCausalLM

    from colossal_lab.engine.lora_tp import lora_tp_plan

    # BLOOM's plan is the engine's built-in table, whatever the transformers release: its embedding is
    # sharded embedding_rowwise (Llama's own plan shards its embedding only from transformers 5.21)
    bloom = BloomForCausalLM(BloomConfig(hidden_size=32, n_head=4, n_layer=2, vocab_size=128))
    model = peft.get_peft_model(bloom, peft.LoraConfig(r=4, target_modules=["word_embeddings", "query_key_value"]))
    with pytest.raises(ValueError, match=r"word_embeddings.*embedding_rowwise.*target_modules"):
        lora_tp_plan(model)


def _hf_pp_ranks(runs, runs4, name):
    return (runs4 if name == "tp2_pp2" else runs)[1]


@pytest.mark.parametrize("name", list(HF_PP))
def test_pipelined_llama_follows_single_process_peft(runs, runs4, name):
    """pp=2 and tp=2 x pp=2: the last stage's losses and the adapters gathered from every stage equal
    single-process peft within 1e-4 relative; the stages' optimizers together hold exactly the adapters;
    the base weights are unchanged bit for bit."""
    _, _, (ref_losses, ref_adapters) = runs
    ranks = _hf_pp_ranks(runs, runs4, name)
    last = ranks[-1][name]  # the last stage (tp2 x pp2: ranks 2 and 3) reports the loss
    assert _close(last["losses"], ref_losses), (name, last["losses"], ref_losses)
    for r in ranks:
        trained = r[name]["trained"]
        assert set(trained) == set(ref_adapters), name
        for n, t in ref_adapters.items():
            assert _close(trained[n], t), (name, n, (trained[n] - t).abs().max())
    held = set().union(*(r[name]["state"] for r in ranks))
    assert held == set(ref_adapters), (name, sorted(held ^ set(ref_adapters))[:4])
    assert all(r[name]["changed"] == [] for r in ranks), name


@pytest.mark.parametrize("name", list(HF_PP))
def test_pipelined_llama_adapter_loads_in_peft(runs, runs4, name):
    root = runs[0]
    ranks = _hf_pp_ranks(runs, runs4, name)
    trained_logits = ranks[-1][name]["logits"]
    assert trained_logits is not None and trained_logits.shape == (BATCH, SEQ, VOCAB)
    loaded = peft.PeftModel.from_pretrained(tiny_llama(), str(root / name)).eval()
    with torch.no_grad():
        logits = loaded(input_ids=batches()[0]).logits
    assert torch.allclose(logits, trained_logits, rtol=RTOL, atol=1e-5), (logits - trained_logits).abs().max()


def test_tp2_pp2_shards_adapters_like_their_base_layer(runs4):
    """Each stage's adapters are sharded as under tp=2 alone: the first stage's layer 0, the last's layer 1."""
    _, ranks, _ = runs4
    for rank, layer_index in ((0, 0), (2, 1)):
        got = ranks[rank]["tp2_pp2"]["placements"]
        assert not any(f"layers.{1 - layer_index}." in n for n in got)  # the other stage's layer is not here
        for layer in ("self_attn.q_proj", "mlp.down_proj"):
            pre = f"base_model.model.model.layers.{layer_index}.{layer}"
            base, a, b = (got[f"{pre}.{k}.weight"] for k in ("base_layer", "lora_A.default", "lora_B.default"))
            if layer.startswith("mlp"):
                assert (base, a, b) == ("(Shard(dim=1),)", "(Shard(dim=1),)", "whole"), layer
            else:
                assert (base, a, b) == ("(Shard(dim=0),)", "whole", "(Shard(dim=0),)"), layer
