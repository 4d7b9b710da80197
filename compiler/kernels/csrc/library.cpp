// Registers this level's ops as torch.ops.<QC_LIBRARY> (qcompile_cpu_avx2, qcompile_cpu_avx512, ...:
// one namespace per ISA level, so that a process can load several, e.g. to test each level the CPU
// runs; compiler/kernels/cpu_build.py passes the name). What each op computes:
// compiler/kernels/cpu_ext.py's docstring.
#include <torch/library.h>

#include <string>

#include "isa.h"
#include "ops.h"

#ifndef QC_LIBRARY
#error "build with -DQC_LIBRARY=qcompile_cpu_<level> (compiler/kernels/cpu_build.py does)"
#endif

namespace {
std::string isa() { return qcompile_cpu::isa_level(); }
}  // namespace

// TORCH_LIBRARY pastes its argument into names, which would not expand QC_LIBRARY: one more level of macro does.
#define QC_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define QC_TORCH_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

QC_TORCH_LIBRARY(QC_LIBRARY, m) {
  m.def("isa() -> str", &isa);
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor k_scale, Tensor v_scale, int window, float sm_scale) -> Tensor");
  m.def("fp8_fake_quant_rows(Tensor x, Tensor? shift, Tensor? static_scale, ScalarType dtype) -> (Tensor, Tensor)");
  m.def("fp8_linear(Tensor x, Tensor? shift, Tensor? static_scale, ScalarType dtype, Tensor weight, Tensor? bias, "
        "Tensor? packed) -> Tensor");
  m.def("fp8_linear_codes(Tensor x, Tensor? shift, Tensor? static_scale, ScalarType activation_dtype, Tensor packed, "
        "ScalarType weight_dtype, Tensor weight_scale, int out_features, Tensor? bias) -> Tensor");
  m.def("dense_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("int4_dense_linear(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int group_size, Tensor? bias) -> Tensor");
  m.def("w4a8_linear(Tensor x, Tensor packed, Tensor scales, Tensor zero_scales, int group_size, int out_features, "
        "Tensor? bias) -> Tensor");
  m.def("w8a8_linear(Tensor x, Tensor packed, Tensor weight_sums, Tensor weight_scale, int out_features, Tensor? bias, "
        "Tensor? input_scale, Tensor? input_zero_point, bool symmetric) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float weight_offset) -> Tensor");
  m.def("rope_qk(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor weight, int group_size, Tensor scales_and_zeros, int padded_in_features, "
        "Tensor? bias) -> Tensor");
}

QC_TORCH_LIBRARY_IMPL(QC_LIBRARY, CPU, m) {
  using namespace qcompile_cpu;
  m.impl("paged_decode", &paged_decode);
  m.impl("fp8_fake_quant_rows", &fp8_fake_quant_rows);
  m.impl("fp8_linear", &fp8_linear);
  m.impl("fp8_linear_codes", &fp8_linear_codes);
  m.impl("dense_linear", &dense_linear);
  m.impl("int4_dense_linear", &int4_dense_linear);
  m.impl("w4a8_linear", &w4a8_linear);
  m.impl("w8a8_linear", &w8a8_linear);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_qk", &rope_qk);
  m.impl("silu_mul", &silu_mul);
  m.impl("int4_linear", &int4_linear);
}
