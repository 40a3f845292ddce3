"""transformers' ``mla_kv_a_proj`` style: multi-head latent attention's joint key/value down-projection.

DeepSeek-V2's MLA (and the families built like it: GLM-4-MoE-Lite, MiniCPM3, ...) projects the hidden state
once, ``kv_a_proj_with_mqa``, to ``[k_pass (kv_lora_rank) | k_rot (qk_rope_head_dim)]``. ``k_pass`` goes through
a norm into ``kv_b_proj`` (column-parallel: its backward already sums the input's gradient over tp), but
``k_rot`` is shared by every head and goes straight to attention, which runs on this rank's heads only: its
gradient on each rank covers that rank's heads. The module stays whole on every tp rank; its output's last
``qk_rope_head_dim`` features pass through an identity whose backward sums the gradient over the tp group, so the
projection's (replicated) weight gets the whole gradient. What transformers' ``MlaKvAProjParallel`` does
(``distributed/tensor_parallel.py``), built here on a forward hook and DTensor (a replicated tensor handed back
with a ``Partial`` gradient placement: the same redistribution a column layer's input takes, as
:mod:`.local_linear` and :mod:`.multi_query`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ParallelStyle


class MlaKvAProj(ParallelStyle):
    """Keep the module whole; sum the gradient of its output's last ``rope_dim`` features over tp."""

    def __init__(self, rope_dim: int):
        if not isinstance(rope_dim, int) or rope_dim <= 0:
            raise ValueError(f"mla_kv_a_proj: the model config's qk_rope_head_dim must be a positive int, "
                             f"got {rope_dim!r}")
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        rope = self.rope_dim

        def hook(mod, args, out):
            if out.shape[-1] <= rope:
                raise ValueError(f"mla_kv_a_proj: {type(mod).__name__} gives {out.shape[-1]} features, not more "
                                 f"than qk_rope_head_dim={rope}")
            kv, rot = out.split([out.shape[-1] - rope, rope], dim=-1)
            # identity forward; backward sums the ranks' partial gradients (each covers its own heads) over tp
            rot = DTensor.from_local(rot, device_mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()])
            return torch.cat([kv, rot], dim=-1)

        module.register_forward_hook(hook)
        return module


def rope_dim(model: nn.Module):
    """The rotary part's width MLA's down-projection ends with: the (text) config's ``qk_rope_head_dim``."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "qk_rope_head_dim", None)
