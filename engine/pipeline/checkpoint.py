"""Checkpoints of a hybrid-parallel model under the *unsplit* model's names.

Save gathers the whole model (DTensor shards made whole with ``full_tensor``; each pipeline
stage contributes its own parameters) and rank 0 writes HF-style safetensors shards through
the shared :class:`GeneralCheckpointIO`, so a checkpoint from ``pp=2 × tp=2`` loads into a
plain ``GPT`` and back into any other layout. Load reads the full state dict and copies each
rank's slice in (``distribute_tensor`` for DTensor parameters). Optimizer state uses the base
class (torch.distributed.checkpoint), unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..checkpoint_io import GeneralCheckpointIO, load_state_dict_shards


class HybridCheckpointIO(GeneralCheckpointIO):
    def full_model_state_dict(self, model) -> dict:
        return model.full_state_dict()

    @torch.no_grad()
    def load_model(self, model, path, strict: bool = True) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        sd = load_state_dict_shards(path)
        seen = set()
        for mod in model.stage_modules:
            for name, t in mod.inner.state_dict().items():
                if name not in sd:
                    if strict:
                        raise RuntimeError(f"load_model({path}): missing key {name!r}; pass strict=False to skip it")
                    continue
                seen.add(name)
                src = sd[name].to(dtype=t.dtype)
                if isinstance(t, DTensor):
                    t.copy_(distribute_tensor(src.to(t.device), t.device_mesh, t.placements))
                else:
                    t.copy_(src)
        if dist.is_initialized():
            dist.barrier()
