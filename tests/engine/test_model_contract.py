"""The model contract (engine/models/protocol.py): a model the engine has never seen trains under
every plugin like one plain-torch process, lazy init and int8 loading work on it, and a model
without the contract gets torch's defaults or an error naming the missing method.

The second model (``support/llama.py``) is unlike the reference GPT on purpose: a Llama-style
decoder with grouped-query attention (fewer key/value heads than query heads), biasless RMSNorm,
learned positions, a SwiGLU MLP, a head tied to the embedding, layers in an ``nn.ModuleList``
(a pipeline stage keeps the others as parameter-free placeholders) and a forward that returns
bare logits. One 2-rank run trains it under DDP, ZeRO-1, ZeRO-2, Gemini (cpu; auto with an NVMe
directory and a small compute budget, from a lazily built model) and the hybrid plugin (tp=2,
tp=2 with sequence parallelism, pp=2 with activation checkpointing).
"""

from __future__ import annotations

import ast
import copy
import os
import re

import pytest
import torch
import torch.nn as nn
from support import ROOT
from support.dist import run_distributed
from support.engine import batch, global_mean, lm_loss, param_groups
from support.llama import SEED, Llama, LlamaConfig, llama

STEPS = 5
LR = 1e-2


def _reference():
    model = llama()
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    losses = []
    for s in range(STEPS):
        idx, tgt = batch(s)
        loss = lm_loss(model(idx), {"targets": tgt})
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# ---- every plugin on two real ranks ---------------------------------------------------------

def _plugin(name, tmp, rank):
    from colossal_lab.engine.plugins import DDPPlugin, GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin

    return {
        "ddp": lambda: DDPPlugin(),
        "zero1": lambda: LowLevelZeroPlugin(stage=1),
        "zero2": lambda: LowLevelZeroPlugin(stage=2),
        "gemini_cpu": lambda: GeminiPlugin(placement_policy="cpu", precision="fp32"),
        "gemini_nvme_lazy": lambda: GeminiPlugin(placement_policy="auto", precision="fp32", device_memory_limit=300_000,
                                                 nvme_offload_dir=os.path.join(tmp, f"nv{rank}"), chunk_size_mb=0.07,
                                                 max_prefetch=1),
        "tp2": lambda: HybridParallelPlugin(tp_size=2),
        "tp2_sp": lambda: HybridParallelPlugin(tp_size=2, sequence_parallel=True),
        "pp2_ac": lambda: HybridParallelPlugin(pp_size=2, num_microbatches=2, pp_style="1f1b",
                                               activation_checkpointing=True),
    }[name]()


def _train(rank, world, name, tmp):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.lazy import is_lazy, lazy_init

    plugin = _plugin(name, tmp, rank)
    booster = Booster(plugin=plugin)
    if name.endswith("_lazy"):  # Gemini materialises it chunk by chunk, from the same seed
        with lazy_init():
            model = Llama(LlamaConfig())
        assert is_lazy(model)
        torch.manual_seed(SEED)
    else:
        model = llama()
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    model, opt, *_ = booster.boost(model, opt, lm_loss)
    hybrid = plugin.supports_pipeline
    out = {"losses": []}
    for s in range(STEPS):
        if hybrid:  # dp=1 here: every rank takes the whole batch
            idx, tgt = batch(s)
            loss = booster.execute_pipeline(iter([{"idx": idx, "targets": tgt}]), model, lm_loss, opt)["loss"]
        else:
            idx, tgt = batch(s, rank, world)
            loss = lm_loss(model(idx), {"targets": tgt})
            booster.backward(loss, opt)
        booster.clip_grad_by_norm(opt, 1.0)
        opt.step()
        opt.zero_grad()
        out["losses"].append(None if loss is None else (loss.item() if hybrid else global_mean(loss)))
    if hybrid:
        inner = [m.inner for m in model.stage_modules]
        out["sharded"] = any(hasattr(p, "to_local") for m in inner for p in m.parameters())
        out["checkpointing"] = all(m.checkpointing for m in inner)
        out["layers"] = [i for m in inner for i in m._held()]
    if hasattr(model, "manager"):  # Gemini: where chunk parameters live
        out["homes"] = sorted({c.param_home for c in model.manager.chunks})
    if hasattr(plugin, "close"):
        plugin.close()
    return out


PLUGINS = ["ddp", "zero1", "zero2", "gemini_cpu", "gemini_nvme_lazy", "tp2", "tp2_sp", "pp2_ac"]


def _all(rank, world, tmp):
    return {name: _train(rank, world, name, tmp) for name in PLUGINS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_all, 2, str(tmp_path_factory.mktemp("contract")), timeout=400)


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.mark.parametrize("name", PLUGINS)
def test_unseen_model_follows_its_single_process_curve(runs, reference, name):
    assert reference[-1] < reference[0] - 0.15  # it really trained
    got = [r[name]["losses"] for r in runs]
    reported = [losses for losses in got if losses[0] is not None]
    assert reported, name
    for losses in reported:
        for a, b in zip(losses, reference):
            assert abs(a - b) <= 1e-4 * abs(b), (name, losses, reference)


def test_hybrid_used_the_models_plan_split_and_checkpointing(runs):
    for r in runs:
        assert r["tp2"]["sharded"] and r["tp2_sp"]["sharded"] and not r["pp2_ac"]["sharded"]
        assert r["pp2_ac"]["checkpointing"] and not r["tp2"]["checkpointing"]
    assert [r["pp2_ac"]["layers"] for r in runs] == [[0, 1], [2, 3]]


def test_gemini_kept_the_lazy_model_partly_on_nvme(runs):
    for r in runs:
        assert "nvme" in r["gemini_nvme_lazy"]["homes"], r["gemini_nvme_lazy"]["homes"]


# ---- lazy init and int8 loading -------------------------------------------------------------

def test_lazy_init_equals_eager_init_from_the_same_seed():
    from colossal_lab.engine.lazy import is_lazy, lazy_init, materialize

    eager = llama()
    with lazy_init():
        lazy = Llama(LlamaConfig())
    assert is_lazy(lazy)
    torch.manual_seed(SEED)
    materialize(lazy, "cpu")
    assert not is_lazy(lazy) and lazy.head.weight is lazy.embed.weight
    want = dict(list(eager.named_parameters()) + list(eager.named_buffers()))
    got = dict(list(lazy.named_parameters()) + list(lazy.named_buffers()))
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_int8_quantize_and_lazy_load_quantized(tmp_path):
    from colossal_lab.engine.checkpoint_io.safetensors_shards import save_state_dict_shards
    from colossal_lab.engine.quant import Int8Linear, load_quantized, quantize

    m = llama().eval()
    idx = batch(0)[0][:2]
    ref = m(idx)
    direct = quantize(copy.deepcopy(m), "int8")
    assert not any(isinstance(x, nn.Linear) for x in direct.modules())
    assert isinstance(direct.layers[0].attn.k_proj, Int8Linear)
    out = direct(idx)
    assert ((out - ref).norm() / ref.norm()).item() < 0.05
    save_state_dict_shards(m.state_dict(), tmp_path, size_per_shard=0.05)
    loaded = load_quantized(LlamaConfig(), tmp_path).eval()  # built lazily by the config's build()
    assert torch.equal(loaded.positions, torch.arange(LlamaConfig().max_seq))  # non-persistent: init_module
    assert loaded.head.weight_int8 is loaded.embed.weight_int8
    torch.testing.assert_close(loaded(idx), out, rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"config with build\(\), a factory"):
        load_quantized(object(), tmp_path)


# ---- without the contract ---------------------------------------------------------------------

class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)))


def test_without_the_contract_torch_defaults_or_errors_naming_the_method():
    import torch.distributed as dist

    from colossal_lab.engine.lazy import lazy_init, materialize
    from colossal_lab.engine.models import ModelConfig, ModelContract
    from colossal_lab.engine.plugins import HybridParallelPlugin

    assert isinstance(llama(), ModelContract) and isinstance(LlamaConfig(), ModelConfig)
    assert not isinstance(Plain(), ModelContract)
    # lazy init: torch's reset_parameters() for every module
    torch.manual_seed(0)
    eager = Plain()
    with lazy_init():
        lazy = Plain()
    torch.manual_seed(0)
    materialize(lazy)
    for (n, p), q in zip(lazy.named_parameters(), eager.parameters()):
        assert torch.equal(p, q), n

    class Odd(Plain):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(8))

    with lazy_init():
        odd = Odd()
    with pytest.raises(ValueError, match=r"no init rule for module '<root>'.*reset_parameters.*init_module"):
        materialize(odd)

    def configure(model, **kw):
        HybridParallelPlugin(**kw).configure(model, None, None, None, None, "fp32")

    with pytest.raises(TypeError, match=r"Plain has no num_layers\(\).*model contract.*nn.Sequential"):
        configure(Plain(), pp_size=2, num_microbatches=2)
    with pytest.raises(ValueError, match=r"Plain has no tp_plan\(\).*model contract"):
        configure(Plain(), tp_size=2)
    with pytest.raises(ValueError, match=r"Plain has no enable_activation_checkpointing\(\)"):
        configure(Plain(), activation_checkpointing=True)
    with pytest.raises(ValueError, match=r"n_kv_heads=2 does not divide over 4 ranks"):
        configure(llama(), tp_size=4)
    assert not dist.is_initialized()  # every error came before any process group


def test_no_engine_module_knows_the_reference_model():
    """Outside engine/models, engine code (docstrings aside) names no GPT class or GPT part."""
    root = ROOT / "engine"
    pattern = re.compile(r"models\.gpt|\bGPT(Config)?\b|tok_emb|lm_head|n_head|n_layer|tie_embeddings|"
                         r"\.blocks\b|'blocks'|cfg\.activation_checkpointing")
    found = []
    for f in sorted(root.rglob("*.py")):
        if "models" in f.relative_to(root).parts:
            continue
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                body[0] = ast.Pass()  # docstrings may use GPT as an example
        found += [f"{f.relative_to(root)}: {m.group()}" for m in pattern.finditer(ast.unparse(tree))]
    assert not found, found
