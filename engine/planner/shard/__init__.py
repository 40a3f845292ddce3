"""``cl.autoshard``: a tensor-parallel strategy for every ``nn.Linear``, searched on the model's
graph (Colossal-AI's per-operator auto-parallel idea, 1D strategies).

```python
plan = cl.autoshard(model, (example_batch,), tp_size=2, device_memory=64 << 20)
plan                      # table: each linear's strategy, predicted step time, memory per rank
plugin = HybridParallelPlugin(tp_size=2, tp_plan=plan.tp_plan())
```

| module | what |
|---|---|
| ``graph`` | the ``torch.export`` graph analysed: :class:`ShardGraph` (linears, regions), :func:`analyse` |
| ``ops`` | the ATen vocabulary it reads (op names, shapes, bytes, which ops may carry a cut) |
| ``strategies`` | the five ways to cut a linear (:data:`STRATEGIES`) and what each costs |
| ``propagate`` | how a cut flows through the ops between linears, by op family |
| ``regions`` | the independent pieces of the choice and each one's Pareto set |
| ``costs`` | compute/collective seconds: :class:`ShardCosts`, :func:`calibrate_shard_costs`, :class:`CalibratedCosts` |
| ``search`` | :func:`autoshard`: regions merged by a knapsack on memory; 2D as a whole-model alternative |
| ``result`` | :class:`ShardPlan` |

Built on ``torch.export`` (the graph), DTensor's ``ColwiseParallel``/``RowwiseParallel``/
``PrepareModuleInput`` (what a plan becomes) and ``tp_nd`` (the 2D alternative). A layout for the
whole model is ``cl.autoplan`` (``colossal_lab.engine.planner.layout``), whose calibration this
search takes as its costs. Limits: linears only (embeddings and norms stay whole); no sequence
parallelism; no overlap of communication with compute; a tensor used by several ops must reach
each in one layout (conservative); activations are an upper bound; a view with a hard-coded full
width after a cut linear is judged infeasible. docs/autoshard.md has the details and what was
measured.
"""
from .costs import CalibratedCosts, ShardCosts, calibrate_shard_costs
from .graph import ShardGraph, analyse
from .result import ShardPlan
from .search import autoshard
from .strategies import STRATEGIES

#: the name :func:`calibrate_shard_costs` had; not ``cl.autoplan``'s ``layout.calibrate``
calibrate = calibrate_shard_costs

__all__ = ["autoshard", "ShardPlan", "ShardCosts", "CalibratedCosts", "ShardGraph", "calibrate",
           "calibrate_shard_costs", "analyse", "STRATEGIES"]
