"""A tied weight's copies on two pipeline ranks sum their gradients, also when one rank's copy got none this
step (a stage that did not use it): that rank joins the sum with zeros instead of skipping the collective its
peer waits in (before: a hang). With no gradient on any rank the copies stay without one, as one process leaves
an unused weight's. Two real gloo ranks, ``TiedCopies.sum_grads`` itself."""

import torch
import torch.distributed as dist
from support.dist import run_distributed


def _rank(rank, world):
    from colossal_lab.engine.plugins.hybrid.grads import TiedCopies

    out = {}
    for case, has in {"both": (True, True), "first only": (True, False), "second only": (False, True),
                      "neither": (False, False)}.items():
        p = torch.nn.Parameter(torch.zeros(3, 2))
        if has[rank]:
            p.grad = torch.full((3, 2), float(rank + 1))
        ties = TiedCopies()
        ties.copies = [([p], dist.group.WORLD)]
        ties.sum_grads()
        out[case] = None if p.grad is None else p.grad.clone()
    return out


def test_copies_sum_their_gradients_when_a_stage_has_none():
    results = run_distributed(_rank, 2, preload=True, timeout=120)
    expect = {"both": 3.0, "first only": 1.0, "second only": 2.0, "neither": None}
    for rank, got in enumerate(results):
        for case, value in expect.items():
            if value is None:
                assert got[case] is None, (rank, case)
            else:
                torch.testing.assert_close(got[case], torch.full((3, 2), value), msg=f"rank {rank}, {case}")
