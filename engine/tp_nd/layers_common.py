"""The layers every N-d mode shares, written against a layout (``grid.Layout``), not a mode.

Built on torch: ``autograd.Function`` and the counted ``torch.distributed`` collectives of
:mod:`.counter`. By hand, after Colossal-AI's 2D/2.5D/3D layers:

* :func:`gather_piece`: a parameter is stored as one piece per rank and gathered where it is used
  (all-gather over the layout's batch group forward, reduce-scatter of its gradient backward), so
  every element has one owner in the grid (no replicas to keep in step, a norm counts it once).
* :class:`RMSNorm`: statistics (the sum of squares over the hidden dimension) all-reduced over the
  layout's hidden group; the weight's ``h / q`` slice gathered from its pieces.
* :class:`LayerNorm`: the same, with the mean and the variance (two all-reduces); weight and bias
  pieces gathered alike.
* :class:`Embedding`: the lookup of this rank's batch rows into the ``h / q`` columns of its hidden
  slice (weight ``(V, h / tp)`` pieces gathered over the batch group).
* :func:`cross_entropy`: vocab-parallel cross-entropy (Megatron's): the max, the sum of
  exponentials and the target's logit all-reduced over the vocab (hidden) group of the logits'
  layout; the backward is local. :func:`gather_vocab` is the alternative for an arbitrary
  criterion: logits all-gathered over the vocab group, each rank back-propagating its own slice.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import counter


class _GatherPiece(torch.autograd.Function):
    @staticmethod
    def forward(ctx, piece, g, dim, kind):
        ctx.g, ctx.dim, ctx.kind = g, dim, kind
        return counter.all_gather(piece, g, kind + ".gather", dim)

    @staticmethod
    def backward(ctx, grad):
        return counter.reduce_scatter(grad, ctx.g, ctx.kind + ".rs_grad", ctx.dim), None, None, None


def gather_piece(piece: torch.Tensor, g, dim: int, kind: str) -> torch.Tensor:
    """The pieces of a parameter held by the ranks of ``g``, concatenated along ``dim`` (group-rank
    order); backward sums the gradient over ``g`` and hands each rank its piece's part."""
    if g.pg is None:
        return piece
    return _GatherPiece.apply(piece, g, dim, kind)


class _AllReduce(torch.autograd.Function):
    """Sum over ``g`` of a value every rank then uses: backward sums the gradients the same way."""

    @staticmethod
    def forward(ctx, x, g, kind):
        ctx.g, ctx.kind = g, kind
        return counter.all_reduce(x.clone(), g, kind)

    @staticmethod
    def backward(ctx, grad):
        return counter.all_reduce(grad.contiguous().clone(), ctx.g, ctx.kind + "_grad"), None, None


def all_reduce(x: torch.Tensor, g, kind: str) -> torch.Tensor:
    return x if g.pg is None else _AllReduce.apply(x, g, kind)


class RMSNorm(nn.Module):
    """RMSNorm over a hidden dimension cut across ``layout.hidden``: ``weight`` is this rank's piece
    ``(h / tp,)`` of the full ``(h,)``; the same arithmetic as the reference GPT's norm."""

    def __init__(self, weight: torch.Tensor, eps: float, hidden: int, grid, layout):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.eps, self.hidden = eps, hidden
        self.hidden_group = grid.group((layout.hidden,))
        self.batch_group = grid.group(layout.batch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = gather_piece(self.weight, self.batch_group, 0, "norm.weight")
        xf = x.float()
        ss = all_reduce(xf.pow(2).sum(-1, keepdim=True), self.hidden_group, "norm.stats")
        return (xf * torch.rsqrt(ss / self.hidden + self.eps)).type_as(x) * w


class LayerNorm(nn.Module):
    """LayerNorm over a hidden dimension cut across ``layout.hidden``: ``weight`` and ``bias`` are
    this rank's pieces ``(h / tp,)``; the mean, then the variance around it, are sums over the
    hidden group (two passes, as ``F.layer_norm`` computes them)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, eps: float, hidden: int, grid, layout):
        super().__init__()
        self.weight, self.bias = nn.Parameter(weight), nn.Parameter(bias)
        self.eps, self.hidden = eps, hidden
        self.hidden_group = grid.group((layout.hidden,))
        self.batch_group = grid.group(layout.batch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = gather_piece(self.weight, self.batch_group, 0, "norm.weight")
        b = gather_piece(self.bias, self.batch_group, 0, "norm.bias")
        xf = x.float()
        mean = all_reduce(xf.sum(-1, keepdim=True), self.hidden_group, "norm.stats") / self.hidden
        xc = xf - mean
        var = all_reduce(xc.pow(2).sum(-1, keepdim=True), self.hidden_group, "norm.stats") / self.hidden
        return (xc * torch.rsqrt(var + self.eps)).type_as(x) * w + b


class _Lookup(nn.Embedding):
    """``nn.Embedding``'s lookup on this rank's hidden slice: placed after a subclass in the MRO of
    :func:`adopt_embedding`'s class, so the subclass's own forward calls it as ``super().forward``."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        w = gather_piece(self.weight, self._nd_batch_group, 1, "embedding.weight")
        return F.embedding(idx, w, self.padding_idx)


def adopt_embedding(old: nn.Embedding, weight: torch.Tensor, grid, layout) -> nn.Embedding:
    """A subclass of ``nn.Embedding`` (its forward computes the ids, then calls the lookup) turned,
    in place, into one whose lookup is :class:`_Lookup`'s on ``weight`` (the ``(V, h / tp)`` piece)."""
    if old.max_norm is not None or old.sparse:
        raise ValueError(f"N-d tensor parallelism: {type(old).__name__} uses max_norm/sparse")
    old.__class__ = type(f"Nd{type(old).__name__}", (type(old), _Lookup), {})
    old.weight = nn.Parameter(weight)
    old._nd_batch_group = grid.group(layout.batch)
    return old


class Embedding(nn.Module):
    """``nn.Embedding`` whose output is this rank's hidden slice: ``weight`` is its piece
    ``(V, h / tp)``, gathered to ``(V, h / q)`` over the layout's batch group."""

    def __init__(self, weight: torch.Tensor, grid, layout, padding_idx: Optional[int] = None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.batch_group = grid.group(layout.batch)
        self.padding_idx = padding_idx

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        w = gather_piece(self.weight, self.batch_group, 1, "embedding.weight")
        return F.embedding(idx, w, self.padding_idx)


# ---- the loss ------------------------------------------------------------------------------------

class VocabShard:
    """What a logits block knows of itself: the vocab group, where its columns start, the vocab."""

    def __init__(self, group, start: int, vocab: int, batch_group):
        self.group, self.start, self.vocab, self.batch_group = group, start, vocab, batch_group


def mark_logits(logits: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    logits._tp_nd_vocab = shard  # read by cross_entropy / gather_vocab
    return logits


def vocab_shard_of(logits: torch.Tensor) -> Optional[VocabShard]:
    return getattr(logits, "_tp_nd_vocab", None)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, g, start, ignore_index):
        lf = logits.float()
        m = lf.max(-1).values
        counter.all_reduce(m, g, "ce.max", op=dist.ReduceOp.MAX)
        e = (lf - m.unsqueeze(-1)).exp()
        s = e.sum(-1)
        counter.all_reduce(s, g, "ce.sumexp")
        local = target - start
        inside = (local >= 0) & (local < lf.shape[-1])
        idx = local.clamp(0, lf.shape[-1] - 1).unsqueeze(-1)
        picked = lf.gather(-1, idx).squeeze(-1) * inside
        counter.all_reduce(picked, g, "ce.target")
        valid = target != ignore_index
        n = valid.sum().clamp(min=1).to(lf.dtype)
        loss = ((s.log() + m - picked) * valid).sum() / n
        ctx.save_for_backward(e, s, idx, inside, valid, n)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g_loss):
        e, s, idx, inside, valid, n = ctx.saved_tensors
        grad = e / s.unsqueeze(-1)
        grad.scatter_add_(-1, idx, -inside.to(grad.dtype).unsqueeze(-1))
        grad.mul_((valid.to(grad.dtype) * (g_loss / n)).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy over this rank's (non-ignored) rows of ``logits`` ``(..., V_local)`` against
    ``targets`` ``(...)`` (global vocab ids). Vocab-parallel when ``logits`` is a block the N-d head
    made (three small all-reduces over its vocab group), ``F.cross_entropy`` on whole logits, so the
    same criterion runs in a one-process reference."""
    shard = vocab_shard_of(logits)
    lf, tf = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if shard is None:
        return F.cross_entropy(lf.float(), tf, ignore_index=ignore_index)
    if shard.group.pg is None:
        return F.cross_entropy(lf.float(), tf, ignore_index=ignore_index)
    return _VocabParallelCE.apply(lf, tf, shard.group, shard.start, ignore_index)


class _GatherVocab(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g, ctx.n = g, x.shape[-1]
        return counter.all_gather(x, g, "vocab.gather", dim=x.dim() - 1)

    @staticmethod
    def backward(ctx, grad):
        # every rank of the group computed the same loss from the same gathered logits: each
        # back-propagates its own columns (summing would count the loss g.size times)
        return grad.narrow(-1, ctx.g.rank * ctx.n, ctx.n).contiguous(), None


def gather_vocab(logits: torch.Tensor, shard: Optional[VocabShard] = None) -> torch.Tensor:
    """Whole-vocab logits of this rank's rows (for a criterion written for whole logits); ``shard``:
    the head's, where the logits may have lost their mark (a model that post-processes them)."""
    shard = shard if shard is not None else vocab_shard_of(logits)
    if shard is None or shard.group.pg is None:
        return logits
    return _GatherVocab.apply(logits, shard.group)


class CrossEntropy:
    """A ready criterion, ``criterion(outputs, batch)``: :func:`cross_entropy` of the logits against
    ``batch[key]``. Marked ``vocab_parallel``, so ``execute_pipeline`` hands it the logits block
    itself instead of gathering the vocab; on whole logits it is ``F.cross_entropy``."""

    vocab_parallel = True

    def __init__(self, key: str = "targets", ignore_index: int = -100):
        self.key, self.ignore_index = key, ignore_index

    def __call__(self, outputs: torch.Tensor, batch: dict) -> torch.Tensor:
        return cross_entropy(outputs, batch[self.key], self.ignore_index)


def vocab_parallel(fn):
    """Mark a criterion as taking logits blocks (it calls :func:`cross_entropy` itself)."""
    fn.vocab_parallel = True
    return fn
