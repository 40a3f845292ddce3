"""``HybridParallelPlugin(cp_size=, cp_mode=)`` on real gloo processes: context parallelism wired
into the plugin, alone and with dp, pp and 1D tp.

A tiny GPT trained 5 steps (SGD with momentum, as in tests/hybrid/test_context_parallel.py) follows the
one-process loss curve within 1e-4 relative and its gradients match per parameter; a direct
forward cuts the batch itself; a checkpoint saved under cp loads into a plain model; bad sizes
are refused before any group exists. One launch per world size does every case.
"""

import pytest
import torch
from support.dist import run_distributed
from support.engine import lm_loss

T, ROWS, STEPS = 32, 4, 5
CFG = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)


def _gpt():
    from colossal_lab.engine.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG))


def _batch():
    x = torch.randint(0, 256, (ROWS, T), generator=torch.Generator().manual_seed(1))
    return {"idx": x, "targets": torch.roll(x, -1, 1)}


def _reference():
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    b, losses, grads = _batch(), [], []
    for _ in range(STEPS):
        logits, _ = model(b["idx"])
        loss = lm_loss(logits, b)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads


CASES = {  # world size -> name -> plugin kwargs
    2: {"ring": dict(cp_size=2, cp_mode="ring"), "ulysses": dict(cp_size=2, cp_mode="ulysses")},
    4: {"ulysses_dp2": dict(cp_size=2, cp_mode="ulysses"),
        "ring_pp2": dict(cp_size=2, cp_mode="ring", pp_size=2, num_microbatches=2),
        "ring_tp2": dict(cp_size=2, cp_mode="ring", tp_size=2)},
}


def _full_grads(model):
    """{name: whole gradient} of this rank's parameters (DTensor shards made whole)."""
    out = {}
    for n, p in model.named_model_parameters():
        if p.grad is not None:
            g = p.grad
            out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _train(kw):
    import torch.distributed as dist

    from colossal_lab.engine import Booster, comm
    from colossal_lab.engine.plugins import HybridParallelPlugin

    plugin = HybridParallelPlugin(**kw)
    booster = Booster(plugin=plugin)
    model = _gpt()
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), lm_loss)
    b = _batch()
    dp, d = plugin.dp_size, plugin.dp_rank
    mine = {k: v[d * ROWS // dp:(d + 1) * ROWS // dp] for k, v in b.items()}  # this dp rank's rows
    losses, grads = [], []
    for _ in range(STEPS):
        out = booster.execute_pipeline(iter([mine]), model, lm_loss, opt)
        opt._sync()  # gradients averaged over dp x cp (what step() does first), to compare them
        loss = None if out["loss"] is None else float(out["loss"])
        if loss is not None and dp > 1:  # the dp ranks' rows: the batch mean is their mean
            (loss,) = comm.reduce_values([loss], group=plugin.dp_group)
            loss /= dp
        losses.append(loss)
        grads.append(_full_grads(model))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "rank": dist.get_rank()}


def _direct_forward_and_checkpoint(tmp):
    import torch.distributed as dist

    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    booster = Booster(plugin=HybridParallelPlugin(cp_size=2, cp_mode="ring"))
    model = _gpt()
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    b = _batch()
    _, loss = model(b["idx"], b["targets"])  # whole sequences in: the model cuts its shard
    loss.backward()
    opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    booster.save_model(model, f"{tmp}/ckpt", shard=True)
    return {"direct_loss": total.item() / 2}


def _errors():
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    out = {}
    for name, kw in {"mode": dict(cp_size=2, cp_mode="zigzag"),
                     "nd": dict(cp_size=2, tp_size=4, tp_mode="2d"),
                     "sp": dict(cp_size=2, tp_size=2, sequence_parallel=True),
                     "world": dict(cp_size=3)}.items():
        try:
            HybridParallelPlugin(**kw)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    from colossal_lab.engine.models import GPT, GPTConfig

    try:  # Ulysses cuts heads over cp: 3 heads do not split over 2 ranks
        Booster(plugin=HybridParallelPlugin(cp_size=2, cp_mode="ulysses")).boost(
            GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=3, n_embd=48)))
        out["heads"] = None
    except ValueError as e:
        out["heads"] = str(e)
    return out


def _rank(rank, world, tmp):
    out = {name: _train(kw) for name, kw in CASES[world].items()}
    if world == 2:
        out.update(_direct_forward_and_checkpoint(tmp))
        out["errors"] = _errors()
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def run(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"cp{request.param}")
    return request.param, tmp, run_distributed(_rank, request.param, str(tmp), timeout=300)


def test_training_under_cp_follows_one_process(run):
    world, _, results = run
    ref_losses, ref_grads = _reference()
    assert ref_losses[-1] < ref_losses[0] - 0.5, ref_losses
    for name in CASES[world]:
        got = [r[name] for r in results]
        losses = next(g["losses"] for g in got if g["losses"][0] is not None)
        for s, (l, w) in enumerate(zip(losses, ref_losses)):
            assert abs(l - w) <= 1e-4 * abs(w), f"{name} step {s}: loss {l} vs {w}"
        for s in range(STEPS):
            merged = {}
            for g in got:
                merged.update(g["grads"][s])  # a pipeline's stages each hold their own names
            assert merged.keys() == ref_grads[s].keys(), name
            for n, w in ref_grads[s].items():
                err = (merged[n] - w).abs().max().item()
                assert err <= 1e-5 * w.abs().max().item(), f"{name} step {s}: grad {n} off by {err}"


def test_direct_forward_cuts_the_batch_and_a_cp_checkpoint_loads_into_a_plain_model(run):
    world, tmp, results = run
    if world != 2:
        pytest.skip("checked at world 2")
    ref = _gpt()
    logits, _ = ref(_batch()["idx"])
    want = lm_loss(logits, _batch()).item()
    assert abs(results[0]["direct_loss"] - want) <= 1e-5 * want
    # the checkpoint holds the whole model after one SGD step: load it into a plain GPT
    from colossal_lab.engine.checkpoint_io import load_state_dict_shards

    plain = _gpt()
    plain.load_state_dict(load_state_dict_shards(str(tmp / "ckpt")), strict=True)
    ref.zero_grad()
    logits, _ = ref(_batch()["idx"])
    lm_loss(logits, _batch()).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for (n, p), (_, q) in zip(ref.named_parameters(), plain.named_parameters()):
        assert torch.allclose(p, q, atol=1e-6), n


def test_bad_sizes_are_refused_before_any_group(run):
    world, _, results = run
    if world != 2:
        pytest.skip("checked at world 2")
    e = results[0]["errors"]
    assert "cp_mode='zigzag'" in e["mode"] and "ring" in e["mode"]
    assert "tp_mode='1d'" in e["nd"]
    assert "sequence_parallel=False" in e["sp"]
    assert "does not divide the world size 2" in e["world"]
    assert "n_head=3" in e["heads"] and "cp_mode='ring'" in e["heads"]
