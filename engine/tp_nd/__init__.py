"""N-dimensional tensor parallelism: 2D (SUMMA), 2.5D (Tesseract) and 3D, as Colossal-AI has them,
on torch.distributed collectives. ``HybridParallelPlugin(tp_size=, tp_mode="2d" |
"2.5d" | "3d", tp_depth=)`` wires it; 1D stays DTensor's (``engine/tensor_parallel.py``).

==================  ==================================================================================
``grid.py``         axes of each mode, this rank's coordinates, the process groups, block layouts
``counter.py``      every collective on the grid's groups, through ``comm`` (counted, timed); 1D's DTensor bytes
``layers_common``   layout-generic layers: parameter pieces, RMSNorm, LayerNorm, Embedding, vocab-parallel loss
``layers_2d.py``    SUMMA (forward and backward), ``Linear2D``
``layers_2p5d.py``  ``Linear2p5D``: SUMMA per depth layer, weights sliced over the depth
``layers_3d.py``    ``Linear3D``: all-gather / reduce-scatter on three axes
``apply.py``        roles from the model contract, size checks, conversion, batch sharding
``volume.py``       the textbook bytes per rank and step of 1D, 2D, 2.5D and 3D (what the bench checks)
==================  ==================================================================================

Usage, layouts, the communication formulas and measured figures: docs/hybrid.md, "N-dimensional
tensor parallelism".
"""

from .apply import ROLES, NdParallel, check, convert, resolve_plan, specs
from .counter import COUNTER, comm_spans, count_dtensor
from .grid import MODES, Grid, Layout, factor, layouts
from .layers_common import CrossEntropy, cross_entropy, gather_vocab, vocab_parallel
from .volume import by_part, textbook

__all__ = ["MODES", "ROLES", "COUNTER", "CrossEntropy", "Grid", "Layout", "NdParallel", "check", "comm_spans",
           "convert", "count_dtensor", "cross_entropy", "factor", "gather_vocab", "layouts", "resolve_plan",
           "specs", "textbook", "by_part", "vocab_parallel"]
