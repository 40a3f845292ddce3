"""Checkpoints of a hybrid-parallel model and optimizer under the *unsplit* model's names.

Model: gathered whole (DTensor shards made whole, each stage its own parameters, every EP group its
experts) and written by world rank 0 through :class:`GeneralCheckpointIO`; loaded by copying each
rank's slice in, read with safetensors' ``get_slice`` where it is rows of the file's tensor (an
expert-parallel rank reads only its own experts' bytes), so it loads at any ep_size. Optimizer:
DCP, keyed by hand by the unsplit model's parameter names (torch's helper would key by each rank's
stage wrapper, so stages would collide), N-d blocks and expert slices saved whole, which makes it load
into any layout. Key scheme and guarantees: docs/hybrid.md, "Checkpoints".
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .. import comm
from ..checkpoint_io import GeneralCheckpointIO, atomic_dir, recover
from ..checkpoint_io.hf import load_hf, save_hf


def _targets(optimizer, model):
    if not hasattr(optimizer, "checkpoint_target"):
        raise TypeError("HybridCheckpointIO.save/load_optimizer: pass the optimizer returned by "
                        "booster.boost() with HybridParallelPlugin")
    optim, owner = optimizer.checkpoint_target()
    return optim, (model if model is not None else owner)


def _local(optim):
    """The torch optimizer holding this rank's state (ZeRO-1: its partition's local optimizer)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optim.optim if isinstance(optim, ZeroRedundancyOptimizer) else optim


def _cut(model, p, name: str, v) -> Optional[str]:
    """How optimizer state ``v`` of parameter ``p`` is cut on this rank: ``"nd"`` (a block of an N-d
    (2D/2.5D/3D) layout), ``"ep"`` (this EP rank's experts, rows of the grouped weight) or None (whole)."""
    if not isinstance(v, torch.Tensor) or v.shape != p.shape:
        return None
    nd, ex = getattr(model, "nd", None), getattr(model, "experts", None)
    if nd is not None and name in nd.params:
        return "nd"
    return "ep" if ex is not None and id(p) in ex.params else None


def _whole(model, cut: Optional[str], name: str, v):
    """State ``v`` made whole for the file (a collective over the tp or EP group)."""
    return model.nd.full(name, v) if cut == "nd" else model.experts.full(v) if cut == "ep" else v


def _whole_shape(model, cut: Optional[str], name: str, v) -> tuple:
    if cut == "nd":
        return model.nd.full_shape(name)
    return model.experts.full_shape(v) if cut == "ep" else tuple(getattr(v, "shape", ()))


def _mine(model, cut: Optional[str], name: str, v, whole):
    """This rank's part of a whole state tensor read from the file."""
    if cut == "nd":
        return model.nd.block(name, whole)
    if cut == "ep":
        lo, hi = model.experts.rows(v)
        return whole[lo:hi]
    return whole


def _names(model) -> Dict[int, List[str]]:
    out: Dict[int, List[str]] = {}
    for n, p in model.named_model_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(n)
    return out


def _hf_view(model):
    """A view of the transformers model a hybrid model runs (``checkpoint_io/hf_layout.py``; under a
    pipeline, of every stage: ``checkpoint_io/hf_stages.py``, a collective; under 2D/2.5D/3D, of its
    grid blocks: ``checkpoint_io/hf_nd.py``), or None."""
    from ..checkpoint_io.hf_layout import ModuleView
    from ..checkpoint_io.hf_nd import NdView
    from ..checkpoint_io.hf_stages import StagesView
    from ..models.hf import is_hf_model

    inners = [m.inner for m in getattr(model, "stage_modules", [])]
    if not inners or not is_hf_model(inners[0]):
        return None
    if len(inners) > 1 or getattr(model, "_plugin_pp", 1) > 1:
        return StagesView(inners)
    nd = getattr(model, "nd", None)
    if nd is None and getattr(model, "experts", None) is not None:  # EP: expert rows (models/hf/moe.py)
        from ..models.hf.moe import checkpoint_view

        return checkpoint_view(inners[0], model.experts)
    return ModuleView(inners[0]) if nd is None else NdView(inners[0], nd)


class HybridCheckpointIO(GeneralCheckpointIO):
    def full_model_state_dict(self, model) -> dict:
        return model.full_state_dict()

    def save_model(self, model, path, shard: bool = True, size_per_shard: float = 1024) -> None:
        view = _hf_view(model)
        if view is None:
            return super().save_model(model, path, shard=shard, size_per_shard=size_per_shard)
        save_hf(view, path, size_per_shard=size_per_shard, shard=shard)

    @torch.no_grad()
    def load_model(self, model, path, strict: bool = True) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        from ..checkpoint_io.hf_files import HFReader

        view = _hf_view(model)
        if view is not None:  # each rank reads only its slice of each tensor
            load_hf(view, path, strict=strict)
            return
        reader = HFReader(recover(path))  # the same file layout; get_slice reads only the rows asked for
        saved = set(reader.names())
        nd = getattr(model, "nd", None)  # tp_mode 2d/2.5d/3d: parameters are blocks of the full tensors
        ex = getattr(model, "experts", None)  # ep_size > 1: grouped expert weights hold E / ep experts
        for mod in model.stage_modules:
            for name, t in mod.inner.state_dict().items():
                if name not in saved:
                    if strict:
                        raise RuntimeError(f"load_model({path}): missing key {name!r}; pass strict=False to skip it")
                    continue
                blocked = nd is not None and name in nd.params
                expert = ex is not None and name in ex.names
                shape = nd.full_shape(name) if blocked else ex.full_shape(t) if expert else tuple(t.shape)
                if reader.shape(name) != shape:
                    raise RuntimeError(f"load_model({path}): {name!r} has shape {reader.shape(name)} in the "
                                       f"checkpoint but {shape} in the model; was it saved from the "
                                       "same model configuration?")
                if expert:  # this rank's experts only: rows [lo, hi) of the whole grouped weight
                    lo, hi = ex.rows(t)
                    src = reader.read_runs(name, [[(lo, hi)]] + [[(0, n)] for n in shape[1:]])
                else:
                    src = reader.read(name)
                src = (nd.block(name, src) if blocked else src).to(dtype=t.dtype)
                if isinstance(t, DTensor):
                    t.copy_(distribute_tensor(src.to(t.device), t.device_mesh, t.placements))
                else:
                    t.copy_(src)
        self.bytes_read = reader.bytes_read  # what this rank read from the files (the MoE test checks it)
        if comm.initialized():
            comm.barrier()

    # ---- optimizer ---------------------------------------------------------------------
    def save_optimizer(self, optimizer, path, model=None) -> None:
        optim, model = _targets(optimizer, model)
        local, names = _local(optim), _names(model)
        sd: dict = {}
        for g in optim.param_groups:  # the global (non-ZeRO) view of the hyper-parameters
            hp = {k: v for k, v in g.items() if k != "params"}
            for n in (n for p in g["params"] for n in names.get(id(p), [])):
                for k, v in hp.items():  # one leaf per hyper-parameter (DCP pickles non-tensors)
                    sd[f"param_groups.{n}.{k}"] = v
        for p in (p for g in local.param_groups for p in g["params"]):
            for n in names[id(p)]:
                for k, v in local.state.get(p, {}).items():
                    # N-d blocks and expert slices saved whole (a collective over the tp / EP group: under
                    # ZeRO-1 the ranks of an EP group own the same parameters' state, their expert-dp
                    # groups being partitioned alike)
                    sd[f"state.{n}.{k}"] = _whole(model, _cut(model, p, n, v), n, v)
        scaler = getattr(optimizer, "loss_scaler", None)
        if scaler is not None:
            sd.update({f"loss_scaler.{k}": torch.tensor(float(v)) for k, v in scaler.state_dict().items()})
        with atomic_dir(path, group=None, collective=True) as tmp:
            dcp.save(sd, checkpoint_id=str(tmp), no_dist=not comm.initialized())

    def load_optimizer(self, optimizer, path, model=None) -> None:
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        optim, model = _targets(optimizer, model)
        path = recover(path) if not comm.initialized() or dist.get_rank() == 0 else Path(path)
        if comm.initialized():
            comm.barrier()
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        local, names = _local(optim), _names(model)
        has_state = any(k.startswith("state.") for k in saved)
        if has_state:
            _init_optim_state(local)  # a zero-lr step: state tensors of the right shapes/placements
        want: dict = {}
        saved_name: Dict[int, str] = {}
        error = None
        hint = ("hybrid optimizer checkpoints load into any pp/tp (1D, 2D, 2.5D, 3D)/dp/ZeRO-1 layout of the same "
                "model and optimizer type, and into one process (booster without a plugin)")
        for p in (p for g in optim.param_groups for p in g["params"]):
            # a tied weight is saved under each name its stages use; read whichever exists
            n = next((n for n in names[id(p)] if any(k.startswith(f"param_groups.{n}.") for k in saved)), None)
            if n is None:
                error = error or (f"load_optimizer({path}): the checkpoint has nothing for parameter "
                                  f"{names[id(p)][0]!r}; {hint}. Was it saved from another model?")
                continue
            saved_name[id(p)] = n
            for k in saved:
                if k.startswith(f"param_groups.{n}.") and "." not in k[len(f"param_groups.{n}."):]:
                    want[k] = None
        for p in (p for g in local.param_groups for p in g["params"]):
            if id(p) not in saved_name:
                continue
            for k, v in local.state.get(p, {}).items():
                key = f"state.{saved_name[id(p)]}.{k}"
                size = getattr(saved.get(key), "size", None)
                cut = _cut(model, p, names[id(p)][0], v)
                shape = _whole_shape(model, cut, names[id(p)][0], v)
                if key not in saved:
                    error = error or (f"load_optimizer({path}): no {key!r} in the checkpoint ({type(local).__name__} "
                                      f"state has {sorted(local.state[p])}); {hint}")
                elif isinstance(v, torch.Tensor) and size is not None and tuple(size) != shape:
                    error = error or (f"load_optimizer({path}): {key!r} has shape {tuple(size)} in the checkpoint "
                                      f"but {shape} here; {hint}")
                else:  # N-d / ep: read whole, this rank's block or experts copied in below
                    want[key] = v.new_empty(shape) if cut else v
        # every rank learns of any rank's error before the collective load (else peers would hang)
        if comm.initialized():
            errors = [None] * dist.get_world_size()
            comm.all_gather_object(errors, error)
            error = next((e for e in errors if e), None)
        if error:
            raise RuntimeError(error)
        scaler = getattr(optimizer, "loss_scaler", None)
        if scaler is not None and "loss_scaler.scale" in saved:
            want.update({k: torch.tensor(0.0) for k in saved if k.startswith("loss_scaler.")})
        dcp.load(want, checkpoint_id=str(path), no_dist=not comm.initialized())
        # tensors were loaded in place into the live state; non-tensor leaves come back new
        for p in (p for g in local.param_groups for p in g["params"]):
            st = local.state.get(p, {})
            for k in list(st):
                v = want[f"state.{saved_name[id(p)]}.{k}"]
                cut = _cut(model, p, names[id(p)][0], st[k])
                if cut:
                    st[k].copy_(_mine(model, cut, names[id(p)][0], st[k], v))
                elif v is not st[k]:
                    st[k] = v
        if not has_state:
            local.state.clear()
        for g in optim.param_groups:  # hyper-parameters (lr, initial_lr, ...) as saved
            n = saved_name[id(g["params"][0])] if g["params"] else None
            if n is not None:
                pre = f"param_groups.{n}."
                g.update({k[len(pre):]: v for k, v in want.items() if k.startswith(pre)})
        if "loss_scaler.scale" in want:
            scaler.load_state_dict({k[len("loss_scaler."):]: v.item() for k, v in want.items()
                                    if k.startswith("loss_scaler.")})
