"""The reference GPT: shapes, loss, tied weights, KV-cache decoding, pipeline split, TP plan."""

import pytest
import torch

from colossal_lab.engine.models import GPT, GPTConfig


def tiny(**kw):
    return GPTConfig.preset("tiny", **kw)


def test_forward_shapes_and_loss():
    torch.manual_seed(0)
    m = GPT(tiny())
    idx = torch.randint(0, 256, (2, 16))
    logits, loss = m(idx)
    assert logits.shape == (2, 16, 256) and loss is None
    _, loss = m(idx, idx)
    # untrained: loss near ln(vocab)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5


def test_tie_embeddings_shares_the_weight():
    m = GPT(tiny(tie_embeddings=True))
    assert m.lm_head.weight is m.tok_emb.weight
    assert GPT(tiny()).lm_head.weight is not GPT(tiny()).tok_emb.weight


def test_kv_cache_matches_full_recompute():
    torch.manual_seed(0)
    m = GPT(tiny()).eval()
    idx = torch.randint(0, 256, (1, 5))
    a = m.generate(idx, 10, temperature=0, use_cache=True)
    b = m.generate(idx, 10, temperature=0, use_cache=False)
    assert torch.equal(a, b)


def test_activation_checkpointing_same_grads():
    torch.manual_seed(0)
    m1 = GPT(tiny())
    m2 = GPT(tiny(activation_checkpointing=True))
    m2.load_state_dict(m1.state_dict())
    idx = torch.randint(0, 256, (2, 16))
    m1(idx, idx)[1].backward()
    m2(idx, idx)[1].backward()
    for (n, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(p1.grad, p2.grad, msg=n)


def test_pipeline_stages_compose_to_the_full_model():
    torch.manual_seed(0)
    m = GPT(tiny(n_layer=4))
    idx = torch.randint(0, 256, (2, 8))
    full, _ = m(idx)
    stages = [m.pipeline_stage(i, 2) for i in range(2)]
    h, _ = stages[0](idx)
    out, _ = stages[1](h)
    torch.testing.assert_close(out, full)
    names = set(m.state_dict())
    assert set(stages[0].state_dict()) | set(stages[1].state_dict()) == names
    assert "tok_emb.weight" in stages[0].state_dict() and "lm_head.weight" in stages[1].state_dict()
    # each copy knows its stage (a checkpoint plan made on it reports that stage)
    assert [s.stage_index for s in stages] == [0, 1] and not hasattr(m, "stage_index")


def test_split_error_names_valid_choices():
    with pytest.raises(ValueError, match=r"n_layer=4 cannot be split evenly into 3.*\[1, 2, 4\]"):
        GPT(tiny(n_layer=4)).split_points(3)


def test_bad_config():
    with pytest.raises(ValueError, match="n_embd=65 must be divisible by n_head=2"):
        GPTConfig(n_embd=65, n_head=2)
    with pytest.raises(ValueError, match="unknown preset"):
        GPTConfig.preset("huge")
