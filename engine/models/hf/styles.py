"""transformers' tensor-parallel style names, translated into torch ``parallelize_module`` styles.

A transformers plan maps module names to style names (``"colwise"``, ``"embedding_rowwise"``, ...); the
names and their meanings changed across releases (transformers' ``distributed/tensor_parallel.py``,
``ALL_PARALLEL_STYLES``; before 5.x ``integrations/tensor_parallel.py``, ``ParallelInterface``). Each name
we know is read here as torch's own ``ColwiseParallel``/``RowwiseParallel`` with the layouts it stands for,
or as :mod:`.local_linear`'s styles where the module is a ``Conv1D`` (weight transposed) or packs parts,
or :mod:`.grad_sum`'s for a whole module with partial gradients, or :mod:`.mla`'s for multi-head latent
attention's key/value down-projection, or :mod:`.mamba`'s for a Mamba block's mixer. Names we know but do not
run yet (mixture-of-experts, fused row-packed weights) and
names we do not know each raise a ``ValueError`` that names the style and the module.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from .grad_sum import ReplicatedGradSum
from .local_linear import LocalColwise, LocalRowwise, is_conv1d
from .mamba import Mamba2MixerParallel, MambaMixerParallel
from .mla import MlaKvAProj
from .multi_query import MultiQueryColwise

# name -> (what it does, the names transformers gave it across releases are each an entry)
SUPPORTED = {
    "colwise": "output features sharded, input whole; output stays this rank's slice",
    "local_colwise": "as colwise (transformers < 5: without DTensor parameters)",
    "colwise_rep": "as colwise, output gathered whole (an LM head)",
    "colwise_gather_output": "as colwise_rep (transformers 5's name)",
    "rowwise": "input features sharded, outputs summed over tp (nn.Embedding: vocabulary sharded)",
    "local_rowwise": "as rowwise (transformers < 5: without DTensor parameters)",
    "rowwise_rep": "as rowwise, the whole input split locally first",
    "rowwise_split_input": "as rowwise_rep (transformers 5's name)",
    "embedding_rowwise": "nn.Embedding, vocabulary sharded, lookups summed over tp",
    "embedding_colwise": "nn.Embedding, hidden dim sharded, slices gathered",
    "packed_colwise": "as colwise on a weight packing equal parts (parts=k; transformers' default 2)",
    "replicate": "kept whole on every rank (nothing to do)",
    "sequence_parallel": "a norm between layers: kept whole (sequence_parallel=True cuts every such norm's "
                         "tokens, whatever the plan says: sequence.py)",
    "replicated_with_grad_allreduce": "kept whole, its gradients summed over tp (per-head norms: Qwen3's q_norm)",
    "mla_kv_a_proj": "multi-head latent attention's kv_a_proj_with_mqa: kept whole, the gradient of its output's "
                     "rotary part (qk_rope_head_dim) summed over tp",
    "mamba_mixer": "a Mamba block: its mixer's conv1d, dt_proj, A_log and D cut by inner channel, x_proj row-parallel "
                   "(in_proj and out_proj take entries of their own: mamba.py)",
    "mamba2_mixer": "a Mamba 2 block: its mixer cut by heads and groups, the packed in_proj and conv1d gathered "
                    "whole each forward for the rank's rows (out_proj takes an entry of its own: mamba.py)",
    "local_params": "a module whose own bare parameters the plan shards (attention sinks, planned colwise: one "
                    "value per head) reads them as this rank's shard (local_params.py)",
}
_MOE = "; expert parallelism: issue 31"
NOT_YET = {
    "packed_rowwise": "fused packed weights (row)", "local_packed_rowwise": "fused packed weights (row)",
    "local": "mixture-of-experts experts" + _MOE, "isolated": "mixture-of-experts experts" + _MOE,
    "gather": "mixture-of-experts output" + _MOE, "all_reduce": "mixture-of-experts output" + _MOE,
    "moe_tp_experts": "mixture-of-experts experts" + _MOE, "moe_identity_expert": "mixture-of-experts experts" + _MOE,
    "grouped_gemm": "mixture-of-experts experts" + _MOE, "ep_router": "mixture-of-experts router" + _MOE,
}


class OwnedRowwise(RowwiseParallel):
    """``RowwiseParallel`` whose local output is a tensor of its own, not the view ``to_local`` hands back: for a
    block that adds into it in place (Falcon's ``mlp_output += attention_output``), which autograd forbids on
    a view made inside a custom function. A table entry asks for it: ``("rowwise", {"owned": True})``."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        out = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return out.clone() if isinstance(out, torch.Tensor) and out._is_view() else out


def style_error(style, module_name: str) -> ValueError:
    where = f"tp plan entry {module_name!r}: "
    if style in NOT_YET:
        return ValueError(f"{where}style {style!r} ({NOT_YET[style]}) is a transformers style colossal-lab does not "
                          f"run yet; pass HybridParallelPlugin(tp_plan={{...}}) without it. Styles it runs: "
                          f"{sorted(SUPPORTED)}")
    return ValueError(f"{where}unknown tensor-parallel style {style!r}; known styles: {sorted(SUPPORTED)} "
                      f"(and, not run yet: {sorted(NOT_YET)})")


def _parse(entry) -> Tuple[str, dict]:
    """A plan value: a style name, or ``(name, options)`` (the built-in tables' packed parts)."""
    if isinstance(entry, tuple):
        return entry[0], dict(entry[1])
    return entry, {}


def check_name(entry, module_name: str) -> None:
    """Raise :func:`style_error` unless the entry's style is one this module runs."""
    name, _ = _parse(entry)
    if name not in SUPPORTED:
        raise style_error(name, module_name)


def translate(entry, module: nn.Module, module_name: str, rope_dim=None) -> Optional[ParallelStyle]:
    """The torch style for one plan entry on ``module`` (None: the module stays whole); ``rope_dim``: the
    model config's ``qk_rope_head_dim``, which ``mla_kv_a_proj`` needs."""
    check_name(entry, module_name)
    name, opts = _parse(entry)
    if name == "mla_kv_a_proj":
        if rope_dim is None:
            raise ValueError(f"tp plan entry {module_name!r}: style 'mla_kv_a_proj' needs the model config's "
                             "qk_rope_head_dim, which this config does not name; pass HybridParallelPlugin("
                             "tp_plan={...}) without it")
        return MlaKvAProj(rope_dim)
    if name == "mamba_mixer":
        return MambaMixerParallel()
    if name == "mamba2_mixer":
        return Mamba2MixerParallel()
    conv, emb = is_conv1d(module), isinstance(module, nn.Embedding)
    if name in ("replicate", "sequence_parallel", "local_params"):  # local_params: plan.torch_plan joins it
        return None                                                   # with its module's parameter entries
    if name == "replicated_with_grad_allreduce":
        return ReplicatedGradSum()
    if not (conv or emb or isinstance(module, nn.Linear)):
        raise ValueError(f"tp plan entry {module_name!r}: style {name!r} shards nn.Linear, nn.Embedding or Conv1D "
                         f"weights, not a {type(module).__name__}")
    if name == "colwise" and opts.get("multi_query"):  # q | k | v with one shared key/value head (multi_query.py)
        return MultiQueryColwise()
    if name.startswith("embedding_") and not emb:
        raise ValueError(f"tp plan entry {module_name!r}: style {name!r} is for nn.Embedding, "
                         f"not {type(module).__name__}")
    if name == "packed_colwise" or conv and name in ("colwise", "local_colwise"):
        return LocalColwise(parts=opts.get("parts", 2 if name == "packed_colwise" else 1))
    if conv and name in ("colwise_rep", "colwise_gather_output"):
        return LocalColwise(gather=True)
    if conv and name in ("rowwise", "local_rowwise"):
        return LocalRowwise()
    if conv:
        raise ValueError(f"tp plan entry {module_name!r}: style {name!r} is not run on Conv1D yet; "
                         "Conv1D takes colwise, colwise_gather_output, packed_colwise and rowwise")
    if name in ("colwise", "local_colwise"):
        return ColwiseParallel()
    if name in ("colwise_rep", "colwise_gather_output", "embedding_colwise"):
        return ColwiseParallel(output_layouts=Replicate())
    if name in ("rowwise", "local_rowwise"):
        # an embedding's input is token ids, whole on every rank; a linear's is the previous slice
        return RowwiseParallel(input_layouts=Replicate()) if emb else (OwnedRowwise() if opts.get("owned")
                                                                      else RowwiseParallel())
    return RowwiseParallel(input_layouts=Replicate())  # embedding_rowwise, rowwise_rep, rowwise_split_input


def weight_shard_dim(entry, module: nn.Module) -> Optional[int]:
    """The weight dimension a style shards (None: whole), so tied weights can be checked to agree."""
    name, opts = _parse(entry)
    if name in ("replicate", "sequence_parallel", "replicated_with_grad_allreduce", "mla_kv_a_proj", "mamba_mixer",
                "mamba2_mixer", "local_params"):
        return None  # (a Mamba block's own parameters: none; its mixer's are cut inside, mamba.py)
    col = "colwise" in name
    if isinstance(module, nn.Embedding):  # (vocab, hidden): rowwise shards the vocabulary
        return 1 if col else 0
    if is_conv1d(module):  # (in, out)
        return 1 if col else 0
    return 0 if col else 1  # nn.Linear (out, in)
