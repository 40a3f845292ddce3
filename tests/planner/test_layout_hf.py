"""``cl.autoplan`` and ``HybridParallelPlugin.auto`` on transformers models and configs: the layouts
the engine runs for such a model (tensor parallelism where the plan and the heads allow it; pipeline
stages and recomputation only where the plugins take them), a real search on 2 ranks whose choice
trains (the plain HF loop, or execute_pipeline for a pipelined choice), and the refusals."""

import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("ipyparallel")

import torch  # noqa: E402

import colossal_lab as cl  # noqa: E402
from colossal_lab.engine.planner.layout import candidates  # noqa: E402
from colossal_lab.engine.planner.layout.space import can_checkpoint, can_pipeline, model_facts  # noqa: E402


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)


def test_the_layouts_of_an_hf_model_are_those_the_plugins_run():
    cfg = _llama_config()
    meta, layers = model_facts(cfg)
    assert layers == 2 and type(meta).__name__ == "LlamaForCausalLM"
    cands = candidates(cfg, 4, 8)
    # 4 heads, 2 key/value heads: tensor parallelism over 1 or 2 ranks, never 4
    assert {c.tp for c in cands} == {1, 2}
    # stages and recomputation exactly where the engine cuts / recomputes this model
    assert any(c.pp > 1 for c in cands) == can_pipeline(meta)
    assert any(c.activation_checkpointing for c in cands) == can_checkpoint(meta)
    # a model and its config give the same layouts
    from transformers import LlamaForCausalLM

    assert candidates(LlamaForCausalLM(cfg), 4, 8) == cands


def _train_one_step(kw, batch, seq):
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from colossal_lab.engine import Booster
    from colossal_lab.engine.planner.layout import Candidate

    c = Candidate(**kw)
    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config())
    booster = Booster(plugin=c.plugin())
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randint(0, 256, (batch // c.dp, seq), generator=torch.Generator().manual_seed(dist.get_rank()))
    if c.pp == 1:
        loss = model(input_ids=x, labels=x).loss  # the plain HF loop
        booster.backward(loss, opt)
    else:  # the choice depends on measured times: a pipelined layout runs through execute_pipeline
        loss = booster.execute_pipeline(iter([{"input_ids": x, "labels": x}]), model, None, opt)["loss"]
    opt.step()
    return None if loss is None else float(loss)  # None on a rank without the last stage


def test_a_search_on_an_hf_config_runs_its_layouts_and_its_choice_trains(cluster):
    from dataclasses import asdict

    plan = cl.autoplan(_llama_config(), world_size=2, batch=4, seq=32, device_memory=256 << 20, cluster=cluster,
                       reps=1)
    assert plan.best is not None and plan.best in {r["candidate"] for r in plan.rows if r["fits"]}
    ran = [r for r in plan.rows if r["measured_s"] is not None]
    assert ran and all(r["measured_s"] > 0 for r in ran)  # layouts ran for real on the ranks
    assert {1, 2} == {c.tp for c in (r["candidate"] for r in plan.rows)}
    cal = plan.calibration
    assert set(cal["compute"]) == {1, 2} and all(v > 0 for row in cal["compute"].values() for v in row["fb"])
    # the choice depends on measured times: train it, and a fitting layout of the other kind (pipelined or not)
    other = next(r["candidate"] for r in plan.rows if r["fits"] and (r["candidate"].pp > 1) != (plan.best.pp > 1))
    for c in (plan.best, other):
        losses = [v for v in cluster.run(_train_one_step, asdict(c), 4, 32) if v is not None]
        assert losses and all(math.isfinite(v) for v in losses), c.label
    # the plugin's own constructor, from the same search (reused: nothing runs again)
    from colossal_lab.engine.plugins import HybridParallelPlugin

    plugin = HybridParallelPlugin.auto(_llama_config(), batch=4, seq=32, world_size=2, device_memory=256 << 20,
                                       calibration=cal)
    assert (plugin.tp_size, plugin.pp_size) == (plan.best.tp, plan.best.pp)
    # a budget below every layout's peak: nothing is chosen, and asking for the plugin says why
    from transformers import LlamaForCausalLM

    tight = cl.autoplan(LlamaForCausalLM(_llama_config()), world_size=2, batch=4, seq=32, device_memory=1 << 10,
                        calibration=cal)
    assert tight.best is None
    with pytest.raises(ValueError, match="device_memory"):
        tight.plugin()
