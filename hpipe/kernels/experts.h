/* A decode step's routed experts in one call, for vnni.c and avx2.c: included after each defines
 * `hpipe_int4_mm` and `hpipe_int8_mm`. One parallel region over (expert, share of its output blocks),
 * each share the single-threaded kernel on its rows: where a step called the kernel once per expert
 * (8 experts: 8 OpenMP regions, 8 dispatches, each ~30 us here at 2 threads for a 512 x 1024 matrix),
 * it now makes one. Expert i of `ids` reads row i of x, or row 0 when `shared` (a step's gate and up
 * read the same input), and writes row i of y [n_ids, n]. Its weights are expert ids[i]'s of the
 * block's stacked tensors: `stride` bytes of weights (and `sz_stride` of scales) apart. */

/* int4 (`hpipe_int4_mm`'s layout and forms): shares of whole 64-output blocks. */
int hpipe_int4_mm_experts(const void *x, int x_bf16, int shared, int64_t k, const uint8_t *packed, int64_t stride,
                          const uint8_t *sz, int64_t sz_stride, int form, int64_t n, int64_t group,
                          const int64_t *ids, int64_t n_ids, float *y, int threads) {
    const int64_t nb = n / ROWS, parts = threads < nb ? threads : nb, per = (nb + parts - 1) / parts;
    const size_t elem = x_bf16 ? 2 : 4;
    int failed = 0;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1) reduction(|:failed)
    for (int64_t t = 0; t < n_ids * parts; ++t) {
        const int64_t i = t / parts, b0 = (t % parts) * per, b1 = b0 + per < nb ? b0 + per : nb;
        if (b0 >= b1)
            continue;
        const char *xi = (const char *)x + (shared ? 0 : i * k * elem);
        failed |= hpipe_int4_mm(xi, x_bf16, 1, k, packed + ids[i] * stride + b0 * k * 32,
                                sz + ids[i] * sz_stride + b0 * scale_bytes(form, k, group), form, (b1 - b0) * ROWS,
                                group, y + i * n + b0 * ROWS, 1);
    }
    return failed ? -1 : 0;
}

/* int8 (`hpipe_int8_mm`'s: row scales, or Q8_0's block scales when `blocks_scaled`): shares of rows. */
int hpipe_int8_mm_experts(const void *x, int x_bf16, int shared, int64_t k, const int8_t *w, int64_t stride,
                          const uint16_t *scales, int64_t sc_stride, int blocks_scaled, int64_t n,
                          const int64_t *ids, int64_t n_ids, float *y, int threads) {
    const int64_t parts = threads, per = ((n + parts - 1) / parts + 1) / 2 * 2;    /* even: row pairs */
    const int64_t per_row = blocks_scaled ? k / BLOCK : 1;
    const size_t elem = x_bf16 ? 2 : 4;
    int failed = 0;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1) reduction(|:failed)
    for (int64_t t = 0; t < n_ids * parts; ++t) {
        const int64_t i = t / parts, j0 = (t % parts) * per, j1 = j0 + per < n ? j0 + per : n;
        if (j0 >= j1)
            continue;
        const char *xi = (const char *)x + (shared ? 0 : i * k * elem);
        failed |= hpipe_int8_mm(xi, x_bf16, 1, k, w + ids[i] * stride + j0 * k,
                                scales + ids[i] * sc_stride + j0 * per_row, blocks_scaled, j1 - j0,
                                y + i * n + j0, 1);
    }
    return failed ? -1 : 0;
}
