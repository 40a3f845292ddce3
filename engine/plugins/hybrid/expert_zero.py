"""ZeRO-1 under expert parallelism: one ``ZeroRedundancyOptimizer`` per kind of parameter.

A non-expert parameter is the same on every dp (× cp) rank; an expert slice is the same only on its
expert-dp group (the ranks at the same place of every EP group, hybrid/experts.py). Torch's
``ZeroRedundancyOptimizer`` shards one optimizer's state over one group and, after its step, broadcasts
each parameter from the rank owning its state to that group: one ZeRO over dp would overwrite the other EP
ranks' experts with the owner's. So :class:`ExpertSplitOptimizer` steps two optimizers with the user's
class, param groups and hyper-parameters: a ZeRO over dp × cp for the non-expert parameters and one over the
expert-dp group for the expert slices (a plain optimizer when ``dp == ep``: each rank then holds the only
copy of its experts, nothing to shard). Colossal-AI's MoE plugin splits its ZeRO the same way (its
``moe_dp_group`` for experts); here both halves are torch's.
"""

from __future__ import annotations

import functools
from typing import Dict, List

from torch.optim import Optimizer

from ...wrappers import rebuild_optimizer


class ExpertSplitOptimizer(Optimizer):
    """``parts``: [the non-expert parameters' optimizer, the experts' optimizer]. ``param_groups`` are the
    parts' own group dicts (an LR scheduler's change reaches the part that owns the group); ``state`` is
    this rank's shard of both (a ZeRO part's local optimizer holds it)."""

    def __init__(self, parts: List[Optimizer]):
        self.parts = parts
        # Optimizer.__init__ appends the dicts it is given (it does not copy them)
        super().__init__([g for p in parts for g in p.param_groups], parts[0].defaults)

    @property
    def state(self):
        out = {}
        for p in self.parts:
            out.update(getattr(p, "optim", p).state)  # ZeroRedundancyOptimizer: its local shard's optimizer
        return out

    @state.setter
    def state(self, _):  # Optimizer.__init__ assigns an empty state; the parts hold it
        pass

    def step(self, closure=None):
        loss = None
        for p in self.parts:
            out = p.step(closure)
            loss = out if loss is None else loss
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parts:
            p.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"parts": [getattr(p, "optim", p).state_dict() for p in self.parts]}

    def load_state_dict(self, sd):
        for p, s in zip(self.parts, sd["parts"]):
            getattr(p, "optim", p).load_state_dict(s)


def split_zero(optimizer: Optimizer, names_of: Dict[int, List[str]], model, dims, experts) -> ExpertSplitOptimizer:
    """The user's optimizer rebuilt as ZeRO-1 over dp × cp (non-expert parameters) and over the expert-dp
    group (this rank's expert slices)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    params = dict(model.named_model_parameters())
    shared = {n: p for n, p in params.items() if id(p) not in experts.params}
    own = {n: p for n, p in params.items() if id(p) in experts.params}

    def zero(group):
        return functools.partial(ZeroRedundancyOptimizer, optimizer_class=type(optimizer), process_group=group)

    parts = [rebuild_optimizer(optimizer, names_of, shared, optimizer_class=zero(dims.grad_group), partial=True)]
    ex_cls = zero(experts.expert_dp_group) if experts.expert_dp_group is not None else None
    parts.append(rebuild_optimizer(optimizer, names_of, own, optimizer_class=ex_cls, partial=True))
    return ExpertSplitOptimizer(parts)
