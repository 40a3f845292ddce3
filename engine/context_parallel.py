"""Context parallelism: ring attention and Ulysses over a ``cp`` process group.

Each of the ``cp`` ranks holds a shard of every sequence (of the batch, the targets, the rotary
positions); only attention needs the whole sequence, and gets it one of two ways:

* **ring** (``mode="ring"``): K/V blocks travel around the ring (P2P ``batch_isend_irecv``, the
  next transfer overlapping the current block's attention); each block's attention comes with its
  log-sum-exp and the blocks are merged by online softmax. Backward sends K/V around again with
  the dK/dV accumulators travelling beside them, recomputing each block's probabilities from the
  saved output and lse, exactly as ring-flash-attention does. Causal attention is load-balanced by
  **zig-zag** sharding: the sequence is cut into ``2*cp`` chunks and rank ``r`` holds chunks ``r``
  and ``2*cp-1-r`` (an early and a late one), so every rank does the same work: at step 0 a rank
  attends causally within its own two chunks; a block from a lower rank ``s < r`` is seen whole
  by both local chunks, but only its first chunk (``s``; chunk ``2cp-1-s`` lies in the future);
  a block from a higher rank is seen whole, but only by the local late chunk.
* **ulysses** (``mode="ulysses"``): one all-to-all turns the sequence-sharded ``(B, H, T/cp, D)``
  q/k/v into head-sharded ``(B, H/cp, T, D)``, attention runs locally over the whole (contiguously
  sharded) sequence, and one all-to-all turns the output back; backward all-to-alls the gradient
  and the output to heads, and dq/dk/dv back. Needs ``cp`` to divide the heads.

Both take two options of the attention itself (GPT-OSS's and Gemma 2's):

* **attention sinks** (``sinks``: one logit per head, ``(H,)`` for the rank's heads, in every row's
  softmax denominator with a zero value): no kernel change. Once the blocks are merged the sink is
  folded into the lse, ``lse' = logaddexp(lse, sink_h)``, ``out' = out * exp(lse - lse')``; the
  backward from ``(out', lse')`` is the ordinary flash backward (``exp(s - lse')`` is each real key's
  probability, ``delta = rowsum(dO * out')``), and ``d sink_h = -sum_rows exp(sink_h - lse') * delta``
  (the ring: over the rank's rows; Ulysses: over the whole sequence of the rank's heads, zeros for the
  other heads; summed over the cp group, as every parameter's gradient is).
* **logit soft-capping** (``softcap=c``: scores ``-> c * tanh(scores / c)``): passed to each block's
  ``flash_attention_forward`` / ``_backward``, which take it on their fp32 reference path (explicit
  scores: O(T^2) memory per block); merging by lse is unchanged.

Built on: ``torch.distributed``'s collectives through the engine's one route, ``engine/comm.py``
(``exchange``: ``batch_isend_irecv`` for the ring; ``all_to_all_single`` for Ulysses; ``all_gather``
in :func:`gather_sequence`), which counts their bytes and times them, and our flash-attention dispatch
(``colossal_lab.kernels``: ``flash_attention_forward``/``flash_attention_backward``, which expose the
lse, for the ring's blocks and Ulysses' local attention).
Written by hand here: the ring's ``autograd.Function`` (both rings, the online-softmax merge, the
zig-zag block plan, after zhuzilin/ring-flash-attention's ``zigzag_ring_flash_attn``), Ulysses'
``autograd.Function`` (the all-to-all layouts after DeepSpeed-Ulysses; it saves its own output
rather than a head-sharded copy) and the sharding helpers.

API (what ``HybridParallelPlugin(cp_size=, cp_mode=)`` wires)::

    from colossal_lab.engine import context_parallel as cp
    cp.apply_context_parallel(model, group, mode)        # model.enable_context_parallel(group, mode)
    batch = cp.shard_batch(batch, group, mode, keys=("idx", "targets"))   # this rank's shard, dim 1
    logits, loss = model(batch["idx"], batch["targets"]) # loss: the mean over this rank's tokens
    # average gradients (and the loss, for reporting) over the cp group, as over data parallelism

    cp.shard_sequence(x, cp_rank, cp_size, mode, dim=1)  # the shard of one tensor
    cp.unshard_sequence(shards, mode, dim=1)             # every rank's shard (rank order) -> whole
    cp.gather_sequence(x, group, mode, dim=1)            # all-gather + unshard (no autograd)
    cp.positions(T, cp_rank, cp_size, mode)              # global positions of the shard (rotary)
    cp.ring_attention(q, k, v, group, causal=True)       # (B, H, T/cp, D) shards in, shards out
    cp.ulysses_attention(q, k, v, group, causal=True)    # both also: sinks=(H,) logits, softcap=c
    cp.ContextParallel(group, mode)                      # a model's handle: .attention(q, k, v, causal),
                                                         # .positions(local_T, device), .shard(x, dim),
                                                         # .check_heads(h)
    cp.COMM.bytes / cp.COMM.total / cp.COMM.reset()      # bytes sent at the collective calls, by kind
                                                         # (the cp part of comm.COUNTER)
    with cp.comm_spans(recorder): ...                    # StageSpan(kind="comm") per collective wait
                                                         # (comm.spans)

Modes fix the layout: ``"ring"`` shards zig-zag (needed for causal load balance), ``"ulysses"``
contiguously. A model joins through the model contract's optional ``enable_context_parallel(group,
mode)`` (``engine/models/protocol.py``); the reference GPT routes each attention through a
:class:`ContextParallel` handle and shards its rotary tables like the batch (:meth:`ContextParallel.shard`).
Bytes are counted as sent by this process (a P2P send's tensor; an all-to-all's input minus the
block it keeps). ``comm`` spans are time spent in, or blocked on, a collective: a ring transfer
hidden behind the block compute shows only its un-hidden part. Details and measured memory:
docs/hybrid.md, "Context parallelism".
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import comm
from .traffic import COUNTER as _ALL
from .traffic import CounterView

MODES = ("ring", "ulysses")


# ---- bookkeeping: the cp part of the engine's one counter, comm spans --------------------------

#: bytes this process sent through context-parallel collectives, by kind: ``ring_kv`` (K/V blocks,
#: forward and backward), ``ring_grad`` (dK/dV accumulators), ``all_to_all`` (Ulysses, forward and
#: backward); ``calls`` counts the collective calls per kind (a ring transfer: one per tensor sent).
#: The ``cp.`` labels of ``comm.COUNTER``, where every collective of the engine is counted.
PREFIX = "cp."
COMM = _ALL.view(PREFIX, int)
CommCounter = CounterView  # the type of COMM
#: while active, every context-parallel collective this process waits on is recorded as a
#: ``StageSpan(kind="comm")`` through ``recorder.add("comm", -1, start, end)`` (the pipeline
#: runtime's ``SpanRecorder``, which emits it on the telemetry bus): ``comm.spans``
comm_spans = comm.spans


# ---- sharding ----------------------------------------------------------------------------------

def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"context parallelism: mode={mode!r} is not one of {MODES}")


def _chunks_of(cp_rank: int, cp_size: int, mode: str) -> List[int]:
    """Which of the sequence's chunks a rank holds, in order: ring cuts ``2*cp`` chunks (zig-zag),
    ulysses ``cp`` (contiguous)."""
    return [cp_rank, 2 * cp_size - 1 - cp_rank] if mode == "ring" else [cp_rank]


def _check_len(T: int, cp_size: int, mode: str, what: str) -> int:
    parts = 2 * cp_size if mode == "ring" else cp_size
    if T % parts:
        up = (T // parts + 1) * parts
        why = "2*cp chunks (zig-zag)" if mode == "ring" else "cp contiguous shards"
        raise ValueError(f"{what}: a sequence of {T} tokens cannot be cut into the {parts} equal chunks "
                         f"mode={mode!r} needs at cp={cp_size} ({why}); use a length divisible by {parts}, "
                         f"e.g. pad to {up}")
    return T // parts


def _check_rank(cp_rank: int, cp_size: int) -> None:
    if not (isinstance(cp_size, int) and cp_size >= 1 and isinstance(cp_rank, int) and 0 <= cp_rank < cp_size):
        raise ValueError(f"context parallelism: cp_rank={cp_rank!r} must be in [0, cp_size={cp_size!r})")


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, mode: str, dim: int = 1) -> torch.Tensor:
    """This rank's shard of ``x`` along ``dim`` (ring: chunks ``r`` and ``2cp-1-r`` of ``2cp``,
    concatenated; ulysses: chunk ``r`` of ``cp``). ``ValueError`` when the length does not divide."""
    _check_mode(mode)
    _check_rank(cp_rank, cp_size)
    c = _check_len(x.shape[dim], cp_size, mode, "shard_sequence")
    parts = [x.narrow(dim, i * c, c) for i in _chunks_of(cp_rank, cp_size, mode)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard_sequence(shards: Sequence[torch.Tensor], mode: str, dim: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's shard (in cp rank order): the inverse of
    :func:`shard_sequence`."""
    _check_mode(mode)
    cp = len(shards)
    chunks: List[Optional[torch.Tensor]] = [None] * (2 * cp if mode == "ring" else cp)
    for r, s in enumerate(shards):
        ids = _chunks_of(r, cp, mode)
        for j, piece in zip(ids, s.chunk(len(ids), dim)):
            chunks[j] = piece
    return torch.cat(chunks, dim)


def gather_sequence(x: torch.Tensor, group, mode: str, dim: int = 1) -> torch.Tensor:
    """All-gather every rank's shard over ``group`` and return the whole tensor (no autograd)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    comm.all_gather(parts, x.contiguous(), group=group)
    return unshard_sequence(parts, mode, dim)


def positions(T: int, cp_rank: int, cp_size: int, mode: str, device=None) -> torch.Tensor:
    """The global positions (``LongTensor``) of the tokens rank ``cp_rank`` holds of a sequence of
    ``T`` tokens: what its rotary tables must be indexed with."""
    return shard_sequence(torch.arange(T, device=device), cp_rank, cp_size, mode, dim=0)


def shard_batch(batch: dict, group, mode: str, keys: Iterable[str] = ("idx", "targets"), dim: int = 1) -> dict:
    """A copy of ``batch`` with each of ``keys`` it holds cut to this rank's shard along ``dim``
    (other entries untouched), so inputs, targets and positions are sharded alike."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    out = dict(batch)
    for k in keys:
        if k in out:
            out[k] = shard_sequence(out[k], rank, size, mode, dim)
    return out


# ---- the ring ----------------------------------------------------------------------------------

def _peers(group):
    g = group if group is not None else dist.group.WORLD
    rank, size = dist.get_rank(g), dist.get_world_size(g)
    return rank, size, dist.get_global_rank(g, (rank + 1) % size), dist.get_global_rank(g, (rank - 1) % size)


def _exchange(sends: Sequence[torch.Tensor], tags: Sequence[int], nxt: int, prv: int, group, kind: str):
    """Start sending ``sends`` to the next rank and receiving same-shaped tensors from the previous
    one; returns ``(received tensors, works)``."""
    return comm.exchange(sends, nxt, prv, group=group, tags=tags, label=PREFIX + kind)


def _wait(works) -> None:
    comm.wait(works, label=PREFIX + "wait")


def _merge(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """Online softmax: fold a block's ``(out, lse)`` into the running ones, in place (fp32)."""
    new = torch.logaddexp(lse, blk_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(blk_out.float() * torch.exp(blk_lse - new).unsqueeze(-1))
    lse.copy_(new)


def _fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Fold per-head sink logits ``(H,)`` into a merged softmax: rescale ``out`` (fp32, in place) and
    return ``lse' = logaddexp(lse, sink)``."""
    new = torch.logaddexp(lse, sinks.detach().float().view(1, -1, 1))
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    return new


def _sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``d sink_h = -sum over (batch, rows) of exp(sink_h - lse') * rowsum(dO * out')``, in ``sinks``' dtype."""
    delta = (dout.float() * out.float()).sum(-1)  # (B, H, T)
    p = torch.exp(sinks.detach().float().view(1, -1, 1) - lse.float())
    return -(p * delta).sum((0, 2)).to(sinks.dtype)


def _block_plan(step: int, rank: int, cp: int, causal: bool, c: int):
    """At ring step ``step`` (holding the K/V of rank ``(rank - step) % cp``): ``(q rows, kv rows,
    causal)`` of the block to compute, as slices of the local 2c rows (see the module docstring)."""
    every = slice(None)
    if not causal:
        return every, every, False
    if step == 0:
        return every, every, True
    if (rank - step) % cp < rank:  # from a lower rank: its early chunk only, seen by both ours
        return every, slice(0, c), False
    return slice(c, None), every, False  # from a higher rank: all of it, seen by our late chunk only


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, backend, scale, sinks, softcap):
        from colossal_lab.kernels import flash_attention_forward

        rank, cp, nxt, prv = _peers(group)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        B, H, T, D = q.shape
        c = T // 2
        # the running output in (B, T, H, D) memory, as SDPA lays its output out: the caller's
        # transpose back to (B, T, H*D) is then a view, not one more saved copy per layer
        out = torch.empty((B, T, H, D), dtype=torch.float32, device=q.device).transpose(1, 2)
        lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
        cur_k, cur_v = k, v
        for step in range(cp):
            if step + 1 < cp:
                (nk, nv), works = _exchange((cur_k, cur_v), (1, 2), nxt, prv, group, "ring_kv")
            rows, cols, blk_causal = _block_plan(step, rank, cp, causal, c)
            bo, bl = flash_attention_forward(q[:, :, rows], cur_k[:, :, cols], cur_v[:, :, cols],
                                             causal=blk_causal, backend=backend, scale=scale, softcap=softcap)
            if step == 0:  # covers every row
                out.copy_(bo)
                lse.copy_(bl)
            else:
                _merge(out[:, :, rows], lse[:, :, rows], bo, bl.float())
            if step + 1 < cp:
                _wait(works)
                cur_k, cur_v = nk, nv
        if sinks is not None:
            lse = _fold_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.group, ctx.causal, ctx.backend, ctx.scale, ctx.softcap = group, causal, backend, scale, softcap
        return out

    @staticmethod
    def backward(ctx, dout):
        from colossal_lab.kernels import flash_attention_backward

        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, causal, backend, scale, softcap = ctx.group, ctx.causal, ctx.backend, ctx.scale, ctx.softcap
        rank, cp, nxt, prv = _peers(group)
        dout = dout.contiguous()
        c = q.shape[2] // 2
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        cur_k, cur_v = k, v
        dk = dv = grad_in = grad_works = None  # grad_in: the accumulators that arrive with the next k/v block
        for step in range(cp):
            if step + 1 < cp:
                (nk, nv), kv_works = _exchange((cur_k, cur_v), (1, 2), nxt, prv, group, "ring_kv")
            rows, cols, blk_causal = _block_plan(step, rank, cp, causal, c)
            bq, bk, bv = flash_attention_backward(dout[:, :, rows], q[:, :, rows], cur_k[:, :, cols],
                                                  cur_v[:, :, cols], out[:, :, rows], lse[:, :, rows],
                                                  causal=blk_causal, backend=backend, scale=scale,
                                                  softcap=softcap)
            dq[:, :, rows] += bq.float()
            if step == 0:  # the accumulators of our own block start here
                dk, dv = bk.float(), bv.float()
            else:  # the accumulators of the block we hold arrived with it (one step behind)
                _wait(grad_works)
                dk, dv = grad_in
                dk[:, :, cols] += bk.float()
                dv[:, :, cols] += bv.float()
            if step + 1 < cp:
                _wait(kv_works)
                cur_k, cur_v = nk, nv
            if cp > 1:  # pass them on; after the last step they reach the block's owner
                grad_in, grad_works = _exchange((dk, dv), (3, 4), nxt, prv, group, "ring_grad")
        if cp > 1:
            _wait(grad_works)
            dk, dv = grad_in
        dsinks = _sink_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[7] else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, dsinks, None


def _check_qkv(op: str, q, k, v, sinks=None, softcap=None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{op}: {name} must be a 4-D (B, H, T/cp, D) shard, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"{op}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must have one shape")
    if sinks is not None and not (isinstance(sinks, torch.Tensor) and tuple(sinks.shape) == (q.shape[1],)):
        raise ValueError(f"{op}: sinks must be one logit per head of this rank's q, shape ({q.shape[1]},), got "
                         f"{tuple(getattr(sinks, 'shape', ())) or type(sinks).__name__}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"{op}: softcap={softcap!r} must be a positive number (scores -> softcap * tanh(scores / "
                         "softcap)) or None")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, causal: bool = True,
                   backend: Optional[str] = None, scale: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                   softcap: Optional[float] = None) -> torch.Tensor:
    """Attention over the whole sequence from this rank's ``(B, H, T/cp, D)`` shards of q/k/v
    (zig-zag sharded when ``causal``: :func:`shard_sequence` with ``mode="ring"``); returns this
    rank's shard of the output, differentiable. ``backend`` goes to the flash-attention dispatch.
    ``sinks``: ``(H,)`` sink logits (differentiable); ``softcap``: logit soft-capping (module docstring)."""
    _check_qkv("ring_attention", q, k, v, sinks, softcap)
    cp = dist.get_world_size(group)
    if causal and cp > 1 and q.shape[2] % 2:
        raise ValueError(f"ring_attention: a causal ring holds two zig-zag chunks per rank, but this shard has "
                         f"{q.shape[2]} tokens (odd); the sequence must be divisible by 2*cp={2 * cp}")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q, k, v, group, causal, backend, scale, sinks, softcap)


# ---- Ulysses -----------------------------------------------------------------------------------

def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """``all_to_all_single`` over dim 0 (one slot per rank)."""
    x = x.contiguous()
    return comm.all_to_all_single(torch.empty_like(x), x, group=group, label=PREFIX + "all_to_all")


def _seq_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """``(n, B, H, Tl, D)`` sequence shards (n tensors stacked) -> ``(n, B, H/cp, cp*Tl, D)`` head
    shards: a slot per destination rank (its head group), all-to-all, a slot per source rank (its
    sequence chunk, in order)."""
    n, B, H, Tl, D = x.shape
    x = x.reshape(n, B, cp, H // cp, Tl, D).permute(2, 0, 1, 3, 4, 5)
    return _all_to_all(x, group).permute(1, 2, 3, 0, 4, 5).reshape(n, B, H // cp, cp * Tl, D)


def _heads_to_seq(y: torch.Tensor, group, cp: int) -> torch.Tensor:
    """The inverse: ``(n, B, H/cp, T, D)`` -> ``(n, B, H, T/cp, D)`` laid out in ``(n, B, T/cp, H, D)``
    memory, as SDPA lays its output out (a caller's transpose back to ``(B, T, H*D)`` is a view)."""
    n, B, Hc, T, D = y.shape
    y = _all_to_all(y.reshape(n, B, Hc, cp, T // cp, D).permute(3, 0, 1, 2, 4, 5), group)
    out = torch.empty((n, B, T // cp, cp * Hc, D), dtype=y.dtype, device=y.device)
    out.view(n, B, T // cp, cp, Hc, D).copy_(y.permute(1, 2, 4, 0, 3, 5))  # (a reshape is a view when n*B == 1)
    return out.transpose(2, 3)


class _UlyssesAttention(torch.autograd.Function):
    """all-to-all q|k|v to head shards, flash attention with its lse, all-to-all the output back.

    Saves the head-sharded q/k/v, the lse and its own (sequence-sharded) output, which the next
    layer saves anyway (the output projection's input): backward all-to-alls that output back to
    head shards beside the incoming gradient instead of keeping a head-sharded copy alive, so a
    layer holds no more activation than without context parallelism (one extra output-sized
    all-to-all per backward; docs/hybrid.md, "Context parallelism")."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, backend, scale, sinks, softcap):
        from colossal_lab.kernels import flash_attention_forward

        cp = dist.get_world_size(group)
        qkv = _seq_to_heads(torch.stack((q, k, v)), group, cp)
        o, lse = flash_attention_forward(qkv[0], qkv[1], qkv[2], causal=causal, backend=backend, scale=scale,
                                         softcap=softcap)
        if sinks is not None:  # this rank's head group of the sinks
            o32 = o.float()
            lse = _fold_sinks(o32, lse.float(), _head_group(sinks, group, cp))
            o = o32.to(o.dtype)
        y = _heads_to_seq(o.unsqueeze(0), group, cp)[0]
        ctx.save_for_backward(qkv, lse, y, sinks)
        ctx.group, ctx.causal, ctx.backend, ctx.scale, ctx.softcap = group, causal, backend, scale, softcap
        return y

    @staticmethod
    def backward(ctx, dy):
        from colossal_lab.kernels import flash_attention_backward

        qkv, lse, y, sinks = ctx.saved_tensors
        cp = dist.get_world_size(ctx.group)
        do_o = _seq_to_heads(torch.stack((dy, y)), ctx.group, cp)  # the gradient and the output, as heads
        grads = flash_attention_backward(do_o[0], qkv[0], qkv[1], qkv[2], do_o[1], lse, causal=ctx.causal,
                                         backend=ctx.backend, scale=ctx.scale, softcap=ctx.softcap)
        dq, dk, dv = _heads_to_seq(torch.stack(grads), ctx.group, cp)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[7]:  # this rank's heads' share; zeros for the others
            dsinks = torch.zeros_like(sinks)
            mine = _head_group(sinks, ctx.group, cp)
            _head_group(dsinks, ctx.group, cp).copy_(_sink_grad(do_o[0], do_o[1], lse, mine))
        return dq, dk, dv, None, None, None, None, dsinks, None


def _head_group(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """This rank's contiguous ``H/cp`` slice of a per-head ``(H,)`` tensor (a view): the heads
    :func:`_seq_to_heads` hands it."""
    n = x.shape[0] // cp
    return x.narrow(0, dist.get_rank(group) * n, n)


def _heads_ok(heads: int, cp: int, op: str) -> None:
    if heads % cp:
        ok = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(f"{op}: {heads} attention heads cannot be split over cp={cp} ranks (Ulysses gives each "
                         f"rank heads/cp whole heads); use a cp size in {ok}, or mode='ring'")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, causal: bool = True,
                      backend: Optional[str] = None, scale: Optional[float] = None,
                      sinks: Optional[torch.Tensor] = None, softcap: Optional[float] = None) -> torch.Tensor:
    """Attention over the whole sequence from this rank's contiguous ``(B, H, T/cp, D)`` shards:
    all-to-all to ``(B, H/cp, T, D)``, local flash attention, all-to-all back; differentiable.
    ``ValueError`` before any communication when ``cp`` does not divide the heads. ``sinks``,
    ``softcap``: as :func:`ring_attention`'s."""
    _check_qkv("ulysses_attention", q, k, v, sinks, softcap)
    cp = dist.get_world_size(group)
    _heads_ok(q.shape[1], cp, "ulysses_attention")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if cp == 1 and sinks is None and softcap is None:
        from colossal_lab.kernels import flash_attention

        return flash_attention(q, k, v, causal=causal, backend=backend, scale=scale)
    return _UlyssesAttention.apply(q, k, v, group, causal, backend, scale, sinks, softcap)


# ---- a model's handle, and the model contract's entry point ------------------------------------

class ContextParallel:
    """One model's context-parallel setting: ``group``, ``mode`` and this rank's place in it.

    Callable as an attention function, ``cp(q, k, v, causal=True, scale=None, sinks=None, softcap=None)``
    (ring or Ulysses by ``mode``);
    :meth:`positions` gives the global positions of a local shard's tokens. A deep copy of a model
    (a pipeline stage) shares the handle: it holds a process group, which is not copied."""

    def __init__(self, group, mode: str, backend: Optional[str] = None):
        _check_mode(mode)
        self.group, self.mode, self.backend = group, mode, backend
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._positions: Dict[tuple, torch.Tensor] = {}
        self._constants: Dict[tuple, torch.Tensor] = {}

    def __call__(self, q, k, v, causal: bool = True, scale: Optional[float] = None,
                 sinks: Optional[torch.Tensor] = None, softcap: Optional[float] = None) -> torch.Tensor:
        fn = ring_attention if self.mode == "ring" else ulysses_attention
        return fn(q, k, v, self.group, causal=causal, backend=self.backend, scale=scale, sinks=sinks, softcap=softcap)

    attention = __call__

    def positions(self, local_T: int, device=None) -> torch.Tensor:
        """Global positions of this rank's ``local_T`` tokens (of a ``local_T * cp`` sequence)."""
        key = (local_T, str(device))
        if key not in self._positions:
            self._positions[key] = positions(local_T * self.size, self.rank, self.size, self.mode, device=device)
        return self._positions[key]

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's shard of a whole-sequence tensor (e.g. rotary tables, ``dim=0``): a view for
        Ulysses' contiguous shard, a copy of two chunks for the ring's zig-zag."""
        return shard_sequence(x, self.rank, self.size, self.mode, dim)

    def shard_constant(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """:meth:`shard` of a tensor that does not change between steps (a buffer such as the
        rotary tables), kept: the ring's zig-zag shard is a copy, and made once it is model state,
        not a new allocation in every forward. Keyed by storage, offset, shape and version, so an
        in-place change or a move to another device makes a new shard."""
        key = (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x._version, dim, str(x.device))
        got = self._constants.get(key)
        if got is None:
            if len(self._constants) >= 8:  # a few lengths at a time; old devices' entries go
                self._constants.pop(next(iter(self._constants)))
            got = self._constants[key] = self.shard(x.detach(), dim)
        return got

    def check_heads(self, heads: int) -> None:
        """``ValueError`` (naming the cp sizes that would work) if Ulysses cannot split ``heads``."""
        if self.mode == "ulysses":
            _heads_ok(heads, self.size, "context parallelism (ulysses)")

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return f"ContextParallel(mode={self.mode!r}, rank={self.rank}, size={self.size})"


def apply_context_parallel(module: torch.nn.Module, group, mode: str) -> torch.nn.Module:
    """Make ``module``'s attention context-parallel over ``group`` through the model contract's
    ``enable_context_parallel(group, mode)``; returns ``module``. Feed it :func:`shard_batch`'s
    shards and average gradients over ``group``."""
    _check_mode(mode)
    fn = getattr(module, "enable_context_parallel", None)
    if not callable(fn):
        raise ValueError(f"apply_context_parallel: {type(module).__name__} has no enable_context_parallel(group, "
                         "mode) method (the model contract, engine/models/protocol.py); a model must route its "
                         "attention through ContextParallel(group, mode) and index its positions with "
                         "ContextParallel.positions")
    fn(group, mode)
    return module


__all__ = ["MODES", "COMM", "CommCounter", "ContextParallel", "apply_context_parallel", "comm_spans",
           "gather_sequence", "positions", "ring_attention", "shard_batch", "shard_sequence", "ulysses_attention",
           "unshard_sequence"]
