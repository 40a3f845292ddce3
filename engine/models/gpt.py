"""The reference model: a compact decoder-only transformer, nanoGPT-short.

RMSNorm, rotary positions, SwiGLU MLP, no biases; ``tie_embeddings=False`` by default. Tests,
benchmarks and tutorials share it. It implements the whole model contract (:mod:`.protocol`);
heads are inferred from the local width, so a tensor-parallel block runs unchanged, and blocks
live in an ``nn.ModuleDict`` keyed by layer index, so a pipeline stage's parameter names equal
the full model's (checkpoints line up across layouts), as in torchtitan.

Attention and RMSNorm go through ``colossal_lab.kernels`` when it provides them (Triton on
CUDA, the best torch path elsewhere).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Dict, FrozenSet, Iterable, List, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    vocab_size: int = 50304
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    tie_embeddings: bool = False
    # True: every block recomputes in backward; "auto": a request (checkpoint_budget) that the engine
    # plans (engine/autockpt_request.py) so a training step's activations stay under activation_budget
    # bytes (under HybridParallelPlugin / GeminiPlugin the plugin makes that plan: a stage gets its share)
    activation_checkpointing: Union[bool, str] = False
    activation_budget: Optional[int] = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    mlp_hidden: Optional[int] = None  # default: SwiGLU's 8/3 * n_embd rounded up to 64
    # mixture of experts (engine/moe, docs/moe.md): n_expert > 0 swaps every block's MLP for an MoE
    # block of n_expert SwiGLU experts of width `hidden`, top_k of them per token; 0 = dense (default)
    n_expert: int = 0
    top_k: int = 2
    moe_gating: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    n_shared_expert: int = 0  # DeepSeek's always-on shared experts
    capacity_factor: Optional[float] = None  # None: dropless; else each expert keeps ceil(c * N * k / E) tokens
    aux_loss_coef: float = 0.01  # load-balancing loss weight (per sequence, Switch's form)
    z_loss_coef: float = 0.0  # router z-loss weight (ST-MoE)

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(f"GPTConfig: head dim n_embd/n_head={self.n_embd // self.n_head} "
                             "must be even for rotary positions")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig: {name}={getattr(self, name)} must be >= 1")
        self._check_moe()
        ac, budget = self.activation_checkpointing, self.activation_budget
        if not (isinstance(ac, bool) or ac == "auto"):
            raise ValueError(f"GPTConfig: activation_checkpointing={ac!r} must be True, False or 'auto'")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0):
            raise ValueError(f"GPTConfig: activation_budget={budget!r} must be a number of bytes > 0, e.g. "
                             "activation_budget=2 << 30")
        if ac == "auto" and budget is None:
            raise ValueError("GPTConfig(activation_checkpointing='auto') needs activation_budget=<bytes> > 0: the peak "
                             "activation memory of a training step the plan must stay under (e.g. activation_budget="
                             "2 << 30), or use activation_checkpointing=True to recompute every block")

    def _check_moe(self) -> None:
        from ..moe.router import GATINGS

        E, k = self.n_expert, self.top_k
        if isinstance(E, bool) or not isinstance(E, int) or E < 0:
            raise ValueError(f"GPTConfig: n_expert={E!r} must be an int >= 0 (0: a dense MLP in every block)")
        if not E:
            return
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= E:
            raise ValueError(f"GPTConfig: top_k={k!r} must be an int in [1, n_expert={E}]")
        if self.moe_gating not in GATINGS:
            raise ValueError(f"GPTConfig: moe_gating={self.moe_gating!r}; choose one of {GATINGS}")
        if not isinstance(self.n_shared_expert, int) or self.n_shared_expert < 0:
            raise ValueError(f"GPTConfig: n_shared_expert={self.n_shared_expert!r} must be an int >= 0")
        cf = self.capacity_factor
        if cf is not None and not (isinstance(cf, (int, float)) and cf > 0):
            raise ValueError(f"GPTConfig: capacity_factor={cf!r} must be None (dropless) or a number > 0, e.g. 1.25")

    @property
    def hidden(self) -> int:
        if self.mlp_hidden:
            return self.mlp_hidden
        h = int(8 * self.n_embd / 3)
        return (h + 63) // 64 * 64

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        """A named size: ``tiny`` (tests), ``small``, ``124m``, ``350m``, ``774m``, ``1.5b``, ``2.7b``."""
        if name not in PRESETS:
            raise ValueError(f"GPTConfig.preset({name!r}): unknown preset; choose one of {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides)

    def build(self) -> "GPT":
        """The model this config describes (the contract's config side: ``load_quantized(cfg, ...)``)."""
        return GPT(self)


PRESETS: Dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64),
    "small": GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_embd=256),
    "124m": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "350m": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "774m": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "1.5b": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
    "2.7b": GPTConfig(n_layer=32, n_head=32, n_embd=2560, block_size=2048),
}


def _kernels():
    try:
        from colossal_lab import kernels
    except Exception:  # kernels are optional for the model
        return None
    return kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = _kernels()
        if k is not None and hasattr(k, "rms_norm"):
            return k.rms_norm(x, self.weight, eps=self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(head_dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(length, dtype=torch.float32), inv)  # (T, hd/2)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, hd); rotate channel pairs (2i, 2i+1) by position-dependent angles."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


@dataclass
class KVCache:
    """Per-layer keys and values for incremental decoding (``GPT.generate``)."""

    k: Dict[str, torch.Tensor] = field(default_factory=dict)
    v: Dict[str, torch.Tensor] = field(default_factory=dict)
    pos: int = 0


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.wq = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wo = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.dropout = cfg.dropout
        self.cp_attention = None  # a context_parallel.ContextParallel (GPT.enable_context_parallel)

    def forward(self, x, cos, sin, cache: Optional[KVCache] = None, key: str = ""):
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_head / tp of them.
        q = apply_rope(self.wq(x).view(B, T, -1, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(B, T, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
        causal = True
        if cache is not None:
            if key in cache.k:
                k = torch.cat([cache.k[key], k], dim=2)
                v = torch.cat([cache.v[key], v], dim=2)
            cache.k[key], cache.v[key] = k, v
            causal = T > 1 and k.shape[2] == T  # one new token attends to every cached one
            if T > 1 and k.shape[2] != T:
                raise NotImplementedError("KVCache: prefill must start from an empty cache")
        kern = _kernels()
        if self.cp_attention is not None:  # x is this rank's shard of the sequence: ring or Ulysses
            y = self.cp_attention(q, k, v, causal=causal)
        elif kern is not None and hasattr(kern, "flash_attention") and (not self.training or self.dropout == 0.0):
            # the dispatcher: Triton flash attention (fwd+bwd) on CUDA, SDPA elsewhere
            y = kern.flash_attention(q, k, v, causal=causal)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, dropout_p=self.dropout if self.training else 0.0
            )
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.n_embd, cfg.hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.n_embd, cfg.hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.hidden, cfg.n_embd, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _moe(cfg: GPTConfig) -> nn.Module:
    """The MoE block that replaces a block's MLP when ``cfg.n_expert > 0`` (engine/moe)."""
    from ..moe import MoE

    return MoE(cfg.n_embd, cfg.hidden, cfg.n_expert, cfg.top_k, cfg.moe_gating, cfg.n_shared_expert,
               cfg.capacity_factor, cfg.aux_loss_coef, cfg.z_loss_coef,
               out_std=0.02 / math.sqrt(2 * cfg.n_layer))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MLP(cfg) if not cfg.n_expert else _moe(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, cos, sin, cache: Optional[KVCache] = None, key: str = "",
                recompute: FrozenSet[str] = frozenset()):
        # recompute: the sub-modules ("attn", "mlp") checkpointed on their own (GPT.forward decides)
        a = self.attn_norm(x)
        if "attn" in recompute:  # the same five positional inputs a tensor-parallel plan expects
            y = checkpoint(self.attn, a, cos, sin, None, key, use_reentrant=False,
                           preserve_rng_state=self.attn.dropout > 0)
        else:
            y = self.attn(a, cos, sin, cache, key)
        x = x + self.drop(y)
        m = self.mlp_norm(x)
        if "mlp" in recompute:  # nothing random inside: no RNG state to keep
            return x + self.drop(checkpoint(self.mlp, m, use_reentrant=False, preserve_rng_state=False))
        return x + self.drop(self.mlp(m))


class GPT(nn.Module):
    """``logits, loss = GPT(cfg)(idx, targets)``; ``loss`` is None without targets.

    A pipeline stage (``pipeline_stage``) has ``tok_emb``/``norm``/``lm_head`` set to None
    where it does not own them; it then takes and returns hidden states instead of ids/logits.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb: Optional[nn.Embedding] = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.norm: Optional[RMSNorm] = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head: Optional[nn.Linear] = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.context_parallel = None  # set by enable_context_parallel
        # activation checkpointing (cfg.activation_checkpointing switches it on): block index -> what
        # recomputes ({"layer"} = the whole block, or parts); None = every block whole ("auto": none
        # until the engine's first plan)
        self.checkpoint_layers: Optional[Dict[int, FrozenSet[str]]] = None
        self.checkpoint_plan = None  # the autockpt.CheckpointPlan in use ("auto", or autockpt.apply)
        # "auto" is a request (checkpoint_budget) the engine plans at training forwards, never this model
        from ..autockpt_request import plan_on_request

        plan_on_request(self)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("attn.wo.weight") or name.endswith("mlp.w2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None):
        T = idx.shape[1]
        start = cache.pos if cache is not None else 0
        cp = self.context_parallel
        if cp is not None and cache is not None:
            raise NotImplementedError("GPT: KV-cache decoding under context parallelism; decode with a plain model")
        total = start + T * (cp.size if cp is not None else 1)
        if total > self.cfg.block_size:
            raise ValueError(f"GPT: sequence of {total} tokens exceeds block_size={self.cfg.block_size}")
        if cp is None:
            cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]
        else:  # a shard of the sequence: the rows of its tokens' global positions, sharded alike
            cos, sin = (cp.shard_constant(t[:T * cp.size], dim=0) for t in (self.rope_cos, self.rope_sin))
        recompute = self._recompute(cache)
        h = self.drop(self.tok_emb(idx)) if self.tok_emb is not None else idx
        for key, block in self.blocks.items():
            what = recompute.get(int(key), frozenset())
            if "layer" in what:  # the same five positional inputs as below (a tensor-parallel plan's hooks)
                h = checkpoint(block, h, cos, sin, None, key, use_reentrant=False,
                               preserve_rng_state=self.cfg.dropout > 0)  # dropout: replay its masks
            else:
                h = block(h, cos, sin, cache, key, recompute=what)
        if cache is not None:
            cache.pos += T
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is None:
            return h, None  # a middle pipeline stage hands hidden states on
        logits = self.lm_head(h)
        loss = None
        if targets is not None:  # vocab-parallel on an N-d head's logits block, F.cross_entropy on whole logits
            from ..tp_nd.layers_common import cross_entropy

            loss = cross_entropy(logits, targets, ignore_index=-1)
        return logits, loss

    # ---- the model contract (protocol.py): what the engine asks of a model -------------------

    def init_module(self, name: str, module: nn.Module) -> None:
        """The constructor's recipe for one module, for lazy init (the engine calls it)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            scaled = name.endswith(("attn.wo", "mlp.w2"))  # GPT-2's scaled residual projections
            nn.init.normal_(module.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.cfg.n_layer) if scaled else 0.02)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif type(module).__name__ in ("GroupedExperts", "TopKRouter"):  # engine/moe: experts, the choice bias
            from ..moe import GroupedExperts

            module.reset_parameters() if isinstance(module, GroupedExperts) else module.expert_bias.zero_()
        elif module is self:
            cos, sin = rope_tables(self.cfg.n_embd // self.cfg.n_head, self.cfg.block_size, self.cfg.rope_theta)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def tp_plan(self, sequence_parallel: bool = False) -> dict:
        """Megatron column/row plan for ``parallelize_module``, of this model or a stage of it;
        embedding and head stay whole (small models). With ``sequence_parallel`` (Megatron-SP)
        norms run on sequence shards, attention/MLP gather their input and reduce-scatter their
        output; a stage takes and hands on the whole sequence (its rotary tables are sized from it)."""
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

        from ..tensor_parallel import seq_boundary

        sp = sequence_parallel
        if sp and self.cfg.n_expert:  # an MoE block takes the whole sequence and hands it on whole
            raise ValueError(f"GPT(n_expert={self.cfg.n_expert}): MoE blocks stay whole on every tp rank, which only "
                             "1D tensor parallelism without sequence parallelism gives them so far; use "
                             "sequence_parallel=False")
        keys = list(self.blocks.keys())
        nb = 5  # Block's positional inputs as forward passes them (checkpointed or not)
        plan = {}
        if sp and self.tok_emb is not None:
            plan["tok_emb"] = seq_boundary(out="shard")
        elif sp and keys:  # a later stage cuts the whole sequence before its first block
            plan[f"blocks.{keys[0]}"] = seq_boundary(nb, into="shard")
        for key in keys:
            p = f"blocks.{key}"
            if sp:
                plan[f"{p}.attn_norm"], plan[f"{p}.mlp_norm"] = SequenceParallel(), SequenceParallel()
                plan[f"{p}.attn"] = seq_boundary(5, into="gather")  # Attention(x, cos, sin, cache, key)
                plan[f"{p}.mlp"] = seq_boundary(into="gather")
            # an MoE block stays whole on every tp rank (its experts split over ep_size instead): it takes
            # the replicated residual stream as a norm does, and every tp rank computes the same routing
            mlp = () if self.cfg.n_expert else ("mlp.w1", "mlp.w3")
            for n in ("attn.wq", "attn.wk", "attn.wv") + mlp:
                plan[f"{p}.{n}"] = ColwiseParallel()
            for n in ("attn.wo",) + (() if self.cfg.n_expert else ("mlp.w2",)):
                plan[f"{p}.{n}"] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
        if sp and self.norm is not None:
            plan["norm"] = SequenceParallel()
            plan["lm_head"] = seq_boundary(into="gather")  # the head may be tied: it stays whole
        elif sp and keys:  # hand the next stage the whole sequence (a one-block stage also cuts it)
            last = f"blocks.{keys[-1]}"
            plan[last] = seq_boundary(nb, into="shard" if last in plan else None, out="gather")
        return plan

    def tp_nd_plan(self) -> dict:
        """Roles of this model's (or stage's) layers for 2D/2.5D/3D tensor parallelism
        (``engine/tp_nd/apply.py``): the 1D plan's column/row linears, the embedding, the norms
        and the head (vocab-parallel logits)."""
        if self.cfg.n_expert:
            raise ValueError(f"GPT(n_expert={self.cfg.n_expert}): MoE blocks stay whole on every tp rank, which only "
                             "1D tensor parallelism gives them so far; use tp_mode='1d'")
        plan = {"tok_emb": "embedding", "norm": "rmsnorm", "lm_head": "head"}
        for key in self.blocks:
            p = f"blocks.{key}"
            plan[f"{p}.attn_norm"] = plan[f"{p}.mlp_norm"] = "rmsnorm"
            plan.update({f"{p}.{n}": "colwise" for n in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3")})
            plan.update({f"{p}.{n}": "rowwise" for n in ("attn.wo", "mlp.w2")})
        return plan

    def check_tp(self, tp_size: int) -> None:
        if self.cfg.n_head % tp_size:
            raise ValueError(f"GPT: n_head={self.cfg.n_head} is not divisible by the {tp_size} ranks of the "
                             f"tensor-parallel group; use a size that divides {self.cfg.n_head}")

    def num_layers(self) -> int:
        return self.cfg.n_layer

    def enable_context_parallel(self, group, mode: str) -> None:
        """Context parallelism over ``group`` (``mode`` ``"ring"`` or ``"ulysses"``): every attention
        runs through one ``ContextParallel`` handle and the rotary tables are indexed at the shard's
        global positions; the model then takes ``shard_batch``'s shards of ``idx``/``targets`` and its
        loss is the mean over this rank's tokens."""
        from ..context_parallel import ContextParallel

        if self.cfg.dropout:
            raise ValueError(f"GPT: context parallelism computes attention without dropout; this model has "
                             f"dropout={self.cfg.dropout} (use GPTConfig(dropout=0.0))")
        cp = ContextParallel(group, mode)
        cp.check_heads(self.cfg.n_head)
        self.context_parallel = cp
        for block in self.blocks.values():
            block.attn.cp_attention = cp

    def enable_activation_checkpointing(self, layers: Optional[Iterable[Union[int, str]]] = None) -> None:
        """Recompute in backward every block (``layers=None``) or the listed ones: ``i`` is block ``i``
        whole, ``"i.attn"`` / ``"i.mlp"`` only that sub-module of it (``checkpoint_parts()``); ``[]``
        recomputes nothing. Replaces an earlier choice. Every block (``None``) also replaces an
        ``"auto"`` request; under ``"auto"`` a list is the plan for the current input (the engine
        profiles and hands its plans back this way) and the request stands for the next input shape."""
        self.checkpoint_layers = None if layers is None else self._parse_layers(layers)
        if layers is None or self.cfg.activation_checkpointing != "auto":
            self.cfg.activation_checkpointing = True

    def checkpoint_budget(self) -> Optional[int]:
        """The model contract's request: ``activation_budget`` while the config asks for ``"auto"``."""
        return self.cfg.activation_budget if self.cfg.activation_checkpointing == "auto" else None

    def activation_checkpointing_enabled(self) -> bool:
        """The model contract: ``cfg.activation_checkpointing`` is on (True or ``"auto"``)."""
        return bool(self.cfg.activation_checkpointing)

    def checkpoint_parts(self) -> tuple:
        """Sub-modules of a block that can recompute on their own (the model contract)."""
        return ("attn", "mlp")

    def _parse_layers(self, layers) -> Dict[int, FrozenSet[str]]:
        if isinstance(layers, (str, int)):
            raise TypeError(f"enable_activation_checkpointing(layers={layers!r}): "
                            f"pass a list, e.g. layers=[{layers!r}]")
        out: Dict[int, set] = {}
        for e in layers:
            i, part = e, "layer"
            if isinstance(e, str):
                head, _, tail = e.partition(".")
                i, part = (int(head) if head.isdigit() else None), (tail or "layer")
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.cfg.n_layer \
                    or part not in ("layer",) + self.checkpoint_parts():
                raise ValueError(f"enable_activation_checkpointing: layer {e!r} is not a block index in "
                                 f"[0, {self.cfg.n_layer}) or 'i.attn' / 'i.mlp'")
            have = out.setdefault(i, set())
            if "layer" in have or (have and part == "layer"):
                raise ValueError(f"enable_activation_checkpointing: block {i} is listed whole and in part; "
                                 "list it once")
            have.add(part)
        return {i: frozenset(p) for i, p in out.items()}

    def _recompute(self, cache) -> Dict[int, FrozenSet[str]]:
        """What each block recomputes in this forward (block index -> parts; {"layer"} = whole)."""
        ac = self.cfg.activation_checkpointing
        if not ac or not self.training or cache is not None:
            return {}
        layers = self.checkpoint_layers
        if ac == "auto" and (layers is None or not torch.is_grad_enabled()):
            return {}  # "auto": the engine's plan for this input, once it made one
        if layers is None:
            return {int(k): frozenset(("layer",)) for k in self.blocks}
        return layers

    def split_points(self, num_stages: int) -> List[int]:
        """Layer indices where stages 1..n-1 begin (even split; blocks must divide evenly)."""
        L = self.cfg.n_layer
        if num_stages < 1:
            raise ValueError(f"split_points: num_stages={num_stages} must be >= 1")
        if L % num_stages:
            valid = [d for d in range(1, L + 1) if L % d == 0]
            raise ValueError(
                f"GPT: n_layer={L} cannot be split evenly into {num_stages} pipeline stages; "
                f"use a number of stages (pp_size * num_model_chunks) in {valid}"
            )
        per = L // num_stages
        return [per * i for i in range(1, num_stages)]

    def pipeline_stage(self, stage: int, num_stages: int) -> "GPT":
        """A copy holding only stage ``stage``'s blocks (and the embedding/head at the ends).

        Only the stage's own part is copied: the other stages' modules are mapped to ``None`` in
        the deep copy's memo, so splitting a model holds it once plus one stage (not twice)."""
        if not 0 <= stage < num_stages:
            raise ValueError(f"pipeline_stage: stage={stage} must be in [0, {num_stages})")
        bounds = [0] + self.split_points(num_stages) + [self.cfg.n_layer]
        lo, hi = bounds[stage], bounds[stage + 1]
        drop = [b for key, b in self.blocks.items() if not lo <= int(key) < hi]
        if stage != 0:
            drop.append(self.tok_emb)
        if stage != num_stages - 1:
            drop += [self.norm, self.lm_head]
        # memo[id(x)] = None: deepcopy puts None wherever it meets x (a tied weight reached through
        # a module that is kept is still copied, through that module)
        memo = {id(mod): None for mod in drop if mod is not None}
        m = copy.deepcopy(self, memo)
        for key in list(m.blocks.keys()):
            if not lo <= int(key) < hi:
                del m.blocks[key]
        if stage != 0:
            m.tok_emb = None
        if stage != num_stages - 1:
            m.norm = None
            m.lm_head = None
        m.stage_index = stage  # as torch's PipelineStage names it: a checkpoint plan's event reports this stage
        return m

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, use_cache: bool = True) -> torch.Tensor:
        """Sample ``max_new_tokens`` after ``idx`` (B, T); greedy when ``temperature == 0``."""
        was_training = self.training
        self.eval()
        cache = KVCache() if use_cache else None
        out = idx
        step_in = idx
        for _ in range(max_new_tokens):
            if cache is not None and cache.pos + step_in.shape[1] > self.cfg.block_size:
                cache, step_in = KVCache(), out[:, -self.cfg.block_size + 1:]
            if cache is None:
                step_in = out[:, -self.cfg.block_size:]
            logits, _ = self(step_in, cache=cache)
            logits = logits[:, -1, :].float()
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1)
            out = torch.cat([out, nxt], dim=1)
            step_in = nxt
        self.train(was_training)
        return out
