"""A Llama-style decoder the engine has never seen, written to the model contract
(engine/models/protocol.py) and unlike the reference GPT on purpose: grouped-query attention (fewer
key/value heads than query heads), biasless RMSNorm, learned positions, a SwiGLU MLP, a head tied to
the embedding, layers in an ``nn.ModuleList`` (a pipeline stage keeps the others as parameter-free
placeholders) and a forward that returns bare logits. The model contract's tests train it under
every plugin; context parallelism's train it beside the GPT."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

SEED = 7


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
        # the stream is cut after this stage's first layer input, whole again after its last
        if sequence_parallel and held:
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


def llama(seed: int = SEED) -> Llama:
    """The default-sized model, its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return Llama(LlamaConfig())
