// torch.ops.hpipe.int4_mm, int8_mm and their routed experts' forms (experts.h) as C++ kernels of
// torch's dispatcher, calling vnni.c's functions (loaded beside it, their symbols global). A compiled decode step's C++ wrapper then
// calls them without Python: through the Python registration each call re-took the GIL and boxed
// its tensors into Python objects, ~4 us of a 5 us call at one row here, 40 calls in a SmolLM2
// stage's step. Same arithmetic, same kernels: `hpipe.cpu_kernels.int4_mm` is the Python twin.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <optional>
#include <torch/library.h>

extern "C" {
int hpipe_int4_mm(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *packed, const uint8_t *sz,
                  int form, int64_t n, int64_t group, float *y, int threads);
int hpipe_int8_mm(const void *x, int x_bf16, int64_t m, int64_t k, const int8_t *w, const uint16_t *scales,
                  int blocks_scaled, int64_t n, float *y, int threads);
int hpipe_int4_mm_routed(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *packed, int64_t stride,
                         const uint8_t *sz, int64_t sz_stride, int form, int64_t n, int64_t group,
                         const int64_t *ids, int64_t n_ids, int64_t n_experts, float *y, int threads);
int hpipe_int8_mm_routed(const void *x, int x_bf16, int64_t m, int64_t k, const int8_t *w, int64_t stride,
                         const uint16_t *scales, int64_t sc_stride, int blocks_scaled, int64_t n,
                         const int64_t *ids, int64_t n_ids, int64_t n_experts, float *y, int threads);
int hpipe_attend_f16(const float *q, int64_t b, int64_t kvh, int64_t g, int64_t d, const uint16_t *k,
                     const uint16_t *v, int64_t b_stride, int64_t h_stride, int64_t pos_stride, int64_t n,
                     const uint8_t *mask, int64_t mask_rows, float scale, float *out, int threads);
}

namespace {

// float32 or bf16 rows, contiguous (as the kernels read them); anything else as float32
at::Tensor rows_of(const at::Tensor &x) {
    auto t = x.scalar_type();
    return (t == at::kFloat || t == at::kBFloat16 ? x : x.to(at::kFloat)).contiguous();
}

// how scales_zeros holds an int4 weight's scales (cpu_kernels.int4_form): uint8 super-blocks 2,
// (s, z) pairs 1, s alone 0
int int4_form(const at::Tensor &sz) {
    if (sz.scalar_type() == at::kByte) return 2;
    return sz.size(-1) == 2 ? 1 : 0;
}

at::Tensor int4_mm(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &scales_zeros, int64_t group) {
    auto a = rows_of(x);
    const int64_t m = a.size(0), k = a.size(1), n = scales_zeros.size(0) * 64;
    auto y = at::empty({m, n}, a.options().dtype(at::kFloat));
    TORCH_CHECK(!m || !hpipe_int4_mm(a.data_ptr(), a.scalar_type() == at::kBFloat16, m, k,
                                     static_cast<const uint8_t *>(packed.data_ptr()),
                                     static_cast<const uint8_t *>(scales_zeros.data_ptr()), int4_form(scales_zeros),
                                     n, group, y.data_ptr<float>(), at::get_num_threads()),
                "int4 kernel: no memory for ", m, " x ", k, " activations");
    return y;
}

at::Tensor int8_mm(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &scales) {
    auto a = rows_of(x);
    const int64_t m = a.size(0), k = a.size(1), n = weight.size(0);
    auto y = at::empty({m, n}, a.options().dtype(at::kFloat));
    TORCH_CHECK(!m || !hpipe_int8_mm(a.data_ptr(), a.scalar_type() == at::kBFloat16, m, k,
                                     static_cast<const int8_t *>(weight.data_ptr()),
                                     static_cast<const uint16_t *>(scales.data_ptr()), scales.dim() == 2, n,
                                     y.data_ptr<float>(), at::get_num_threads()),
                "int8 kernel: no memory for ", m, " x ", k, " activations");
    return y;
}

// a step's (row, slot) pairs' experts as experts.h reads them, each row of x with as many pairs
at::Tensor pairs_of(const at::Tensor &x, const at::Tensor &ids) {
    auto p = ids.reshape({-1}).to(at::kLong).contiguous();
    TORCH_CHECK(!x.size(0) || p.numel() % x.size(0) == 0, p.numel(), " routed pairs over ", x.size(0),
                " rows: each row must have as many");
    return p;
}

void routed_check(int rc, int64_t k, int64_t n_experts) {
    TORCH_CHECK_INDEX(rc != -2, "an expert id outside [0, ", n_experts, ")");
    TORCH_CHECK(rc == 0, "routed experts kernel: no memory for ", k, " activations");
}

at::Tensor int4_mm_experts(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &scales_zeros,
                           int64_t group, const at::Tensor &ids) {
    auto a = rows_of(x);
    auto p = pairs_of(a, ids);
    const int64_t m = a.size(0), k = a.size(1), n = scales_zeros.size(1) * 64, e = packed.size(0);
    auto y = at::empty({p.numel(), n}, a.options().dtype(at::kFloat));
    if (m && p.numel())
        routed_check(hpipe_int4_mm_routed(a.data_ptr(), a.scalar_type() == at::kBFloat16, m, k,
                                          static_cast<const uint8_t *>(packed.data_ptr()),
                                          packed.stride(0) * packed.element_size(),
                                          static_cast<const uint8_t *>(scales_zeros.data_ptr()),
                                          scales_zeros.stride(0) * scales_zeros.element_size(),
                                          int4_form(scales_zeros), n, group, p.data_ptr<int64_t>(), p.numel(), e,
                                          y.data_ptr<float>(), at::get_num_threads()), k, e);
    return y;
}

at::Tensor int8_mm_experts(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &scales,
                           const at::Tensor &ids) {
    auto a = rows_of(x);
    auto p = pairs_of(a, ids);
    const int64_t m = a.size(0), k = a.size(1), n = weight.size(1), e = weight.size(0);
    auto y = at::empty({p.numel(), n}, a.options().dtype(at::kFloat));
    if (m && p.numel())
        routed_check(hpipe_int8_mm_routed(a.data_ptr(), a.scalar_type() == at::kBFloat16, m, k,
                                          static_cast<const int8_t *>(weight.data_ptr()), weight.stride(0),
                                          static_cast<const uint16_t *>(scales.data_ptr()), scales.stride(0),
                                          scales.dim() == 3, n, p.data_ptr<int64_t>(), p.numel(), e,
                                          y.data_ptr<float>(), at::get_num_threads()), k, e);
    return y;
}

// one query row per sequence (or a sequence's rows as one group, each row's queries their row of the mask)
// against a float16 KV cache where it lies (attention.h; the Python twin is cpu_kernels.attend_f16,
// whose checks these are)
at::Tensor attend_f16(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                      const std::optional<at::Tensor> &mask, double scale) {
    const int64_t b = q.size(0), h = q.size(1), g = q.size(2), d = q.size(3), n = k.size(2);
    auto qc = q.to(at::kFloat).contiguous();
    TORCH_CHECK(k.scalar_type() == at::kHalf && v.scalar_type() == at::kHalf && k.strides() == v.strides() &&
                k.stride(3) == 1, "attention kernel: k and v must be float16 at the same strides, the last 1");
    TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == b && k.size(1) == h &&
                k.size(3) == d, "attention kernel: k ", k.sizes(), " and v ", v.sizes(), " do not match the query");
    at::Tensor m;
    int64_t rows = 1;                    // the mask's rows: one for the group, one a query, or one per `g / rows`
    if (mask.has_value()) {
        rows = mask->dim() == 4 ? mask->size(2) : 1;
        TORCH_CHECK(rows >= 1 && g % rows == 0, "attention kernel: a mask of ", rows, " rows for ", g,
                    " queries a KV head: its rows must divide them");
        m = mask->expand({b, 1, rows, n}).reshape({b, rows * n}).to(at::kByte).contiguous();
    }
    auto out = at::empty({b, h, g, d}, qc.options());
    const int rc = hpipe_attend_f16(qc.data_ptr<float>(), b, h, g, d, static_cast<const uint16_t *>(k.data_ptr()),
                                    static_cast<const uint16_t *>(v.data_ptr()), k.stride(0), k.stride(1),
                                    k.stride(2), n, m.defined() ? m.data_ptr<uint8_t>() : nullptr, rows,
                                    static_cast<float>(scale), out.data_ptr<float>(), at::get_num_threads());
    TORCH_CHECK(rc != -1, "attention kernel: no memory for ", b, " x ", h, " x ", n, " positions");
    TORCH_CHECK(rc == 0, "attention kernel: heads of size ", d, ": sizes a multiple of 8 up to 256");
    return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hpipe, CPU, m) {
    m.impl("int4_mm", int4_mm);
    m.impl("int8_mm", int8_mm);
    m.impl("int4_mm_experts", int4_mm_experts);
    m.impl("int8_mm_experts", int8_mm_experts);
    m.impl("attend_f16", attend_f16);
}
