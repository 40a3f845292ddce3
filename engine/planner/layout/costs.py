"""The step-time model: seconds of one training step of a layout, by part, from the calibration.

A step (``m`` microbatches, ``pp`` stages, ``v`` model chunks per stage, the times those of one
microbatch on one rank, i.e. ``1/pp`` of the model) is ``(m + (pp-1)/v) · (t_F + t_B + AC·t_F +
TP comm + 2·v·p2p)`` with the compute at the speed of a rank alone (the bubble's idle ranks leave
their cores to the busy ones), but never less than ``m ·`` the same with every rank busy (the
work itself); with a device per rank both are the plain formula. Plus the data-parallel gradient
all-reduce (ZeRO-1: and the parameters' broadcast, one collective per parameter tensor as
``ZeroRedundancyOptimizer`` issues them), plus the optimizer step over this rank's parameters
(ZeRO-1: its ``1/dp`` share). 1D tensor parallelism (Megatron) costs two all-reduces of the
microbatch's activations per layer forward and two backward (the forward's again under
checkpointing); 2D/2.5D/3D cost ``tp_nd.volume.textbook``'s bytes (:func:`nd_traffic`). A
mixture-of-experts model (``experts``) under ``ep > 1`` pays, per microbatch and MoE layer of the
stage, the dispatch and combine all-to-alls forward and backward (and the counts): the bytes
``cl.plan`` counts (``memory/experts.py``), each priced as the all-reduce on a group of ``ep`` that
sends as many bytes per rank (half the payload); a rank holds ``1/ep`` of the experts (whole on every
tp rank), whose gradients are all-reduced over the expert-dp group (``dp / ep``) and stepped there.
Overlap of communication with compute is not modelled (gloo does not overlap).

What the formula leaves out (the pipeline runtime's Python per scheduled action, DTensor's
dispatch per sharded layer, the step's fixed bookkeeping) is the *overhead*: non-negative
coefficients of :func:`features`, fitted (:func:`fit_overheads`) to layouts run for real.
"""
from __future__ import annotations

import itertools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .calibration import Calibration
from .space import Candidate, compute_tp, cuts, microbatches


def piecewise(xs: Sequence[float], ys: Sequence[float]) -> Callable[[float], float]:
    """y(x) through measured points: one point, through the origin; two, the line through them;
    more, piecewise between neighbours and the end segments' lines beyond. Never below 0."""
    pts = sorted(zip(xs, ys))
    if len(pts) == 1 or pts[0][0] == pts[-1][0]:
        k = pts[0][1] / pts[0][0] if pts[0][0] else 0.0
        return lambda x: k * x

    def at(x):
        i = next((i for i in range(1, len(pts) - 1) if x <= pts[i][0]), len(pts) - 1)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return max(0.0, y0 + (y1 - y0) / (x1 - x0) * (x - x0)) if x1 != x0 else y1
    return at


class Costs:
    """The calibration as functions: seconds for a microbatch's tokens, a group's all-reduce of
    ``bytes``, a point-to-point transfer, an optimizer step over ``n`` elements. ``calibration``:
    a :class:`Calibration` or its dict form (``AutoPlan.calibration``)."""

    def __init__(self, calibration):
        self.calibration = Calibration.of(calibration)
        self._f = {tp: piecewise(row["tokens"], row["f"]) for tp, row in self.calibration.compute.items()}
        self._fb = {tp: piecewise(row["tokens"], row["fb"]) for tp, row in self.calibration.compute.items()}

    def has_compute(self, tp: int) -> bool:
        """Whether the model was timed shrunk to ``tp`` ranks."""
        return tp in self._fb

    def forward(self, tp: int, tokens: int) -> float:
        return self._f[tp](tokens)

    def forward_backward(self, tp: int, tokens: int) -> float:
        return self._fb[tp](tokens)

    def has_allreduce(self, k: int) -> bool:
        """Whether all-reduces were timed on groups of ``k``."""
        return bool(self.calibration.allreduce.get(k))

    def allreduce(self, k: int, nbytes: float) -> float:
        if k <= 1 or nbytes <= 0:
            return 0.0
        pts = self.calibration.allreduce.get(k)
        if not pts:
            raise ValueError(f"autoplan: no all-reduce measured for groups of {k}")
        return piecewise([b for b, _ in pts], [s for _, s in pts])(nbytes)

    def zero_sync(self, k: int, calls: float, nbytes: float) -> Optional[float]:
        """Seconds of ZeroRedundancyOptimizer's parameter sync on a group of ``k``: ``calls``
        asynchronous broadcasts carrying ``nbytes`` in all, as ``seconds = calls * a + bytes * b``
        through the two measured batches (None where the calibration did not measure it)."""
        if k <= 1:
            return 0.0
        pts = (self.calibration.zero_sync or {}).get(k)
        if not pts:
            return None
        (n1, b1, t1), (n2, b2, t2) = pts[0], pts[-1]
        det = n1 * b2 - n2 * b1
        a = (t1 * b2 - t2 * b1) / det if det else t1 / n1
        b = (n1 * t2 - n2 * t1) / det if det else 0.0
        if b < 0:  # noise: the many small calls cost as much as the few large ones
            a, b = max(t1 / n1, t2 / n2), 0.0
        elif a < 0:
            a, b = 0.0, max(t1 / b1, t2 / b2)
        return calls * a + nbytes * b

    def p2p(self, nbytes: float) -> float:
        pts = self._figure("p2p")
        return piecewise([b for b, _ in pts], [s for _, s in pts])(nbytes) if pts else 0.0

    def adam(self, n: float) -> float:
        return self._figure("adam_s_per_elem") * n

    @property
    def slowdown(self) -> float:
        """How much slower a rank computes with every rank busy than alone (1: one device each,
        as on GPUs; ~world/cores where CPU ranks share cores). Bounds ``[1, world]`` are the
        caller's; a calibration without the measurement says 1."""
        a = self.calibration.alone
        return max(1.0, a["busy"] / a["alone"]) if a and a.get("alone") else 1.0

    def _figure(self, name: str):
        value = getattr(self.calibration, name)
        if value is None:
            raise ValueError(f"autoplan: the calibration has no {name!r}; calibrate again (cl.autoplan without "
                             "calibration=)")
        return value


def nd_traffic(meta, c: Candidate, batch: int, seq: int) -> Tuple[float, float]:
    """``(bytes, collectives)`` one rank of layout ``c`` sends per step under 2D/2.5D/3D tensor
    parallelism: ``tp_nd.volume.textbook`` for the whole model over its stage's ``1/pp``, and per
    planned linear and microbatch SUMMA's ``6q`` broadcasts/reduces (2D, 2.5D) or 3D's six
    gathers/scatters. ``(0, 0)`` for 1D."""
    if c.tp_mode == "1d" or c.tp == 1:
        return 0.0, 0.0
    from ...tp_nd.volume import textbook

    m = microbatches(c)
    tokens = batch // c.dp * seq
    nbytes = sum(textbook(meta, c.tp_mode, c.tp, tokens, depth=c.tp_depth, microbatches=m).values())
    q, _ = cuts(c.tp_mode, c.tp, c.tp_depth)
    linears = len(meta.tp_plan()) + 1  # the plan's linears and the head
    calls = m * linears * (6 * q if c.tp_mode in ("2d", "2.5d") else 6)
    return nbytes / c.pp, calls / c.pp


def predict(c: Candidate, costs: Costs, *, batch: int, seq: int, n_embd: int, layers: int,
            params: int, tensors: int = 0, act_bytes: int = 4, grad_bytes: int = 4,
            nd_bytes: float = 0.0, nd_calls: float = 0.0, experts: Optional[Dict[str, int]] = None) -> Dict[str, float]:
    """Predicted seconds of one step of layout ``c`` (global ``batch``), by part; ``params`` the
    model's parameter elements, ``tensors`` its parameter tensors. Under 2D/2.5D/3D tensor
    parallelism ``nd_bytes`` is what a rank sends per step (``tp_nd.volume.textbook`` over its
    stage) and ``nd_calls`` its collectives per step (:func:`nd_traffic`). ``experts``: a mixture-of-experts
    model's ``{"params": expert elements, "layers": MoE layers, "top_k", "n_expert"}`` (None: dense)."""
    m = microbatches(c)
    tok = batch // c.dp // m * seq                 # tokens of one microbatch
    v = c.num_model_chunks                         # model chunks per rank (interleaved: 2)
    # one microbatch on one rank: its v chunks, 1/pp of the (tp-shrunk) model in all; N-d cuts the
    # hidden size q ways and the rows nb = tp/q ways: the model shrunk q ways, on 1/nb of the rows
    ct, share = compute_tp(c), compute_tp(c) / c.tp
    f, fb = costs.forward(ct, tok) * share / c.pp, costs.forward_backward(ct, tok) * share / c.pp
    compute = fb + (f if c.activation_checkpointing else 0.0)
    tp_comm = _tp_comm(c, costs, tok, m, n_embd, layers, act_bytes, nd_bytes, nd_calls)
    # each chunk hands its activation on and takes its gradient back
    p2p = 2 * v * costs.p2p(tok * n_embd * act_bytes) if c.pp > 1 else 0.0
    a2a = _a2a(c, costs, tok, n_embd, act_bytes, experts)
    slots = m + (c.pp - 1) / v                     # microbatches plus the bubble, in microbatch times
    # ranks that share cores (CPU) compute faster while others idle: the critical path's slots at
    # the speed of a rank alone, but never below the work itself (m microbatches per rank, all
    # ranks busy); with a device per rank (slowdown 1) this is slots x the microbatch time
    n, per = max((slots, compute / costs.slowdown), (m, compute),
                 key=lambda x: x[0] * (x[1] + tp_comm + p2p + a2a))
    pipeline = n * (per + tp_comm + p2p + a2a)
    dp_comm, optim = _data_parallel(c, costs, params, tensors, grad_bytes, experts)
    total = pipeline + dp_comm + optim
    return {"total": total, "pipeline": pipeline, "compute": n * per, "tp_comm": n * tp_comm,
            "p2p": n * p2p, "a2a": n * a2a, "dp_comm": dp_comm, "optim": optim}


def a2a_bytes(c: Candidate, tok: int, n_embd: int, act_bytes: int, experts: Optional[Dict[str, int]]) -> float:
    """Bytes one rank sends in one microbatch's expert all-to-alls over its stage (``cl.plan``'s count)."""
    if not experts or c.ep <= 1:
        return 0.0
    from ..memory.experts import _MoeLayer, all_to_all_bytes

    layer = _MoeLayer("", experts["n_expert"], experts["top_k"], n_embd, [])
    return all_to_all_bytes([layer], tok, c.ep, act_bytes, 1) * experts["layers"] / c.pp


def _a2a(c: Candidate, costs: Costs, tok: int, n_embd: int, act_bytes: int,
         experts: Optional[Dict[str, int]]) -> float:
    """Seconds of one microbatch's all-to-alls on a rank: 5 per MoE layer (counts; dispatch and combine,
    forward and backward), their bytes sent priced as an all-reduce on the EP group that sends as many
    (an all-reduce of n bytes sends ``2 (p-1)/p n``, an all-to-all ``(p-1)/p n``)."""
    sent = a2a_bytes(c, tok, n_embd, act_bytes, experts)
    if not sent:
        return 0.0
    calls = 5 * experts["layers"] / c.pp
    payload = sent * c.ep / (c.ep - 1) / calls  # one all-to-all's input bytes
    return calls * costs.allreduce(c.ep, payload / 2)


def _tp_comm(c: Candidate, costs: Costs, tok: int, m: int, n_embd: int, layers: int, act_bytes: int,
             nd_bytes: float, nd_calls: float) -> float:
    """Tensor parallelism's seconds per microbatch slot on one rank."""
    if c.tp_mode == "1d":
        # Megatron 1D: per layer two all-reduces of (tokens, n_embd) forward and two backward
        per_layer = (4 + (2 if c.activation_checkpointing else 0)) * costs.allreduce(c.tp, tok * n_embd * act_bytes)
        return per_layer * layers / c.pp
    # N-d: the textbook bytes as the payload of all-reduces on the whole tp group (one of n
    # bytes sends 2(p-1)/p n), plus a latency per collective on the grid's lines (size q); the
    # forward's share (a third: one product of three) again under checkpointing
    q, _ = cuts(c.tp_mode, c.tp, c.tp_depth)
    again = 4 / 3 if c.activation_checkpointing else 1.0
    payload = nd_bytes * c.tp / (2 * (c.tp - 1))
    latency = costs.allreduce(q, 1.0) if q > 1 else 0.0
    return again * (costs.allreduce(c.tp, payload) + nd_calls * latency) / m


def _data_parallel(c: Candidate, costs: Costs, params: int, tensors: int, grad_bytes: int,
                   experts: Optional[Dict[str, int]] = None) -> Tuple[float, float]:
    """``(gradient all-reduce and ZeRO-1's sync, optimizer step)`` seconds of one rank. A MoE model's
    experts stay whole on every tp rank and are ``1/ep`` per rank, synced over the expert-dp group."""
    n_exp = experts["params"] if experts else 0
    dense = (params - n_exp) / (c.tp * c.pp)
    mine = n_exp / (c.ep * c.pp)  # this rank's expert elements
    edp = c.dp // c.ep
    local_params = dense + mine
    dp_comm = costs.allreduce(c.dp, dense * grad_bytes) + costs.allreduce(edp, mine * grad_bytes)
    if c.zero_stage == 1:
        # ZeroRedundancyOptimizer broadcasts every parameter tensor from its owner after the step,
        # all asynchronously (the measured sync); a calibration without it: a blocking collective's
        # latency per tensor, carrying the parameters' bytes once
        sync = costs.zero_sync(c.dp, tensors / (c.tp * c.pp), local_params * grad_bytes)
        if sync is None:
            sync = (tensors / (c.tp * c.pp) * costs.allreduce(c.dp, 1.0)
                    + costs.allreduce(c.dp, local_params * grad_bytes) / 2)
        dp_comm += sync
        return dp_comm, costs.adam(dense / c.dp + mine / edp)
    return dp_comm, costs.adam(local_params)


def features(c: Candidate, layers: int) -> List[float]:
    """What a step's framework overhead scales with: one per step (the optimizer wrapper, the
    data-parallel bookkeeping), per scheduled action (a chunk's forward or backward of one
    microbatch: the pipeline runtime's Python, its send/recv set-up) and per layer pass under
    tensor parallelism (DTensor's dispatch around each sharded linear)."""
    m = microbatches(c)
    slots = m + (c.pp - 1) / c.num_model_chunks
    actions = 2 * slots * c.num_model_chunks * (1.5 if c.activation_checkpointing else 1.0)
    tp_passes = slots * layers / c.pp * (1.5 if c.activation_checkpointing else 1.0) if c.tp > 1 else 0.0
    return [1.0, actions, tp_passes]


def overhead(over: Sequence[float], c: Candidate, layers: int) -> float:
    """Seconds of overhead of layout ``c`` under fitted coefficients ``over``."""
    return sum(x * f for x, f in zip(over, features(c, layers)))


def fit_overheads(feats: Sequence[Sequence[float]], residuals: Sequence[float]) -> List[float]:
    """Non-negative coefficients for ``features`` that best explain ``measured - modelled`` (least
    squares over every subset of the features, keeping the best fit with no negative
    coefficient): the overhead a layout adds beyond its compute and communication."""
    import torch

    k = len(feats[0])
    best, best_err = [0.0] * k, sum(r * r for r in residuals)
    X_all = torch.tensor(feats, dtype=torch.float64)
    y = torch.tensor(residuals, dtype=torch.float64).unsqueeze(1)
    for n in range(1, k + 1):
        for cols in itertools.combinations(range(k), n):
            X = X_all[:, list(cols)]
            if torch.linalg.matrix_rank(X) < n:
                continue
            coef = torch.linalg.lstsq(X, y).solution.squeeze(1)
            if (coef < 0).any():
                continue
            err = float(((X @ coef.unsqueeze(1) - y) ** 2).sum())
            if err < best_err - 1e-15:
                best, best_err = [0.0] * k, err
                for i, ci in zip(cols, coef.tolist()):
                    best[i] = ci
    return best
