"""CPU int8 weight-only GEMV/GEMM for decode: fp32 activations in, fp32 out, one call.

The CPU counterpart of the Triton kernel in ``int8_matmul.py``: each int8 weight row is
widened to fp32 in registers (AVX-512 or AVX2, picked at run time; a scalar loop elsewhere),
multiplied by fp32 activations with an fp32 accumulator, and the per-output-channel scale and
the bias are applied once at the end. Nothing is rounded to bf16, so it is *more* exact than
torch's ``aten._weight_int8pack_mm`` route (whose fast CPU kernel needs bf16 activations and
therefore a cast in and a cast out per layer — three ops where an fp32 ``F.linear`` is one,
and on small models that per-op overhead outweighs what the int8 weights save).

Why C: torch ships no CPU op for fp32 activations × int8 weights that is not either slow
(``_weight_int8pack_mm`` with fp32 runs a scalar loop, far slower than an fp32 GEMV) or a
dynamic-quant op (which quantises activations too). The source below is compiled on first use
with the system C compiler (``cc``, or ``$CC``) into a cache directory (``$COLOSSAL_LAB_CACHE``
or ``~/.cache/colossal_lab``) and loaded with ``ctypes``; it needs no torch headers, so one
compiler call builds it. No compiler → :func:`available` is False with the reason in
:func:`unavailable_reason`, and ``int8_linear`` keeps using the aten route.
Set ``COLOSSAL_LAB_INT8_CPU_KERNEL=0`` to disable it.

Multi-threaded with OpenMP over output rows for large matrices (threads =
``torch.get_num_threads()``). The library links ``libgomp.so.1``; torch has already loaded
its own copy under that name, which the dynamic loader reuses, so both share one pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

MAX_ROWS = 16  # decode-sized inputs; larger ones (prefill) are compute-bound: fp32 GEMM wins there
PARALLEL_MIN_BYTES = 1 << 18  # int8 weight bytes below which one thread is faster than a fork/join

_SOURCE = r"""
#include <stdint.h>
#include <immintrin.h>

/* y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n]); x, y fp32 row-major, w int8 (N, K).
   Work is split in blocks of up to 16 output rows (the unit of multi-threading); within a block,
   four int8 rows at a time are widened to fp32 in registers as they are read, for every input
   row in turn (the four weight rows stay in L1 across input rows). */

#define BLOCK 16

/* rows(x, M, K, w, nb, scale, bias, y, ldy): nb output rows of a block; w points at its first row. */
typedef void (*rows_fn)(const float *, int64_t, int64_t, const int8_t *, int64_t, const float *, const float *,
                        float *, int64_t);

#define STORE(j, v) y[m * ldy + (j)] = (v) * scale[j] + (bias ? bias[j] : 0.f)

static void rows_i8_scalar(const float *x, int64_t M, int64_t K, const int8_t *w, int64_t nb,
                           const float *scale, const float *bias, float *y, int64_t ldy) {
    for (int64_t j = 0; j < nb; j++)
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K; const int8_t *wj = w + j * K;
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) acc += xm[k] * (float)wj[k];
            STORE(j, acc);
        }
}

/* four output rows at a time; V = vector width; two k-halves x four rows = eight FMA chains */
#define ROWS_SIMD(NAME, TGT, V, VEC, ZERO, LOADX, LOADW, FMA, ADD, HSUM)                               \
__attribute__((target(TGT)))                                                                           \
static void NAME(const float *x, int64_t M, int64_t K, const int8_t *w, int64_t nb, const float *scale, \
                 const float *bias, float *y, int64_t ldy) {                                           \
    const int64_t K2 = K & ~(int64_t)(2 * V - 1), K1 = K & ~(int64_t)(V - 1);                          \
    int64_t j = 0;                                                                                     \
    for (; j + 4 <= nb; j += 4) {                                                                      \
        const int8_t *w0 = w + j * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;                            \
        for (int64_t m = 0; m < M; m++) {                                                              \
            const float *xm = x + m * K;                                                               \
            VEC a0 = ZERO, a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;              \
            int64_t k = 0;                                                                             \
            for (; k < K2; k += 2 * V) {                                                               \
                VEC xa = LOADX(xm + k), xb = LOADX(xm + k + V);                                        \
                a0 = FMA(xa, LOADW(w0 + k), a0); b0 = FMA(xb, LOADW(w0 + k + V), b0);                  \
                a1 = FMA(xa, LOADW(w1 + k), a1); b1 = FMA(xb, LOADW(w1 + k + V), b1);                  \
                a2 = FMA(xa, LOADW(w2 + k), a2); b2 = FMA(xb, LOADW(w2 + k + V), b2);                  \
                a3 = FMA(xa, LOADW(w3 + k), a3); b3 = FMA(xb, LOADW(w3 + k + V), b3);                  \
            }                                                                                          \
            for (; k < K1; k += V) {                                                                   \
                VEC xa = LOADX(xm + k);                                                                \
                a0 = FMA(xa, LOADW(w0 + k), a0); a1 = FMA(xa, LOADW(w1 + k), a1);                      \
                a2 = FMA(xa, LOADW(w2 + k), a2); a3 = FMA(xa, LOADW(w3 + k), a3);                      \
            }                                                                                          \
            float s0 = HSUM(ADD(a0, b0)), s1 = HSUM(ADD(a1, b1)), s2 = HSUM(ADD(a2, b2)), s3 = HSUM(ADD(a3, b3)); \
            for (; k < K; k++) {                                                                       \
                s0 += xm[k] * (float)w0[k]; s1 += xm[k] * (float)w1[k];                                \
                s2 += xm[k] * (float)w2[k]; s3 += xm[k] * (float)w3[k];                                \
            }                                                                                          \
            STORE(j, s0); STORE(j + 1, s1); STORE(j + 2, s2); STORE(j + 3, s3);                        \
        }                                                                                              \
    }                                                                                                  \
    if (j < nb) rows_i8_scalar(x, M, K, w + j * K, nb - j, scale + j, bias ? bias + j : 0, y + j, ldy);   \
}

__attribute__((target("avx2,fma")))
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define W8_AVX2(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define W16_AVX512(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))

ROWS_SIMD(rows_i8_avx2, "avx2,fma", 8, __m256, _mm256_setzero_ps(), _mm256_loadu_ps, W8_AVX2,
          _mm256_fmadd_ps, _mm256_add_ps, hsum256)
ROWS_SIMD(rows_i8_avx512, "avx512f,fma", 16, __m512, _mm512_setzero_ps(), _mm512_loadu_ps, W16_AVX512,
          _mm512_fmadd_ps, _mm512_add_ps, _mm512_reduce_add_ps)

struct isa { rows_fn i8; int bits; };
static struct isa impl;

static void pick(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) impl = (struct isa){rows_i8_avx512, 512};
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        impl = (struct isa){rows_i8_avx2, 256};
    else impl = (struct isa){rows_i8_scalar, 0};
}

int i8_isa(void) { if (!impl.i8) pick(); return impl.bits; }

/* tests: use at most `bits` (512, 256, 0) of what this CPU has; returns what is now used */
int i8_limit_isa(int bits) {
    pick();
    if (bits < 512 && impl.bits == 512) {
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
            impl = (struct isa){rows_i8_avx2, 256};
        else impl = (struct isa){rows_i8_scalar, 0};
    }
    if (bits < 256) impl = (struct isa){rows_i8_scalar, 0};
    return impl.bits;
}

static void run_block(const float *x, int64_t M, int64_t K, const int8_t *q, int64_t N, const float *scale,
                      const float *bias, float *y, int64_t b) {
    int64_t n0 = b * BLOCK, nb = N - n0 < BLOCK ? N - n0 : BLOCK;
    impl.i8(x, M, K, q + n0 * K, nb, scale + n0, bias ? bias + n0 : 0, y + n0, N);
}

void i8_linear(const float *x, int64_t M, int64_t K, const int8_t *q, int64_t N,
               const float *scale, const float *bias, float *y, int nthreads) {
    if (!impl.i8) pick();
    const int64_t blocks = (N + BLOCK - 1) / BLOCK;
    if (nthreads <= 1) {
        for (int64_t b = 0; b < blocks; b++) run_block(x, M, K, q, N, scale, bias, y, b);
        return;
    }
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) run_block(x, M, K, q, N, scale, bias, y, b);
}

struct plan { const int8_t *q; const float *scale, *bias; int64_t N, K; };

/* the per-layer constants travel as one pointer: fewer ctypes conversions per call */
void i8_linear_plan(const struct plan *p, const float *x, float *y, int64_t M, int nthreads) {
    i8_linear(x, M, p->K, p->q, p->N, p->scale, p->bias, y, nthreads);
}
"""

_FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp", "-fno-strict-aliasing"]
_state: dict = {}


def _cache_dirs() -> list:
    """Where the built library may live: ``$COLOSSAL_LAB_CACHE``, else the user cache, else tmp."""
    if os.environ.get("COLOSSAL_LAB_CACHE"):
        return [Path(os.environ["COLOSSAL_LAB_CACHE"]) / "kernels"]
    user = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(user) / "colossal_lab" / "kernels",
            Path(tempfile.gettempdir()) / f"colossal_lab-{os.getuid() if hasattr(os, 'getuid') else 0}" / "kernels"]


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc) on PATH; set CC to build the CPU int8 kernel")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    tag = hashlib.sha256("\0".join([_SOURCE, cc, version, *_FLAGS]).encode()).hexdigest()[:16]
    name, errors = f"int8_linear_cpu-{tag}.so", []
    for folder in _cache_dirs():
        out = folder / name
        if out.exists():
            break
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:  # same filesystem: atomic rename
                src, lib = Path(tmp) / "int8_linear_cpu.c", Path(tmp) / name
                src.write_text(_SOURCE)
                r = subprocess.run([cc, *_FLAGS, str(src), "-o", str(lib)], capture_output=True, text=True,
                                   timeout=300)
                if r.returncode != 0:
                    raise RuntimeError(f"{cc} failed to build the CPU int8 kernel:\n{r.stderr[-2000:]}")
                os.replace(lib, out)  # concurrent builders race harmlessly: identical files
            break
        except OSError as e:  # read-only or missing home: try the next folder
            errors.append(f"{folder}: {e}")
    else:
        raise RuntimeError("cannot write the CPU int8 kernel to any cache folder (set COLOSSAL_LAB_CACHE): "
                           + "; ".join(errors))
    dll = ctypes.CDLL(str(out))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    dll.i8_linear.argtypes = [p, i64, i64, p, i64, p, p, p, ctypes.c_int]
    dll.i8_linear.restype = None
    dll.i8_linear_plan.argtypes = [p, p, p, i64, ctypes.c_int]
    dll.i8_linear_plan.restype = None
    dll.i8_isa.restype = ctypes.c_int
    dll.i8_limit_isa.argtypes = [ctypes.c_int]
    dll.i8_limit_isa.restype = ctypes.c_int
    dll.i8_isa()  # picks the instruction set now, before any concurrent call
    return dll


class _PlanStruct(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("N", ctypes.c_int64), ("K", ctypes.c_int64)]


def _lib() -> Optional[ctypes.CDLL]:
    if "lib" not in _state:
        if os.environ.get("COLOSSAL_LAB_INT8_CPU_KERNEL", "1") in ("0", "false", "False", ""):
            _state["lib"], _state["why"] = None, "disabled by COLOSSAL_LAB_INT8_CPU_KERNEL=0"
        else:
            try:
                _state["lib"], _state["why"] = _build(), None
            except Exception as e:  # no compiler, read-only cache, ...: the aten route still works
                _state["lib"], _state["why"] = None, f"{type(e).__name__}: {e}"
    return _state["lib"]


ENABLED = True  # read on every call; change it with set_enabled


def set_enabled(flag: bool) -> bool:
    """Turn the kernel on/off for this process (``int8_linear`` then takes the aten route);
    returns the previous setting. For A/B benchmarks."""
    global ENABLED
    prev, ENABLED = ENABLED, bool(flag)
    return prev


def available() -> bool:
    """True when the compiled kernel is loaded (builds it on the first call) and enabled."""
    return ENABLED and _lib() is not None


def unavailable_reason() -> Optional[str]:
    """Why :func:`available` is False (None when it is True)."""
    _lib()
    return _state["why"]


def isa() -> str:
    """The instruction set the kernel picked on this CPU: ``avx512``, ``avx2`` or ``scalar``."""
    lib = _lib()
    if lib is None:
        raise RuntimeError(f"CPU int8 kernel unavailable: {unavailable_reason()}")
    return {512: "avx512", 256: "avx2"}.get(lib.i8_isa(), "scalar")


def limit_isa(name: str) -> str:
    """Use at most ``name`` (``avx512``, ``avx2``, ``scalar``) of what this CPU has; returns the
    instruction set now used. For tests of the narrower code paths."""
    bits = {"avx512": 512, "avx2": 256, "scalar": 0}
    if name not in bits:
        raise ValueError(f"limit_isa: name={name!r}; choose one of {list(bits)}")
    lib = _lib()
    if lib is None:
        raise RuntimeError(f"CPU int8 kernel unavailable: {unavailable_reason()}")
    return {512: "avx512", 256: "avx2"}.get(lib.i8_limit_isa(bits[name]), "scalar")


def supports(x: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor,
             bias: Optional[torch.Tensor]) -> bool:
    """Whether :func:`int8_linear_cpu` takes this call (else use another path)."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and not (x.requires_grad and torch.is_grad_enabled())
            and x.numel() <= MAX_ROWS * x.shape[-1] and weight_int8.device.type == "cpu"
            and scale.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)
            and available())


def int8_linear_cpu(x: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor,
                    bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x (…, K)`` fp32 × int8 ``(N, K)`` · ``scale (N,)`` (+ ``bias``) → fp32 ``(…, N)``; no autograd.

    Call only where :func:`supports` holds. What keeps the C code in bounds (shapes, dtypes,
    contiguity, CPU) is checked here on every call; :class:`Plan` checks once, for callers that
    reuse one weight on every call (``Int8Linear``).
    """
    N, K = weight_int8.shape
    if (x.shape[-1] != K or scale.shape != (N,) or weight_int8.dtype != torch.int8 or x.dtype != torch.float32
            or scale.dtype != torch.float32 or x.device.type != "cpu" or weight_int8.device.type != "cpu"
            or scale.device.type != "cpu"):
        raise ValueError(f"int8_linear_cpu: needs CPU x (..., {K}) float32, weight_int8 ({N}, {K}) int8 and "
                         f"scale ({N},) float32; got x {x.dtype} {tuple(x.shape)}, weight_int8 {weight_int8.dtype} "
                         f"{tuple(weight_int8.shape)}, scale {scale.dtype} {tuple(scale.shape)}")
    if bias is not None and (bias.shape != (N,) or bias.dtype != torch.float32 or bias.device.type != "cpu"):
        raise ValueError(f"int8_linear_cpu: bias must be a CPU float32 tensor of shape ({N},), "
                         f"got {bias.dtype} {tuple(bias.shape)}")
    lib = _state.get("lib") or _lib()
    if lib is None:
        raise RuntimeError(f"int8_linear_cpu: the CPU int8 kernel is unavailable: {unavailable_reason()}")
    x = x.contiguous()
    weight_int8, scale = weight_int8.contiguous(), scale.contiguous()
    M = x.numel() // K if K else 0
    y = torch.empty(x.shape[:-1] + (N,), dtype=torch.float32)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand_as(y))
    lib.i8_linear(x.data_ptr(), M, K, weight_int8.data_ptr(), N, scale.data_ptr(),
                  None if bias is None else bias.contiguous().data_ptr(), y.data_ptr(),
                  torch.get_num_threads() if N * K >= PARALLEL_MIN_BYTES else 1)
    return y


class Plan:
    """One int8 linear's weights, checked once and packed for the C call (``Int8Linear`` keeps
    one). ``run(x)`` then costs an allocation and one ctypes call. The plan holds the tensors
    it points into, so they stay alive; callers must drop it when the tensors are replaced
    (``Int8Linear`` compares identities on every call)."""

    __slots__ = ("q", "scale", "bias", "N", "K", "max_numel", "threads", "_struct", "_addr", "_fn")

    def __init__(self, weight_int8: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None):
        lib = _lib()
        if lib is None:
            raise RuntimeError(f"CPU int8 kernel unavailable: {unavailable_reason()}")
        if weight_int8.dim() != 2 or weight_int8.dtype != torch.int8 or not weight_int8.is_cpu:
            raise ValueError(f"Plan: weight_int8 must be a 2-D CPU int8 tensor, got {weight_int8.dtype} "
                             f"{tuple(weight_int8.shape)} on {weight_int8.device}")
        N, K = weight_int8.shape
        for name, t in (("scale", scale), ("bias", bias)):
            if t is not None and (t.shape != (N,) or t.dtype != torch.float32 or not t.is_cpu):
                raise ValueError(f"Plan: {name} must be a CPU float32 tensor of shape ({N},), got {t.dtype} "
                                 f"{tuple(t.shape)} on {t.device}")
        if not (weight_int8.is_contiguous() and scale.is_contiguous() and (bias is None or bias.is_contiguous())):
            raise ValueError("Plan: weight_int8, scale and bias must be contiguous")
        if N == 0 or K == 0:
            raise ValueError(f"Plan: empty weight {tuple(weight_int8.shape)}")
        self.q, self.scale, self.bias, self.N, self.K = weight_int8, scale, bias, N, K
        self.max_numel = MAX_ROWS * K
        self.threads = N * K >= PARALLEL_MIN_BYTES  # big enough to split across threads
        self._struct = _PlanStruct(weight_int8.data_ptr(), scale.data_ptr(),
                                   None if bias is None else bias.data_ptr(), N, K)
        self._addr = ctypes.addressof(self._struct)
        self._fn = lib.i8_linear_plan

    def __deepcopy__(self, memo):  # a copy would point into the original's memory: rebuild instead
        return None

    def __reduce__(self):
        return type(None), ()

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` must be a contiguous CPU float32 tensor with last dim ``K`` and at most
        ``MAX_ROWS`` rows (the caller checks; ``Int8Linear.forward`` does)."""
        y = torch.empty(x.shape[:-1] + (self.N,), dtype=torch.float32)
        self._fn(self._addr, x.data_ptr(), y.data_ptr(), x.numel() // self.K,
                 torch.get_num_threads() if self.threads else 1)
        return y
