"""Benchmark: int8 weight-only vs fp32 vs bf16 on a briefly trained small GPT (CPU or GPU).

Trains the ``small`` preset for ``--steps`` on bytes of Python's stdlib sources (offline, see
``colossal_lab.engine.data``), then measures on the same weights, side by side:
model bytes, held-out perplexity (teacher-forced windows of the tail 10% of the corpus), and
KV-cache greedy decode tokens/s (batch 1; contenders alternate repeat by repeat).
Contenders: fp32, bf16, int8 (fp32 activations) and int8 with bf16 activations
(``quantize(..., dtype=torch.bfloat16)``). On CPU, int8 decode runs our C kernel
(``colossal_lab.kernels.int8_linear_cpu``); the contender ``int8_aten`` is the same int8 model
with that kernel switched off (torch's ``aten._weight_int8pack_mm`` with bf16 casts around it),
so one run shows what the kernel buys. Decode speed is also timed on a wider untrained model
(``--wide-embd``), since the small preset's matrices fit in CPU caches.
Prints one JSON line: ratios are fp32/int8 and bf16/int8 bytes, int8/fp32 perplexity - 1,
and int8/fp32 and int8/bf16 tokens/s (from wall-clock medians; ``*_cpu`` ratios use the
process CPU time of the same runs, which a busy shared machine disturbs less), plus the raw medians.

    OMP_NUM_THREADS=1 python bench/quant.py [--steps 300] [--repeats 9]
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
from colossal_lab.kernels import int8_linear_cpu


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


def decode_tps(models, prompt, new_tokens, repeats, device):
    """Tokens/s from the median wall-clock and the median process CPU time per contender.

    A contender named ``int8_aten`` runs with the C int8 kernel switched off."""
    def run(k, m, n):
        prev = int8_linear_cpu.set_enabled(k != "int8_aten")
        try:
            return m.generate(prompt, n, temperature=0)
        finally:
            int8_linear_cpu.set_enabled(prev)

    for k, m in models.items():
        run(k, m, 4)  # warm-up
    wall, cpu = {k: [] for k in models}, {k: [] for k in models}
    outs = {}
    for _ in range(repeats):  # contenders alternate, so machine-load drift hits all of them
        for k, m in models.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t, c = time.perf_counter(), time.process_time()
            outs[k] = run(k, m, new_tokens)
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
    return ({k: new_tokens / statistics.median(v) for k, v in wall.items()},
            {k: new_tokens / statistics.median(v) for k, v in cpu.items()}, outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--corpus-bytes", type=int, default=1_500_000)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=9, help="interleaved decode repeats per contender (medians)")
    ap.add_argument("--wide-embd", type=int, default=1024, help="width of the untrained decode-speed model")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = GPTConfig.preset("small")
    train_tok, held = split(encode(stdlib_corpus(args.corpus_bytes)), 0.1)
    t0 = time.perf_counter()
    fp32, losses = train(cfg, train_tok, args.steps, args.batch, args.seq, device, args.lr)
    train_s = time.perf_counter() - t0
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    int8 = quantize(copy.deepcopy(fp32), "int8")
    int8_bf16 = quantize(copy.deepcopy(fp32), "int8", dtype=torch.bfloat16)  # bf16 activations
    models = {"fp32": fp32, "bf16": bf16, "int8": int8, "int8_bf16act": int8_bf16}
    if device.type == "cpu":
        models["int8_aten"] = int8  # same weights, torch's aten int8 route instead of our C kernel

    data = ByteDataset(held, cfg.block_size)
    data = [data[i] for i in range(0, len(data), max(1, len(data) // args.eval_windows))][:args.eval_windows]
    ppl = {k: perplexity(m, data, device) for k, m in models.items() if k != "int8_aten"}
    size = {k: model_bytes(m) for k, m in models.items() if k != "int8_aten"}

    prompt = held[:32].unsqueeze(0).to(device)
    tps, tps_cpu, outs = decode_tps(models, prompt, args.new_tokens, args.repeats, device)
    agree = (outs["int8"][0, 32:] == outs["fp32"][0, 32:]).float().mean().item()
    # Decode speed does not depend on the weights' values: also time a wider, untrained model
    # whose matrices no longer sit in the CPU caches (where weight bytes decide the speed).
    torch.manual_seed(0)
    wide_cfg = GPTConfig.preset("small", n_embd=args.wide_embd, n_head=args.wide_embd // 64)
    wide = GPT(wide_cfg).to(device).eval()
    wide_models = {"fp32": wide, "bf16": copy.deepcopy(wide).to(torch.bfloat16),
                   "int8": quantize(copy.deepcopy(wide), "int8"),
                   "int8_bf16act": quantize(copy.deepcopy(wide), "int8", dtype=torch.bfloat16)}
    if device.type == "cpu":
        wide_models["int8_aten"] = wide_models["int8"]
    wide_tps, wide_tps_cpu, _ = decode_tps(wide_models, prompt, args.new_tokens, args.repeats, device)

    def ratios(t, tc):
        r = {"tps_ratio_int8_over_fp32": round(t["int8"] / t["fp32"], 3),
             "tps_ratio_int8_over_fp32_cpu": round(tc["int8"] / tc["fp32"], 3),
             "tps_ratio_int8_over_bf16": round(t["int8"] / t["bf16"], 3),
             "tps_ratio_int8_bf16act_over_fp32": round(t["int8_bf16act"] / t["fp32"], 3)}
        if "int8_aten" in t:
            r["tps_ratio_int8_aten_over_fp32"] = round(t["int8_aten"] / t["fp32"], 3)
            r["tps_ratio_int8_aten_over_fp32_cpu"] = round(tc["int8_aten"] / tc["fp32"], 3)
        return r

    print(json.dumps({
        "device": str(device), "threads": torch.get_num_threads(), "preset": "small",
        "int8_cpu_kernel": (int8_linear_cpu.isa() if int8_linear_cpu.available()
                            else f"unavailable: {int8_linear_cpu.unavailable_reason()}"),
        "decode_repeats": args.repeats, "new_tokens": args.new_tokens,
        "train_steps": args.steps, "train_seconds": round(train_s, 1),
        "train_loss_first_last": [round(losses[0], 3), round(statistics.mean(losses[-20:]), 3)],
        "bytes": size,
        "bytes_ratio_fp32_over_int8": round(size["fp32"] / size["int8"], 3),
        "bytes_ratio_bf16_over_int8": round(size["bf16"] / size["int8"], 3),
        "heldout_ppl": {k: round(v, 4) for k, v in ppl.items()},
        "ppl_rel_increase_int8_vs_fp32": round(ppl["int8"] / ppl["fp32"] - 1, 5),
        "ppl_rel_increase_bf16_vs_fp32": round(ppl["bf16"] / ppl["fp32"] - 1, 5),
        "decode_tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
        "decode_tokens_per_cpu_s": {k: round(v, 1) for k, v in tps_cpu.items()},
        **ratios(tps, tps_cpu),
        "greedy_token_agreement_int8_vs_fp32": round(agree, 3),
        "wide_untrained": {"n_embd": args.wide_embd, "n_layer": wide_cfg.n_layer,
                           "decode_tokens_per_s": {k: round(v, 1) for k, v in wide_tps.items()},
                           "decode_tokens_per_cpu_s": {k: round(v, 1) for k, v in wide_tps_cpu.items()},
                           **ratios(wide_tps, wide_tps_cpu)},
    }))


if __name__ == "__main__":
    main()
