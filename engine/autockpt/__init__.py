"""Activation checkpointing within a memory budget: measure each layer once, then choose by a
dynamic program which layers (or which part of a layer) recompute in backward so that one
training step's peak activation memory stays under the budget with the least recompute time.

    from colossal_lab.engine.autockpt import plan_checkpointing, apply
    plan = plan_checkpointing(model, (idx, targets), budget=512 << 20)
    apply(model, plan)              # model.enable_activation_checkpointing(plan.layers)
    model.checkpoint_plan           # the plan: which layers, predicted peak and recompute seconds

    GPT(GPTConfig(..., activation_checkpointing="auto", activation_budget=512 << 20))
    # the same, planned on the first training forward's batch (again for a new batch shape)

**The budget** is the peak, over one training step (forward, loss, backward), of the bytes
allocated by the step and still live, above what was live when it began: activations, their
gradients and temporaries. The parameters, their ``.grad`` and the optimizer state are the
model's, not the step's (they are live before the step; ``cl.plan`` counts them), and so is the
batch. On CUDA these are ``torch.cuda.memory_allocated`` bytes; on CPU the bytes PyTorch's
allocator hands out (the profiler's allocation events). The caller is taken to hold the model's
output through backward, as ``logits, loss = model(idx, targets); loss.backward()`` does.

**The chain.** The model's layers run one after another: ``u = 0..n-1`` (a Sequential's children,
else the model's ModuleList/ModuleDict of ``num_layers()`` layers, e.g. GPT's ``blocks``), between
a *prefix* (embedding) and a *tail* (final norm, head, loss). Each layer takes one option: ``none``
(keep what it saves), ``layer`` (``torch.utils.checkpoint`` around the whole layer: keep its input,
recompute it in backward) or, for a model listing ``checkpoint_parts()`` (GPT: ``attn``, ``mlp``),
one sub-module checkpointed on its own (keep that sub-module's input, recompute only it).

**What is measured** (:func:`profile_checkpointing`, a few training steps on a sample batch, each
option applied to every layer once: ``K = 2 + len(parts)`` measured steps, layer ``u`` taking
option ``(u + r) % K`` in step ``r``, so no profiling step holds more than about the mean of the
options' memory, and never the whole no-checkpointing peak unless there is only one layer).
Marks are put in the allocator's event stream (or read off the CUDA allocator's counters) when
each layer's forward starts and ends and when the gradient of each layer's output and of the
first layer's input is ready, which cuts the step into intervals. Per layer and option:

* ``keep``      bytes live after the layer's forward minus before it (what stays for backward:
  its output plus what it saved or, checkpointed, nothing more; its input is the previous
  layer's output and was counted there); a layer's forward is taken from the end of the previous
  one's, so what its caller does before calling it (``checkpoint`` saving the RNG state) is its own,
* ``fwd_peak``  the peak within its forward above the bytes live when it began,
* ``bwd_delta`` live bytes after its backward minus before (negative: backward frees),
* ``bwd_peak``  the peak within its backward (recompute included) above the bytes live when it began,
* ``recompute_s`` the time of the recompute itself (the checkpointed module's forward, timed by
  its hooks while it runs inside backward, in a separate unprofiled step; the least of
  ``repeats``): wall seconds after a synchronize on CUDA, CPU seconds of the process
  (``time.process_time``, every intra-op thread) on CPU, which other work on a shared machine
  barely disturbs,
* ``overhead_s`` what the option costs beyond that recompute, one figure per option pooled over
  the layers: the same timed steps read the clock at the marks, so each layer's whole forward
  plus whole backward is timed under each option; the overhead is the median over layers of that
  time, less the same layer's time not checkpointed, less its recompute (the checkpoint wrapper,
  its saved RNG state, the recompute's own autograd graph; a few ms a region on a small GPT on CPU,
  where a whole block recomputes in ~43 ms),
* ``saved``     the bytes autograd saved for the layer, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` with storages deduplicated and parameters and
  buffers left out (reported, with the split into parts, to show where the memory is; the
  solver uses the allocator's figures, which also hold outputs, gradients and temporaries).

The prefix and the tail get the same figures once (the most over the profiling steps).

**What is modelled.** With ``s_u`` the live bytes when layer ``u``'s forward begins (prefix keep
plus ``keep`` of layers ``< u``) and ``K = tail keep + tail backward delta``:

* forward of ``u``:   ``s_u + fwd_peak_u``
* tail:               ``s_n + tail_peak`` and ``s_n + tail_keep + tail_bwd_peak``
* backward of ``u``:  ``s_u + keep_u + bwd_peak_u + K + sum_{v>u} r_v``, where
  ``r_v = keep_v + bwd_delta_v`` is what layer ``v`` leaves behind once its backward is done (its
  input's gradient instead of its output's); that barely depends on the option, and the model
  takes the largest over the options, so ``r`` is a constant of the layer
* prefix backward:    a constant.

Every figure of a layer is assumed to depend on its own option only (the additivity the plan
rests on; the tests and ``bench/activation_checkpoint.py`` check the measured peak of mixed plans
against the budget). The predicted recompute time of a plan is the sum over its checkpointed
layers of ``recompute_s + overhead_s`` (``OptionCost.cost_s``); what checkpointing adds to the
forward is in the overhead.

**The solver** (:func:`solve`). Every constraint is ``s_u + c_u(option) <= budget``, so the prefix
sum ``s`` is the whole state: a dynamic program over the chain (as Checkmate and rotor do for
memory-constrained recomputation) keeps, after each layer, the Pareto front of (``s``, recompute
seconds so far) among partial plans whose constraints held (a state with more bytes kept and no
less time is dropped, since every later constraint only gets harder with ``s``). The answer is
exact for the model above, and equal to trying every combination (the tests check it against
brute force). Were a front ever to exceed ``MAX_STATES`` states (long chains of unequal layers),
``s`` is rounded up to a grid, which only overestimates memory. The same program with "max" in
place of "+" gives the lowest peak any plan reaches (:func:`min_peak`), named in the error when a
budget is below it.

**Telemetry.** :func:`solve` (so :func:`plan_checkpointing` and everything planning through it) and
:func:`apply` put the plan on this process's telemetry bus as a ``CheckpointPlanEvent`` (rank from
``torch.distributed``, stage from the module's ``stage_index`` where it has one, per layer the option,
kept bytes and recompute seconds); nothing is built while nobody listens. ``solve(..., report=False)``
solves without reporting. ``colossal_lab.widgets.CheckpointPlanView`` draws it.
"""
from .events import plan_event
from .measure import profile_checkpointing
from .profile import LAYER, NONE, CheckpointProfile, OptionCost, UnitProfile
from .solver import CheckpointPlan, apply, min_peak, plan_checkpointing, solve

__all__ = ["LAYER", "NONE", "CheckpointPlan", "CheckpointProfile", "OptionCost", "UnitProfile", "apply", "min_peak",
           "plan_checkpointing", "plan_event", "profile_checkpointing", "solve"]
