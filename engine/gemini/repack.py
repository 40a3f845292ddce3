"""Chunks in execution order: learn the order at the first training forward, then re-pack.

``boost`` packs in registration order; a model whose modules run in another order then touches
chunks out of order (gathered, evicted, gathered again). ``trace_order`` learns each parameter's
first use from one forward on the meta device, ``_new_layout``/``_plan`` pack the new chunks and
find a move schedule the tiers can hold (dry-run first, ranks voting), and ``_Mover`` moves each
chunk's ``master|exp_avg|exp_avg_sq`` block one new chunk at a time. The how and why of each step:
docs/gemini.md, "Re-packing in execution order".
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm, telemetry
from .chunk import Chunk, TensorInfo, TensorState, pack_chunks, search_chunk_size
from .chunk_manager import ChunkManager
from .materialize import bind
from .placement import min_working_set_bytes, plan_homes

ORDERS = ("execution", "registration")
_WARNED: Set[str] = set()


@dataclass
class PackSpec:
    """How ``GeminiModel`` re-packs at its first training forward (built by ``GeminiPlugin``)."""

    order: str = "execution"                 # "execution": learn and re-pack; "registration": keep
    shard_param_frac: float = 1.0            # the plugin's, for the new chunk list
    search_max: Optional[int] = None         # chunk-size search cap (elements); None: keep the size
    done: bool = False
    status: str = "pending"                  # repacked | in order | kept: <why> | untraced: <why> | registration
    seconds: float = 0.0                     # wall time of the trace + move
    spilled: int = 0                         # new chunks that went through a temporary NVMe file
    gathers: int = 0                         # all-gathers issued (sharded old chunks, piece by piece)


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


# ---- the order ----------------------------------------------------------------------------------
def trace_order(module: nn.Module, params: List[nn.Parameter], args, kwargs) -> Tuple[Optional[List[int]], str]:
    """Indices of ``params`` in first-use order (unused ones last, in their given order), from a
    run of ``module`` on the meta device; ``(None, reason)`` when it cannot run there."""
    from torch.func import functional_call
    from torch.utils._pytree import tree_map

    index = {id(p): i for i, p in enumerate(params)}
    first: List[int] = []
    seen: Set[int] = set()
    handles = []

    def make(own):
        def hook(mod, a):
            for i in own:
                if i not in seen:
                    seen.add(i)
                    first.append(i)
        return hook

    for m in module.modules():
        own = [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index]
        if own:
            handles.append(m.register_forward_pre_hook(make(own)))

    def meta(x):
        return torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        stand_ins = {n: meta(t) for n, t in module.named_parameters()}
        stand_ins.update({n: meta(b) for n, b in module.named_buffers()})
        margs, mkwargs = tree_map(meta, (tuple(args), dict(kwargs)))
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            functional_call(module, stand_ins, margs, mkwargs, strict=False)
    except Exception as exc:  # data-dependent forward: keep the order we have
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        for h in handles:
            h.remove()
    return first + [i for i in range(len(params)) if i not in seen], ""


def _vote(mgr: ChunkManager, values: List[int]) -> bool:
    """True when every rank holds the same ``values`` (a MIN and a MAX all-reduce)."""
    if mgr.world <= 1 or not comm.initialized():
        return True
    t = torch.tensor(values, dtype=torch.int64, device=mgr.device)
    lo, hi = t.clone(), t.clone()
    comm.all_reduce(lo, op=dist.ReduceOp.MIN, group=mgr.group)
    comm.all_reduce(hi, op=dist.ReduceOp.MAX, group=mgr.group)
    return bool(torch.equal(lo, hi))


# ---- the entry point (called by GeminiModel.forward) ---------------------------------------------
def learn_and_repack(model, args, kwargs) -> None:
    """At a training forward: trace the order, re-pack if it differs. Never fails the user's step
    for a model it cannot trace; every rank must call it at the same forward (they do: the first
    training forward)."""
    spec: PackSpec = model.pack
    mgr: ChunkManager = model.manager
    if spec.done:
        return
    if spec.order == "registration":
        spec.done, spec.status = True, "registration"
        return
    if any(mgr.has_grad(c) for c in mgr.chunks):
        return  # a backward ran without its step (eval-mode forward?): try at the next training forward
    t0 = time.perf_counter()
    old = list(mgr.chunks)
    infos = [i for c in old for i in c.infos]
    params = [i.param for i in infos]
    model.remove_hooks()  # the meta forward must not gather real chunks
    try:
        perm, why = trace_order(model.module, params, args, kwargs)
        ok = perm is not None
        agreed = _vote(mgr, [int(ok)] + (perm if ok else [0] * len(params)))
        if not ok or not agreed:
            spec.status = "untraced: " + (why or "the ranks traced different orders")
            _warn_once("untraced", f"Gemini: could not learn the execution order of the model's parameters "
                       f"({why or 'the ranks traced different orders'}); chunks stay in registration order. "
                       "The forward has to run on the meta device for that (no .item() or data-dependent "
                       "control flow); pass GeminiPlugin(pack_order='registration') to skip the attempt.")
            return
        new = _new_layout(mgr, spec, [infos[i] for i in perm])
        if new is None:
            spec.status = "in order"
            return
        mgr.flush_writes()
        mgr.drop_cache()  # only homes stay; the schedule below starts from them (same call on every rank)
        plan, why = _plan(mgr, old, new)
        agreed = _vote(mgr, [int(plan is not None)] + (plan or [0] * len(new)))
        if plan is None or not agreed:
            spec.status = "kept: " + (why or "the ranks planned different moves")
            _warn_once("kept", f"Gemini: chunks stay in registration order: re-packing them in execution order "
                       f"does not fit ({why or 'the ranks planned different moves'}).")
            return
        mover = _Mover(mgr, old, new, dry=False)
        mover.run(plan)
        spec.status, spec.spilled, spec.gathers = "repacked", len(mover.spilled), mover.gathers
        mgr.adopt(new, mover.state, mover.steps)
    finally:
        model.install_hooks()
        spec.done = True
        spec.seconds += time.perf_counter() - t0
    if spec.status == "repacked":
        mgr.snapshot()
        if telemetry.has_subscribers():  # ids the new layout no longer uses: empty, so views stop counting them
            for oc in old[len(mgr.chunks):]:
                telemetry.emit(telemetry.ChunkEvent(rank=mgr.rank, step=mgr.step, chunk_id=oc.id, tier=oc.param_home,
                                                    state=TensorState.FREE.value, nbytes=0, params=()))


def _new_layout(mgr: ChunkManager, spec: PackSpec, ordered: List[TensorInfo]) -> Optional[List[Chunk]]:
    """Chunks packing ``ordered`` (homes not planned yet), or None when that is the current packing."""
    old = mgr.chunks
    c0 = old[0]
    numels = [i.numel for i in ordered]

    def chunks_of(size: int) -> List[Chunk]:  # the packing build() does, over the new order
        return pack_chunks(ordered, size, c0.dtype, c0.world, c0.rank, spec.shard_param_frac)

    new = None
    if spec.search_max is not None:  # the size was searched at boost: search again for this order
        new = chunks_of(search_chunk_size(numels, c0.world, max_size=spec.search_max))
        if min_working_set_bytes(new) > mgr.compute.capacity:
            new = None
    if new is None:
        new = chunks_of(c0.size)
    same = len(new) == len(old) and all(
        a.size == b.size and a.sharded == b.sharded and [id(i.param) for i in a.infos] == [id(i.param) for i in b.infos]
        for a, b in zip(new, old))
    return None if same else new


def _plan(mgr: ChunkManager, old: List[Chunk], new: List[Chunk]) -> Tuple[Optional[List[int]], str]:
    """Homes for ``new`` and a move schedule that never overfills a tier: ``[2*chunk + spilled]``."""
    try:
        plan_homes(new, mgr.stack, mgr.cfg)
    except ValueError as exc:
        return None, str(exc)
    mv = _Mover(mgr, old, new, dry=True)
    pending = list(range(len(new)))
    plan: List[int] = []
    while pending:
        for k in pending:
            snap = mv.save()
            try:
                mv.process(k, spill=False)
            except _NoRoom:
                mv.restore(snap)
                continue
            plan.append(2 * k)
            pending.remove(k)
            break
        else:
            k = pending[0]
            if mgr.nvme is None:
                return None, (f"the {mv.last_full} tier has no room for a new chunk while the old chunks it "
                              "waits for are still there, and there is no NVMe tier to stage it")
            try:
                mv.process(k, spill=True)
            except _NoRoom:
                return None, f"the {mv.last_full} tier has no room even to stage a chunk"
            plan.append(2 * k + 1)
            pending.remove(k)
    try:
        mv.finish()
    except _NoRoom:
        return None, f"the {mv.last_full} tier has no room for the staged chunks"
    return plan, ""


# ---- moving state -------------------------------------------------------------------------------
class _NoRoom(Exception):
    pass


class _Mover:
    """Builds the new chunks one at a time from the old ones; ``dry`` only counts bytes.

    Every allocation goes through ``take``/``give`` against per-tier counters that start from the
    real ones (NVMe: the bytes of this run's files against the free disk at boost), so the dry
    run sees exactly the peaks the real run will have.
    """

    def __init__(self, mgr: ChunkManager, old: List[Chunk], new: List[Chunk], dry: bool):
        self.mgr, self.old, self.new, self.dry = mgr, old, new, dry
        st = mgr.stack
        self.host = st.host.name
        self.used = {t.name: t.used for t in st.tiers}
        if st.nvme is not None:
            self.used["nvme"] = mgr.nvme.used if mgr.nvme is not None else 0
        self.cap = {t.name: t.capacity for t in st.tiers}
        self.last_full = ""
        where = {id(i.param): (c, i) for c in old for i in c.infos}
        self.src: Dict[int, List[Tuple[TensorInfo, Chunk, TensorInfo]]] = {}
        self.contrib: Dict[int, List[Chunk]] = {}
        self.left: Dict[int, Set[int]] = {c.id: set() for c in old}
        for c in new:
            rows, seen = [], []
            for info in c.infos:
                oc, oi = where[id(info.param)]
                rows.append((info, oc, oi))
                if oc not in seen:
                    seen.append(oc)
                self.left[oc.id].add(c.id)
            self.src[c.id], self.contrib[c.id] = rows, seen
        self.state: Dict[int, torch.Tensor] = {}
        self.spilled: List[int] = []
        self.steps: Dict[int, int] = {}
        self.gathers = 0

    # ---- the ledger ----------------------------------------------------------------------------
    def take(self, tier: str, nbytes: int) -> None:
        if nbytes <= 0:
            return
        if self.used[tier] + nbytes > self.cap[tier]:
            self.last_full = tier
            if not self.dry:
                raise RuntimeError(f"Gemini re-pack: the {tier} tier ran out of room in a move its dry run "
                                   "planned to fit (a bug; please report it)")
            raise _NoRoom(tier)
        self.used[tier] += nbytes
        if not self.dry and tier != "nvme":
            self.mgr.stack.get(tier).alloc(nbytes)

    def give(self, tier: str, nbytes: int) -> None:
        if nbytes <= 0:
            return
        self.used[tier] -= nbytes
        if not self.dry and tier != "nvme":
            self.mgr.stack.get(tier).free(nbytes)

    def save(self):
        return dict(self.used), self.gathers

    def restore(self, snap) -> None:
        self.used, self.gathers = dict(snap[0]), snap[1]

    def _empty(self, tier: str, numel: int, dtype=torch.float32, zero: bool = False) -> Optional[torch.Tensor]:
        """A buffer in ``tier`` (RAM/device), counted against it; None in a dry run."""
        self.take(tier, numel * dtype.itemsize)
        if self.dry:
            return None
        dev = self.mgr.stack.get(tier).device
        t = torch.empty(numel, dtype=dtype, device=dev, pin_memory=self.mgr.pin and dev.type == "cpu")
        return t.zero_() if zero else t

    # ---- one new chunk ---------------------------------------------------------------------------
    def process(self, k: int, spill: bool) -> None:
        c = self.new[k]
        n = c.shard_size
        home_state = c.optim_home != "nvme" and not spill
        nb = 4 * c.state_rows * n  # bytes of its fp32 state block
        block = self._empty(c.optim_home if home_state else self.host, c.state_rows * n, zero=True)
        for oc in self.contrib[k]:
            self._move(k, c, oc, block)
        self.steps[k] = max([self.mgr.steps.get(oc.id, 0) for oc in self.contrib[k] if oc.trainable] or [0])
        if spill:
            self.take("nvme", nb)
            if not self.dry:
                self.mgr.nvme.write(f"s{c.id}.state", block).result()
            self.give(self.host, nb)
            self.spilled.append(k)
        else:
            self._install(c, block, home_state)
        for oc in self.contrib[k]:
            self.left[oc.id].discard(c.id)
            if not self.left[oc.id]:
                self._release(oc)

    def _move(self, k: int, c: Chunk, oc: Chunk, block: Optional[torch.Tensor]) -> None:
        """Copy into ``block`` (new chunk ``c``'s shard, rows master|exp_avg|exp_avg_sq) what old
        chunk ``oc`` holds of it."""
        s0, s1 = c.shard_range
        need: List[Tuple[int, int]] = []             # old-chunk ranges new chunk k takes (all ranks)
        mine: List[List[int]] = []                   # [old lo, old hi, offset in this rank's new shard]
        for info, occ, oi in self.src[k]:
            if occ is not oc:
                continue
            need.append((oi.offset, oi.end))
            lo, hi = max(info.offset, s0), min(info.end, s1)
            if lo < hi:
                a, b, d = oi.offset + lo - info.offset, oi.offset + hi - info.offset, lo - s0
                if mine and mine[-1][1] == a and mine[-1][2] + (mine[-1][1] - mine[-1][0]) == d:
                    mine[-1][1] = b  # contiguous in both layouts: one copy / one read
                else:
                    mine.append([a, b, d])
        if oc.sharded and self.mgr.world > 1:
            self._move_sharded(c, oc, need, mine, block)
        else:
            self._move_local(c, oc, mine, block)

    def _move_local(self, c: Chunk, oc: Chunk, mine, block) -> None:
        """Old chunk whole on this rank: copy from its RAM block, or read the ranges from its file."""
        if self.dry or not mine:
            return
        n_new, n_old = c.shard_size, oc.shard_size
        st = self.mgr.state_block(oc)
        for r in range(min(c.state_rows, oc.state_rows)):
            for a, b, d in mine:
                dst = block[r * n_new + d:r * n_new + d + b - a]
                if st is not None:
                    dst.copy_(st[r * n_old + a:r * n_old + b])
                else:
                    self.mgr.nvme.read_at(f"c{oc.id}.state", 4 * (r * n_old + a), dst)

    def _move_sharded(self, c: Chunk, oc: Chunk, need, mine, block) -> None:
        """Old chunk sharded over the ranks: all-gather, row by row and in ``world`` pieces of a
        row, the pieces that hold anything new chunk ``c`` takes (decided from ``need``, the
        same on every rank, so every rank issues the same collectives)."""
        mgr, world = self.mgr, self.mgr.world
        n, n_new = oc.shard_size, c.shard_size
        q = -(-n // world)
        pieces = set()
        for a, b in need:
            for s in range(a // n, (b - 1) // n + 1):
                lo, hi = max(a, s * n) - s * n, min(b, (s + 1) * n) - s * n
                pieces.update(range(lo // q, (hi - 1) // q + 1))
        on_nvme, dev = oc.optim_home == "nvme", mgr.device.type != "cpu"
        gtier = mgr.compute.name if dev else self.host          # where the collective's buffers live
        st = None if (self.dry or on_nvme) else mgr.state_block(oc)
        staged = self._empty(self.host, q) if on_nvme else None  # this rank's piece, read from its file
        din = self._empty(gtier, q) if dev else None
        dout = self._empty(gtier, world * q)
        for r in range(min(c.state_rows, oc.state_rows)):  # the same on every rank
            for j in sorted(pieces):
                L = min(q, n - j * q)
                self.gathers += 1
                if self.dry:
                    continue
                if on_nvme:
                    src = staged[:L]
                    self.mgr.nvme.read_at(f"c{oc.id}.state", 4 * (r * n + j * q), src)
                else:
                    src = st[r * n + j * q:r * n + j * q + L]
                if din is not None:
                    din[:L].copy_(src)
                    src = din[:L]
                out = dout[:world * L]
                comm.all_gather_into_tensor(out, src, group=mgr.group)  # out[s*L + t] = rank s's local[r*n + j*q + t]
                for a, b, d in mine:
                    for s in range(a // n, (b - 1) // n + 1):
                        x0, x1 = max(a, s * n + j * q), min(b, s * n + j * q + L)
                        if x0 < x1:
                            o = s * L + x0 - s * n - j * q
                            block[r * n_new + d + x0 - a:r * n_new + d + x1 - a].copy_(out[o:o + x1 - x0])
        self.give(gtier, 4 * world * q)
        if dev:
            self.give(gtier, 4 * q)
        if on_nvme:
            self.give(self.host, 4 * q)

    # ---- homes -------------------------------------------------------------------------------
    def _alias(self, c: Chunk) -> bool:
        return c.param_home == self.mgr.compute.name and (not c.sharded or self.mgr.world == 1)

    def _install(self, c: Chunk, block: Optional[torch.Tensor], home_state: bool) -> None:
        """Give new chunk ``c`` its homes from its ``master|exp_avg|exp_avg_sq`` block (mirrors
        ``ChunkManager.materialize``: the same aliasing/sharing rules and byte accounting)."""
        mgr, n = self.mgr, c.shard_size
        alias, share = self._alias(c), mgr.shares_master(c)
        if home_state:
            if not self.dry:
                self.state[c.id] = block
        if not self.dry:
            master = block[:n]
            c.full = master if alias and share else torch.empty(c.size, dtype=c.dtype, device=mgr.device)
            for info in c.infos:  # views first: a view needs the storage's full size to exist
                bind(info, c.full[info.offset:info.end].view(info.shape))
        if alias:
            if not share:
                self.take(mgr.compute.name, c.full_bytes)
                if not self.dry:
                    c.full.copy_(master)
            if not self.dry:
                c.shard = c.full
                c.gathered = True
                c.set_state(TensorState.HOLD)
        else:
            if not self.dry:
                c.full.untyped_storage().resize_(0)
                c.gathered = False
            if c.param_home == "nvme":
                cast = 0 if c.dtype == torch.float32 else c.shard_bytes
                self.take(self.host, cast)
                self.take("nvme", c.shard_bytes)
                if not self.dry:
                    mgr.nvme.write(f"r{c.id}.param", master.to(c.dtype).contiguous()).result()
                    c.shard = None
                self.give(self.host, cast)
            elif share:
                if not self.dry:
                    c.shard = block[:n]
            else:
                shard = self._empty(c.param_home, n, c.dtype)
                if not self.dry:
                    shard.copy_(master)
                    c.shard = shard
        if c.optim_home == "nvme" or not home_state:
            nb = 4 * c.state_rows * n
            if c.optim_home == "nvme":
                self.take("nvme", nb)
                if not self.dry:
                    mgr.nvme.write(f"r{c.id}.state", block).result()
            self.give(self.host, nb)  # the staging block (a home block stays)

    def _release(self, oc: Chunk) -> None:
        """Free old chunk ``oc``'s homes (RAM accounting, NVMe files): all its parameters moved."""
        mgr, n = self.mgr, oc.shard_size
        alias, share = self._alias(oc), mgr.shares_master(oc)
        if alias:
            if not share:
                self.give(mgr.compute.name, oc.full_bytes)
        elif oc.param_home == "nvme":
            self.give("nvme", oc.shard_bytes)
            if not self.dry:
                mgr.nvme.remove(f"c{oc.id}.param")
        elif not share:
            self.give(oc.param_home, oc.shard_bytes)
        if oc.optim_home == "nvme":
            self.give("nvme", 4 * oc.state_rows * n)
            if not self.dry:
                mgr.nvme.remove(f"c{oc.id}.state")
                mgr.nvme.remove(f"c{oc.id}.grad")
        else:
            self.give(oc.optim_home, 4 * oc.state_rows * n)
            if not self.dry:
                mgr.drop_state(oc)
        if not self.dry:
            oc.full = oc.shard = None
            oc.gathered = False

    def finish(self) -> None:
        """Install the spilled chunks (every old chunk is gone by now)."""
        for k in self.spilled:
            c = self.new[k]
            n = c.shard_size
            home_state = c.optim_home != "nvme"
            tier = c.optim_home if home_state else self.host
            block = self._empty(tier, c.state_rows * n)
            if not self.dry:
                if block.device.type == "cpu":
                    self.mgr.nvme.read(f"s{c.id}.state", block).result()
                else:
                    block.copy_(self.mgr.nvme.read(f"s{c.id}.state", torch.empty(c.state_rows * n)).result())
                self.mgr.nvme.remove(f"s{c.id}.state")
            self.give("nvme", 4 * c.state_rows * n)
            self._install(c, block, home_state)

    def run(self, plan: List[int]) -> None:
        for code in plan:
            self.process(code // 2, spill=bool(code % 2))
        self.finish()
        assert all(not v for v in self.left.values())
        if self.mgr.nvme is not None:  # new files were written under temporary names; the old ones are gone
            for c in self.new:
                for kind in ("param", "state"):
                    self.mgr.nvme.rename(f"r{c.id}.{kind}", f"c{c.id}.{kind}")

