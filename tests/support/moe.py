"""The tiny MoE GPT the MoE tests train (4 experts, top-2, z-loss on), optionally with experts starved by
a router bias so they receive no token in any step, and its single-process curve (losses, gradient norms,
final state) every distributed layout must follow."""

import torch

from colossal_lab.engine.models import GPT, GPTConfig

from .engine import batch, param_groups, train_step

E, STEPS, LR, CLIP = 4, 5, 3e-3, 1.0
STARVED = [1, 2]  # experts pushed out of every token's choice (a router bias) in the "starved" runs


def tiny_moe(starve: bool, n_layer: int = 2) -> GPT:
    """``n_layer=4``: enough blocks for two pipeline stages of two chunks each (interleaved, zero-bubble)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_expert=E, top_k=2, z_loss_coef=1e-3, n_layer=n_layer))
    if starve:
        for block in model.blocks.values():
            block.mlp.router.expert_bias[STARVED] = -1e4
    return model


def moe_reference(starve: bool, n_layer: int = 2):
    """Single process, plain torch AdamW + clip_grad_norm_: (losses, gradient norms, final state_dict)."""
    model = tiny_moe(starve, n_layer)
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    losses, norms = [], []
    for s in range(STEPS):
        _, loss = model(*batch(s))
        norms.append(train_step(model, opt, loss, CLIP))
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}
