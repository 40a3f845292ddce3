"""The MoE block in one process (engine/moe): grouped experts, router, routing and losses against a
plain per-expert loop, and the MoE GPT training. Expert parallelism: test_moe_ep.py."""

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from colossal_lab.engine.models import GPT, GPTConfig
from colossal_lab.engine.moe import MoE, grouped_swiglu, load_balancing_loss, route, router_z_loss
from colossal_lab.engine.moe.dispatch import capacity

D, H, E = 16, 24, 6
# fp32 sums in another order (grouped GEMM, padded bmm vs one row at a time): equal to rounding
close = functools.partial(torch.testing.assert_close, rtol=1e-5, atol=1e-6)


def _loop_swiglu(x, w1, w3, w2, experts):
    """Row i through expert experts[i], one small matmul per row: the reference."""
    return torch.stack([(F.silu(x[i] @ w1[e]) * (x[i] @ w3[e])) @ w2[e] for i, e in enumerate(experts.tolist())]) \
        if len(experts) else x.new_zeros(0, w2.shape[-1]) + 0 * (w1.sum() + w3.sum() + w2.sum())


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(0.2 * torch.randn(*s, generator=g)).requires_grad_() for s in ((E, D, H), (E, D, H), (E, H, D))]


@pytest.mark.parametrize("impl", ["grouped_mm", "bmm"])
@pytest.mark.parametrize("counts", [[3, 0, 5, 1, 0, 2], [0, 0, 0, 4, 0, 0], [0] * E])
def test_grouped_swiglu_equals_loop(impl, counts):
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), D, requires_grad=True)
    w = _weights()
    y = grouped_swiglu(x, *w, counts, impl=impl)
    experts = torch.repeat_interleave(torch.arange(E), counts)
    ref_w = [t.detach().clone().requires_grad_() for t in w]
    ref_x = x.detach().clone().requires_grad_()
    ref = _loop_swiglu(ref_x, *ref_w, experts)
    close(y, ref)
    gy = torch.randn_like(ref)
    y.backward(gy)
    ref.backward(gy)
    close(x.grad, ref_x.grad if ref_x.grad is not None else torch.zeros_like(x))
    for a, b in zip(w, ref_w):
        got = a.grad if a.grad is not None else torch.zeros_like(a)
        want = b.grad if b.grad is not None else torch.zeros_like(b)
        close(got, want)
        assert got[counts == 0].abs().sum() == 0  # an expert without rows: a zero gradient, never None


def test_grouped_swiglu_refuses_unknown_impl():
    with pytest.raises(ValueError, match="impl='loop'.*grouped_mm"):
        grouped_swiglu(torch.zeros(0, D), *_weights(), torch.zeros(E, dtype=torch.long), impl="loop")


def _reference_moe(moe, x):
    """The MoE block written as a loop over tokens and their chosen experts (no grouping, no sorting)."""
    B, T, d = x.shape
    xf = x.reshape(-1, d)
    logits = moe.router.gate(xf).float()
    scores = moe.router.scores(logits)
    idx = torch.topk(scores.detach() + moe.router.expert_bias, moe.top_k, dim=-1).indices
    w = scores.gather(-1, idx)
    if moe.top_k > 1:
        w = w / w.sum(-1, keepdim=True)
    keep = torch.ones_like(idx, dtype=torch.bool)
    if moe.capacity_factor is not None:  # an expert keeps its first `cap` assignments in token order
        cap, seen = capacity(xf.shape[0], moe.top_k, moe.n_expert, moe.capacity_factor), [0] * moe.n_expert
        for i in range(idx.shape[0]):
            for j in range(idx.shape[1]):
                e = int(idx[i, j])
                keep[i, j] = seen[e] < cap
                seen[e] += 1
    ex = moe.experts
    rows = []
    for i in range(xf.shape[0]):
        y = xf.new_zeros(d)
        for j in range(moe.top_k):
            if keep[i, j]:
                e = int(idx[i, j])
                y = y + w[i, j] * ((F.silu(xf[i] @ ex.w1[e]) * (xf[i] @ ex.w3[e])) @ ex.w2[e])
        rows.append(y)
    out = torch.stack(rows)
    if moe.shared is not None:
        out = out + moe.shared(xf)
    return out.view(B, T, d), int((~keep).sum())


CASES = {
    "softmax_top2": dict(),
    "sigmoid_top3": dict(top_k=3, gating="sigmoid"),
    "shared_top1": dict(top_k=1, n_shared=1),
    "capacity": dict(capacity_factor=0.5),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("starve", [False, True])
def test_moe_block_equals_loop(case, starve):
    kw = dict(dict(top_k=2, gating="softmax"), **CASES[case])
    torch.manual_seed(1)
    moe = MoE(D, H, E, **kw)
    if starve:  # experts 1 and 4 out of every token's choice: they get no token
        moe.router.expert_bias[[1, 4]] = -1e4
    ref = MoE(D, H, E, **kw)
    ref.load_state_dict(moe.state_dict())
    x = torch.randn(2, 5, D, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y = moe(x)
    want, dropped = _reference_moe(ref, xr)
    close(y, want)
    assert moe.last.dropped == dropped
    assert sum(moe.last.tokens_per_expert) == 2 * 5 * moe.top_k - dropped
    if kw.get("capacity_factor"):
        assert dropped > 0  # the case is meant to drop
    if starve:
        assert moe.last.tokens_per_expert[1] == moe.last.tokens_per_expert[4] == 0
    g = torch.randn_like(y)
    y.backward(g)
    want.backward(g)
    close(x.grad, xr.grad)
    for (n, p), (_, q) in zip(moe.named_parameters(), ref.named_parameters()):
        assert p.grad is not None, n
        close(p.grad, q.grad if q.grad is not None else torch.zeros_like(p), msg=n)
    if starve:
        assert moe.experts.w1.grad[[1, 4]].abs().sum() == 0


def test_route_counts_and_capacity():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # expert 0 chosen 4 times, 1 twice
    w = torch.rand(4, 2)
    r = route(w, idx, 5)
    assert r.counts.tolist() == [4, 2, 1, 1, 0] and r.dropped == 0
    assert r.token.tolist() == [0, 1, 2, 3, 0, 2, 1, 3]  # expert-major, token order inside
    r = route(w, idx, 5, capacity_factor=1.25)  # ceil(1.25 * 4 * 2 / 5) = 2 per expert
    assert capacity(4, 2, 5, 1.25) == 2
    assert r.counts.tolist() == [2, 2, 1, 1, 0] and r.dropped == 2 and r.chosen.tolist() == [4, 2, 1, 1, 0]
    assert r.token.tolist()[:2] == [0, 1]  # expert 0 keeps its first two tokens


def test_losses():
    B, T = 3, 8
    uniform = torch.full((B, T, E), 1.0 / E)
    even = torch.arange(B * T * 2).reshape(B, T, 2) % E  # every expert chosen equally often
    assert load_balancing_loss(uniform, even, E).item() == pytest.approx(1.0)
    skew = torch.zeros(B, T, E)
    skew[..., 0] = 1.0
    assert load_balancing_loss(skew, torch.zeros(B, T, 1, dtype=torch.long), E).item() == pytest.approx(E)
    # per sequence: two halves of a batch average to the whole batch's value (data parallelism needs it)
    s, i = torch.rand(4, T, E), torch.randint(0, E, (4, T, 2))
    whole = load_balancing_loss(s, i, E)
    halves = (load_balancing_loss(s[:2], i[:2], E) + load_balancing_loss(s[2:], i[2:], E)) / 2
    torch.testing.assert_close(whole, halves)
    logits = torch.randn(5, E)
    assert router_z_loss(logits).item() == pytest.approx((torch.logsumexp(logits, -1) ** 2).mean().item())


def test_aux_losses_train_the_router():
    """Their gradient reaches the router through the block's output as if added to the loss."""
    torch.manual_seed(2)
    moe = MoE(D, H, E, top_k=2, aux_loss_coef=0.3, z_loss_coef=0.1)
    ref = MoE(D, H, E, top_k=2)
    ref.load_state_dict(moe.state_dict())
    x = torch.randn(2, 7, D)
    moe(x).pow(2).sum().backward()
    y = ref(x)
    logits = ref.router.gate(x.reshape(-1, D)).float()
    idx = torch.topk(logits.softmax(-1), 2, dim=-1).indices
    extra = 0.3 * load_balancing_loss(logits.softmax(-1).view(2, 7, E), idx.view(2, 7, 2), E) \
        + 0.1 * router_z_loss(logits)
    (y.pow(2).sum() + extra).backward()
    close(moe.router.gate.weight.grad, ref.router.gate.weight.grad)
    assert moe.last.balance_loss == pytest.approx(float((extra - 0.1 * router_z_loss(logits)).detach()) / 0.3, rel=1e-5)


def test_loss_scaling_weighs_the_aux_losses_as_the_loss():
    """fp16's loss scaler back-propagates ``S * loss``: the aux losses, which enter backward through the block
    outputs rather than the loss, must be scaled by ``S`` as well, or after unscaling they weigh ``1/S`` of
    their coefficient. Every gradient of a scaled backward, divided by ``S``, equals the plain backward's."""
    from colossal_lab.engine.wrappers import OptimizerWrapper

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_expert=4, top_k=2, aux_loss_coef=0.1, z_loss_coef=1e-2))
    x = torch.randint(0, 256, (2, 16))
    _, loss = model(x, x.roll(-1, 1))
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    opt = OptimizerWrapper(torch.optim.SGD(model.parameters(), lr=0.1), mixed_precision="fp16")
    S = opt.loss_scaler.scale
    assert S > 1
    _, loss = model(x, x.roll(-1, 1))
    opt.backward(loss)
    for n, p in model.named_parameters():  # (without the aux losses scaled, the routers' gradients part)
        torch.testing.assert_close(p.grad / S, ref[n], rtol=1e-5, atol=1e-9, msg=n)


@pytest.mark.parametrize("kw, match", [
    (dict(n_expert=-1), "n_expert=-1"),
    (dict(n_expert=4, top_k=5), r"top_k=5 must be an int in \[1, n_expert=4\]"),
    (dict(n_expert=4, top_k=0), "top_k=0"),
    (dict(n_expert=4, moe_gating="relu"), "moe_gating='relu'"),
    (dict(n_expert=4, capacity_factor=0), "capacity_factor=0"),
])
def test_config_refuses_bad_moe_fields(kw, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig.preset("tiny", **kw)


def test_dense_default_unchanged_and_moe_gpt_trains():
    dense = GPT(GPTConfig.preset("tiny"))
    assert not any("expert" in n or "router" in n for n, _ in dense.named_parameters())
    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny", n_expert=4, top_k=2, n_shared_expert=1, z_loss_coef=1e-3)
    model = GPT(cfg)
    assert model.blocks["0"].mlp.experts.w1.shape == (4, cfg.n_embd, cfg.hidden)
    plan = model.tp_plan()  # 1D tensor parallelism: attention split, MoE blocks whole on every tp rank
    assert {k.split(".", 2)[2] for k in plan} == {"attn.wq", "attn.wk", "attn.wv", "attn.wo"}
    with pytest.raises(ValueError, match="MoE blocks stay whole.*use tp_mode='1d'"):
        model.tp_nd_plan()
    with pytest.raises(ValueError, match="MoE blocks stay whole.*use sequence_parallel=False"):
        model.tp_plan(sequence_parallel=True)  # what cl.plan reads as well as the plugin
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = (torch.arange(8 * 33).reshape(8, 33) * 5 + 3) % 256
    losses = []
    for _ in range(12):
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses
    assert all(math.isfinite(v) for v in losses)


def _moe_gpt(**kw):
    return GPT(GPTConfig.preset("tiny", **dict(dict(n_expert=4, top_k=2), **kw)))


@pytest.mark.parametrize("plugin_kw, model, match", [
    (dict(ep_size=2), lambda: GPT(GPTConfig.preset("tiny")), r"GPT has no MoE block.*set ep_size=1"),
    (dict(ep_size=4), lambda: _moe_gpt(n_expert=6), r"n_expert=6 .* use an ep_size in \[1, 2, 3, 6\]"),
    (dict(ep_size=2, cp_size=2), _moe_gpt, r"cp_size=2\): expert parallelism composes with"),
    (dict(ep_size=2, tp_size=2, sequence_parallel=True), _moe_gpt, r"MoE blocks stay whole.*sequence_parallel=False"),
    (dict(tp_size=4, tp_mode="2d"), _moe_gpt, r"MoE blocks stay whole.*use tp_mode='1d'"),  # GPT's tp_nd_plan
])
def test_ep_refused_before_any_group(plugin_kw, model, match):
    """configure() refuses on its model checks: no process group runs here, so reaching one would be a
    RuntimeError instead."""
    from colossal_lab.engine.plugins import HybridParallelPlugin

    with pytest.raises(ValueError, match=match):
        HybridParallelPlugin(**plugin_kw).configure(model())


def test_ep_refuses_top_k_over_experts_and_bad_world(monkeypatch):
    from colossal_lab.engine.plugins import HybridParallelPlugin

    model = _moe_gpt()
    model.blocks["1"].mlp.top_k = 5  # a model changed after its config was checked
    with pytest.raises(ValueError, match=r"blocks.1.mlp routes top_k=5 of n_expert=4 .* top_k <= 4"):
        HybridParallelPlugin(ep_size=2).configure(model)
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ValueError, match=r"ep_size=4\): .* 6 data-parallel ranks .* ep_size in \[1, 2, 3, 6\]"):
        HybridParallelPlugin(ep_size=4)
    with pytest.raises(ValueError, match=r"ep_size=0\): must be an int >= 1"):
        HybridParallelPlugin(ep_size=0)


@pytest.mark.parametrize("make, match", [
    (lambda P: P.HybridParallelPlugin(ep_size=2, zero_stage=2, pp_size=2, num_microbatches=2),
     r"zero_stage=2, pp_size=2\): ZeRO-2 .* use zero_stage=1 with pp_size=2"),
    (lambda P: P.HybridParallelPlugin(zero_stage=2, tp_size=2), r"zero_stage=2, tp_size=2\)"),
    (lambda P: P.HybridParallelPlugin(ep_size=2, zero_stage=2, precision="fp16"),
     r"zero_stage=2, precision='fp16'\).*use precision='fp32' or 'bf16'"),
    (lambda P: P.HybridParallelPlugin(ep_size=2, zero_stage=3), r"zero_stage=3\).*no ep_size.*zero_stage=2"),
])
def test_zero2_and_gemini_refusals(make, match):
    """What ZeRO-2 under the hybrid plugin does not compose with yet is refused at construction, naming what
    works (GeminiPlugin(ep_size=...)'s refusals: test_moe_ep.py)."""
    from colossal_lab.engine import plugins

    with pytest.raises(ValueError, match=match):
        make(plugins)


def test_expert_load_counts_a_step_and_round_trips():
    from colossal_lab.engine import telemetry
    from colossal_lab.engine.moe import take_load

    torch.manual_seed(0)
    model = _moe_gpt(capacity_factor=0.5, activation_checkpointing=True)
    x = torch.randint(0, 256, (2, 9))
    for _ in range(2):  # two forwards in one step (gradient accumulation); the recompute in backward is no load
        model(x[:, :-1], x[:, 1:])[1].backward()
    with torch.no_grad():
        model(x[:, :-1])  # an evaluation forward is no load either
    events = take_load(model, rank=0, step=3)
    assert [e.layer for e in events] == ["blocks.0.mlp", "blocks.1.mlp"]
    for e in events:
        assert sum(e.tokens) + e.dropped == 2 * 2 * 8 * 2 and e.dropped > 0
        assert telemetry.from_dict(telemetry.to_dict(e)) == e == telemetry.from_row(telemetry.to_row(e))
    assert take_load(model, 0, 4) == []  # cleared
    with pytest.raises(ValueError, match="must be counts >= 0"):
        telemetry.ExpertLoad(rank=0, step=0, layer="x", tokens=(1, -1))
