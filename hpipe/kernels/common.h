/* What vnni.c and avx2.c share: the layouts' constants, the activations' buffer and the int8
 * driver's row scales. Included first; each source defines `quantize_row` for its instructions. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define BLOCK 32              /* activation block: inputs per scale */
#define QMAX 32767.0f         /* the activations' int16 range */
#define ROWS 64               /* outputs per block of the packing */
enum { SCALES = 0, PAIRS = 1, SUPER = 2 };
#define SUPER_INPUTS 256      /* inputs per SUPER block */
#define SUPER_BYTES 1280      /* its scales for 64 outputs */
#define INT8_TILE 4           /* rows of x sharing one read of a weight row */

static void quantize_row(const void *x, int x_bf16, int64_t k, int16_t *q, float *d, float *dsum);

/* The rows' quantized activations: q [m, k] int16, d and d * sum(q) [m, k / 32], one allocation. */
typedef struct { int16_t *q; float *d, *dsum; } Activations;

static int quantize_rows(const void *x, int x_bf16, int64_t m, int64_t k, Activations *a) {
    const int64_t blocks = k / BLOCK;
    a->q = malloc(sizeof(int16_t) * m * k + 2 * sizeof(float) * m * blocks + 64);
    if (!a->q)
        return -1;
    a->d = (float *)(((uintptr_t)(a->q + m * k) + 63) & ~(uintptr_t)63);
    a->dsum = a->d + m * blocks;
    for (int64_t r = 0; r < m; ++r)
        quantize_row((const char *)x + r * k * (x_bf16 ? 2 : 4), x_bf16, k, a->q + r * k, a->d + r * blocks,
                     a->dsum + r * blocks);
    return 0;
}

/* Bytes of one block of 64 outputs' scales over K inputs. */
static inline int64_t scale_bytes(int form, int64_t k, int64_t group) {
    return form == SUPER ? k / SUPER_INPUTS * SUPER_BYTES : (k / group) * ROWS * (form == PAIRS ? 4 : 2);
}

static inline float row_scale(const uint16_t *scales, int blocks_scaled, int64_t j) {
    float scale = 1.0f;
    if (!blocks_scaled) {
        uint32_t bits = (uint32_t)scales[j] << 16;
        __builtin_memcpy(&scale, &bits, 4);
    }
    return scale;
}

/* Rows `rows` [t] of an int4 weight in the kernels' layout and forms, dequantized in float32 into
 * out [t, k]: w = (u - 8) s + z, with (s, z) as the kernels take them from `sz` (SUPER: s = d sc,
 * z = 8 s - dmin mn; PAIRS: bf16 s, z; SCALES: float16 s, z = 0). Every product is exact in
 * float32 (a 4-bit code times s; d's 11 bits times a 6-bit sc or mn), so w is the one rounding of
 * the sum, as torch's ops on the same tensors give it. An embedding's lookups: one call a step
 * where torch's ops took ~20 (0.3-0.5 ms for one row of Q4_K here). Returns 0, or -2 for a row
 * outside [0, n). */
int hpipe_int4_rows(const uint8_t *packed, const uint8_t *sz, int form, int64_t n, int64_t k, int64_t group,
                    const int64_t *rows, int64_t t, float *out) {
    for (int64_t i = 0; i < t; ++i)
        if (rows[i] < 0 || rows[i] >= n)
            return -2;
    const int64_t sb = scale_bytes(form, k, group);
    for (int64_t i = 0; i < t; ++i) {
        const int64_t b = rows[i] / ROWS, j = rows[i] % ROWS;
        const uint8_t *codes = packed + b * k * 32 + j % 32, *scales = sz + b * sb;
        const int shift = j >= 32 ? 4 : 0;
        float *o = out + i * k;
        for (int64_t c = 0; c < k; ++c) {
            const float u = (float)(((codes[c * 32] >> shift) & 15) - 8);
            float s, z = 0.0f;
            if (form == SUPER) {
                const uint8_t *blk = scales + c / SUPER_INPUTS * SUPER_BYTES, *g = blk + 256 + (c % SUPER_INPUTS) / 32 * 128;
                const float d = _cvtsh_ss(((const uint16_t *)blk)[j]), dmin = _cvtsh_ss(((const uint16_t *)blk)[ROWS + j]);
                s = d * (float)g[j];
                z = 8.0f * s - dmin * (float)g[ROWS + j];
            } else if (form == PAIRS) {
                const uint16_t *p = (const uint16_t *)scales + (c / group * ROWS + j) * 2;
                uint32_t sbits = (uint32_t)p[0] << 16, zbits = (uint32_t)p[1] << 16;
                __builtin_memcpy(&s, &sbits, 4);
                __builtin_memcpy(&z, &zbits, 4);
            } else {
                s = _cvtsh_ss(((const uint16_t *)scales)[c / group * ROWS + j]);
            }
            o[c] = u * s + z;
        }
    }
    return 0;
}
