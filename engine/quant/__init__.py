"""Int8 inference: weight-only quantization, lazy quantized loading, tensor-parallel serving.

``quantize(model, "int8")`` — in place, per output channel, symmetric (:mod:`.int8`);
``load_quantized(cfg, path)`` — meta build + shard-by-shard load and quantise (:mod:`.loading`);
``shard_int8_tp(model)`` — tensor-parallel int8 across ranks (:mod:`.tp`).
Generation is the model's own ``GPT.generate`` (KV cache) — quantized layers are drop-ins.
"""

from .int8 import MODES, Int8Embedding, Int8Linear, model_bytes, quantize, quantize_weight
from .loading import ShardReader, load_quantized
from .tp import RowParallelInt8Linear, shard_int8_tp

__all__ = ["MODES", "Int8Embedding", "Int8Linear", "RowParallelInt8Linear", "ShardReader", "load_quantized",
           "model_bytes", "quantize", "quantize_weight", "shard_int8_tp"]
