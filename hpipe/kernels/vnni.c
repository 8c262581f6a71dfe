/* y = x W^T with 16-bit activations and integer dot products (AVX-512 VNNI `vpdpwssd`): W in
 * torch's CPU int4 packing (`hpipe_int4_mm`) or int8 with a scale per output row or per block of
 * 32 inputs (`hpipe_int8_mm`).
 *
 * W is read where torch's ops read it, so the dense path, the embeddings' row gathers and the disk
 * cache keep their one layout:
 *   packed [N / 64, K, 32] bytes: in block b, byte (k, j) holds code u[64 b + j, k] in its low
 *          nibble and u[64 b + j + 32, k] in its high nibble;
 *   sz     the scales, in blocks of 64 outputs as the codes are, w = (u - 8) s + z over each group
 *          of G inputs, in one of three forms (`form`), decode here being bound by reading them:
 *          PAIRS   [N / 64, K / G, 64] pairs of bf16 (s, z);
 *          SCALES  [N / 64, K / G, 64] float16 s, z = 0: a symmetric weight (GGUF's Q4_0), the
 *                  file's own 4.5 bits a weight, not 5, and its own d;
 *          SUPER   [N / 64, K / 256] super-blocks of 1,280 bytes, GGUF's Q4_K (G = 32) as the file
 *                  factors it, w = (d sc) u - (dmin mn): float16 d [64], dmin [64], then for
 *                  each of its 8 groups uint8 sc [64] and mn [64] (6-bit; in the order they are
 *                  read, one stream): 4.625 bits a weight (the file's 4.5), the products exact
 *                  in float32, so s = d sc and z = 8 s - dmin mn.
 * x is quantized per block of 32 inputs: x ~ d q, q int16 in [-32767, 32767], d = amax / 32767.
 * Over one block then
 *   sum_k w_k x_k = d (s sum_k u_k q_k + (z - 8 s) sum_k q_k),
 * where sum_k u_k q_k is exact in int32. The activations' own rounding is 2^-16 of their block's
 * largest value: below bf16's 2^-8 of each value (torch's kernels take bf16 activations), and
 * 256 times finer than llama.cpp's 8-bit activations (q8_0 / q8_1), whose steps part two near-equal
 * logits where a float32 difference upstream (another batch, a cached prefix) crosses one.
 * torch's own kernels convert every code to float and multiply in float: several times the work
 * per weight, and decode at one or two threads is bound by that work, not by reading memory.
 *
 * Rows of x are independent: a row gets the same bits whatever else is in the call. */
#include "common.h"

#define PF_BYTES 2048         /* codes prefetched this far ahead of the dot products (one block's stream) */
#define MAX_TILE 4            /* rows of x sharing one pass over a block's codes (a verification step's,
                                 * a small batch's: 3 rows 0.75x and 5 rows 0.86x the time of tiles of 2) */

static inline __m512 bf16_to_f32(const uint16_t *p) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* One row of K inputs -> int16 codes, per block of 32 the scale d and d * sum(q). */
static void quantize_row(const void *x, int x_bf16, int64_t k, int16_t *q, float *d, float *dsum) {
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
        float scale = amax / QMAX, inv = amax > 0.0f ? QMAX / amax : 0.0f;
        __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
        __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
        _mm256_storeu_si256((__m256i *)(q + b * BLOCK), _mm512_cvtsepi32_epi16(i0));
        _mm256_storeu_si256((__m256i *)(q + b * BLOCK + 16), _mm512_cvtsepi32_epi16(i1));
        d[b] = scale;
        dsum[b] = scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    }
}


/* Even bytes (2 t of lane r) <- the code byte of row r (+16 for the second half of the 32 rows a
 * byte holds) at input k + t + 2 pair, from the 128 bytes of inputs k .. k + 3 (two registers);
 * odd bytes are zeroed by the permute's mask: each 32-bit lane holds two of a row's codes as int16
 * (its low nibble's row; its high nibble's row after a shift), as vpdpwssd multiplies them. */
static inline __m512i lanes_index(int half, int pair) {
    uint8_t idx[64];
    for (int r = 0; r < 16; ++r)
        for (int t = 0; t < 2; ++t) {
            idx[4 * r + 2 * t] = (uint8_t)((2 * pair + t) * 32 + r + 16 * half);
            idx[4 * r + 2 * t + 1] = 0;
        }
    return _mm512_loadu_si512(idx);
}



/* SUPER, outputs 16 i .. 16 i + 15 of super-block `sb`: float16 d (which 0) or dmin (1); group j's
 * 6-bit sc (which 0) or mn (1). */
static inline __m512 super_d(const uint8_t *sb, int which, int i) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 128 * which + 32 * i)));
}

static inline __m512 super_u8(const uint8_t *sb, int64_t j, int which, int i) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sb + 256 + 128 * j + 64 * which + 16 * i))));
}

/* s and z of outputs 16 i .. 16 i + 15 of a block (`sz` its scales) over input group g. */
static inline __attribute__((always_inline)) void group_scales(
        const int form, const uint8_t *sz, int64_t g, int i, __m512 *s, __m512 *z) {
    if (form == PAIRS) {
        __m512i v = _mm512_loadu_si512(sz + (g * ROWS + 16 * i) * 4);
        *s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        *z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
    } else if (form == SCALES) {
        *s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sz + (g * ROWS + 16 * i) * 2)));
        *z = _mm512_setzero_ps();
    } else {
        const uint8_t *sb = sz + g / 8 * SUPER_BYTES;
        *s = _mm512_mul_ps(super_d(sb, 0, i), super_u8(sb, g % 8, 0, i));
        *z = _mm512_fmsub_ps(_mm512_set1_ps(8.0f), *s, _mm512_mul_ps(super_d(sb, 1, i), super_u8(sb, g % 8, 1, i)));
    }
}

/* A tile of `tile` rows of x against block b's 64 outputs, accumulated over all of K. */
static inline __attribute__((always_inline)) void block_tile(
        const int tile, const int form, const uint8_t *codes, const uint8_t *sz, int64_t n, int64_t n0, int64_t k,
        int64_t group, const int16_t *q, const float *d, const float *dsum, float *y, const __m512i idx[4]) {
    const __m512i nibble = _mm512_set1_epi16(0x0f);
    const __mmask64 even = 0x5555555555555555ull;
    __m512 out[MAX_TILE][4], dsup[4], msup[4];
    for (int m = 0; m < tile; ++m)
        for (int i = 0; i < 4; ++i)
            out[m][i] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < k; kb += BLOCK) {
        __m512i acc[MAX_TILE][4];
        for (int m = 0; m < tile; ++m)
            for (int i = 0; i < 4; ++i)
                acc[m][i] = _mm512_setzero_si512();
        const uint8_t *p = codes + kb * 32;
        for (int step = 0; step < BLOCK / 4; ++step, p += 128) {
            _mm_prefetch((const char *)p + PF_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)p + PF_BYTES + 64, _MM_HINT_T0);
            __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(p + 64);
            __m512i w[2][4];                                     /* [pair of inputs][16 rows] */
            for (int pair = 0; pair < 2; ++pair) {
                __m512i lo = _mm512_maskz_permutex2var_epi8(even, a, idx[pair], b);      /* rows 0-15 | 32-47 */
                __m512i hi = _mm512_maskz_permutex2var_epi8(even, a, idx[2 + pair], b);  /* rows 16-31 | 48-63 */
                w[pair][0] = _mm512_and_si512(lo, nibble);
                w[pair][1] = _mm512_and_si512(hi, nibble);
                w[pair][2] = _mm512_srli_epi16(lo, 4);
                w[pair][3] = _mm512_srli_epi16(hi, 4);
            }
            for (int m = 0; m < tile; ++m) {
                const int16_t *xq = q + m * k + kb + 4 * step;
                __m512i x01 = _mm512_set1_epi32(*(const int32_t *)xq), x23 = _mm512_set1_epi32(*(const int32_t *)(xq + 2));
                for (int i = 0; i < 4; ++i)
                    acc[m][i] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(acc[m][i], w[0][i], x01), w[1][i], x23);
            }
        }
        if (form == SUPER) {    /* d and dmin once per super-block; s = d sc, then s t - (dmin mn) ds */
            const uint8_t *sb = sz + kb / SUPER_INPUTS * SUPER_BYTES;
            const int64_t j = (kb / BLOCK) % 8;
            if (j == 0)
                for (int i = 0; i < 4; ++i) {
                    dsup[i] = super_d(sb, 0, i);
                    msup[i] = super_d(sb, 1, i);
                }
            for (int i = 0; i < 4; ++i) {
                __m512 s = _mm512_mul_ps(dsup[i], super_u8(sb, j, 0, i));
                __m512 mn = _mm512_mul_ps(msup[i], super_u8(sb, j, 1, i));
                for (int m = 0; m < tile; ++m) {
                    int64_t blk = m * (k / BLOCK) + kb / BLOCK;
                    __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[m][i]), _mm512_set1_ps(d[blk]));
                    out[m][i] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(dsum[blk]), _mm512_fmadd_ps(s, t, out[m][i]));
                }
            }
            continue;
        }
        for (int i = 0; i < 4; ++i) {
            __m512 s, z;
            group_scales(form, sz, kb / group, i, &s, &z);
            for (int m = 0; m < tile; ++m) {
                int64_t blk = m * (k / BLOCK) + kb / BLOCK;
                __m512 db = _mm512_set1_ps(d[blk]), ds = _mm512_set1_ps(dsum[blk]);
                __m512 t = _mm512_fmsub_ps(_mm512_cvtepi32_ps(acc[m][i]), db, _mm512_mul_ps(ds, _mm512_set1_ps(8.0f)));
                out[m][i] = _mm512_fmadd_ps(s, t, out[m][i]);
                if (form != SCALES)
                    out[m][i] = _mm512_fmadd_ps(z, ds, out[m][i]);
            }
        }
    }
    for (int m = 0; m < tile; ++m)
        for (int i = 0; i < 4; ++i)
            _mm512_storeu_ps(y + m * n + n0 + 16 * i, out[m][i]);
}

/* y [m, n] float32 = x [m, k] (float32, or bf16 when x_bf16) @ W^T. k a multiple of 32 and of
 * the group (SUPER: of 256, G 32), n of 64; `form` how sz holds the scales (above). Work is split
 * over blocks of 64 outputs on `threads` OpenMP threads (the
 * runtime torch itself uses, shared when loaded into its process). Returns 0, or -1 when out of
 * memory for the quantized activations. */
int hpipe_int4_mm(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *packed,
                  const uint8_t *sz, int form, int64_t n, int64_t group, float *y, int threads) {
    Activations a;
    if (quantize_rows(x, x_bf16, m, k, &a))
        return -1;
    const int64_t blocks = k / BLOCK, nb = n / ROWS, tiles = (m + MAX_TILE - 1) / MAX_TILE;
    const __m512i idx[4] = {lanes_index(0, 0), lanes_index(0, 1), lanes_index(1, 0), lanes_index(1, 1)};
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && nb > 1)
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *codes = packed + b * k * 32;
        const uint8_t *scales = sz + b * scale_bytes(form, k, group);
        for (int64_t t = 0; t < tiles; ++t) {
            int64_t r = t * MAX_TILE;
            const int16_t *qt = a.q + r * k;
            const float *dt = a.d + r * blocks, *st = a.dsum + r * blocks;
            float *yt = y + r * n;
            const int tile = m - r < MAX_TILE ? (int)(m - r) : MAX_TILE;   /* the tile's shape and the scales' as constants */
            #define TILE(rows, f) block_tile(rows, f, codes, scales, n, b * ROWS, k, group, qt, dt, st, yt, idx)
            #define TILES(f) do { switch (tile) { case 1: TILE(1, f); break; case 2: TILE(2, f); break; \
                                                  case 3: TILE(3, f); break; default: TILE(4, f); } } while (0)
            if (form == PAIRS)
                TILES(PAIRS);
            else if (form == SCALES)
                TILES(SCALES);
            else
                TILES(SUPER);
            #undef TILES
            #undef TILE
        }
    }
    free(a.q);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * int8: W [n, k] int8 row-major with one bf16 scale per row (torch's `_weight_int8pack_mm` form),
 *   y_n = scale_n sum_b d_b sum_{k in b} w_nk q_k,
 * or with a float16 scale per block of 32 inputs, a GGUF Q8_0 file's own (`blocks_scaled` 1),
 *   y_n = sum_b (d_b e_nb) sum_{k in b} w_nk q_k.
 * One block of 32 inputs is one register of 32 int16 products summed in pairs (vpmaddwd), its
 * scales applied as it goes to float. */


static inline __attribute__((always_inline)) void int8_rows(
        const int tile, const int8_t *w, int64_t k, const int16_t *q, const float *d, const uint16_t *e,
        float scale, float *y, int64_t n) {
    const int64_t blocks = k / BLOCK;
    __m512 acc[INT8_TILE];
    for (int m = 0; m < tile; ++m)
        acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + BLOCK * b)));
        const float eb = e ? _cvtsh_ss(e[b]) : 1.0f;
        for (int m = 0; m < tile; ++m) {
            __m512i p = _mm512_madd_epi16(wv, _mm512_loadu_si512(q + m * k + BLOCK * b));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(d[m * blocks + b] * eb), acc[m]);
        }
    }
    for (int m = 0; m < tile; ++m)
        y[m * n] = _mm512_reduce_add_ps(acc[m]) * scale;
}

/* One row of x against two weight rows (a decode step; rows j and j + n / 2, two sequential
 * streams): two independent chains of FMAs, where one row alone waits on its chain's latency (with
 * block scales, on their conversion too: SmolLM2's 49152 x 576 head took 1.43 ms at one thread
 * against 1.10 with a scale per row). Each output's arithmetic is int8_rows' own, in the same
 * order: the same bits. */
static inline __attribute__((always_inline)) void int8_row_pair(
        const int8_t *w0, const int8_t *w1, int64_t k, const int16_t *q, const float *d, const uint16_t *e0,
        const uint16_t *e1, float s0, float s1, float *y0, float *y1) {
    const int64_t blocks = k / BLOCK;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m512i qv = _mm512_loadu_si512(q + BLOCK * b);
        __m512i v0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w0 + BLOCK * b)));
        __m512i v1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w1 + BLOCK * b)));
        const float f0 = d[b] * (e0 ? _cvtsh_ss(e0[b]) : 1.0f), f1 = d[b] * (e1 ? _cvtsh_ss(e1[b]) : 1.0f);
        a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(v0, qv)), _mm512_set1_ps(f0), a0);
        a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(v1, qv)), _mm512_set1_ps(f1), a1);
    }
    *y0 = _mm512_reduce_add_ps(a0) * s0;
    *y1 = _mm512_reduce_add_ps(a1) * s1;
}

#include "int8_mm.h"

/* One row of x against one block of 64 outputs (experts.h's unit of work), the form a constant. */
static void int4_block_row(int form, const uint8_t *codes, const uint8_t *sz, int64_t k, int64_t group,
                           const int16_t *q, const float *d, const float *dsum, float *y) {
    const __m512i idx[4] = {lanes_index(0, 0), lanes_index(0, 1), lanes_index(1, 0), lanes_index(1, 1)};
    if (form == PAIRS)
        block_tile(1, PAIRS, codes, sz, 0, 0, k, group, q, d, dsum, y, idx);
    else if (form == SCALES)
        block_tile(1, SCALES, codes, sz, 0, 0, k, group, q, d, dsum, y, idx);
    else
        block_tile(1, SUPER, codes, sz, 0, 0, k, group, q, d, dsum, y, idx);
}

#include "experts.h"
#include "attention.h"

/* ---------------------------------------------------------------------------------------------
 * Dequantizing for the dense path (many rows: prefill slices): weights to bf16 a chunk at a time,
 * multiplied by oneDNN's bf16 GEMM. One pass, rounded once to bf16 (to nearest, ties to even)
 * from the float32 value, where torch's ops took five passes over each chunk. */

static inline __m256i f32_to_bf16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}

/* Blocks [b0, b0 + nb) of an int4 weight -> out [nb, k, 64] bf16, W^T of each block of 64 outputs:
 * out[b, k, j] = (u - 8) s + z of output 64 b + j, input k (sz in `form`, as hpipe_int4_mm reads it). */
void hpipe_int4_dequant(const uint8_t *packed, const uint8_t *sz, int form, int64_t k, int64_t group,
                        int64_t b0, int64_t nb, uint16_t *out, int threads) {
    const __m512i nibble = _mm512_set1_epi32(0x0f);
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && nb > 1)
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *codes = packed + (b0 + b) * k * 32;
        const uint8_t *scales = sz + (b0 + b) * scale_bytes(form, k, group);
        uint16_t *o = out + b * k * ROWS;
        for (int64_t g = 0; g < k / group; ++g) {
            __m512 s[4], z[4];
            for (int i = 0; i < 4; ++i)
                group_scales(form, scales, g, i, &s[i], &z[i]);
            for (int64_t kk = g * group; kk < (g + 1) * group; ++kk) {
                for (int h = 0; h < 2; ++h) {             /* rows 16 h .. 16 h + 15 and + 32 */
                    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + kk * 32 + 16 * h)));
                    __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(bytes, nibble), _mm512_set1_epi32(8)));
                    __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(bytes, 4), _mm512_set1_epi32(8)));
                    _mm256_storeu_si256((__m256i *)(o + kk * ROWS + 16 * h), f32_to_bf16(_mm512_fmadd_ps(lo, s[h], z[h])));
                    _mm256_storeu_si256((__m256i *)(o + kk * ROWS + 32 + 16 * h),
                                        f32_to_bf16(_mm512_fmadd_ps(hi, s[2 + h], z[2 + h])));
                }
            }
        }
    }
}

/* Rows [r0, r0 + n) of an int8 weight [*, k] with bf16 row scales, or (`blocks_scaled`) float16
 * scales per block of 32 inputs -> out [n, k] bf16 = code * scale. */
void hpipe_int8_dequant(const int8_t *w, const uint16_t *scales, int blocks_scaled, int64_t k, int64_t r0,
                        int64_t n, uint16_t *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n > 16)
    for (int64_t r = 0; r < n; ++r) {
        float scale;
        uint32_t bits = (uint32_t)scales[r0 + r] << 16;
        __builtin_memcpy(&scale, &bits, 4);
        const int8_t *row = w + (r0 + r) * k;
        int64_t c = 0;
        for (; c + 16 <= k; c += 16) {
            if (blocks_scaled)      /* k is whole blocks of 32 here */
                scale = _cvtsh_ss(scales[(r0 + r) * (k / BLOCK) + c / BLOCK]);
            __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + c))));
            _mm256_storeu_si256((__m256i *)(out + r * k + c), f32_to_bf16(_mm512_mul_ps(v, _mm512_set1_ps(scale))));
        }
        for (; c < k; ++c) {
            float f = (float)row[c] * scale;
            uint32_t u;
            __builtin_memcpy(&u, &f, 4);
            out[r * k + c] = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
        }
    }
}
