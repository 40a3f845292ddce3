"""The main job (``scripts/main.sh``): launch 2 CPU ranks and run one distributed training step.

``python -m colossal_lab.demo [--n 2] [--steps 1]`` starts a cluster with ``cl.launch``, trains
the tiny reference GPT with plain torch DDP for ``--steps`` steps on random tokens, prints the
all-reduced loss of each step and checks that every rank ends with identical weights (which
DDP's gradient all-reduce guarantees). Exits non-zero if anything disagrees.
"""

from __future__ import annotations

import argparse
import sys
import time


def train_steps(steps: int, seed: int = 0) -> dict:
    """Runs on every rank: ``steps`` DDP steps of the tiny GPT; losses averaged over ranks."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from colossal_lab.engine.models import GPT, GPTConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)  # same initial weights on every rank
    cfg = GPTConfig.preset("tiny")
    model = DDP(GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed + 1 + rank)  # each rank its own data shard
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1), generator=gen)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().item()
    return {"rank": rank, "losses": losses, "checksum": checksum}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m colossal_lab.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2, help="number of ranks (default 2)")
    ap.add_argument("--steps", type=int, default=1, help="training steps (default 1)")
    args = ap.parse_args(argv)

    import colossal_lab as cl

    t0 = time.perf_counter()
    with cl.launch(n=args.n, backend="gloo", timeout=120) as cluster:
        print(f"launched {cluster.n} ranks (gloo) in {time.perf_counter() - t0:.1f}s; "
              f"MASTER_PORT={cluster.master_port}, pids={cluster.pids}")
        t1 = time.perf_counter()
        out = cluster.run(train_steps, args.steps)
        print(f"{args.steps} DDP step(s) of the tiny GPT in {time.perf_counter() - t1:.2f}s")
    for step in range(args.steps):
        print(f"step {step}: all-reduced loss {out[0]['losses'][step]:.4f}")
    same_loss = all(o["losses"] == out[0]["losses"] for o in out)
    same_weights = all(abs(o["checksum"] - out[0]["checksum"]) < 1e-9 for o in out)
    print(f"ranks agree on the loss: {same_loss}; identical weights after the step: {same_weights}")
    return 0 if same_loss and same_weights else 1


if __name__ == "__main__":
    sys.exit(main())
