"""``cl.plan`` on transformers models and configs: each plugin's predicted peak per rank and tier
against a real run of the plain HF loop (``model(input_ids=x, labels=x).loss``; under a pipeline
``execute_pipeline`` with HF batches and the model's own loss) on 2 gloo ranks,
within the 10% the GPT's plans keep (``test_memory.py``); an HF config plans as its model does; the
tensor-parallel plugin's refusals come before any work, word for word."""

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
    return out


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
