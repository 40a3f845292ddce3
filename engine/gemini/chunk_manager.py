"""The chunk manager: gathers, releases, moves and prefetches chunks over the tier stack.

One algorithm for every stack (``cuda→cpu→nvme`` or ``cpu→nvme``): a chunk computes from the
compute tier, loaded from its homes (``placement.py``) and all-gathered when sharded; the compute
tier's bytes are accounted against ``device_memory_limit``; eviction, prefetch (identical on every
rank), gradient reduction and telemetry are described in docs/gemini.md (``chunk_manager.py`` row).
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm, telemetry
from .chunk import Chunk, TensorInfo, TensorState
from .materialize import ParamSource, bind
from .memstats import AccessTrace, NonModelMemory, storage_key
from .nvme import NVMeStore
from .placement import PlacementConfig, optim_block_bytes, shares_master
from .tiers import Tier, TierStack


@dataclass
class _Load:
    """A chunk on its way into the compute tier: an NVMe read and/or an all-gather in flight."""

    fut: Optional[Future] = None          # NVMe read (into ``staging`` or straight into ``full``)
    staging: Optional[torch.Tensor] = None
    work: Optional[object] = None         # async all-gather (dist.Work)
    src: Optional[torch.Tensor] = None    # the all-gather's input, kept alive until it lands
    started: int = 0                      # access counter when the load began


class ChunkManager:
    def __init__(self, chunks: List[Chunk], stack: TierStack, cfg: PlacementConfig,
                 device: torch.device, group=None, nvme: Optional[NVMeStore] = None,
                 pin_memory: bool = True, telemetry_rank: int = 0, world: Optional[int] = None):
        self.chunks = chunks
        self.stack = stack
        self.cfg = cfg
        self.device = device
        self.group = group
        self.nvme = nvme
        self.pin = pin_memory and device.type == "cuda"
        self.rank = telemetry_rank
        self.world = world if world is not None else (chunks[0].world if chunks else 1)  # the data-parallel size
        self.trace = AccessTrace()
        self.nonmodel = NonModelMemory()
        self.step = 0
        self.moves = 0
        self._lru: "collections.OrderedDict[int, None]" = collections.OrderedDict()
        self._loading: Dict[int, _Load] = {}
        self._accesses = 0
        self.prefetch_hits = 0
        self._writes: Deque[Tuple[Future, Tier, int, object]] = collections.deque()
        self._grad_shard: Dict[int, torch.Tensor] = {}       # optim home in RAM
        self._grad_on_nvme: Dict[int, bool] = {}
        self._grad_norms: Dict[int, Tuple[float, float]] = {}  # NVMe-bound grads: (sum of squares, max |g|)
        self._optim_state: Dict[int, torch.Tensor] = {}      # master|exp_avg|exp_avg_sq, optim home in RAM
        self.steps: Dict[int, int] = {c.id: 0 for c in chunks}  # Adam's step count, per chunk
        self._in_backward = False
        self.check_finite = False   # set by the fp16 optimizer: inf/nan check of NVMe-bound grads
        self.found_inf = False
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._events: Dict[int, "torch.cuda.Event"] = {}

    @property
    def in_backward(self) -> bool:
        """True between ``begin_backward()`` and ``finish_backward()``: a forward seen then is a
        checkpoint's recompute, not a new step."""
        return self._in_backward

    # ---- groups ----------------------------------------------------------------------------------
    def group_of(self, c: Chunk):
        """The process group ``c`` is sharded and reduced over: its own (expert chunks: the expert-dp
        group) or the manager's data-parallel one."""
        return c.group if c.group is not None else self.group

    @staticmethod
    def split(c: Chunk) -> bool:
        """``c`` is sharded over more than one rank (its payload is all-gathered to compute)."""
        return c.sharded and c.world > 1

    # ---- tiers -----------------------------------------------------------------------------------
    @property
    def compute(self) -> Tier:
        return self.stack.compute

    def tier_of(self, c: Chunk) -> str:
        """Where the chunk's payload is now: the compute tier while gathered, else its home."""
        return self.compute.name if c.gathered else c.param_home

    def _alloc_ram(self, tier_name: str, numel: int, dtype, protect: Tuple[int, ...] = ()) -> torch.Tensor:
        tier = self.stack.get(tier_name)
        if tier is self.compute:
            self._reserve(numel * dtype.itemsize, protect=protect)
        t = torch.empty(numel, dtype=dtype, device=tier.device,
                        pin_memory=self.pin and tier.device.type == "cpu")
        tier.alloc(t.numel() * t.element_size())
        return t

    def _free_ram(self, tier_name: str, t: torch.Tensor) -> None:
        self.stack.get(tier_name).free(t.numel() * t.element_size())

    def _reserve(self, nbytes: int, protect: Tuple[int, ...] = (), before: Optional[float] = None) -> bool:
        """Make ``nbytes`` room in the compute tier; False (prefetch only) or MemoryError if impossible."""
        tier = self.compute
        while tier.room() < nbytes:
            victim = self._victim(protect)
            if victim is not None and (before is None or self.trace.next_use(victim.id) > before):
                self._drop(victim)
                continue
            if self._writes:
                self._finish_oldest_write()
                continue
            if before is not None:
                return False
            raise MemoryError(
                f"Gemini: the compute tier ({tier.name}) needs {nbytes} more bytes but holds "
                f"{tier.used} of device_memory_limit={tier.capacity} with every chunk in use; "
                "raise device_memory_limit, lower max_prefetch or chunk_size_mb, or offload more "
                "(placement_policy='auto' with nvme_offload_dir)")
        return True

    def _victim(self, protect) -> Optional[Chunk]:
        cands = [c for c in self.chunks if c.gathered and not c.aliased and not c.in_use
                 and c.id not in protect]
        if not cands:
            return None
        if self.cfg.policy == "auto" and self.trace.ready and not self.trace.lost:
            return max(cands, key=lambda c: (self.trace.next_use(c.id), c.id))
        order = list(self._lru)
        return min(cands, key=lambda c: order.index(c.id) if c.id in self._lru else -1)

    # ---- set-up ------------------------------------------------------------------------------
    def materialize(self, source=None) -> None:
        """Pack parameter values (from ``source``, a ``materialize.ParamSource``) into chunk homes
        one chunk at a time, and point every parameter into ``chunk.full`` (docs/gemini.md,
        ``materialize.py``: at most one chunk's staging buffers exist at once)."""
        if source is None:
            source = ParamSource(nn.Module())
        for c in self.chunks:
            flat = torch.zeros(c.size, dtype=c.dtype)
            for info in c.infos:
                flat[info.offset:info.end].copy_(source.value(info).reshape(-1).to("cpu", c.dtype))
            s0, s1 = c.shard_range
            master = flat[s0:s1].float()
            alias = c.param_home == self.compute.name and not self.split(c)
            share = self.shares_master(c)
            st = None
            if c.optim_home != "nvme":
                st = self._alloc_ram(c.optim_home, c.state_rows * c.shard_size, torch.float32)
                st.zero_()
                st[:c.shard_size].copy_(master)
                self._optim_state[c.id] = st
            if alias and share:
                c.full = st[:c.shard_size]  # fp32: the master *is* the parameter (no second copy)
            else:
                c.full = torch.empty(c.size, dtype=c.dtype, device=self.device)
            for info in c.infos:  # views first: a view needs the storage's full size to exist
                bind(info, c.full[info.offset:info.end].view(info.shape))
            if alias:
                if not share:
                    c.full.copy_(flat)
                    self.compute.alloc(c.full_bytes)
                c.shard = c.full
                c.gathered = True
                c.set_state(TensorState.HOLD)
            else:
                c.full.untyped_storage().resize_(0)
                if c.param_home == "nvme":
                    self.nvme.write(f"c{c.id}.param", flat[s0:s1].clone()).result()
                    c.shard = None
                elif share:
                    c.shard = st[:c.shard_size]
                else:
                    c.shard = self._alloc_ram(c.param_home, c.shard_size, c.dtype)
                    c.shard.copy_(flat[s0:s1])
            if c.optim_home == "nvme":
                state = torch.zeros(c.state_rows * c.shard_size, dtype=torch.float32)
                state[:c.shard_size].copy_(master)
                self.nvme.write(f"c{c.id}.state", state).result()
                del state
            del flat, master
        self.nonmodel.chunk_storages = {storage_key(c.full) for c in self.chunks}

    def shares_master(self, c: Chunk) -> bool:
        """The parameter shard is the fp32 master's own memory (``placement.shares_master``)."""
        return shares_master(c, c.param_home, c.optim_home, self.stack)

    # ---- gather / release ------------------------------------------------------------------------
    def access(self, c: Chunk, infos: List[TensorInfo], state: TensorState) -> None:
        """Make ``c`` computable now and mark ``infos`` with ``state``; then prefetch ahead."""
        self.trace.record(c.id, self.nonmodel.current)
        self._accesses += 1
        self._ensure_gathered(c)
        c.set_state(state, infos)
        self._lru.pop(c.id, None)
        self._lru[c.id] = None
        self._prefetch(protect=(c.id,))

    def done(self, c: Chunk, infos: List[TensorInfo], state: TensorState = TensorState.HOLD) -> None:
        c.set_state(state, infos)
        self._maybe_release(c)

    def _maybe_release(self, c: Chunk) -> None:
        if c.aliased or c.in_use or not c.gathered:
            return
        if self.cfg.policy == "auto" and self.trace.ready and \
                self.compute.used + self.trace.nonmodel_ahead(self.nonmodel.peak) <= self.compute.capacity:
            return  # keep it cached; it is evicted by furthest next use when room is needed
        self._drop(c)

    def _drop(self, c: Chunk) -> None:
        if c.aliased or not c.gathered:
            return
        self._wait_load(c)
        c.full.untyped_storage().resize_(0)
        self.compute.free(c.full_bytes)
        c.gathered = False
        c.set_state(TensorState.FREE)
        self._moved(c)

    def _load_bytes(self, c: Chunk) -> int:
        """Compute-tier bytes a load of ``c`` takes: the full buffer, plus a staging shard when
        an NVMe read cannot land in ``full`` directly (sharded chunk, or a CUDA compute tier)."""
        staged = c.param_home == "nvme" and (self.split(c) or self.device.type != "cpu")
        return c.full_bytes + (c.shard_bytes if staged and self.stack.host is self.compute else 0)

    def _ensure_gathered(self, c: Chunk) -> None:
        if c.id in self._loading:
            self.prefetch_hits += 1  # started ahead of use by _prefetch
            self._wait_load(c)
            return
        if c.gathered:
            return
        self._reserve(self._load_bytes(c), protect=(c.id,))
        self._start_load(c)
        self._wait_load(c)

    def _start_load(self, c: Chunk) -> None:
        """Allocate ``c.full`` in the compute tier and begin filling it (room already reserved)."""
        c.full.untyped_storage().resize_(c.full_bytes)
        self.compute.alloc(c.full_bytes)
        c.gathered = True
        c.set_state(TensorState.HOLD)
        if self.split(c):
            if c.param_home == "nvme":  # read now; all-gather at the next access or at use
                staging = self._alloc_ram(self.stack.host.name, c.shard_size, c.dtype, protect=(c.id,))
                self._loading[c.id] = _Load(self.nvme.read(f"c{c.id}.param", staging), staging,
                                            started=self._accesses)
            else:
                load = _Load(started=self._accesses)
                self._loading[c.id] = load
                self._issue_gather(c, load)
            return
        if c.param_home == "nvme":
            if self.device.type == "cpu":
                self._loading[c.id] = _Load(self.nvme.read(f"c{c.id}.param", c.full))
            else:
                staging = self._alloc_ram(self.stack.host.name, c.shard_size, c.dtype, protect=(c.id,))
                self._loading[c.id] = _Load(self.nvme.read(f"c{c.id}.param", staging), staging)
        else:  # host RAM -> device on the side stream
            if self._stream is not None:
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._stream):
                    c.full.copy_(c.shard, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(self._stream)
                self._events[c.id] = ev
                self._loading[c.id] = _Load()
            else:
                c.full.copy_(c.shard)

    def _issue_gather(self, c: Chunk, load: _Load) -> None:
        """Start the all-gather of a sharded chunk (its shard is in RAM or already read)."""
        if load.fut is not None:
            load.fut.result()
            load.fut = None
        src = load.staging if load.staging is not None else c.shard
        load.src = src.to(self.device)
        load.work = comm.all_gather_into_tensor(c.full, load.src, group=self.group_of(c), async_op=True)

    def _wait_load(self, c: Chunk) -> None:
        entry = self._loading.pop(c.id, None)
        if entry is None:
            return
        staging = entry.staging
        if entry.fut is not None and not self.split(c):
            entry.fut.result()
        ev = self._events.pop(c.id, None)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
        if self.split(c):
            if entry.work is None:
                self._issue_gather(c, entry)
            entry.work.wait()
            entry.src = None
        elif staging is not None:
            c.full.copy_(staging)
        if staging is not None:
            self._free_ram(self.stack.host.name, staging)
        self._moved(c)

    def _prefetch(self, protect: Tuple[int, ...]) -> None:
        """Start loading the next chunks of the trace if they fit without evicting sooner ones."""
        if self.cfg.max_prefetch <= 0 or self.cfg.policy != "auto":
            return
        for cid in self.trace.upcoming(self.cfg.max_prefetch + 1):
            c = self.chunks[cid]
            load = self._loading.get(cid)
            if load is not None:
                # an NVMe shard read at an earlier access: all-gather it now (a point in the
                # access sequence that is the same on every rank, whether or not the read is done)
                if load.work is None and load.fut is not None and self.split(c) \
                        and load.started < self._accesses:
                    self._issue_gather(c, load)
                continue
            if c.gathered:
                continue
            if not self._reserve(self._load_bytes(c), protect=protect + (cid,), before=self.trace.next_use(cid)):
                return
            self._start_load(c)

    # ---- gradients ---------------------------------------------------------------------------
    def begin_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        for c in self.chunks:
            c.grads_pending = len(c.trainable)
            c.reduced = False
        torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def on_grad(self, c: Chunk, info: TensorInfo) -> None:
        """Called after ``info.param.grad`` is fully accumulated for this backward."""
        p = info.param
        if c.grad_full is None:
            self._reserve(c.size * 4, protect=(c.id,))
            c.grad_full = torch.zeros(c.size, dtype=torch.float32, device=self.device)
            self.compute.alloc(c.size * 4)
        c.grad_full[info.offset:info.end].add_(p.grad.detach().reshape(-1))
        p.grad = None
        info.state = TensorState.READY_FOR_REDUCE
        c.grads_pending -= 1
        if c.grads_pending == 0:
            self._reduce(c)

    def finish_backward(self) -> None:
        """Reduce every chunk whose gradients did not all arrive (unused parameters) — same order on every rank."""
        if not self._in_backward:
            return
        for c in self.chunks:
            if not c.reduced and c.trainable:
                if c.grad_full is None:
                    self._reserve(c.size * 4, protect=(c.id,))
                    c.grad_full = torch.zeros(c.size, dtype=torch.float32, device=self.device)
                    self.compute.alloc(c.size * 4)
                self._reduce(c)
        for c in self.chunks:
            if any(i.state == TensorState.HOLD_AFTER_BWD for i in c.infos):
                c.set_state(TensorState.HOLD, [i for i in c.infos if i.state == TensorState.HOLD_AFTER_BWD])
                self._maybe_release(c)
        self._in_backward = False

    def _reduce(self, c: Chunk) -> None:
        g = c.grad_full
        if self.world > 1:
            # summed over the chunk's group, divided by the whole dp: an expert chunk's gradient already
            # sums its EP group's tokens (the all-to-all's backward), its group is the expert-dp ranks
            if self.split(c):
                out = torch.empty(c.shard_size, dtype=torch.float32, device=self.device)
                comm.reduce_scatter_tensor(out, g, group=self.group_of(c))
            else:
                if c.world > 1:
                    comm.all_reduce(g, group=self.group_of(c))
                out = g
            out.div_(self.world)
        else:
            out = g
        c.reduced = True
        adopted = self._store_grad(c, out)
        c.grad_full = None
        if not adopted:
            self.compute.free(c.size * 4)
        c.set_state(TensorState.HOLD, [i for i in c.infos if i.state == TensorState.READY_FOR_REDUCE])
        self._maybe_release(c)

    def _store_grad(self, c: Chunk, g: torch.Tensor) -> bool:
        """Hand the reduced gradient to the optimizer home; True if ``g`` itself was adopted."""
        if c.optim_home == "nvme":
            adopt = g is c.grad_full and g.device.type == "cpu"  # write the reduced buffer itself
            if adopt:
                host = g.detach()
                self.compute.free(g.numel() * 4)
            else:
                if self.stack.host is self.compute:
                    self._reserve(c.shard_size * 4, protect=(c.id,))
                host = g.detach().to("cpu", copy=True)
            if self._grad_on_nvme.get(c.id):  # accumulation across backward calls before a step
                prev = torch.empty_like(host)
                self.nvme.read(f"c{c.id}.grad", prev).result()
                host.add_(prev)
            if self.check_finite and not self.found_inf and not bool(torch.isfinite(host).all()):
                self.found_inf = True  # fp16: seen here, before the gradient goes to disk
            # for gradient clipping: norms of what goes to disk, so clipping never reads it back
            self._grad_norms[c.id] = (float(host.double().pow(2).sum()),
                                      float(host.abs().max()) if host.numel() else 0.0)
            self.stack.host.alloc(host.numel() * 4)
            self._writes.append((self.nvme.write(f"c{c.id}.grad", host), self.stack.host, host.numel() * 4, host))
            self._grad_on_nvme[c.id] = True
            return adopt
        else:
            prev = self._grad_shard.get(c.id)
            if prev is not None:
                prev.add_(g.to(prev.device))
            elif g is c.grad_full and g.device == self.stack.get(c.optim_home).device:
                # one rank, unsharded: the reduced buffer becomes the optimizer's gradient (no copy)
                self.compute.free(g.numel() * 4)
                self.stack.get(c.optim_home).alloc(g.numel() * 4)
                self._grad_shard[c.id] = g
                return True
            else:
                t = self._alloc_ram(c.optim_home, c.shard_size, torch.float32)
                t.copy_(g)
                self._grad_shard[c.id] = t
        return False

    def _finish_oldest_write(self) -> None:
        fut, tier, nbytes, _keep = self._writes.popleft()
        fut.result()
        tier.free(nbytes)

    def flush_writes(self) -> None:
        while self._writes:
            self._finish_oldest_write()

    # ---- optimizer-side access ---------------------------------------------------------------
    def has_grad(self, c: Chunk) -> bool:
        return c.id in self._grad_shard or bool(self._grad_on_nvme.get(c.id))

    def grad_norm_part(self, c: Chunk, p: float) -> float:
        """This rank's ``sum |g|^p`` (``max |g|`` for p = inf) over ``c``'s gradient shard."""
        inf = p == float("inf")
        if c.id in self._grad_shard:
            g = self._grad_shard[c.id]
        else:
            cached = self._grad_norms.get(c.id)
            if cached is not None and (inf or p == 2.0):
                return cached[1] if inf else cached[0]
            g = torch.empty(c.shard_size, dtype=torch.float32)
            self.flush_writes()
            self.nvme.read(f"c{c.id}.grad", g).result()
        if not g.numel():
            return 0.0
        return float(g.abs().max()) if inf else float(g.double().abs().pow(p).sum())

    def grads_finite(self) -> bool:
        """Whether this rank's gradient shards are all finite (NVMe-bound ones were checked as
        they were written, under ``check_finite``)."""
        return not self.found_inf and all(bool(torch.isfinite(g).all()) for g in self._grad_shard.values())

    def discard_grads(self) -> None:
        """Drop every gradient waiting for the optimizer step (an overflowed step, ``zero_grad``)."""
        self.flush_writes()
        for cid in self._grad_on_nvme:
            self.nvme.remove(f"c{cid}.grad")
        self._grad_on_nvme.clear()
        self._grad_norms.clear()
        for c in self.chunks:
            g = self._grad_shard.pop(c.id, None)
            if g is not None:
                self._free_ram(c.optim_home, g)
        self.found_inf = False

    def drop_cache(self) -> None:
        """Before the optimizer step: cached gathered copies become stale, so drop them."""
        for c in self.chunks:
            self._wait_load(c)
        self._loading.clear()
        for c in self.chunks:
            if c.gathered and not c.aliased:
                self._drop(c)

    def load_optim(self, c: Chunk, ahead: bool = False) -> Optional["OptimWindow"]:
        """Begin loading ``c``'s optimizer state and gradient (NVMe homes: a background read);
        ``ahead=True`` (a read-ahead) returns None instead of failing when there is no room."""
        need = optim_block_bytes(c) + c.shard_bytes if c.optim_home == "nvme" else 0
        if need and self.stack.host is self.compute:
            if ahead and self.compute.room() < need:
                while self._writes and self.compute.room() < need:
                    self._finish_oldest_write()
                if self.compute.room() < need:
                    return None
            self._reserve(need)
        return OptimWindow(self, c)

    def release_optim(self, w: "OptimWindow") -> None:
        c = w.chunk
        if c.optim_home == "nvme":
            # the window's buffers: the state buffer is handed to the write (freed when it lands)
            self.stack.host.free(optim_block_bytes(c) - w.state.numel() * 4)
            self._writes.append((self.nvme.write(f"c{c.id}.state", w.state), self.stack.host,
                                 w.state.numel() * 4, w.state))
            self._grad_on_nvme.pop(c.id, None)
            self._grad_norms.pop(c.id, None)
            self.nvme.remove(f"c{c.id}.grad")
        else:
            g = self._grad_shard.pop(c.id, None)
            if g is not None:
                self._free_ram(c.optim_home, g)

    def write_params(self, c: Chunk, master: torch.Tensor) -> None:
        """Store the updated parameter shard (from the fp32 master) in the chunk's home."""
        if c.param_home == "nvme":
            nbytes = 0 if master.dtype == c.dtype else c.shard_bytes  # fp32 writes the master itself
            if nbytes and self.stack.host is self.compute:
                self._reserve(nbytes)
            new = master.to(c.dtype)
            self.stack.host.alloc(nbytes)
            self._writes.append((self.nvme.write(f"c{c.id}.param", new), self.stack.host, nbytes, new))
            return
        if c.shard.data_ptr() != master.data_ptr():
            c.shard.copy_(master)

    # ---- whole state blocks (checkpoints, re-pack) -------------------------------------------
    def state_block(self, c: Chunk) -> Optional[torch.Tensor]:
        """``c``'s ``master|exp_avg|exp_avg_sq`` block itself when its home is RAM, else None."""
        return self._optim_state.get(c.id)

    def drop_state(self, c: Chunk) -> None:
        """Let go of ``c``'s RAM state block (a re-pack moved everything out of it)."""
        self._optim_state.pop(c.id, None)

    def read_state(self, c: Chunk) -> torch.Tensor:
        """A CPU copy of this rank's ``master|exp_avg|exp_avg_sq`` block of ``c`` (the master alone
        for a frozen chunk)."""
        self.flush_writes()
        if c.optim_home == "nvme":
            return self.nvme.read(f"c{c.id}.state", torch.empty(c.state_rows * c.shard_size)).result()
        return self._optim_state[c.id].detach().to("cpu", copy=True)

    def write_state(self, c: Chunk, state: torch.Tensor, params: bool = False) -> None:
        """Store ``state`` as ``c``'s block on this rank; ``params=True`` (a model load): the
        parameter shard follows the new master and a cached gathered copy is dropped."""
        if c.optim_home == "nvme":
            self.nvme.write(f"c{c.id}.state", state).result()
        else:
            self._optim_state[c.id].copy_(state)
        if params:
            self._drop(c)
            self.write_params(c, state[:c.shard_size])
            self.flush_writes()

    def gather_full(self, c: Chunk, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's ``shard`` (k blocks of ``shard_size``) of a sharded chunk as k full-size
        blocks (collective); an unsharded chunk's ``shard`` as it is."""
        if not self.split(c):
            return shard
        n = c.shard_size
        parts = comm.all_gather([torch.empty_like(shard) for _ in range(c.world)], shard, group=self.group_of(c))
        return torch.cat([p[j * n:(j + 1) * n] for j in range(shard.numel() // n) for p in parts])

    def adopt(self, chunks: List[Chunk], state_blocks: Dict[int, torch.Tensor], steps: Dict[int, int]) -> None:
        """Take a new chunk list (a re-pack) with its RAM state blocks and step counts; the
        access trace is learned again for the new ids."""
        self.chunks, self._optim_state = chunks, state_blocks
        self.steps = {c.id: steps.get(c.id, 0) for c in chunks}
        self._lru.clear()
        self.trace = AccessTrace()
        self.nonmodel = NonModelMemory({storage_key(c.full) for c in chunks})

    # ---- steps and telemetry -----------------------------------------------------------------
    def begin_step(self) -> None:
        self.trace.begin_step()

    def end_step(self) -> None:
        self.flush_writes()
        if not self.trace.ready:
            if self.world > 1:  # decisions that drive collectives must agree on every rank
                at = self.trace.nonmodel_at
                n = torch.tensor([float(len(at)), -float(len(at))], dtype=torch.float64, device=self.device)
                comm.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
                same = int(n[0].item()) == -int(n[1].item())
                vals = torch.tensor([float(self.nonmodel.peak)] + ([float(v) for v in at] if same else []),
                                    dtype=torch.float64, device=self.device)
                comm.all_reduce(vals, op=dist.ReduceOp.MAX, group=self.group)
                self.nonmodel.peak = int(vals[0].item())
                self.trace.nonmodel_at = [int(v) for v in vals[1:].tolist()] if same else []
            self.trace.finish_warmup()
        self.found_inf = False
        self.step += 1
        self.snapshot()

    def _moved(self, c: Chunk) -> None:
        self.moves += 1
        if telemetry.has_subscribers():
            telemetry.emit(self._event(c))

    def _event(self, c: Chunk) -> telemetry.ChunkEvent:
        return telemetry.ChunkEvent(rank=self.rank, step=self.step, chunk_id=c.id, tier=self.tier_of(c),
                                    state=c.state_summary(), nbytes=c.full_bytes if c.gathered else c.shard_bytes,
                                    params=c.names())

    def snapshot(self) -> None:
        """One ChunkEvent per chunk and one MemorySample per tier (only when someone listens)."""
        if not telemetry.has_subscribers():
            return
        for c in self.chunks:
            telemetry.emit(self._event(c))
        now = time.time()
        for t in self.stack.tiers:
            used = self.nvme.used if t.name == "nvme" and self.nvme is not None else t.used
            telemetry.emit(telemetry.MemorySample(rank=self.rank, time=now, tier=t.name, used=used,
                                                  capacity=min(t.capacity, 1 << 62)))

    def close(self) -> None:
        """Wait for pending writes, then delete the NVMe files. Never raises for a write that
        failed (a full disk was already reported by the step that hit it; the files it was
        writing are being deleted), so cleanup always happens."""
        try:
            while self._writes:
                fut, tier, nbytes, _keep = self._writes.popleft()
                try:
                    fut.result()
                except OSError:
                    pass
                tier.free(nbytes)
        finally:
            if self.nvme is not None:
                self.nvme.close()


class OptimWindow:
    """One chunk's optimizer state + gradient, resident for its update (``master``, ``exp_avg``,
    ``exp_avg_sq``: the rows of its state block); NVMe reads start here, ``wait()`` joins them."""

    def __init__(self, mgr: ChunkManager, c: Chunk):
        self.chunk = c
        self._futs: List[Future] = []
        n = c.shard_size
        if c.optim_home == "nvme":
            mgr.stack.host.alloc(optim_block_bytes(c))
            self.state = torch.empty(3 * n, dtype=torch.float32)
            self._futs.append(mgr.nvme.read(f"c{c.id}.state", self.state))
            if mgr._grad_on_nvme.get(c.id):
                self.grad = torch.empty(n, dtype=torch.float32)
                self._futs.append(mgr.nvme.read(f"c{c.id}.grad", self.grad))
            else:
                self.grad = None
        else:
            self.state = mgr._optim_state[c.id]
            self.grad = mgr._grad_shard.get(c.id)
        self.master, self.exp_avg, self.exp_avg_sq = self.state.view(3, n)

    def wait(self) -> "OptimWindow":
        for f in self._futs:
            f.result()
        self._futs = []
        return self
