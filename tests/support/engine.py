"""Shared bits of the engine tests: the tiny GPT, a fixed data stream, a plain-torch reference, the
criterion the plugins are boosted with, one training step (booster or plain torch)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from colossal_lab.engine.models import GPT, GPTConfig

GLOBAL_BATCH, SEQ, LR = 8, 32, 3e-3


def tiny_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("tiny"))


def batch(step: int, rank: int = 0, world: int = 1):
    """The global batch of ``step`` (the same on every rank), and this rank's slice of it."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, 256, (GLOBAL_BATCH, 1), generator=g)
    # a learnable stream: each token is a fixed affine function of the previous one (mod 256)
    cols = [start]
    for _ in range(SEQ):
        cols.append((cols[-1] * 5 + 3) % 256)
    x = torch.cat(cols, dim=1)
    idx, tgt = x[:, :-1], x[:, 1:]
    n = GLOBAL_BATCH // world
    return idx[rank * n:(rank + 1) * n], tgt[rank * n:(rank + 1) * n]


def lm_loss(out, batch):
    """Next-token cross-entropy of logits ``out`` (batch x seq x vocab) against ``batch["targets"]``,
    computed in fp32 whatever the logits' dtype: the criterion the tests boost with."""
    return F.cross_entropy(out.flatten(0, 1).float(), batch["targets"].flatten())


def param_groups(model):
    """Two groups as real recipes have them: weight decay on matrices, none on norms."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def reference_losses(steps: int, clip: float = 1.0):
    """Single process, plain torch: the loss curve every plugin must follow."""
    model = tiny_model()
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    out = []
    for s in range(steps):
        _, loss = model(*batch(s))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def train_step(model, opt, loss, clip: float, booster=None) -> float:
    """One optimizer step on ``loss``: backward (the booster's, or plain torch's), clip the gradients to
    ``clip`` (the booster's global norm, or ``clip_grad_norm_``), step, zero the gradients. Returns the
    gradient norm before clipping."""
    if booster:
        booster.backward(loss, opt)
        norm = booster.clip_grad_by_norm(opt, clip)
    else:
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad()
    return float(norm)


def boosted_losses(model, opt, booster, steps: int, rank: int, world: int, clip: float = 1.0) -> list:
    """``steps`` training steps of a boosted tiny GPT on this rank's slice of each global ``batch``
    (``train_step``); the loss averaged over the ranks at each step, what ``reference_losses`` gives."""
    losses = []
    for s in range(steps):
        _, loss = model(*batch(s, rank, world))
        train_step(model, opt, loss, clip, booster)
        losses.append(global_mean(loss))
    return losses


def plain_losses(model, data, make_opt) -> list:
    """One process, plain torch, whole batches: one ``make_opt(params)`` step per batch of ``data``
    (dicts with ``idx`` and ``targets``) on ``lm_loss``; the curve a parallel run of the same follows."""
    opt = make_opt(model.parameters())
    out = []
    for b in data:
        loss = lm_loss(model(b["idx"])[0], b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def assert_follows(case, losses, norms, ref, ref_norms, rel: float = 1e-4) -> None:
    """A run's losses and gradient norms equal the single-process reference at every step, within
    ``rel``; ``case`` names the run in the failure."""
    import pytest

    assert losses == pytest.approx(ref, rel=rel), (case, losses, ref)
    assert norms == pytest.approx(ref_norms, rel=rel), (case, norms, ref_norms)


def global_mean(t: torch.Tensor) -> float:
    t = t.detach().clone().float()
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()


def state_bytes(optimizer) -> int:
    """Bytes of optimizer-state tensors this rank holds (local shards of DTensors)."""
    total = 0
    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                v = v.to_local() if hasattr(v, "to_local") else v
                total += v.numel() * v.element_size()
    return total
