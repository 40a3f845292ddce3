"""The pieces ``HybridParallelPlugin`` (``..hybrid_parallel``) is built from, one idea per file.

==========================  =======================================================================
``dims.py``                 ``ParallelDims``: the (dp, pp, cp, tp) sizes, the mesh, every group cut from it
``checks.py``               what configure asks of the model, checked before any process group exists
``apply.py``                the ``apply_*`` steps configure composes (cp, tp, checkpointing, pipeline, ...)
``auto_checkpoint.py``      ``activation_checkpointing="auto"``: the per-stage planning hook
``grads.py``                tied copies across stages and the dp × cp gradient mean at ``step()``
``module.py``               ``HybridParallelModule``: the boosted model
``optimizer.py``            ``HybridParallelOptimizer``: the boosted optimizer
==========================  =======================================================================
"""
