"""Gemini checkpoints: full, name-keyed tensors in HF-style safetensors, whatever the placement.

The gathering and loading are ``GeminiModel``'s and ``GeminiOptimizer``'s ``state_dict`` /
``load_state_dict``; this file only writes and reads the files (``model*.safetensors``,
``optimizer*.safetensors`` + ``param_groups.json``), atomically. See docs/gemini.md, ``checkpoint.py`` row.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint_io import GeneralCheckpointIO, atomic_dir, load_state_dict_shards, recover, save_state_dict_shards
from ..checkpoint_io.hf import load_hf, save_hf
from .zero_model import GeminiModel
from .zero_optim import GeminiOptimizer


def _groups_json(optim: GeminiOptimizer) -> str:
    groups = []
    for g in optim.param_groups:
        groups.append({k: v for k, v in g.items()
                       if k != "params" and isinstance(v, (int, float, str, bool, list, tuple, type(None)))})
    scaler = optim.loss_scaler.state_dict() if optim.loss_scaler is not None else None
    return json.dumps({"param_groups": groups, "loss_scaler": scaler}, indent=2)


class GeminiCheckpointIO(GeneralCheckpointIO):
    """``Booster.save_*``/``load_*`` for Gemini-boosted models and optimizers (collective calls);
    the LR scheduler's file, the writer rank and the barrier are the general IO's."""

    @staticmethod
    def _gemini(model) -> GeminiModel:
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
    def _gopt(optimizer) -> GeminiOptimizer:
        o = optimizer
        while not isinstance(o, GeminiOptimizer):
            if hasattr(o, "optim"):
                o = o.optim
            else:
                raise TypeError(f"GeminiCheckpointIO: {type(optimizer).__name__} is not a Gemini optimizer")
        return o

    def _hf_view(self, model):
        """The chunk-by-chunk view of a transformers model (``hf_view.py``), or None for others."""
        from ..models.hf import is_hf_model
        from .hf_view import GeminiView

        g = self._gemini(model)
        return GeminiView(g) if is_hf_model(g.module) else None

    def save_model(self, model, path, shard: bool = True, size_per_shard: float = 1024) -> None:
        view = self._hf_view(model)
        if view is not None:  # transformers' layout, one chunk whole at a time
            save_hf(view, path, size_per_shard=size_per_shard, shard=shard)
            return
        sd = self._gemini(model).state_dict()
        if self._is_writer():
            with atomic_dir(path) as tmp:
                save_state_dict_shards(sd, tmp, size_per_shard=size_per_shard, shard=shard)
        self._barrier()

    def load_model(self, model, path, strict: bool = True) -> None:
        view = self._hf_view(model)
        if view is not None:  # each rank reads its shard's bytes of each tensor
            load_hf(view, path, strict=strict)
            return
        if self._is_writer():
            recover(path)
        self._barrier()
        self._gemini(model).load_state_dict(load_state_dict_shards(path), strict=strict)

    def save_optimizer(self, optimizer, path, model=None, size_per_shard: float = 1024) -> None:
        opt = self._gopt(optimizer)
        sd = opt.state_dict()
        if self._is_writer():
            with atomic_dir(path) as tmp:
                save_state_dict_shards(sd, tmp, size_per_shard=size_per_shard, prefix="optimizer")
                (Path(tmp) / "param_groups.json").write_text(_groups_json(opt))
        self._barrier()

    def load_optimizer(self, optimizer, path, model=None) -> None:
        opt = self._gopt(optimizer)
        if self._is_writer():
            recover(path)
        self._barrier()
        opt.load_state_dict(load_state_dict_shards(path, prefix="optimizer"))
        meta = json.loads((Path(path) / "param_groups.json").read_text())
        for g, saved in zip(opt.param_groups, meta["param_groups"]):
            for k, v in saved.items():
                g[k] = tuple(v) if isinstance(g.get(k), tuple) else v
        # the scaler's whole state where the file has one; else the scale alone (a file written
        # without a scaler, or one holding only ``loss_scale``)
        if opt.loss_scaler is not None:
            opt.loss_scaler.load_state_dict(meta.get("loss_scaler") or {"scale": meta.get("loss_scale", opt.scale)})
