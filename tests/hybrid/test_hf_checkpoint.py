"""transformers checkpoints through the booster: what every plugin saves loads in plain transformers,
and what transformers' ``save_pretrained`` writes loads into every layout.

Tiny random models built from configs (no hub), fp32, eval mode. Two runs of real processes serve every
check (one per world size): on 2 ranks each family is boosted under tp2, DDP, ZeRO-2 and Gemini, saved
with ``booster.save_model(shard=True)`` in files small enough to make several, and a model with other
random weights is loaded from a sharded ``save_pretrained`` directory (Mamba, whose plan is a built-in table's
channel-cut mixers, under tp2 only); on 4 ranks the same for tp2 x dp2,
and a model built on the meta device, boosted, then loaded. Pipelines (4-layer models): pp2 and interleaved
on 2 ranks, tp2 x pp2 on 4, each trained two steps, saved, and loaded into; and load errors that only one
stage can see, which every rank must raise alike. The test process reads the saved directories with
``AutoModelFor*.from_pretrained`` and compares logits with the plain (or trained pipeline's) model's.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

pytest.importorskip("transformers")

from support.dist import run_distributed  # noqa: E402

SEED, OTHER = 11, 99
SHARD_MB = 0.05  # ~50 KB files: several per model, as a real checkpoint has
FAMILIES = ("llama", "llama_tied", "qwen2", "gpt2", "opt", "bert")
TP_FAMILIES = ("mamba",)  # under tp2 only: a built-in plan's packed in_proj and channel-cut mixer (mamba.py)
LAYOUTS_2 = ("tp2", "ddp", "zero2", "gemini")
TOL = 1e-6
BAD_NAME = "model.layers.3.mlp.down_proj.weight"


def _config(family, layers=2):
    import transformers as tf

    small = dict(num_hidden_layers=layers, vocab_size=256, max_position_embeddings=64)
    if family in ("llama", "llama_tied", "qwen2"):
        cls = tf.LlamaConfig if family != "qwen2" else tf.Qwen2Config
        return cls(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                   tie_word_embeddings=family == "llama_tied", **small)
    if family == "gpt2":
        return tf.GPT2Config(n_embd=64, n_head=4, n_layer=layers, vocab_size=257, n_positions=64,  # uneven vocab shards
                             bos_token_id=0, eos_token_id=0)
    if family == "opt":
        return tf.OPTConfig(hidden_size=64, num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64,
                            bos_token_id=0, eos_token_id=0, pad_token_id=1, **small)
    if family == "mamba":
        return tf.MambaConfig(hidden_size=64, state_size=8, expand=2, time_step_rank=8, num_hidden_layers=layers,
                              vocab_size=256)
    return tf.BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, **small)


def _auto(family):
    import transformers as tf

    return tf.AutoModelForMaskedLM if family == "bert" else tf.AutoModelForCausalLM


def _build(family, seed, layers=2):
    torch.manual_seed(seed)
    return _auto(family).from_config(_config(family, layers)).eval()


def _input(rows=2):
    return torch.randint(2, 250, (rows, 12), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _logits(model, rows=2):
    return model(input_ids=_input(rows)).logits.detach().float().cpu()


def _plugin(layout):
    from colossal_lab.engine.plugins import DDPPlugin, GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin

    return {"tp2": lambda: HybridParallelPlugin(tp_size=2), "ddp": DDPPlugin,
            "zero2": lambda: LowLevelZeroPlugin(stage=2),
            "gemini": lambda: GeminiPlugin(placement_policy="cpu", precision="fp32")}[layout]()


def _boosted(layout, model):
    from colossal_lab.engine import Booster

    booster = Booster(plugin=_plugin(layout))
    boosted, *_ = booster.boost(model)
    return booster, boosted


def _save_and_load(rank, world, root, hf_dirs, layouts, families):
    """Each layout x family: save from it (files listed), load the HF directory into it (logits)."""
    out = {}
    for layout in layouts:
        for family in families:
            booster, model = _boosted(layout, _build(family, SEED))
            target = os.path.join(root, f"{layout}-{family}")
            booster.save_model(model, target, shard=True, size_per_shard=SHARD_MB)
            booster, model = _boosted(layout, _build(family, OTHER))
            booster.load_model(model, hf_dirs[family])
            out[(layout, family)] = {"files": sorted(os.listdir(target)), "logits": _logits(model)}
    return out if rank == 0 else None


def _errors(rank, world, bad):
    """Each bad input to load_model under tp2: the error's type and message."""
    booster, model = _boosted("tp2", _build("llama", OTHER))
    out = {}
    for name, path in bad.items():
        try:
            booster.load_model(model, path)
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - the message is what is checked
            out[name] = (type(exc).__name__, str(exc))
    return out


def _lazy(layout, hf_dir):
    """The lazy path: a Llama built under ``lazy_init()`` (the meta device), boosted, then loaded."""
    from colossal_lab.engine.lazy import is_lazy, lazy_init

    with lazy_init():
        model = _build("llama", OTHER)
    assert is_lazy(model)
    booster, model = _boosted(layout, model)
    booster.load_model(model, hf_dir)
    return _logits(model)


# ---- pipelines: 4-layer models, every stage writing and reading its own tensors ---------------------------
PP_LAYERS, PP_ROWS = 4, 4  # two stages of two layers (interleaved: four of one); four rows: four microbatches
PP_FAMILIES = ("llama", "llama_tied", "gpt2")
PP_PLUGINS = {"pp2": dict(pp_size=2, num_microbatches=2),
              "interleaved": dict(pp_size=2, num_microbatches=4, pp_style="interleaved", num_model_chunks=2),
              "tp2_pp2": dict(tp_size=2, pp_size=2, num_microbatches=2)}


def _pp_boosted(layout, model):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    plugin = HybridParallelPlugin(**PP_PLUGINS[layout])
    booster = Booster(plugin=plugin)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, *_ = booster.boost(model, opt)
    return plugin, booster, model, opt


def _pp_logits(booster, model, opt):
    """The whole batch's logits from the pipeline (eval mode), on the ranks holding the last stage."""
    x = _input(PP_ROWS)
    model.eval()
    out = booster.execute_pipeline(iter([{"input_ids": x, "labels": x}]), model, None, opt,
                                   return_outputs=True)["outputs"]
    opt.zero_grad()
    if out is None:
        return None
    return (out.full_tensor() if hasattr(out, "full_tensor") else out).detach().float().cpu()


def _pp_save_and_load(root, hf_dirs, layouts, families):
    """Each pipeline layout x family: 2 training steps, the trained logits, save; a model with other
    weights loaded from the save_pretrained directory: its logits."""
    out = {}
    for layout in layouts:
        for family in families:
            plugin, booster, model, opt = _pp_boosted(layout, _build(family, SEED, PP_LAYERS).train())
            for step in range(2):
                x = _input(PP_ROWS) + step
                booster.execute_pipeline(iter([{"input_ids": x, "labels": x}]), model, None, opt)
                opt.step()
                opt.zero_grad()
            trained = _pp_logits(booster, model, opt)
            booster.save_model(model, os.path.join(root, f"{layout}-{family}"), shard=True, size_per_shard=SHARD_MB)
            plugin.close()
            plugin, booster, model, opt = _pp_boosted(layout, _build(family, OTHER, PP_LAYERS))
            booster.load_model(model, hf_dirs[f"pp-{family}"])
            out[(layout, family)] = {"trained": trained, "loaded": _pp_logits(booster, model, opt)}
            plugin.close()
    return out


def _pp_lazy(layout, hf_dir):
    """The lazy path under a pipeline: each stage allocates its own (shards of) tensors, then the load."""
    from colossal_lab.engine.lazy import is_lazy, lazy_init

    with lazy_init():
        model = _build("llama", OTHER, PP_LAYERS)
    assert is_lazy(model)
    plugin, booster, model, opt = _pp_boosted(layout, model)
    booster.load_model(model, hf_dir)
    logits = _pp_logits(booster, model, opt)
    plugin.close()
    return logits


def _pp_errors(hf_dirs, bad_shape):
    """Loads that must fail on every rank alike under pp2: a checkpoint of a 2-layer config (the second
    stage's layers are missing, the first stage's are there) and one whose last layer has another shape
    (only the second stage holds it). Each: (type, message, seconds) on this rank."""
    plugin, booster, model, _ = _pp_boosted("pp2", _build("llama", OTHER, PP_LAYERS))
    out = {}
    for name, path in (("fewer_layers", hf_dirs["llama"]), ("shape", bad_shape)):
        t0 = time.perf_counter()
        try:
            booster.load_model(model, path)
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - the message is what is checked
            out[name] = (type(exc).__name__, str(exc), time.perf_counter() - t0)
    try:
        booster.save_model(model, os.path.join(os.path.dirname(bad_shape), "one_file"), shard=False)
        out["shard_false"] = None
    except ValueError as exc:
        out["shard_false"] = str(exc)
    plugin.close()
    return out


def _world2(rank, world, root, hf_dirs, bad, single):
    out = _save_and_load(rank, world, root, hf_dirs, LAYOUTS_2, FAMILIES)
    tp_only = _save_and_load(rank, world, root, hf_dirs, ("tp2",), TP_FAMILIES)
    out = {**out, **tp_only} if rank == 0 else None
    booster, model = _boosted("tp2", _build("llama", OTHER))
    booster.load_model(model, single)  # one .safetensors file, not a directory
    single_logits = _logits(model)
    lazy = {layout: _lazy(layout, hf_dirs["llama"]) for layout in LAYOUTS_2}
    errors = _errors(rank, world, bad)
    pp = _pp_save_and_load(root, hf_dirs, ("pp2", "interleaved"), PP_FAMILIES)
    pp_errors = _pp_errors(hf_dirs, bad["bad_shape"])
    pp["lazy", "pp2"] = {"loaded": _pp_lazy("pp2", hf_dirs["pp-llama"])}
    return ((out, single_logits, lazy, errors) if rank == 0 else None), pp, pp_errors


def _world4(rank, world, root, hf_dirs):
    """tp2 x dp2 (Llama, GPT-2's packed Conv1D), and the lazy path under it; tp2 x pp2."""
    out = _save_and_load(rank, world, root, hf_dirs, ("tp2",), ("llama", "gpt2"))
    lazy = _lazy("tp2", hf_dirs["llama"])  # every rank: boosting and loading are collectives
    pp = _pp_save_and_load(root, hf_dirs, ("tp2_pp2",), ("llama", "gpt2"))
    pp["lazy", "tp2_pp2"] = {"loaded": _pp_lazy("tp2_pp2", hf_dirs["pp-llama"])}
    return ((out, lazy) if rank == 0 else None), pp


def _last_stage(per_rank):
    """Merge the ranks' ``{case: {what: logits or None}}``: each value from a rank that holds it."""
    merged = {}
    for part in per_rank:
        for case, values in part.items():
            slot = merged.setdefault(case, {})
            slot.update({k: v for k, v in values.items() if v is not None})
    return merged


# ---- fixtures: the plain models, their save_pretrained directories, the two runs --------------------------
@pytest.fixture(scope="module")
def plain():
    out = {f: _logits(_build(f, SEED)) for f in FAMILIES + TP_FAMILIES}
    out.update({f"pp-{f}": _logits(_build(f, SEED, PP_LAYERS), PP_ROWS) for f in PP_FAMILIES})
    return out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_pretrained")
    out = {}
    for f in FAMILIES + TP_FAMILIES:
        out[f] = str(root / f)
        _build(f, SEED).save_pretrained(out[f], max_shard_size="40KB")
    for f in PP_FAMILIES:
        out[f"pp-{f}"] = str(root / f"pp-{f}")
        _build(f, SEED, PP_LAYERS).save_pretrained(out[f"pp-{f}"], max_shard_size="40KB")
    return out


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory, hf_dirs):
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("hf_bad")
    sd = {}
    for f in sorted(os.listdir(hf_dirs["llama"])):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(hf_dirs["llama"], f)))
    sd.pop("model.norm.weight")
    sd["model.extra.weight"] = torch.zeros(3)
    (root / "wrong_keys").mkdir()
    save_file(sd, str(root / "wrong_keys" / "model.safetensors"), metadata={"format": "pt"})
    (root / "not_safetensors.safetensors").write_text("this is not a safetensors file")
    sd = {}  # the 4-layer Llama with its last layer's down_proj narrower: another intermediate_size there
    for f in sorted(os.listdir(hf_dirs["pp-llama"])):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(hf_dirs["pp-llama"], f)))
    sd[BAD_NAME] = sd[BAD_NAME][:, :96].contiguous()
    (root / "bad_shape").mkdir()
    save_file(sd, str(root / "bad_shape" / "model.safetensors"), metadata={"format": "pt"})
    return {"wrong_keys": str(root / "wrong_keys"), "not_safetensors": str(root / "not_safetensors.safetensors"),
            "missing_path": str(root / "nothing_here"), "bad_shape": str(root / "bad_shape")}


@pytest.fixture(scope="module")
def single_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_single")
    _build("llama", SEED).save_pretrained(str(root))
    return str(root / "model.safetensors")


@pytest.fixture(scope="module")
def run2(tmp_path_factory, hf_dirs, bad_inputs, single_file):
    root = str(tmp_path_factory.mktemp("saved2"))
    ranks = run_distributed(_world2, 2, root, hf_dirs, bad_inputs, single_file, timeout=600, preload=True)
    out, single, lazy, errors = ranks[0][0]
    return root, out, single, lazy, errors, _last_stage([r[1] for r in ranks]), [r[2] for r in ranks]


@pytest.fixture(scope="module")
def run4(tmp_path_factory, hf_dirs):
    root = str(tmp_path_factory.mktemp("saved4"))
    ranks = run_distributed(_world4, 4, root, hf_dirs, timeout=600, preload=True)
    out, lazy = ranks[0][0]
    return root, out, lazy, _last_stage([r[1] for r in ranks])


def _from_pretrained(family, path):
    return _auto(family).from_pretrained(path).eval()


def _close(a, b, tol=TOL):
    assert a.shape == b.shape
    assert torch.allclose(a, b, atol=tol, rtol=0), (a - b).abs().max()


# ---- save: every layout writes what transformers loads --------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS_2)
@pytest.mark.parametrize("family", FAMILIES)
def test_saved_checkpoint_loads_in_transformers(run2, plain, layout, family):
    root, out = run2[:2]
    path = os.path.join(root, f"{layout}-{family}")
    files = out[(layout, family)]["files"]
    assert "config.json" in files and "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 1
    _close(_logits(_from_pretrained(family, path)), plain[family])


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tp2_checkpoint_of_a_built_in_plan_loads_both_ways(run2, plain, family):
    """Saved under tp2 (the whole tensors of the cut ones, in the model's own layout) loads in transformers with
    the plain model's logits; a save_pretrained directory loads into tp2 alike."""
    root, out = run2[:2]
    _close(_logits(_from_pretrained(family, os.path.join(root, f"tp2-{family}"))), plain[family])
    # computed under tp2: x_proj's and out_proj's sums over the ranks round apart from one process's (1.1e-6 at the
    # floor, transformers 5.5); a wrong cut parts by whole units (3.4 with in_proj cut as one block)
    _close(out[("tp2", family)]["logits"], plain[family], tol=1e-5)


@pytest.mark.parametrize("family", ("llama", "gpt2"))
def test_tp2_dp2_checkpoint_loads_in_transformers(run4, plain, family):
    root = run4[0]
    _close(_logits(_from_pretrained(family, os.path.join(root, f"tp2-{family}"))), plain[family])


def test_saved_files_match_save_pretrained(run2, hf_dirs):
    """Same tensor names as transformers writes (tied weights once), format metadata, total size."""
    from safetensors import safe_open

    root = run2[0]
    for family in FAMILIES + TP_FAMILIES:
        ours = json.load(open(os.path.join(root, f"tp2-{family}", "model.safetensors.index.json")))
        theirs = json.load(open(os.path.join(hf_dirs[family], "model.safetensors.index.json")))
        assert set(ours["weight_map"]) == set(theirs["weight_map"]), family
        assert ours["metadata"]["total_size"] == theirs["metadata"]["total_size"], family
        first = os.path.join(root, f"tp2-{family}", sorted(set(ours["weight_map"].values()))[0])
        with safe_open(first, "pt") as f:
            assert f.metadata() == {"format": "pt"}
    tied = json.load(open(os.path.join(root, "gemini-llama_tied", "model.safetensors.index.json")))
    assert "lm_head.weight" not in tied["weight_map"] and "model.embed_tokens.weight" in tied["weight_map"]


# ---- load: save_pretrained directories load into every layout ----------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS_2)
@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_loads_into_layout(run2, plain, layout, family):
    out = run2[1]
    _close(out[(layout, family)]["logits"], plain[family])


@pytest.mark.parametrize("family", ("llama", "gpt2"))
def test_save_pretrained_loads_into_tp2_dp2(run4, plain, family):
    out = run4[1]
    _close(out[("tp2", family)]["logits"], plain[family])


def test_single_safetensors_file_loads(run2, plain):
    _close(run2[2], plain["llama"])


@pytest.mark.parametrize("layout", LAYOUTS_2)
def test_meta_model_boosted_then_loaded(run2, plain, layout):
    _close(run2[3][layout], plain["llama"])


def test_meta_model_boosted_then_loaded_tp2_dp2(run4, plain):
    _close(run4[2], plain["llama"])


# ---- bad input ------------------------------------------------------------------------------------------
def test_bad_inputs_are_named(run2):
    errors = run2[4]
    kind, msg = errors["wrong_keys"]
    assert kind == "RuntimeError" and "model.norm.weight" in msg and "model.extra.weight" in msg
    kind, msg = errors["not_safetensors"]
    assert kind == "ValueError" and "not a safetensors file" in msg
    kind, msg = errors["missing_path"]
    assert kind == "FileNotFoundError" and "nothing_here" in msg


def test_save_refuses_a_file_path(tmp_path):
    from colossal_lab.engine import Booster

    with pytest.raises(ValueError, match="directory"):
        Booster().save_model(_build("llama", SEED), str(tmp_path / "x.safetensors"))
    shutil.rmtree(tmp_path, ignore_errors=True)


# ---- pipelines: pp2, interleaved (four virtual stages), tp2 x pp2 -------------------------------------------
def _pp_case(run2, run4, layout, family):
    return (run4[3] if layout == "tp2_pp2" else run2[5])[(layout, family)], (run4 if layout == "tp2_pp2" else run2)[0]


PP_CASES = [(lay, f) for lay in ("pp2", "interleaved") for f in PP_FAMILIES] + \
    [("tp2_pp2", f) for f in ("llama", "gpt2")]


@pytest.mark.parametrize("layout,family", PP_CASES)
def test_pipeline_checkpoint_loads_in_transformers(run2, run4, layout, family):
    """Every stage wrote its own tensors; from_pretrained gives the trained pipeline's logits."""
    case, root = _pp_case(run2, run4, layout, family)
    path = os.path.join(root, f"{layout}-{family}")
    assert case["trained"].shape == (PP_ROWS, 12, _config(family).vocab_size)
    _close(_logits(_from_pretrained(family, path), PP_ROWS), case["trained"])


@pytest.mark.parametrize("layout,family", PP_CASES)
def test_save_pretrained_loads_into_pipeline(run2, run4, plain, layout, family):
    case, _ = _pp_case(run2, run4, layout, family)
    _close(case["loaded"], plain[f"pp-{family}"])


def test_meta_model_boosted_then_loaded_into_pipeline(run2, run4, plain):
    _close(run2[5]["lazy", "pp2"]["loaded"], plain["pp-llama"])
    _close(run4[3]["lazy", "tp2_pp2"]["loaded"], plain["pp-llama"])


def test_pipeline_files_match_save_pretrained(run2, run4, hf_dirs):
    """One index over every stage, the names save_pretrained writes (a tied head once), its total size."""
    for layout, family in PP_CASES:
        root = (run4 if layout == "tp2_pp2" else run2)[0]
        ours = json.load(open(os.path.join(root, f"{layout}-{family}", "model.safetensors.index.json")))
        theirs = json.load(open(os.path.join(hf_dirs[f"pp-{family}"], "model.safetensors.index.json")))
        assert set(ours["weight_map"]) == set(theirs["weight_map"]), (layout, family)
        assert ours["metadata"]["total_size"] == theirs["metadata"]["total_size"], (layout, family)
        files = set(ours["weight_map"].values())
        assert files == {f for f in os.listdir(os.path.join(root, f"{layout}-{family}")) if f.endswith(".safetensors")}
        # no file mixes stages: the first layer and the last layer live in different files
        first = {f for n, f in ours["weight_map"].items() if ".0." in n}
        last = {f for n, f in ours["weight_map"].items() if f".{PP_LAYERS - 1}." in n}
        assert not first & last, (layout, family)
    tied = json.load(open(os.path.join(run2[0], "pp2-llama_tied", "model.safetensors.index.json")))
    assert "lm_head.weight" not in tied["weight_map"] and "model.embed_tokens.weight" in tied["weight_map"]


def test_pipeline_load_errors_agree_on_every_rank(run2):
    """A problem one stage finds is raised by every rank, with one message, at once (not at a timeout)."""
    per_rank = run2[6]
    for name in ("fewer_layers", "shape"):
        found = [r[name] for r in per_rank]
        assert all(f is not None for f in found), name
        assert len({(kind, msg) for kind, msg, _ in found}) == 1, found
        assert all(seconds < 20 for _, _, seconds in found), found
    kind, msg, _ = per_rank[0]["fewer_layers"]
    assert kind == "RuntimeError" and "model.layers.2." in msg and "missing keys" in msg
    kind, msg, _ = per_rank[0]["shape"]
    assert kind == "RuntimeError" and BAD_NAME in msg and "expected (64, 128)" in msg and "found (64, 96)" in msg
    assert all("shard=True" in r["shard_false"] for r in per_rank)
