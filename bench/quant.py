"""Benchmark: int8 weight-only vs fp32 vs bf16 on a briefly trained small GPT (CPU or GPU).

Trains the ``small`` preset for ``--steps`` on bytes of Python's stdlib sources (offline, see
``colossal_lab.engine.data``), then measures on the same weights, side by side:
model bytes, held-out perplexity (teacher-forced windows of the tail 10% of the corpus), and
KV-cache greedy decode tokens/s (batch 1; contenders alternate repeat by repeat).
Prints one JSON line: ratios are fp32/int8 and bf16/int8 bytes, int8/fp32 perplexity - 1,
and int8/fp32 and int8/bf16 tokens/s, plus the raw medians.

    OMP_NUM_THREADS=1 python bench/quant.py [--steps 300]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time

import torch

from colossal_lab.engine.data import ByteDataset, encode, split, stdlib_corpus
from colossal_lab.engine.models import GPT, GPTConfig
from colossal_lab.engine.quant import model_bytes, quantize


def train(cfg, tokens, steps, batch, seq, device, lr):
    torch.manual_seed(0)
    m = GPT(cfg).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        ix = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=g)
        x = torch.stack([tokens[i:i + seq] for i in ix]).to(device)
        y = torch.stack([tokens[i + 1:i + seq + 1] for i in ix]).to(device)
        for grp in opt.param_groups:  # warm-up then cosine
            grp["lr"] = lr * min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * step / steps))
        _, loss = m(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return m.eval(), losses


@torch.no_grad()
def perplexity(m, data, device, batch=8):
    tot, n = 0.0, 0
    for i in range(0, len(data), batch):
        items = [data[j] for j in range(i, min(i + batch, len(data)))]
        x = torch.stack([it["idx"] for it in items]).to(device)
        y = torch.stack([it["targets"] for it in items]).to(device)
        logits, _ = m(x)
        tot += torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
        n += y.numel()
    return math.exp(tot / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--corpus-bytes", type=int, default=1_500_000)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = GPTConfig.preset("small")
    train_tok, held = split(encode(stdlib_corpus(args.corpus_bytes)), 0.1)
    t0 = time.perf_counter()
    fp32, losses = train(cfg, train_tok, args.steps, args.batch, args.seq, device, args.lr)
    train_s = time.perf_counter() - t0
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    int8 = quantize(copy.deepcopy(fp32), "int8")
    models = {"fp32": fp32, "bf16": bf16, "int8": int8}

    data = ByteDataset(held, cfg.block_size)
    data = [data[i] for i in range(0, len(data), max(1, len(data) // args.eval_windows))][:args.eval_windows]
    ppl = {k: perplexity(m, data, device) for k, m in models.items()}
    size = {k: model_bytes(m) for k, m in models.items()}

    prompt = held[:32].unsqueeze(0).to(device)
    for m in models.values():
        m.generate(prompt, 4, temperature=0)  # warm-up
    times = {k: [] for k in models}
    outs = {}
    for _ in range(args.repeats):
        for k, m in models.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            outs[k] = m.generate(prompt, args.new_tokens, temperature=0)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t)
    tps = {k: args.new_tokens / statistics.median(v) for k, v in times.items()}
    agree = (outs["int8"][0, 32:] == outs["fp32"][0, 32:]).float().mean().item()
    print(json.dumps({
        "device": str(device), "threads": torch.get_num_threads(), "preset": "small",
        "train_steps": args.steps, "train_seconds": round(train_s, 1),
        "train_loss_first_last": [round(losses[0], 3), round(statistics.mean(losses[-20:]), 3)],
        "bytes": size,
        "bytes_ratio_fp32_over_int8": round(size["fp32"] / size["int8"], 3),
        "bytes_ratio_bf16_over_int8": round(size["bf16"] / size["int8"], 3),
        "heldout_ppl": {k: round(v, 4) for k, v in ppl.items()},
        "ppl_rel_increase_int8_vs_fp32": round(ppl["int8"] / ppl["fp32"] - 1, 5),
        "ppl_rel_increase_bf16_vs_fp32": round(ppl["bf16"] / ppl["fp32"] - 1, 5),
        "decode_tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
        "tps_ratio_int8_over_fp32": round(tps["int8"] / tps["fp32"], 3),
        "tps_ratio_int8_over_bf16": round(tps["int8"] / tps["bf16"], 3),
        "greedy_token_agreement_int8_vs_fp32": round(agree, 3),
    }))


if __name__ == "__main__":
    main()
