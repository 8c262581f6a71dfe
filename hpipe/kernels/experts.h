/* A step's routed experts in one call, for vnni.c and avx2.c: included after each defines
 * `int4_block_row`, `int8_rows` and `int8_row_pair` for its instructions.
 *
 * The step's (row, slot) pairs come as `ids` [n_ids], the expert each pair picked; pair i reads row
 * i / (n_ids / m) of x [m, k] (a step's gate and up: T rows, k pairs each; its down: one row a pair)
 * and writes row i of y [n_ids, n]. The pairs are grouped by expert (a stable counting sort) and each
 * picked expert's weights are read once for all of its pairs: expert e's are the block's stacked
 * tensors' slice e, `stride` bytes of weights (and `sz_stride` of scales) apart. One parallel region
 * over (picked expert, share of its outputs), where a call per expert made one region each (8
 * experts: 8 OpenMP regions, each ~30 us here at 2 threads for a 512 x 1024 matrix); x is quantized
 * once, not once per share. The same arithmetic as `hpipe_int4_mm` / `hpipe_int8_mm` on one row:
 * a pair's row gets the bits a call per expert gives it. m and n_ids > 0 (the callers' check).
 * Returns 0, -1 out of memory, -2 an id outside [0, n_experts). */

typedef struct { int64_t *order, *expert, *begin, groups; } Groups;

static int group_pairs(const int64_t *ids, int64_t n_ids, int64_t n_experts, Groups *g) {
    for (int64_t i = 0; i < n_ids; ++i)
        if (ids[i] < 0 || ids[i] >= n_experts)
            return -2;
    int64_t *start = calloc(n_experts + 1, sizeof(int64_t));
    g->order = malloc(sizeof(int64_t) * (3 * n_ids + 1));     /* order, expert, begin (groups + 1) */
    if (!start || !g->order) {
        free(start);
        free(g->order);
        return -1;
    }
    g->expert = g->order + n_ids;
    g->begin = g->expert + n_ids;
    for (int64_t i = 0; i < n_ids; ++i)
        ++start[ids[i] + 1];
    g->groups = 0;
    for (int64_t e = 0; e < n_experts; ++e) {
        if (start[e + 1]) {
            g->expert[g->groups] = e;
            g->begin[g->groups++] = start[e];
        }
        start[e + 1] += start[e];
    }
    g->begin[g->groups] = n_ids;
    for (int64_t i = 0; i < n_ids; ++i)
        g->order[start[ids[i]]++] = i;
    free(start);
    return 0;
}

/* A routed call's state: its pairs grouped, x quantized, and what a pair's row of them is found by. */
typedef struct { Activations a; Groups g; int64_t blocks, every; } Routed;

static int routed_prologue(const void *x, int x_bf16, int64_t m, int64_t k, const int64_t *ids, int64_t n_ids,
                           int64_t n_experts, Routed *r) {
    int rc = group_pairs(ids, n_ids, n_experts, &r->g);
    if (rc)
        return rc;
    if (quantize_rows(x, x_bf16, m, k, &r->a)) {
        free(r->g.order);
        return -1;
    }
    r->blocks = k / BLOCK;
    r->every = n_ids / m;
    return 0;
}

static int routed_done(Routed *r) {
    free(r->g.order);
    free(r->a.q);
    return 0;
}

/* int4 (`hpipe_int4_mm`'s layout and forms): shares of whole 64-output blocks. */
int hpipe_int4_mm_routed(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *packed, int64_t stride,
                         const uint8_t *sz, int64_t sz_stride, int form, int64_t n, int64_t group,
                         const int64_t *ids, int64_t n_ids, int64_t n_experts, float *y, int threads) {
    Routed r;
    int rc = routed_prologue(x, x_bf16, m, k, ids, n_ids, n_experts, &r);
    if (rc)
        return rc;
    const int64_t nb = n / ROWS, sb = scale_bytes(form, k, group);
    const int64_t parts = threads < nb ? threads : nb, per = (nb + parts - 1) / parts;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < r.g.groups * parts; ++t) {
        const int64_t i = t / parts, e = r.g.expert[i], b0 = (t % parts) * per, b1 = b0 + per < nb ? b0 + per : nb;
        for (int64_t b = b0; b < b1; ++b) {
            const uint8_t *codes = packed + e * stride + b * k * 32, *scales = sz + e * sz_stride + b * sb;
            for (int64_t j = r.g.begin[i]; j < r.g.begin[i + 1]; ++j) {
                const int64_t p = r.g.order[j], row = p / r.every;
                int4_block_row(form, codes, scales, k, group, r.a.q + row * k, r.a.d + row * r.blocks,
                               r.a.dsum + row * r.blocks, y + p * n + b * ROWS);
            }
        }
    }
    return routed_done(&r);
}

/* int8 (`hpipe_int8_mm`'s: row scales, or Q8_0's block scales when `blocks_scaled`): shares of rows. */
int hpipe_int8_mm_routed(const void *x, int x_bf16, int64_t m, int64_t k, const int8_t *w, int64_t stride,
                         const uint16_t *scales, int64_t sc_stride, int blocks_scaled, int64_t n,
                         const int64_t *ids, int64_t n_ids, int64_t n_experts, float *y, int threads) {
    Routed r;
    int rc = routed_prologue(x, x_bf16, m, k, ids, n_ids, n_experts, &r);
    if (rc)
        return rc;
    const int64_t per_row = blocks_scaled ? r.blocks : 1;
    const int64_t parts = threads, per = ((n + parts - 1) / parts + 1) / 2 * 2;    /* even: row pairs */
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < r.g.groups * parts; ++t) {
        const int64_t i = t / parts, j0 = (t % parts) * per, j1 = j0 + per < n ? j0 + per : n;
        const int8_t *we = w + r.g.expert[i] * stride;
        const uint16_t *se = scales + r.g.expert[i] * sc_stride;
        for (int64_t j = r.g.begin[i]; j < r.g.begin[i + 1]; ++j) {
            const int64_t p = r.g.order[j], row = p / r.every;
            const int16_t *q = r.a.q + row * k;
            const float *d = r.a.d + row * r.blocks;
            float *yp = y + p * n;
            int64_t o = j0;
            for (; o + 1 < j1; o += 2)
                int8_row_pair(we + o * k, we + (o + 1) * k, k, q, d, blocks_scaled ? se + o * per_row : NULL,
                              blocks_scaled ? se + (o + 1) * per_row : NULL, row_scale(se, blocks_scaled, o),
                              row_scale(se, blocks_scaled, o + 1), yp + o, yp + o + 1);
            if (o < j1)
                int8_rows(1, we + o * k, k, q, d, blocks_scaled ? se + o * per_row : NULL,
                          row_scale(se, blocks_scaled, o), yp + o, n);
        }
    }
    return routed_done(&r);
}
