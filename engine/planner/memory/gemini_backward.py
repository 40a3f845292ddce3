"""Gemini's forward and backward on the compute tier, op by op over the trace: the chunk homes, the
chunks gathered at once (the one computing; under ``auto`` the next and ``max_prefetch`` in flight,
and the cache), the fp32 chunk gradient buffers and the chunks they pin, reduced gradients held
until the step, and at each chunk's reduce the buffers ``_reduce``/``_store_grad`` make."""

from __future__ import annotations

import bisect
from typing import Dict, List, Tuple

import torch

from .trace import _nbytes


class _Backward:
    """``self(i, other, grad, saved)``: the compute tier's categories at op ``i`` of the trace
    (``peaks._peak_over``'s callback); ``cap``, ``auto`` and ``ahead`` are read by the traffic."""

    def __init__(self, m, tr, plugin, chunks, homes, dtype: torch.dtype, w: int, dev: str):
        from ...gemini.tiers import UNLIMITED

        self.homes, self.w, self.dev = homes, w, dev
        comp = homes.comp
        params = dict(m.params)
        # gradients arrive in reverse order of first use, in the compute dtype as the trace's
        # gradients (Gemini's buffers are fp32)
        order = list(tr.order) + [n for n, _ in m.params if n not in set(tr.order)]
        arrival = [n for n in reversed(order) if params[n].requires_grad]
        self.cum, acc = [], 0
        for n in arrival:
            acc += _nbytes(params[n], dtype)
            self.cum.append(acc)
        self.chunk_last: Dict[int, int] = {}
        self.chunk_first: Dict[int, int] = {}
        for i, n in enumerate(arrival):
            c = homes.cid_of[n]
            self.chunk_last[c.id] = i
            self.chunk_first.setdefault(c.id, i)
        self.by_id = {c.id: c for c in chunks}
        self.pending_host = dev == "cpu"  # NVMe-bound gradients wait in host buffers (accounted) until the step
        self.nonalias = {c.id for c in chunks if not (c.param_home == comp.name and (not c.sharded or w == 1))}
        # chunks gathered at once: under ``auto`` the one computing, the next and ``max_prefetch`` in
        # flight; the other policies never prefetch and drop a chunk as soon as its module is done
        biggest = max(homes.full_sizes, default=0)
        self.auto = plugin.placement_policy == "auto"
        self.in_use = min(homes.nonalias_full, ((2 + plugin.max_prefetch) if self.auto else 1) * biggest)
        self.ahead = tr.saved_ahead()
        self.cap = comp.capacity if comp.capacity < UNLIMITED else None
        self.gloo = dev == "cpu" and w > 1  # gloo's reduce_scatter clones its input on the calling thread
        self.at_reduce = self._reduce_ops(tr)

    def _reduce_ops(self, tr) -> Dict[int, List]:
        """Op index -> the chunks whose last gradient lands there."""
        at_reduce: Dict[int, List] = {}
        bwd_idx = [i for i, ph in enumerate(tr.phase) if ph == "bwd"]
        for cid, last in self.chunk_last.items():
            need = self.cum[last]
            i = next((j for j in bwd_idx if tr.grad[j] >= need), bwd_idx[-1] if bwd_idx else 0)
            at_reduce.setdefault(i, []).append(self.by_id[cid])
        return at_reduce

    def held(self, c) -> int:
        """Gradient bytes chunk ``c`` keeps on the compute tier once reduced, until the step: its
        shard in a RAM home there, or (host = compute tier) the host copy its NVMe write keeps
        alive in the write-behind queue, which only the step's ``flush_writes`` empties."""
        if c.optim_home == self.homes.comp.name:
            return self.homes.grads_ram.get(c.id, 0)
        if c.optim_home == "nvme" and self.pending_host:
            return 4 * c.shard_size
        return 0

    def grad_state(self, g: int) -> Tuple[int, int, int]:
        """(gradient bytes held on the compute tier, fp32 chunk gradient buffers in flight, gathered
        bytes of the chunks those buffers pin: a chunk awaiting gradients stays in use)."""
        k = bisect.bisect_right(self.cum, g)  # parameters whose gradient has arrived
        stored, buffers, pinned = 0, 0, 0
        for cid, last in self.chunk_last.items():
            c = self.by_id[cid]
            if last < k:  # reduced: handed to the optimizer home
                stored += self.held(c)
            elif self.chunk_first[cid] < k:  # some gradients in: the full fp32 buffer exists
                buffers += c.size * 4
                pinned += c.full_bytes if cid in self.nonalias else 0
        return stored, buffers, pinned

    def spike(self, c) -> Tuple[int, int]:
        """``(accounted, unaccounted)`` compute-tier bytes beyond ``held(c)`` the moment chunk
        ``c``'s last gradient lands (``_reduce``, then ``_store_grad``). Accounted (Gemini counts
        them against its budget): the fp32 chunk buffer, the host copy an NVMe write takes, the
        RAM copy a RAM home takes (none when the buffer itself is adopted). Unaccounted: the
        reduce-scatter output, gloo's copy of its input, and for an NVMe home the float64 square
        taken for the clipping norm. gloo's copy is freed by whichever thread drops the work last
        (its worker or ours, a race): it is taken as alive until the gradient is stored, the worst
        case, which is what a budget must hold."""
        n4, full4 = 4 * c.shard_size, 4 * c.size
        split = c.sharded and self.w > 1
        out = n4 if split else 0
        clone = full4 if self.gloo and split else 0
        rs = (full4, clone + out)
        if self.dev != "cpu":  # the hand-off copies go to host RAM, another tier: only the device's part here
            store = (full4, out)
        elif c.optim_home == "nvme":
            host = 0 if not split else n4  # adopted: the buffer itself is written
            store = (full4 + host, clone + out + 4 * n4)
        else:
            store = (full4 + (0 if not split else n4), clone + out)
        acc, unacc = max(rs, store, key=sum)
        return acc - self.held(c), unacc

    def __call__(self, i: int, other: int, g: int, saved: int) -> Dict[str, int]:
        homes = self.homes
        stored, buffers, pinned = self.grad_state(g)
        extra = [self.spike(c) for c in self.at_reduce.get(i, ())]
        stored += sum(a for a, _ in extra)
        work = min(homes.nonalias_full, self.in_use + pinned)
        if self.auto:  # after warm-up: a used chunk stays cached while Gemini's bytes + activations ahead fit
            room = (homes.nonalias_full if self.cap is None
                    else self.cap - homes.homes_comp - stored - buffers - self.ahead[i])
            work = max(work, min(homes.nonalias_full, room))
        comp = homes.cats[homes.comp.name]
        return {"params": comp["params"], "optimizer": comp["optimizer"],
                "grads": stored + buffers, "activations": other, "working": work + sum(u for _, u in extra)}
