"""``cl.autoshard`` on transformers models: it searches over the cuts the model's own tensor-parallel plan
allows (each linear the plan's cut, or whole; at the least memory every one it can cut), and its
``tp_plan()`` (transformers' style names) is taken by ``HybridParallelPlugin(tp_size=2, tp_plan=...)``: two
AdamW steps on 2 gloo ranks give the losses of the same steps in one process, within 1e-4 relative. A model
whose plan cuts only Conv1D / packed weights (GPT-2) is refused, naming its own plan."""

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from support import hf  # noqa: E402
from support.dist import run_distributed  # noqa: E402

import colossal_lab as cl  # noqa: E402
from colossal_lab.engine.models.hf.cuts import linear_cuts  # noqa: E402

BATCH, SEQ, STEPS = 2, 16, 2
# Llama with as many key/value heads as heads (its attention reshapes by -1: cut by heads), Qwen2 with
# grouped key/values and OPT (their attention reshapes by fixed head counts, so the search keeps it whole;
# OPT's head count is one the plugin divides once any linear of the attention is cut: none is offered)
MODELS = {"llama_mha": lambda: hf.llama(num_key_value_heads=4), "qwen2_gqa": hf.qwen2,
          "opt": lambda: hf.opt(fixed_key_bias=True)}
MIB = 1 << 20


def _data(vocab: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _tight_plan(name: str):
    """The plan at the least memory autoshard can reach: every linear the model's plan cuts, cut."""
    model = MODELS[name]()
    x = torch.zeros(BATCH, SEQ, dtype=torch.long)
    loose = cl.autoshard(model, (x,), 2)
    least = min(m for m, _ in loose.frontier)
    return cl.autoshard(model, (x,), 2, device_memory=least + 1024, graph=loose.graph)


def _losses(model, data, step):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for x in data:
        loss = model(input_ids=x, labels=x).loss
        step(loss, opt)
        out.append(float(loss))
        opt.step()
        opt.zero_grad()
    return out


def _train(rank, world, plans):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    out = {}
    for name, tp_plan in plans.items():
        model = MODELS[name]()
        booster = Booster(plugin=HybridParallelPlugin(tp_size=2, tp_plan=tp_plan))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt, *_ = booster.boost(model, opt)
        data = _data(256)
        losses = []
        for x in data:
            loss = model(input_ids=x, labels=x).loss
            booster.backward(loss, opt)
            losses.append(float(loss))
            opt.step()
            opt.zero_grad()
        out[name] = losses
    return out


@pytest.fixture(scope="module")
def plans():
    return {name: _tight_plan(name) for name in MODELS}


@pytest.fixture(scope="module")
def trained(plans):
    return run_distributed(_train, 2, {n: p.tp_plan() for n, p in plans.items()}, timeout=600)


@pytest.mark.parametrize("name", list(MODELS))
def test_autoshard_searches_the_cuts_the_hf_plan_allows(plans, name):
    plan, model = plans[name], MODELS[name]()
    cuts = linear_cuts(model)
    kinds = {"column": "col", "column+gather": "col", "row": "row"}
    cut = {n: s for n, s in plan.strategies.items() if s != "replicated"}
    assert cut, plan  # at the least memory, something is cut
    for lin, strategy in cut.items():
        assert lin in cuts and kinds[strategy] == cuts[lin].kind, (lin, strategy, cuts.get(lin))
    # the MLP (and an attention reshaping by -1) cut as the model's plan cuts it; a gathered head may stay whole
    must = {n for n, c in cuts.items() if not c.gather and (name == "llama_mha" or "attn" not in n)}
    assert must and must <= set(cut), (sorted(must - set(cut)), plan)
    styles = plan.tp_plan()
    assert set(styles) == set(cut) and set(styles.values()) <= {"colwise", "rowwise", "rowwise_split_input",
                                                                "colwise_gather_output"}


@pytest.mark.parametrize("name", list(MODELS))
def test_autoshard_plan_trains_under_the_plugin_as_in_one_process(trained, name):
    want = _losses(MODELS[name](), _data(256), lambda loss, opt: loss.backward())
    for rank in range(2):
        got = trained[rank][name]
        assert len(got) == STEPS
        for a, b in zip(got, want):
            assert abs(a - b) <= 1e-4 * abs(b), (name, rank, got, want)


def test_autoshard_refuses_an_hf_model_whose_plan_cuts_no_linear_it_searches():
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel cuts no nn.Linear.*HybridParallelPlugin\(tp_size=2\)"):
        cl.autoshard(hf.gpt2(), (torch.zeros(BATCH, SEQ, dtype=torch.long),), 2)
