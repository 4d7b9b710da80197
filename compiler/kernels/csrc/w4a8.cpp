// w4a8_linear: INT4 weights times int8 activations (W4A8), the integer arithmetic of ONNX Runtime's
// MatMulNBits at accuracy_level 4 and of llama.cpp's Q4 x Q8 dot products. Each row's activations
// are quantized to int8 per group of the weight's K (symmetric, scale = the group's largest |a| / 127),
// the 4-bit codes are multiplied by them exactly in int32 over a group, and the float32 sums take
// both scales once a group: y = sum_g s_w s_a (sum q a_q - z sum a_q). compiler/kernels/w4a8_cpu.py
// packs the weight and says when the engine runs this (never without being asked: it rounds the
// activations).
//
// The integer dot products, four u8 x s8 products added into each 32-bit lane:
//   avx512_vnni and up  vpdpbusd, one instruction for 64 products;
//   avx512              vpmaddubsw (pairs into int16) then vpmaddwd by ones (pairs into int32);
//   avx2_vnni           AVX-VNNI's vpdpbusd on 8 channels at a time;
//   avx2                vpmaddubsw and vpmaddwd on 8 channels at a time, the int16 pairs summed over
//                       four steps before vpmaddwd (llama.cpp's AVX2 Q4_0 x Q8_0 dot product does so).
// The products are exact at every level (|q a| <= 15 x 127, an int16 pair <= 3810, four steps of
// two pairs <= 30480 < 2^15), and the float32 arithmetic after them is the same operations in the
// same order, so every level gives the same bits.
#include "dense_tiles.h"
#include "ops.h"

namespace qcompile_cpu {
namespace {

struct W4A8Gemm {
  const int8_t* qa;     // [M, Kp] the activations' int8 codes, zero past K
  const float* sa;      // [M, G] each row's scale for each group
  const float* sa_sum;  // [M, G] that scale times the group's sum of codes (what a zero point subtracts)
  int64_t M, Kp, G, group;
  const uint8_t* w;     // [NB, Kp / 8, 16, 4]: channel c's k0..k0+3 in the low nibbles, k0+4..k0+7 high
  const float* ws;      // [NB, G, 16] weight scales
  const float* wzs;     // [NB, G, 16] zero point times scale
  const float* bias;    // [N] or null
  float* y;             // [M, N]
  int64_t N;
};

// A row's 4 activation codes at a, broadcast to every 32-bit lane.
inline int32_t four_codes(const int8_t* a) {
  int32_t v;
  std::memcpy(&v, a, 4);
  return v;
}

#if QC_AVX512
constexpr int kW4A8Rows = 8;

inline __m512i dot4(__m512i acc, __m512i u8, __m512i s8) {
#if QC_VNNI
  return _mm512_dpbusd_epi32(acc, u8, s8);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u8, s8), _mm512_set1_epi16(1)));
#endif
}

// Rows m0..m0+MB-1 of block b (16 channels): MB int32 sums over a group, MB float32 sums over K, all
// in registers (one block: more would spill them, measured slower at 16 rows).
template <int MB>
void w4a8_tile(const W4A8Gemm& g, int64_t b, int64_t m0) {
  const int64_t K8 = g.Kp / 8, steps = g.group / 8;
  const uint8_t* w = g.w + b * K8 * 64;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 f[MB];
  for (int m = 0; m < MB; ++m) f[m] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < g.G; ++gi) {
    __m512i acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_si512();
    for (int64_t k8 = gi * steps; k8 < (gi + 1) * steps; ++k8) {
      const __m512i v = _mm512_loadu_si512(w + k8 * 64);
      const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      for (int m = 0; m < MB; ++m) {
        const int8_t* a = g.qa + (m0 + m) * g.Kp + k8 * 8;
        acc[m] = dot4(dot4(acc[m], lo, _mm512_set1_epi32(four_codes(a))), hi, _mm512_set1_epi32(four_codes(a + 4)));
      }
    }
    const __m512 s = _mm512_loadu_ps(g.ws + (b * g.G + gi) * 16), zs = _mm512_loadu_ps(g.wzs + (b * g.G + gi) * 16);
    for (int m = 0; m < MB; ++m) {
      const int64_t at = (m0 + m) * g.G + gi;
      f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), _mm512_mul_ps(s, _mm512_set1_ps(g.sa[at])), f[m]);
      f[m] = _mm512_fnmadd_ps(zs, _mm512_set1_ps(g.sa_sum[at]), f[m]);
    }
  }
  const int64_t n = b * 16, count = std::min<int64_t>(16, g.N - n);
  const __mmask16 mask = Vec16::mask(count);
  const __m512 bias = g.bias ? _mm512_maskz_loadu_ps(mask, g.bias + n) : _mm512_setzero_ps();
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(g.y + (m0 + m) * g.N + n, mask, _mm512_add_ps(f[m], bias));
}

template <int... MB>
void w4a8_rows_of(const W4A8Gemm& g, int64_t b, std::integer_sequence<int, MB...>) {
  using Tile = void (*)(const W4A8Gemm&, int64_t, int64_t);
  static constexpr Tile tiles[] = {nullptr, w4a8_tile<MB + 1>...};
  for (int64_t m = 0; m < g.M; m += kW4A8Rows) tiles[std::min<int64_t>(kW4A8Rows, g.M - m)](g, b, m);
}
#else
// 8 channels x MB rows: each row's int16 and int32 sums and its float32 sum fill 3 of the 16
// registers, beside the codes' two halves and the broadcast activations.
constexpr int kW4A8Rows = 4;

template <int MB>
void w4a8_tile(const W4A8Gemm& g, int64_t b, int half, int64_t m0) {
  const int64_t K8 = g.Kp / 8, steps = g.group / 8;
  const uint8_t* w = g.w + b * K8 * 64 + half * 32;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 f[MB];
  for (int m = 0; m < MB; ++m) f[m] = _mm256_setzero_ps();
  for (int64_t gi = 0; gi < g.G; ++gi) {
    __m256i acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_si256();
    const int64_t group_end = (gi + 1) * steps;
#if QC_AVX_VNNI
    for (int64_t k8 = gi * steps; k8 < group_end; ++k8) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k8 * 64));
      const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      for (int m = 0; m < MB; ++m) {
        const int8_t* a = g.qa + (m0 + m) * g.Kp + k8 * 8;
        acc[m] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc[m], lo, _mm256_set1_epi32(four_codes(a))), hi,
                                         _mm256_set1_epi32(four_codes(a + 4)));
      }
    }
    (void)ones;
#else
    for (int64_t k0 = gi * steps; k0 < group_end; k0 += 4) {  // int16 sums of up to four steps
      __m256i pairs[MB];
      for (int m = 0; m < MB; ++m) pairs[m] = _mm256_setzero_si256();
      for (int64_t k8 = k0; k8 < std::min(k0 + 4, group_end); ++k8) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k8 * 64));
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        for (int m = 0; m < MB; ++m) {
          const int8_t* a = g.qa + (m0 + m) * g.Kp + k8 * 8;
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(four_codes(a))),
                                             _mm256_maddubs_epi16(hi, _mm256_set1_epi32(four_codes(a + 4))));
          pairs[m] = _mm256_add_epi16(pairs[m], p);
        }
      }
      for (int m = 0; m < MB; ++m) acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(pairs[m], ones));
    }
#endif
    const float* scales = g.ws + (b * g.G + gi) * 16 + half * 8;
    const __m256 s = _mm256_loadu_ps(scales), zs = _mm256_loadu_ps(g.wzs + (b * g.G + gi) * 16 + half * 8);
    for (int m = 0; m < MB; ++m) {
      const int64_t at = (m0 + m) * g.G + gi;
      f[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_mul_ps(s, _mm256_set1_ps(g.sa[at])), f[m]);
      f[m] = _mm256_fnmadd_ps(zs, _mm256_set1_ps(g.sa_sum[at]), f[m]);
    }
  }
  const int64_t n = b * 16 + half * 8, count = std::min<int64_t>(8, g.N - n);
  if (count <= 0) return;
  const __m256i mask = first_lanes(count);
  const __m256 bias = g.bias ? _mm256_maskload_ps(g.bias + n, mask) : _mm256_setzero_ps();
  for (int m = 0; m < MB; ++m) _mm256_maskstore_ps(g.y + (m0 + m) * g.N + n, mask, _mm256_add_ps(f[m], bias));
}

template <int... MB>
void w4a8_rows_of(const W4A8Gemm& g, int64_t b, std::integer_sequence<int, MB...>) {
  using Tile = void (*)(const W4A8Gemm&, int64_t, int, int64_t);
  static constexpr Tile tiles[] = {nullptr, w4a8_tile<MB + 1>...};
  for (int half = 0; half < 2; ++half)
    for (int64_t m = 0; m < g.M; m += kW4A8Rows) tiles[std::min<int64_t>(kW4A8Rows, g.M - m)](g, b, half, m);
}
#endif

// One group of a row (len values, then zeros up to group) as int8 codes rounded to nearest (ties to
// even, as torch.round), its scale and scale x sum of codes. A group holding NaN or inf gets a NaN
// scale, so that the row's outputs are NaN, never a finite guess.
void quantize_group_int8(const float* x, int64_t len, int64_t group, int8_t* q, float* scale, float* scale_sum) {
  const float amax = len > 0 ? row_amax(x, len) : 0.f;
  std::memset(q, 0, group);
  if (!std::isfinite(amax)) {
    *scale = *scale_sum = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  if (amax == 0.f) {
    *scale = *scale_sum = 0.f;
    return;
  }
  const float inv = 127.f / amax;
  int64_t i = 0;
  int32_t sum = 0;
#if QC_AVX512
  __m512i sums = _mm512_setzero_si512();
  for (; i + 16 <= len; i += 16) {
    const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(inv)));
    sums = _mm512_add_epi32(sums, c);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(c));
  }
  sum = _mm512_reduce_add_epi32(sums);
#else
  __m256i sums = _mm256_setzero_si256();
  for (; i + 8 <= len; i += 8) {
    const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(inv)));
    sums = _mm256_add_epi32(sums, c);
    const __m128i c16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));  // |c| <= 127: no saturation
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(c16, c16));
  }
  sum = reduce_add8(sums);
#endif
  for (; i < len; ++i) {
    const int32_t c = static_cast<int32_t>(std::nearbyint(x[i] * inv));
    q[i] = static_cast<int8_t>(c);
    sum += c;
  }
  *scale = amax / 127.f;
  *scale_sum = *scale * static_cast<float>(sum);
}

}  // namespace

// x [..., K] float32 times a W4A8-packed INT4 weight (w4a8_cpu.pack_w4a8) of N outputs, plus the bias.
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& zero_scales, int64_t group_size, int64_t out_features,
                       const OptionalTensor& bias) {
  const int64_t K = x.size(-1), N = out_features, NB = (N + 15) / 16;
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0, "group_size must be a positive multiple of 8");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.size(0) == NB && packed.size(2) == 16 &&
              packed.size(3) == 4 && packed.is_contiguous() && (packed.size(1) * 8) % group_size == 0 &&
              K <= packed.size(1) * 8,
              "packed must be pack_w4a8's uint8 [ceil(N/16), K_pad/8, 16, 4] covering x's K");
  const int64_t Kp = packed.size(1) * 8, G = Kp / group_size;
  for (const at::Tensor* t : {&scales, &zero_scales})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == NB &&
                t->size(1) == G && t->size(2) == 16, "scales and zero_scales must be float32 [ceil(N/16), n_groups, 16]");
  at::Tensor b;
  const float* bias_ptr = bias_data(bias, N, b);
  return linear_rows(x, N, [&](const DenseGemm& d) {
    const int64_t M = d.M;
    at::Tensor qa = at::empty({M, Kp}, x.options().dtype(at::kChar));
    at::Tensor sa = at::empty({2, M, G}, x.options());  // the scales, then scale x sum of codes
    int8_t* qp = qa.data_ptr<int8_t>();
    float* sp = sa.data_ptr<float>();
    at::parallel_for(0, M * G, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / G, k0 = (i % G) * group_size;
        quantize_group_int8(d.x + r * K + k0, std::clamp<int64_t>(K - k0, 0, group_size), group_size,
                            qp + r * Kp + k0, sp + i, sp + M * G + i);
      }
    });
    const W4A8Gemm g{qp, sp, sp + M * G, M, Kp, G, group_size, packed.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                     zero_scales.data_ptr<float>(), bias_ptr, d.y, N};
    at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
      for (int64_t blk = begin; blk < end; ++blk) w4a8_rows_of(g, blk, std::make_integer_sequence<int, kW4A8Rows>());
    });
  });
}

}  // namespace qcompile_cpu
