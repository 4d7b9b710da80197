// Fp8Linear's CPU forward (compiler/formats/fp8.py):
//
// fp8_fake_quant_rows: the activation quantization in one pass, bit for bit the torch ops it
//   replaces (compiler/quant/fp8.py): x - shift, a per-row scale from the row's absolute maximum
//   (or a static one), the saturating cast to FP8, and back to float32 times the scale.
// fp8_linear: those activations times the dequantized float32 weight, plus the bias, in one call
//   (the same addmm / mm as the Python path, or given the weight packed, dense_linear on it: the
//   same bits), without the Python path's per-call work, which at one token costs more than the rounding.
// fp8_linear_codes: the forward on the FP8 codes themselves, never a float copy of the weight. An
//   FP8 value (E4M3 or E5M2) times another is exact in float32, so multiplying the activations'
//   codes by the weight's and applying both scales to the float32 sums differs from the dequantize
//   reference (which rounds each factor times its scale first) by float32 rounding only, ~1e-7
//   relative, never by a code. 1 byte read per weight where the float copy reads 4. Each output
//   depends on its own row only, so a token's result does not change with the batch it is in.
//     avx512_bf16: AVX512-BF16's dot product (vdpbf16ps: pairs of bfloat16 products added into
//       float32; FP8 values are exact in bfloat16), on the codes turned into bfloat16 by a lookup.
//     below it: the codes turned into float32 through float16 (F16C; isa.h's fp8_as_half), a panel
//       at a time times the activation codes by dense_tiles.h's float32 tiles, or for one row in
//       registers as they are read. The two levels differ by the order of their float32 roundings
//       (each within the bound above of the reference).
//   The weight is laid out once (compiler/kernels/cpu_ext.py, pack_fp8_codes) as uint8
//   [N/16, K/2, 16, 2]: for each block of 16 output channels and each pair of input channels, the
//   16 channels' two codes.
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include "dense_tiles.h"
#include "ops.h"

namespace qcompile_cpu {
namespace {

// An FP8 format's rounding: mantissa bits, smallest normal exponent, largest finite value.
struct Fp8Spec {
  int mantissa_bits;
  int min_normal_exp;
  float max;
};
constexpr Fp8Spec kE4m3Spec{3, -6, 448.f}, kE5m2Spec{2, -14, 57344.f};

// Saturating cast to FP8 and back: what quantize()'s clamp_ and .to(dtype), then .float(), do.
template <typename F8>
inline float round_trip(float v, float fp8_max) {
  v = std::min(std::max(v, -fp8_max), fp8_max);  // NaN stays NaN (both comparisons are false)
  return static_cast<float>(F8(v));
}

// round_trip for a vector, exactly (tests compare it with torch's cast on every rounding boundary):
// |v| clamped to the largest finite value, then rounded to nearest even at the format's precision —
// for a normal result by rounding the float32 bits to `mantissa_bits`, for a subnormal one by adding
// and subtracting 1.5 * 2^(23 + min_normal_exp - mantissa_bits), which makes the float32 addition
// round to the subnormal quantum; the sign put back, NaN kept.
#if QC_AVX512
inline __m512 round_trip_vec(__m512 v, const Fp8Spec& f) {
  const __m512i sign_bit = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512 a = _mm512_min_ps(_mm512_castsi512_ps(_mm512_andnot_si512(sign_bit, _mm512_castps_si512(v))),
                                 _mm512_set1_ps(f.max));
  const int drop = 23 - f.mantissa_bits;
  const __m512i bits = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, drop), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32((1 << (drop - 1)) - 1), odd));
  rounded = _mm512_and_si512(rounded, _mm512_set1_epi32(~((1 << drop) - 1)));
  const __m512 magic = _mm512_set1_ps(std::ldexp(1.5f, 23 + f.min_normal_exp - f.mantissa_bits));
  const __m512 sub = _mm512_sub_ps(_mm512_add_ps(a, magic), magic);
  const __mmask16 is_sub = _mm512_cmp_ps_mask(a, _mm512_set1_ps(std::ldexp(1.f, f.min_normal_exp)), _CMP_LT_OQ);
  __m512 r = _mm512_mask_mov_ps(_mm512_castsi512_ps(rounded), is_sub, sub);
  r = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r), _mm512_and_si512(_mm512_castps_si512(v), sign_bit)));
  return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v);  // NaN in, NaN out
}
#else
inline __m256 round_trip_vec(__m256 v, const Fp8Spec& f) {
  const __m256i sign_bit = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256 a = _mm256_min_ps(_mm256_castsi256_ps(_mm256_andnot_si256(sign_bit, _mm256_castps_si256(v))),
                                 _mm256_set1_ps(f.max));
  const int drop = 23 - f.mantissa_bits;
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, drop), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32((1 << (drop - 1)) - 1), odd));
  rounded = _mm256_and_si256(rounded, _mm256_set1_epi32(~((1 << drop) - 1)));
  const __m256 magic = _mm256_set1_ps(std::ldexp(1.5f, 23 + f.min_normal_exp - f.mantissa_bits));
  const __m256 sub = _mm256_sub_ps(_mm256_add_ps(a, magic), magic);
  const __m256 is_sub = _mm256_cmp_ps(a, _mm256_set1_ps(std::ldexp(1.f, f.min_normal_exp)), _CMP_LT_OQ);
  __m256 r = _mm256_blendv_ps(_mm256_castsi256_ps(rounded), sub, is_sub);
  r = _mm256_or_ps(r, _mm256_and_ps(v, _mm256_castsi256_ps(sign_bit)));
  return _mm256_blendv_ps(r, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));  // NaN in, NaN out
}
#endif

// A row as the FP8 rounding reads it (less the shift, written to `centred`) and its scale: the
// static one, or scale_from_amax's (amax / max).clamp(min=MIN_SCALE), NaN when the row holds a NaN.
inline std::pair<const float*, float> centred_row(const float* xr, const float* shift, const float* static_scale,
                                                  const Fp8Spec& spec, int64_t K, std::vector<float>& centred) {
  if (shift) {  // x.float() - input_shift, kept so that amax and the quotient read the same values
#pragma omp simd
    for (int64_t i = 0; i < K; ++i) centred[i] = xr[i] - shift[i];
    xr = centred.data();
  }
  if (static_scale) return {xr, *static_scale};
  const float s = row_amax(xr, K) / spec.max;
  return {xr, s < 1e-12f ? 1e-12f : s};
}

// Each row's FP8 values round_trip(x / s), times s where `rescale` (the fake-quantized activations),
// else as they are (the codes' values, for fp8_linear_codes), and the row's scale s.
template <typename F8>
void quantize_rows(const float* x, const float* shift, const float* static_scale, const Fp8Spec& spec, int64_t M,
                   int64_t K, bool rescale, float* out, float* scales) {
  at::parallel_for(0, M, std::max<int64_t>(1, kRowGrain / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    std::vector<float> centred(shift ? K : 0);
    for (int64_t r = begin; r < end; ++r) {
      const auto [xr, s] = centred_row(x + r * K, shift, static_scale, spec, K, centred);
      scales[r] = s;
      float* o = out + r * K;
      const Reg sv = reg_broadcast(s);
      int64_t i = 0;
      for (; i + kRegLanes <= K; i += kRegLanes) {
        const Reg q = round_trip_vec(reg_div(reg_load(xr + i), sv), spec);
        reg_store(o + i, rescale ? reg_mul(q, sv) : q);
      }
      for (; i < K; ++i) {
        const float q = round_trip<F8>(xr[i] / s, spec.max);
        o[i] = rescale ? q * s : q;
      }
    }
  });
}

void check_shift_and_scale(const OptionalTensor& shift, const OptionalTensor& static_scale, int64_t K) {
  if (shift) TORCH_CHECK(shift->scalar_type() == at::kFloat && shift->is_contiguous() && shift->numel() == K, "shift must be float32 [K]");
  if (static_scale) TORCH_CHECK(static_scale->scalar_type() == at::kFloat && static_scale->numel() == 1, "static_scale must be float32 [1]");
}

// quantize_rows for an FP8 dtype (dtype_name names the argument in the error).
void quantize_rows_as(at::ScalarType dtype, const char* dtype_name, const float* x, const OptionalTensor& shift,
                      const OptionalTensor& static_scale, int64_t M, int64_t K, bool rescale, float* out, float* scales) {
  const float* sp = shift ? shift->data_ptr<float>() : nullptr;
  const float* ssp = static_scale ? static_scale->data_ptr<float>() : nullptr;
  if (dtype == at::kFloat8_e4m3fn) {
    quantize_rows<c10::Float8_e4m3fn>(x, sp, ssp, kE4m3Spec, M, K, rescale, out, scales);
  } else {
    TORCH_CHECK(dtype == at::kFloat8_e5m2, dtype_name, " must be float8_e4m3fn or float8_e5m2");
    quantize_rows<c10::Float8_e5m2>(x, sp, ssp, kE5m2Spec, M, K, rescale, out, scales);
  }
}

#if QC_BF16
// The bfloat16 bits of an FP8 format's 128 magnitudes (codes 0..127; the sign bit is moved over).
struct Bf16Magnitudes {
  alignas(64) uint16_t bits[128];
  template <typename F8>
  static Bf16Magnitudes of() {
    Bf16Magnitudes t;
    for (int i = 0; i < 128; ++i) {
      const float f = static_cast<float>(F8(static_cast<uint8_t>(i), F8::from_bits()));
      uint32_t b;
      std::memcpy(&b, &f, 4);
      t.bits[i] = static_cast<uint16_t>(b >> 16);  // exact: 3 or 2 mantissa bits; NaN stays NaN
    }
    return t;
  }
};
const Bf16Magnitudes kE4m3Bf16 = Bf16Magnitudes::of<c10::Float8_e4m3fn>();
const Bf16Magnitudes kE5m2Bf16 = Bf16Magnitudes::of<c10::Float8_e5m2>();

struct CodeTable {
  __m512i t0, t1, t2, t3;  // magnitudes 0-31, 32-63, 64-95, 96-127
  explicit CodeTable(const Bf16Magnitudes& m)
      : t0(_mm512_loadu_si512(m.bits)), t1(_mm512_loadu_si512(m.bits + 32)),
        t2(_mm512_loadu_si512(m.bits + 64)), t3(_mm512_loadu_si512(m.bits + 96)) {}
};

// 32 FP8 codes -> their 32 bfloat16 values.
inline __m512i codes_to_bf16(const uint8_t* p, const CodeTable& t) {
  const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i low = _mm512_permutex2var_epi16(t.t0, c, t.t1), high = _mm512_permutex2var_epi16(t.t2, c, t.t3);
  const __m512i magnitude = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(c, _mm512_set1_epi16(0x40)), low, high);
  return _mm512_or_si512(magnitude, _mm512_slli_epi16(_mm512_and_si512(c, _mm512_set1_epi16(0x80)), 8));
}

// Rows of FP8 values (quantize_rows' codes, K_even apart, zeros past K) in bfloat16: exact.
void rows_to_bf16(const float* values, int64_t M, int64_t K, int64_t K_even, uint16_t* codes) {
  at::parallel_for(0, M, std::max<int64_t>(1, kRowGrain / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* v = values + r * K;
      uint16_t* q = codes + r * K_even;
      int64_t i = 0;
      for (; i + 16 <= K; i += 16) {
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(v + i));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), reinterpret_cast<const __m256i&>(b));
      }
      for (; i < K_even; ++i) {
        const __m128bh b = _mm_cvtneps_pbh(_mm_set1_ps(i < K ? v[i] : 0.f));
        q[i] = static_cast<uint16_t>(_mm_extract_epi16(reinterpret_cast<const __m128i&>(b), 0));
      }
    }
  });
}

struct CodesGemm {
  const uint16_t* x;  // [M, K_even] bfloat16 codes
  int64_t M, K_pairs;
  const float *x_scale, *w_scale, *bias;  // [M]; [N] or one; [N] or null
  bool per_tensor;
  float* y;  // [M, N]
  int64_t N;
};

// Rows [0, MB) of a tile of J blocks of 16 channels from n0: the sums over every pair, then the scales and bias.
template <int J, int MB>
void codes_tile(const CodesGemm& g, const uint16_t* panel, const uint16_t* x, const float* x_scale, float* y, int64_t n0) {
  __m512 acc[MB][J];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < J; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < g.K_pairs; ++p) {
    __m512bh w[J];
    for (int j = 0; j < J; ++j) w[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + (j * g.K_pairs + p) * 32));
    for (int m = 0; m < MB; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * 2 * g.K_pairs + 2 * p, 4);
      const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int j = 0; j < J; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, w[j]);
    }
  }
  for (int j = 0; j < J; ++j) {
    const int64_t n = n0 + 16 * j, count = std::min<int64_t>(16, g.N - n);
    const __mmask16 mask = Vec16::mask(count);
    const __m512 ws = g.per_tensor ? _mm512_set1_ps(*g.w_scale) : _mm512_maskz_loadu_ps(mask, g.w_scale + n);
    for (int m = 0; m < MB; ++m) {
      __m512 v = _mm512_mul_ps(_mm512_mul_ps(acc[m][j], _mm512_set1_ps(x_scale[m])), ws);
      if (g.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, g.bias + n));
      _mm512_mask_storeu_ps(y + m * g.N + n, mask, v);
    }
  }
}

// Every row, in tiles of 6 (6 x 4 accumulators fill 24 of the 32 vector registers) and the rest.
template <int J>
void codes_rows(const CodesGemm& g, const uint16_t* panel, int64_t n0) {
  using Tile = void (*)(const CodesGemm&, const uint16_t*, const uint16_t*, const float*, float*, int64_t);
  static constexpr Tile tiles[] = {nullptr, codes_tile<J, 1>, codes_tile<J, 2>, codes_tile<J, 3>, codes_tile<J, 4>,
                                   codes_tile<J, 5>, codes_tile<J, 6>};
  for (int64_t m = 0; m < g.M; m += 6)
    tiles[std::min<int64_t>(6, g.M - m)](g, panel, g.x + m * 2 * g.K_pairs, g.x_scale + m, g.y + m * g.N, n0);
}

// Each thread turns 64 channels' codes at a time into bfloat16 (a panel that stays in its cache)
// and runs every row against them.
void codes_gemm(const CodesGemm& g, const uint8_t* packed, int64_t n_blocks, const CodeTable& table) {
  using Rows = void (*)(const CodesGemm&, const uint16_t*, int64_t);
  static constexpr Rows rows[] = {nullptr, codes_rows<1>, codes_rows<2>, codes_rows<3>, codes_rows<4>};
  const int64_t groups = (n_blocks + 3) / 4, block = g.K_pairs * 32;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    uint16_t* panel = thread_scratch<uint16_t>(4 * block).data();
    for (int64_t group = begin; group < end; ++group) {
      const int64_t b0 = group * 4, J = std::min<int64_t>(4, n_blocks - b0);
      for (int64_t i = 0; i < J * block; i += 32) _mm512_storeu_si512(panel + i, codes_to_bf16(packed + b0 * block + i, table));
      rows[J](g, panel, b0 * 16);
    }
  });
}

void codes_linear(const DenseGemm& d, const float* values, const float* x_scale, const uint8_t* packed,
                  at::ScalarType weight_dtype, const float* w_scale, bool per_tensor, const float* bias) {
  const int64_t K_pairs = (d.K + 1) / 2;
  std::vector<uint16_t> codes(d.M * 2 * K_pairs);
  rows_to_bf16(values, d.M, d.K, 2 * K_pairs, codes.data());
  const CodesGemm g{codes.data(), d.M, K_pairs, x_scale, w_scale, bias, per_tensor, d.y, d.N};
  codes_gemm(g, packed, (d.N + 15) / 16, CodeTable(weight_dtype == at::kFloat8_e4m3fn ? kE4m3Bf16 : kE5m2Bf16));
}
#else
// The weights below AVX512-BF16 are float16 values of the codes (isa.h's fp8_as_half: for E4M3 the
// codes' values times 2^-8, which the row scale takes back, exactly), made float32 for FMAs.
const __m128i kSplitPairs = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);

// A pair's 32 codes (16 channels x 2 input channels) as float16: its even input channel's, its odd one's.
struct HalfPair {
  __m256i even, odd;
};
template <bool E4M3>
inline HalfPair pair_as_half(const uint8_t* codes) {
  const __m128i a = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)), kSplitPairs);
  const __m128i b = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16)), kSplitPairs);
  return {fp8_as_half<E4M3>(_mm_unpacklo_epi64(a, b)), fp8_as_half<E4M3>(_mm_unpackhi_epi64(a, b))};
}

// J blocks' codes [K_pairs, 16, 2] in dense_tiles.h's float32 panel layout [K, 16].
template <bool E4M3>
void codes_panel(const uint8_t* packed, int64_t b0, int J, int64_t K, float* panel) {
  const int64_t K_pairs = (K + 1) / 2;
  for (int j = 0; j < J; ++j) {
    const uint8_t* src = packed + (b0 + j) * K_pairs * 32;
    float* p = panel + j * K * 16;
    for (int64_t pair = 0; pair < K_pairs; ++pair) {
      const auto [even, odd] = pair_as_half<E4M3>(src + pair * 32);
      half_to_float(even).store(p + 2 * pair * 16);
      if (2 * pair + 1 < K) half_to_float(odd).store(p + (2 * pair + 1) * 16);
    }
  }
}

// The epilogue: y = (the sums times the row's scale) times the channel's, plus the bias.
struct CodesOut {
  const DenseGemm& g;
  const float *x_scale, *w_scale, *bias;
  bool per_tensor;
  float from_half;  // kFp8FromHalf: applied with the row's scale (a power of two: the same bits as on the codes)
  void operator()(int64_t m, int64_t n, int64_t count, Vec16 sums) const {
    const Vec16 ws = per_tensor ? Vec16::broadcast(*w_scale) : Vec16::load_first(w_scale + n, count);
    Vec16 v = (sums * Vec16::broadcast(x_scale[m] * from_half)) * ws;
    if (bias) v = v + Vec16::load_first(bias + n, count);
    v.store_first(g.y + m * g.N + n, count);
  }
};

// One row (a decode step's token) against J blocks from b0: each pair's codes made float32 in
// registers and multiplied at once, no panel (whose store and load cost a single row more than its
// arithmetic). The multiply-adds of the panel's tiles in the same order, so the same bits.
template <bool E4M3, int J>
void codes_row(const uint8_t* packed, const DenseGemm& g, int64_t b0, const CodesOut& out) {
  const int64_t K_pairs = (g.K + 1) / 2;
  Reg acc[J][kRegsPerBlock];
  for (int j = 0; j < J; ++j)
    for (int r = 0; r < kRegsPerBlock; ++r) acc[j][r] = reg_zero();
  const uint8_t* blocks = packed + b0 * K_pairs * 32;
  for (int64_t pair = 0; pair < K_pairs; ++pair) {
    const bool has_odd = 2 * pair + 1 < g.K;
    const Reg x_even = reg_broadcast(g.x[2 * pair]), x_odd = reg_broadcast(has_odd ? g.x[2 * pair + 1] : 0.f);
    for (int j = 0; j < J; ++j) {
      const auto [even, odd] = pair_as_half<E4M3>(blocks + (j * K_pairs + pair) * 32);
      Reg w[kRegsPerBlock];
      half_to_regs(even, w);
      for (int r = 0; r < kRegsPerBlock; ++r) acc[j][r] = reg_fmadd(x_even, w[r], acc[j][r]);
      if (has_odd) {
        half_to_regs(odd, w);
        for (int r = 0; r < kRegsPerBlock; ++r) acc[j][r] = reg_fmadd(x_odd, w[r], acc[j][r]);
      }
    }
  }
  for (int j = 0; j < J; ++j) {
    const int64_t n = (b0 + j) * 16;
    out(0, n, std::min<int64_t>(16, g.N - n), block_of(acc[j]));
  }
}

template <bool E4M3>
void codes_gemm(const DenseGemm& g, const uint8_t* packed, const CodesOut& out) {
  const int64_t n_blocks = (g.N + 15) / 16;
  if (g.M > 1) {
    return blocks_gemm(g, n_blocks, [&](int64_t b, int J, float* panel) {
      codes_panel<E4M3>(packed, b, J, g.K, panel);
      return static_cast<const float*>(panel);
    }, out);
  }
  using Row = void (*)(const uint8_t*, const DenseGemm&, int64_t, const CodesOut&);
  static constexpr Row rows[] = {nullptr, codes_row<E4M3, 1>, codes_row<E4M3, 2>, codes_row<E4M3, 3>};
  at::parallel_for(0, n_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b += kPanelBlocks) rows[std::min<int64_t>(kPanelBlocks, end - b)](packed, g, b, out);
  });
}

void codes_linear(const DenseGemm& d, const float* values, const float* x_scale, const uint8_t* packed,
                  at::ScalarType weight_dtype, const float* w_scale, bool per_tensor, const float* bias) {
  const DenseGemm g{values, d.M, d.K, d.y, d.N};
  if (weight_dtype == at::kFloat8_e4m3fn)
    codes_gemm<true>(g, packed, CodesOut{g, x_scale, w_scale, bias, per_tensor, kFp8FromHalf<true>});
  else
    codes_gemm<false>(g, packed, CodesOut{g, x_scale, w_scale, bias, per_tensor, kFp8FromHalf<false>});
}
#endif

}  // namespace

std::tuple<at::Tensor, at::Tensor> fp8_fake_quant_rows(const at::Tensor& x, const OptionalTensor& shift,
                                                       const OptionalTensor& static_scale, at::ScalarType dtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  check_shift_and_scale(shift, static_scale, K);
  at::Tensor out = at::empty_like(x);
  at::Tensor scales = static_scale ? static_scale->reshape({1}).clone() : at::empty({M}, x.options());
  std::vector<float> per_row(static_scale ? M : 0);
  float* scale_out = static_scale ? per_row.data() : scales.data_ptr<float>();
  quantize_rows_as(dtype, "dtype", x.data_ptr<float>(), shift, static_scale, M, K, true, out.data_ptr<float>(), scale_out);
  return {out, scales};
}

at::Tensor fp8_linear(const at::Tensor& x, const OptionalTensor& shift, const OptionalTensor& static_scale,
                      at::ScalarType dtype, const at::Tensor& weight, const OptionalTensor& bias,
                      const OptionalTensor& packed) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.size(1) == x.size(-1),
              "weight must be float32 [N, K] with K = x's last size");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == weight.size(0)), "bias must be float32 [N]");
  const at::Tensor a = std::get<0>(fp8_fake_quant_rows(x.reshape({-1, x.size(-1)}).contiguous(), shift, static_scale, dtype));
  at::Tensor y = packed ? dense_linear(a, *packed, weight.size(0), bias)
                        : bias ? at::addmm(*bias, a, weight.t()) : at::mm(a, weight.t());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = weight.size(0);
  return y.view(shape);
}

at::Tensor fp8_linear_codes(const at::Tensor& x, const OptionalTensor& shift, const OptionalTensor& static_scale,
                            at::ScalarType activation_dtype, const at::Tensor& packed, at::ScalarType weight_dtype,
                            const at::Tensor& weight_scale, int64_t out_features, const OptionalTensor& bias) {
  const int64_t K = x.size(-1), N = out_features, K_pairs = (K + 1) / 2, n_blocks = (N + 15) / 16;
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.size(0) == n_blocks &&
              packed.size(1) == K_pairs && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous(),
              "packed must be pack_fp8_codes' uint8 [ceil(N/16), ceil(K/2), 16, 2] for x's K and out_features");
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && (weight_scale.numel() == N || weight_scale.numel() == 1),
              "weight_scale must be float32 [N] or [1]");
  at::Tensor b;
  const float* bias_ptr = bias_data(bias, N, b);
  check_shift_and_scale(shift, static_scale, K);
  TORCH_CHECK(activation_dtype == at::kFloat8_e4m3fn || activation_dtype == at::kFloat8_e5m2,
              "activation_dtype must be float8_e4m3fn or float8_e5m2");
  TORCH_CHECK(weight_dtype == at::kFloat8_e4m3fn || weight_dtype == at::kFloat8_e5m2,
              "weight_dtype must be float8_e4m3fn or float8_e5m2");
  const at::Tensor ws = weight_scale.contiguous();
  return linear_rows(x, N, [&](const DenseGemm& d) {
    at::Tensor values = at::empty({d.M, K}, x.options());  // the activations' FP8 values, before their scale
    at::Tensor x_scale = at::empty({d.M}, x.options());
    quantize_rows_as(activation_dtype, "activation_dtype", d.x, shift, static_scale, d.M, K, false,
                     values.data_ptr<float>(), x_scale.data_ptr<float>());
    codes_linear(d, values.data_ptr<float>(), x_scale.data_ptr<float>(), packed.data_ptr<uint8_t>(), weight_dtype,
                 ws.data_ptr<float>(), ws.numel() == 1 && N != 1, bias_ptr);
  });
}

}  // namespace qcompile_cpu
