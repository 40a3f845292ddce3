"""2.5D tensor parallelism: ``d`` layers of a q x q SUMMA grid (Colossal-AI's 2.5D, after Tesseract).

Built on torch: ``torch.distributed`` all-gather/reduce-scatter on the depth group, through
:func:`.layers_common.gather_piece`. By hand: the layer below; the SUMMA inside is
:func:`.layers_2d.summa`.

Rank ``(k, i, j)`` (``dep``, ``row``, ``col``) runs SUMMA in depth layer ``k`` on batch rows
``k * q + i`` (of ``d * q``) and features ``j``. Tesseract keeps one copy of each weight block
``W[i, j]`` per depth layer and all-reduces its gradient over the ``d`` layers; here each of the
``d`` ranks ``(*, i, j)`` stores one ``1 / d`` slice of it (output rows), all-gathered over the
depth group before SUMMA and kept for its backward, and the gradient is reduce-scattered back:
the same bytes as the textbook's all-reduce (an all-gather plus a reduce-scatter), ``1 / d`` of
its parameter and optimizer memory, and every element has one owner.

Per rank and linear ``(in, out)`` over ``N`` rows: ``3 (q - 1) (N in / (d q^2) + in out / q^2)``
for SUMMA plus ``2 (d - 1) / d * in out / q^2`` over the depth.
"""

from __future__ import annotations

import torch

from .layers_2d import Linear2D
from .layers_common import gather_piece


class Linear2p5D(Linear2D):
    """An ``nn.Linear`` on the 2.5D grid: ``weight`` is this rank's ``(out / (q d), in / q)`` slice
    of its depth layer's block; the output is in the input's layout."""

    def __init__(self, weight, bias, grid, layout, transposed: bool = False):
        super().__init__(weight, bias, grid, layout, transposed)
        self.depth_group = grid.group(("dep",))

    def stored_block(self) -> torch.Tensor:  # slices of the output rows: dimension 1 when stored (in, out)
        return gather_piece(self.weight, self.depth_group, 1 if self.transposed else 0, "depth.weight")
