"""``cl.plan`` on transformers models and configs: each plugin's predicted peak per rank and tier
against a real run of the plain HF loop (``model(input_ids=x, labels=x).loss``; under a pipeline
``execute_pipeline`` with HF batches and the model's own loss) on 2 gloo ranks,
within the 10% the GPT's plans keep (``test_memory.py``); an HF config plans as its model does; the
tensor-parallel plugin's refusals come before any work, word for word. In the same world a tiny Mixtral under
``HybridParallelPlugin(ep_size=2)`` (routing balanced over the EP pair by a router hook) holds on each rank the
parameter, gradient and optimizer-state bytes the plan gives it, and sends the all-to-all bytes it plans."""

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from support import hf  # noqa: E402
from support.dist import run_distributed  # noqa: E402

import colossal_lab as cl  # noqa: E402
from colossal_lab.engine.plugins import (  # noqa: E402
    DDPPlugin,
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
)

MIB = 1 << 20
BATCH, SEQ, STEPS, WORLD = 2, 64, 3, 2
PLUGINS = {
    "ddp": DDPPlugin,
    "zero2": lambda: LowLevelZeroPlugin(stage=2),
    "gemini_cpu": lambda: GeminiPlugin(placement_policy="cpu", precision="fp32", chunk_size_mb=2),
    "tp2": lambda: HybridParallelPlugin(tp_size=2),
    "tp2_ac": lambda: HybridParallelPlugin(tp_size=2, activation_checkpointing=True),
    "pp2": lambda: HybridParallelPlugin(pp_size=2, num_microbatches=2),
    # a LoRA model (peft) under Gemini: its frozen base chunks keep their fp32 master only (no moments, no
    # gradients), which the plan must count as the chunks hold them
    "gemini_lora": lambda: GeminiPlugin(placement_policy="cpu", precision="fp32", chunk_size_mb=2),
}


def _lora_config():
    import peft

    return peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])


def _config(family: str):
    from transformers import GPT2Config, LlamaConfig

    if family == "llama":
        return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=4, vocab_size=2048, max_position_embeddings=128)
    return GPT2Config(n_embd=256, n_layer=4, n_head=8, vocab_size=2048, n_positions=128, bos_token_id=0,
                      eos_token_id=0)


def _model(family: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(family))


def _train_and_measure(rank, world, cases):
    import torch.distributed as dist

    out = {}
    for family, name in cases:
        plugin = PLUGINS[name]()
        g = torch.Generator().manual_seed(rank)
        data = [torch.randint(0, 2048, (BATCH, SEQ), generator=g) for _ in range(STEPS)]
        out[(family, name)] = hf.measured_run(lambda: _model(family), plugin, data, pipeline=name == "pp2",
                                              lora_config=_lora_config() if name.endswith("_lora") else None,
                                              close=isinstance(plugin, GeminiPlugin))
        dist.barrier()
    out["mixtral_ep2"] = _mixtral_ep2(rank) if _has_ep_plan() else None
    return out


def _has_ep_plan() -> bool:
    from transformers import MixtralConfig

    return bool(getattr(MixtralConfig(), "base_model_ep_plan", None))


def _mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=256, max_position_embeddings=64, num_local_experts=4,
                         num_experts_per_tok=2)


def _to_experts_0_and_3(gate, args, out):
    """Every token's top-2 becomes experts 0 and 3, one on each rank of the EP pair: balanced routing."""
    logits = out[0]
    masked = logits.clone()
    masked[:, [1, 2]] = -1e4
    top, idx = torch.topk(torch.softmax(masked.float(), -1), 2, dim=-1)
    return logits, (top / top.sum(-1, keepdim=True)).to(logits.dtype), idx


def _mixtral_ep2(rank):
    """Steps of the tiny Mixtral at ep2 (= dp2): the bytes this rank holds and sent in the first, its peak."""
    import torch.distributed as dist
    from support.engine import state_bytes
    from transformers import MixtralForCausalLM

    from colossal_lab.engine import Booster
    from colossal_lab.engine.moe.parallel import COMM
    from colossal_lab.engine.planner.memory import measure

    def held(ps):
        return sum(p.numel() * p.element_size() for p in ps)

    x = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    got = {}
    with measure() as meter:
        torch.manual_seed(0)
        model = MixtralForCausalLM(_mixtral_config())
        for layer in model.model.layers:
            layer.mlp.gate.register_forward_hook(_to_experts_0_and_3)
        plugin = HybridParallelPlugin(ep_size=2)
        booster = Booster(plugin=plugin)
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        meter.start_window()
        for step in range(STEPS):
            COMM.reset()
            loss = model(input_ids=x, labels=x).loss
            booster.backward(loss, opt)
            if step == 0:
                params = [p for _, p in model.named_model_parameters()]
                experts = [p for p in params if id(p) in plugin.experts.params]
                got = {"params": held(params), "grads": held(p.grad for p in params), "expert_params": held(experts),
                       "all_to_all": COMM.total}
            opt.step()
            opt.zero_grad()
            del loss
        got["optimizer"] = state_bytes(opt)
        plugin.close()
        del model, opt, booster
    got["peak"] = meter.peak["cpu"]
    dist.barrier()
    return got


CASES = [("llama", n) for n in PLUGINS] + [("gpt2", "tp2")]


def _planned_model(family: str, name: str):
    model = _model(family)
    if name.endswith("_lora"):
        import peft

        model = peft.get_peft_model(model, _lora_config())
    return model


@pytest.fixture(scope="module")
def measured():
    return run_distributed(_train_and_measure, WORLD, CASES, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_predicted_peak_of_an_hf_model_is_within_10pct_of_measured(measured, case):
    family, name = case
    plan = cl.plan(_planned_model(family, name), PLUGINS[name](), world_size=WORLD, batch=BATCH, seq=SEQ)
    losses = [v for rank in range(WORLD) for v in measured[rank][case]["losses"] if v is not None]
    assert len(losses) >= STEPS and all(0 < v < 20 for v in losses)  # it trained
    for rank in range(WORLD):
        peaks = measured[rank][case]["peak"]
        for tier in plan.tiers:
            meas, pred = peaks[tier], plan.peak(tier, rank=rank)
            err = 100.0 * (pred - meas) / meas
            assert abs(err) <= 10.0, (f"{case} rank {rank} {tier}: predicted {pred / MIB:.2f} MiB, measured "
                                      f"{meas / MIB:.2f} MiB ({err:+.1f}%)\n{plan}")


def test_mixtral_expert_parallel_plan_equals_what_each_rank_holds_and_sends(measured):
    if measured[0]["mixtral_ep2"] is None:
        import transformers

        pytest.skip(f"transformers {transformers.__version__} gives Mixtral no base_model_ep_plan, which expert "
                    "parallelism reads (docs/moe.md, 'Which transformers')")
    plan = cl.plan(_mixtral_config(), HybridParallelPlugin(ep_size=2), world_size=WORLD, batch=BATCH, seq=SEQ)
    states = plan.rank_plan(0).states
    assert plan.layout["ep"] == 2 and plan.traffic["all_to_all"] == states["all_to_all"] > 0
    for rank in range(WORLD):
        got = measured[rank]["mixtral_ep2"]
        for key in ("params", "grads", "expert_params", "optimizer", "all_to_all"):
            assert states[key] == got[key], (rank, key, states[key], got[key])
        err = 100.0 * (plan.peak("cpu", rank=rank) - got["peak"]) / got["peak"]
        assert abs(err) <= 10.0, (rank, plan.peak("cpu", rank=rank), got["peak"], f"{err:+.1f}%")


def test_an_hf_config_plans_as_its_model_and_defaults_seq_to_its_context():
    for family in ("llama", "gpt2"):
        for name in ("ddp", "tp2"):
            by_config = cl.plan(_config(family), PLUGINS[name](), world_size=WORLD, batch=BATCH, seq=SEQ)
            by_model = cl.plan(_model(family), PLUGINS[name](), world_size=WORLD, batch=BATCH, seq=SEQ)
            assert by_config.peak(by_config.tiers[0]) == by_model.peak(by_model.tiers[0]), (family, name)
    # seq defaults to max_position_embeddings (n_positions for GPT-2); more than that is refused
    assert cl.plan(_config("llama"), DDPPlugin(), world_size=WORLD).seq == 128
    with pytest.raises(ValueError, match=r"seq=256.*max_position_embeddings is 128"):
        cl.plan(_config("gpt2"), DDPPlugin(), world_size=WORLD, seq=256)


def test_tensor_parallel_plans_refuse_what_the_plugin_refuses():
    # 8 heads, 4 key/value heads: tp=8 does not give each rank whole key/value heads
    with pytest.raises(ValueError, match=r"choose tp_size in \[1, 2, 4\]"):
        cl.plan(_config("llama"), HybridParallelPlugin(tp_size=8), world_size=8, batch=BATCH, seq=SEQ)
    with pytest.raises(ValueError, match=r"unknown tensor-parallel style 'diagonal'"):
        cl.plan(_config("llama"), HybridParallelPlugin(tp_size=2, tp_plan={"model.layers.*.mlp.up_proj": "diagonal"}),
                world_size=WORLD, batch=BATCH, seq=SEQ)
    # the shard shapes are the plugin's: q/k/v/up/gate cut by their outputs, o/down by their inputs
    tp = cl.plan(_config("llama"), HybridParallelPlugin(tp_size=2), world_size=WORLD, batch=BATCH, seq=SEQ)
    whole = cl.plan(_config("llama"), DDPPlugin(), world_size=WORLD, batch=BATCH, seq=SEQ)
    assert tp.peak(tp.tiers[0]) < whole.peak(whole.tiers[0])
