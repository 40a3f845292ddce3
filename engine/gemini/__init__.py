"""Gemini: chunk-based ZeRO-3 over a compute-device → host-RAM → NVMe tier stack.

One idea per file (docs/gemini.md, "How it works"); ``build.build`` is the one entry point, which
users reach through ``GeminiPlugin``.
"""

from .chunk import Chunk, TensorInfo, TensorState, search_chunk_size
from .chunk_manager import ChunkManager
from .nvme import NVMeStore
from .placement import POLICIES, PlacementConfig
from .tiers import Tier, TierStack
from .zero_model import GeminiModel
from .zero_optim import GeminiOptimizer

__all__ = ["Chunk", "TensorInfo", "TensorState", "search_chunk_size", "ChunkManager", "NVMeStore",
           "POLICIES", "PlacementConfig", "Tier", "TierStack", "GeminiModel", "GeminiOptimizer"]
