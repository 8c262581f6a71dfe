/* vnni.c's functions for CPUs with AVX2 and no AVX-512 (Intel's client cores since Alder Lake, AMD's
 * before Zen 4): the same layouts, the same 16-bit activations per block of 32, the same int32 dot
 * products (`vpmaddwd` and an add where VNNI fuses them in `vpdpwssd`), and each output's float
 * arithmetic in vnni.c's order, so that a row gets vnni.c's bits (its reductions are restated
 * over two 8-lane halves as GCC's 16-lane ones run).
 *
 * The int4 codes are read in the blocked layout of vnni.c (`hpipe.quant.pack` writes it for
 * both): in block b of 64 outputs, byte (k, j) holds output 64 b + j at input k in its low nibble
 * and output 64 b + j + 32 in its high nibble. Two inputs k, k + 1 are two 32-byte rows; their
 * bytes interleaved (`vpunpck*bw`) put a row's two codes side by side, which a nibble mask and a
 * widening to 16 bits make one 32-bit lane of (u_k, u_k+1) for `vpmaddwd` against (q_k, q_k+1).
 * That order puts rows in groups of four across the two 128-bit halves; one cross-half permute
 * per block puts them back in order before the scales. See vnni.c for the arithmetic. */
#include "common.h"

#define PF_BYTES 2048         /* codes prefetched this far ahead of the dot products */


static inline __m256 bf16_to_f32(const uint16_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

static inline __m256 load8(const void *x, int x_bf16, int64_t i) {
    return x_bf16 ? bf16_to_f32((const uint16_t *)x + i) : _mm256_loadu_ps((const float *)x + i);
}

/* GCC's _mm512_reduce_add_ps over the 16 lanes (lo: 0-7, hi: 8-15), in its order. */
static inline float reduce16(__m256 lo, __m256 hi) {
    __m256 t3 = _mm256_add_ps(hi, lo);
    __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}

static inline int32_t reduce_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_extracti128_si256(v, 1), _mm256_castsi256_si128(v));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

static inline float reduce_max(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* int32 [a0..7], [b0..7] -> int16 [a0..7, b0..7], saturated as vpmovsdw. */
static inline __m256i pack16(__m256i a, __m256i b) {
    return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), _MM_SHUFFLE(3, 1, 2, 0));
}

/* One row of K inputs -> int16 codes, per block of 32 the scale d and d * sum(q). */
static void quantize_row(const void *x, int x_bf16, int64_t k, int16_t *q, float *d, float *dsum) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < k / BLOCK; ++b) {
        __m256 v[4];
        for (int i = 0; i < 4; ++i)
            v[i] = load8(x, x_bf16, b * BLOCK + 8 * i);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
                                 _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)));
        float amax = reduce_max(m);
        float scale = amax / QMAX, inv = amax > 0.0f ? QMAX / amax : 0.0f;
        __m256i c[4];
        for (int i = 0; i < 4; ++i)
            c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
        _mm256_storeu_si256((__m256i *)(q + b * BLOCK), pack16(c[0], c[1]));
        _mm256_storeu_si256((__m256i *)(q + b * BLOCK + 16), pack16(c[2], c[3]));
        d[b] = scale;
        dsum[b] = scale * (float)reduce_i32(_mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3])));
    }
}



/* SUPER, outputs 8 i .. 8 i + 7 of super-block `sb`: float16 d (which 0) or dmin (1); group j's
 * 6-bit sc (which 0) or mn (1). */
static inline __m256 super_d(const uint8_t *sb, int which, int i) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 128 * which + 16 * i)));
}

static inline __m256 super_u8(const uint8_t *sb, int64_t j, int which, int i) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sb + 256 + 128 * j + 64 * which + 8 * i))));
}

/* s and z of outputs 8 i .. 8 i + 7 of a block (`sz` its scales) over input group g. */
static inline __attribute__((always_inline)) void group_scales(
        const int form, const uint8_t *sz, int64_t g, int i, __m256 *s, __m256 *z) {
    if (form == PAIRS) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(sz + (g * ROWS + 8 * i) * 4));
        *s = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        *z = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
    } else if (form == SCALES) {
        *s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sz + (g * ROWS + 8 * i) * 2)));
        *z = _mm256_setzero_ps();
    } else {
        const uint8_t *sb = sz + g / 8 * SUPER_BYTES;
        *s = _mm256_mul_ps(super_d(sb, 0, i), super_u8(sb, g % 8, 0, i));
        *z = _mm256_fmsub_ps(_mm256_set1_ps(8.0f), *s, _mm256_mul_ps(super_d(sb, 1, i), super_u8(sb, g % 8, 1, i)));
    }
}

/* One row of x against block b's 64 outputs, accumulated over all of K. */
static inline __attribute__((always_inline)) void block_row(
        const int form, const uint8_t *codes, const uint8_t *sz, int64_t n0, int64_t k, int64_t group,
        const int16_t *q, const float *d, const float *dsum, float *y) {
    const __m256i nibble = _mm256_set1_epi8(0x0f), zero = _mm256_setzero_si256();
    __m256 out[8];                                  /* rows 8 i .. 8 i + 7 */
    for (int i = 0; i < 8; ++i)
        out[i] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < k; kb += BLOCK) {
        __m256i acc[8];
        for (int i = 0; i < 8; ++i)
            acc[i] = _mm256_setzero_si256();
        const uint8_t *p = codes + kb * 32;
        const int16_t *xq = q + kb;
        for (int step = 0; step < BLOCK / 2; ++step, p += 64) {
            _mm_prefetch((const char *)p + PF_BYTES, _MM_HINT_T0);
            __m256i a = _mm256_loadu_si256((const __m256i *)p), b = _mm256_loadu_si256((const __m256i *)(p + 32));
            __m256i x = _mm256_set1_epi32(*(const int32_t *)(xq + 2 * step));      /* (q_k, q_k+1) */
            __m256i lo = _mm256_unpacklo_epi8(a, b), hi = _mm256_unpackhi_epi8(a, b);  /* rows 0-7|16-23, 8-15|24-31 */
            __m256i w;
            w = _mm256_and_si256(lo, nibble);
            acc[0] = _mm256_add_epi32(acc[0], _mm256_madd_epi16(_mm256_unpacklo_epi8(w, zero), x));   /* 0-3 | 16-19 */
            acc[1] = _mm256_add_epi32(acc[1], _mm256_madd_epi16(_mm256_unpackhi_epi8(w, zero), x));   /* 4-7 | 20-23 */
            w = _mm256_and_si256(hi, nibble);
            acc[2] = _mm256_add_epi32(acc[2], _mm256_madd_epi16(_mm256_unpacklo_epi8(w, zero), x));   /* 8-11 | 24-27 */
            acc[3] = _mm256_add_epi32(acc[3], _mm256_madd_epi16(_mm256_unpackhi_epi8(w, zero), x));   /* 12-15 | 28-31 */
            w = _mm256_and_si256(_mm256_srli_epi16(lo, 4), nibble);                                 /* rows + 32 */
            acc[4] = _mm256_add_epi32(acc[4], _mm256_madd_epi16(_mm256_unpacklo_epi8(w, zero), x));
            acc[5] = _mm256_add_epi32(acc[5], _mm256_madd_epi16(_mm256_unpackhi_epi8(w, zero), x));
            w = _mm256_and_si256(_mm256_srli_epi16(hi, 4), nibble);
            acc[6] = _mm256_add_epi32(acc[6], _mm256_madd_epi16(_mm256_unpacklo_epi8(w, zero), x));
            acc[7] = _mm256_add_epi32(acc[7], _mm256_madd_epi16(_mm256_unpackhi_epi8(w, zero), x));
        }
        __m256i r[8];                               /* rows 8 i .. 8 i + 7 */
        for (int h = 0; h < 2; ++h) {               /* h 1: the high nibbles' rows 32-63 */
            r[4 * h + 0] = _mm256_permute2x128_si256(acc[4 * h + 0], acc[4 * h + 1], 0x20);
            r[4 * h + 2] = _mm256_permute2x128_si256(acc[4 * h + 0], acc[4 * h + 1], 0x31);
            r[4 * h + 1] = _mm256_permute2x128_si256(acc[4 * h + 2], acc[4 * h + 3], 0x20);
            r[4 * h + 3] = _mm256_permute2x128_si256(acc[4 * h + 2], acc[4 * h + 3], 0x31);
        }
        const int64_t blk = kb / BLOCK;
        const __m256 db = _mm256_set1_ps(d[blk]), ds = _mm256_set1_ps(dsum[blk]);
        if (form == SUPER) {    /* s = d sc, then s t - (dmin mn) ds */
            const uint8_t *sb = sz + kb / SUPER_INPUTS * SUPER_BYTES;
            const int64_t j = blk % 8;
            for (int i = 0; i < 8; ++i) {
                __m256 s = _mm256_mul_ps(super_d(sb, 0, i), super_u8(sb, j, 0, i));
                __m256 mn = _mm256_mul_ps(super_d(sb, 1, i), super_u8(sb, j, 1, i));
                __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(r[i]), db);
                out[i] = _mm256_fnmadd_ps(mn, ds, _mm256_fmadd_ps(s, t, out[i]));
            }
            continue;
        }
        for (int i = 0; i < 8; ++i) {
            __m256 s, z;
            group_scales(form, sz, kb / group, i, &s, &z);
            __m256 t = _mm256_fmsub_ps(_mm256_cvtepi32_ps(r[i]), db, _mm256_mul_ps(ds, _mm256_set1_ps(8.0f)));
            out[i] = _mm256_fmadd_ps(s, t, out[i]);
            if (form != SCALES)
                out[i] = _mm256_fmadd_ps(z, ds, out[i]);
        }
    }
    for (int i = 0; i < 8; ++i)
        _mm256_storeu_ps(y + n0 + 8 * i, out[i]);
}

/* y [m, n] float32 = x [m, k] (float32, or bf16 when x_bf16) @ W^T, as vnni.c's. */
int hpipe_int4_mm(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *packed,
                  const uint8_t *sz, int form, int64_t n, int64_t group, float *y, int threads) {
    Activations a;
    if (quantize_rows(x, x_bf16, m, k, &a))
        return -1;
    const int64_t blocks = k / BLOCK, nb = n / ROWS;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && nb > 1)
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *codes = packed + b * k * 32;
        const uint8_t *scales = sz + b * scale_bytes(form, k, group);
        for (int64_t r = 0; r < m; ++r) {
            #define ROW(f) block_row(f, codes, scales, b * ROWS, k, group, a.q + r * k, a.d + r * blocks, \
                                     a.dsum + r * blocks, y + r * n)
            if (form == PAIRS)
                ROW(PAIRS);
            else if (form == SCALES)
                ROW(SCALES);
            else
                ROW(SUPER);
            #undef ROW
        }
    }
    free(a.q);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * int8, as vnni.c's: a block of 32 inputs is two registers of 16 int16 products summed in pairs,
 * lanes 0-7 and 8-15 of vnni.c's one register. */


static inline __attribute__((always_inline)) void int8_rows(
        const int tile, const int8_t *w, int64_t k, const int16_t *q, const float *d, const uint16_t *e,
        float scale, float *y, int64_t n) {
    const int64_t blocks = k / BLOCK;
    __m256 lo[INT8_TILE], hi[INT8_TILE];
    for (int m = 0; m < tile; ++m)
        lo[m] = hi[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + BLOCK * b)));
        __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + BLOCK * b + 16)));
        const float eb = e ? _cvtsh_ss(e[b]) : 1.0f;
        for (int m = 0; m < tile; ++m) {
            const int16_t *qb = q + m * k + BLOCK * b;
            __m256 f = _mm256_set1_ps(d[m * blocks + b] * eb);
            __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)qb));
            __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(qb + 16)));
            lo[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), f, lo[m]);
            hi[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), f, hi[m]);
        }
    }
    for (int m = 0; m < tile; ++m)
        y[m * n] = reduce16(lo[m], hi[m]) * scale;
}

/* One row of x against two weight rows (a decode step), as vnni.c's. */
static inline __attribute__((always_inline)) void int8_row_pair(
        const int8_t *w0, const int8_t *w1, int64_t k, const int16_t *q, const float *d, const uint16_t *e0,
        const uint16_t *e1, float s0, float s1, float *y0, float *y1) {
    const int64_t blocks = k / BLOCK;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m256i q0 = _mm256_loadu_si256((const __m256i *)(q + BLOCK * b));
        __m256i q1 = _mm256_loadu_si256((const __m256i *)(q + BLOCK * b + 16));
        const float f0 = d[b] * (e0 ? _cvtsh_ss(e0[b]) : 1.0f), f1 = d[b] * (e1 ? _cvtsh_ss(e1[b]) : 1.0f);
        __m256i v;
        v = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w0 + BLOCK * b))), q0);
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(f0), a0);
        v = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w0 + BLOCK * b + 16))), q1);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(f0), a1);
        v = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w1 + BLOCK * b))), q0);
        b0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(f1), b0);
        v = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w1 + BLOCK * b + 16))), q1);
        b1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(f1), b1);
    }
    *y0 = reduce16(a0, a1) * s0;
    *y1 = reduce16(b0, b1) * s1;
}

#include "int8_mm.h"

/* One row of x against one block of 64 outputs (experts.h's unit of work), the form a constant. */
static void int4_block_row(int form, const uint8_t *codes, const uint8_t *sz, int64_t k, int64_t group,
                           const int16_t *q, const float *d, const float *dsum, float *y) {
    if (form == PAIRS)
        block_row(PAIRS, codes, sz, 0, k, group, q, d, dsum, y);
    else if (form == SCALES)
        block_row(SCALES, codes, sz, 0, k, group, q, d, dsum, y);
    else
        block_row(SUPER, codes, sz, 0, k, group, q, d, dsum, y);
}

#include "experts.h"
#include "attention.h"

/* ---------------------------------------------------------------------------------------------
 * Dequantizing, as vnni.c's: rounded once to bf16 (to nearest, ties to even). */

static inline __m128i f32_to_bf16(__m256 v) {
    __m256i bits = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), _MM_SHUFFLE(3, 1, 2, 0)));
}

void hpipe_int4_dequant(const uint8_t *packed, const uint8_t *sz, int form, int64_t k, int64_t group,
                        int64_t b0, int64_t nb, uint16_t *out, int threads) {
    const __m256i nibble = _mm256_set1_epi32(0x0f), eight = _mm256_set1_epi32(8);
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && nb > 1)
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *codes = packed + (b0 + b) * k * 32;
        const uint8_t *scales = sz + (b0 + b) * scale_bytes(form, k, group);
        uint16_t *o = out + b * k * ROWS;
        for (int64_t g = 0; g < k / group; ++g) {
            __m256 s[8], z[8];
            for (int i = 0; i < 8; ++i)
                group_scales(form, scales, g, i, &s[i], &z[i]);
            for (int64_t kk = g * group; kk < (g + 1) * group; ++kk) {
                for (int h = 0; h < 4; ++h) {             /* rows 8 h .. 8 h + 7 and + 32 */
                    __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + kk * 32 + 8 * h)));
                    __m256 lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(bytes, nibble), eight));
                    __m256 hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bytes, 4), eight));
                    _mm_storeu_si128((__m128i *)(o + kk * ROWS + 8 * h), f32_to_bf16(_mm256_fmadd_ps(lo, s[h], z[h])));
                    _mm_storeu_si128((__m128i *)(o + kk * ROWS + 32 + 8 * h),
                                     f32_to_bf16(_mm256_fmadd_ps(hi, s[4 + h], z[4 + h])));
                }
            }
        }
    }
}

void hpipe_int8_dequant(const int8_t *w, const uint16_t *scales, int blocks_scaled, int64_t k, int64_t r0,
                        int64_t n, uint16_t *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n > 16)
    for (int64_t r = 0; r < n; ++r) {
        float scale;
        uint32_t bits = (uint32_t)scales[r0 + r] << 16;
        __builtin_memcpy(&scale, &bits, 4);
        const int8_t *row = w + (r0 + r) * k;
        int64_t c = 0;
        for (; c + 8 <= k; c += 8) {
            if (blocks_scaled)      /* k is whole blocks of 32 here */
                scale = _cvtsh_ss(scales[(r0 + r) * (k / BLOCK) + c / BLOCK]);
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + c))));
            _mm_storeu_si128((__m128i *)(out + r * k + c), f32_to_bf16(_mm256_mul_ps(v, _mm256_set1_ps(scale))));
        }
        for (; c < k; ++c) {
            float f = (float)row[c] * scale;
            uint32_t u;
            __builtin_memcpy(&u, &f, 4);
            out[r * k + c] = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
        }
    }
}
