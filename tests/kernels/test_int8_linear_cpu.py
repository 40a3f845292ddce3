"""The C int8 kernel behind CPU decode: exact fp32 numerics on every instruction set this CPU
has, odd shapes, threads, the Int8Linear fast path (weights checked once, dropped when the
buffers change), and the aten route it replaces."""

import copy
import pickle

import pytest
import torch

from colossal_lab.engine.models import GPT, GPTConfig
from colossal_lab.engine.quant import Int8Linear, quantize
from colossal_lab.kernels import int8_linear, int8_linear_cpu, int8_linear_reference

pytestmark = pytest.mark.skipif(not int8_linear_cpu.available(),
                                reason=f"no C kernel here: {int8_linear_cpu.unavailable_reason()}")


def _exact(x, q, s, b=None):
    """The reference in float64: what an exact fp32 kernel must approach."""
    return int8_linear_reference(x.double(), q, s.double(), None if b is None else b.double())


def _rel(y, r):
    return ((y.double() - r).abs().max() / r.abs().max()).item()


@pytest.fixture
def isas():
    names = []
    try:
        for name in ("scalar", "avx2", "avx512"):
            got = int8_linear_cpu.limit_isa(name)
            if got not in names:
                names.append(got)
        yield names
    finally:
        int8_linear_cpu.limit_isa("avx512")  # back to the best this CPU has


@pytest.mark.parametrize("M,N,K", [(1, 256, 256), (1, 37, 200), (3, 96, 77), (16, 33, 7), (1, 5, 1), (2, 1408, 256)])
def test_c_kernel_is_fp32_exact_on_every_isa(isas, M, N, K):
    torch.manual_seed(0)
    x = torch.randn(M, K)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    s = torch.rand(N) / 127 + 1e-4
    b = torch.randn(N)
    for name in isas:
        assert int8_linear_cpu.limit_isa(name) == name
        for bias in (None, b):
            y = int8_linear_cpu.int8_linear_cpu(x, q, s, bias)
            assert y.dtype == torch.float32 and y.shape == (M, N)
            # fp32 accumulation of K products: a few ulp of the largest output, never bf16's 4e-3
            assert _rel(y, _exact(x, q, s, bias)) < 5e-6, (name, bias is None)


def test_c_kernel_threads_split_output_rows():
    torch.manual_seed(0)
    N, K = 1000, 700  # above PARALLEL_MIN_BYTES: split across threads
    assert N * K >= int8_linear_cpu.PARALLEL_MIN_BYTES
    x, q, s = torch.randn(2, 1, K), torch.randint(-127, 128, (N, K), dtype=torch.int8), torch.rand(N) / 127
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int8_linear_cpu.int8_linear_cpu(x, q, s)
        torch.set_num_threads(2)
        two = int8_linear_cpu.int8_linear_cpu(x, q, s)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(one, two)  # each output row is computed by one thread, in the same order
    assert _rel(two, _exact(x, q, s)) < 5e-6


def test_int8_linear_dispatches_decode_to_the_c_kernel_and_large_inputs_elsewhere():
    torch.manual_seed(0)
    q, s = torch.randint(-127, 128, (64, 96), dtype=torch.int8), torch.rand(64) / 127
    small, big = torch.randn(1, 3, 96), torch.randn(2, 40, 96)  # 3 rows (kernel), 80 rows (fp32 GEMM)
    assert int8_linear_cpu.supports(small, q, s, None) and not int8_linear_cpu.supports(big, q, s, None)
    assert _rel(int8_linear(small, q, s), _exact(small, q, s)) < 5e-6
    assert _rel(int8_linear(big, q, s), _exact(big, q, s)) < 5e-6
    # needs autograd to x: not the kernel (it has no backward); the fallback is differentiable
    xg = small.clone().requires_grad_()
    assert not int8_linear_cpu.supports(xg, q, s, None)
    int8_linear(xg, q, s).sum().backward()
    torch.testing.assert_close(xg.grad, (q.float() * s[:, None]).sum(0).expand_as(xg))
    # switched off: the aten route (bf16 activations, ~3 significant digits)
    prev = int8_linear_cpu.set_enabled(False)
    try:
        assert not int8_linear_cpu.supports(small, q, s, None)
        assert 5e-6 < _rel(int8_linear(small, q, s), _exact(small, q, s)) < 1e-2
    finally:
        int8_linear_cpu.set_enabled(prev)


def test_c_kernel_rejects_what_would_leave_its_bounds():
    q, s = torch.zeros(8, 64, dtype=torch.int8), torch.ones(8)
    with pytest.raises(ValueError, match=r"x \(\.\.\., 64\) float32"):
        int8_linear_cpu.int8_linear_cpu(torch.randn(1, 32), q, s)
    with pytest.raises(ValueError, match=r"scale \(8,\) float32"):
        int8_linear_cpu.int8_linear_cpu(torch.randn(1, 64), q, torch.ones(4))
    with pytest.raises(ValueError, match=r"bias must be a CPU float32 tensor of shape \(8,\)"):
        int8_linear_cpu.int8_linear_cpu(torch.randn(1, 64), q, s, torch.ones(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        int8_linear_cpu.Plan(q.t(), torch.ones(64))
    with pytest.raises(ValueError, match="limit_isa: name='sse'"):
        int8_linear_cpu.limit_isa("sse")


def _layer(seed=0, N=48, K=80, bias=True):
    torch.manual_seed(seed)
    return Int8Linear.from_linear(torch.nn.Linear(K, N, bias=bias)).eval()


def test_int8_linear_module_plan_follows_its_buffers():
    m = _layer()
    x = torch.randn(1, 1, 80)
    with torch.no_grad():
        y0 = m(x)
        assert m._plan is not None  # the decode fast path is armed after the first call
        assert _rel(m(x), _exact(x, m.weight_int8, m.scale, m.bias)) < 5e-6
        m.scale = m.scale * 2  # a new buffer: the old plan must not be used
        torch.testing.assert_close(m(x) - m.bias, 2 * (y0 - m.bias))
        m.weight_int8.neg_()  # in place: same memory, the plan sees it
        torch.testing.assert_close(m(x) - m.bias, -2 * (y0 - m.bias))
        c = copy.deepcopy(m)  # the copy owns new memory: it must not read the original's
        assert c._plan is None
        m.weight_int8.zero_()
        torch.testing.assert_close(c(x) - c.bias, -2 * (y0 - c.bias))
        torch.testing.assert_close(m(x), m.bias.expand(1, 1, -1))
        r = pickle.loads(pickle.dumps(c))
        torch.testing.assert_close(r(x), c(x))
        # bf16 activations: not the fp32 kernel; the plan stays unused and the result is bf16
        mb = _layer(bias=False)
        mb(x)
        assert mb(x.bfloat16()).dtype == torch.bfloat16


def test_quantized_gpt_decode_is_fp32_exact_against_the_dequantised_model():
    """End to end: KV-cache decode through the C kernel equals an fp32 model holding the
    dequantised weights (the same numbers an fp32 GEMM sees), token for token."""
    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny", n_embd=128, n_head=4, mlp_hidden=200)  # 200: not a multiple of 32
    q = quantize(GPT(cfg).eval(), "int8")
    deq = GPT(cfg).eval()
    sd = {}
    for name, mod in q.named_modules():
        if hasattr(mod, "weight_int8"):
            sd[f"{name}.weight"] = mod.weight_int8.float() * mod.scale[:, None]
    sd.update({k: v for k, v in q.state_dict().items() if "weight_int8" not in k and not k.endswith(".scale")})
    deq.load_state_dict(sd)
    idx = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        a = q.generate(idx, 16, temperature=0)
        b = deq.generate(idx, 16, temperature=0)
        assert torch.equal(a, b)
        step = q(idx[:, :1])[0]
        assert _rel(step, deq(idx[:, :1])[0].double()) < 1e-5
