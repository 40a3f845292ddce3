"""A transformers model resumes training from a model + optimizer checkpoint under 2D / 2.5D tensor parallelism.

A tiny random Llama (grouped-query attention, fp32) trains three AdamW steps with the plain HF loop under
``HybridParallelPlugin(tp_size=4, tp_mode="2d")`` and ``tp_mode="2.5d"`` (depth 1) on four ranks, then
``booster.save_model`` and ``booster.save_optimizer`` write the checkpoint mid-run. A fresh model with other
random weights and a fresh AdamW, boosted anew, load both and train three more steps: loss and gradient norm
equal the uninterrupted single-process curve (six steps, one AdamW) within 1e-4 relative, so the moments and
the step count came back (a fresh AdamW would move the curve). The 2D checkpoint also resumes under another
layout: 1D tensor parallelism (tp 2 × dp 2) on the same four ranks, and one process (``Booster()`` without a
plugin), each continuing the same curve. GPT-2 under 2D (its ``c_attn`` packs q | k | v, reordered in its
blocks) resumes too. A checkpoint of a smaller model is refused on every rank, naming the tensor and the
layouts that load.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

from support import hf  # noqa: E402
from support.dist import run_distributed  # noqa: E402
from support.engine import assert_follows, param_groups  # noqa: E402

STEPS, LR, CLIP = 3, 1e-2, 0.5  # the clip acts at every step: a wrong gradient norm moves the curve
SEED, OTHER = 11, 99
MODELS = {"llama": hf.llama, "llama-1": lambda seed: hf.llama(layers=1, seed=seed),
          "gpt2": lambda seed: hf.gpt2(seed=seed, tie_word_embeddings=False)}
LAYOUTS = {"2d": dict(tp_size=4, tp_mode="2d"), "2.5d": dict(tp_size=4, tp_mode="2.5d", tp_depth=1),
           "1d": dict(tp_size=2)}
# (case, family, the layout saved under, the layout resumed under)
CASES = [("2d", "llama", "2d", "2d"), ("2.5d", "llama", "2.5d", "2.5d"), ("2d-gpt2", "gpt2", "2d", "2d"),
         ("2d->1d", "llama", "2d", "1d")]


def _loop(model, opt, first, booster=None):
    """The plain HF loop over steps ``first .. first + STEPS``: losses and gradient norms (before clipping)."""
    return hf.loop(model, opt, booster, steps=STEPS, clip=CLIP, first=first)


def _boosted(family, layout, seed):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    plugin = HybridParallelPlugin(**LAYOUTS[layout]) if layout else None
    booster = Booster(plugin=plugin)
    model = MODELS[family](seed=seed)
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    model, opt, *_ = booster.boost(model, opt)
    return plugin, booster, model, opt


def _close(plugin):
    if plugin is not None:
        plugin.close()


def _save(root, family, layout):
    """Three steps from ``SEED``, then the model and the optimizer saved under ``root``."""
    plugin, booster, model, opt = _boosted(family, layout, SEED)
    first = _loop(model, opt, 0, booster)
    booster.save_model(model, os.path.join(root, "model"), shard=True, size_per_shard=0.05)
    booster.save_optimizer(opt, os.path.join(root, "optim"))
    _close(plugin)
    return first


def _resume(root, family, layout):
    """A fresh model (other weights) and AdamW under ``layout``, both loaded from ``root``; three more steps."""
    plugin, booster, model, opt = _boosted(family, layout, OTHER)
    booster.load_model(model, os.path.join(root, "model"))
    booster.load_optimizer(opt, os.path.join(root, "optim"))
    then = _loop(model, opt, STEPS, booster)
    _close(plugin)
    return then


def _refused(root):
    """A 2D checkpoint of a one-layer Llama is refused by a two-layer one's 2D optimizer, on every rank."""
    plugin, booster, model, opt = _boosted("llama", "2d", SEED)
    try:
        booster.load_optimizer(opt, os.path.join(root, "optim"))
    except RuntimeError as exc:
        return str(exc)
    finally:
        _close(plugin)
    return None


def _world(rank, world, root):
    out, saved = {}, {}
    for case, family, save_as, resume_as in CASES:
        where = os.path.join(root, f"{family}-{save_as}")
        if where not in saved:
            saved[where] = _save(where, family, save_as)
        out[case] = {"first": saved[where], "then": _resume(where, family, resume_as)}
    small = os.path.join(root, "small")  # the mismatch case: a one-layer Llama's optimizer
    plugin, booster, model, opt = _boosted("llama-1", "2d", SEED)
    _loop(model, opt, 0, booster)
    booster.save_optimizer(opt, os.path.join(small, "optim"))
    plugin.close()
    out["refused"] = _refused(small)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("optim_nd"))
    return root, run_distributed(_world, 4, root, timeout=900)


def _reference(family):
    """One process, uninterrupted: six steps with one AdamW."""
    model = MODELS[family](seed=SEED)
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    return _loop(model, opt, 0), _loop(model, opt, STEPS)


def _fresh_adamw(family):
    """What a resume that lost the optimizer state would give: three steps, a new AdamW, three more."""
    model = MODELS[family](seed=SEED)
    _loop(model, torch.optim.AdamW(param_groups(model), lr=LR), 0)
    return _loop(model, torch.optim.AdamW(param_groups(model), lr=LR), STEPS)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_resumed_run_continues_the_uninterrupted_curve(runs, case):
    family = next(c[1] for c in CASES if c[0] == case)
    (ref_first, ref_norms_first), (ref_then, ref_norms_then) = _reference(family)
    assert ref_then[-1] < ref_first[0] and min(ref_norms_first + ref_norms_then) > CLIP
    lost, _ = _fresh_adamw(family)  # the test can tell a lost optimizer state from a restored one
    assert max(abs(a - b) / abs(b) for a, b in zip(lost, ref_then)) > 1e-3
    ref = ref_first + ref_norms_first + ref_then + ref_norms_then
    worst = max(abs(g - e) / abs(e) for r in runs[1]
                for g, e in zip(r[case]["first"][0] + r[case]["first"][1] + r[case]["then"][0] + r[case]["then"][1],
                                ref))
    print(f"{case}: resumed loss and gradient norm curve max relative diff {worst:.3g}")
    for r in runs[1]:
        assert_follows((case, "before the save"), *r[case]["first"], ref_first, ref_norms_first)
        assert_follows((case, "resumed"), *r[case]["then"], ref_then, ref_norms_then)


def test_2d_checkpoint_resumes_in_one_process(runs):
    (_, _), (ref_then, ref_norms_then) = _reference("llama")
    then = _resume(os.path.join(runs[0], "llama-2d"), "llama", None)
    assert_follows("2d->one process", *then, ref_then, ref_norms_then)


def test_checkpoint_of_another_model_is_refused_on_every_rank(runs):
    msgs = [r["refused"] for r in runs[1]]
    assert all(m is not None for m in msgs), msgs
    assert len(set(msgs)) == 1, msgs  # every rank raised the same agreed error
    assert "model.layers.1" in msgs[0] and "load into any pp/tp (1D, 2D, 2.5D, 3D)/dp/ZeRO-1 layout" in msgs[0], msgs[0]
