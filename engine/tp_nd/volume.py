"""The textbook communication volume of each tensor-parallel scheme, per rank and training step.

Pure arithmetic (no torch.distributed): bytes each rank sends in one forward + backward, from the
model's layer shapes (its tp plan: which linears are column/row-parallel, the embeddings, norms
and head), the tokens ``N`` of a step (one data-parallel replica's batch x sequence), the number
of microbatches ``m`` (weight traffic recurs per microbatch) and the element size. Collective
costs follow :mod:`.counter`'s convention (the bandwidth-optimal algorithm: all-reduce
``2 (p-1)/p n``, all-gather ``(p-1) n_in``, reduce-scatter ``(p-1)/p n_in``, SUMMA's ``q``
broadcasts/reduces ``(q-1)`` blocks). With ``r = N / nb`` rows per rank and a linear ``(in, out)``:

=======  ======================================================================================
1D       column-parallel: one all-reduce of ``N x in`` (backward); row-parallel: one of ``N x out``
         (forward); embedding, norms and head whole (Megatron without fused QKV / gate-up)
2D/2.5D  ``3 (q-1) (r in / q + in out / q^2)`` (SUMMA: broadcasts forward, broadcast + reduce per
         gradient) ``+ 2 (d-1)/d * in out / q^2`` (depth: weight slices gathered, gradient
         reduce-scattered); ``d = 1`` is 2D
3D       ``2 (q-1) (r in / q + r out / q + in out / q^3)`` (all-gather of input and weight and
         reduce-scatter of the output forward; the mirror images backward)
=======  ======================================================================================

N-d extras, all modes (``nb`` batch pieces, ``q`` the hidden cut): a norm all-reduces ``r`` fp32
sums of squares over ``q`` ranks forward and backward (``2 * 2 (q-1)/q * 4r`` bytes) and gathers
its weight (``2 (nb-1)/nb * h / q``); an embedding gathers its weight likewise
(``2 (nb-1)/nb * V h / q``); the vocab-parallel cross-entropy all-reduces three fp32 values per
row (``3 * 2 (q-1)/q * 4r``), or a whole-logits criterion all-gathers the logits
(``(q-1) r V / q``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Optional

import torch.nn as nn

from .grid import factor


def _ar(p: int, n: float) -> float:
    return 2 * (p - 1) / p * n


def textbook(model: nn.Module, mode: str, tp_size: int, tokens: int, depth: int = 1, microbatches: int = 1,
             elem: int = 4, vocab_parallel_loss: bool = True, tp_plan: Optional[dict] = None,
             calls: Optional[Dict[str, int]] = None) -> Dict[str, float]:
    """Bytes one rank sends per training step under ``mode`` at ``tp_size`` ranks, by part
    (``linear``, ``depth``, ``norm``, ``embedding``, ``loss``, ``bias``); ``model`` is the whole
    (unsplit) model, whose layer roles come from the model contract; ``calls`` names the modules
    a forward calls more than once (``{name: times}``), every other planned module is called once."""
    from .apply import resolve_plan

    out: Dict[str, float] = defaultdict(float)
    m, N = microbatches, tokens
    mods = dict(model.named_modules())
    if mode == "1d":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan = tp_plan if tp_plan is not None else model.tp_plan()
        for name, style in plan.items():
            lin = mods.get(name)
            if isinstance(style, ColwiseParallel):
                out["linear"] += _ar(tp_size, N * lin.in_features * elem)
            elif isinstance(style, RowwiseParallel):
                out["linear"] += _ar(tp_size, N * lin.out_features * elem)
        return dict(out)
    sizes = factor(mode, tp_size, depth)
    q = sizes["y"] if mode == "3d" else sizes["row"]
    d = sizes.get("dep", 1)
    nb = tp_size // q
    r = N / nb / m  # rows per rank and microbatch
    for name, (role, _) in resolve_plan(model, tp_plan).items():
        mod, before = mods[name], dict(out)
        if role in ("colwise", "rowwise", "head"):
            i, o = mod.in_features, mod.out_features
            if mode == "3d":
                out["linear"] += m * 2 * (q - 1) * (r * i / q + r * o / q + i * o / q ** 3) * elem
            else:
                out["linear"] += m * 3 * (q - 1) * (r * i / q + i * o / q ** 2) * elem
                out["depth"] += m * 2 * (d - 1) / d * i * o / q ** 2 * elem
            if mod.bias is not None:
                out["bias"] += m * 2 * (nb - 1) / nb * o / q * elem
            if role == "head":
                if vocab_parallel_loss:
                    out["loss"] += m * 3 * _ar(q, r * 4)
                else:
                    out["loss"] += m * (q - 1) * r * o / q * elem
        elif role == "embedding":
            out["embedding"] += m * 2 * (nb - 1) / nb * mod.num_embeddings * mod.embedding_dim / q * elem
        else:
            h = mod.weight.shape[0]
            out["norm"] += m * (2 * _ar(q, r * 4) + 2 * (nb - 1) / nb * h / q * elem)
        for k in out:  # a module called n times communicates n times
            out[k] = before.get(k, 0.0) + (out[k] - before.get(k, 0.0)) * (calls or {}).get(name, 1)
    return dict(out)


#: which counter kinds (``counter.COUNTER``) make up each part of :func:`textbook`
PARTS = {"linear": ("summa.", "3d."), "depth": ("depth.",), "bias": ("linear.bias",),
         "norm": ("norm.",), "embedding": ("embedding.",), "loss": ("ce.", "vocab."), }


def by_part(counted: Dict[str, float]) -> Dict[str, float]:
    """Counter kinds summed into :func:`textbook`'s parts (1D's ``dtensor.*`` count as ``linear``)."""
    out: Dict[str, float] = defaultdict(float)
    for kind, b in counted.items():
        part = next((p for p, prefixes in PARTS.items() if kind.startswith(prefixes)),
                    "linear" if kind.startswith("dtensor.") else kind)
        out[part] += b
    return dict(out)
