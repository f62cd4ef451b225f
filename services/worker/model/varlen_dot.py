"""Varlen attention for bfloat16 models on CPUs with AVX512-BF16: the dot products in bfloat16.

The general varlen kernel (`varlen`) widens every bfloat16 key and value to float32 and runs float32
FMAs; on the development box that left prefill attention at about 130-160 GFLOP/s, half of a
2,048-token bfloat16 prefill, against about 410 GFLOP/s for the bfloat16 GEMMs around it. This
kernel keeps the operands in bfloat16 and accumulates in float32 with `vdpbf16ps` (32 products per
instruction, twice the float32 FMA's 16):

- each sequence's keys and values are packed once per call, per KV head and chunk of 64 keys, into
  the instruction's pair layout (K as `[D/2][64]` pairs of dimensions, V as `[32][D]` pairs of
  keys), instead of every query tile transposing them again;
- scores are the exact products of the bfloat16 queries and keys summed in float32, scaled after;
- the online softmax runs in float32 as in the general kernel; the probabilities are rounded to
  bfloat16 for the P V products (as flash attention does on GPUs), the normalizer is summed from
  the unrounded ones; the output accumulates in float32 and is rounded once to bfloat16.

So its result is not the float32 kernel's bit for bit: it is within bfloat16 rounding of it (the
self-check bounds the difference to the float32 reference), and like it, each query row's result
depends only on its own position and keys, never on how a prompt was chunked or batched. Queries
and output are the QKV projection's bfloat16 rows and the layer's bfloat16 input (head sizes that
are multiples of 16). With `BLITZMESH_BF16_DOT_ATTENTION=0`, or on a CPU without AVX512-BF16,
`bf16_dot_prefill()` returns None and the general kernel runs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from services.worker.model.native import AVX512_EXP16, LazyKernel, build_library, has_avx512_bf16, vector_flags
from services.worker.model.varlen_reference import reference_prefill

_SOURCE = (
    r"""
/* ---- bfloat16 dot products (AVX512-BF16): a bfloat16 cache read by bfloat16 queries ---------- */
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <stdlib.h>
#include <immintrin.h>

#define QT 32      /* query positions per task */
#define KC 64      /* keys per chunk (one online-softmax update) */

static inline uint16_t dp_from_f32(float f) {
    if (f != f) return 0x7FC0;
    uint32_t u; memcpy(&u, &f, 4);
    return (uint16_t)((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
}

"""
    + AVX512_EXP16
    + r"""
/* Pack one chunk of KC keys (positions c0 .. c0 + cn - 1 of a sequence, one KV head) for the dot
   products: kp [D/2][KC] pairs (k[j][2p], k[j][2p+1]) and vp [KC/2][D] pairs (v[2i][d],
   v[2i+1][d]), zeros past cn (a zero probability times a zero value adds exactly nothing). */
static void dp_pack(const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* tab, int64_t c0, int64_t cn,
                    int64_t kvh, int64_t row, int64_t D, int64_t bs, uint32_t* kp, uint32_t* vp) {
    const int64_t P = D / 2;
    for (int64_t j = 0; j < KC; ++j) {
        if (j < cn) {
            const int64_t pos = c0 + j, slot = tab[pos / bs] * bs + pos % bs;
            const uint32_t* kr = (const uint32_t*)(k_cache + slot * row + kvh * D);
            for (int64_t p = 0; p < P; ++p) kp[p * KC + j] = kr[p];
        } else {
            for (int64_t p = 0; p < P; ++p) kp[p * KC + j] = 0u;
        }
    }
    for (int64_t i = 0; i < KC / 2; ++i) {
        const uint16_t* v0 = 0; const uint16_t* v1 = 0;
        if (2 * i < cn) { const int64_t pos = c0 + 2 * i; v0 = v_cache + (tab[pos / bs] * bs + pos % bs) * row + kvh * D; }
        if (2 * i + 1 < cn) { const int64_t pos = c0 + 2 * i + 1; v1 = v_cache + (tab[pos / bs] * bs + pos % bs) * row + kvh * D; }
        uint32_t* dst = vp + i * D;
        for (int64_t d = 0; d < D; ++d)
            dst[d] = (uint32_t)(v0 ? v0[d] : 0) | ((uint32_t)(v1 ? v1[d] : 0) << 16);
    }
}

/* o[x] (NV vectors of 16 lanes, rows x of a 4-row group) += P V over key pairs [jlo, jhi). */
static inline __attribute__((always_inline)) void dp_pv4(float* os, int64_t D, int64_t dv, const uint32_t* pb,
                                                          const uint32_t* vp, int64_t jlo, int64_t jhi, const float* alphas, const int NV) {
    __m512 o[4][4];
    for (int x = 0; x < 4; ++x)
        for (int y = 0; y < NV; ++y)
            o[x][y] = _mm512_mul_ps(_mm512_loadu_ps(os + x * D + dv + 16 * y), _mm512_set1_ps(alphas[x]));
    for (int64_t i = jlo; i < jhi; ++i) {
        __m512i v[4];
        for (int y = 0; y < NV; ++y) v[y] = _mm512_loadu_si512((const void*)(vp + i * D + dv + 16 * y));
        for (int x = 0; x < 4; ++x) {
            const __m512bh pr = (__m512bh)_mm512_set1_epi32((int)pb[x * (KC / 2) + i]);
            for (int y = 0; y < NV; ++y) o[x][y] = _mm512_dpbf16_ps(o[x][y], pr, (__m512bh)v[y]);
        }
    }
    for (int x = 0; x < 4; ++x)
        for (int y = 0; y < NV; ++y) _mm512_storeu_ps(os + x * D + dv + 16 * y, o[x][y]);
}

static inline __attribute__((always_inline)) void dp_pv1(float* os, int64_t dv, const uint32_t* pb, const uint32_t* vp,
                                                          int64_t D, int64_t jlo, int64_t jhi, float alpha) {
    __m512 o = _mm512_mul_ps(_mm512_loadu_ps(os + dv), _mm512_set1_ps(alpha));
    for (int64_t i = jlo; i < jhi; ++i)
        o = _mm512_dpbf16_ps(o, (__m512bh)_mm512_set1_epi32((int)pb[i]), (__m512bh)_mm512_loadu_si512((const void*)(vp + i * D + dv)));
    _mm512_storeu_ps(os + dv, o);
}

/* One task (see the float32 kernel): rows R = G * nq, row r = position i * G + head g, reading
   the packed chunks of its sequence and KV head. os [R, D] and sc [R, KC] float32 scratch,
   pb [R, KC/2] bfloat16 pairs of probabilities. */
static void dp_task(const uint16_t* q, int64_t q_stride, const uint32_t* packed, int64_t q_row0, int64_t i0,
                    int64_t nq, int64_t ctx, int64_t kvh, int64_t H, int64_t KVH, int64_t D, float scale,
                    int64_t window, uint16_t* out, float* os, float* sc, uint32_t* pb, float* m, float* l,
                    int64_t* lohi, const uint32_t** qp) {
    const int64_t G = H / KVH, R = G * nq, P = D / 2, chunk = D * KC; /* uint32 per packed chunk */
    for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g)
            qp[i * G + g] = (const uint32_t*)(q + (q_row0 + i0 + i) * q_stride + (kvh * G + g) * D);
    memset(os, 0, sizeof(float) * R * D);
    for (int64_t r = 0; r < R; ++r) { m[r] = -INFINITY; l[r] = 0.f; }
    const int64_t p_first = ctx + i0, p_last = ctx + i0 + nq - 1;
    const int64_t k_lo = window > 0 && p_first - window + 1 > 0 ? p_first - window + 1 : 0;
    const __m512 vscale = _mm512_set1_ps(scale);
    int64_t* los = lohi;
    int64_t* his = lohi + R;
    float* alphas = l + R;
    for (int64_t c = k_lo / KC; c * KC <= p_last; ++c) {
        const int64_t c0 = c * KC;
        const int64_t cn = p_last - c0 + 1 < KC ? p_last - c0 + 1 : KC;
        const uint32_t* kp = packed + c * chunk;
        const uint32_t* vp = kp + chunk / 2;
        /* scores, 4 rows x 64 keys at a time */
        int64_t r = 0;
        for (; r + 4 <= R; r += 4) {
            __m512 a[4][4];
            for (int x = 0; x < 4; ++x) for (int y = 0; y < 4; ++y) a[x][y] = _mm512_setzero_ps();
            for (int64_t p = 0; p < P; ++p) {
                const uint32_t* kd = kp + p * KC;
                const __m512bh k0 = (__m512bh)_mm512_loadu_si512((const void*)kd), k1 = (__m512bh)_mm512_loadu_si512((const void*)(kd + 16));
                const __m512bh k2 = (__m512bh)_mm512_loadu_si512((const void*)(kd + 32)), k3 = (__m512bh)_mm512_loadu_si512((const void*)(kd + 48));
                for (int x = 0; x < 4; ++x) {
                    const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qp[r + x][p]);
                    a[x][0] = _mm512_dpbf16_ps(a[x][0], qv, k0);
                    a[x][1] = _mm512_dpbf16_ps(a[x][1], qv, k1);
                    a[x][2] = _mm512_dpbf16_ps(a[x][2], qv, k2);
                    a[x][3] = _mm512_dpbf16_ps(a[x][3], qv, k3);
                }
            }
            for (int x = 0; x < 4; ++x)
                for (int y = 0; y < 4; ++y) _mm512_storeu_ps(sc + (r + x) * KC + 16 * y, _mm512_mul_ps(a[x][y], vscale));
        }
        for (; r < R; ++r) {
            __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int64_t p = 0; p < P; ++p) {
                const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qp[r][p]);
                for (int y = 0; y < 4; ++y) a[y] = _mm512_dpbf16_ps(a[y], qv, (__m512bh)_mm512_loadu_si512((const void*)(kp + p * KC + 16 * y)));
            }
            for (int y = 0; y < 4; ++y) _mm512_storeu_ps(sc + r * KC + 16 * y, _mm512_mul_ps(a[y], vscale));
        }
        /* online softmax per row over its visible keys [lo, hi); probabilities to bf16 pairs */
        for (int64_t r2 = 0; r2 < R; ++r2) {
            const int64_t p = ctx + i0 + r2 / G;
            int64_t hi = p - c0 + 1; if (hi > cn) hi = cn;
            int64_t lo = window > 0 ? p - window + 1 - c0 : 0; if (lo < 0) lo = 0;
            uint32_t* prow = pb + r2 * (KC / 2);
            if (hi <= lo) {
                memset(prow, 0, sizeof(uint32_t) * (KC / 2));
                alphas[r2] = 1.f;
                los[r2] = 0; his[r2] = 0;
                continue;
            }
            los[r2] = lo / 2; his[r2] = (hi + 1) / 2;   /* in key pairs */
            float* srow = sc + r2 * KC;
            __m512 e[4];
            const float alpha = online_softmax64(srow, lo, hi, m + r2, l + r2, e);
            _mm512_storeu_si512((void*)prow, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
            _mm512_storeu_si512((void*)(prow + 16), (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
            alphas[r2] = alpha;
        }
        /* output: o = o * alpha + P V */
        int64_t r3 = 0;
        for (; r3 + 4 <= R; r3 += 4) {
            int64_t jlo = KC / 2, jhi = 0;
            for (int x = 0; x < 4; ++x)
                if (his[r3 + x] > los[r3 + x]) {
                    if (his[r3 + x] > jhi) jhi = his[r3 + x];
                    if (los[r3 + x] < jlo) jlo = los[r3 + x];
                }
            if (jhi <= jlo) { jlo = 0; jhi = 0; }
            const uint32_t* pb4 = pb + r3 * (KC / 2);
            float* os4 = os + r3 * D;
            int64_t dv = 0;
            for (; dv + 64 <= D; dv += 64) dp_pv4(os4, D, dv, pb4, vp, jlo, jhi, alphas + r3, 4);
            for (; dv + 32 <= D; dv += 32) dp_pv4(os4, D, dv, pb4, vp, jlo, jhi, alphas + r3, 2);
            for (; dv < D; dv += 16) dp_pv4(os4, D, dv, pb4, vp, jlo, jhi, alphas + r3, 1);
        }
        for (; r3 < R; ++r3)
            for (int64_t dv = 0; dv < D; dv += 16)
                dp_pv1(os + r3 * D, dv, pb + r3 * (KC / 2), vp, D, los[r3], his[r3], alphas[r3]);
    }
    for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
            const int64_t r = i * G + g;
            const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
            uint16_t* dst = out + ((q_row0 + i0 + i) * H + kvh * G + g) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = dp_from_f32(os[r * D + d] * inv);
        }
}

/* As paged_prefill_bf16io, for D a multiple of 16: each sequence's keys and values are packed
   once per call (chunk by chunk, per KV head) into the dot products' pair layout, then every
   query tile reads the packed chunks. Returns -1 if memory could not be allocated. */
int paged_prefill_bf16dp(const uint16_t* q, int64_t q_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                         const int64_t* tables, int64_t max_blocks, const int64_t* q_row0, const int64_t* q_len,
                         const int64_t* ctx, int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t bs,
                         float scale, int64_t window, uint16_t* out, int64_t nthreads) {
    if (D % 16) return -2;
    const int64_t chunk = D * KC, row = KVH * D;
    int64_t tiles = 0, chunks = 0;
    for (int64_t s = 0; s < n; ++s) {
        tiles += (q_len[s] + QT - 1) / QT;
        chunks += (ctx[s] + q_len[s] + KC - 1) / KC;
    }
    int64_t* task_seq = (int64_t*)malloc(sizeof(int64_t) * (tiles > 0 ? tiles : 1));
    int64_t* task_i0 = (int64_t*)malloc(sizeof(int64_t) * (tiles > 0 ? tiles : 1));
    int64_t* first = (int64_t*)malloc(sizeof(int64_t) * (n + 1));  /* first packed chunk of s */
    int64_t* pack_seq = (int64_t*)malloc(sizeof(int64_t) * (chunks > 0 ? chunks : 1));
    uint32_t* packed = (uint32_t*)malloc(sizeof(uint32_t) * (size_t)(chunks > 0 ? chunks : 1) * KVH * chunk);
    if (!task_seq || !task_i0 || !first || !pack_seq || !packed) {
        free(task_seq); free(task_i0); free(first); free(pack_seq); free(packed);
        return -1;
    }
    int64_t t = 0, c = 0;
    for (int64_t s = 0; s < n; ++s) {
        first[s] = c;
        for (int64_t i0 = 0; i0 < q_len[s]; i0 += QT) { task_seq[t] = s; task_i0[t] = i0; ++t; }
        const int64_t nc = (ctx[s] + q_len[s] + KC - 1) / KC;
        for (int64_t k = 0; k < nc; ++k) pack_seq[c + k] = s;
        c += nc;
    }
    first[n] = c;
    const int64_t G = H / KVH, R = G * QT;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads > 0 ? (int)nthreads : 1)
    {
        #pragma omp for schedule(static)
        for (int64_t k = 0; k < chunks * KVH; ++k) {
            const int64_t cc = k / KVH, kvh = k % KVH, s = pack_seq[cc], ci = cc - first[s];
            const int64_t total = ctx[s] + q_len[s], c0 = ci * KC;
            const int64_t cn = total - c0 < KC ? total - c0 : KC;
            uint32_t* kp = packed + ((first[s] * KVH) + kvh * (first[s + 1] - first[s]) + ci) * chunk;
            dp_pack(k_cache, v_cache, tables + s * max_blocks, c0, cn, kvh, row, D, bs, kp, kp + chunk / 2);
        }
        float* buf = (float*)malloc(sizeof(float) * (R * D + R * KC + 3 * R + R * KC / 2 + 16));
        int64_t* lohi = (int64_t*)malloc(sizeof(int64_t) * 2 * R);
        const uint32_t** qp = (const uint32_t**)malloc(sizeof(void*) * R);
        if (!buf || !lohi || !qp) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t k = 0; k < tiles * KVH; ++k) {
            if (!buf || !lohi || !qp) continue;
            const int64_t task = tiles - 1 - k / KVH, kvh = k % KVH;
            const int64_t s = task_seq[task], i0 = task_i0[task];
            const int64_t nq = q_len[s] - i0 < QT ? q_len[s] - i0 : QT;
            float* os = buf; float* sc = os + R * D; float* m = sc + R * KC; float* l = m + R;
            uint32_t* pb = (uint32_t*)(l + 2 * R);
            const uint32_t* mine = packed + ((first[s] * KVH) + kvh * (first[s + 1] - first[s])) * chunk;
            dp_task(q, q_stride, mine, q_row0[s], i0, nq, ctx[s], kvh, H, KVH, D, scale, window, out, os, sc, pb,
                    m, l, lohi, qp);
        }
        free(buf); free(lohi); free((void*)qp);
    }
    free(task_seq); free(task_i0); free(first); free(pack_seq); free(packed);
    return failed ? -1 : 0;
}
"""
)

_ENV_SWITCH = "BLITZMESH_BF16_DOT_ATTENTION"

# The general kernel's entry signature (see `varlen._load`): q, q_stride, k_cache, v_cache,
# tables, max_blocks, q_row0, q_len, ctx, n, H, KVH, D, block_size, scale, window, out, threads.
DotEntry = Callable[..., int]


def supported(isa: str | None = None) -> bool:
    """Whether level `isa` (default: the target level) has the instructions the kernel is built for."""
    return has_avx512_bf16(isa)


def _load(isa: str) -> DotEntry:
    if not supported(isa):
        raise RuntimeError(f"the bfloat16 dot-product kernel needs AVX512-BF16 (asked for {isa!r})")
    lib = ctypes.CDLL(str(build_library(_SOURCE, "paged_prefill_bf16dot", [*vector_flags(isa), "-mavx512bf16"])))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = lib.paged_prefill_bf16dp
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, i64, ptr, i64]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def _self_check(fn: DotEntry) -> None:
    """Against the float32 reference on random cases (GQA, a fresh prompt, chunks after cached
    context starting mid-block, a single-token row, with and without a sliding window, head sizes
    of 32, 48 and 64): within 2e-2, the size of bfloat16 rounding of outputs of this scale (a wrong
    kernel is off by order 1)."""
    g = torch.Generator().manual_seed(0)
    for heads, kv_heads, d in ((6, 2, 32), (4, 2, 48), (9, 3, 64)):
        for window in (0, 7):
            bs, blocks = 4, 90
            k = torch.randn(blocks, bs, kv_heads, d, generator=g).to(torch.bfloat16)
            v = torch.randn(blocks, bs, kv_heads, d, generator=g).to(torch.bfloat16)
            lens, ctxs = [37, 70, 1], [0, 18, 9]
            q = torch.randn(sum(lens), heads, d, generator=g).to(torch.bfloat16)
            perm = torch.randperm(blocks, generator=g).tolist()
            tables = [perm[0:28], perm[28:56], perm[56:84]]
            rows = [0, 37, 107]
            out = torch.empty_like(q)
            t_tables, t_rows, t_lens, t_ctx = (torch.tensor(x) for x in (tables, rows, lens, ctxs))
            rc = fn(
                q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), t_tables.data_ptr(), t_tables.shape[1],
                t_rows.data_ptr(), t_lens.data_ptr(), t_ctx.data_ptr(), 3, heads, kv_heads, d, bs, d ** -0.5,
                window, out.data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
            if rc != 0:
                raise RuntimeError(f"self-check: the kernel returned {rc}")
            for s in range(3):
                part = slice(rows[s], rows[s] + lens[s])
                want = reference_prefill(q[part].float(), k, v, tables[s], ctxs[s], window)
                if not torch.allclose(out[part].float(), want, atol=2e-2, rtol=2e-2):
                    err = (out[part].float() - want).abs().max().item()
                    raise RuntimeError(
                        f"self-check failed (H={heads}, KVH={kv_heads}, D={d}, window={window}, seq {s}): "
                        f"max error {err:.3g}"
                    )


# Part of the varlen prefill op: chosen with it.
_KERNEL = LazyKernel("varlen_prefill", "native_bf16_dot_attention", _ENV_SWITCH, _load, _self_check)


def bf16_dot_prefill(isa: str | None = None) -> DotEntry | None:
    """The kernel's entry point at level `isa` (default: the target level), built and checked on
    first call; None where unavailable."""
    return _KERNEL.build(isa) if supported(isa) and _KERNEL.enabled() else None
