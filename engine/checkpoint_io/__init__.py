"""Checkpoint IO: the ``CheckpointIO`` contract, the default implementation, and reusable
pieces (HF-style safetensors shards, atomic directory/file writes) for plugin-specific IOs."""

from .atomic import atomic_dir, atomic_file, commit_dir, recover
from .checkpoint_io_base import CheckpointIO, unwrap_model, unwrap_optimizer
from .general import GeneralCheckpointIO
from .safetensors_shards import (
                                 checkpoint_files,
                                 iter_state_dict_shards,
                                 load_state_dict_shards,
                                 save_state_dict_shards,
                                 shard_plan,
)

__all__ = [
    "CheckpointIO", "GeneralCheckpointIO", "unwrap_model", "unwrap_optimizer",
    "save_state_dict_shards", "load_state_dict_shards", "iter_state_dict_shards",
    "checkpoint_files", "shard_plan", "atomic_dir", "atomic_file", "commit_dir", "recover",
]
