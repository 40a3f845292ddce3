"""``booster.clip_grad_by_norm`` under HybridParallelPlugin: the same global norm and the same
clipped step as torch's ``clip_grad_norm_`` on one process, with the gradients split over
tensor-parallel shards or pipeline stages (tied embeddings counted once). Real gloo ranks."""

import math

import pytest
import torch
from support.dist import run_distributed
from support.engine import lm_loss

BATCH, SEQ = 8, 16
MAX_NORM = {2.0: 0.1, math.inf: 0.01}  # below the first step's norm, so the clip scales
CONFIGS = [dict(tp_size=2), dict(pp_size=2, num_microbatches=2, pp_style="1f1b", tie=True),
           dict(pp_size=2, num_microbatches=2, pp_style="gpipe", norm_type=math.inf)]


def _data(steps=2):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randint(0, 256, (BATCH, SEQ), generator=g)
        out.append({"idx": x, "targets": torch.roll(x, -1, 1)})
    return out


def _model(tie):
    from colossal_lab.engine.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", n_layer=2, tie_embeddings=tie))


def _reference(tie, norm_type):
    model = _model(tie)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    norms = []
    for b in _data():
        lm_loss(model(b["idx"])[0], b).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM[norm_type], norm_type=norm_type)
        norms.append(float(norm))
        opt.step()
        opt.zero_grad()
    return norms, {k: v.clone() for k, v in model.state_dict().items()}


def _train(rank, world):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    out = []
    for cfg in CONFIGS:
        cfg = dict(cfg)
        tie, norm_type = cfg.pop("tie", False), cfg.pop("norm_type", 2.0)
        booster = Booster(plugin=HybridParallelPlugin(**cfg))
        model = _model(tie)
        model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.5), lm_loss)
        norms, it = [], iter(_data())
        for _ in range(2):
            booster.execute_pipeline(it, model, lm_loss, opt)
            norms.append(float(booster.clip_grad_by_norm(opt, MAX_NORM[norm_type], norm_type=norm_type)))
            opt.step()
            opt.zero_grad()
        out.append({"norms": norms, "state": model.full_state_dict(), "tie": tie, "norm_type": norm_type})
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_train, 2)


@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=["tp2", "pp2-tied", "pp2-inf"])
def test_clip_matches_one_process(runs, i):
    res0 = runs[0][i]
    ref_norms, ref_state = _reference(res0["tie"], res0["norm_type"])
    assert ref_norms[0] > MAX_NORM[res0["norm_type"]]  # the clip really scales this step
    for rank in range(2):
        res = runs[rank][i]
        assert res["norms"] == pytest.approx(ref_norms, rel=1e-4), (rank, res["norms"], ref_norms)
        for k, v in ref_state.items():
            err = (res["state"][k] - v).abs().max().item()
            assert err < 2e-5, f"rank {rank}: {k} differs from one-process clipped training by {err}"


def _direct_call_dtype(rank, world, precision):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, precision=precision))
    model, *_ = booster.boost(_model(False))
    x = torch.randint(0, 256, (2, 8))
    logits, _ = model(x, x)
    return str(logits.dtype)


def test_direct_call_without_pipeline_runs_in_the_plugins_precision():
    """pp_size=1: calling the boosted model directly runs under the precision's autocast."""
    assert run_distributed(_direct_call_dtype, 2, "bf16") == ["torch.bfloat16"] * 2
