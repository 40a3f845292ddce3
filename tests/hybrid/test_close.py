"""``HybridParallelPlugin.close()`` gives back the process groups a boost made: without it every
boost leaves gloo groups (threads, sockets) behind on every rank, which a notebook that boosts
again and again (a search, a sweep) piles up."""

import torch
from support.dist import run_distributed
from support.engine import lm_loss


def _threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


def _boost_step(kw, close):
    from colossal_lab.engine import Booster
    from colossal_lab.engine.models import GPT, GPTConfig
    from colossal_lab.engine.plugins import HybridParallelPlugin

    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny")
    plugin = HybridParallelPlugin(**kw)
    booster = Booster(plugin=plugin)
    model = GPT(cfg)
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1), lm_loss)
    x = torch.randint(0, cfg.vocab_size, (4, 32))
    booster.execute_pipeline(iter([{"idx": x, "targets": x}]), model, lm_loss, opt)
    if close:
        plugin.close()


def _rank(rank, world):
    import torch.distributed as dist

    out = {}
    for close in (True, False):
        counts = []
        for kw in [dict(tp_size=2), dict(cp_size=2), dict(pp_size=2, num_microbatches=2), dict(tp_size=2)] * 2:
            _boost_step(kw, close)
            dist.barrier()
            counts.append(_threads())
        out[close] = counts
    return out


def test_close_gives_back_what_each_boost_made():
    for r in run_distributed(_rank, 2, timeout=240):
        closed, kept = r[True], r[False]
        assert closed[-1] <= closed[0] + 2, closed           # flat: each boost's groups are gone
        assert kept[-1] - kept[0] > closed[-1] - closed[0], (kept, closed)  # what close() saved


def _rank_again(rank, world):
    # dp2 x tp2: the tp groups are not the world, so close() destroys them; the next boost's
    # mesh equals the closed one, and DTensor's cached shardings must not name the old groups
    for _ in range(3):
        _boost_step(dict(tp_size=2), close=True)
    return True


def test_boost_after_close_with_equal_mesh():
    assert run_distributed(_rank_again, 4, timeout=240) == [True] * 4
