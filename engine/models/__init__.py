"""Reference models shared by tests, benchmarks and tutorials."""

from .gpt import GPT, PRESETS, GPTConfig, KVCache

__all__ = ["GPT", "GPTConfig", "KVCache", "PRESETS"]
