"""Reference models shared by tests, benchmarks and tutorials, and the contract any model may implement."""

from .gpt import GPT, PRESETS, GPTConfig, KVCache
from .protocol import CheckpointRequestContract, ModelConfig, ModelContract, NdTensorParallelContract

__all__ = ["CheckpointRequestContract", "GPT", "GPTConfig", "KVCache", "ModelConfig", "ModelContract",
           "NdTensorParallelContract", "PRESETS"]
