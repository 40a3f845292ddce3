"""A vocabulary-parallel loss on a pipeline's last stage, for transformers models under 1D tensor parallelism.

A tiny random Llama (4 layers, fp32) trains 5 AdamW steps through
``booster.execute_pipeline(iter([{"input_ids": x, "labels": x}]), model, None, optimizer)`` under
``HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=2)`` on four ranks: the last stage hands the
schedule its logits block (``B x T x V/2``, measured on the stage's output), the model's own loss runs on the
blocks, and loss and gradient norm follow the single-process curve within 1e-4 relative. A criterion that reads
``outputs.logits`` gets them whole and follows the same curve; ``return_outputs=True`` hands back whole logits
equal to the gathered run's; ``loss_parallel=False`` keeps the gathered head (whole ``V`` on the stage's output;
its 5-step curve is ``tests/hybrid/test_hf_pp.py``'s ``tp2_pp2``, one step here; the criterion reading
``outputs.logits``, 2 steps). An odd vocabulary (257: blocks of 129 and 128 columns) follows its curve (2 steps).
The last stage's peak CPU bytes (``colossal_lab.engine.planner.memory.measure``) over one step with a larger
vocabulary drop with the sharded head.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("transformers")

from support import hf  # noqa: E402
from support.dist import run_distributed  # noqa: E402
from support.engine import assert_follows, batch, param_groups  # noqa: E402

STEPS, LR, CLIP, LAYERS = 5, hf.LR, 0.5, 4  # AdamW's lr: support.hf says why not 1e-2
BIG_VOCAB = 8192  # the memory case: logits dominate the last stage's peak
ODD_VOCAB = 257  # blocks of 129 and 128 columns


def _x(step):
    return batch(step)[0].contiguous()


def _own_loss_by_hand(outputs, mb):
    """The shifted LM mean loss from whole logits (equal token counts per microbatch: the model's own)."""
    logits, labels = outputs.logits, mb["labels"]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def _boosted(loss_parallel=True, **model_kw):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    plugin = HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=2, loss_parallel=loss_parallel)
    booster = Booster(plugin=plugin)
    model = hf.llama(layers=LAYERS, **model_kw)
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    model, opt, *_ = booster.boost(model, opt)
    return plugin, booster, model, opt


def _train(criterion=None, loss_parallel=True, steps=STEPS, **model_kw):
    """``steps`` steps; the losses (last stage; None elsewhere), norms, the last stage's output widths, and the
    outputs handed back at the first step."""
    plugin, booster, model, opt = _boosted(loss_parallel, **model_kw)
    widths = set()
    hooks = [m.register_forward_hook(lambda mod, a, out: widths.add(out.shape[-1])) for m in model.stage_modules
             if m.inner.stage_index == 1]
    losses, norms, outputs = [], [], None
    for s in range(steps):
        x = _x(s)
        out = booster.execute_pipeline(iter([{"input_ids": x, "labels": x}]), model, criterion, opt,
                                       return_outputs=s == 0)
        norms.append(float(booster.clip_grad_by_norm(opt, CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(None if out["loss"] is None else float(out["loss"]))
        outputs = out["outputs"] if s == 0 else outputs
    for h in hooks:
        h.remove()
    plugin.close()
    return {"losses": losses, "norms": norms, "widths": sorted(widths),
            "outputs": None if outputs is None else outputs.detach().clone()}


def _peak(loss_parallel):
    """Peak CPU bytes of one training step (after a first one) on this rank, the vocabulary ``BIG_VOCAB``."""
    from colossal_lab.engine.planner.memory import measure

    plugin, booster, model, opt = _boosted(loss_parallel, vocab_size=BIG_VOCAB)
    x = _x(0) % BIG_VOCAB
    for s in range(2):
        if s == 1:
            with measure() as meter:
                booster.execute_pipeline(iter([{"input_ids": x, "labels": x}]), model, None, opt)
        else:
            booster.execute_pipeline(iter([{"input_ids": x, "labels": x}]), model, None, opt)
        opt.step()
        opt.zero_grad()
    plugin.close()
    return meter.peak["cpu"]


def _world(rank, world):
    # the gathered head's curve is test_hf_pp.py's tp2_pp2: one step here, for its widths and outputs
    out = {"sharded": _train(), "by_hand": _train(_own_loss_by_hand, steps=2),
           "gathered": _train(loss_parallel=False, steps=1), "odd": _train(steps=2, vocab_size=ODD_VOCAB),
           "peak_gathered": _peak(False), "peak_sharded": _peak(True)}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_world, 4, timeout=900)


def _reference(steps=STEPS, **model_kw):
    """The plain HF loop in one process: losses and gradient norms before clipping."""
    model = hf.llama(layers=LAYERS, **model_kw)
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    losses, norms = [], []
    for s in range(steps):
        x = _x(s)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


@pytest.fixture(scope="module")
def reference():
    return _reference()


def _last(runs, case):
    return [r[case] for r in runs if r[case]["losses"][0] is not None]


@pytest.mark.parametrize("case", ["sharded", "by_hand", "gathered"])
def test_pipeline_follows_the_single_process_curve(runs, reference, case):
    ref, ref_norms = reference
    assert ref[-1] < ref[0] and min(ref_norms) > CLIP
    steps = len(runs[0][case]["norms"])
    ref, ref_norms = ref[:steps], ref_norms[:steps]
    last = _last(runs, case)
    assert len(last) == 2  # the last stage's two tp ranks report the loss
    worst = max(abs(g - e) / abs(e) for r in last for g, e in zip(r["losses"] + r["norms"], ref + ref_norms))
    print(f"{case}: loss and gradient norm max relative diff {worst:.3g}")
    for r in last:
        assert_follows(case, r["losses"], r["norms"], ref, ref_norms)
    for r in runs:
        assert r[case]["norms"] == pytest.approx(ref_norms, rel=1e-4)


def test_odd_vocabulary_follows_the_curve(runs):
    ref, ref_norms = _reference(steps=2, vocab_size=ODD_VOCAB)
    last = _last(runs, "odd")
    for r in last:
        assert r["widths"] in ([128], [129])  # uneven blocks
        assert_follows("odd vocabulary", r["losses"], r["norms"], ref, ref_norms)
    assert sorted(r["widths"][0] for r in last) == [128, 129]


def test_last_stage_keeps_its_logits_sharded(runs):
    for r in _last(runs, "sharded"):
        assert r["widths"] == [128]  # V / tp: the schedule carries the block
    for r in _last(runs, "gathered"):
        assert r["widths"] == [256]


def test_returned_outputs_are_whole(runs):
    sharded, gathered = _last(runs, "sharded"), _last(runs, "gathered")
    for s, g in zip(sharded, gathered):
        assert s["outputs"].shape == (8, 32, 256)
        assert float((s["outputs"] - g["outputs"]).abs().max()) < 1e-4


def test_last_stage_peak_drops(runs):
    last = [r for r in runs if r["sharded"]["losses"][0] is not None]
    for r in last:
        drop = r["peak_gathered"] - r["peak_sharded"]
        print(f"last stage peak: gathered {r['peak_gathered'] / 2**20:.2f} MiB, sharded "
              f"{r['peak_sharded'] / 2**20:.2f} MiB, drop {drop / 2**20:.2f} MiB")
        logits_share = 4 * 32 * BIG_VOCAB * 4 // 2  # one microbatch's fp32 logits, the (tp-1)/tp share
        assert drop >= logits_share, (r["peak_gathered"], r["peak_sharded"])
