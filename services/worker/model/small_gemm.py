"""A native GEMM for the few rows of a decode step, on CPUs with AVX-512 or AVX2 + FMA.

A decode step multiplies a handful of rows (one per running sequence) by every weight matrix, so
it is bound by reading the weights. oneDNN's GEMM on its prepacked weights read them well below
the memory's rate on the development box (2 threads; 25 GB/s is its copy rate): bfloat16 at about
17 GB/s with one row and 13 GB/s with 16, and each call cost 14 us of dispatch. This kernel reads
a copy packed at load for it, once per 8 rows (more rows take more passes over a block's weights,
the later ones from cache; one pass of 16 rows x 16 columns measured slower):

- bfloat16, where the CPU has AVX512-BF16: per block of 16 output columns, K/2 vectors of 16
  pairs of input dimensions, multiplied with `vdpbf16ps` against each row's two inputs
  broadcast; exact products summed in float32 and rounded to bfloat16 once, as oneDNN rounds, or
  left in float32 for the LM head's logits;
- float32: per block of 16 output columns, K vectors of 16 weights, one FMA per row and input
  (AVX-512: one 16-wide vector; AVX2 + FMA: two 8-wide ones, rows 4 at a time, or 1-2 rows over
  two blocks for more independent sums). Each row's sums run in K order whatever the row count.

Over the 120 projections of the default model's 30 layers: bfloat16 7.3 / 8.8 / 12.5 / 21.0 ms at
1 / 8 / 16 / 32 rows against oneDNN's 15.4 / 12.4 / 15.1 / 24.5; float32 12.9 / 14.0 / 22.2 / 41.7
against 20.9 / 20.2 / 34.0 / 42.7 (the same sums in another order: float32 errors against a
float64 product of the same size as oneDNN's). In the engine a one-sequence decode step of the
default model took 13.6 ms against 24.3 in bfloat16 and 22-25 against 34-35 in float32; a
16-sequence one 41-43 against 45-50 and 54-57 against 61-67 (a shared box).

`Linear` keeps the packed copy beside the plain and oneDNN-blocked ones (one more copy of the
weights in memory) and routes calls of at most `MAX_ROWS` rows here. With
`BLITZMESH_SMALL_GEMM=0`, on CPUs without AVX2, where the worker's kernel plan measured oneDNN
faster (`kernels.py`), for weights with a bias, or shapes that are not N % 16 == 0 and K % 2 == 0,
oneDNN runs them.
"""

from __future__ import annotations

import ctypes

import torch

from services.worker.model import native
from services.worker.model.native import LazyKernel, build_library, has_avx512_bf16, target_isa, vector_flags

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#ifdef __AVX512BF16__

/* Weight w [N, K] bfloat16 (row-major, out x in) -> wp: for each block of 16 output columns,
   K/2 vectors of 16 pairs (w[n][2p], w[n][2p+1]). N % 16 == 0, K % 2 == 0. */
void pack_bf16_pairs(const uint16_t* w, int64_t N, int64_t K, uint32_t* wp, int64_t nthreads) {
    const int64_t P = K / 2;
    #pragma omp parallel for num_threads((int)nthreads) schedule(static)
    for (int64_t b = 0; b < N / 16; ++b)
        for (int64_t p = 0; p < P; ++p)
            for (int64_t l = 0; l < 16; ++l) {
                const uint32_t* row = (const uint32_t*)(w + (b * 16 + l) * K);
                wp[(b * P + p) * 16 + l] = row[p];
            }
}

static inline __m256i f32x16_to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

/* RB rows x 32 columns (two blocks) over all K. */
static inline __attribute__((always_inline)) void tile(const uint16_t* x, int64_t x_stride, const uint32_t* wp0,
                                                        const uint32_t* wp1, int64_t P, void* out, int64_t o0,
                                                        int64_t o_stride, int out_f32, int rb, const int RB,
                                                        const int NB) {
    __m512 acc[8][2];
    for (int r = 0; r < RB; ++r) for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
    const uint32_t* xr[8];
    for (int r = 0; r < RB; ++r) xr[r] = (const uint32_t*)(x + (r < rb ? r : 0) * x_stride);
    for (int64_t p = 0; p < P; ++p) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void*)(wp0 + p * 16));
        __m512bh w1 = w0;
        if (NB == 2) w1 = (__m512bh)_mm512_loadu_si512((const void*)(wp1 + p * 16));
        for (int r = 0; r < RB; ++r) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xr[r][p]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
            if (NB == 2) acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
        }
    }
    for (int r = 0; r < RB && r < rb; ++r)
        for (int j = 0; j < NB; ++j) {
            const int64_t at = o0 + r * o_stride + 16 * j;
            if (out_f32) _mm512_storeu_ps((float*)out + at, acc[r][j]);
            else _mm256_storeu_si256((__m256i*)((uint16_t*)out + at), f32x16_to_bf16(acc[r][j]));
        }
}

/* out [M, N] = x [M, K] w^T, bfloat16 in, float32 sums, out bfloat16 (rounded once) or, with
   out_f32, float32; w packed by pack_bf16_pairs. Each row's sums run in the same order whatever
   M is, so a row's result does not depend on the rows beside it. */
void gemm_small_bf16(const uint16_t* x, int64_t x_stride, const uint32_t* wp, void* out, int64_t M,
                     int64_t N, int64_t K, int out_f32, int64_t nthreads) {
    const int64_t P = K / 2, blocks = N / 16, pairs = (blocks + 1) / 2;
    #pragma omp parallel for num_threads((int)nthreads) schedule(static) if (nthreads > 1)
    for (int64_t bp = 0; bp < pairs; ++bp) {
        const int64_t b0 = 2 * bp;
        const int nb = b0 + 1 < blocks ? 2 : 1;
        const uint32_t* wp0 = wp + b0 * P * 16;
        const uint32_t* wp1 = wp0 + P * 16;
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            const int rb = M - m0 < 8 ? (int)(M - m0) : 8;
            const uint16_t* xm = x + m0 * x_stride;
            const int64_t o0 = m0 * N + b0 * 16;
            if (nb == 2) {
                if (rb == 8) tile(xm, x_stride, wp0, wp1, P, out, o0, N, out_f32, rb, 8, 2);
                else if (rb >= 4) tile(xm, x_stride, wp0, wp1, P, out, o0, N, out_f32, rb, rb == 4 ? 4 : 8, 2);
                else if (rb == 1) tile(xm, x_stride, wp0, wp1, P, out, o0, N, out_f32, rb, 1, 2);
                else tile(xm, x_stride, wp0, wp1, P, out, o0, N, out_f32, rb, 4, 2);
            } else {
                tile(xm, x_stride, wp0, wp1, P, out, o0, N, out_f32, rb, 8, 1);
            }
        }
    }
}
#endif

/* Weight w [N, K] float32 -> wp: for each block of 16 output columns, K vectors of its 16 weights
   at one input dimension. N % 16 == 0. */
void pack_f32_panels(const float* w, int64_t N, int64_t K, float* wp, int64_t nthreads) {
    #pragma omp parallel for num_threads((int)nthreads) schedule(static)
    for (int64_t b = 0; b < N / 16; ++b)
        for (int64_t k = 0; k < K; ++k)
            for (int64_t l = 0; l < 16; ++l) wp[(b * K + k) * 16 + l] = w[(b * 16 + l) * K + k];
}
#ifdef __AVX512F__
/* RB rows x 32 columns (two blocks) over all K, float32 FMAs in K order. */
static inline __attribute__((always_inline)) void tilef(const float* x, int64_t xs, const float* w0p, const float* w1p, int64_t K, float* out, int64_t os, int rb, const int RB, const int NB) {
    __m512 acc[8][2];
    for (int r = 0; r < RB; ++r) for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
    const float* xr[8];
    for (int r = 0; r < RB; ++r) xr[r] = x + (r < rb ? r : 0) * xs;
    for (int64_t k = 0; k < K; ++k) {
        const __m512 w0 = _mm512_loadu_ps(w0p + k * 16);
        __m512 w1 = w0; if (NB == 2) w1 = _mm512_loadu_ps(w1p + k * 16);
        for (int r = 0; r < RB; ++r) {
            const __m512 xv = _mm512_set1_ps(xr[r][k]);
            acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
            if (NB == 2) acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < RB && r < rb; ++r) for (int j = 0; j < NB; ++j) _mm512_storeu_ps(out + r * os + 16 * j, acc[r][j]);
}
/* out [M, N] = x [M, K] w^T in float32; w packed by pack_f32_panels. */
void gemm_small_f32(const float* x, int64_t xs, const float* wp, float* out, int64_t M, int64_t N, int64_t K, int64_t nthreads) {
    const int64_t blocks = N / 16, pairs = (blocks + 1) / 2;
    #pragma omp parallel for num_threads((int)nthreads) schedule(static) if (nthreads > 1)
    for (int64_t bp = 0; bp < pairs; ++bp) {
        const int64_t b0 = 2 * bp; const int nb = b0 + 1 < blocks ? 2 : 1;
        const float* w0p = wp + b0 * K * 16; const float* w1p = w0p + K * 16;
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            const int rb = M - m0 < 8 ? (int)(M - m0) : 8;
            const float* xm = x + m0 * xs; float* om = out + m0 * N + b0 * 16;
            if (nb == 2) { if (rb == 8) tilef(xm, xs, w0p, w1p, K, om, N, rb, 8, 2); else if (rb == 1) tilef(xm, xs, w0p, w1p, K, om, N, rb, 1, 2); else if (rb <= 4) tilef(xm, xs, w0p, w1p, K, om, N, rb, 4, 2); else tilef(xm, xs, w0p, w1p, K, om, N, rb, 8, 2); }
            else tilef(xm, xs, w0p, w1p, K, om, N, rb, 8, 1);
        }
    }
}
#else
/* AVX2 + FMA: RB rows x NB blocks of 16 columns (two 8-wide vectors each) over all K, float32
   FMAs in K order: RB * NB * 2 accumulators (at most 8 of the 16 vector registers). */
static inline __attribute__((always_inline)) void tilef2(const float* x, int64_t xs, const float* w0p, const float* w1p, int64_t K, float* out, int64_t os, int rb, const int RB, const int NB) {
    __m256 acc[4][4];
    for (int r = 0; r < RB; ++r) for (int j = 0; j < 2 * NB; ++j) acc[r][j] = _mm256_setzero_ps();
    const float* xr[4];
    for (int r = 0; r < RB; ++r) xr[r] = x + (r < rb ? r : 0) * xs;
    for (int64_t k = 0; k < K; ++k) {
        __m256 w[4];
        w[0] = _mm256_loadu_ps(w0p + k * 16); w[1] = _mm256_loadu_ps(w0p + k * 16 + 8);
        if (NB == 2) { w[2] = _mm256_loadu_ps(w1p + k * 16); w[3] = _mm256_loadu_ps(w1p + k * 16 + 8); }
        for (int r = 0; r < RB; ++r) {
            const __m256 xv = _mm256_broadcast_ss(xr[r] + k);
            for (int j = 0; j < 2 * NB; ++j) acc[r][j] = _mm256_fmadd_ps(xv, w[j], acc[r][j]);
        }
    }
    for (int r = 0; r < RB && r < rb; ++r) for (int j = 0; j < 2 * NB; ++j) _mm256_storeu_ps(out + r * os + 16 * (j / 2) + 8 * (j % 2), acc[r][j]);
}
/* out [M, N] = x [M, K] w^T in float32; w packed by pack_f32_panels. Rows go 4 at a time over
   one block (or 1-2 at a time over two blocks, for more independent sums); every row's sums run
   in K order whatever M is, so a row's result does not depend on the rows beside it. */
void gemm_small_f32(const float* x, int64_t xs, const float* wp, float* out, int64_t M, int64_t N, int64_t K, int64_t nthreads) {
    const int64_t blocks = N / 16, pairs = (blocks + 1) / 2;
    #pragma omp parallel for num_threads((int)nthreads) schedule(static) if (nthreads > 1)
    for (int64_t bp = 0; bp < pairs; ++bp) {
        const int64_t b0 = 2 * bp; const int nb = b0 + 1 < blocks ? 2 : 1;
        const float* w0p = wp + b0 * K * 16; const float* w1p = w0p + K * 16;
        for (int64_t m0 = 0; m0 < M;) {
            const int left = M - m0 < 4 ? (int)(M - m0) : 4;
            const float* xm = x + m0 * xs; float* om = out + m0 * N + b0 * 16;
            if (left <= 2) {
                if (nb == 2) { if (left == 1) tilef2(xm, xs, w0p, w1p, K, om, N, 1, 1, 2); else tilef2(xm, xs, w0p, w1p, K, om, N, 2, 2, 2); }
                else { if (left == 1) tilef2(xm, xs, w0p, w1p, K, om, N, 1, 1, 1); else tilef2(xm, xs, w0p, w1p, K, om, N, 2, 2, 1); }
                m0 += left;
            } else {
                tilef2(xm, xs, w0p, w0p, K, om, N, left, 4, 1);
                if (nb == 2) tilef2(xm, xs, w1p, w1p, K, om + 16, N, left, 4, 1);
                m0 += left;
            }
        }
    }
}
#endif
"""

_ENV_SWITCH = "BLITZMESH_SMALL_GEMM"
# The most rows a call takes here without a measurement (the kernel beat oneDNN at every count up
# to 32 on the AVX-512 development box). The worker's kernel plan measures the count on the CPU it
# runs on (`max_rows()`): on an AVX2 EPYC the kernel wins at 1-4 rows and loses from 16.
MAX_ROWS = 32


def max_rows() -> int:
    """The most rows a call takes this kernel with: the kernel plan's measured limit, else
    `MAX_ROWS`."""
    return native.row_limit("small_gemm") or MAX_ROWS


class SmallGemm:
    """The loaded kernel: `pack(w)` once per weight, then `__call__(x, packed, n)`; float32
    weights on AVX-512, bfloat16 ones where the CPU has AVX512-BF16 too (`bf16`)."""

    def __init__(self, lib: ctypes.CDLL, bf16: bool) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.bf16 = bf16
        self._pack = {torch.float32: lib.pack_f32_panels}
        self._gemm = {torch.float32: lib.gemm_small_f32}
        if bf16:
            self._pack[torch.bfloat16] = lib.pack_bf16_pairs
            self._gemm[torch.bfloat16] = lib.gemm_small_bf16
        for fn in self._pack.values():
            fn.argtypes = [ptr, i64, i64, ptr, i64]
            fn.restype = None
        lib.gemm_small_f32.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64]
        if bf16:
            lib.gemm_small_bf16.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ctypes.c_int, i64]
        for fn in self._gemm.values():
            fn.restype = None

    def packable(self, weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and self.packs_shape(weight.dtype, tuple(weight.shape))

    def packs_shape(self, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
        """Whether a CPU weight of this dtype and [N, K] shape gets a packed copy (its bytes:
        the weight's own)."""
        return dtype in self._pack and len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % 2 == 0

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight [N, K]` -> its packed copy (bfloat16: int32 storage of N * K / 2 pairs;
        float32: N * K floats in 16-column panels)."""
        if not self.packable(weight):
            raise ValueError(
                f"small GEMM packs [N % 16, K % 2] weights of {[str(d) for d in self._pack]}, "
                f"got {tuple(weight.shape)} {weight.dtype}"
            )
        n, k = weight.shape
        w = weight.contiguous()
        if weight.dtype == torch.bfloat16:
            packed = torch.empty(n * k // 2, dtype=torch.int32)
        else:
            packed = torch.empty(n * k, dtype=torch.float32)
        self._pack[weight.dtype](w.data_ptr(), n, k, packed.data_ptr(), torch.get_num_threads())
        return packed

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """`x [M, K]` (rows may be strided) times the packed `[N, K]` weight of x's dtype ->
        `[M, N]` in `out_dtype`: x's dtype by default; float32 for bfloat16 x gives the sums
        unrounded."""
        m, k = x.shape
        out_dtype = out_dtype or x.dtype
        bf16 = x.dtype == torch.bfloat16
        width = 2 if bf16 else 1  # elements per packed item
        if (
            x.dtype not in self._gemm
            or x.stride(1) != 1
            or packed.numel() * width != n * k
            or packed.dtype != (torch.int32 if bf16 else torch.float32)
            or out_dtype not in ((torch.bfloat16, torch.float32) if bf16 else (torch.float32,))
        ):
            raise ValueError(
                f"small GEMM: x {tuple(x.shape)} {x.dtype} stride {x.stride()}, weight of {n} x {k}, out {out_dtype}"
            )
        out = torch.empty((m, n), dtype=out_dtype)
        threads = torch.get_num_threads()
        if bf16:
            f32 = int(out_dtype == torch.float32)
            self._gemm[x.dtype](x.data_ptr(), x.stride(0), packed.data_ptr(), out.data_ptr(), m, n, k, f32, threads)
        else:
            self._gemm[x.dtype](x.data_ptr(), x.stride(0), packed.data_ptr(), out.data_ptr(), m, n, k, threads)
        return out


# Levels with a path: AVX-512 (float32, and bfloat16 with AVX512-BF16) and AVX2 + FMA (float32).
LEVELS = ("avx512", "avx2")


def _load(isa: str) -> SmallGemm:
    if isa not in LEVELS:
        raise RuntimeError(f"the small GEMM has AVX-512 and AVX2 paths only (asked for {isa!r})")
    bf16 = has_avx512_bf16(isa)
    flags = [*vector_flags(isa), *(["-mavx512bf16"] if bf16 else [])]
    return SmallGemm(ctypes.CDLL(str(build_library(_SOURCE, "small_gemm", flags))), bf16)


def _self_check(kernel: SmallGemm) -> None:
    """Against a float32 matmul of the same operands (rounded once for bfloat16): every row count
    from 1 to 17 (full and partial row groups) and 32, an odd number of 16-column blocks, strided
    rows."""
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
        if dtype == torch.bfloat16 and not kernel.bf16:
            continue
        for n, k in ((48, 34), (64, 96)):
            w = torch.randn(n, k, generator=g).to(dtype)
            packed = kernel.pack(w)
            for m in (*range(1, 18), 32):
                x = torch.randn(m, k + 6, generator=g).to(dtype)[:, 3 : 3 + k]
                got = kernel(x, packed, n)
                want = (x.float() @ w.float().T).to(dtype)
                if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
                    err = (got.float() - want.float()).abs().max().item()
                    raise RuntimeError(f"self-check failed: {dtype} [{m} x {k}] x [{n} x {k}]^T: max error {err:.3g}")


_KERNEL = LazyKernel("small_gemm", "native_small_gemm", _ENV_SWITCH, _load, _self_check)


def small_gemm() -> SmallGemm | None:
    """The kernel the model uses (see `native.LazyKernel.get`); None where unavailable (below
    AVX2, or the CPU_ISA cap) or not chosen: oneDNN runs every row count."""
    if target_isa() not in LEVELS:
        return None
    return _KERNEL.get()


def small_gemm_at(isa: str) -> SmallGemm | None:
    """The kernel built for level `isa`, whatever was chosen; None where unavailable."""
    return _KERNEL.build(isa) if isa in LEVELS else None
