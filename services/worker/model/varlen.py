"""A native (C, OpenMP) varlen attention kernel over the paged KV cache, for steps that carry
prompt tokens: fresh prompts, later chunks of a prompt and prompts after a prefix-cache hit.

Each sequence s has `q_len[s]` new tokens after `ctx[s]` cached ones, and every key, cached or
new, is already in the paged cache (the fused RoPE kernel writes the new K/V before attention).
The kernel reads K and V through the block tables once per call, packing each sequence's keys
(transposed) and values per KV head and chunk of 64 keys, widened to float32, so that every query
tile reads them packed (it used to transpose them again per tile: one 2,048-token layer went from
30.4 to 27.1 ms, about 180 GFLOP/s, near the float32 GEMM rate); no mask is materialized. Work is
split into tasks of (sequence, KV head, tile of 32 query positions); a task packs the G query
heads that share its KV head as G x 32 rows, so each K/V row it reads serves all of them, and
visits only the chunks its causal (or sliding) window reaches (chunks start at multiples of 64
keys, so a row's result does not depend on how its prompt was cut into tiles or chunks). Scores,
the online softmax (running max and sum, as flash attention does) and the output accumulate in
float32, whatever the cache's dtype.

Three paths, picked at compile time by the build's flags:

- AVX-512 (`__AVX512F__`): 4 query rows x 64 keys of scores per pass, 4 rows x up to 64 lanes of
  the head for P V, 16-lane exponentials.
- AVX2 + FMA (`__AVX2__` and `__FMA__` without AVX-512; head sizes a multiple of 8): the task's rows
  in groups of 6, each group over a chunk in one go: scores 6 rows x 16 keys (12 accumulators,
  each key's sum over the head in order), the online softmax of the 6 rows together (one lane per
  row for the maxima, rescaling factors and sums; 8-lane base-2 exponentials on scores kept in
  units of log2(e)), then P V 6 rows x 16 lanes of the head. A row is computed the same way
  whichever rows share its group. On a 2-core AMD EPYC (AVX2, FMA, F16C; bench.engine.varlen_avx2,
  default model's shapes) one 2,048-token float32 layer takes 66.9 ms of one core's time against
  90.1 ms for torch's SDPA (about 72 against 54 GFLOP/s; peak about 100), 108 against 124 ms on
  2 threads of that shared machine.
- Portable C for head sizes the vector paths do not take. As a level of its own (built with no
  vector flags) it measured 5-20x slower than torch's SDPA on the default model's shapes (0.05-0.21
  of its speed), so the kernel is not built at the portable level: there attention always runs
  on torch's paths.

Built like the other kernels (`native.build_library`), checked against SDPA on load; with
`BLITZMESH_VARLEN_ATTENTION=0` or where it cannot be built, `paged_prefill()` returns None and
attention uses the torch paths.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from services.worker.model import varlen_dot
from services.worker.model.native import (
    AVX512_EXP16,
    KV_DTYPES,
    LazyKernel,
    build_library,
    expand_variants,
    vector_flags,
)
from services.worker.model.varlen_reference import reference_prefill

_PRELUDE = (
    r"""
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define VL_AVX2 1  /* the AVX2 + FMA path (8 float32 lanes); AVX-512 builds take theirs */
#endif
#if defined(__AVX512F__) || defined(VL_AVX2)
#include <immintrin.h>
#endif

#define QT 32      /* query positions per task */
#define KC 64      /* keys per chunk (one online-softmax update): may span blocks */

static inline float bf16_to_f32(uint16_t x) { uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f; }
static inline float to_f32_f32(float x) { return x; }
static inline float to_f32_bf16(uint16_t x) { return bf16_to_f32(x); }
static inline float from_f32_f32(float x) { return x; }
/* float32 -> bfloat16 as torch rounds it: to nearest, ties to even; NaN stays a quiet NaN. */
static inline uint16_t from_f32_bf16(float f) {
    if (f != f) return 0x7FC0;
    uint32_t u; memcpy(&u, &f, 4);
    return (uint16_t)((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
}

#ifdef __AVX512F__
"""
    + AVX512_EXP16
    + r"""
#endif

#ifdef VL_AVX2
/* 2^x for x <= 0 in 8 lanes (Cephes exp2f: x = n + f, |f| <= 1/2, degree-5 polynomial, about
   2e-7 relative), 2^-125 and below to 2^-125. The path keeps scores in units of log2(e) (the
   queries' scale times log2(e)), so exp(s - m) is 2^(s' - m') with one multiplication fewer and
   no two-part ln(2) reduction. */
static inline __m256 vl_exp2(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-125.f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    /* p in [0.7, 1.42] times 2^n, n >= -125: add n to the exponent field (stays normal) */
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23)));
}

/* Eight rows' vectors a[0..7] -> one vector of their eight reductions (lane x: row x's max, or
   sum), by the same tree for every lane: ((0 2)(1 3)) ((4 6)(5 7)) as lanes of the row, so a row's
   result does not depend on its place among the eight. */
#define VL_REDUCE8(NAME, OP)                                                                          \
    static inline __m256 NAME(const __m256* a) {                                                     \
        const __m256 t0 = OP(_mm256_unpacklo_ps(a[0], a[1]), _mm256_unpackhi_ps(a[0], a[1]));      \
        const __m256 t1 = OP(_mm256_unpacklo_ps(a[2], a[3]), _mm256_unpackhi_ps(a[2], a[3]));      \
        const __m256 t2 = OP(_mm256_unpacklo_ps(a[4], a[5]), _mm256_unpackhi_ps(a[4], a[5]));      \
        const __m256 t3 = OP(_mm256_unpacklo_ps(a[6], a[7]), _mm256_unpackhi_ps(a[6], a[7]));      \
        const __m256 u0 = OP(_mm256_shuffle_ps(t0, t1, 0x44), _mm256_shuffle_ps(t0, t1, 0xEE));    \
        const __m256 u1 = OP(_mm256_shuffle_ps(t2, t3, 0x44), _mm256_shuffle_ps(t2, t3, 0xEE));    \
        return OP(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));     \
    }
VL_REDUCE8(vl_max8x8, _mm256_max_ps)
VL_REDUCE8(vl_sum8x8, _mm256_add_ps)

/* The online-softmax update of NR (<= 6) rows over a chunk of 64 scores each (sc [NR][KC]), row x
   seeing keys [lo[x], hi[x]) (none where hi <= lo): the visible scores become exp(s - m_new),
   the rest zeros; m and l move to the new running max and sum, alphas get the factor each row's
   output so far is to be scaled by (1 for a row that sees nothing). Maxima, the rescaling and
   the sums run for the rows together, one lane each. */
static inline __attribute__((always_inline)) void vl_softmax(float* sc, const int64_t* lo, const int64_t* hi,
                                                             float* m, float* l, float* alphas, const int NR) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 red[8];
    float mo[8], lo_[8], act[8];
    int part[6];
    for (int x = 0; x < 8; ++x) { red[x] = ninf; mo[x] = -INFINITY; lo_[x] = 0.f; act[x] = 0.f; }
    for (int x = 0; x < NR; ++x) {
        float* s = sc + x * KC;
        part[x] = -1;
        if (hi[x] <= lo[x]) {
            for (int y = 0; y < 8; ++y) _mm256_storeu_ps(s + 8 * y, _mm256_setzero_ps());
            continue;
        }
        mo[x] = m[x]; lo_[x] = l[x];
        memset(act + x, 0xFF, sizeof(float));
        __m256 sv[8];
        if (lo[x] == 0 && hi[x] >= KC) {
            part[x] = 0;
            for (int y = 0; y < 8; ++y) sv[y] = _mm256_loadu_ps(s + 8 * y);
        } else {
            /* keys outside [lo, hi) to -inf (written back, for the exponentials below) */
            part[x] = 1;
            const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256i vlo = _mm256_set1_epi32((int)lo[x]), vhi = _mm256_set1_epi32((int)hi[x]);
            for (int y = 0; y < 8; ++y) {
                const __m256i idx = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * y));
                const __m256 keep = _mm256_castsi256_ps(
                    _mm256_andnot_si256(_mm256_cmpgt_epi32(vlo, idx), _mm256_cmpgt_epi32(vhi, idx)));
                sv[y] = _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + 8 * y), keep);
                _mm256_storeu_ps(s + 8 * y, sv[y]);
            }
        }
        red[x] = _mm256_max_ps(_mm256_max_ps(_mm256_max_ps(sv[0], sv[1]), _mm256_max_ps(sv[2], sv[3])),
                               _mm256_max_ps(_mm256_max_ps(sv[4], sv[5]), _mm256_max_ps(sv[6], sv[7])));
    }
    const __m256 active = _mm256_loadu_ps(act);
    const __m256 vmo = _mm256_loadu_ps(mo);
    const __m256 vmn = _mm256_blendv_ps(vmo, _mm256_max_ps(vmo, vl_max8x8(red)), active);
    /* alpha: 0 for a row's first visible keys, exp(m_old - m_new) after, 1 where it sees none */
    __m256 va = vl_exp2(_mm256_sub_ps(_mm256_blendv_ps(_mm256_setzero_ps(), vmo, active),
                                      _mm256_blendv_ps(_mm256_setzero_ps(), vmn, active)));
    va = _mm256_andnot_ps(_mm256_cmp_ps(vmo, ninf, _CMP_EQ_OQ), va);
    va = _mm256_blendv_ps(_mm256_set1_ps(1.f), va, active);
    float mn[8];
    _mm256_storeu_ps(mn, vmn);
    __m256 sums[8];
    for (int x = 0; x < 8; ++x) sums[x] = _mm256_setzero_ps();
    for (int x = 0; x < NR; ++x) {
        if (part[x] < 0) continue;
        float* s = sc + x * KC;
        const __m256 mb = _mm256_set1_ps(mn[x]);
        __m256 e[8];
        for (int y = 0; y < 8; ++y) {
            const __m256 sv = _mm256_loadu_ps(s + 8 * y);
            e[y] = vl_exp2(_mm256_sub_ps(sv, mb));
            if (part[x]) e[y] = _mm256_and_ps(e[y], _mm256_cmp_ps(sv, ninf, _CMP_NEQ_OQ));
            _mm256_storeu_ps(s + 8 * y, e[y]);
        }
        sums[x] = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(e[0], e[1]), _mm256_add_ps(e[2], e[3])),
                                _mm256_add_ps(_mm256_add_ps(e[4], e[5]), _mm256_add_ps(e[6], e[7])));
    }
    const __m256 vl = _mm256_fmadd_ps(_mm256_loadu_ps(lo_), va, vl_sum8x8(sums));
    float ln[8], al[8];
    _mm256_storeu_ps(ln, vl);
    _mm256_storeu_ps(al, va);
    for (int x = 0; x < NR; ++x) {
        alphas[x] = al[x];
        if (part[x] >= 0) { m[x] = mn[x]; l[x] = ln[x]; }
    }
}

/* Scores of NR (<= 6) rows: sc [NR][KC] keys [0, 16 * nk) = qs [NR][D] . kt [D][KC], each key's
   sum over d in order from zero (a row's scores do not depend on the rows beside it). */
static inline __attribute__((always_inline)) void vl_qk(const float* qs, int64_t D, const float* kt, int64_t nk,
                                                        float* sc, const int NR) {
    for (int64_t j0 = 0; j0 < 16 * nk; j0 += 16) {
        __m256 a[6][2];
        for (int x = 0; x < NR; ++x) a[x][0] = a[x][1] = _mm256_setzero_ps();
        const float* kd = kt + j0;
        for (int64_t d = 0; d < D; ++d, kd += KC) {
            const __m256 k0 = _mm256_loadu_ps(kd), k1 = _mm256_loadu_ps(kd + 8);
            for (int x = 0; x < NR; ++x) {
                const __m256 qv = _mm256_broadcast_ss(qs + x * D + d);
                a[x][0] = _mm256_fmadd_ps(qv, k0, a[x][0]);
                a[x][1] = _mm256_fmadd_ps(qv, k1, a[x][1]);
            }
        }
        for (int x = 0; x < NR; ++x) {
            _mm256_storeu_ps(sc + x * KC + j0, a[x][0]);
            _mm256_storeu_ps(sc + x * KC + j0 + 8, a[x][1]);
        }
    }
}

/* os rows [NR][D] lanes [dv, dv + 8 NV) = alpha * os + P V over keys [lo, hi): p [NR][KC]
   probabilities (zeros where a row sees nothing), vc [KC][D]; each lane's sum in key order. */
static inline __attribute__((always_inline)) void vl_pv(float* os, int64_t D, int64_t dv, const float* p,
                                                        const float* vc, int64_t lo, int64_t hi,
                                                        const float* alphas, const int NR, const int NV) {
    __m256 o[6][2];
    for (int x = 0; x < NR; ++x)
        for (int y = 0; y < NV; ++y)
            o[x][y] = _mm256_mul_ps(_mm256_loadu_ps(os + x * D + dv + 8 * y), _mm256_set1_ps(alphas[x]));
    for (int64_t j = lo; j < hi; ++j) {
        __m256 v[2];
        for (int y = 0; y < NV; ++y) v[y] = _mm256_loadu_ps(vc + j * D + dv + 8 * y);
        for (int x = 0; x < NR; ++x) {
            const __m256 pr = _mm256_broadcast_ss(p + x * KC + j);
            for (int y = 0; y < NV; ++y) o[x][y] = _mm256_fmadd_ps(pr, v[y], o[x][y]);
        }
    }
    for (int x = 0; x < NR; ++x)
        for (int y = 0; y < NV; ++y) _mm256_storeu_ps(os + x * D + dv + 8 * y, o[x][y]);
}

/* One group of NR rows over one chunk: scores, online softmax, output. lohi: the rows' visible
   key ranges [lo, hi) (hi <= lo: none), alphas scratch [NR]. */
static inline __attribute__((always_inline)) void vl_rows(const float* qs, float* os, float* sc, float* m, float* l,
                                                          const int64_t* lo, const int64_t* hi, float* alphas,
                                                          const float* kt, const float* vc, int64_t D,
                                                          const int NR) {
    int64_t ulo = KC, uhi = 0;
    for (int x = 0; x < NR; ++x)
        if (hi[x] > lo[x]) {
            if (hi[x] > uhi) uhi = hi[x];
            if (lo[x] < ulo) ulo = lo[x];
        }
    if (uhi <= ulo) return;  /* no row sees a key here: nothing changes */
    vl_qk(qs, D, kt, (uhi + 15) / 16, sc, NR);
    vl_softmax(sc, lo, hi, m, l, alphas, NR);
    /* rows whose range is narrower have zeros in the wider one: exact */
    int64_t dv = 0;
    for (; dv + 16 <= D; dv += 16) vl_pv(os, D, dv, sc, vc, ulo, uhi, alphas, NR, 2);
    for (; dv < D; dv += 8) vl_pv(os, D, dv, sc, vc, ulo, uhi, alphas, NR, 1);
}
#endif
"""
)

_BODY = r"""
#ifdef __AVX512F__
/* os rows x (4 of them) += P V over keys [lo, hi) for NV vectors of 16 lanes from dv, after
   scaling by their alphas: p [4][KC] probabilities, vc [KC][D]. */
static inline __attribute__((always_inline)) void pv4_@S@(float* os, int64_t D, int64_t dv, const float* p,
                                                          const float* vc, int64_t lo, int64_t hi,
                                                          const float* alphas, const int NV) {
    __m512 o[4][4];
    for (int x = 0; x < 4; ++x)
        for (int y = 0; y < NV; ++y)
            o[x][y] = _mm512_mul_ps(_mm512_loadu_ps(os + x * D + dv + 16 * y), _mm512_set1_ps(alphas[x]));
    for (int64_t j = lo; j < hi; ++j) {
        __m512 v[4];
        for (int y = 0; y < NV; ++y) v[y] = _mm512_loadu_ps(vc + j * D + dv + 16 * y);
        for (int x = 0; x < 4; ++x) {
            const __m512 pr = _mm512_set1_ps(p[x * KC + j]);
            for (int y = 0; y < NV; ++y) o[x][y] = _mm512_fmadd_ps(pr, v[y], o[x][y]);
        }
    }
    for (int x = 0; x < 4; ++x)
        for (int y = 0; y < NV; ++y) _mm512_storeu_ps(os + x * D + dv + 16 * y, o[x][y]);
}
#endif

/* Pack chunk ci (keys ci * KC .. + cn - 1) of one sequence's KV head: K transposed into kt [D, KC]
   and V into vc [KC, D], widened to float32, zeros past cn. */
static void pack_@S@(const @T@* k_cache, const @T@* v_cache, const int64_t* tab, int64_t ci, int64_t cn,
                     int64_t kvh, int64_t row, int64_t D, int64_t bs, float* kt, float* vc) {
    for (int64_t j = 0; j < KC; ++j) {
        if (j < cn) {
            const int64_t pos = ci * KC + j;
            const int64_t slot = tab[pos / bs] * bs + pos % bs;
            const @T@* kr = k_cache + slot * row + kvh * D;
            const @T@* vr = v_cache + slot * row + kvh * D;
            for (int64_t d = 0; d < D; ++d) { kt[d * KC + j] = to_f32_@KS@(kr[d]); vc[j * D + d] = to_f32_@KS@(vr[d]); }
        } else {
            for (int64_t d = 0; d < D; ++d) { kt[d * KC + j] = 0.f; vc[j * D + d] = 0.f; }
        }
    }
}

/* One task: query rows R = G * nq (row r = position i * G + head g), keys through the table.
   qs [R, D] (scaled), os [R, D], kt [D, KC], vc [KC, D], sc [R, KC] scratch. */
static void task_@S@(const @Q@* q, int64_t q_stride, const float* packed, int64_t q_row0, int64_t i0,
                     int64_t nq, int64_t ctx, int64_t kvh, int64_t H, int64_t KVH, int64_t D, float scale,
                     int64_t window, @Q@* out, float* qs, float* os, float* sc, float* m, float* l,
                     int64_t* lohi) {
    const int64_t G = H / KVH, R = G * nq;
#ifdef VL_AVX2
    /* the AVX2 path's scores in units of log2(e), for its base-2 exponentials */
    const float qscale = KC == 64 && D % 8 == 0 ? scale * 1.44269504088896341f : scale;
#else
    const float qscale = scale;
#endif
    for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
            const @Q@* src = q + (q_row0 + i0 + i) * q_stride + (kvh * G + g) * D;
            float* dst = qs + (i * G + g) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = to_f32_@QS@(src[d]) * qscale;
        }
    memset(os, 0, sizeof(float) * R * D);
    for (int64_t r = 0; r < R; ++r) { m[r] = -INFINITY; l[r] = 0.f; }
    const int64_t p_first = ctx + i0, p_last = ctx + i0 + nq - 1;
    const int64_t k_lo = window > 0 && p_first - window + 1 > 0 ? p_first - window + 1 : 0;
    for (int64_t c = k_lo / KC; c * KC <= p_last; ++c) {
        /* a chunk: keys c0 .. c0 + cn - 1, packed as K transposed kt [D, KC] and V vc [KC, D] */
        const int64_t c0 = c * KC, cn = p_last - c0 + 1 < KC ? p_last - c0 + 1 : KC;
        const float* kt = packed + c * 2 * KC * D;
        const float* vc = kt + KC * D;
#ifdef __AVX512F__
        if (KC == 64 && D % 16 == 0) {
            /* scores: 4 rows x 64 keys at a time, 16 accumulators */
            int64_t r = 0;
            for (; r + 4 <= R; r += 4) {
                __m512 a[4][4];
                for (int x = 0; x < 4; ++x) for (int y = 0; y < 4; ++y) a[x][y] = _mm512_setzero_ps();
                const float* q0 = qs + r * D;
                for (int64_t d = 0; d < D; ++d) {
                    const float* kd = kt + d * KC;
                    const __m512 k0 = _mm512_loadu_ps(kd), k1 = _mm512_loadu_ps(kd + 16);
                    const __m512 k2 = _mm512_loadu_ps(kd + 32), k3 = _mm512_loadu_ps(kd + 48);
                    for (int x = 0; x < 4; ++x) {
                        const __m512 qv = _mm512_set1_ps(q0[x * D + d]);
                        a[x][0] = _mm512_fmadd_ps(qv, k0, a[x][0]);
                        a[x][1] = _mm512_fmadd_ps(qv, k1, a[x][1]);
                        a[x][2] = _mm512_fmadd_ps(qv, k2, a[x][2]);
                        a[x][3] = _mm512_fmadd_ps(qv, k3, a[x][3]);
                    }
                }
                for (int x = 0; x < 4; ++x)
                    for (int y = 0; y < 4; ++y) _mm512_storeu_ps(sc + (r + x) * KC + 16 * y, a[x][y]);
            }
            for (; r < R; ++r) {
                __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                for (int64_t d = 0; d < D; ++d) {
                    const __m512 qv = _mm512_set1_ps(qs[r * D + d]);
                    for (int y = 0; y < 4; ++y) a[y] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kt + d * KC + 16 * y), a[y]);
                }
                for (int y = 0; y < 4; ++y) _mm512_storeu_ps(sc + r * KC + 16 * y, a[y]);
            }
            /* online softmax per row over the chunk's visible keys [lo, hi) */
            int64_t* los = lohi;
            int64_t* his = lohi + R;
            float* alphas = l + R;
            for (int64_t r2 = 0; r2 < R; ++r2) {
                const int64_t p = ctx + i0 + r2 / G;
                int64_t hi = p - c0 + 1; if (hi > cn) hi = cn;
                int64_t lo = window > 0 ? p - window + 1 - c0 : 0; if (lo < 0) lo = 0;
                los[r2] = lo; his[r2] = hi;
                float* srow = sc + r2 * KC;
                if (hi <= lo) {
                    /* nothing visible here; zeros, as the row may share a 4-row block below */
                    for (int y = 0; y < 4; ++y) _mm512_storeu_ps(srow + 16 * y, _mm512_setzero_ps());
                    alphas[r2] = 1.f;
                    los[r2] = 0; his[r2] = 0;
                    continue;
                }
                __m512 e[4];
                const float alpha = online_softmax64(srow, lo, hi, m + r2, l + r2, e);
                for (int y = 0; y < 4; ++y) _mm512_storeu_ps(srow + 16 * y, e[y]);
                alphas[r2] = alpha;
            }
            /* output: o = o * alpha + P V, 4 rows x up to 64 lanes of D at a time (each lane's sum
               in key order, as one row at a time would) */
            int64_t r3 = 0;
            for (; r3 + 4 <= R; r3 += 4) {
                int64_t lo = KC, hi = 0;
                for (int x = 0; x < 4; ++x)
                    if (his[r3 + x] > los[r3 + x]) {
                        if (his[r3 + x] > hi) hi = his[r3 + x];
                        if (los[r3 + x] < lo) lo = los[r3 + x];
                    }
                /* rows whose window is narrower have zeros in the wider range: exact */
                int64_t dv = 0;
                for (; dv + 64 <= D; dv += 64) pv4_@S@(os + r3 * D, D, dv, sc + r3 * KC, vc, lo, hi, alphas + r3, 4);
                for (; dv + 32 <= D; dv += 32) pv4_@S@(os + r3 * D, D, dv, sc + r3 * KC, vc, lo, hi, alphas + r3, 2);
                for (; dv < D; dv += 16) pv4_@S@(os + r3 * D, D, dv, sc + r3 * KC, vc, lo, hi, alphas + r3, 1);
            }
            for (; r3 < R; ++r3)
                for (int64_t dv = 0; dv < D; dv += 16) {
                    __m512 o = _mm512_mul_ps(_mm512_loadu_ps(os + r3 * D + dv), _mm512_set1_ps(alphas[r3]));
                    for (int64_t j = los[r3]; j < his[r3]; ++j)
                        o = _mm512_fmadd_ps(_mm512_set1_ps(sc[r3 * KC + j]), _mm512_loadu_ps(vc + j * D + dv), o);
                    _mm512_storeu_ps(os + r3 * D + dv, o);
                }
            continue;
        }
#endif
#ifdef VL_AVX2
        if (KC == 64 && D % 8 == 0) {
            /* groups of 6 rows (the last one shorter): scores 6 rows x 16 keys, softmax, output
               6 rows x 16 lanes of D, each row computed exactly as it would be in any group */
            int64_t* los = lohi;
            int64_t* his = lohi + R;
            float* alphas = l + R;
            for (int64_t i = 0; i < nq; ++i) {
                const int64_t p = ctx + i0 + i;
                int64_t hi = p - c0 + 1; if (hi > cn) hi = cn;
                int64_t lo = window > 0 ? p - window + 1 - c0 : 0; if (lo < 0) lo = 0;
                for (int64_t g = 0; g < G; ++g) { los[i * G + g] = lo; his[i * G + g] = hi; }
            }
            for (int64_t r = 0; r < R; r += 6) {
                const int64_t nr = R - r < 6 ? R - r : 6;
                const float* qr = qs + r * D;
                float* orow = os + r * D;
                float* srow = sc + r * KC;
                switch (nr) {
                    case 6: vl_rows(qr, orow, srow, m + r, l + r, los + r, his + r, alphas, kt, vc, D, 6); break;
                    case 5: vl_rows(qr, orow, srow, m + r, l + r, los + r, his + r, alphas, kt, vc, D, 5); break;
                    case 4: vl_rows(qr, orow, srow, m + r, l + r, los + r, his + r, alphas, kt, vc, D, 4); break;
                    case 3: vl_rows(qr, orow, srow, m + r, l + r, los + r, his + r, alphas, kt, vc, D, 3); break;
                    case 2: vl_rows(qr, orow, srow, m + r, l + r, los + r, his + r, alphas, kt, vc, D, 2); break;
                    default: vl_rows(qr, orow, srow, m + r, l + r, los + r, his + r, alphas, kt, vc, D, 1); break;
                }
            }
            continue;
        }
#endif
        for (int64_t r2 = 0; r2 < R; ++r2) {
            const int64_t p = ctx + i0 + r2 / G;
            int64_t hi = p - c0 + 1; if (hi > cn) hi = cn;
            int64_t lo = window > 0 ? p - window + 1 - c0 : 0; if (lo < 0) lo = 0;
            if (hi <= lo) continue;
            float* s = sc + r2 * KC;
            float cmax = -INFINITY;
            for (int64_t j = lo; j < hi; ++j) {
                float acc = 0.f;
                for (int64_t d = 0; d < D; ++d) acc += qs[r2 * D + d] * kt[d * KC + j];
                s[j] = acc;
                cmax = acc > cmax ? acc : cmax;
            }
            const float mnew = cmax > m[r2] ? cmax : m[r2];
            const float alpha = m[r2] == -INFINITY ? 0.f : expf(m[r2] - mnew);
            float sum = 0.f;
            for (int64_t j = lo; j < hi; ++j) { s[j] = expf(s[j] - mnew); sum += s[j]; }
            l[r2] = l[r2] * alpha + sum;
            m[r2] = mnew;
            float* o = os + r2 * D;
            for (int64_t d = 0; d < D; ++d) {
                float acc = o[d] * alpha;
                for (int64_t j = lo; j < hi; ++j) acc += s[j] * vc[j * D + d];
                o[d] = acc;
            }
        }
    }
    for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
            const int64_t r = i * G + g;
            const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
            @Q@* dst = out + ((q_row0 + i0 + i) * H + kvh * G + g) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = from_f32_@QS@(os[r * D + d] * inv);
        }
}

/* q [*, H, D] rows strided by q_stride and out [*, H, D] contiguous, both float32 or both the
   cache's bfloat16 (scores and sums in float32 either way); sequence s
   has rows q_row0[s] .. + q_len[s] at positions ctx[s] .. + q_len[s] - 1 and block table
   tables[s * max_blocks ..]. Returns -1 if scratch memory could not be allocated. */
int paged_prefill_@S@(const @Q@* q, int64_t q_stride, const @T@* k_cache, const @T@* v_cache,
                      const int64_t* tables, int64_t max_blocks, const int64_t* q_row0, const int64_t* q_len,
                      const int64_t* ctx, int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t bs,
                      float scale, int64_t window, @Q@* out, int64_t nthreads) {
    int64_t tiles = 0, chunks = 0;
    for (int64_t s = 0; s < n; ++s) {
        tiles += (q_len[s] + QT - 1) / QT;
        chunks += (ctx[s] + q_len[s] + KC - 1) / KC;
    }
    const int64_t chunk = 2 * KC * D, row = KVH * D;  /* floats per packed chunk (K then V) */
    int64_t* task_seq = (int64_t*)malloc(sizeof(int64_t) * (tiles > 0 ? tiles : 1));
    int64_t* task_i0 = (int64_t*)malloc(sizeof(int64_t) * (tiles > 0 ? tiles : 1));
    int64_t* first = (int64_t*)malloc(sizeof(int64_t) * (n + 1));  /* first chunk of sequence s */
    int64_t* chunk_seq = (int64_t*)malloc(sizeof(int64_t) * (chunks > 0 ? chunks : 1));
    float* packed = (float*)malloc(sizeof(float) * (size_t)(chunks > 0 ? chunks : 1) * KVH * chunk);
    if (!task_seq || !task_i0 || !first || !chunk_seq || !packed) {
        free(task_seq); free(task_i0); free(first); free(chunk_seq); free(packed);
        return -1;
    }
    int64_t t = 0, c = 0;
    for (int64_t s = 0; s < n; ++s) {
        first[s] = c;
        for (int64_t i0 = 0; i0 < q_len[s]; i0 += QT) { task_seq[t] = s; task_i0[t] = i0; ++t; }
        for (int64_t nc = (ctx[s] + q_len[s] + KC - 1) / KC; nc > 0; --nc) chunk_seq[c++] = s;
    }
    first[n] = c;
    const int64_t G = H / KVH, R = G * QT;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads > 0 ? (int)nthreads : 1)
    {
        /* K and V of every sequence, packed once per call (sequence s, KV head h: chunks
           first[s] * KVH + h * nc[s] ..), instead of once per query tile that reads them. */
        #pragma omp for schedule(static)
        for (int64_t k = 0; k < chunks * KVH; ++k) {
            const int64_t cc = k / KVH, kvh = k % KVH, s = chunk_seq[cc], ci = cc - first[s];
            const int64_t total = ctx[s] + q_len[s], nc = first[s + 1] - first[s];
            const int64_t cn = total - ci * KC < KC ? total - ci * KC : KC;
            float* kt = packed + (first[s] * KVH + kvh * nc + ci) * chunk;
            pack_@S@(k_cache, v_cache, tables + s * max_blocks, ci, cn, kvh, row, D, bs, kt, kt + KC * D);
        }
        float* buf = (float*)malloc(sizeof(float) * (2 * R * D + R * KC + 3 * R));
        int64_t* lohi = (int64_t*)malloc(sizeof(int64_t) * 2 * R);
        if (!buf || !lohi) {
            #pragma omp atomic write
            failed = 1;
        }
        /* Longest tiles (latest in their sequence: most keys) are spread first by the dynamic
           schedule walking tasks in reverse. */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t k = 0; k < tiles * KVH; ++k) {
            if (!buf || !lohi) continue;
            const int64_t task = tiles - 1 - k / KVH, kvh = k % KVH;
            const int64_t s = task_seq[task], i0 = task_i0[task];
            const int64_t nq = q_len[s] - i0 < QT ? q_len[s] - i0 : QT;
            float* qs = buf; float* os = qs + R * D; float* sc = os + R * D; float* m = sc + R * KC; float* l = m + R;
            const float* mine = packed + (first[s] * KVH + kvh * (first[s + 1] - first[s])) * chunk;
            task_@S@(q, q_stride, mine, q_row0[s], i0, nq, ctx[s], kvh, H, KVH, D, scale, window, out, qs, os,
                     sc, m, l, lohi);
        }
        free(buf);
        free(lohi);
    }
    free(task_seq); free(task_i0); free(first); free(chunk_seq); free(packed);
    return failed ? -1 : 0;
}
"""

_SOURCE = expand_variants(_PRELUDE, _BODY)  # the three cache / query dtype variants

_ENV_SWITCH = "BLITZMESH_VARLEN_ATTENTION"

# (q [T, H, D], k_cache, v_cache, tables [n, max_blocks], q_row0 [n], q_len [n], ctx [n], window,
# *, bf16_dot=True) -> out [T, H, D] (rows of no listed sequence are left unset).
PagedPrefill = Callable[..., torch.Tensor]


def _load(isa: str) -> PagedPrefill:
    if isa == "portable":
        raise RuntimeError("not built at the portable level (measured 0.05-0.21x torch's SDPA): torch's paths run")
    lib = ctypes.CDLL(str(build_library(_SOURCE, "paged_prefill", vector_flags(isa))))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    # (cache dtype, q/out dtype) -> entry point
    entry = {}
    for (cache_dtype, io_dtype), suffix in {
        (torch.float32, torch.float32): "f32",
        (torch.bfloat16, torch.float32): "bf16",
        (torch.bfloat16, torch.bfloat16): "bf16io",
    }.items():
        fn = getattr(lib, f"paged_prefill_{suffix}")
        fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, i64]
        fn.argtypes += [ptr, i64]
        fn.restype = ctypes.c_int
        entry[cache_dtype, io_dtype] = fn

    def paged_prefill(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        q_row0: torch.Tensor,
        q_len: torch.Tensor,
        ctx: torch.Tensor,
        window: int = 0,
        *,
        bf16_dot: bool = True,
    ) -> torch.Tensor:
        """Attention of each listed sequence's new tokens over its whole context (cached keys and
        its own new ones, all in the cache), causal, or over the last `window` keys per query.

        q `[T, H, D]` (rows may be strided); caches `[num_blocks, block_size, KVH, D]` float32 or
        bfloat16; `tables [n, max_blocks]`, `q_row0`, `q_len`, `ctx` `[n]` int64 CPU tensors
        whose bounds the caller has checked (tables cover ctx + q_len tokens, ids inside the
        cache, rows inside q). Returns `[T, H, D]` in q's dtype when that is the cache's (a
        bfloat16 model: read and written in bfloat16, rounded once as torch rounds), else float32.
        A bfloat16 model's queries go through `varlen_dot`'s bfloat16 dot products where the CPU
        has them (head size a multiple of 16), unless `bf16_dot` is False.
        """
        t, heads, d = q.shape
        _, bs, kv_heads, d_k = k_cache.shape
        io_dtype = q.dtype if q.dtype == k_cache.dtype else torch.float32
        fn = entry.get((k_cache.dtype, io_dtype))
        n = int(q_len.shape[0])
        if (
            fn is None
            or d_k != d
            or heads % kv_heads
            or v_cache.shape != k_cache.shape
            or v_cache.dtype != k_cache.dtype
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or tables.shape[0] != n
            or any(x.shape != (n,) or x.dtype != torch.int64 for x in (q_row0, q_len, ctx))
            or tables.dtype != torch.int64
        ):
            raise ValueError(
                f"paged_prefill: q {tuple(q.shape)} {q.dtype}, cache {tuple(k_cache.shape)} {k_cache.dtype}, "
                f"tables {tuple(tables.shape)}, {n} sequences"
            )
        if q.dtype != io_dtype or q.stride(2) != 1 or q.stride(1) != d:
            q = q.to(io_dtype).contiguous()
        tables, q_row0, q_len, ctx = (x.contiguous() for x in (tables, q_row0, q_len, ctx))
        out = torch.empty((t, heads, d), dtype=io_dtype)
        if bf16_dot and io_dtype == torch.bfloat16 and d % 16 == 0:
            fn = varlen_dot.bf16_dot_prefill(isa) or fn
        rc = fn(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
            q_row0.data_ptr(), q_len.data_ptr(), ctx.data_ptr(), n, heads, kv_heads, d, bs, d ** -0.5, window,
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("paged_prefill: scratch allocation failed")
        return out

    return paged_prefill


def _self_check(kernel: PagedPrefill) -> None:
    """Against `reference_prefill` on random cases: GQA, a fresh prompt, a chunk after cached
    context that starts mid-block, a single-token row, each cache dtype, with and without a
    sliding window, a head size the vector path takes and one only the portable path does."""
    g = torch.Generator().manual_seed(0)
    for heads, kv_heads, d in ((6, 2, 32), (4, 2, 20)):
        for dtype in KV_DTYPES:
            for window in (0, 7):
                bs, blocks = 4, 70
                k = torch.randn(blocks, bs, kv_heads, d, generator=g).to(dtype)
                v = torch.randn(blocks, bs, kv_heads, d, generator=g).to(dtype)
                lens, ctxs = [37, 70, 1], [0, 18, 9]
                q = torch.randn(sum(lens), heads, d, generator=g)
                perm = torch.randperm(blocks, generator=g).tolist()
                tables = [perm[0:22], perm[22:44], perm[44:66]]
                rows = [0, 37, 107]
                got = kernel(
                    q, k, v, torch.tensor(tables), torch.tensor(rows), torch.tensor(lens), torch.tensor(ctxs), window
                )
                # Queries in the cache's dtype, output in it too: the float32 path's result on the
                # same (exactly widened) queries, rounded once as torch rounds, bit for bit.
                q_io = q.to(dtype)
                args = (torch.tensor(tables), torch.tensor(rows), torch.tensor(lens), torch.tensor(ctxs), window)
                got_io = kernel(q_io, k, v, *args, bf16_dot=False)
                via_f32 = kernel(q_io.float(), k, v, *args).to(dtype)
                for s in range(3):
                    want = reference_prefill(q[rows[s] : rows[s] + lens[s]], k, v, tables[s], ctxs[s], window)
                    have = got[rows[s] : rows[s] + lens[s]]
                    part = slice(rows[s], rows[s] + lens[s])
                    if got_io.dtype != dtype or not torch.equal(got_io[part], via_f32[part]):
                        raise RuntimeError(
                            f"self-check failed ({dtype} queries and output, H={heads}, KVH={kv_heads}, D={d},"
                            f" window={window}, seq {s}): not the float32 path's result rounded to {dtype}"
                        )
                    if not torch.allclose(have, want, atol=2e-5, rtol=2e-5):
                        raise RuntimeError(
                            f"self-check failed (H={heads}, KVH={kv_heads}, D={d}, {dtype}, window={window}, seq {s}): "
                            f"max error {(have - want).abs().max().item():.3g}"
                        )


_PAGED_PREFILL = LazyKernel("varlen_prefill", "native_varlen_attention", _ENV_SWITCH, _load, _self_check)


def paged_prefill() -> PagedPrefill | None:
    """The varlen prefill kernel the model uses (see `native.LazyKernel.get`); None: torch's paths."""
    return _PAGED_PREFILL.get()


def paged_prefill_at(isa: str) -> PagedPrefill | None:
    """The varlen prefill kernel built for level `isa`, whatever was chosen; None if unavailable."""
    return _PAGED_PREFILL.build(isa)
