"""The offline stdlib corpus and byte dataset."""

import pytest
import torch

from colossal_lab.engine.data import ByteDataset, decode, encode, split, stdlib_corpus


def test_corpus_is_real_python_and_deterministic():
    a = stdlib_corpus(50_000)
    assert len(a) == 50_000 and a == stdlib_corpus(50_000)
    assert b"def " in a and b"import " in a
    assert stdlib_corpus(1000, subdir="json") != a[:1000]


def test_dataset_windows_shift_by_one():
    toks = encode("abcdefghij")
    ds = ByteDataset(toks, block_size=4)
    assert len(ds) == 2
    item = ds[1]
    assert decode(item["idx"]) == "efgh" and decode(item["targets"]) == "fghi"
    tr, ho = split(encode(stdlib_corpus(10_000)), 0.1)
    assert tr.numel() == 9000 and ho.numel() == 1000 and tr.dtype == torch.long


def test_bad_input():
    with pytest.raises(ValueError, match="subdir"):
        stdlib_corpus(10, subdir="nope_not_here")
    with pytest.raises(ValueError, match="block_size"):
        ByteDataset(encode("abc"), block_size=8)


def test_docs_corpus_is_prose_not_code():
    from colossal_lab.engine.data import stdlib_docs_corpus

    docs = stdlib_docs_corpus(100_000)
    assert len(docs) == 100_000
    assert docs.count(b"the ") > 200 and docs != stdlib_corpus(100_000)
