"""2D tensor parallelism: SUMMA on a q x q grid (Colossal-AI's 2D, after Optimus).

Built on torch: ``autograd.Function`` and ``torch.distributed`` broadcast/reduce on the grid's row
and column groups (:mod:`.counter`). By hand: the SUMMA loops, forward and backward.

Rank ``(i, j)`` (``row``, ``col``) holds the activation block ``X[i, j]``: batch rows ``i`` (of
``q``), features ``j`` (of ``q``); and the weight block ``W[i, j]``: input features ``i``, output
features ``j`` (an ``nn.Linear`` weight ``(out, in)`` holds ``weight[out_j, in_i]``; a weight stored
``(in, out)``, transformers' ``Conv1D``, the same block transposed). Then

* forward ``Y[i, j] = sum_k X[i, k] W[k, j]``: at step ``k`` the row group broadcasts ``X[i, k]``
  from column ``k`` and the column group ``W[k, j]`` from row ``k``;
* backward ``dX[i, k] = sum_j dY[i, j] W[k, j]^T``: step ``k`` broadcasts ``W[k, j]`` again down
  the column and reduces the products along the row to column ``k``; ``dW[k, j] = sum_i X[i, k]^T
  dY[i, j]``: step ``k`` broadcasts ``X[i, k]`` again along the row and reduces down the column to
  row ``k``.

Per rank and linear ``(in, out)`` over ``N`` rows: ``3 (q - 1) (N in / q^2 + in out / q^2)``
elements sent (the forward's broadcasts, and a broadcast plus a reduce per gradient), against 1D's
all-reduce of ``N x h`` per linear. No block larger than one ``X`` or ``W`` block is ever held, as
SUMMA intends. 2D is 2.5D with one depth layer: :mod:`.layers_2p5d` reuses :func:`summa`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from . import counter


def _compute_dtype(*ts: torch.Tensor) -> torch.dtype:
    dev = ts[0].device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return ts[0].dtype


class _Summa(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, rowg, colg, q):
        # rowg: the ranks of this row (axis "col"; group rank = column k); colg: of this column
        dt = _compute_dtype(x, w)
        ctx.in_dtypes = (x.dtype, w.dtype)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).to(dt).contiguous()
        wl = w.to(dt).contiguous()
        with torch.autocast(x.device.type, enabled=False):
            out = x2.new_zeros(x2.shape[0], wl.shape[0])
            for k in range(q):
                xk = x2 if rowg.rank == k else torch.empty_like(x2)
                counter.broadcast(xk, k, rowg, "summa.bcast_x")
                wk = wl if colg.rank == k else torch.empty_like(wl)
                counter.broadcast(wk, k, colg, "summa.bcast_w")
                out.addmm_(xk, wk.t())
        ctx.save_for_backward(x2, wl)
        ctx.rowg, ctx.colg, ctx.q = rowg, colg, q
        return out.view(*lead, wl.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, wl = ctx.saved_tensors
        rowg, colg, q = ctx.rowg, ctx.colg, ctx.q
        lead = dy.shape[:-1]
        d2 = dy.reshape(-1, dy.shape[-1]).to(x2.dtype)
        dx: Optional[torch.Tensor] = None
        dw: Optional[torch.Tensor] = None
        with torch.autocast(dy.device.type, enabled=False):
            for k in range(q):
                wk = wl if colg.rank == k else torch.empty_like(wl)
                counter.broadcast(wk, k, colg, "summa.bcast_w")
                part = d2 @ wk                      # this row's share of dX[i, k]
                counter.reduce(part, k, rowg, "summa.reduce_dx")
                if rowg.rank == k:
                    dx = part
                xk = x2 if rowg.rank == k else torch.empty_like(x2)
                counter.broadcast(xk, k, rowg, "summa.bcast_x")
                pw = d2.t() @ xk                    # this column's share of dW[k, j]
                counter.reduce(pw, k, colg, "summa.reduce_dw")
                if colg.rank == k:
                    dw = pw
        return (dx.view(*lead, dx.shape[-1]).to(ctx.in_dtypes[0]), dw.to(ctx.in_dtypes[1]),
                None, None, None)


def summa(x: torch.Tensor, w: torch.Tensor, grid) -> torch.Tensor:
    """``x @ W`` for the blocks of a q x q grid (one depth layer): ``x`` ``(..., in / q)``, ``w``
    this rank's ``(out / q, in / q)`` block (``nn.Linear`` orientation); returns ``(..., out / q)``."""
    return _Summa.apply(x, w, grid.group(("col",)), grid.group(("row",)), grid.sizes["row"])


class Linear2D(nn.Module):
    """An ``nn.Linear`` on the 2D grid: ``weight`` is this rank's block ``(out / q, in / q)``;
    ``bias`` (optional) its piece ``(out / (q * nb),)`` of the output columns, gathered over the
    batch group. The output is in the same layout as the input (2D has one)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], grid, layout, transposed: bool = False):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.grid, self.batch_group = grid, grid.group(layout.batch)
        self.transposed = transposed  # weight stored (in, out), as transformers' Conv1D holds it
        self.vocab = None  # a layers_common.VocabShard when this is the LM head (marks its logits)

    def stored_block(self) -> torch.Tensor:
        """This rank's weight block in its stored orientation."""
        return self.weight

    def block_weight(self) -> torch.Tensor:
        """The block in ``nn.Linear`` orientation ``(out / q, in / q)``."""
        w = self.stored_block()
        return w.t() if self.transposed else w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .layers_common import gather_piece, mark_logits

        y = summa(x, self.block_weight(), self.grid)
        if self.bias is not None:
            y = y + gather_piece(self.bias, self.batch_group, 0, "linear.bias")
        return y if self.vocab is None else mark_logits(y, self.vocab)
