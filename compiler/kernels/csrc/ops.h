// The ops each kernel family defines, registered by library.cpp (schemas and what each computes:
// compiler/kernels/cpu_ext.py's docstring).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace qcompile_cpu {

using OptionalTensor = c10::optional<at::Tensor>;

// paged_decode.cpp
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& k_scale,
                        const at::Tensor& v_scale, int64_t window, double sm_scale);

// fp8.cpp
std::tuple<at::Tensor, at::Tensor> fp8_fake_quant_rows(const at::Tensor& x, const OptionalTensor& shift,
                                                       const OptionalTensor& static_scale, at::ScalarType dtype);
at::Tensor fp8_linear(const at::Tensor& x, const OptionalTensor& shift, const OptionalTensor& static_scale,
                      at::ScalarType dtype, const at::Tensor& weight, const OptionalTensor& bias,
                      const OptionalTensor& packed);
at::Tensor fp8_linear_codes(const at::Tensor& x, const OptionalTensor& shift, const OptionalTensor& static_scale,
                            at::ScalarType activation_dtype, const at::Tensor& packed, at::ScalarType weight_dtype,
                            const at::Tensor& weight_scale, int64_t out_features, const OptionalTensor& bias);

// dense.cpp
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, const OptionalTensor& bias);
at::Tensor int4_dense_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const at::Tensor& zeros, int64_t group_size, const OptionalTensor& bias);

// w4a8.cpp
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& zero_scales, int64_t group_size, int64_t out_features,
                       const OptionalTensor& bias);

// w8a8.cpp
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight_sums,
                       const at::Tensor& weight_scale, int64_t out_features, const OptionalTensor& bias,
                       const OptionalTensor& input_scale, const OptionalTensor& input_zero_point, bool symmetric);

// layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double weight_offset);
std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                           const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& weight, int64_t group_size,
                       const at::Tensor& scales_and_zeros, int64_t padded_in_features, const OptionalTensor& bias);

}  // namespace qcompile_cpu
