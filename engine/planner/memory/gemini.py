"""Memory model of ``GeminiPlugin``: its chunks packed, sized and homed by Gemini's own functions,
then the step's bytes per tier.

The chunk size and tier stack come from ``engine/gemini`` (``build.chunk_elems``,
``TierStack.of``), the packing from ``chunk.pack_chunks`` in execution order (the order of first
use read off the trace, as Gemini's re-pack does), the homes from ``placement.plan_homes``; a
layout ``plan_homes`` refuses is planned with room everywhere and reported as refused. Over the
trace go the homes, the gathered chunks (and ``auto``'s cache: a used chunk stays while Gemini's
bytes plus the activations still ahead fit the budget), fp32 gradient buffers, each chunk's reduce
(``gemini_backward.py``), and the optimizer step's windows over NVMe homes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from .env import _check_dir, _Env
from .gemini_backward import _Backward
from .peaks import _acts_summary, _max_cats, _peak_over, _Result, _tier
from .result import CATEGORIES, RankPlan, _fmt


def plan_gemini(m, plugin, env: _Env, precision: str, opt: str, ac: bool) -> _Result:
    """GeminiPlugin: chunks packed and homed by the engine's own functions, then the step's
    bytes per tier: homes, gathered chunks (and ``auto``'s cache), gradient buffers, activations,
    the optimizer's windows."""
    from ...mixed_precision import TORCH_DTYPE_MAP

    if opt not in ("adamw", "adam"):
        raise ValueError(f"cl.plan(optimizer={opt!r}): GeminiPlugin runs torch.optim.AdamW/Adam only; pass "
                         "optimizer='adamw'")
    w, dev = env.world, env.compute_tier
    dtype = TORCH_DTYPE_MAP[precision]
    tr = m.trace(ac=ac, dtype=dtype)
    notes: List[str] = []
    chunks, size = _pack(m, plugin, tr, dtype, w)
    stack = _stack(plugin, env)
    refused = _place(chunks, stack, plugin, notes)
    homes = _Homes.of(chunks, stack, w)
    bwd = _Backward(m, tr, plugin, chunks, homes, dtype, w, dev)
    fbc, ph, _ = _peak_over(tr, bwd)
    out_tiers = _tiers(env, stack, homes, chunks, bwd.cap, (fbc, ph), dtype, plugin.nvme_offload_dir)
    traffic = _traffic(chunks, homes, bwd, tr, plugin, w)
    notes += _notes(chunks, homes, plugin, size * dtype.itemsize)
    sharded = any(c.sharded and w > 1 for c in chunks)
    rp = RankPlan(list(range(w)), "ZeRO-3 chunks" if sharded else "", out_tiers)
    layout = {"dp": w, "tp": 1, "pp": 1, "chunks": len(chunks), "chunk_bytes": size * dtype.itemsize,
              "placement": plugin.placement_policy, "refused": refused}
    return _Result([rp], traffic, _acts_summary(m, ac, dtype=dtype), layout, notes)


def _pack(m, plugin, tr, dtype: torch.dtype, w: int):
    """The chunks ``build()`` packs, in the order the execution-order re-pack leaves them; their size."""
    from ...gemini.build import chunk_elems
    from ...gemini.chunk import TensorInfo, pack_chunks

    named = [(n, p) for n, p in m.params]
    if plugin.pack_order == "execution" and tr.order:
        pos = {n: i for i, n in enumerate(tr.order)}
        named = sorted(named, key=lambda t: pos.get(t[0], len(pos) + [n for n, _ in m.params].index(t[0])))
    infos = [TensorInfo(name=n, param=p, offset=0, numel=p.numel(), shape=p.shape) for n, p in named]
    size, _ = chunk_elems(infos, dtype.itemsize, w, plugin.chunk_size_mb, plugin.device_memory_limit,
                          plugin.max_prefetch)
    return pack_chunks(infos, size, dtype, w, 0, plugin.shard_param_frac), size


def _stack(plugin, env: _Env):
    """The tier stack Gemini would build on each rank, with the capacities being planned for."""
    from ...gemini.tiers import TierStack

    nvme = None
    if plugin.nvme_offload_dir is not None:
        nvme = env.nvme if env.nvme is not None else _check_dir(plugin.nvme_offload_dir) // env.world
    return TierStack.of(torch.device(env.compute_tier), env.compute, plugin.device_memory_limit, nvme)


def _place(chunks, stack, plugin, notes: List[str]) -> Optional[str]:
    """Home every chunk as ``plan_homes`` does; where it refuses, home them with room everywhere
    and return its message (the plan is then ``blocked``)."""
    from ...gemini.placement import PlacementConfig, plan_homes
    from ...gemini.tiers import UNLIMITED, Tier, TierStack

    cfg = PlacementConfig(policy=plugin.placement_policy, offload_optim_frac=plugin.offload_optim_frac,
                          offload_param_frac=plugin.offload_param_frac, nvme_offload_frac=plugin.nvme_offload_frac,
                          max_prefetch=plugin.max_prefetch)
    try:
        plan_homes(chunks, stack, cfg)
    except ValueError as exc:  # show where it would go with room everywhere, and say it does not fit
        roomy = TierStack([Tier(t.name, UNLIMITED, t.device) for t in stack.tiers])
        plan_homes(chunks, roomy, cfg)
        notes.append(f"Gemini refuses this at boost: {exc}")
        return str(exc)
    return None


@dataclass
class _Homes:
    """Per tier and category the bytes chunk homes hold, and what the run-time model needs of them."""

    comp: Any                                     # the compute tier (``gemini.tiers.Tier``)
    cats: Dict[str, Dict[str, int]]               # tier -> category -> bytes of homes there
    files: Dict[str, int] = field(default_factory=lambda: {"param": 0, "state": 0, "grad": 0})  # NVMe
    nonalias_full: int = 0                        # gathered bytes of chunks not computed in place
    full_sizes: List[int] = field(default_factory=list)
    grads_ram: Dict[int, int] = field(default_factory=dict)   # chunk id -> fp32 gradient shard in a RAM home
    nvme_param_chunks: List[Any] = field(default_factory=list)
    cid_of: Dict[str, Any] = field(default_factory=dict)      # parameter name -> its chunk

    @classmethod
    def of(cls, chunks, stack, w: int) -> "_Homes":
        from ...gemini.placement import shares_master

        comp = stack.compute
        h = cls(comp, {t.name: {c: 0 for c in CATEGORIES} for t in stack.tiers})
        for c in chunks:
            for info in c.infos:
                h.cid_of[info.name] = c
            alias = c.param_home == comp.name and (not c.sharded or w == 1)
            share = shares_master(c, c.param_home, c.optim_home, stack)
            n = c.shard_size
            if c.param_home == "nvme":
                h.files["param"] += c.shard_bytes
                h.nvme_param_chunks.append(c)
            else:
                h.cats[c.param_home]["params"] += c.shard_bytes
            # fp32 master + Adam's two moments; a frozen chunk (a LoRA base) keeps its master only and gets
            # no gradient (Chunk.state_rows)
            state, grad = 4 * c.state_rows * n, (0 if c.frozen else 4 * n)
            if c.optim_home == "nvme":
                h.files["state"] += state
                h.files["grad"] += grad
            else:
                h.cats[c.optim_home]["optimizer"] += state - (c.shard_bytes if share else 0)
                if grad:
                    h.grads_ram[c.id] = grad
            if not alias:
                h.nonalias_full += c.full_bytes
                h.full_sizes.append(c.full_bytes)
        return h

    @property
    def homes_comp(self) -> int:
        return sum(self.cats[self.comp.name][k] for k in ("params", "optimizer"))


def _step_host(homes: _Homes, chunks, cap: Optional[int], dtype: torch.dtype) -> Dict[str, int]:
    """Host RAM through the optimizer step: cache dropped, then chunk by chunk
    (``GeminiOptimizer._apply_step``) an NVMe home's state+gradient window is read (the next one
    read ahead), updated and written behind; a written-behind buffer stays in the write queue, alive
    and accounted on the host tier, until room is needed (``_reserve``/``load_optim`` finish the
    oldest writes) or the step ends."""
    from ...gemini.placement import optim_block_bytes

    host_name = "cpu"
    by_id = {c.id: c for c in chunks}
    on_host = {"params": homes.cats[host_name]["params"], "optimizer": homes.cats[host_name]["optimizer"]}
    host_homes = on_host["params"] + on_host["optimizer"]
    host_cap = cap if host_name == homes.comp.name else None
    ram_grads = {cid: v for cid, v in homes.grads_ram.items() if by_id[cid].optim_home == host_name}
    left_grads = sum(ram_grads.values())
    pending, best = 0, None
    todo = [c for c in chunks if any(i.param.requires_grad for i in c.infos)]
    for j, c in enumerate(todo):
        nxt = todo[j + 1] if j + 1 < len(todo) else None
        wcur = optim_block_bytes(c) if c.optim_home == "nvme" else 0
        wnext = optim_block_bytes(nxt) if nxt is not None and nxt.optim_home == "nvme" else 0
        windows = wcur + wnext
        if host_cap is not None:  # the oldest writes are finished to make room for the windows
            pending = max(0, min(pending, host_cap - host_homes - left_grads - windows))
        cand = {**on_host, "grads": left_grads, "working": windows + pending}
        if best is None or sum(cand.values()) > sum(best.values()):
            best = cand
        left_grads -= ram_grads.get(c.id, 0)
        if c.optim_home == "nvme":
            low = c.param_home == "nvme" and dtype != torch.float32  # its low-precision parameter shard too
            pending += 4 * c.state_rows * c.shard_size + (c.shard_bytes if low else 0)
    return best or {**on_host, "grads": 0, "working": 0}


def _tiers(env: _Env, stack, homes: _Homes, chunks, cap: Optional[int], fb, dtype: torch.dtype,
           nvme_dir: Optional[str]) -> dict:
    """Each tier at its peak: the compute tier (backward or step), host RAM on a GPU machine (the
    step), the NVMe files (end of backward)."""
    comp, cats = homes.comp, homes.cats
    step_host = _step_host(homes, chunks, cap, dtype)
    step = step_host if comp.name == "cpu" else {"params": cats[comp.name]["params"],
                                                 "optimizer": cats[comp.name]["optimizer"]}
    comp_cats, comp_phase = _max_cats(fb, (step, "optimizer step"))
    out = {comp.name: _tier(comp.name, env.capacity(comp.name), comp_cats, comp_phase)}
    if env.compute_tier == "cuda":  # host RAM: homes there, the gradients handed to them, the step's windows
        out["cpu"] = _tier("cpu", env.capacity("cpu"), step_host, "optimizer step")
    if nvme_dir is not None:
        files = homes.files
        out["nvme"] = _tier("nvme", env.capacity("nvme") or stack.nvme.capacity,
                            {"params": files["param"], "optimizer": files["state"], "grads": files["grad"]},
                            "end of backward")
    return out


def _traffic(chunks, homes: _Homes, bwd: _Backward, tr, plugin, w: int) -> Dict[str, int]:
    """Bytes a step moves per rank: NVMe reads and writes, all-gathers, reduce-scatters, all-reduces."""
    traffic: Dict[str, int] = {}
    if plugin.nvme_offload_dir is not None:
        # an NVMe-homed parameter chunk is read each time it is gathered: once a step when every
        # chunk stays cached, else at every run of accesses to it — forward in module order,
        # backward in reverse (Gemini gathers per module that owns parameters)
        cap, files = bwd.cap, homes.files
        keep = bwd.auto and (cap is None or homes.nonalias_full + homes.homes_comp + max(bwd.ahead, default=0) <= cap)
        seq_ids = [homes.cid_of[n].id for call in tr.calls for n in call if n in homes.cid_of]
        runs: Dict[int, int] = {}
        for s_ in (seq_ids, seq_ids[::-1]):
            for j, cid in enumerate(s_):
                if j == 0 or s_[j - 1] != cid:
                    runs[cid] = runs.get(cid, 0) + 1
        reads = sum(c.shard_bytes * (1 if keep else max(2, runs.get(c.id, 2))) for c in homes.nvme_param_chunks)
        traffic["nvme->cpu"] = reads + files["state"] + files["grad"]
        traffic["cpu->nvme"] = files["grad"] + files["state"] + sum(c.shard_bytes for c in homes.nvme_param_chunks)
    sharded = [c for c in chunks if c.sharded and w > 1]
    if sharded:
        keep_all = bwd.auto and bwd.cap is None
        traffic["allgather"] = int(sum(c.full_bytes for c in sharded) * (1 if keep_all else 2) * (w - 1) / w)
        traffic["reduce_scatter"] = int(sum(c.size * 4 for c in sharded) * (w - 1) / w)
    repl = [c for c in chunks if not c.sharded and w > 1]
    if repl:
        traffic["allreduce"] = int(sum(c.size * 4 for c in repl) * 2 * (w - 1) / w)
    return traffic


def _notes(chunks, homes: _Homes, plugin, chunk_bytes: int) -> List[str]:
    from ...gemini.placement import working_set_bytes

    count: Dict[str, int] = {}
    for c in chunks:
        count.setdefault(f"param:{c.param_home}", 0)
        count[f"param:{c.param_home}"] += 1
        count.setdefault(f"optim:{c.optim_home}", 0)
        count[f"optim:{c.optim_home}"] += 1
    comp = homes.comp
    notes = [f"Gemini: {len(chunks)} chunks of {_fmt(chunk_bytes)} ({plugin.pack_order} order), homes "
             + ", ".join(f"{k} {v}" for k, v in sorted(count.items()))
             + f"; working-set reserve {_fmt(working_set_bytes(chunks, plugin.max_prefetch, comp.capacity))}"]
    if plugin.device_memory_limit is not None:
        notes.append(f"Gemini keeps its own bytes on the {comp.name} tier under "
                     f"device_memory_limit={_fmt(plugin.device_memory_limit)}; "
                     "activations come on top (it leaves them room when caching)")
    return notes
