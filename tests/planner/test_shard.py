"""``cl.autoshard``: per-linear tensor-parallel strategies on the torch.export graph (issue #19's stretch).

Planning runs in this process (the tiny GPT is traced once per module); one 2-rank gloo run then
trains under the plans' ``tp_plan()`` with ``HybridParallelPlugin`` and compares with one process:
losses to 1e-5, and the parameter bytes a rank really holds against the plan's prediction. The
MLP plans cover every DTensor style the solver emits (column with whole and sharded input, column
+gather, row with sharded and whole input, row+scatter, a replicated linear gathering its input).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support.dist import run_distributed
from support.engine import lm_loss

SEQ_BATCH = (4, 32)
CHEAP = dict(flops=20e9, allreduce_s_per_byte=1e-10, allreduce_latency=1e-7, allgather_s_per_byte=1e-10,
             allgather_latency=1e-7)
SLOW = dict(flops=20e9, allreduce_s_per_byte=1e-6, allreduce_latency=1e-2, allgather_s_per_byte=1e-6,
            allgather_latency=1e-2)
# the MLP's layouts trained at world 2: name -> fixed strategies (None: the solver's tight-budget choice)
MLP_PLANS = {
    "tight": None,
    "row_whole_in+scatter+gather_in": {"0": "row", "2": "row+scatter", "4": "replicated"},
    "colgather+row_whole_in": {"0": "column+gather", "2": "row", "4": "column+gather"},
}


def _gpt():
    from colossal_lab.engine.models import GPTConfig

    torch.manual_seed(0)
    return GPTConfig.preset("tiny").build()


def _gpt_batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, SEQ_BATCH, generator=g)
    return {"idx": x, "targets": torch.roll(x, -1, 1)}


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))


def _mlp_data(steps=3):
    g = torch.Generator().manual_seed(2)
    return [{"idx": torch.randn(8, 8, generator=g), "y": torch.randn(8, 8, generator=g)} for _ in range(steps)]


def mse(out, batch):
    return F.mse_loss(out.float(), batch["y"])


@pytest.fixture(scope="module")
def gpt_plan():
    from colossal_lab.engine.planner.shard import ShardCosts, autoshard

    return autoshard(_gpt(), (_gpt_batch()["idx"],), 2, costs=ShardCosts(**CHEAP))


@pytest.fixture(scope="module")
def mlp_plans():
    from colossal_lab.engine.planner.shard import ShardCosts, autoshard

    free = autoshard(_mlp(), (_mlp_data()[0]["idx"],), 2, costs=ShardCosts())
    out = {}
    for key, fixed in MLP_PLANS.items():
        budget = free.frontier[0][0] if fixed is None else None
        out[key] = autoshard(_mlp(), None, 2, costs=ShardCosts(), device_memory=budget, graph=free.graph, fixed=fixed)
    return out


def _megatron(plan):
    return {n: s for n, s in plan.strategies.items() if n.startswith("blocks.")}


def test_tight_budget_gives_megatron_pairs(gpt_plan):
    import colossal_lab as cl
    from colossal_lab.engine.planner.shard import ShardCosts

    least = gpt_plan.frontier[0][0]
    tight = cl.autoshard(_gpt(), None, 2, costs=ShardCosts(**CHEAP), device_memory=least, graph=gpt_plan.graph)
    assert tight.fits and tight.memory_bytes <= least
    for n, s in _megatron(tight).items():
        want = "row" if n.endswith(("attn.wo", "mlp.w2")) else "column"
        assert s == want, (n, s, tight)
        assert tight.inputs[n] == ("sharded" if want == "row" else "whole")
    assert tight.strategies["lm_head"] != "replicated"  # the budget is the least memory: everything is cut
    # a loose budget with cheap collectives may choose otherwise, but never slower
    assert gpt_plan.predicted_s <= tight.predicted_s
    styles = tight.tp_plan()
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    assert isinstance(styles["blocks.0.attn.wq"], ColwiseParallel)
    assert isinstance(styles["blocks.1.mlp.w2"], RowwiseParallel)
    assert "blocks.0.attn" in repr(tight) and "column" in tight.table()


def test_huge_budget_and_slow_collectives_replicate(gpt_plan):
    from colossal_lab.engine.planner.shard import ShardCosts, autoshard

    plan = autoshard(_gpt(), None, 2, costs=ShardCosts(**SLOW), device_memory=1 << 40, graph=gpt_plan.graph)
    assert set(plan.strategies.values()) == {"replicated"}, plan
    assert plan.tp_plan() == {} and plan.comm_s == 0.0
    # the same budget with near-free collectives shards: the cost model, not a default, decides
    fast = autoshard(_gpt(), None, 2, costs=ShardCosts(**CHEAP), device_memory=1 << 40, graph=gpt_plan.graph)
    assert any(s != "replicated" for s in fast.strategies.values()), fast
    # a budget between the extremes is met, with the fastest plan that fits
    mid = (gpt_plan.frontier[0][0] + plan.memory_bytes) // 2
    between = autoshard(_gpt(), None, 2, costs=ShardCosts(**SLOW), device_memory=mid, graph=gpt_plan.graph)
    assert between.memory_bytes <= mid < plan.memory_bytes
    assert plan.predicted_s < between.predicted_s


def test_two_d_only_where_it_applies(gpt_plan):
    from colossal_lab.engine.planner.shard import ShardCosts, autoshard

    # tp=2 is no 2D grid: 1D only, and 2D-only is refused
    assert "2d" not in autoshard(_gpt(), None, 2, costs=ShardCosts(), graph=gpt_plan.graph,
                                 modes=("1d", "2d")).alternatives
    with pytest.raises(ValueError, match="2D does not apply"):
        autoshard(_gpt(), None, 2, costs=ShardCosts(), graph=gpt_plan.graph, modes=("2d",))


def test_bad_input_errors_before_work():
    from colossal_lab.engine.planner.shard import ShardCosts, autoshard

    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x) if x.sum() > 0 else -self.fc(x)

    x = torch.randn(2, 8)
    for tp in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tp_size"):
            autoshard(DataDependent(), (x,), tp)  # checked before tracing the untraceable model
    for mem in (0, -5):
        with pytest.raises(ValueError, match="device_memory"):
            autoshard(DataDependent(), (x,), 2, device_memory=mem)
    with pytest.raises(ValueError, match=r"torch.export could not trace DataDependent.*Fix:.*torch.cond"):
        autoshard(DataDependent(), (x,), 2, costs=ShardCosts())
    with pytest.raises(ValueError, match=r"tp_size=3 divides the features of no nn.Linear"):
        autoshard(_mlp(), (x,), 3, costs=ShardCosts())
    with pytest.raises(ValueError, match=r"needs at least .* MiB per rank"):
        autoshard(_mlp(), (x,), 2, costs=ShardCosts(), device_memory=1000)
    odd = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8))
    with pytest.raises(ValueError, match=r"fixed '0' to 'column'.*tp_size=4 does not divide its out_features=6"):
        autoshard(odd, (x,), 4, costs=ShardCosts(), fixed={"0": "column"})
    with pytest.raises(ValueError, match="not an nn.Linear"):
        autoshard(_mlp(), (x,), 2, costs=ShardCosts(), fixed={"1": "column"})
    with pytest.raises(TypeError, match="compute"):
        autoshard(_mlp(), (x,), 2, costs=object())


def test_plain_mlp_gets_a_plan(mlp_plans):
    tight = mlp_plans["tight"]
    assert not hasattr(_mlp(), "tp_plan")
    assert all(s != "replicated" for s in tight.strategies.values()), tight
    # each layout the distributed test trains emits the DTensor style it names
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel

    styles = mlp_plans["row_whole_in+scatter+gather_in"].tp_plan()
    assert isinstance(styles["0"], RowwiseParallel) and styles["0"].input_layouts == (Replicate(),)
    assert styles["2"].output_layouts == (Shard(-1),)
    assert isinstance(styles["4"], PrepareModuleInput)


# ---- on real ranks ------------------------------------------------------------------------------

def _local_bytes(model):
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            t = p.to_local() if hasattr(p, "to_local") else p
            total += t.numel() * t.element_size()
    return total


def _boosted(make, plan, loss_fn):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    m = make()
    plugin = HybridParallelPlugin(tp_size=2, tp_plan=plan.tp_plan())
    booster = Booster(plugin=plugin)
    m, o, *_ = booster.boost(m, torch.optim.AdamW(m.parameters(), lr=1e-2), loss_fn)
    return booster, m, o


def _ranks(rank, world, mlp_plans, gpt_plan):
    from colossal_lab.engine.planner.shard import calibrate_shard_costs

    out = {"costs": calibrate_shard_costs(sizes=(16 << 10, 256 << 10), reps=2)}
    for key, plan in mlp_plans.items():
        booster, m, o = _boosted(_mlp, plan, mse)
        losses = []
        for b in _mlp_data():
            res = booster.execute_pipeline(iter([b]), m, mse, o)
            o.step()
            o.zero_grad()
            losses.append(res["loss"].item())
        out[key] = {"losses": losses, "bytes": _local_bytes(m)}
    booster, m, o = _boosted(_gpt, gpt_plan, lm_loss)
    res = booster.execute_pipeline(iter([_gpt_batch()]), m, lm_loss, o)
    out["gpt"] = {"losses": [res["loss"].item()], "bytes": _local_bytes(m)}
    return out


def _reference(make, loss_fn, batches):
    m = make()
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for b in batches:
        out = m(b["idx"])
        loss = loss_fn(out[0] if isinstance(out, tuple) else out, b)
        loss.backward()
        o.step()
        o.zero_grad()
        losses.append(loss.item())
    return losses


def test_plans_train_like_one_process_and_memory_matches(mlp_plans, gpt_plan):
    from colossal_lab.engine.planner.shard import ShardCosts, autoshard

    tight_gpt = autoshard(_gpt(), None, 2, costs=ShardCosts(**CHEAP), device_memory=gpt_plan.frontier[0][0],
                          graph=gpt_plan.graph)
    results = run_distributed(_ranks, 2, mlp_plans, tight_gpt, timeout=120)
    ref = _reference(_mlp, mse, _mlp_data())
    for key, plan in mlp_plans.items():
        for r in results:
            assert r[key]["losses"] == pytest.approx(ref, abs=1e-5), (key, plan, r[key]["losses"], ref)
            assert r[key]["bytes"] == plan.param_bytes, (key, plan)
    gpt_ref = _reference(_gpt, lm_loss, [_gpt_batch()])
    for r in results:
        assert r["gpt"]["losses"] == pytest.approx(gpt_ref, abs=1e-5)
        assert r["gpt"]["bytes"] == tight_gpt.param_bytes
    assert tight_gpt.param_bytes < _local_bytes(_gpt())  # the GPT plan really cut something
    c = results[0]["costs"]
    assert c == results[1]["costs"]  # both ranks agree on the calibration
    assert c.flops > 0 and c.allreduce_s_per_byte >= 0 and c.allgather_latency >= 0


def test_autoplans_calibration_prices_the_strategies_as_the_layout_search_does(gpt_plan):
    # the stretch asks for "the same cost model": an AutoPlan.calibration (what cl.autoplan measured
    # on the ranks) is read as the solver's costs: the matmul rate from the model's measured
    # forward+backward, the all-reduce from its curve, an all-gather as half an all-reduce's bytes
    from colossal_lab.engine.planner.layout import Costs
    from colossal_lab.engine.planner.shard import CalibratedCosts, autoshard

    def cal(ar_scale):
        return {"compute": {1: {"tokens": [64, 256], "f": [0.001, 0.004], "fb": [0.003, 0.012]}},
                "allreduce": {2: [(1 << 10, 1e-4 * ar_scale), (64 << 10, 1e-3 * ar_scale), (4 << 20, 4e-2 * ar_scale)]},
                "p2p": [], "adam_s_per_elem": 1e-9}

    g = gpt_plan.graph
    tokens = max(l.tokens for l in g.linears.values())
    total = sum(6.0 * l.tokens * l.in_features * l.out_features for l in g.linears.values())
    c = CalibratedCosts(cal(1.0), total, tokens)
    assert c.compute(total) == pytest.approx(Costs(cal(1.0)).forward_backward(1, tokens))
    assert c.allreduce(2, 1 << 20) == pytest.approx(Costs(cal(1.0)).allreduce(2, 1 << 20))
    assert c.allgather(2, 1 << 20) == pytest.approx(Costs(cal(1.0)).allreduce(2, 1 << 19))
    with pytest.raises(ValueError, match="groups of 4"):
        c.allreduce(4, 1 << 20)
    # slow collectives, no budget: nothing is cut; the tightest budget cuts, from the same figures
    slow = autoshard(_gpt(), None, 2, costs=cal(1e3), graph=g)
    assert set(slow.strategies.values()) == {"replicated"}
    tight = autoshard(_gpt(), None, 2, costs=cal(1e3), graph=g, device_memory=gpt_plan.frontier[0][0])
    assert any(v != "replicated" for v in tight.strategies.values())
    assert tight.predicted_s > slow.predicted_s
