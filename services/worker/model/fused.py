"""Fused native (C, OpenMP) kernels for the elementwise part of a decoder layer on CPU.

Between its GEMMs, an eager layer runs some 40 small torch ops: RMSNorm as eight, RoPE as six,
the KV write as two index copies, SiLU-and-multiply as three, the residual adds. In a decode step
each costs more in dispatch than in arithmetic, and in a prefill each is its own pass over
memory. Here they are four kernels, one pass each:

- `rms_norm(x, w)`, and `add_rms_norm(x, delta, w)`, which also forms the residual sum x + delta
  (written over `delta`) and normalizes it;
- `rope_write(qkv, ...)`: rotates the Q and K heads of the fused QKV projection in place and
  copies the new K and V rows into the paged cache at their slots;
- `silu_mul(gate_up)`: SiLU of the gate half times the up half.

Each reproduces the eager ops' rounding: statistics in float32, and in bfloat16 every
intermediate the eager path rounds to bfloat16 is rounded here too (round to nearest even), so
the two paths differ only in the order of a float32 sum and the last bit of `exp`. The kernels
are built like the decode-attention kernel (see `native.build_library`), checked against the
eager ops once on load, and with `BLITZMESH_FUSED_OPS=0`, on other devices or dtypes, or where
they cannot be built, `fused_ops()` returns None and the model runs the eager ops.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from services.worker.model.native import LazyKernel, build_library, vector_flags

_PRELUDE = r"""
#include <stdint.h>
#include <math.h>
#include <string.h>

typedef union { uint32_t u; float f; } pun_t;

static inline float bf16_to_f32(uint16_t x) { pun_t v; v.u = (uint32_t)x << 16; return v.f; }
/* float32 -> bfloat16, round to nearest even; NaNs stay (quiet) NaNs. */
static inline uint16_t f32_to_bf16(float f) {
    pun_t v; v.f = f;
    uint32_t u = v.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float ld_f32(float x) { return x; }
static inline float st_f32(float x) { return x; }
static inline float rnd_f32(float x) { return x; }
static inline float ld_bf16(uint16_t x) { return bf16_to_f32(x); }
static inline uint16_t st_bf16(float x) { return f32_to_bf16(x); }
static inline float rnd_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

/* exp(x) for x <= 0: Cephes range reduction and a degree-5 polynomial (about 1 ulp); written
   with plain arithmetic so that loops over it vectorize. */
static inline float exp_nonpos(float x) {
    x = x < -87.3f ? -87.3f : x;
    /* n = round(x / ln 2) by the 1.5 * 2^23 trick (floorf would keep the loop scalar). */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    pun_t e; e.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * e.f;
}

/* Rows per OpenMP task below which a kernel runs on the calling thread alone: forking costs more
   than a decode step's few rows. */
#define PAR_MIN_ELEMS 65536
"""

# One copy per activation dtype: @T@ the C type, @S@ the suffix.
_BODY = r"""
/* out[t] = w * (x[t] * rsqrt(mean(x[t]^2) + eps)); with delta: x[t] + delta[t] first, the sum
   written over delta. Row strides in elements (x may be a strided view). */
void rms_norm_@S@(const @T@* x, int64_t x_stride, @T@* delta, const @T@* w, @T@* out,
                  int64_t rows, int64_t h, float eps, int64_t nthreads) {
    #pragma omp parallel for num_threads((int)nthreads) if (rows * h >= PAR_MIN_ELEMS && nthreads > 1) schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        const @T@* xr = x + t * x_stride;
        @T@* dr = delta ? delta + t * h : 0;
        @T@* o = out + t * h;
        float ss = 0.f;
        if (dr) {
            #pragma omp simd reduction(+:ss)
            for (int64_t i = 0; i < h; ++i) {
                float v = rnd_@S@(ld_@S@(xr[i]) + ld_@S@(dr[i]));
                dr[i] = st_@S@(v);
                ss += v * v;
            }
        } else {
            #pragma omp simd reduction(+:ss)
            for (int64_t i = 0; i < h; ++i) { float v = ld_@S@(xr[i]); ss += v * v; }
        }
        const float r = 1.0f / sqrtf(ss / (float)h + eps);
        const @T@* src = dr ? dr : xr;
        #pragma omp simd
        for (int64_t i = 0; i < h; ++i)
            o[i] = st_@S@(ld_@S@(w[i]) * rnd_@S@(ld_@S@(src[i]) * r));
    }
}

/* out[t, i] = silu(gu[t, i]) * gu[t, n + i], gu [rows, 2n]. */
void silu_mul_@S@(const @T@* gu, @T@* out, int64_t rows, int64_t n, int64_t nthreads) {
    #pragma omp parallel for num_threads((int)nthreads) if (rows * n >= PAR_MIN_ELEMS && nthreads > 1) schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        const @T@* g = gu + t * 2 * n;
        const @T@* u = g + n;
        @T@* o = out + t * n;
        #pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
            const float x = ld_@S@(g[i]);
            const float e = exp_nonpos(x >= 0.f ? -x : x);
            /* x / (1 + e) for x >= 0, x * e / (1 + e) below: one division either way */
            const float s = (x >= 0.f ? x : x * e) / (1.0f + e);
            o[i] = st_@S@(rnd_@S@(s) * ld_@S@(u[i]));
        }
    }
}

/* RoPE over the first nrot heads of each row of qkv [rows, stride] (Q heads then K heads, each
   d wide, rotate-half layout), in place; cos [rows, d], sin_half [rows, d/2]. Then, when slots
   is given, K (heads nq .. nrot-1, rotated) and V (the kvh heads after them) of row t are copied
   to row slots[t] of k_cache and v_cache ([*, kvh * d]). */
void rope_write_@S@(@T@* qkv, int64_t stride, int64_t rows, int64_t nq, int64_t nrot, int64_t d,
                    const @T@* cos_t, const @T@* sin_half, const int64_t* slots,
                    @T@* k_cache, @T@* v_cache, int64_t nthreads) {
    const int64_t half = d / 2, kvh = nrot - nq;
    #pragma omp parallel for num_threads((int)nthreads) if (rows * nrot * d >= PAR_MIN_ELEMS && nthreads > 1) schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        @T@* r = qkv + t * stride;
        const @T@* c = cos_t + t * d;
        const @T@* s = sin_half + t * half;
        for (int64_t hd = 0; hd < nrot; ++hd) {
            @T@* x = r + hd * d;
            #pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = ld_@S@(x[i]), x2 = ld_@S@(x[i + half]);
                const float si = ld_@S@(s[i]);
                /* Eager: x * cos + cat(-x2, x1) * sin, each product rounded to the dtype. */
                const float a1 = rnd_@S@(x1 * ld_@S@(c[i])), b1 = rnd_@S@(-x2 * si);
                const float a2 = rnd_@S@(x2 * ld_@S@(c[i + half])), b2 = rnd_@S@(x1 * si);
                x[i] = st_@S@(a1 + b1);
                x[i + half] = st_@S@(a2 + b2);
            }
        }
        if (slots) {
            memcpy(k_cache + slots[t] * kvh * d, r + nq * d, sizeof(@T@) * kvh * d);
            memcpy(v_cache + slots[t] * kvh * d, r + nrot * d, sizeof(@T@) * kvh * d);
        }
    }
}
"""

_SOURCE = _PRELUDE + "".join(
    _BODY.replace("@T@", t).replace("@S@", s) for t, s in (("float", "f32"), ("uint16_t", "bf16"))
)

_ENV_SWITCH = "BLITZMESH_FUSED_OPS"
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


class FusedOps:
    """The loaded kernels. Arguments are CPU tensors of one dtype in `DTYPES`; shapes are checked
    here, once per call, in Python (no tensor reductions)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self._norm = {}
        self._silu = {}
        self._rope = {}
        for suffix in DTYPES.values():
            fn = getattr(lib, f"rms_norm_{suffix}")
            fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, f32, i64]
            fn.restype = None
            self._norm[suffix] = fn
            fn = getattr(lib, f"silu_mul_{suffix}")
            fn.argtypes = [ptr, ptr, i64, i64, i64]
            fn.restype = None
            self._silu[suffix] = fn
            fn = getattr(lib, f"rope_write_{suffix}")
            fn.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64]
            fn.restype = None
            self._rope[suffix] = fn

    @staticmethod
    def _suffix(*tensors: torch.Tensor) -> str:
        dtype = tensors[0].dtype
        suffix = DTYPES.get(dtype)
        if suffix is None or any(t.dtype != dtype or t.device.type != "cpu" for t in tensors):
            raise ValueError(
                f"fused ops take CPU tensors of one dtype in {list(DTYPES)}, got {[t.dtype for t in tensors]}"
            )
        return suffix

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`weight * rmsnorm(x)` over the last dim of `x [rows, h]` (rows may be strided)."""
        rows, h = x.shape
        if x.stride(1) != 1 or weight.shape != (h,) or not weight.is_contiguous():
            raise ValueError(f"rms_norm: x {tuple(x.shape)} stride {x.stride()}, weight {tuple(weight.shape)}")
        out = torch.empty((rows, h), dtype=x.dtype)
        self._norm[self._suffix(x, weight)](
            x.data_ptr(), x.stride(0), None, weight.data_ptr(), out.data_ptr(), rows, h, eps, torch.get_num_threads()
        )
        return out

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(weight * rmsnorm(x + delta), x + delta)`; the sum is written over `delta` (which must
        be contiguous and is returned as the second value)."""
        rows, h = x.shape
        if (
            x.stride(1) != 1
            or delta.shape != (rows, h)
            or not delta.is_contiguous()
            or weight.shape != (h,)
            or not weight.is_contiguous()
        ):
            raise ValueError(
                f"add_rms_norm: x {tuple(x.shape)} stride {x.stride()}, delta {tuple(delta.shape)}, "
                f"weight {tuple(weight.shape)}"
            )
        out = torch.empty((rows, h), dtype=x.dtype)
        self._norm[self._suffix(x, delta, weight)](
            x.data_ptr(),
            x.stride(0),
            delta.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            h,
            eps,
            torch.get_num_threads(),
        )
        return out, delta

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` of `gate_up [rows, 2n]` (gate first) -> `[rows, n]`."""
        rows, two_n = gate_up.shape
        if two_n % 2 or not gate_up.is_contiguous():
            raise ValueError(f"silu_mul: gate_up {tuple(gate_up.shape)} must be contiguous [rows, 2n]")
        out = torch.empty((rows, two_n // 2), dtype=gate_up.dtype)
        self._silu[self._suffix(gate_up)](gate_up.data_ptr(), out.data_ptr(), rows, two_n // 2, torch.get_num_threads())
        return out

    def rope_write(
        self,
        qkv: torch.Tensor,
        heads: int,
        kv_heads: int,
        head_dim: int,
        cos: torch.Tensor,
        sin_half: torch.Tensor,
        slots: torch.Tensor | None = None,
        k_cache: torch.Tensor | None = None,
        v_cache: torch.Tensor | None = None,
    ) -> None:
        """Rotate the Q and K heads of `qkv [rows, (heads + 2 kv_heads) * head_dim]` in place
        (`cos [rows, d]`, `sin_half [rows, d/2]`, contiguous), then, with `slots [rows]` (int64),
        copy each row's K and V heads into row `slots[t]` of the caches (`[*, kv_heads, d]`
        storage, contiguous; the caller guarantees the slots are inside them)."""
        rows, width = qkv.shape
        d = head_dim
        ok = (
            width == (heads + 2 * kv_heads) * d
            and d % 2 == 0
            and qkv.is_contiguous()
            and cos.shape == (rows, d)
            and sin_half.shape == (rows, d // 2)
            and cos.is_contiguous()
            and sin_half.is_contiguous()
        )
        if slots is not None:
            ok = ok and (
                k_cache is not None
                and v_cache is not None
                and slots.shape == (rows,)
                and slots.dtype == torch.int64
                and slots.is_contiguous()
                and k_cache.is_contiguous()
                and v_cache.is_contiguous()
                and k_cache.dtype == v_cache.dtype == qkv.dtype
            )
        if not ok:
            raise ValueError(
                f"rope_write: qkv {tuple(qkv.shape)} heads {heads}/{kv_heads} d {d}, cos {tuple(cos.shape)}, "
                f"sin_half {tuple(sin_half.shape)}, slots {None if slots is None else tuple(slots.shape)}"
            )
        self._rope[self._suffix(qkv, cos, sin_half)](
            qkv.data_ptr(),
            width,
            rows,
            heads,
            heads + kv_heads,
            d,
            cos.data_ptr(),
            sin_half.data_ptr(),
            None if slots is None else slots.data_ptr(),
            None if k_cache is None else k_cache.data_ptr(),
            None if v_cache is None else v_cache.data_ptr(),
            torch.get_num_threads(),
        )


# ---- eager references (what the model's eager path computes) --------------------------------------


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin_half: torch.Tensor) -> torch.Tensor:
    """x `[T, heads, d]`, cos `[T, 1, d]`, sin_half `[T, 1, d/2]`: HF's `x * cos + rotate_half(x) * sin`."""
    half = x.shape[-1] // 2
    sin = torch.cat((sin_half, sin_half), dim=-1)
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _self_check(ops: FusedOps) -> None:
    """Each kernel against its eager reference on small random cases of each dtype, with rows
    enough to take the threaded path and few enough not to."""
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for rows in (3, 200):
            h = 96
            x = torch.randn(rows, h, generator=g).to(dtype)
            delta = torch.randn(rows, h, generator=g).to(dtype)
            w = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
            checks = [("rms_norm", ops.rms_norm(x, w, 1e-5), reference_rms_norm(x, w, 1e-5))]
            total = x + delta
            normed, summed = ops.add_rms_norm(x, delta.clone(), w, 1e-5)
            checks += [("add_rms_norm", normed, reference_rms_norm(total, w, 1e-5)), ("add", summed, total)]
            gu = (3 * torch.randn(rows, 2 * h, generator=g)).to(dtype)
            checks.append(("silu_mul", ops.silu_mul(gu), reference_silu_mul(gu)))
            heads, kvh, d = 4, 2, 16
            qkv = torch.randn(rows, (heads + 2 * kvh) * d, generator=g).to(dtype)
            ang = torch.rand(rows, d // 2, generator=g) * 6
            cos = torch.cat([ang.cos(), ang.cos()], dim=-1).to(dtype)
            sin_half = ang.sin().to(dtype)
            k_cache = torch.zeros(rows + 5, kvh, d, dtype=dtype)
            v_cache = torch.zeros(rows + 5, kvh, d, dtype=dtype)
            slots = torch.randperm(rows + 5, generator=g)[:rows]
            want = reference_rope(
                qkv[:, : (heads + kvh) * d].view(rows, heads + kvh, d), cos[:, None], sin_half[:, None]
            )
            v_want = qkv[:, (heads + kvh) * d :].view(rows, kvh, d).clone()
            got = qkv.clone()
            ops.rope_write(got, heads, kvh, d, cos, sin_half, slots, k_cache, v_cache)
            checks += [
                ("rope", got[:, : (heads + kvh) * d].view(rows, heads + kvh, d), want),
                ("k_write", k_cache[slots], want[:, heads:]),
                ("v_write", v_cache[slots], v_want),
            ]
            for name, have, expect in checks:
                if not torch.allclose(have.float(), expect.float(), atol=tol, rtol=tol):
                    err = (have.float() - expect.float()).abs().max().item()
                    raise RuntimeError(f"self-check failed: {name} {dtype} rows={rows}: max error {err:.3g}")


def _load(isa: str) -> FusedOps:
    flags = [*vector_flags(isa), "-ffp-contract=off"]
    return FusedOps(ctypes.CDLL(str(build_library(_SOURCE, "fused_ops", flags))))


_FUSED = LazyKernel("fused_ops", "native_fused_ops", _ENV_SWITCH, _load, _self_check)


def fused_ops() -> FusedOps | None:
    """The fused kernels the model uses (see `native.LazyKernel.get`); None: the eager ops."""
    return _FUSED.get()


def fused_ops_at(isa: str) -> FusedOps | None:
    """The fused kernels built for level `isa`, whatever was chosen; None if unavailable."""
    return _FUSED.build(isa)
