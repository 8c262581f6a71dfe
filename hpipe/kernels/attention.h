/* Decode attention over a float16 KV cache, read where it lies (included by vnni.c and avx2.c; AVX2,
 * FMA and F16C, which both builds have; the VNNI build's AVX-512 takes 16 elements of a row at a
 * time where the head size allows, half the conversions' and products' instructions, and the
 * remainder 8 at a time).
 *
 * One query row per sequence: q [b, kv heads, g, d] float32 (the g query heads of one KV head
 * together, so each key and value row is read once for all of them), k and v [b, kv heads, n, d]
 * float16 at any strides whose last is 1 (the pool's pages in place, or a gathered copy), an
 * optional mask [b, n] (1 = attend) and out [b, kv heads, g, d] float32. A sequence's few query
 * rows (a speculative step's) go as one: its L rows' g heads are the group's L g queries, each with
 * its row of the mask ([b, L, n]: mask_rows = L), so the context is read once for all of them
 * rather than once a row (16 queries a pass over a chunk). Flash-decoding, as
 * llama.cpp's CPU path does: the context is cut in chunks of CHUNK positions, each (sequence, KV
 * head, chunk) is one task of the OpenMP loop (many tasks even for one sequence: both threads work
 * at any context), each keeps its max score, its sum of exponentials and its weighted sum of
 * values, and the chunks are merged by their maxima. Every product and sum is float32, the
 * float16 elements exact in it: the only rounding beyond float32's is the cache's own.
 *
 * torch's flash kernel takes float16 on CPUs without AVX-512 FP16 as 2-5x float32's time, and a
 * float32 copy of the context per layer costs more than the attention (bench/kv_dtype.py). */
#include <math.h>
#include <string.h>

#define CHUNK 256             /* positions a task attends to */
/* call(G) with G the constant 1 .. 16 that g is: the products' loops over the queries unrolled, their
 * sums in registers (with g a variable: a compare and branch beside every product, and sums past the
 * 12th on the stack; 5 rows of 3 heads at 1,700 positions, 30 layers: 6.9 -> 6.6 ms). */
#define FOR_QUERIES(g, call) do { switch (g) { \
    case 1: call(1); break; case 2: call(2); break; case 3: call(3); break; case 4: call(4); break; \
    case 5: call(5); break; case 6: call(6); break; case 7: call(7); break; case 8: call(8); break; \
    case 9: call(9); break; case 10: call(10); break; case 11: call(11); break; case 12: call(12); break; \
    case 13: call(13); break; case 14: call(14); break; case 15: call(15); break; default: call(16); } } while (0)
#define MAX_HEAD 256          /* the largest head size (Gemma's) */

static inline void f16_row(const uint16_t *src, float *dst, int64_t d) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= d; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
#endif
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < d; ++i)
        dst[i] = _cvtsh_ss(src[i]);
}

static inline void axpy_f32(float *y, float a, const float *x, int64_t d) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < d; ++i)
        y[i] += a * x[i];
}

/* e^x for x <= 0 (a score less its maximum), 8 at a time: 2^n times Cephes' degree-6 polynomial on
 * x - n ln 2, within 2 float32 ulps; -inf (a masked position) gives 0. */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 masked = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(masked, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* The 8 sums of acc[0..7]'s lanes, in one vector (lane i: acc[i]'s). */
static inline __m256 sums8(const __m256 *acc) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* g queries' scores against 8 key rows (float32, rows [8][d]), scaled, into s[j CHUNK .. + 7]: each
 * query's 8 dot products summed across lanes together. */
static inline __attribute__((always_inline)) void scores8(const float *q, const int g, int64_t d, const float *rows, float scale, float *s) {
    for (int64_t j = 0; j < g; ++j) {
        __m256 acc[8];
        for (int i = 0; i < 8; ++i)
            acc[i] = _mm256_setzero_ps();
        int64_t c = 0;
#ifdef __AVX512F__
        __m512 wide[8];
        for (int i = 0; i < 8; ++i)
            wide[i] = _mm512_setzero_ps();
        for (; c + 16 <= d; c += 16) {
            const __m512 qv = _mm512_loadu_ps(q + j * d + c);
            for (int i = 0; i < 8; ++i)
                wide[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows + i * d + c), wide[i]);
        }
        for (int i = 0; i < 8; ++i)         /* its two halves added: 8 lanes, as below */
            acc[i] = _mm256_add_ps(_mm512_castps512_ps256(wide[i]),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wide[i]), 1)));
#endif
        for (; c < d; c += 8) {
            const __m256 qv = _mm256_loadu_ps(q + j * d + c);
            for (int i = 0; i < 8; ++i)
                acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows + i * d + c), acc[i]);
        }
        _mm256_storeu_ps(s + j * CHUNK, _mm256_mul_ps(sums8(acc), _mm256_set1_ps(scale)));
    }
}

/* part's weighted values: for each of the g queries, sum over the chunk's positions that any of them
 * attends (`seen`, by the chunk's index; NULL: all) of its weight (scores, exponentials by now: 0
 * where it does not attend) times the value row, 16 (AVX-512) or 8 elements at a time, the g sums
 * in registers. */
static inline __attribute__((always_inline)) void weighted_values(const float *scores, const int g, int64_t d, const uint16_t *v, int64_t pos_stride,
                                   const uint8_t *seen, int64_t p0, int64_t len, float *part, int64_t width) {
    int64_t c = 0;
#ifdef __AVX512F__
    for (; c + 16 <= d; c += 16) {
        __m512 acc[16];
        for (int64_t j = 0; j < g; ++j)
            acc[j] = _mm512_setzero_ps();
        for (int64_t p = 0; p < len; ++p) {
            if (seen && !seen[p])
                continue;
            const __m512 row = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(v + (p0 + p) * pos_stride + c)));
            for (int64_t j = 0; j < g; ++j)
                acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(scores[j * CHUNK + p]), row, acc[j]);
        }
        for (int64_t j = 0; j < g; ++j)
            _mm512_storeu_ps(part + j * width + 2 + c, acc[j]);
    }
#endif
    for (; c < d; c += 8) {
        __m256 acc[16];
        for (int64_t j = 0; j < g; ++j)
            acc[j] = _mm256_setzero_ps();
        for (int64_t p = 0; p < len; ++p) {
            if (seen && !seen[p])
                continue;
            const __m256 row = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + (p0 + p) * pos_stride + c)));
            for (int64_t j = 0; j < g; ++j)
                acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(scores + j * CHUNK + p), row, acc[j]);
        }
        for (int64_t j = 0; j < g; ++j)
            _mm256_storeu_ps(part + j * width + 2 + c, acc[j]);
    }
}

/* The 8 scores at s (positions p .. p + 7 of a chunk) kept where the position is one of the chunk's
 * `valid` and its mask byte (m: 8 bytes, or NULL) is set, -inf elsewhere. */
static inline void mask8(float *s, const uint8_t *m, int64_t valid) {
    __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(valid < 8 ? valid : 8)),
                                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    if (m) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)m));
        keep = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(bytes, _mm256_setzero_si256())), keep);
    }
    _mm256_storeu_ps(s, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(s), keep));
}

/* One task: g <= 16 queries against positions [p0, p1) of one sequence's KV head, into part: g entries
 * of (max score, sum of exponentials, d weighted values); a max of -inf where no position is
 * attended. mask: NULL, or rows of n bytes, query j's the row (first + j) / per (each row shared by
 * `per` consecutive queries: the group's heads of one row of a speculative step, or all of them).
 * Three passes over the chunk: the scores (scores[j][p]; 8 key rows at a time made float32 once
 * for all g queries, each query's 8 dot products summed across lanes together, its mask applied 8
 * at a time), their exponentials 8 at a time per query, then the weighted values, 8 of a row's
 * elements at a time for all g queries in registers. d is a multiple of 8 (the caller checks). */
static void attend_chunk(const float *q, int64_t g, int64_t d, const uint16_t *k, const uint16_t *v,
                         int64_t pos_stride, const uint8_t *mask, int64_t n, int64_t first, int64_t per, int64_t p0,
                         int64_t p1, float scale, float *part) {
    float rows[8 * MAX_HEAD];
    float scores[16 * CHUNK];          /* [g][CHUNK], g <= 16 */
    uint8_t any[CHUNK];                /* several mask rows: whether any query attends a position */
    const int64_t width = d + 2, len = p1 - p0, padded = (len + 7) & ~(int64_t)7;
    const int64_t last_row = (first + g - 1) / per;
    const uint8_t *seen = mask && last_row == 0 ? mask + p0 : mask ? any : 0;     /* one mask row: itself */
    if (mask && last_row > 0)
        for (int64_t p = 0; p < len; ++p) {
            uint8_t a = 0;
            for (int64_t r = 0; r <= last_row; ++r)
                a |= mask[r * n + p0 + p];
            any[p] = a;
        }
    for (int64_t p = 0; p < padded; p += 8) {
        for (int64_t i = 0; i < 8; ++i) {
            if (p + i < len)
                f16_row(k + (p0 + p + i) * pos_stride, rows + i * d, d);
            else
                memset(rows + i * d, 0, sizeof(float) * d);
        }
        #define SCORES(G) scores8(q, G, d, rows, scale, scores + p)
        FOR_QUERIES(g, SCORES);
        #undef SCORES
        uint8_t tail[8] = {0};
        for (int64_t j = 0; j < g; ++j) {
            const uint8_t *m = mask ? mask + (first + j) / per * n + p0 + p : 0;
            if (m && p + 8 > len) {            /* the row's last bytes: not past its end */
                memcpy(tail, m, (size_t)(len - p));
                m = tail;
            }
            mask8(scores + j * CHUNK + p, m, len - p);
        }
    }
    for (int64_t j = 0; j < g; ++j) {
        float *s = scores + j * CHUNK, m = -INFINITY;
        __m256 top = _mm256_set1_ps(-INFINITY);      /* 8 lanes, not one chain of compares 256 long */
        for (int64_t p = 0; p < padded; p += 8)        /* past len: -inf (mask8) */
            top = _mm256_max_ps(top, _mm256_loadu_ps(s + p));
        float tops[8];
        _mm256_storeu_ps(tops, top);
        for (int i = 0; i < 8; ++i)
            m = tops[i] > m ? tops[i] : m;
        __m256 sum = _mm256_setzero_ps();
        if (m != -INFINITY)
            for (int64_t p = 0; p < padded; p += 8) {
                const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + p), _mm256_set1_ps(m)));
                _mm256_storeu_ps(s + p, e);
                sum = _mm256_add_ps(sum, e);
            }
        float lanes[8];
        _mm256_storeu_ps(lanes, sum);
        part[j * width] = m;
        part[j * width + 1] = lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
    }
    #define VALUES(G) weighted_values(scores, G, d, v, pos_stride, seen, p0, len, part, width)
    FOR_QUERIES(g, VALUES);
    #undef VALUES
}

/* mask_rows: how many rows of n bytes the mask has per sequence ([b, mask_rows, n]), a divisor of g:
 * query j (of a KV head's g) takes row j / (g / mask_rows). 1: one row for all g; g: one each; L:
 * one per row of a speculative step whose L rows' heads are the g = L group queries (its causal mask
 * as it is, not repeated per head). Returns 0; -1 without memory; -3 for a head size over MAX_HEAD
 * or not a multiple of 8, or a mask_rows that does not divide g (the caller's fallback takes those). A task is one chunk of one sequence's KV
 * head for up to 16 of its queries (a tile). */
int hpipe_attend_f16(const float *q, int64_t b, int64_t kvh, int64_t g, int64_t d, const uint16_t *k,
                     const uint16_t *v, int64_t b_stride, int64_t h_stride, int64_t pos_stride, int64_t n,
                     const uint8_t *mask, int64_t mask_rows, float scale, float *out, int threads) {
    if (d > MAX_HEAD || d % 8 || mask_rows < 1 || g % mask_rows)
        return -3;
    const int64_t chunks = n ? (n + CHUNK - 1) / CHUNK : 1, width = d + 2, tiles = (g + 15) / 16;
    float *parts = malloc(sizeof(float) * b * kvh * chunks * g * width);
    if (!parts)
        return -1;
    const int64_t tasks = b * kvh * chunks * tiles, per = g / mask_rows;
#pragma omp parallel for num_threads(threads) schedule(static) if (tasks > 1)
    for (int64_t t = 0; t < tasks; ++t) {
        const int64_t tile = t % tiles, c = t / tiles % chunks, hi = t / (tiles * chunks) % kvh,
                      bi = t / (tiles * chunks * kvh);
        const int64_t off = bi * b_stride + hi * h_stride, j0 = 16 * tile, gt = g - j0 < 16 ? g - j0 : 16;
        attend_chunk(q + ((bi * kvh + hi) * g + j0) * d, gt, d, k + off, v + off, pos_stride,
                     mask ? mask + (bi * mask_rows + j0 / per) * n : 0, n, j0 % per, per, c * CHUNK, c * CHUNK + CHUNK < n ? c * CHUNK + CHUNK : n, scale,
                     parts + (((bi * kvh + hi) * chunks + c) * g + j0) * width);
    }
    for (int64_t bh = 0; bh < b * kvh; ++bh)
        for (int64_t j = 0; j < g; ++j) {
            float m = -INFINITY, sum = 0.0f;
            for (int64_t c = 0; c < chunks; ++c) {
                const float pm = parts[((bh * chunks + c) * g + j) * width];
                if (pm > m)
                    m = pm;
            }
            float *o = out + (bh * g + j) * d;
            memset(o, 0, sizeof(float) * d);
            if (m == -INFINITY)          /* nothing attended: zeros, as torch's flash kernel gives */
                continue;
            for (int64_t c = 0; c < chunks; ++c) {
                const float *part = parts + ((bh * chunks + c) * g + j) * width;
                if (part[0] == -INFINITY)
                    continue;
                const float w = expf(part[0] - m);
                sum += w * part[1];
                axpy_f32(o, w, part + 2, d);
            }
            const float inv = 1.0f / sum;
            for (int64_t i = 0; i < d; ++i)
                o[i] *= inv;
        }
    free(parts);
    return 0;
}
