"""The default checkpoint IO: full model in safetensors shards, optimizer through DCP.

torch.distributed.checkpoint's state-dict helpers already know plain modules, DDP and FSDP2 and
make DTensor shards whole, so one code path serves no plugin, DDP, ZeRO-1 and ZeRO-2. The files,
and why flattened optimizer keys reshard N -> M: docs/engine.md, "Checkpoints".
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .. import comm
from .atomic import atomic_dir, atomic_file, recover
from .checkpoint_io_base import CheckpointIO, PathLike, unwrap_model, unwrap_optimizer
from .hf import hf_module, load_hf, save_hf
from .hf_layout import ModuleView
from .safetensors_shards import _prepare, load_state_dict_shards, save_state_dict_shards


class GeneralCheckpointIO(CheckpointIO):
    """``group``: the ranks that hold replicas/shards of the model (None = world)."""

    def __init__(self, group: Optional["dist.ProcessGroup"] = None):
        self.group = group

    def _is_writer(self) -> bool:
        return not comm.initialized() or dist.get_rank(self.group) == 0

    def _barrier(self) -> None:
        if comm.initialized():
            comm.barrier(self.group)

    # ---- model ---------------------------------------------------------------------------
    def full_model_state_dict(self, model) -> dict:
        """Full CPU state dict (a collective for sharded models; empty off the writer rank)."""
        module = unwrap_model(model)
        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save_model(self, model, path: PathLike, shard: bool = True, size_per_shard: float = 1024) -> None:
        hf = hf_module(model)
        if hf is not None:  # transformers' layout, which from_pretrained loads (hf.py)
            save_hf(ModuleView(hf), path, size_per_shard=size_per_shard, shard=shard)
            return
        if str(path).endswith(".safetensors") and shard:
            raise ValueError(f"save_model(path={str(path)!r}, shard=True): shards need a directory; "
                             "pass a directory path, or shard=False to write this one file")
        sd = self.full_model_state_dict(model)
        if self._is_writer():
            if str(path).endswith(".safetensors"):  # one file at exactly this path
                with atomic_file(path) as tmp:
                    save_file(_prepare(sd), str(tmp), metadata={"format": "pt"})
            else:
                with atomic_dir(path) as tmp:
                    save_state_dict_shards(sd, tmp, size_per_shard=size_per_shard, shard=shard)
        self._barrier()

    def load_model(self, model, path: PathLike, strict: bool = True) -> None:
        hf = hf_module(model)
        if hf is not None:  # each rank reads only its own part (hf.py)
            load_hf(ModuleView(hf), path, strict=strict)
            return
        module = unwrap_model(model)
        sd = load_state_dict_shards(path)
        want = set(get_model_state_dict(module).keys())
        missing, unexpected = want - set(sd), set(sd) - want
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_model({path}): missing keys {sorted(missing)[:8]}, "
                               f"unexpected keys {sorted(unexpected)[:8]}; pass strict=False to skip them")
        set_model_state_dict(module, sd, options=StateDictOptions(full_state_dict=True, strict=False))

    # ---- optimizer -----------------------------------------------------------------------
    _OPTS = StateDictOptions(flatten_optimizer_state_dict=True)

    def _targets(self, optimizer, model):
        optim, owner = unwrap_optimizer(optimizer)
        owner = unwrap_model(model) if model is not None else owner
        if owner is None:
            raise ValueError("save/load_optimizer: a plain torch optimizer needs model=...; "
                             "or pass the optimizer returned by booster.boost()")
        return optim, owner

    def save_optimizer(self, optimizer, path: PathLike, model=None) -> None:
        optim, module = self._targets(optimizer, model)
        if hasattr(optimizer, "sync_param_groups"):
            optimizer.sync_param_groups()
        osd = get_optimizer_state_dict(module, optim, options=self._OPTS)
        state = {"optimizer": osd}
        scaler = getattr(optimizer, "loss_scaler", None)
        if scaler is not None:  # fp16: resume with the scale reached, not 2**16 again
            state["loss_scaler"] = {k: torch.tensor(float(v)) for k, v in scaler.state_dict().items()}
        with atomic_dir(path, group=self.group, collective=True) as tmp:
            if comm.initialized():
                dcp.save(state, checkpoint_id=str(tmp), process_group=self.group)
            else:
                with warnings.catch_warnings():  # "assuming single process": that is the intent
                    warnings.simplefilter("ignore", UserWarning)
                    dcp.save(state, checkpoint_id=str(tmp), no_dist=True)

    def load_optimizer(self, optimizer, path: PathLike, model=None) -> None:
        optim, module = self._targets(optimizer, model)
        path = recover(path) if self._is_writer() else Path(path)
        self._barrier()
        if hasattr(optimizer, "sync_param_groups"):
            optimizer.sync_param_groups()
        # The template initialises empty state (a zero-lr step) so DCP knows shapes and keys.
        osd = get_optimizer_state_dict(module, optim, options=self._OPTS)
        saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        # HybridParallelPlugin writes the same flattened keys at the top level (no "optimizer." prefix):
        # its checkpoints resume here too, in one process or under DDP / ZeRO
        top = not any(k.startswith("optimizer.") for k in saved)
        missing = [k for k in osd if ("" if top else "optimizer.") + k not in saved]
        lost_state = [k for k in missing if not k.startswith("param_groups.")]
        if lost_state:
            raise RuntimeError(f"load_optimizer({path}): the checkpoint has no optimizer state for "
                               f"{lost_state[:5]}...; was it saved from the same model and optimizer type?")
        # a hyper-parameter the checkpoint lacks (e.g. initial_lr: scheduler added since) keeps
        # its current value
        kept = {k: osd.pop(k) for k in missing}
        state = dict(osd) if top else {"optimizer": osd}
        scaler = getattr(optimizer, "loss_scaler", None)
        if scaler is not None and "loss_scaler.scale" in saved:
            state["loss_scaler"] = {k: torch.tensor(0.0) for k in scaler.state_dict()}
        if comm.initialized():
            dcp.load(state, checkpoint_id=str(path), process_group=self.group)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(state, checkpoint_id=str(path), no_dist=True)
        scaled = state.pop("loss_scaler", None)
        set_optimizer_state_dict(module, optim, {**(state if top else state["optimizer"]), **kept},
                                 options=self._OPTS)
        if scaled is not None:
            scaler.load_state_dict({k: v.item() for k, v in scaled.items()})
        if hasattr(optimizer, "after_load"):
            optimizer.after_load()

    # ---- LR scheduler --------------------------------------------------------------------
    def save_lr_scheduler(self, lr_scheduler, path: PathLike) -> None:
        if self._is_writer():
            with atomic_file(path) as tmp:
                torch.save(lr_scheduler.state_dict(), tmp)
        self._barrier()

    def load_lr_scheduler(self, lr_scheduler, path: PathLike) -> None:
        lr_scheduler.load_state_dict(torch.load(path, weights_only=True, map_location="cpu"))
