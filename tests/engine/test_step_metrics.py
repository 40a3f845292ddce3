"""The Booster emits one StepMetrics per optimizer step under every plugin (real gloo ranks)."""

import torch
from support.dist import run_distributed
from support.engine import lm_loss


def _collect(rank, world, plugin_name, tmp):
    from colossal_lab.engine import Booster, telemetry
    from colossal_lab.engine.models import GPT, GPTConfig
    from colossal_lab.engine.plugins import GeminiPlugin, HybridParallelPlugin

    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny", n_layer=2)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = []
    unsub = telemetry.subscribe(lambda e: seen.append(e) if isinstance(e, telemetry.StepMetrics) else None)
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    batch = {"idx": x, "targets": torch.roll(x, -1, 1)}
    losses = []
    if plugin_name == "gemini":
        booster = Booster(plugin=GeminiPlugin(placement_policy="cpu", precision="fp32"))
        model, opt, *_ = booster.boost(model, opt)
        for _ in range(3):
            _, loss = model(batch["idx"], batch["targets"])
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    else:
        booster = Booster(plugin=HybridParallelPlugin(pp_size=2, num_microbatches=2, pp_style="1f1b"))
        model, opt, crit, *_ = booster.boost(model, opt, lm_loss)
        for _ in range(3):
            out = booster.execute_pipeline(iter([batch]), model, crit, opt)
            opt.step()
            opt.zero_grad()
            losses.append(None if out["loss"] is None else float(out["loss"]))
    unsub()
    return [(e.rank, e.step, e.loss, e.tokens, e.seconds) for e in seen], losses


def _check(results, per_rank_tokens):
    for rank, (events, losses) in enumerate(results):
        assert [e[1] for e in events] == [0, 1, 2], events
        assert all(e[0] == rank and e[3] == per_rank_tokens and e[4] >= 0 for e in events), events
        for e, loss in zip(events, losses):
            assert (e[2] is None and loss is None) or abs(e[2] - loss) < 1e-6


def test_gemini_emits_step_metrics(tmp_path):
    _check(run_distributed(_collect, 2, "gemini", str(tmp_path)), per_rank_tokens=4 * 16)


def test_pipeline_emits_step_metrics(tmp_path):
    results = run_distributed(_collect, 2, "hybrid", str(tmp_path))
    _check(results, per_rank_tokens=4 * 16)
    assert all(l is None for l in results[0][1]) and all(l is not None for l in results[1][1])
