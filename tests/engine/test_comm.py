"""Every collective the engine makes runs on its process group's device (issue: fp16 on NCCL
crashed in the loss scaler's overflow vote, a CPU tensor handed to an NCCL all-reduce).

Real gloo ranks train every plugin under fp16 (overflow vote, clip, checkpoint save) inside
:class:`support.collectives.CollectiveChecker`; on a GPU the same runs on NCCL."""

import pytest
import torch
import torch.distributed as dist
from support.collectives import CollectiveChecker
from support.dist import run_distributed
from support.engine import lm_loss


def test_device_rule_per_backend():
    from colossal_lab.engine.comm import _pick_device, device_types_of

    assert device_types_of("nccl") == ("cuda",)
    assert "cpu" in device_types_of("gloo")
    assert device_types_of("cpu:gloo,cuda:nccl") == ("cpu", "cuda")
    assert _pick_device(device_types_of("gloo")) == torch.device("cpu")
    assert _pick_device(device_types_of("cpu:gloo,cuda:nccl")) == torch.device("cpu")
    if torch.cuda.is_available():
        assert _pick_device(device_types_of("nccl")).type == "cuda"


def _comm_ops(rank, world):
    """comm's helpers on a real group: values, in-place semantics, vote."""
    from colossal_lab.engine import comm

    t = torch.tensor([float(rank + 1)])
    assert comm.all_reduce(t) is t and t.item() == 3.0
    assert comm.any_rank(rank == 1) is True and comm.any_rank(False) is False
    assert comm.reduce_values([rank, 2.0], op=dist.ReduceOp.MAX) == [1.0, 2.0]
    parts = [torch.empty(2) for _ in range(world)]
    comm.all_gather(parts, torch.full((2,), float(rank)))
    return [p.tolist() for p in parts]


def test_comm_helpers_on_real_ranks():
    assert run_distributed(_comm_ops, 2) == [[[0.0, 0.0], [1.0, 1.0]]] * 2


def _gpt():
    from colossal_lab.engine.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", n_layer=2))


def _train(name, tmp, rank):
    """Two fp16 steps (one forced overflow), a clip and a checkpoint under plugin ``name``."""
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import DDPPlugin, GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin

    plugin = {"ddp": lambda: DDPPlugin(), "zero1": lambda: LowLevelZeroPlugin(stage=1),
              "zero2": lambda: LowLevelZeroPlugin(stage=2), "gemini": lambda: GeminiPlugin(placement_policy="cpu"),
              "tp2": lambda: HybridParallelPlugin(tp_size=2),
              "pp2": lambda: HybridParallelPlugin(pp_size=2, num_microbatches=2)}[name]()
    booster = Booster(plugin=plugin, mixed_precision="fp16")
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, crit, *_ = booster.boost(model, opt, lm_loss)
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    for step in range(2):
        if name == "pp2":
            booster.execute_pipeline(iter([{"idx": x, "targets": x}]), model, crit, opt)
        else:
            _, loss = model(x, x)
            booster.backward(loss * (float("inf") if step == 0 and rank == 0 else 1.0), opt)
        booster.clip_grad_by_norm(opt, 1.0)
        opt.step()
        opt.zero_grad()
    booster.save_model(model, f"{tmp}/{name}-model")
    booster.save_optimizer(opt, f"{tmp}/{name}-optim")
    if hasattr(plugin, "close"):
        plugin.close()


def _int8_tp(rank):
    from colossal_lab.engine.quant import quantize
    from colossal_lab.engine.quant.tp import shard_int8_tp

    m = quantize(_gpt().eval(), "int8")
    shard_int8_tp(m)
    m(torch.randint(0, 256, (1, 8)))


def _checked(rank, world, names, tmp):
    with CollectiveChecker() as chk:
        for name in names:
            if name == "int8_tp":
                _int8_tp(rank)
            else:
                _train(name, tmp, rank)
    return chk.violations, chk.calls, chk.engine_calls


PLUGINS = ["ddp", "zero1", "zero2", "gemini", "tp2", "pp2", "int8_tp"]


def test_engine_collectives_go_through_comm_on_gloo(tmp_path):
    for violations, calls, engine_calls in run_distributed(_checked, 2, PLUGINS, str(tmp_path), timeout=600):
        assert calls > 0 and engine_calls > 0  # the checker saw the engine's own collectives
        assert violations == [], "\n".join(sorted(set(violations)))


def _bad(rank, world):
    from colossal_lab.engine import comm

    with CollectiveChecker() as chk:
        exec(compile("import torch.distributed as dist\ndist.all_reduce(torch.zeros(1))\n",
                     comm.__file__.replace("comm.py", "scaler_like.py"), "exec"), {"torch": torch})
        comm.any_rank(False)
    return chk.violations


def test_checker_catches_a_direct_engine_collective():
    """The checker itself: an engine-module call around comm is reported; comm's is not."""
    violations = run_distributed(_bad, 2)[0]
    assert len(violations) == 1 and "scaler_like.py" in violations[0]


def _one_counter(rank, world):
    """N-d tensor parallelism's, context parallelism's and the engine's own collectives on two real
    ranks, under the checker: what comm's one counter holds by kind and label, and its spans."""
    from colossal_lab.engine import comm
    from colossal_lab.engine import context_parallel as cp
    from colossal_lab.engine.pipeline.timing import SpanRecorder
    from colossal_lab.engine.tp_nd import COUNTER, counter
    from colossal_lab.engine.tp_nd.grid import Group

    g = Group(axes=("row",), pg=dist.group.WORLD, ranks=(0, 1), rank=rank)
    x = torch.ones(4, 8)  # 128 bytes
    q = cp.shard_sequence(torch.randn(1, 2, 16, 4, generator=torch.Generator().manual_seed(0)), rank, world,
                          "ring", dim=2)  # (1, 2, 8, 4): 256 bytes
    comm.COUNTER.reset()
    rec = SpanRecorder(rank=rank, stage=0)
    with CollectiveChecker() as chk, comm.spans(rec), torch.no_grad():
        counter.broadcast(x.clone(), 0, g, "summa.bcast_x")
        counter.all_reduce(x.clone(), g, "norm.stats")
        counter.all_gather(x, g, "3d.gather_x")
        counter.reduce_scatter(x, g, "3d.rs_y")
        cp.ring_attention(q, q, q, None)
        cp.ulysses_attention(q, q, q, None)
        comm.reduce_values([1.0])  # the engine's own bookkeeping: counted, not a span
    return {"kinds": comm.COUNTER.by_kind(), "labels": comm.COUNTER.by_label(), "total": comm.COUNTER.total,
            "tp": COUNTER.snapshot(), "cp": cp.COMM.snapshot(), "views": COUNTER.total + cp.COMM.total,
            "spans": len(rec.spans), "violations": chk.violations}


def test_tp_nd_cp_and_engine_collectives_are_counted_in_comm():
    for rank, got in enumerate(run_distributed(_one_counter, 2)):
        assert got["violations"] == [], got["violations"]
        assert got["kinds"] == {"broadcast": 128 if rank == 0 else 0, "all_reduce": 128 + 8, "all_gather": 128,
                                "reduce_scatter": 64, "p2p": 2 * 256, "all_to_all": (3 * 256 + 256) // 2}
        assert got["tp"] == {"summa.bcast_x": 128 if rank == 0 else 0, "norm.stats": 128, "3d.gather_x": 128,
                             "3d.rs_y": 64}
        assert got["cp"] == {"ring_kv": 512, "all_to_all": 512}
        assert got["labels"][""] == 8 and got["views"] + 8 == got["total"]
        assert got["spans"] == 4 + 1 + 2  # tp's calls, the ring's one wait, Ulysses' two all-to-alls


@pytest.mark.gpu
def test_engine_collectives_on_nccl(tmp_path):
    names = ["ddp", "zero1", "zero2", "gemini", "tp2", "pp2"] if torch.cuda.device_count() >= 2 else \
        ["ddp", "zero1", "zero2", "gemini"]
    world = 2 if torch.cuda.device_count() >= 2 else 1
    for violations, calls, _ in run_distributed(_checked_cuda, world, names, str(tmp_path), backend="nccl"):
        assert calls > 0 and violations == [], violations


def _checked_cuda(rank, world, names, tmp):
    torch.cuda.set_device(rank)
    return _checked(rank, world, names, tmp)
