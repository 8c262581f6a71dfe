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
