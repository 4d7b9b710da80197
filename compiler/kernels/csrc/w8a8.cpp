// w8a8_linear: int8 weights times int8 activations (W8A8), compiler/quant/int8.py's numerics bit for
// bit. The weight's codes q_w [N, K] (symmetric, -127..127) are packed once (w8a8_cpu.pack_w8a8) in
// blocks of 16 output channels x 4 consecutive k, [ceil(N/16), ceil(K/4), 16, 4], K padded with zero
// codes, beside each channel's sum of codes (int32). Each call quantizes x's rows to int8 itself, in
// one of int8.py's three ways (dynamic symmetric or asymmetric per token: quantize_per_token; static
// per tensor: quantize_activations), the same float32 operations (x / s, not x times 1 / s; rounding
// half to even; the clamp; the empty-range rule), then
//
//   y[m, n] = float(acc[m, n] - zp[m] * sum_k q_w[n, k]) * (s_a[m] * s_w[n]) + b[n]
//
// as int8_gemm does it: the integer part in int32 (wrapping as torch's int32 tensors do, where a far
// zero point overflows it), the float32 part the same three roundings in the same order. A row
// holding NaN or inf gets a NaN scale, so its outputs are NaN (in the static mode too, where
// quantize_activations alone would clamp inf and cast NaN to an arbitrary code).
//
// The activations are stored as u8 = code + 128 (0..255), so that the integer sums are
//   acc'[m, n] = sum_k (q_a + 128) q_w = acc + 128 sum_k q_w[n, k],
// and the epilogue subtracts (zp[m] + 128) sum_k q_w[n, k]: the same int32 value as int8_gemm's
// acc - zp sum q_w (equal modulo 2^32, and both wrap modulo 2^32). The dot products:
//   avx512_vnni and up  vpdpbusd (u8 activations x s8 weights, 4 products into each int32 lane, no
//                       saturation), 16 channels per 512-bit register;
//   avx512              the weight's bytes sign-extended to int16 (even and odd k of each lane's
//                       four apart), the activations stored as int16 in the order (k0, k2, k1, k3),
//                       vpmaddwd: two int16 products into int32, exact (|255 x 127| x 2 < 2^31);
//   avx2_vnni           AVX-VNNI's vpdpbusd on 8 channels a register;
//   avx2                avx512's int16 way on 8 channels a register.
// vpmaddubsw (u8 x s8 pairs into int16, saturating) is not used: 255 x 127 x 2 overflows int16. Every
// product and sum is exact at every level and the float32 part is the same operations, so every
// level gives the same bits, equal to int8_gemm(*quantize_per_token(x), q_w, s_w, bias).
//
// As dense_linear's tiles: each thread takes a run of blocks, a few at a time, and every row against
// them in tiles whose int32 sums stay in registers over the whole of K; so the packed weight (1 byte a
// weight) is read from memory once per call, as one stream per block, whatever the number of rows.
#include "dense_tiles.h"
#include "ops.h"

namespace qcompile_cpu {
namespace {

#if QC_VNNI || QC_AVX_VNNI
using Act = uint8_t;  // code + 128, in k order: four of them a 32-bit lane for vpdpbusd
#else
using Act = int16_t;  // code + 128 as int16, each group of 4 k stored as k0, k2, k1, k3 (vpmaddwd's pairs)
#endif

struct W8A8Gemm {
  const Act* qa;          // [M, Kp]
  const float* sa;        // [M] each row's activation scale (NaN: a non-finite row)
  const int32_t* corr;    // [M] zero point + 128
  int64_t M, Kp;
  const int8_t* w;        // [NB, Kp / 4, 16, 4]
  const int32_t* wsum;    // [NB * 16] sum_k q_w per channel (0 past N)
  const float* ws;        // [N] weight scales
  const float* bias;      // [N] or null
  float* y;               // [M, N]
  int64_t N;
};

// The position of k's activation in a row's Act storage.
inline int64_t act_slot(int64_t k) {
#if QC_VNNI || QC_AVX_VNNI
  return k;
#else
  constexpr int64_t order[4] = {0, 2, 1, 3};
  return (k & ~int64_t{3}) + order[k & 3];
#endif
}

inline int32_t load32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// A row's codes: clamp(round(x / s) + zp, lo, hi) + 128 for k < K (zp = 0: symmetric), 128 (code 0)
// from K to Kp. torch's float32 operations: a true division, round half to even, the add, the clamp.
void quantize_row(const float* x, int64_t K, int64_t Kp, float s, float zp, float lo, float hi, Act* out) {
  int64_t k = 0;
#if QC_AVX512
  const __m512 S = _mm512_set1_ps(s), Z = _mm512_set1_ps(zp), LO = _mm512_set1_ps(lo), HI = _mm512_set1_ps(hi),
               OFF = _mm512_set1_ps(128.f);
  for (; k + 16 <= K; k += 16) {
    __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + k), S), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_add_ps(_mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, Z), LO), HI), OFF);
    __m512i c = _mm512_cvtps_epi32(v);  // an integer in 0..255: exact
#if QC_VNNI
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtepi32_epi8(c));
#else
    c = _mm512_shuffle_epi32(c, _MM_PERM_DBCA);  // k0, k2, k1, k3 in each group of four
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm512_cvtepi32_epi16(c));
#endif
  }
#else
  const __m256 S = _mm256_set1_ps(s), Z = _mm256_set1_ps(zp), LO = _mm256_set1_ps(lo), HI = _mm256_set1_ps(hi),
               OFF = _mm256_set1_ps(128.f);
  for (; k + 8 <= K; k += 8) {
    __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k), S), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_add_ps(_mm256_min_ps(_mm256_max_ps(_mm256_add_ps(v, Z), LO), HI), OFF);
    __m256i c = _mm256_cvtps_epi32(v);
#if QC_AVX_VNNI
    const __m128i c16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));  // 0..255: no saturation
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + k), _mm_packus_epi16(c16, c16));
#else
    c = _mm256_shuffle_epi32(c, 0xD8);  // k0, k2, k1, k3 in each group of four
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k),
                     _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)));
#endif
  }
#endif
  for (; k < K; ++k) {
    const float q = std::min(std::max(std::nearbyint(x[k] / s) + zp, lo), hi);
    out[act_slot(k)] = static_cast<Act>(static_cast<int32_t>(q) + 128);
  }
  for (; k < Kp; ++k) out[act_slot(k)] = 128;
}

void fill_row(int64_t Kp, int32_t code, Act* out) {
  std::fill(out, out + Kp, static_cast<Act>(code + 128));
}

// float -> int32 as torch's .to(torch.int32) does it on x86 (cvttss2si: out of range gives INT_MIN).
inline int32_t to_int32(float v) { return _mm_cvtt_ss2si(_mm_set_ss(v)); }

// The smallest and largest value of a row, and whether every value is finite.
bool row_min_max(const float* x, int64_t n, float& low, float& high) {
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
  bool bad = false;
  int64_t i = 0;
#if QC_AVX512
  __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
  __mmask16 nans = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vlo = _mm512_min_ps(vlo, v);
    vhi = _mm512_max_ps(vhi, v);
  }
  lo = _mm512_reduce_min_ps(vlo);
  hi = _mm512_reduce_max_ps(vhi);
  bad = nans != 0;
#else
  __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi), nans = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nans = _mm256_or_ps(nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vlo = _mm256_min_ps(vlo, v);
    vhi = _mm256_max_ps(vhi, v);
  }
  alignas(32) float l[8], h[8];
  _mm256_store_ps(l, vlo);
  _mm256_store_ps(h, vhi);
  for (int j = 0; j < 8; ++j) lo = std::min(lo, l[j]), hi = std::max(hi, h[j]);
  bad = _mm256_movemask_ps(nans) != 0;
#endif
  for (; i < n; ++i) {
    bad |= std::isnan(x[i]);
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  low = lo, high = hi;
  return !bad && std::isfinite(lo) && std::isfinite(hi);
}

// How a call quantizes its activations.
struct ActQuant {
  enum Mode { kSymmetric, kAsymmetric, kStatic } mode;
  float scale = 0.f;          // static
  int32_t zero_point = 0;     // static
  bool has_zero_point = false;
};

// Row m of x quantized into out: its scale and zero point + 128 (int8.py's rules, see above).
void quantize_activation_row(const ActQuant& aq, const float* x, int64_t K, int64_t Kp, Act* out, float* sa,
                             int32_t* corr) {
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  *corr = 128;
  if (aq.mode == ActQuant::kAsymmetric) {
    float low, high;
    if (!row_min_max(x, K, low, high)) {
      *sa = kNaN;
      return fill_row(Kp, 0, out);
    }
    if (high == low) low = std::min(low, 0.f), high = std::max(high, 0.f);  // an empty range takes 0 in
    const float s = (high - low) / 255.f;
    *sa = s;
    if (!(s > 0.f)) return fill_row(Kp, 0, out);
    const int32_t zp = to_int32(std::nearbyint(-128.f - low / s));
    *corr = static_cast<int32_t>(static_cast<uint32_t>(zp) + 128u);
    return quantize_row(x, K, Kp, s, static_cast<float>(zp), -128.f, 127.f, out);
  }
  const float amax = K > 0 ? row_amax(x, K) : 0.f;  // NaN with a NaN, inf with an inf
  if (!std::isfinite(amax)) {
    *sa = kNaN;
    return fill_row(Kp, 0, out);
  }
  if (aq.mode == ActQuant::kSymmetric) {
    const float s = amax / 127.f;
    *sa = s;
    if (!(s > 0.f)) return fill_row(Kp, 0, out);
    return quantize_row(x, K, Kp, s, 0.f, -127.f, 127.f, out);
  }
  const float s = aq.scale;
  const int32_t zp = aq.has_zero_point ? aq.zero_point : 0;
  *sa = s;
  *corr = static_cast<int32_t>(static_cast<uint32_t>(zp) + 128u);
  if (!(s > 0.f)) return fill_row(Kp, zp, out);  // quantize_activations' codes: the zero point (checked in -128..127)
  return quantize_row(x, K, Kp, s, static_cast<float>(zp), aq.has_zero_point ? -128.f : -127.f, 127.f, out);
}

// -- the integer tiles: J blocks of 16 channels x MB rows, the int32 sums in registers over all of K --

#if QC_AVX512
using IReg = __m512i;
constexpr int kIRegs = 1;  // registers a block's 16 sums take
inline IReg ireg_zero() { return _mm512_setzero_si512(); }
inline IReg ireg_load(const void* p) { return _mm512_loadu_si512(p); }
inline IReg ireg_set1(int32_t v) { return _mm512_set1_epi32(v); }
inline IReg ireg_add(IReg a, IReg b) { return _mm512_add_epi32(a, b); }
inline IReg ireg_sub(IReg a, IReg b) { return _mm512_sub_epi32(a, b); }
inline IReg ireg_mullo(IReg a, IReg b) { return _mm512_mullo_epi32(a, b); }
inline IReg ireg_madd16(IReg a, IReg b) { return _mm512_madd_epi16(a, b); }
inline IReg ireg_even16(IReg w) { return _mm512_srai_epi16(_mm512_slli_epi16(w, 8), 8); }  // bytes 0, 2 as int16
inline IReg ireg_odd16(IReg w) { return _mm512_srai_epi16(w, 8); }                          // bytes 1, 3 as int16
#if QC_VNNI
inline IReg ireg_dot4(IReg acc, IReg u8, IReg s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
// 12 sums, 3 weight vectors and a broadcast: GCC keeps 3 x 8 (28 of the 32 registers) partly on the
// stack, a store beside every dot product, measured 2x slower; 2 x 8, 3 x 6 spill a little.
constexpr int kW8A8Blocks = 3, kW8A8Rows = 4;
#else
constexpr int kW8A8Blocks = 2, kW8A8Rows = 4;  // 8 sums, 4 int16 weight vectors, 2 broadcasts, products
#endif
inline Vec16 block_floats(const IReg* r) { return {_mm512_cvtepi32_ps(r[0])}; }
#else
using IReg = __m256i;
constexpr int kIRegs = 2;
inline IReg ireg_zero() { return _mm256_setzero_si256(); }
inline IReg ireg_load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline IReg ireg_set1(int32_t v) { return _mm256_set1_epi32(v); }
inline IReg ireg_add(IReg a, IReg b) { return _mm256_add_epi32(a, b); }
inline IReg ireg_sub(IReg a, IReg b) { return _mm256_sub_epi32(a, b); }
inline IReg ireg_mullo(IReg a, IReg b) { return _mm256_mullo_epi32(a, b); }
inline IReg ireg_madd16(IReg a, IReg b) { return _mm256_madd_epi16(a, b); }
inline IReg ireg_even16(IReg w) { return _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8); }
inline IReg ireg_odd16(IReg w) { return _mm256_srai_epi16(w, 8); }
#if QC_AVX_VNNI
inline IReg ireg_dot4(IReg acc, IReg u8, IReg s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
constexpr int kW8A8Blocks = 1, kW8A8Rows = 4;  // 8 sums of 16 registers, 2 weight vectors, a broadcast
#else
constexpr int kW8A8Blocks = 1, kW8A8Rows = 3;  // 6 sums, 4 int16 weight vectors, 2 broadcasts, products
#endif
inline Vec16 block_floats(const IReg* r) { return {_mm256_cvtepi32_ps(r[0]), _mm256_cvtepi32_ps(r[1])}; }
#endif
constexpr int kILanes = 16 / kIRegs;

template <int J, int MB>
void w8a8_tile(const W8A8Gemm& g, int64_t b0, int64_t m0) {
  constexpr int R = J * kIRegs;
  const int64_t K4 = g.Kp / 4;
  const int8_t* w = g.w + b0 * K4 * 64;
  IReg acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = ireg_zero();
  const Act* a = g.qa + m0 * g.Kp;
  for (int64_t k4 = 0; k4 < K4; ++k4) {
#if QC_VNNI || QC_AVX_VNNI
    IReg wv[R];
    for (int r = 0; r < R; ++r) wv[r] = ireg_load(w + ((r / kIRegs) * K4 + k4) * 64 + (r % kIRegs) * kILanes * 4);
    for (int m = 0; m < MB; ++m) {
      const IReg u8 = ireg_set1(load32(a + m * g.Kp + k4 * 4));
      for (int r = 0; r < R; ++r) acc[m][r] = ireg_dot4(acc[m][r], u8, wv[r]);
    }
#else
    IReg even[R], odd[R];
    for (int r = 0; r < R; ++r) {
      const IReg v = ireg_load(w + ((r / kIRegs) * K4 + k4) * 64 + (r % kIRegs) * kILanes * 4);
      even[r] = ireg_even16(v);
      odd[r] = ireg_odd16(v);
    }
    for (int m = 0; m < MB; ++m) {
      const Act* row = a + m * g.Kp + k4 * 4;
      const IReg a02 = ireg_set1(load32(row)), a13 = ireg_set1(load32(row + 2));
      for (int r = 0; r < R; ++r)
        acc[m][r] = ireg_add(acc[m][r], ireg_add(ireg_madd16(even[r], a02), ireg_madd16(odd[r], a13)));
    }
#endif
  }
  // int8_gemm's epilogue: (acc - zp sum q_w) as float32, times (s_a s_w), plus the bias.
  for (int j = 0; j < J; ++j) {
    const int64_t n = (b0 + j) * 16, count = std::min<int64_t>(16, g.N - n);
    IReg wsum[kIRegs];
    for (int i = 0; i < kIRegs; ++i) wsum[i] = ireg_load(g.wsum + n + i * kILanes);
    const Vec16 ws = Vec16::load_first(g.ws + n, count);
    const Vec16 bias = g.bias ? Vec16::load_first(g.bias + n, count) : Vec16::zero();
    for (int m = 0; m < MB; ++m) {
      IReg exact[kIRegs];
      const IReg corr = ireg_set1(g.corr[m0 + m]);
      for (int i = 0; i < kIRegs; ++i) exact[i] = ireg_sub(acc[m][j * kIRegs + i], ireg_mullo(corr, wsum[i]));
      Vec16 y = block_floats(exact) * (Vec16::broadcast(g.sa[m0 + m]) * ws);
      if (g.bias) y = y + bias;
      y.store_first(g.y + (m0 + m) * g.N + n, count);
    }
  }
}

template <int J, int... MB>
void w8a8_rows_of(const W8A8Gemm& g, int64_t b0, std::integer_sequence<int, MB...>) {
  using Tile = void (*)(const W8A8Gemm&, int64_t, int64_t);
  static constexpr Tile tiles[] = {nullptr, w8a8_tile<J, MB + 1>...};
  for (int64_t m = 0; m < g.M; m += kW8A8Rows) tiles[std::min<int64_t>(kW8A8Rows, g.M - m)](g, b0, m);
}

// Every row against J blocks from b0, in tiles of kW8A8Rows rows (the blocks stay in the core's cache).
template <int J>
void w8a8_rows(const W8A8Gemm& g, int64_t b0) {
  w8a8_rows_of<J>(g, b0, std::make_integer_sequence<int, kW8A8Rows>());
}

template <int... J>
void w8a8_panel(const W8A8Gemm& g, int64_t b0, int blocks, std::integer_sequence<int, J...>) {
  using Rows = void (*)(const W8A8Gemm&, int64_t);
  static constexpr Rows rows[] = {nullptr, w8a8_rows<J + 1>...};
  rows[blocks](g, b0);
}

}  // namespace

// x [..., K] float32 times pack_w8a8's int8 weight of N outputs: activations quantized per token
// (input_scale absent: symmetric or not) or on the static input_scale [1] (and input_zero_point [1]).
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight_sums,
                       const at::Tensor& weight_scale, int64_t out_features, const OptionalTensor& bias,
                       const OptionalTensor& input_scale, const OptionalTensor& input_zero_point, bool symmetric) {
  const int64_t K = x.size(-1), N = out_features, NB = (N + 15) / 16, Kp = (K + 3) / 4 * 4;
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(0) == NB &&
              packed.size(1) == Kp / 4 && packed.size(2) == 16 && packed.size(3) == 4 && packed.is_contiguous(),
              "packed must be pack_w8a8's int8 [ceil(N/16), ceil(K/4), 16, 4] for x's K and out_features");
  TORCH_CHECK(weight_sums.scalar_type() == at::kInt && weight_sums.is_contiguous() && weight_sums.numel() == NB * 16,
              "weight_sums must be int32 [ceil(N/16) * 16]");
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous() && weight_scale.numel() == N,
              "weight_scale must be contiguous float32 [N]");
  ActQuant aq{symmetric ? ActQuant::kSymmetric : ActQuant::kAsymmetric};
  if (input_scale) {
    TORCH_CHECK(input_scale->scalar_type() == at::kFloat && input_scale->numel() == 1, "input_scale must be float32 [1]");
    aq.mode = ActQuant::kStatic;
    TORCH_CHECK(input_scale->device().is_cpu(), "input_scale must be a CPU tensor");
    aq.scale = *input_scale->data_ptr<float>();
    if (input_zero_point) {
      TORCH_CHECK(input_zero_point->scalar_type() == at::kInt && input_zero_point->numel() == 1,
                  "input_zero_point must be int32 [1]");
      aq.has_zero_point = true;
      TORCH_CHECK(input_zero_point->device().is_cpu(), "input_zero_point must be a CPU tensor");
      aq.zero_point = *input_zero_point->data_ptr<int32_t>();
    }
    TORCH_CHECK(aq.scale > 0.f || (aq.zero_point >= -128 && aq.zero_point <= 127),
                "a static input_scale that is not positive needs an input_zero_point in -128..127");
  } else {
    TORCH_CHECK(!input_zero_point, "input_zero_point needs input_scale (a static zero point)");
  }
  at::Tensor b;
  const float* bias_ptr = bias_data(bias, N, b);
  return linear_rows(x, N, [&](const DenseGemm& d) {
    const int64_t M = d.M;
    Act* qa = thread_scratch<Act>(M * Kp).data();  // the calling thread's: its workers only read it
    float* sa = thread_scratch<float>(M).data();
    int32_t* corr = thread_scratch<int32_t>(M).data();
    at::parallel_for(0, M, std::max<int64_t>(1, kRowGrain / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) quantize_activation_row(aq, d.x + r * K, K, Kp, qa + r * Kp, sa + r, corr + r);
    });
    const W8A8Gemm g{qa, sa, corr, M, Kp, packed.data_ptr<int8_t>(), weight_sums.data_ptr<int32_t>(),
                     weight_scale.data_ptr<float>(), bias_ptr, d.y, N};
    at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
      for (int64_t blk = begin; blk < end; blk += kW8A8Blocks)
        w8a8_panel(g, blk, static_cast<int>(std::min<int64_t>(kW8A8Blocks, end - blk)),
                   std::make_integer_sequence<int, kW8A8Blocks>());
    });
  });
}

}  // namespace qcompile_cpu
