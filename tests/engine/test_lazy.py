"""Lazy init: meta build with no memory, module-by-module materialisation by init or by loader."""

import pytest
import torch
import torch.nn as nn

from colossal_lab.engine.lazy import is_lazy, lazy_init, materialize, meta_names
from colossal_lab.engine.models import GPT, GPTConfig


def tiny(**kw):
    return GPTConfig.preset("tiny", **kw)


def test_meta_build_holds_no_storage():
    with lazy_init():
        m = GPT(GPTConfig.preset("124m"))  # 124M params, built instantly with no memory
    assert is_lazy(m)
    assert all(p.is_meta for p in m.parameters())
    assert m.num_params() > 100_000_000


def test_materialise_by_init_matches_the_model_init_recipe():
    with lazy_init():
        m = GPT(tiny(n_layer=4))
    materialize(m, "cpu")
    assert not is_lazy(m) and meta_names(m) == []
    ref = GPT(tiny(n_layer=4))
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        if "norm" in n:
            assert torch.equal(p, torch.ones_like(p)), n
        else:  # normal(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer)
            assert abs(p.std().item() - q.std().item()) < 0.15 * q.std().item(), n
            assert abs(p.mean().item()) < 3e-3, n
    assert torch.equal(m.rope_cos, ref.rope_cos) and torch.equal(m.rope_sin, ref.rope_sin)
    logits, loss = m(torch.randint(0, 256, (1, 8)), torch.randint(0, 256, (1, 8)))
    assert torch.isfinite(loss)


def test_materialise_from_loader_reproduces_the_model():
    torch.manual_seed(0)
    src = GPT(tiny()).eval()
    sd = src.state_dict()
    with lazy_init():
        m = GPT(tiny())
    seen = []
    materialize(m, "cpu", state_dict_loader=lambda n: (seen.append(n), sd.get(n))[1])
    assert set(seen) >= set(sd)  # every persistent tensor came through the loader
    idx = torch.randint(0, 256, (2, 12))
    torch.testing.assert_close(m.eval()(idx)[0], src(idx)[0], rtol=0, atol=0)


def test_partial_materialisation_keeps_tied_weights_tied():
    with lazy_init():
        m = GPT(tiny(tie_embeddings=True))
    materialize(m, "cpu", only=lambda name: name == "tok_emb" or name.startswith("blocks.0"))
    assert not m.tok_emb.weight.is_meta and m.blocks["1"].attn.wq.weight.is_meta
    assert m.lm_head.weight.is_meta  # not materialised yet, but ...
    materialize(m, "cpu")
    assert m.lm_head.weight is m.tok_emb.weight  # ... the same storage when it is
    assert not is_lazy(m)


def test_bad_input():
    with lazy_init():
        m = GPT(tiny())
    with pytest.raises(ValueError, match="device='meta'"):
        materialize(m, "meta")
    with pytest.raises(ValueError, match=r"'rope_cos' has shape \(3,\), model expects \(64, 16\)"):
        materialize(m, "cpu", state_dict_loader=lambda n: torch.zeros(3))

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(3))

    with lazy_init():
        odd = Odd()
    with pytest.raises(ValueError, match="no init rule for module '<root>'.*init_fn"):
        materialize(odd)
    materialize(odd, init_fn=lambda name, mod: nn.init.constant_(mod.w, 2.0))
    assert torch.equal(odd.w, torch.full((3,), 2.0))
