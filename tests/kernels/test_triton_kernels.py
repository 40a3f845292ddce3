"""Each Triton kernel against its torch reference: small shapes on CPU under TRITON_INTERPRET=1,
full size on a GPU; forward and backward; tolerances by dtype; the dispatch rule and bad input."""

import os
import subprocess
import sys
import textwrap

import torch

# Triton decides interpreter vs compiler when a kernel is decorated; our kernels are decorated
# on first use, so setting this before any test runs is enough (CPU machines only).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from colossal_lab import kernels  # noqa: E402
from colossal_lab.kernels import (  # noqa: E402
    FusedAdamW,
    attention_reference,
    flash_attention,
    int8_linear,
    int8_linear_reference,
    rms_norm,
    rms_norm_reference,
)

needs_triton = pytest.mark.skipif(not kernels.triton_available(), reason="triton not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float16: dict(atol=5e-3, rtol=5e-3), torch.bfloat16: dict(atol=5e-2, rtol=3e-2),
       torch.float32: dict(atol=1e-4, rtol=1e-4)}


def _attn_case(dtype, causal, D, Tq, Tk, B=1, H=2, device=DEV):
    torch.manual_seed(0)
    q = torch.randn(B, H, Tq, D, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(B, H, Tk, D, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(B, H, Tk, D, dtype=dtype, device=device, requires_grad=True)
    o = flash_attention(q, k, v, causal=causal, backend="triton")
    do = torch.randn_like(o)
    o.backward(do)
    got = [o.detach()] + [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    r = attention_reference(q, k, v, causal)
    r.backward(do)
    want = [r.detach()] + [t.grad for t in (q, k, v)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m: f"{name}: {m}")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("D,T", [(64, 48), (128, 32)])
def test_flash_attention_matches_reference_fwd_bwd(dtype, causal, D, T):
    _attn_case(dtype, causal, D, T, T)


@needs_triton
def test_flash_attention_decode_step_against_longer_keys():
    _attn_case(torch.float16, False, 64, 1, 40)


@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("D", [64, 128])
def test_flash_attention_full_size_gpu(dtype, causal, D):
    _attn_case(dtype, causal, D, 1024, 1024, B=2, H=8, device="cuda")


def test_flash_attention_default_path_on_cpu_is_sdpa_and_differentiable():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 32, requires_grad=True) for _ in range(3))
    o = flash_attention(q, k, v)  # fp32, head dim 32 on CPU: SDPA
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    torch.testing.assert_close(o, attention_reference(q, k, v, True), atol=1e-5, rtol=1e-5)
    o.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_flash_attention_bad_input():
    q = torch.randn(1, 2, 8, 80, dtype=torch.float16)
    with pytest.raises(ValueError, match="head dim 80"):
        flash_attention(q, q, q, backend="triton")
    out = flash_attention(q.float(), q.float(), q.float())  # unsupported by the kernel: documented fallback
    assert out.shape == q.shape
    with pytest.raises(ValueError, match="dtype torch.float32"):
        flash_attention(*(torch.randn(1, 1, 8, 64),) * 3, backend="triton")
    with pytest.raises(ValueError, match="causal=True needs as many queries as keys"):
        flash_attention(torch.randn(1, 1, 1, 64), torch.randn(1, 1, 4, 64), torch.randn(1, 1, 4, 64))
    with pytest.raises(ValueError, match="backend='cuda' is not one of"):
        flash_attention(q, q, q, backend="cuda")
    with pytest.raises(ValueError, match=r"4-D \(B, H, T, D\)"):
        flash_attention(torch.randn(2, 8, 64), torch.randn(2, 8, 64), torch.randn(2, 8, 64))
    with pytest.raises(ValueError, match="dtypes differ"):
        flash_attention(q, q.float(), q)


def _halves_case(backend, dtype, causal, Tq, Tk, D=16, tol=None):
    """flash_attention_forward/backward against autograd through the fp32 reference; and, split
    into two key blocks, the blocks' (out, lse) merge to the whole and their backward (given the
    whole's out and lse) sums to the whole's gradient: what ring attention relies on."""
    from colossal_lab.kernels import flash_attention_backward, flash_attention_forward

    torch.manual_seed(0)
    q = torch.randn(2, 2, Tq, D, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, Tk, D, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, Tk, D, dtype=dtype, requires_grad=True)
    tol = tol or TOL[dtype]
    r = attention_reference(q, k, v, causal)
    do = torch.randn_like(r)
    r.float().backward(do.float())
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) / D ** 0.5
    if causal:
        s = s.masked_fill(~torch.ones(Tq, Tk, dtype=torch.bool).tril(), float("-inf"))
    want_lse = torch.logsumexp(s, -1)
    o, lse = flash_attention_forward(q, k, v, causal=causal, backend=backend)
    assert not o.requires_grad and lse.dtype == torch.float32 and lse.shape == (2, 2, Tq)
    torch.testing.assert_close(o, r.detach(), **tol)
    torch.testing.assert_close(lse, want_lse, atol=2e-3 if dtype != torch.float32 else 1e-5, rtol=1e-3)
    grads = flash_attention_backward(do, q, k, v, o, lse, causal=causal, backend=backend)
    for name, got, t in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert got.dtype == dtype
        torch.testing.assert_close(got, t.grad, **tol, msg=lambda m: f"{name}: {m}")
    if causal:
        return
    h = Tk // 2
    (o1, l1), (o2, l2) = (flash_attention_forward(q, k[:, :, sl], v[:, :, sl], causal=False, backend=backend)
                          for sl in (slice(0, h), slice(h, Tk)))
    merged_lse = torch.logaddexp(l1, l2)
    merged = o1.float() * torch.exp(l1 - merged_lse)[..., None] + o2.float() * torch.exp(l2 - merged_lse)[..., None]
    torch.testing.assert_close(merged_lse, lse, atol=2e-3 if dtype != torch.float32 else 1e-5, rtol=1e-3)
    torch.testing.assert_close(merged.to(dtype), o, **tol)
    a = flash_attention_backward(do, q, k[:, :, :h], v[:, :, :h], o, lse, causal=False, backend=backend)
    b = flash_attention_backward(do, q, k[:, :, h:], v[:, :, h:], o, lse, causal=False, backend=backend)
    torch.testing.assert_close(a[0].float() + b[0].float(), q.grad.float(), **tol)
    torch.testing.assert_close(torch.cat([a[1], b[1]], 2), k.grad, **tol)
    torch.testing.assert_close(torch.cat([a[2], b[2]], 2), v.grad, **tol)


@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("causal,Tq,Tk", [(True, 24, 24), (False, 24, 12), (False, 8, 20)])
def test_flash_attention_halves_with_lse_torch_paths(backend, causal, Tq, Tk):
    _halves_case(backend, torch.float32, causal, Tq, Tk)


@needs_triton
@pytest.mark.parametrize("causal,Tq,Tk", [(True, 40, 40), (False, 40, 24)])
def test_flash_attention_halves_with_lse_triton(causal, Tq, Tk):
    _halves_case("triton", torch.float16, causal, Tq, Tk)


def test_flash_attention_halves_default_cpu_path_is_aten_flash(monkeypatch):
    """backend=None on CPU runs ATen's fused CPU flash op (O(T) memory), not the reference."""
    import importlib

    fa = importlib.import_module("colossal_lab.kernels.flash_attention")  # the module, not the function
    called = []
    real = fa._cpu_flash()
    assert real is not None, "this torch has no _scaled_dot_product_flash_attention_for_cpu"
    monkeypatch.setattr(fa, "_cpu_flash", lambda: (lambda *a, **k: called.append("f") or real[0](*a, **k),
                                                   lambda *a, **k: called.append("b") or real[1](*a, **k)))
    q = torch.randn(1, 2, 8, 16)
    o, lse = fa.flash_attention_forward(q, q, q)
    fa.flash_attention_backward(torch.ones_like(o), q, q, q, o, lse)
    assert called == ["f", "b"]
    with pytest.raises(ValueError, match="lse"):
        fa.flash_attention_backward(torch.ones_like(o), q, q, q, o, lse[:, :, :4])
    with pytest.raises(ValueError, match="flash_attention_forward: causal=True needs as many queries"):
        fa.flash_attention_forward(q, q[:, :, :4], q[:, :, :4])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("wdtype", ["same", torch.float32])
def test_rms_norm_matches_reference_fwd_bwd(dtype, wdtype):
    torch.manual_seed(0)
    wdtype = dtype if wdtype == "same" else wdtype
    x = torch.randn(3, 37, 96, dtype=dtype, device=DEV, requires_grad=True)
    w = (1 + 0.1 * torch.randn(96, device=DEV)).to(wdtype).requires_grad_()
    y = rms_norm(x, w, eps=1e-5, backend="triton")
    dy = torch.randn_like(y)
    y.backward(dy)
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    r = rms_norm_reference(x, w, eps=1e-5)
    r.backward(dy)
    assert y.dtype == r.dtype
    tol = TOL[dtype]
    torch.testing.assert_close(y, r, **tol)
    torch.testing.assert_close(gx, x.grad, **tol)
    # dweight sums 111 rows: scale the tolerance by the row count's square root
    torch.testing.assert_close(gw, w.grad, atol=tol["atol"] * 12, rtol=tol["rtol"])


@needs_triton
@pytest.mark.gpu
def test_rms_norm_full_size_gpu():
    x = torch.randn(8, 1024, 4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    w = torch.ones(4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    torch.testing.assert_close(rms_norm(x, w, backend="triton"), rms_norm_reference(x, w), **TOL[torch.bfloat16])


def test_rms_norm_bad_input_and_model_numbers():
    with pytest.raises(ValueError, match=r"weight shape \(8,\) must be \(16,\)"):
        rms_norm(torch.randn(2, 16), torch.ones(8))
    with pytest.raises(ValueError, match="eps=0 must be > 0"):
        rms_norm(torch.randn(2, 16), torch.ones(16), eps=0)
    with pytest.raises(ValueError, match="floating-point"):
        rms_norm(torch.ones(2, 16, dtype=torch.long), torch.ones(16))
    x = torch.randn(4, 16, dtype=torch.float64)  # kernel lacks fp64: torch path, exact
    w = torch.ones(16, dtype=torch.float64)
    torch.testing.assert_close(rms_norm(x, w), rms_norm_reference(x, w))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M,K", [(1, 200), (40, 256)])
def test_int8_linear_matches_reference(dtype, M, K):
    torch.manual_seed(0)
    x = torch.randn(M, K, dtype=dtype, device=DEV, requires_grad=True)
    w = torch.randint(-127, 128, (150, K), dtype=torch.int8, device=DEV)
    s = torch.rand(150, device=DEV) / 127
    b = torch.randn(150, device=DEV)
    y = int8_linear(x, w, s, b, backend="triton")
    r = int8_linear_reference(x, w, s, b)
    scale = r.detach().abs().max().item()
    tol = TOL[dtype]
    torch.testing.assert_close(y, r, atol=tol["atol"] * scale, rtol=tol["rtol"])
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    (rx,) = torch.autograd.grad(r, x, g)
    torch.testing.assert_close(gx, rx, atol=tol["atol"] * rx.abs().max().item(), rtol=tol["rtol"])


@pytest.mark.parametrize("M,K", [(1, 256), (3, 256), (40, 256), (2, 200)])
def test_int8_linear_cpu_default_path(M, K):
    torch.manual_seed(0)
    x = torch.randn(2, M, K)
    w = torch.randint(-127, 128, (96, K), dtype=torch.int8)
    s = torch.rand(96) / 127
    r = int8_linear_reference(x, w, s)
    y = int8_linear(x, w, s)
    # decode-sized fp32 inputs: the C kernel (exact fp32), or without a C compiler aten's int8 kernel
    # on bf16 activations (~3 significant digits); tests/kernels/test_int8_linear_cpu.py checks the
    # former tightly
    torch.testing.assert_close(y, r, atol=1e-2 * r.abs().max().item(), rtol=1e-2)
    assert y.shape == (2, M, 96) and y.dtype == torch.float32


def test_int8_linear_bad_input():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="weight_int8 must be a 2-D torch.int8"):
        int8_linear(x, torch.randn(8, 64), torch.ones(8))
    with pytest.raises(ValueError, match=r"scale must be a float tensor of shape \(8,\)"):
        int8_linear(x, torch.zeros(8, 64, dtype=torch.int8), torch.ones(4))
    with pytest.raises(ValueError, match="last dim 64 != weight_int8's in-features 32"):
        int8_linear(x, torch.zeros(8, 32, dtype=torch.int8), torch.ones(8))


@needs_triton
@pytest.mark.parametrize("backend", ["triton", None])
def test_fused_adamw_equals_torch_adamw_over_steps(backend):
    torch.manual_seed(0)
    shapes = [(100, 30), (77,)]
    a = [torch.randn(s, device=DEV, requires_grad=True) for s in shapes]
    b = [p.detach().clone().requires_grad_() for p in a]
    oa = FusedAdamW(a, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, backend=backend)
    ob = torch.optim.AdamW(b, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(5):
        for x, y in zip(a, b):
            g = torch.randn_like(x)
            x.grad, y.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)
    sa, sb = oa.state_dict()["state"][0], ob.state_dict()["state"][0]
    torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"])
    assert float(sa["step"]) == float(sb["step"]) == 5


def test_fused_adamw_bad_input():
    p = torch.zeros(4)
    with pytest.raises(ValueError, match="step=0 must be >= 1"):
        kernels.fused_adamw([p], [p], [p], [p], 0)
    with pytest.raises(ValueError, match="shapes differ"):
        kernels.fused_adamw([p], [torch.zeros(5)], [p], [p], 1)
    with pytest.raises(ValueError, match="betas"):
        kernels.fused_adamw([p], [p], [p], [p], 1, beta1=1.0)


def test_kernels_import_and_run_without_triton():
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # any 'import triton' now fails
        import torch
        from colossal_lab import kernels
        assert not kernels.triton_available()
        x = torch.randn(1, 2, 8, 64)
        y = kernels.flash_attention(x, x, x)
        try:
            kernels.flash_attention(x.half(), x.half(), x.half(), backend="triton")
        except RuntimeError as e:
            assert "triton is not importable" in str(e)
        else:
            raise SystemExit("no error")
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr
