"""The model contract (engine/models/protocol.py): a model the engine has never seen trains under
every plugin like one plain-torch process, lazy init and int8 loading work on it, and a model
without the contract gets torch's defaults or an error naming the missing method.

The second model is written here and is unlike the reference GPT on purpose: a Llama-style
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
import math
import os
import pathlib
import re
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from _dist import run_distributed
from _engine_common import batch, global_mean, param_groups

STEPS = 5
SEED = 7
LR = 1e-2


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden: int = 96
    max_seq: int = 64

    def build(self) -> "Llama":
        return Llama(self)


class Norm(nn.Module):
    """RMSNorm with a weight and no bias (and no ``reset_parameters``: the model initialises it)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class GQAttention(nn.Module):
    cp = None  # context parallelism's attention (Llama.enable_context_parallel)

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.head_dim, self.group = c.dim // c.n_heads, c.n_heads // c.n_kv_heads
        self.q_proj = nn.Linear(c.dim, c.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.dim, c.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.dim, c.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(c.n_heads * self.head_dim, c.dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        # -1 heads: a tensor-parallel rank holds a slice of query and key/value heads alike
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True) if self.cp is None else self.cp(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(c.dim, c.hidden, bias=False)
        self.up = nn.Linear(c.dim, c.hidden, bias=False)
        self.down = nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Layer(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.input_norm, self.attn = Norm(c.dim), GQAttention(c)
        self.post_attn_norm, self.mlp = Norm(c.dim), SwiGLU(c)

    def forward(self, h):
        h = h + self.attn(self.input_norm(h))
        return h + self.mlp(self.post_attn_norm(h))


class Llama(nn.Module):
    """``logits = Llama(cfg)(tokens)``; a later pipeline stage takes and returns hidden states."""

    cp = None  # a ContextParallel handle (enable_context_parallel)

    def __init__(self, c: LlamaConfig):
        rng = torch.get_rng_state()
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.pos = nn.Embedding(c.max_seq, c.dim)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.n_layers))
        self.final_norm = Norm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab_size, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("positions", torch.arange(c.max_seq), persistent=False)
        self.checkpointing = False
        # init draws start where the caller seeded, whatever the constructors drew, so an eager
        # build and a lazy build materialised from the same seed hold the same weights
        torch.set_rng_state(rng)
        for name, module in self.named_modules():
            self.init_module(name, module)

    def forward(self, x):
        if self.embed is not None:
            T = x.shape[1]  # under context parallelism a shard: its tokens' global positions
            x = self.embed(x) + self.pos(self.positions[:T] if self.cp is None else self.cp.positions(T, x.device))
        for layer in self.layers:
            if isinstance(layer, Layer):  # placeholders stand for other stages' layers
                x = checkpoint(layer, x, use_reentrant=False) if self.checkpointing and self.training else layer(x)
        return x if self.head is None else self.head(self.final_norm(x))

    # ---- the model contract ----
    def init_module(self, name, module):
        tied = self.embed is not None and getattr(module, "weight", None) is self.embed.weight
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, nn.Linear) and not tied:  # the tied head was initialised as the embedding
            nn.init.normal_(module.weight, std=1 / math.sqrt(module.in_features))
        elif isinstance(module, Norm):
            nn.init.ones_(module.weight)
        elif module is self:
            self.positions.copy_(torch.arange(self.config.max_seq))

    def _held(self):
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, Layer)]

    def tp_plan(self, sequence_parallel=False):
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

        from colossal_lab.engine.tensor_parallel import seq_boundary

        plan, held = {}, self._held()
        for i in held:
            p = f"layers.{i}"
            for n in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate", "mlp.up"):
                plan[f"{p}.{n}"] = ColwiseParallel()
            for n in ("attn.o_proj", "mlp.down"):
                plan[f"{p}.{n}"] = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
            if sequence_parallel:
                plan[f"{p}.input_norm"], plan[f"{p}.post_attn_norm"] = SequenceParallel(), SequenceParallel()
                plan[f"{p}.attn"], plan[f"{p}.mlp"] = seq_boundary(into="gather"), seq_boundary(into="gather")
        if sequence_parallel and held:  # the stream is cut after this stage's first layer input, whole again after its last
            first, last = f"layers.{held[0]}", f"layers.{held[-1]}"
            plan[first] = seq_boundary(into="shard", out="gather" if first == last else None)
            if last != first:
                plan[last] = seq_boundary(out="gather")
        return plan

    def check_tp(self, tp_size):
        if self.config.n_kv_heads % tp_size:
            raise ValueError(f"Llama: n_kv_heads={self.config.n_kv_heads} does not divide over {tp_size} ranks")

    def num_layers(self):
        return len(self.layers)

    def pipeline_stage(self, stage, num_stages):
        per = len(self.layers) // num_stages
        m = copy.deepcopy(self)
        for i in range(len(m.layers)):
            if not stage * per <= i < (stage + 1) * per:
                m.layers[i] = nn.Identity()
        if stage > 0:
            m.embed = m.pos = None
        if stage < num_stages - 1:
            m.final_norm = m.head = None
        return m

    def enable_activation_checkpointing(self):
        self.checkpointing = True

    def enable_context_parallel(self, group, mode):
        from colossal_lab.engine.context_parallel import ContextParallel

        self.cp = ContextParallel(group, mode)
        self.cp.check_heads(self.config.n_heads)  # Ulysses splits the (repeated) key/value heads too
        for layer in self.layers:
            if isinstance(layer, Layer):
                layer.attn.cp = self.cp


def _model(seed=SEED):
    torch.manual_seed(seed)
    return Llama(LlamaConfig())


def crit(out, b):
    return F.cross_entropy(out.flatten(0, 1).float(), b["targets"].flatten())


def _reference():
    model = _model()
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    losses = []
    for s in range(STEPS):
        idx, tgt = batch(s)
        loss = crit(model(idx), {"targets": tgt})
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
        model = _model()
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    model, opt, *_ = booster.boost(model, opt, crit)
    hybrid = plugin.supports_pipeline
    out = {"losses": []}
    for s in range(STEPS):
        if hybrid:  # dp=1 here: every rank takes the whole batch
            idx, tgt = batch(s)
            loss = booster.execute_pipeline(iter([{"idx": idx, "targets": tgt}]), model, crit, opt)["loss"]
        else:
            idx, tgt = batch(s, rank, world)
            loss = crit(model(idx), {"targets": tgt})
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

    eager = _model()
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

    m = _model().eval()
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

    assert isinstance(_model(), ModelContract) and isinstance(LlamaConfig(), ModelConfig)
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
        configure(_model(), tp_size=4)
    assert not dist.is_initialized()  # every error came before any process group


def test_no_engine_module_knows_the_reference_model():
    """Outside engine/models, engine code (docstrings aside) names no GPT class or GPT part."""
    root = pathlib.Path(__file__).resolve().parents[1] / "engine"
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
