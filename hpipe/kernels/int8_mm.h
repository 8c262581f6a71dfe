/* hpipe_int8_mm for vnni.c and avx2.c: included after each defines `int8_rows` and
 * `int8_row_pair` for its instructions. */

/* y [m, n] float32 = x [m, k] (float32, or bf16 when x_bf16) @ W^T, W int8 [n, k] with bf16 row
 * `scales` [n], or (`blocks_scaled` 1) float16 block scales [n, k / 32]; k a multiple of 32. Returns 0,
 * or -1 when out of memory. */
int hpipe_int8_mm(const void *x, int x_bf16, int64_t m, int64_t k, const int8_t *w,
                  const uint16_t *scales, int blocks_scaled, int64_t n, float *y, int threads) {
    Activations a;
    if (quantize_rows(x, x_bf16, m, k, &a))
        return -1;
    const int64_t blocks = k / BLOCK;
    if (m == 1) {
        const int64_t h = n / 2;
        #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n > 64)
        for (int64_t j = 0; j < h; ++j)
            int8_row_pair(w + j * k, w + (j + h) * k, k, a.q, a.d, blocks_scaled ? scales + j * blocks : NULL,
                          blocks_scaled ? scales + (j + h) * blocks : NULL, row_scale(scales, blocks_scaled, j),
                          row_scale(scales, blocks_scaled, j + h), y + j, y + j + h);
        if (n % 2)
            int8_rows(1, w + (n - 1) * k, k, a.q, a.d, blocks_scaled ? scales + (n - 1) * blocks : NULL,
                      row_scale(scales, blocks_scaled, n - 1), y + n - 1, n);
        free(a.q);
        return 0;
    }
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n > 64)
    for (int64_t j = 0; j < n; ++j) {
        const float scale = row_scale(scales, blocks_scaled, j);
        const uint16_t *e = blocks_scaled ? scales + j * blocks : NULL;
        for (int64_t r = 0; r < m; r += INT8_TILE) {
            const int16_t *q = a.q + r * k;
            const float *d = a.d + r * blocks;
            if (m - r >= 4)
                int8_rows(4, w + j * k, k, q, d, e, scale, y + r * n + j, n);
            else if (m - r == 3)
                int8_rows(3, w + j * k, k, q, d, e, scale, y + r * n + j, n);
            else if (m - r == 2)
                int8_rows(2, w + j * k, k, q, d, e, scale, y + r * n + j, n);
            else
                int8_rows(1, w + j * k, k, q, d, e, scale, y + r * n + j, n);
        }
    }
    free(a.q);
    return 0;
}
