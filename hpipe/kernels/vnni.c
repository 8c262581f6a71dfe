/* y = x W^T with 8-bit activations and integer dot products (AVX-512 VNNI), the arithmetic
 * llama.cpp uses for its 4- and 8-bit blocks on x86: W in torch's CPU int4 packing
 * (`hpipe_int4_mm`) or int8 with a scale per output row (`hpipe_int8_mm`).
 *
 * W is read where torch's `_convert_weight_to_int4pack_for_cpu` left it, so the dense path, the
 * embedding's row gather and the disk cache keep their one layout:
 *   packed [N / 64, K, 32] bytes: in block b, byte (k, j) holds code u[64 b + j, k] in its low
 *          nibble and u[64 b + j + 32, k] in its high nibble;
 *   sz     [K / G, N] pairs of bf16 (s, z): w = (u - 8) s + z over each group of G inputs.
 * x is quantized per block of 32 inputs: x ~ d q, q int8 in [-127, 127]. Over one block then
 *   sum_k w_k x_k = d (s sum_k u_k q_k + (z - 8 s) sum_k q_k),
 * where sum_k u_k q_k is exact in int32 (vpdpbusd: unsigned codes times signed activations).
 * torch's own kernel converts every code to float and multiplies in float: about twice the work
 * per weight, and decode at one or two threads is bound by that work, not by reading memory.
 *
 * Rows of x are independent: a row gets the same bits whatever else is in the call. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define BLOCK 32              /* activation block: inputs per int8 scale */
#define ROWS 64               /* outputs per block of the packing */
#ifndef PF_K
#define PF_K 128
#endif
#ifndef PF_BYTES
#define PF_BYTES 2048
#endif
#define MAX_TILE 2            /* rows of x sharing one pass over a block's codes */

static inline __m512 bf16_to_f32(const uint16_t *p) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* One row of K inputs -> int8 codes, per block of 32 the scale d and d * sum(q). */
static void quantize_row(const void *x, int x_bf16, int64_t k, int8_t *q, float *d, float *dsum) {
    for (int64_t b = 0; b < k / BLOCK; ++b) {
        __m512 v0, v1;
        if (x_bf16) {
            v0 = bf16_to_f32((const uint16_t *)x + b * BLOCK);
            v1 = bf16_to_f32((const uint16_t *)x + b * BLOCK + 16);
        } else {
            v0 = _mm512_loadu_ps((const float *)x + b * BLOCK);
            v1 = _mm512_loadu_ps((const float *)x + b * BLOCK + 16);
        }
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
        __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(q + b * BLOCK), _mm512_cvtsepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(q + b * BLOCK + 16), _mm512_cvtsepi32_epi8(i1));
        d[b] = scale;
        dsum[b] = scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    }
}

/* Byte (4 r + t) of a 32-bit lane group <- code byte of row r (+16 for the second half) at input
 * k + t, from the 128 bytes of inputs k .. k + 3 (two registers: t = 0, 1 and t = 2, 3): each
 * 32-bit lane then holds one row's four codes, as vpdpbusd multiplies them. */
static inline __m512i lanes_index(int half) {
    uint8_t idx[64];
    for (int r = 0; r < 16; ++r)
        for (int t = 0; t < 4; ++t)
            idx[4 * r + t] = (uint8_t)(t * 32 + r + 16 * half);
    return _mm512_loadu_si512(idx);
}

/* A tile of `tile` rows of x against block b's 64 outputs, accumulated over all of K. */
static inline __attribute__((always_inline)) void block_tile(
        const int tile, const uint8_t *codes, const uint32_t *sz, int64_t n, int64_t n0, int64_t k,
        int64_t group, const int8_t *q, const float *d, const float *dsum, float *y,
        __m512i idx_lo, __m512i idx_hi) {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    const __m512i upper = _mm512_set1_epi32((int)0xffff0000u);
    __m512 out[MAX_TILE][4];
    for (int m = 0; m < tile; ++m)
        for (int i = 0; i < 4; ++i)
            out[m][i] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < k; kb += BLOCK) {
        __m512i acc[MAX_TILE][4];
        for (int m = 0; m < tile; ++m)
            for (int i = 0; i < 4; ++i)
                acc[m][i] = _mm512_setzero_si512();
        const uint8_t *p = codes + kb * 32;
        _mm_prefetch((const char *)(sz + ((kb + PF_K) / group) * n + n0), _MM_HINT_T0);
        _mm_prefetch((const char *)(sz + ((kb + PF_K) / group) * n + n0) + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)(sz + ((kb + PF_K) / group) * n + n0) + 128, _MM_HINT_T0);
        _mm_prefetch((const char *)(sz + ((kb + PF_K) / group) * n + n0) + 192, _MM_HINT_T0);
        for (int step = 0; step < BLOCK / 4; ++step, p += 128) {
            _mm_prefetch((const char *)p + PF_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)p + PF_BYTES + 64, _MM_HINT_T0);
            __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(p + 64);
            __m512i lo = _mm512_permutex2var_epi8(a, idx_lo, b);     /* rows 0-15 | 32-47 */
            __m512i hi = _mm512_permutex2var_epi8(a, idx_hi, b);     /* rows 16-31 | 48-63 */
            __m512i w[4] = {_mm512_and_si512(lo, nibble), _mm512_and_si512(hi, nibble),
                            _mm512_and_si512(_mm512_srli_epi16(lo, 4), nibble),
                            _mm512_and_si512(_mm512_srli_epi16(hi, 4), nibble)};
            for (int m = 0; m < tile; ++m) {
                __m512i xq = _mm512_set1_epi32(*(const int32_t *)(q + m * k + kb + 4 * step));
                for (int i = 0; i < 4; ++i)
                    acc[m][i] = _mm512_dpbusd_epi32(acc[m][i], w[i], xq);
            }
        }
        const uint32_t *pairs = sz + (kb / group) * n + n0;
        for (int i = 0; i < 4; ++i) {
            __m512i v = _mm512_loadu_si512(pairs + 16 * i);
            __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            __m512 z = _mm512_castsi512_ps(_mm512_and_si512(v, upper));
            for (int m = 0; m < tile; ++m) {
                int64_t blk = m * (k / BLOCK) + kb / BLOCK;
                __m512 db = _mm512_set1_ps(d[blk]), ds = _mm512_set1_ps(dsum[blk]);
                __m512 t = _mm512_fmsub_ps(_mm512_cvtepi32_ps(acc[m][i]), db, _mm512_mul_ps(ds, _mm512_set1_ps(8.0f)));
                out[m][i] = _mm512_fmadd_ps(z, ds, _mm512_fmadd_ps(s, t, out[m][i]));
            }
        }
    }
    for (int m = 0; m < tile; ++m)
        for (int i = 0; i < 4; ++i)
            _mm512_storeu_ps(y + m * n + n0 + 16 * i, out[m][i]);
}

/* y [m, n] float32 = x [m, k] (float32, or bf16 when x_bf16) @ W^T. k a multiple of 32 and of
 * the group, n of 64. Work is split over blocks of 64 outputs on `threads` OpenMP threads (the
 * runtime torch itself uses, shared when loaded into its process). Returns 0, or -1 when out of
 * memory for the quantized activations. */
int hpipe_int4_mm(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *packed,
                  const uint32_t *sz, int64_t n, int64_t group, float *y, int threads) {
    int64_t blocks = k / BLOCK;
    int8_t *q = malloc(m * k + 2 * sizeof(float) * m * blocks + 64);
    if (!q)
        return -1;
    float *d = (float *)(((uintptr_t)(q + m * k) + 63) & ~(uintptr_t)63), *dsum = d + m * blocks;
    for (int64_t r = 0; r < m; ++r)
        quantize_row((const char *)x + r * k * (x_bf16 ? 2 : 4), x_bf16, k, q + r * k, d + r * blocks,
                     dsum + r * blocks);
    const __m512i idx_lo = lanes_index(0), idx_hi = lanes_index(1);
    const int64_t nb = n / ROWS, tiles = (m + MAX_TILE - 1) / MAX_TILE;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && nb > 1)
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *codes = packed + b * k * 32;
        for (int64_t t = 0; t < tiles; ++t) {
            int64_t r = t * MAX_TILE;
            const int8_t *qt = q + r * k;
            const float *dt = d + r * blocks, *st = dsum + r * blocks;
            float *yt = y + r * n;
            if (m - r >= 2)
                block_tile(2, codes, sz, n, b * ROWS, k, group, qt, dt, st, yt, idx_lo, idx_hi);
            else
                block_tile(1, codes, sz, n, b * ROWS, k, group, qt, dt, st, yt, idx_lo, idx_hi);
        }
    }
    free(q);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * int8: W [n, k] int8 row-major with one bf16 scale per row (torch's `_weight_int8pack_mm` form),
 *   y_n = scale_n sum_b d_b sum_{k in b} w_nk q_k.
 * vpdpbusd multiplies unsigned by signed bytes: |q| by w with q's sign moved onto w (the codes of
 * both are in [-127, 127]: no product overflows, four of them sum within int32). One 64-input
 * chunk of a row gives 16 lanes of four products each, lanes 0-7 of its first block and 8-15 of
 * its second: the blocks' d go on as a vector of two halves. */

#define INT8_TILE 4           /* rows of x sharing one read of a weight row */

static inline __attribute__((always_inline)) void int8_rows(
        const int tile, const int8_t *w, int64_t k, const uint8_t *aq, const uint64_t *neg,
        const float *dv, float scale, float *y, int64_t n) {
    const int64_t chunks = k / 64, stride = (k + 63) / 64;    /* whole chunks; per row of x */
    __m512 acc[INT8_TILE];
    for (int m = 0; m < tile; ++m)
        acc[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
        __m512i wv = _mm512_loadu_si512(w + 64 * c);
        for (int m = 0; m < tile; ++m) {
            const int64_t row = m * stride;
            __m512i sw = _mm512_mask_sub_epi8(wv, neg[row + c], _mm512_setzero_si512(), wv);
            __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(aq + m * k + 64 * c), sw);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_loadu_ps(dv + 16 * (row + c)), acc[m]);
        }
    }
    if (k % 64) {                                 /* a last block of 32: the upper lanes stay zero */
        __m512i wv = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(w + 64 * chunks)));
        for (int m = 0; m < tile; ++m) {
            const int64_t row = m * stride;
            __m512i sw = _mm512_mask_sub_epi8(wv, neg[row + chunks], _mm512_setzero_si512(), wv);
            __m512i xa = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(aq + m * k + 64 * chunks)));
            __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), xa, sw);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_loadu_ps(dv + 16 * (row + chunks)), acc[m]);
        }
    }
    for (int m = 0; m < tile; ++m)
        y[m * n] = _mm512_reduce_add_ps(acc[m]) * scale;
}

/* y [m, n] float32 = x [m, k] (float32, or bf16 when x_bf16) @ W^T, W int8 [n, k] with bf16 row
 * `scales`; k a multiple of 32. Returns 0, or -1 when out of memory. */
int hpipe_int8_mm(const void *x, int x_bf16, int64_t m, int64_t k, const int8_t *w,
                  const uint16_t *scales, int64_t n, float *y, int threads) {
    const int64_t blocks = k / BLOCK, chunks = (k + 63) / 64;
    /* per row of x: its int8 codes, |q|, the sign masks per chunk, d as two-halves vectors */
    size_t bytes = 2 * m * k + sizeof(uint64_t) * m * chunks + sizeof(float) * (m * 16 * chunks + 2 * m * blocks) + 128;
    int8_t *q = malloc(bytes);
    if (!q)
        return -1;
    uint8_t *aq = (uint8_t *)(q + m * k);
    float *dv = (float *)(((uintptr_t)(aq + m * k) + 63) & ~(uintptr_t)63);
    float *d = dv + m * 16 * chunks, *dsum = d + m * blocks;
    uint64_t *neg = (uint64_t *)(dsum + m * blocks);
    for (int64_t r = 0; r < m; ++r) {
        quantize_row((const char *)x + r * k * (x_bf16 ? 2 : 4), x_bf16, k, q + r * k, d + r * blocks,
                     dsum + r * blocks);
        for (int64_t c = 0; c < chunks; ++c) {
            __m512i v = c * 64 + 64 <= k ? _mm512_loadu_si512(q + r * k + 64 * c)
                                         : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(q + r * k + 64 * c)));
            _mm512_mask_storeu_epi8(aq + r * k + 64 * c, c * 64 + 64 <= k ? ~0ull : 0xffffffffull, _mm512_abs_epi8(v));
            neg[r * chunks + c] = _mm512_movepi8_mask(v);
            float lo = d[r * blocks + 2 * c], hi = 2 * c + 1 < blocks ? d[r * blocks + 2 * c + 1] : 0.0f;
            _mm512_storeu_ps(dv + 16 * (r * chunks + c),
                             _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(lo), _mm512_set1_ps(hi)));
        }
    }
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n > 64)
    for (int64_t j = 0; j < n; ++j) {
        float scale;
        uint32_t bits = (uint32_t)scales[j] << 16;
        __builtin_memcpy(&scale, &bits, 4);
        for (int64_t r = 0; r < m; r += INT8_TILE) {
            const int64_t at = r * chunks;
            if (m - r >= 4)
                int8_rows(4, w + j * k, k, aq + r * k, neg + at, dv + 16 * at, scale, y + r * n + j, n);
            else if (m - r == 3)
                int8_rows(3, w + j * k, k, aq + r * k, neg + at, dv + 16 * at, scale, y + r * n + j, n);
            else if (m - r == 2)
                int8_rows(2, w + j * k, k, aq + r * k, neg + at, dv + 16 * at, scale, y + r * n + j, n);
            else
                int8_rows(1, w + j * k, k, aq + r * k, neg + at, dv + 16 * at, scale, y + r * n + j, n);
        }
    }
    free(q);
    return 0;
}
