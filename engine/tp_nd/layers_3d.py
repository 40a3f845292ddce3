"""3D tensor parallelism on a q x q x q grid (Colossal-AI's 3D, after Agarwal et al.'s 3D matmul).

Built on torch: ``autograd.Function`` and ``torch.distributed`` all-gather/reduce-scatter on the
grid's axis groups (:mod:`.counter`). By hand: the linear below.

A linear has an *input axis* ``A`` (cutting its input features), an *output axis* ``C`` (cutting
its output features) and the third axis ``x`` (the batch). Rank ``(x, a, c)`` holds the input rows
``(x, c)`` (batch piece ``x * q + c`` of ``q^2``) of features ``a``, and the weight piece: input
features ``a``, output features ``c``, rows ``x`` of those (``(out / q^2, in / q)``). Then

* forward: all-gather the input over ``C`` (rows ``x``), the weight over ``x``; multiply; the
  partial output (its sum runs over ``A``) is reduce-scattered over ``A`` along the rows, so the
  output holds rows ``(x, a)`` of features ``c``: the input and output axes have traded places;
* backward: all-gather ``dY`` over ``A``; ``dX`` reduce-scattered over ``C``, ``dW`` over ``x``.

In a transformer the residual stream (norms, the embedding, a column-parallel linear's input) uses
input axis ``y`` and output axis ``z``: layout ``stream`` (rows ``x, z``, features ``y``); a
column-parallel linear turns it into ``inner`` (rows ``x, y``, features ``z``), where attention and
the logits live, and a row-parallel linear (input axis ``z``, output axis ``y``) turns it back.

Per rank and linear ``(in, out)`` over ``N`` rows: ``2 (q - 1) (N in / q^3 + in out / q^3 +
N out / q^3)`` elements (each of the three all-gathers and three reduce-scatters moves
``(q - 1) / q`` of a ``1 / q^2`` block): it falls as ``tp^(2/3)`` where 1D's does not fall.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from . import counter
from .layers_2d import _compute_dtype


class _Linear3D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, ga, gc, gx):
        dt = _compute_dtype(x, w)
        ctx.in_dtypes = (x.dtype, w.dtype)
        with torch.autocast(x.device.type, enabled=False):
            xg = counter.all_gather(x.to(dt), gc, "3d.gather_x", 0)
            wg = counter.all_gather(w.to(dt), gx, "3d.gather_w", 0)
            y = torch.matmul(xg, wg.t())
            out = counter.reduce_scatter(y, ga, "3d.rs_y", 0)
        ctx.save_for_backward(xg, wg)
        ctx.groups = (ga, gc, gx)
        return out

    @staticmethod
    def backward(ctx, dy):
        xg, wg = ctx.saved_tensors
        ga, gc, gx = ctx.groups
        with torch.autocast(dy.device.type, enabled=False):
            dyg = counter.all_gather(dy.to(xg.dtype), ga, "3d.gather_dy", 0)
            dx = counter.reduce_scatter(torch.matmul(dyg, wg), gc, "3d.rs_dx", 0)
            dwg = dyg.reshape(-1, dyg.shape[-1]).t() @ xg.reshape(-1, xg.shape[-1])
            dw = counter.reduce_scatter(dwg, gx, "3d.rs_dw", 0)
        return dx.to(ctx.in_dtypes[0]), dw.to(ctx.in_dtypes[1]), None, None, None


class Linear3D(nn.Module):
    """An ``nn.Linear`` on the 3D grid with input axis ``in_axis`` and output axis ``out_axis``:
    ``weight`` ``(out / q^2, in / q)``, ``bias`` (optional) its ``(out / q^3,)`` piece of the
    output features, gathered over the output layout's batch group (``transposed``: the weight
    stored ``(in / q, out / q^2)``)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], grid, in_axis: str, out_axis: str,
                 out_layout, transposed: bool = False):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.transposed = transposed  # weight stored (in, out), as transformers' Conv1D holds it
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.ga, self.gc, self.gx = grid.group((in_axis,)), grid.group((out_axis,)), grid.group(("x",))
        self.batch_group = grid.group(out_layout.batch)
        self.vocab = None  # a layers_common.VocabShard when this is the LM head (marks its logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .layers_common import gather_piece, mark_logits

        w = self.weight.t() if self.transposed else self.weight
        y = _Linear3D.apply(x, w, self.ga, self.gc, self.gx)
        if self.bias is not None:
            y = y + gather_piece(self.bias, self.batch_group, 0, "linear.bias")
        return y if self.vocab is None else mark_logits(y, self.vocab)
