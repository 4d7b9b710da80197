// The decoder layer's small ops (compiler/model/layers.py), one op each instead of six to twelve
// torch ops: at a decode step's few tokens each torch op's dispatch costs more than its arithmetic,
// and a step runs these some two hundred times. float32 only; the callers run the torch code for
// anything else.
//
// rms_norm, rope_qk: `omp simd` loops, vectorised by the compiler at each level's width.
// silu_mul: torch's own exp at each level, so bit for bit torch's SwiGLU.
// int4_linear: Int4Linear's bfloat16 casts, padding, torch's INT4 kernel and bias in one call.
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/constant_pad_nd.h>

#include "common.h"
#include "ops.h"

namespace qcompile_cpu {

// RMSNorm over the last axis, as compiler.model.layers.RMSNorm (weight_offset 0: weight * (x * r))
// and GemmaRMSNorm (offset 1: (x * r) * (1 + weight)) compute it, r = 1 / sqrt(mean(x^2) + eps):
// the same float32 products in the same order, the sum of squares in another order (last bit of r).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double weight_offset) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm takes float32 x and weight");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.numel() == D, "weight must have x's last size");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const float *xp = xc.data_ptr<float>(), *w = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps), offset = static_cast<float>(weight_offset);
  at::parallel_for(0, xc.numel() / D, std::max<int64_t>(1, kRowGrain / D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * D;
      float* o = op + r * D;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < D; ++i) squares += xr[i] * xr[i];
      const float rs = 1.f / std::sqrt(squares / static_cast<float>(D) + e);
      if (offset == 0.f) {
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) o[i] = w[i] * (xr[i] * rs);
      } else {
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) o[i] = (xr[i] * rs) * (offset + w[i]);
      }
    }
  });
  return out;
}

// x [B, H, T, D] rotated by cos/sin [B, 1, T, D] (compiler.model.layers.apply_rope: x * cos +
// cat(-x2, x1) * sin, rotate-half), bit for bit: the same products and sum (the extension builds in
// ISO C++, so nothing is contracted into an FMA). Any strides with the last one 1; the result is laid
// out [B, T, H, D] (returned as its [B, H, T, D] view), as the projection wrote q and k.
namespace {

at::Tensor rope_one(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3), half = D / 2;
  at::Tensor out = at::empty({B, T, H, D}, x.options());
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * T * H, std::max<int64_t>(1, kRowGrain / D), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (T * H), t = (i / H) % T, h = i % H;
      const float* xr = xp + b * x.stride(0) + h * x.stride(1) + t * x.stride(2);
      const float* c = cp + b * cos.stride(0) + t * cos.stride(2);
      const float* s = sp + b * sin.stride(0) + t * sin.stride(2);
      float* o = op + i * D;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) o[d] = xr[d] * c[d] + (-xr[d + half]) * s[d];
#pragma omp simd
      for (int64_t d = half; d < D; ++d) o[d] = xr[d] * c[d] + xr[d - half] * s[d];
    }
  });
  return out.permute({0, 2, 1, 3});
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                           const at::Tensor& sin) {
  for (const at::Tensor* t : {&q, &k, &cos, &sin})
    TORCH_CHECK(t->dim() == 4 && t->scalar_type() == at::kFloat && t->stride(3) == 1,
                "rope_qk takes float32 [B, H, T, D] tensors whose last axis is contiguous");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(1) == 1 && cos.size(0) == q.size(0) && cos.size(2) == q.size(2) &&
              cos.size(3) == q.size(3) && k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.size(3) == q.size(3) &&
              q.size(3) % 2 == 0, "cos/sin must be [B, 1, T, D] for q [B, Hq, T, D] and k [B, Hk, T, D], D even");
  return {rope_one(q, cos, sin), rope_one(k, cos, sin)};
}

// torch's own exp (libtorch_cpu exports it): what Vectorized<float>::exp() runs on AVX-512 and on AVX2.
#if QC_AVX512
extern "C" __m512 Sleef_expf16_u10(__m512);
#else
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif

// SwiGLU's silu(gate) * up, [..., I] each (rows of any stride, the last axis contiguous) -> [..., I]:
// torch's vectorised silu, x / (1 + exp(-x)) with its own exp at this level's width, then the
// product, for every element (the tail of a row through masked lanes), so bit for bit
// F.silu(gate) * up wherever torch vectorises the whole row (I a multiple of 32 on AVX-512, of 16
// on AVX2, as in every model here); the fused gate_up and the separate projections
// (compiler/model/layers.py's MLP) take this same op, so they agree exactly.
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat && gate.sizes() == up.sizes() &&
              gate.dim() >= 1 && gate.stride(-1) == 1 && up.stride(-1) == 1,
              "silu_mul takes float32 gate and up of one shape whose last axis is contiguous");
  const int64_t I = gate.size(-1);
  const at::Tensor g2 = gate.reshape({-1, I}), u2 = up.reshape({-1, I});  // views where the rows allow
  const int64_t rows = g2.size(0);
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  const float *gp = g2.data_ptr<float>(), *upp = u2.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = rows > 1 ? g2.stride(0) : I, us = rows > 1 ? u2.stride(0) : I;
  at::parallel_for(0, rows, std::max<int64_t>(1, kRowGrain / std::max<int64_t>(I, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *g = gp + r * gs, *u = upp + r * us;
      float* o = op + r * I;
#if QC_AVX512
      const __m512 one = _mm512_set1_ps(1.f);
      for (int64_t i = 0; i < I; i += 16) {
        const __mmask16 m = I - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (I - i)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(m, g + i);
        const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
        const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, Sleef_expf16_u10(neg)));
        _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(m, u + i)));
      }
#else
      const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
      for (int64_t i = 0; i < I; i += 8) {
        const __m256i m = first_lanes(I - i);
        const __m256 x = _mm256_maskload_ps(g + i, m);
        const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_xor_ps(sign, x))));
        _mm256_maskstore_ps(o + i, m, _mm256_mul_ps(silu, _mm256_maskload_ps(u + i, m)));
      }
#endif
    }
  });
  return out;
}

// Int4Linear's CPU forward in one call (compiler/kernels/int4_cpu.py's int4_cpu_matmul, the same ops
// in the same order, so the same bits): x in bfloat16, zero-padded to the packed K, torch's INT4
// kernel, the result back in x's dtype plus the bias.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& weight, int64_t group_size,
                       const at::Tensor& scales_and_zeros, int64_t padded_in_features,
                       const OptionalTensor& bias) {
  const int64_t k = x.size(-1);
  TORCH_CHECK(k <= padded_in_features, "x's last size exceeds the packed in_features");
  at::Tensor a = x.reshape({-1, k}).to(at::kBFloat16, /*non_blocking=*/false, /*copy=*/false,
                                       at::MemoryFormat::Contiguous);
  if (k != padded_in_features) a = at::constant_pad_nd(a, {0, padded_in_features - k});
  at::Tensor y = at::_weight_int4pack_mm_for_cpu(a, weight, group_size, scales_and_zeros).to(x.scalar_type());
  if (bias) y.add_(bias->to(x.scalar_type()));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = y.size(-1);
  return y.view(shape);
}

}  // namespace qcompile_cpu
