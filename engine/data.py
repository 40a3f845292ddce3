"""Offline training text: byte-level corpora made from Python's own standard library.

No model hub, no dataset hub: every machine with Python has its stdlib sources, so tutorials,
tests and benchmarks train on real code text (byte vocabulary of 256, matching the ``tiny``
and ``small`` GPT presets). Files are read in sorted order, so a corpus is the same on every
run of one Python version; ``split`` holds out the tail for evaluation.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch.utils.data import Dataset


def stdlib_corpus(max_bytes: int = 2_000_000, subdir: Optional[str] = None) -> bytes:
    """Up to ``max_bytes`` of ``.py`` sources from the stdlib (optionally one ``subdir``, e.g. ``"json"``)."""
    if max_bytes < 1:
        raise ValueError(f"stdlib_corpus(max_bytes={max_bytes}): must be >= 1")
    root = sysconfig.get_paths()["stdlib"]
    if subdir is not None:
        root = os.path.join(root, subdir)
        if not os.path.isdir(root):
            raise ValueError(f"stdlib_corpus(subdir={subdir!r}): no such stdlib folder {root!r}")
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), "rb") as f:
                data = f.read()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(chunks)[:max_bytes]
    if not chunks:
        raise RuntimeError(f"stdlib_corpus: no .py files under {root!r}")
    return b"".join(chunks)[:max_bytes]


def encode(text: str | bytes) -> torch.Tensor:
    """Bytes → token ids (int64), the byte-level 'tokenizer'."""
    if isinstance(text, str):
        text = text.encode("utf-8")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def decode(ids) -> str:
    """Token ids → text (invalid UTF-8 replaced)."""
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@dataclass
class ByteDataset(Dataset):
    """Fixed windows of ``block_size + 1`` bytes: ``{"idx": x, "targets": y}`` with y = x shifted;
    ``stride`` defaults to ``block_size`` (non-overlapping windows: an epoch sees each byte once)."""

    tokens: torch.Tensor
    block_size: int
    stride: Optional[int] = None

    def __post_init__(self):
        self.stride = self.stride or self.block_size
        if self.tokens.numel() < self.block_size + 1:
            raise ValueError(
                f"ByteDataset: {self.tokens.numel()} tokens is fewer than block_size+1={self.block_size + 1}"
            )

    def __len__(self) -> int:
        return (self.tokens.numel() - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> dict:
        s = i * self.stride
        w = self.tokens[s:s + self.block_size + 1]
        return {"idx": w[:-1], "targets": w[1:]}


def split(tokens: torch.Tensor, holdout: float = 0.1) -> Tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) with the last ``holdout`` fraction held out."""
    if not 0 < holdout < 1:
        raise ValueError(f"split(holdout={holdout}): must be in (0, 1)")
    n = int(tokens.numel() * (1 - holdout))
    return tokens[:n], tokens[n:]


def stdlib_docs_corpus(max_bytes: int = 2_000_000) -> bytes:
    """Up to ``max_bytes`` of English prose, the Python reference's help topics (``pydoc_data``):
    a domain other than :func:`stdlib_corpus`'s code, which the fine-tuning tutorial adapts to."""
    if max_bytes < 1:
        raise ValueError(f"stdlib_docs_corpus(max_bytes={max_bytes}): must be >= 1")
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return text.encode("utf-8")[:max_bytes]
