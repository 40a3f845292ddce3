"""Gemini checkpoints: full, name-keyed tensors in HF-style safetensors, whatever the placement.

Built on the engine's ``checkpoint_io`` pieces (``save_state_dict_shards``/
``load_state_dict_shards`` and ``atomic_dir``): a chunk's bytes may sit in the compute tier,
host RAM or an NVMe file, and be a 1/world shard, so we gather chunk by chunk (one chunk of
memory at a time), read NVMe-resident shards through the store, and write one checkpoint
that a plain ``GPT`` (``load_state_dict``) or a Gemini run on any number of ranks reads back.

* model: ``model*.safetensors`` of the fp32 master weights (exact for fp32 runs; for bf16/fp16
  runs the master is what training continues from);
* optimizer: ``optimizer*.safetensors`` with ``state.<param>.exp_avg``/``exp_avg_sq``/``step``
  plus ``param_groups.json`` (hyper-parameters, so LR schedules resume).

Saving is atomic (temporary directory + rename): a failure, including a full disk, leaves the
previous checkpoint intact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.distributed as dist

from .. import comm
from ..checkpoint_io import CheckpointIO, atomic_dir, atomic_file, load_state_dict_shards, save_state_dict_shards
from ..checkpoint_io.atomic import recover
from .chunk import Chunk
from .chunk_manager import ChunkManager


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _read_state_shard(mgr: ChunkManager, c: Chunk) -> torch.Tensor:
    """This rank's ``master|exp_avg|exp_avg_sq`` block for chunk ``c`` (a CPU copy)."""
    if c.optim_home == "nvme":
        out = torch.empty(3 * c.shard_size, dtype=torch.float32)
        mgr.flush_writes()
        mgr.nvme.read(f"c{c.id}.state", out).result()
        return out
    return mgr._optim_state[c.id].detach().to("cpu", copy=True)


def _gather_full(mgr: ChunkManager, c: Chunk, shard: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's shard of a sharded chunk (``shard`` holds k blocks of shard_size)."""
    if not (c.sharded and mgr.world > 1):
        return shard
    k = shard.numel() // c.shard_size
    parts = comm.all_gather([torch.empty_like(shard) for _ in range(mgr.world)], shard, group=mgr.group)
    # each part is [block0 | block1 | ...]; regroup into k full-size blocks
    blocks = [torch.cat([p[j * c.shard_size:(j + 1) * c.shard_size] for p in parts]) for j in range(k)]
    return torch.cat(blocks)


def gather_model_state(model) -> Dict[str, torch.Tensor]:
    mgr = model.manager
    mgr.flush_writes()
    out: Dict[str, torch.Tensor] = {}
    for c in mgr.chunks:
        st = _gather_full(mgr, c, _read_state_shard(mgr, c)[:c.shard_size].contiguous())
        for info in c.infos:
            out[info.name] = st[info.offset:info.end].view(info.shape).clone()
    return out


def _write_chunk_master(mgr: ChunkManager, c: Chunk, full_master: torch.Tensor, full_m=None, full_v=None) -> None:
    s0, s1 = c.shard_range
    state = _read_state_shard(mgr, c)
    n = c.shard_size
    state[:n].copy_(full_master[s0:s1])
    if full_m is not None:
        state[n:2 * n].copy_(full_m[s0:s1])
        state[2 * n:].copy_(full_v[s0:s1])
    if c.optim_home == "nvme":
        mgr.nvme.write(f"c{c.id}.state", state).result()
    else:
        mgr._optim_state[c.id].copy_(state)
    if full_m is None:  # model load: parameters follow the new master
        if c.gathered and not c.aliased:
            mgr._drop(c)
        new = full_master[s0:s1].to(c.dtype)
        if c.param_home == "nvme":
            mgr.nvme.write(f"c{c.id}.param", new).result()
        else:
            c.shard.copy_(new)


def load_model_state(model, sd: Dict[str, torch.Tensor], strict: bool = True):
    mgr = model.manager
    mgr.flush_writes()
    names = {i.name for c in mgr.chunks for i in c.infos}
    missing, unexpected = sorted(names - set(sd)), sorted(set(sd) - names)
    if strict and (missing or unexpected):
        raise RuntimeError(f"Gemini load_model: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}; "
                           "pass strict=False to skip them")
    for c in mgr.chunks:
        full = _gather_full(mgr, c, _read_state_shard(mgr, c)[:c.shard_size].contiguous()).clone()
        for info in c.infos:
            if info.name in sd:
                t = sd[info.name]
                if tuple(t.shape) != tuple(info.shape):
                    raise RuntimeError(f"Gemini load_model: {info.name} has shape {tuple(t.shape)} in the "
                                       f"checkpoint but {tuple(info.shape)} in the model")
                full[info.offset:info.end].copy_(t.reshape(-1).float())
        _write_chunk_master(mgr, c, full)
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


def gather_optim_state(optim) -> Dict[str, torch.Tensor]:
    mgr = optim.mgr
    mgr.flush_writes()
    out: Dict[str, torch.Tensor] = {}
    for c in mgr.chunks:
        full = _gather_full(mgr, c, _read_state_shard(mgr, c))
        m, v = full[c.size:2 * c.size], full[2 * c.size:]
        for info in c.infos:
            if not info.param.requires_grad:
                continue
            out[f"state.{info.name}.exp_avg"] = m[info.offset:info.end].view(info.shape).clone()
            out[f"state.{info.name}.exp_avg_sq"] = v[info.offset:info.end].view(info.shape).clone()
            out[f"state.{info.name}.step"] = torch.tensor(float(optim.steps[c.id]))
    return out


def load_optim_state(optim, sd: Dict[str, torch.Tensor]) -> None:
    mgr = optim.mgr
    mgr.flush_writes()
    for c in mgr.chunks:
        full = _gather_full(mgr, c, _read_state_shard(mgr, c)).clone()
        master, m, v = full[:c.size], full[c.size:2 * c.size], full[2 * c.size:]
        for info in c.infos:
            key = f"state.{info.name}.exp_avg"
            if key in sd:
                m[info.offset:info.end].copy_(sd[key].reshape(-1))
                v[info.offset:info.end].copy_(sd[f"state.{info.name}.exp_avg_sq"].reshape(-1))
                optim.steps[c.id] = int(sd[f"state.{info.name}.step"].item())
        _write_chunk_master(mgr, c, master, m, v)


def _groups_json(optim) -> str:
    groups = []
    for g in optim.param_groups:
        groups.append({k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, str, bool, list, tuple, type(None)))})
    return json.dumps({"param_groups": groups, "loss_scale": optim.scale}, indent=2)


class GeminiCheckpointIO(CheckpointIO):
    """``Booster.save_*``/``load_*`` for Gemini-boosted models and optimizers (collective calls)."""

    def __init__(self, group=None):
        self.group = group

    def _writer(self) -> bool:
        return not _dist() or dist.get_rank(self.group) == 0

    def _barrier(self):
        if _dist():
            dist.barrier(self.group)

    @staticmethod
    def _gemini(model):
        from .zero_model import GeminiModel

        m = model
        while not isinstance(m, GeminiModel):
            if hasattr(m, "unwrap") and m.unwrap() is not m:
                m = m.unwrap()
            elif hasattr(m, "module"):
                m = m.module
            else:
                raise TypeError(f"GeminiCheckpointIO: {type(model).__name__} is not a Gemini-boosted model")
        return m

    @staticmethod
    def _gopt(optimizer):
        from .zero_optim import GeminiOptimizer

        o = optimizer
        while not isinstance(o, GeminiOptimizer):
            if hasattr(o, "optim"):
                o = o.optim
            else:
                raise TypeError(f"GeminiCheckpointIO: {type(optimizer).__name__} is not a Gemini optimizer")
        return o

    def save_model(self, model, path, shard: bool = True, size_per_shard: float = 1024) -> None:
        sd = gather_model_state(self._gemini(model))
        if self._writer():
            with atomic_dir(path) as tmp:
                save_state_dict_shards(sd, tmp, size_per_shard=size_per_shard, shard=shard)
        self._barrier()

    def load_model(self, model, path, strict: bool = True) -> None:
        if self._writer():
            recover(path)
        self._barrier()
        load_model_state(self._gemini(model), load_state_dict_shards(path), strict=strict)

    def save_optimizer(self, optimizer, path, model=None, size_per_shard: float = 1024) -> None:
        opt = self._gopt(optimizer)
        sd = gather_optim_state(opt)
        if self._writer():
            with atomic_dir(path) as tmp:
                save_state_dict_shards(sd, tmp, size_per_shard=size_per_shard, prefix="optimizer")
                (Path(tmp) / "param_groups.json").write_text(_groups_json(opt))
        self._barrier()

    def load_optimizer(self, optimizer, path, model=None) -> None:
        opt = self._gopt(optimizer)
        if self._writer():
            recover(path)
        self._barrier()
        load_optim_state(opt, load_state_dict_shards(path, prefix="optimizer"))
        meta = json.loads((Path(path) / "param_groups.json").read_text())
        for g, saved in zip(opt.param_groups, meta["param_groups"]):
            for k, v in saved.items():
                g[k] = tuple(v) if isinstance(g.get(k), tuple) else v
        opt.scale = meta.get("loss_scale", opt.scale)

    def save_lr_scheduler(self, lr_scheduler, path) -> None:
        if self._writer():
            with atomic_file(path) as tmp:
                torch.save(lr_scheduler.state_dict(), tmp)
        self._barrier()

    def load_lr_scheduler(self, lr_scheduler, path) -> None:
        lr_scheduler.load_state_dict(torch.load(path, weights_only=True, map_location="cpu"))
