"""Benchmark: each kernel against its baseline; on a GPU, the measurements the dispatcher decides by.

On CUDA "ours" is the Triton kernel (``backend="triton"``): flash attention fwd+bwd vs torch SDPA,
RMSNorm fwd+bwd vs the unfused torch norm, int8 weight-only linear vs a bf16 linear at decode shapes,
fused AdamW vs ``torch.optim.AdamW(fused=True)``; ``--record FILE`` writes one record per op for this
GPU in the form of ``kernels/measured.py`` (``backend=None`` runs Triton only where its ratio is >= 1),
and the JSON says what ``backend=None`` chose (``kernels.chosen()``). On CPU "ours" is the dispatched
torch path (SDPA vs the math reference, ``aten._weight_int8pack_mm`` vs an fp32 linear, torch's fused
AdamW vs the default foreach AdamW): those figures say nothing about Triton. Contenders alternate
repeat by repeat. Prints one JSON line; each ``speed_ratio`` is baseline median time ÷ ours
(> 1: ours is faster), with the raw medians in ms.

    python bench/kernels.py [--repeats 15] [--record measured.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from colossal_lab import kernels


def _timer(device):
    def run(fn, iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / iters * 1e3
    return run


def duel(name, ours, base, device, repeats, iters):
    run = _timer(device)
    ours(), base()  # warm-up / JIT
    a, b = [], []
    for _ in range(repeats):
        a.append(run(ours, iters))
        b.append(run(base, iters))
    ma, mb = statistics.median(a), statistics.median(b)
    return {"ours_ms": round(ma, 4), "baseline_ms": round(mb, 4), "speed_ratio": round(mb / ma, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--record", metavar="FILE", help="on a GPU: write this device's records for kernels/measured.py")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if args.record and not cuda:
        ap.error("--record: the records say whether a Triton kernel beats torch on a GPU; there is no CUDA "
                 "device here (run it on the GPU, e.g. in scripts/gpu-check.sh's machine)")
    dev = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    out = {"device": torch.cuda.get_device_name(0) if cuda else f"cpu x{torch.get_num_threads()} threads",
           "ours": "triton" if cuda else "the dispatched torch path"}
    R = args.repeats
    be = "triton" if cuda else None  # on a GPU, time the kernel itself, whatever the dispatcher would pick

    # flash attention fwd+bwd
    if cuda:
        B, H, T, D, dt = 4, 16, 2048, 64, torch.bfloat16
    else:
        B, H, T, D, dt = 1, 4, 256, 64, torch.float32
    q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, T, D, device=dev, dtype=dt)

    def fa_ours():
        torch.autograd.grad(kernels.flash_attention(q, k, v, causal=True, backend=be), (q, k, v), do)

    if cuda:
        def fa_base():
            torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do)
        base_name = "sdpa"
    else:
        def fa_base():
            torch.autograd.grad(kernels.attention_reference(q, k, v, True), (q, k, v), do)
        base_name = "math_reference"
    out["flash_attention_fwd_bwd"] = {"shape": [B, H, T, D], "dtype": str(dt), "baseline": base_name,
                                      **duel("fa", fa_ours, fa_base, dev, R, 3 if cuda else 2)}

    # RMSNorm fwd+bwd
    rows, dim = (8 * 2048, 4096) if cuda else (2048, 512)
    x = torch.randn(rows, dim, device=dev, dtype=dt, requires_grad=True)
    w = torch.ones(dim, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(rows, dim, device=dev, dtype=dt)
    out["rms_norm_fwd_bwd"] = {"shape": [rows, dim], "dtype": str(dt), "baseline": "unfused_torch",
                               **duel("rn", lambda: torch.autograd.grad(kernels.rms_norm(x, w, backend=be), (x, w), dy),
                                      lambda: torch.autograd.grad(kernels.rms_norm_reference(x, w), (x, w), dy),
                                      dev, R, 5)}

    # int8 weight-only linear at decode shapes
    K, N = (4096, 11008) if cuda else (1024, 2816)
    adt = torch.bfloat16 if cuda else torch.float32
    wf = torch.randn(N, K, device=dev, dtype=adt) * 0.02
    from colossal_lab.engine.quant import quantize_weight
    qw, s = quantize_weight(wf)
    for M in (1, 8):
        xa = torch.randn(M, K, device=dev, dtype=adt)
        out[f"int8_linear_decode_M{M}"] = {
            "shape": [M, K, N], "activations": str(adt), "baseline": f"{str(adt).split('.')[-1]}_linear",
            "weight_bytes_ratio": round(wf.numel() * wf.element_size() / (qw.numel() + s.numel() * 4), 3),
            **duel("i8", lambda: kernels.int8_linear(xa, qw, s, backend=be), lambda: F.linear(xa, wf), dev, R, 20)}

    # fused AdamW over a ~16M-element (GPU) / 2M (CPU) fp32 chunk in 8 tensors
    n = (2 << 20) if cuda else (1 << 18)
    ps = [torch.randn(n, device=dev, requires_grad=True) for _ in range(8)]
    qs = [p.detach().clone().requires_grad_() for p in ps]
    for p, p2 in zip(ps, qs):
        p.grad = torch.randn_like(p)
        p2.grad = p.grad.clone()
    ours = kernels.FusedAdamW(ps, lr=1e-3, backend=be)
    base = torch.optim.AdamW(qs, lr=1e-3, fused=True) if cuda else torch.optim.AdamW(qs, lr=1e-3)
    out["fused_adamw"] = {"numel": 8 * n, "baseline": "torch_adamw_fused" if cuda else "torch_adamw_foreach",
                          **duel("adam", ours.step, base.step, dev, R, 5)}
    if cuda:  # what backend=None now runs for each op on this GPU, and why
        kernels.flash_attention(q, k, v, causal=True)
        kernels.rms_norm(x, w)
        kernels.int8_linear(xa, qw, s)
        kernels.fused_adamw([ps[0].detach()], [ps[0].grad], [torch.zeros_like(ps[0])], [torch.zeros_like(ps[0])],
                            step=1)
        out["backend_none_chose"] = {op: list(v) for op, v in kernels.chosen().items()}
    if args.record:
        with open(args.record, "w") as f:
            json.dump(records(out), f, indent=1)
    print(json.dumps(out))


#: bench entry -> (op, shape class) of kernels/measured.py
RECORDED = {"flash_attention_fwd_bwd": ("flash_attention", "any"), "rms_norm_fwd_bwd": ("rms_norm", "any"),
            "int8_linear_decode_M1": ("int8_linear", "decode"), "fused_adamw": ("fused_adamw", "any")}


def records(out: dict, when: str = "") -> list:
    """``kernels/measured.py`` records from one run's JSON (``when``: its date and commit)."""
    if not when:
        import subprocess

        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        when = f"{time.strftime('%Y-%m-%d')} {rev}".strip()
    return [{"op": op, "klass": klass, "device": out["device"], "ratio": out[key]["speed_ratio"],
             "baseline": out[key]["baseline"], "when": when}
            for key, (op, klass) in RECORDED.items() if key in out]


if __name__ == "__main__":
    main()
