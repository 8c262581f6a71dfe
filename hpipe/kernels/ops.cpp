// torch.ops.hpipe.int4_mm and int8_mm as C++ kernels of torch's dispatcher, calling vnni.c's
// functions (loaded beside it, their symbols global). A compiled decode step's C++ wrapper then
// calls them without Python: through the Python registration each call re-took the GIL and boxed
// its tensors into Python objects, ~4 us of a 5 us call at one row here, 40 calls in a SmolLM2
// stage's step. Same arithmetic, same kernels: `hpipe.cpu_kernels.int4_mm` is the Python twin.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

extern "C" {
int hpipe_int4_mm(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *packed, const uint8_t *sz,
                  int form, int64_t n, int64_t group, float *y, int threads);
int hpipe_int8_mm(const void *x, int x_bf16, int64_t m, int64_t k, const int8_t *w, const uint16_t *scales,
                  int blocks_scaled, int64_t n, float *y, int threads);
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

}  // namespace

TORCH_LIBRARY_IMPL(hpipe, CPU, m) {
    m.impl("int4_mm", int4_mm);
    m.impl("int8_mm", int8_mm);
}
