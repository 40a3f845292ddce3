"""Gemini: chunk-based ZeRO-3 over a compute-device → host-RAM → NVMe tier stack.

One idea per file: ``chunk`` (flat chunks, tensor states, packing, size search), ``tiers`` (the
ordered stack and its capacities), ``nvme`` (async file IO), ``placement`` (policies → homes),
``memstats`` (warm-up access trace, non-model memory), ``chunk_manager`` (gather/release,
eviction, prefetch, gradient reduction, state blocks, telemetry), ``zero_model``/``zero_optim``
(hooks and the chunked AdamW), ``repack`` (execution-order packing), ``checkpoint`` (files), and
``build.build``, the one entry point. Users reach it through ``GeminiPlugin``; see docs/gemini.md.
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
