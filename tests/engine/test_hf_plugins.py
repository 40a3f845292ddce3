"""Every transformers family the tests build, under every data-parallel plugin, with no parallel code.

Tiny random models built from configs (no hub), fp32, trained with the plain HF loop on 2 real ranks (each
its half of the batch) under DDP, ZeRO-1, ZeRO-2 and Gemini (every chunk on the host, ``static`` with half
the chunks sharded, ``auto`` under a memory limit spilling chunks to NVMe files, and the optimizer state on
NVMe), follow the same loop in one process: losses and gradient norms within 1e-4 relative over 5 AdamW
steps with the clip acting at every step. ZeRO-2 shards layer by layer; Gemini's ``static`` placement
shards some chunks only; its NVMe files exist while it trains and are gone after ``plugin.close()``.
LoRA (peft) on Qwen2 and GPT-2 under ZeRO-2 and Gemini follows single-process peft. Qwen3, Mistral and
BLOOM (the families tests/hybrid/test_hf_checkpoint.py does not save) are saved trained from ZeRO-2 and
Gemini with ``booster.save_model`` and load in plain transformers to the same logits.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

pytest.importorskip("transformers")

from support import hf  # noqa: E402
from support.dist import run_distributed  # noqa: E402
from support.engine import batch, param_groups  # noqa: E402

STEPS = 5
LR = hf.LR  # AdamW's: support.hf says why not 1e-2
CLIP = 0.5  # below every model's gradient norm here, so clipping acts at every step
CHUNK_MB = 0.07  # several chunks per model (the largest parameter, a 256 x 64 embedding, is 64 KiB)

MODELS = {"llama": hf.llama, "llama_tied": lambda: hf.llama(tie_word_embeddings=True), "qwen2": hf.qwen2,
          "qwen3": hf.qwen3, "mistral": hf.mistral, "gpt2": hf.gpt2, "opt": lambda: hf.opt(fixed_key_bias=True),
          "bert": hf.bert, "bloom": hf.bloom}


def _plugin(name, nvme_dir):
    """The plugin ``name``; on a CPU-only machine the compute tier is host RAM, so Gemini's placements
    differ by sharding (``shard_param_frac``) and by what goes to NVMe files, not by device."""
    from colossal_lab.engine.plugins import DDPPlugin, GeminiPlugin, LowLevelZeroPlugin

    gemini = functools.partial(GeminiPlugin, precision="fp32")
    return {"ddp": DDPPlugin, "zero1": lambda: LowLevelZeroPlugin(stage=1),
            "zero2": lambda: LowLevelZeroPlugin(stage=2),
            "gemini_cpu": lambda: gemini(placement_policy="cpu"),
            "gemini_static": lambda: gemini(placement_policy="static", shard_param_frac=0.5, offload_param_frac=0.5,
                                            offload_optim_frac=0.5, chunk_size_mb=CHUNK_MB),
            # a compute tier smaller than the model: chunks spill to NVMe and come back every step
            "gemini_auto_nvme": lambda: gemini(placement_policy="auto", device_memory_limit=400_000,
                                               nvme_offload_dir=nvme_dir, chunk_size_mb=CHUNK_MB, max_prefetch=1),
            "gemini_nvme_optim": lambda: gemini(placement_policy="cpu", nvme_offload_dir=nvme_dir,
                                                nvme_offload_frac=1.0, chunk_size_mb=CHUNK_MB)}[name]()


@functools.lru_cache(maxsize=None)
def _reference(family):
    model = MODELS[family]()
    losses, norms = hf.loop(model, torch.optim.AdamW(param_groups(model), lr=LR), steps=STEPS, clip=CLIP)
    with torch.no_grad():
        logits = model.eval()(input_ids=batch(0)[0].contiguous()).logits
    return losses, norms, logits


def _train(rank, world, family, plugin_name, root):
    from colossal_lab.engine import Booster

    nvme_dir = os.path.join(root, f"nvme-{family}-{plugin_name}-{rank}")
    plugin = _plugin(plugin_name, nvme_dir)
    booster = Booster(plugin=plugin)
    model = MODELS[family]()
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    model, opt, *_ = booster.boost(model, opt)
    losses, norms = hf.loop(model, opt, booster, steps=STEPS, clip=CLIP, split=(rank, world))
    out = {"losses": losses, "norms": norms}
    if plugin_name == "zero2":  # FSDP2 units: every decoder (encoder) layer, and the root
        out["fsdp_units"] = sum(type(m).__name__.startswith("FSDP") for m in model.modules())
    if plugin_name.startswith("gemini"):
        out["chunks"] = [c.sharded for c in model.manager.chunks]
    if "nvme" in plugin_name:
        out["nvme_files"] = len(os.listdir(nvme_dir))
        out["nvme_homes"] = sorted({h for c in model.manager.chunks for h in (c.param_home, c.optim_home)})
    if (family, plugin_name) in SAVED:
        booster.save_model(model, os.path.join(root, f"saved-{family}-{plugin_name}"), shard=True)
    if hasattr(plugin, "close"):
        plugin.close()
    if "nvme" in plugin_name:
        out["nvme_left"] = os.listdir(nvme_dir) if os.path.isdir(nvme_dir) else []
    return out


FAMILIES = tuple(MODELS)
PLUGINS = ("ddp", "zero1", "zero2", "gemini_cpu", "gemini_static", "gemini_auto_nvme", "gemini_nvme_optim")
CASES = [(f, p) for p in PLUGINS for f in FAMILIES]
# the families tests/hybrid/test_hf_checkpoint.py does not save, saved here from the sharding plugins
SAVED = [(f, p) for f in ("qwen3", "mistral", "bloom") for p in ("zero2", "gemini_cpu")]


# ---- LoRA (peft) on families other than the Llama (tests/engine/test_lora.py trains the Llama) -----------
LORA_TARGETS = {"qwen2": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}  # GPT-2: Conv1D
LORA_CLIP = 0.1  # the adapters' gradients are smaller than the whole model's: a clip that still acts
LORA_CASES = [(f, p) for f in LORA_TARGETS for p in ("zero2", "gemini_cpu")]


def _lora_config(family):
    import peft

    # random A and B (not B = 0), so the adapters change the logits from the first step on
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[family], lora_dropout=0.0,
                           init_lora_weights=False)


@functools.lru_cache(maxsize=None)
def _lora_reference(family):
    import peft

    base = MODELS[family]()
    torch.manual_seed(1)
    model = peft.get_peft_model(base, _lora_config(family))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    return hf.loop(model, opt, steps=STEPS, clip=LORA_CLIP)


def _lora(rank, world, family, plugin_name):
    from colossal_lab.engine import Booster

    plugin = _plugin(plugin_name, None)
    booster = Booster(plugin=plugin)
    base = MODELS[family]()
    torch.manual_seed(1)
    model = booster.enable_lora(base, lora_config=_lora_config(family))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)  # the usual way: boost keeps only the adapters
    model, opt, *_ = booster.boost(model, opt)
    losses, norms = hf.loop(model, opt, booster, steps=STEPS, clip=LORA_CLIP, split=(rank, world))
    if hasattr(plugin, "close"):
        plugin.close()
    return {"losses": losses, "norms": norms}


def _all(rank, world, root):
    out = {case: _train(rank, world, *case, root) for case in CASES}
    out.update({("lora",) + case: _lora(rank, world, *case) for case in LORA_CASES})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf_plugins"))
    return root, run_distributed(_all, 2, root, timeout=600, preload=True)


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_hf_model_follows_its_single_process_curve(runs, case):
    ref, ref_norms, _ = _reference(case[0])
    for r in runs[1]:
        got = r[case]["losses"]
        assert got == pytest.approx(ref, rel=1e-4), (case, got, ref)
        assert r[case]["norms"] == pytest.approx(ref_norms, rel=1e-4), (case, r[case]["norms"], ref_norms)
    assert ref[-1] < ref[0]  # it learned: the curve is not flat
    assert min(ref_norms) > CLIP  # the clip acted on every step, so a wrong norm would move the curve


def test_zero2_shards_layer_by_layer(runs):
    for family in FAMILIES:
        assert runs[1][0][(family, "zero2")]["fsdp_units"] == 2 + 1, family  # two layers and the root


def test_gemini_shards_what_its_placement_says(runs):
    for r in runs[1]:
        for family in FAMILIES:
            every, half = r[(family, "gemini_cpu")]["chunks"], r[(family, "gemini_static")]["chunks"]
            assert all(every), family  # ZeRO-3: every chunk sharded over the two ranks
            assert 0 < sum(half) < len(half), (family, half)  # shard_param_frac=0.5: some chunks whole


@pytest.mark.parametrize("case", LORA_CASES, ids=["-".join(c) for c in LORA_CASES])
def test_lora_follows_single_process_peft(runs, case):
    pytest.importorskip("peft")
    ref, ref_norms = _lora_reference(case[0])
    for r in runs[1]:
        got = r[("lora",) + case]
        assert got["losses"] == pytest.approx(ref, rel=1e-4), (case, got, ref)
        assert got["norms"] == pytest.approx(ref_norms, rel=1e-4), (case, got, ref_norms)
    assert ref[-1] < ref[0] and min(ref_norms) > LORA_CLIP


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("plugin", [p for p in PLUGINS if "nvme" in p])
def test_gemini_nvme_files_are_used_and_removed(runs, family, plugin):
    for r in runs[1]:
        res = r[(family, plugin)]
        assert res["nvme_files"] > 0 and "nvme" in res["nvme_homes"], res
        assert res["nvme_left"] == [], res


@pytest.mark.parametrize("case", SAVED, ids=["-".join(c) for c in SAVED])
def test_trained_checkpoint_loads_in_transformers(runs, case):
    from transformers import AutoModelForCausalLM

    path = os.path.join(runs[0], "saved-{}-{}".format(*case))
    assert "config.json" in os.listdir(path)
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(loaded) is type(MODELS[case[0]]())
    with torch.no_grad():
        logits = loaded(input_ids=batch(0)[0].contiguous()).logits
    ref = _reference(case[0])[2]
    assert torch.allclose(logits, ref, rtol=1e-4, atol=1e-4), (logits - ref).abs().max()
