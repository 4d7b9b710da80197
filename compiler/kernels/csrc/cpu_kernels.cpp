// qcompile's CPU kernels, registered as torch.ops.qcompile_cpu.* (loaded by compiler/kernels/cpu_ext.py).
//
// paged_decode: one query token per sequence over its paged K/V, read in place (float32, bfloat16,
//   float16 or FP8 E4M3 with per-KV-head scales), with grouped-query heads and a sliding window.
//   The contract of serving/paged_attention.py's paged_decode_reference, which gathers every
//   sequence's blocks into a buffer (and dequantizes an FP8 cache there) before torch's SDPA; this
//   kernel reads each cached row once, where it lies, and needs no copy.
// fp8_fake_quant_rows: Fp8Linear's activation quantization for the CPU in one pass, bit for bit
//   the torch ops it replaces (compiler/quant/fp8.py): x - shift, a per-row scale from the row's
//   absolute maximum (or a static one), the saturating cast to FP8, and back to float32 times the
//   scale — the activations that float_weight_gemm multiplies by the dequantized weight.
// fp8_linear: those activations times the dequantized weight, plus the bias, in one call; given
//   the weight packed (dense_cpu.pack_weight), through the packed linear dense_cpu.dense calls.
// dense_linear: a float32 linear layer on its weight packed once in blocks of 16 output channels,
//   the sums of each tile in registers over the whole of K (where the CPU has AVX-512);
//   int4_dense_linear: an INT4 layer's prefill, its weights dequantized into such blocks as it goes.
// w4a8_linear: an INT4 layer on int8 activations (W4A8), integer dot products (AVX512-VNNI).
//
// rms_norm, rope_qk, silu_mul: the decoder layer's RMSNorm, rotary embedding and SwiGLU, one op each
//   (compiler/model/layers.py); int4_linear: Int4Linear's bfloat16 casts, padding, torch's INT4 kernel
//   and bias in one call. At a decode step's few tokens each torch op's dispatch costs more than its
//   arithmetic, and a step runs these some two hundred times.
//
// Built with -fopenmp (compiler/kernels/cpu_ext.py): at::parallel_for is OpenMP, and the `omp simd`
// loops vectorise without -ffast-math (which would change the FP8 rounding and NaN handling this
// file must keep exact).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// Each FP8 E4M3 code's value, so that a cached row dequantizes by table lookup, not bit twiddling.
struct E4m3Table {
  float value[256];
  E4m3Table() {
    for (int i = 0; i < 256; ++i) value[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  }
};
const E4m3Table kE4m3;

// A cached row of D values in float32 times its scale; a float32 row with no scale is read where it lies.
template <typename T>
inline const float* load_row(const T* src, float scale, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
  return dst;
}

inline const float* load_row(const float* src, float scale, float* dst, int64_t n) {
  if (scale == 1.f) return src;
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * scale;
  return dst;
}

inline const float* load_row(const c10::Float8_e4m3fn* src, float scale, float* dst, int64_t n) {
  const uint8_t* bits = reinterpret_cast<const uint8_t*>(src);
  int64_t i = 0;
#if defined(__AVX512F__)
  // 16 codes at a time, exactly: a normal code's exponent rebiased (7 -> 127) in place, a
  // subnormal's mantissa times 2^-9, the sign put back, NaN (|code| = 0x7f) kept.
  const __m512i low7 = _mm512_set1_epi32(0x7f), rebias = _mm512_set1_epi32(120 << 23);
  const __m512 scales = _mm512_set1_ps(scale), subnormal_unit = _mm512_set1_ps(1.f / 512.f);
  for (; i + 16 <= n; i += 16) {
    const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i)));
    const __m512i mag = _mm512_and_si512(code, low7);
    __m512 v = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), rebias));
    v = _mm512_mask_mul_ps(v, _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), _mm512_cvtepi32_ps(mag), subnormal_unit);
    v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(mag, low7), _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(code, _mm512_set1_epi32(0x80)), 24);
    v = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(v, scales));
  }
#endif
  for (; i < n; ++i) dst[i] = kE4m3.value[bits[i]] * scale;
  return dst;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

#if defined(__AVX512F__)
// exp(x) = 2^n * 2^f with n = round(x log2 e) and |f| <= 1/2; 2^f = e^(f ln 2) by its Taylor
// series to degree 7 (truncation below 1e-8); _mm512_scalef_ps applies 2^n, -inf giving 0 and NaN staying NaN.
inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  for (float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}
#endif

// s[i] = exp(s[i] - m); returns their sum.
inline float exp_shifted(float* s, int64_t n, float m) {
  float sum = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(m)));
    _mm512_storeu_ps(s + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - m));
  return sum;
}

// Where a sequence's cached tokens lie, and how they are read.
template <typename T>
struct SeqCache {
  const T* k;
  const T* v;
  const int64_t* table;  // the sequence's block ids
  int64_t first, n;      // its keys are positions [first, first + n)
  int64_t block_size, token_stride;  // token_stride = Hkv * D

  // Calls f(t0, count, row of position first + t0) for each run of `count` positions that lie in
  // one block, one after another (`token_stride` apart), so the cache is read as a stream.
  template <typename F>
  void each_run(const T* cache, F&& f) const {
    for (int64_t t = 0; t < n;) {
      const int64_t pos = first + t, offset = pos % block_size;
      const int64_t count = std::min(block_size - offset, n - t);
      f(t, count, cache + (table[pos / block_size] * block_size + offset) * token_stride);
      t += count;
    }
  }
};

// `count` rows of one KV head (`stride` apart in the cache) as float32 times the scale: in place
// for an unscaled float32 cache, else converted into `buffer` (rows D apart). Returns the rows and their stride.
template <typename T>
inline std::pair<const float*, int64_t> head_rows(const T* rows, int64_t count, int64_t stride, float scale,
                                                  int64_t D, std::vector<float>& buffer) {
  if constexpr (std::is_same_v<T, float>) {
    if (scale == 1.f) return {rows, stride};
  }
  buffer.resize(count * D);
  for (int64_t t = 0; t < count; ++t) load_row(rows + t * stride, scale, buffer.data() + t * D, D);
  return {buffer.data(), D};
}

// scores[g * n + t0 + t] = q_g . k_t * sm_scale for the G query heads of one KV head. G is a
// template argument so that each head's partial sums stay in registers.
template <int G>
void block_scores(const float* q, const float* k, int64_t k_stride, int64_t count, int64_t D, float sm_scale,
                  float* scores, int64_t n, int64_t t0) {
  int64_t t = 0;
#if defined(__AVX512F__)
  // Four keys at a time: G x 4 independent sums in registers instead of one dependent chain per dot.
  constexpr int T = G <= 6 ? 4 : 2;
  for (; t + T <= count; t += T, k += T * k_stride) {
    __m512 acc[G][T];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < T; ++i) acc[g][i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      __m512 kv[T];
      for (int i = 0; i < T; ++i) kv[i] = _mm512_loadu_ps(k + i * k_stride + d);
      for (int g = 0; g < G; ++g) {
        const __m512 qv = _mm512_loadu_ps(q + g * D + d);
        for (int i = 0; i < T; ++i) acc[g][i] = _mm512_fmadd_ps(qv, kv[i], acc[g][i]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < T; ++i) scores[g * n + t0 + t + i] = _mm512_reduce_add_ps(acc[g][i]) * sm_scale;
  }
#endif
  for (; t < count; ++t, k += k_stride) {
    float acc[G] = {};
    for (int g = 0; g < G; ++g) acc[g] = dot(q + g * D, k, D);
    for (int g = 0; g < G; ++g) scores[g * n + t0 + t] = acc[g] * sm_scale;
  }
}

// out[g] += sum_t p[g * n + t0 + t] * v_t for the G query heads of one KV head, 64 columns at a
// time so that the G x 64 accumulators stay in registers across the block's rows (D % 64 == 0).
template <int G>
void block_values(const float* p, int64_t n, int64_t t0, const float* v, int64_t v_stride, int64_t count, int64_t D,
                  float* out) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    float acc[G][64];
    for (int g = 0; g < G; ++g)
#pragma omp simd
      for (int j = 0; j < 64; ++j) acc[g][j] = out[g * D + d0 + j];
    for (int64_t t = 0; t < count; ++t) {
      const float* row = v + t * v_stride + d0;
      for (int g = 0; g < G; ++g) {
        const float w = p[g * n + t0 + t];
#pragma omp simd
        for (int j = 0; j < 64; ++j) acc[g][j] += w * row[j];
      }
    }
    for (int g = 0; g < G; ++g)
#pragma omp simd
      for (int j = 0; j < 64; ++j) out[g * D + d0 + j] = acc[g][j];
  }
}

// The same for any G and D (the register-blocked versions above cover G <= 8 with D % 64 == 0).
inline void block_values_any(const float* p, int64_t n, int64_t t0, const float* v, int64_t v_stride, int64_t count,
                             int64_t G, int64_t D, float* out) {
  for (int64_t t = 0; t < count; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const float w = p[g * n + t0 + t];
      const float* row = v + t * v_stride;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) out[g * D + d] += w * row[d];
    }
}

inline void block_scores_any(const float* q, const float* k, int64_t k_stride, int64_t count, int64_t G, int64_t D,
                             float sm_scale, float* scores, int64_t n, int64_t t0) {
  for (int64_t t = 0; t < count; ++t, k += k_stride)
    for (int64_t g = 0; g < G; ++g) scores[g * n + t0 + t] = dot(q + g * D, k, D) * sm_scale;
}

template <int G>
struct Blocked {
  static void scores(const float* q, const float* k, int64_t ks, int64_t count, int64_t, int64_t D, float sm,
                     float* s, int64_t n, int64_t t0) { block_scores<G>(q, k, ks, count, D, sm, s, n, t0); }
  static void values(const float* p, int64_t n, int64_t t0, const float* v, int64_t vs, int64_t count, int64_t,
                     int64_t D, float* out) { block_values<G>(p, n, t0, v, vs, count, D, out); }
};

struct AnyG {
  static void scores(const float* q, const float* k, int64_t ks, int64_t count, int64_t G, int64_t D, float sm,
                     float* s, int64_t n, int64_t t0) { block_scores_any(q, k, ks, count, G, D, sm, s, n, t0); }
  static void values(const float* p, int64_t n, int64_t t0, const float* v, int64_t vs, int64_t count, int64_t G,
                     int64_t D, float* out) { block_values_any(p, n, t0, v, vs, count, G, D, out); }
};

// One sequence: every query head (head h reads KV head h / G) over its keys; one K and one V
// scale per KV head. Kernels: Blocked<G> or AnyG.
template <typename Kernels, typename T>
void decode_sequence(const float* q, const SeqCache<T>& seq, const float* k_scales, const float* v_scales,
                     float sm_scale, int64_t Hkv, int64_t G, int64_t D, float* out,
                     std::vector<float>& scores, std::vector<float>& buffer) {
  const int64_t n = seq.n, Hq = Hkv * G, stride = seq.token_stride;
  scores.resize(Hq * n);
  seq.each_run(seq.k, [&](int64_t t0, int64_t count, const T* rows) {
    for (int64_t h = 0; h < Hkv; ++h) {
      auto [k, k_stride] = head_rows(rows + h * D, count, stride, k_scales[h], D, buffer);
      Kernels::scores(q + h * G * D, k, k_stride, count, G, D, sm_scale, scores.data() + h * G * n, n, t0);
    }
  });
  for (int64_t head = 0; head < Hq; ++head) {  // softmax of each query head's scores, in place
    float* s = scores.data() + head * n;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) m = std::isnan(s[t]) || s[t] > m ? s[t] : m;  // NaN wins, as in torch
    const float inv = 1.f / exp_shifted(s, n, m);
    for (int64_t t = 0; t < n; ++t) s[t] *= inv;
  }
  std::fill(out, out + Hq * D, 0.f);
  seq.each_run(seq.v, [&](int64_t t0, int64_t count, const T* rows) {
    for (int64_t h = 0; h < Hkv; ++h) {
      auto [v, v_stride] = head_rows(rows + h * D, count, stride, v_scales[h], D, buffer);
      Kernels::values(scores.data() + h * G * n, n, t0, v, v_stride, count, G, D, out + h * G * D);
    }
  });
}

// decode_sequence with the register-blocked kernels for this G and D where there are some.
template <typename T>
void decode_sequence_for(int64_t G, int64_t D, const float* q, const SeqCache<T>& seq, const float* ks,
                         const float* vs, float sm, int64_t Hkv, float* out, std::vector<float>& scores,
                         std::vector<float>& buffer) {
  if (D % 64 == 0) {
    switch (G) {
      case 1: return decode_sequence<Blocked<1>>(q, seq, ks, vs, sm, Hkv, G, D, out, scores, buffer);
      case 2: return decode_sequence<Blocked<2>>(q, seq, ks, vs, sm, Hkv, G, D, out, scores, buffer);
      case 3: return decode_sequence<Blocked<3>>(q, seq, ks, vs, sm, Hkv, G, D, out, scores, buffer);
      case 4: return decode_sequence<Blocked<4>>(q, seq, ks, vs, sm, Hkv, G, D, out, scores, buffer);
      case 5: return decode_sequence<Blocked<5>>(q, seq, ks, vs, sm, Hkv, G, D, out, scores, buffer);
      case 6: return decode_sequence<Blocked<6>>(q, seq, ks, vs, sm, Hkv, G, D, out, scores, buffer);
      case 7: return decode_sequence<Blocked<7>>(q, seq, ks, vs, sm, Hkv, G, D, out, scores, buffer);
      case 8: return decode_sequence<Blocked<8>>(q, seq, ks, vs, sm, Hkv, G, D, out, scores, buffer);
      default: break;
    }
  }
  decode_sequence<AnyG>(q, seq, ks, vs, sm, Hkv, G, D, out, scores, buffer);
}

template <typename T>
void decode_all(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                const at::Tensor& seq_lens, const at::Tensor& k_scale, const at::Tensor& v_scale, int64_t window,
                double sm_scale, at::Tensor& out) {
  const int64_t S = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2), G = Hq / Hkv, M = tables.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  // per-tensor scales are expanded to one per KV head, so the loops index them alike
  at::Tensor ks = k_scale.expand({Hkv}).contiguous(), vs = v_scale.expand({Hkv}).contiguous();
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, buffer;
    for (int64_t s = begin; s < end; ++s) {
      const int64_t first = window > 0 ? std::max<int64_t>(lens[s] - window, 0) : 0;
      const SeqCache<T> seq{k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), tables.data_ptr<int64_t>() + s * M, first,
                            lens[s] - first, block_size, Hkv * D};
      decode_sequence_for<T>(G, D, q.data_ptr<float>() + s * Hq * D, seq, ks.data_ptr<float>(), vs.data_ptr<float>(),
                             static_cast<float>(sm_scale), Hkv, out.data_ptr<float>() + s * Hq * D, scores, buffer);
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& k_scale,
                        const at::Tensor& v_scale, int64_t window, double sm_scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous float32 [S, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type()
              && k_cache.is_contiguous() && v_cache.is_contiguous(), "K and V caches must be contiguous [N, bs, Hkv, D] of one dtype");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "head sizes of q and the cache disagree");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && block_tables.scalar_type() == at::kLong
              && block_tables.is_contiguous(), "block_tables must be contiguous int64 [S, M]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0) && seq_lens.scalar_type() == at::kLong
              && seq_lens.is_contiguous(), "seq_lens must be contiguous int64 [S]");
  const int64_t Hkv = k_cache.size(2);
  for (const at::Tensor* s : {&k_scale, &v_scale})
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && (s->numel() == 1 || s->numel() == Hkv),
                "K/V scales must be contiguous float32 with 1 or Hkv values");
  const int64_t capacity = block_tables.size(1) * k_cache.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t s = 0; s < q.size(0); ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= capacity, "seq_lens[", s, "] = ", lens[s], " is outside [1, ", capacity, "]");
    for (int64_t j = 0; j < (lens[s] + k_cache.size(1) - 1) / k_cache.size(1); ++j)
      TORCH_CHECK(tables[s * block_tables.size(1) + j] >= 0 && tables[s * block_tables.size(1) + j] < k_cache.size(0),
                  "block table entry out of range");
  }
  at::Tensor out = at::empty_like(q);
  switch (k_cache.scalar_type()) {
    case at::kFloat: decode_all<float>(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, window, sm_scale, out); break;
    case at::kBFloat16: decode_all<at::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, window, sm_scale, out); break;
    case at::kHalf: decode_all<at::Half>(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, window, sm_scale, out); break;
    case at::kFloat8_e4m3fn: decode_all<c10::Float8_e4m3fn>(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, window, sm_scale, out); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported cache dtype ", k_cache.scalar_type());
  }
  return out;
}

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

#if defined(__AVX512F__)
// round_trip for 16 values, exactly (tests compare it with torch's cast on every rounding
// boundary): |v| clamped to the largest finite value, then rounded to nearest even at the
// format's precision — for a normal result by rounding the float32 bits to `mantissa_bits`, for a
// subnormal one by adding and subtracting 1.5 * 2^(23 + min_normal_exp - mantissa_bits), which makes
// the float32 addition round to the subnormal quantum; the sign put back, NaN kept.
inline __m512 round_trip16(__m512 v, const Fp8Spec& f) {
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
#endif

// |x| of a row's largest value, or NaN when the row holds one (torch's amax propagates NaN).
inline float row_amax(const float* x, int64_t n) {
  float amax = 0.f;
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  __mmask16 nans = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    acc = _mm512_max_ps(acc, _mm512_abs_ps(v));
  }
  amax = _mm512_reduce_max_ps(acc);
  nan = nans != 0;
#endif
  for (; i < n; ++i) {
    const float a = std::fabs(x[i]);
    nan |= std::isnan(a);
    amax = a > amax ? a : amax;
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : amax;
}

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

template <typename F8>
void fake_quant_rows(const float* x, const float* shift, const float* static_scale, const Fp8Spec& spec, int64_t M,
                     int64_t K, float* out, float* scales) {
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> centred(shift ? K : 0);
    for (int64_t r = begin; r < end; ++r) {
      const auto [xr, s] = centred_row(x + r * K, shift, static_scale, spec, K, centred);
      scales[r] = s;
      float* o = out + r * K;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 sv = _mm512_set1_ps(s);
      for (; i + 16 <= K; i += 16)
        _mm512_storeu_ps(o + i, _mm512_mul_ps(round_trip16(_mm512_div_ps(_mm512_loadu_ps(xr + i), sv), spec), sv));
#endif
      for (; i < K; ++i) o[i] = round_trip<F8>(xr[i] / s, spec.max) * s;
    }
  });
}

std::tuple<at::Tensor, at::Tensor> fp8_fake_quant_rows(const at::Tensor& x, const c10::optional<at::Tensor>& shift,
                                                       const c10::optional<at::Tensor>& static_scale,
                                                       at::ScalarType dtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  if (shift) TORCH_CHECK(shift->scalar_type() == at::kFloat && shift->is_contiguous() && shift->numel() == K, "shift must be float32 [K]");
  if (static_scale) TORCH_CHECK(static_scale->scalar_type() == at::kFloat && static_scale->numel() == 1, "static_scale must be float32 [1]");
  at::Tensor out = at::empty_like(x);
  at::Tensor scales = static_scale ? static_scale->reshape({1}).clone() : at::empty({M}, x.options());
  std::vector<float> per_row(static_scale ? M : 0);
  float* scale_out = static_scale ? per_row.data() : scales.data_ptr<float>();
  const float* sp = shift ? shift->data_ptr<float>() : nullptr;
  const float* ssp = static_scale ? static_scale->data_ptr<float>() : nullptr;
  if (dtype == at::kFloat8_e4m3fn) {
    fake_quant_rows<c10::Float8_e4m3fn>(x.data_ptr<float>(), sp, ssp, kE4m3Spec, M, K, out.data_ptr<float>(), scale_out);
  } else {
    TORCH_CHECK(dtype == at::kFloat8_e5m2, "dtype must be float8_e4m3fn or float8_e5m2");
    fake_quant_rows<c10::Float8_e5m2>(x.data_ptr<float>(), sp, ssp, kE5m2Spec, M, K, out.data_ptr<float>(), scale_out);
  }
  return {out, scales};
}

// torch.ops.mkldnn._linear_pointwise(a, packed, bias, "none", [], None): a times a weight in
// oneDNN's layout (mkldnn._reorder_linear_weight), called through the dispatcher as Python would.
at::Tensor onednn_linear(const at::Tensor& a, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(a);
  stack.emplace_back(packed);
  stack.emplace_back(bias);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
  stack.emplace_back(c10::IValue());  // algorithm: None
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// Float32 linear layers: y = x W^T (+ bias), the weight laid out once (compiler/kernels/dense_cpu.py,
// pack_dense_weight) as float32 [N/16, K, 16]: for each block of 16 output channels, the 16
// channels' weights of each input channel in one vector (zeros where N is padded). A tile of J
// blocks and MB rows keeps its MB x J sums in registers over the whole of K, and each thread takes
// a run of blocks, so the weight is read from memory once, as one stream per block, whatever the
// number of rows. Each output is the float32 multiply-add chain over k = 0..K-1 of its own row, so
// a row's result does not change with the batch it is in (oneDNN's and MKL's choose their blocking,
// and so the order of the sums, by the batch). SmolLM2's 30 layers of projections on 2 threads of
// the AMD EPYC, weights cold: 1.2-1.7x oneDNN's speed at 1-64 rows, 1.04x at 512
// (python benchmarks/dense_cpu.py).
#if defined(__AVX512F__)
constexpr bool kDenseGemm = true;

struct DenseGemm {
  const float* x;  // [M, K]
  int64_t M, K;
  const float* bias;  // [N] or null
  float* y;           // [M, N]
  int64_t N;
};

// Rows [0, MB) of a tile of J blocks of 16 channels from n0.
template <int J, int MB>
void dense_tile(const DenseGemm& g, const float* panel, const float* x, float* y, int64_t n0) {
  __m512 acc[MB][J];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < J; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < g.K; ++k) {
    __m512 w[J];
    for (int j = 0; j < J; ++j) w[j] = _mm512_loadu_ps(panel + (j * g.K + k) * 16);
    for (int m = 0; m < MB; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * g.K + k]);
      for (int j = 0; j < J; ++j) acc[m][j] = _mm512_fmadd_ps(xb, w[j], acc[m][j]);
    }
  }
  for (int j = 0; j < J; ++j) {
    const int64_t n = n0 + 16 * j, count = std::min<int64_t>(16, g.N - n);
    const __mmask16 mask = count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
    const __m512 b = g.bias ? _mm512_maskz_loadu_ps(mask, g.bias + n) : _mm512_setzero_ps();
    for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + m * g.N + n, mask, g.bias ? _mm512_add_ps(acc[m][j], b) : acc[m][j]);
  }
}

// Every row, in tiles of 8 (8 x 3 accumulators fill 24 of the 32 vector registers) and the rest;
// the panel of J blocks stays in the core's cache from the first tile on.
template <int J>
void dense_rows(const DenseGemm& g, const float* panel, int64_t n0) {
  using Tile = void (*)(const DenseGemm&, const float*, const float*, float*, int64_t);
  static constexpr Tile tiles[] = {nullptr, dense_tile<J, 1>, dense_tile<J, 2>, dense_tile<J, 3>, dense_tile<J, 4>,
                                   dense_tile<J, 5>, dense_tile<J, 6>, dense_tile<J, 7>, dense_tile<J, 8>};
  for (int64_t m = 0; m < g.M; m += 8) tiles[std::min<int64_t>(8, g.M - m)](g, panel, g.x + m * g.K, g.y + m * g.N, n0);
}

// Each thread takes a run of the n_blocks blocks of 16 channels, three at a time: panel(b, J, buffer)
// gives blocks b..b+J-1's float32 weights in the packed layout (in place, or built in buffer).
template <typename Panel>
void blocks_gemm(const DenseGemm& g, int64_t n_blocks, Panel&& panel) {
  using Rows = void (*)(const DenseGemm&, const float*, int64_t);
  static constexpr Rows rows[] = {nullptr, dense_rows<1>, dense_rows<2>, dense_rows<3>};
  at::parallel_for(0, n_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
    for (int64_t b = begin; b < end; b += 3) {
      const int J = static_cast<int>(std::min<int64_t>(3, end - b));
      rows[J](g, panel(b, J, buffer), b * 16);
    }
  });
}

// x [..., K] float32 times a weight of N outputs, plus the bias: run(g) fills g.y for the rows of x.
template <typename Run>
at::Tensor linear_rows(const at::Tensor& x, int64_t N, const c10::optional<at::Tensor>& bias, Run&& run) {
  const int64_t K = x.size(-1);
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty({x2.size(0), N}, x.options());
  const DenseGemm g{x2.data_ptr<float>(), x2.size(0), K, bias ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), N};
  if (g.M > 0 && N > 0) run(g);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return y.view(shape);
}

// An INT4 layer as compiler/formats/int4.py stores it: codes [N, K_pad / 2] (two a byte, the even k
// in the low nibble), scales and zero points [N, n_groups] in float32.
struct Int4Weight {
  const uint8_t* codes;
  const float *scales, *zeros;
  int64_t N, row_bytes, group, n_groups;
};

// The float32 weights of J blocks of 16 channels for k = 0..K-1, in dense_linear's panel layout:
// w = (q - z) * s, compiler/quant/int4.py's dequantize in the same float32 arithmetic, so the same
// values. Channels past N repeat the last one (their outputs are never stored).
void int4_panel(const Int4Weight& w, int64_t b0, int J, int64_t K, float* panel) {
  for (int j = 0; j < J; ++j) {
    alignas(64) int32_t rows[16];
    for (int c = 0; c < 16; ++c) rows[c] = static_cast<int32_t>(std::min<int64_t>((b0 + j) * 16 + c, w.N - 1));
    const __m512i row = _mm512_load_si512(rows), low4 = _mm512_set1_epi32(15);
    float* p = panel + j * K * 16;
    for (int64_t gi = 0; gi * w.group < K; ++gi) {
      const __m512i at = _mm512_add_epi32(_mm512_mullo_epi32(row, _mm512_set1_epi32(static_cast<int32_t>(w.n_groups))),
                                          _mm512_set1_epi32(static_cast<int32_t>(gi)));
      const __m512 s = _mm512_i32gather_ps(at, w.scales, 4), z = _mm512_i32gather_ps(at, w.zeros, 4);
      const int64_t k_end = std::min(K, (gi + 1) * w.group);
      for (int64_t k0 = gi * w.group; k0 < k_end; k0 += 8) {  // 8 codes of each channel: 4 bytes of its row
        alignas(64) uint32_t bytes[16];
        for (int c = 0; c < 16; ++c) std::memcpy(&bytes[c], w.codes + rows[c] * w.row_bytes + k0 / 2, 4);
        const __m512i v = _mm512_load_si512(bytes);
        for (int i = 0; i < 8 && k0 + i < k_end; ++i) {
          const __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 4 * i), low4));
          _mm512_storeu_ps(p + (k0 + i) * 16, _mm512_mul_ps(_mm512_sub_ps(q, z), s));
        }
      }
    }
  }
}

#else
constexpr bool kDenseGemm = false;
#endif

bool dense_gemm_available() { return kDenseGemm; }

// An INT4 linear layer on float32 activations for batches of many rows (prefill): the dequantize
// reference's float32 weights, built 3 blocks of 16 channels at a time where the GEMM reads them
// (never the whole weight), times x by dense_linear's tiles. Within ~1e-7 of the reference (the
// order of the float32 sums); the panels cost ~1/M of the multiply-adds, so it is for many rows.
at::Tensor int4_dense_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const at::Tensor& zeros, int64_t group_size, const c10::optional<at::Tensor>& bias) {
#if defined(__AVX512F__)
  const int64_t K = x.size(-1), N = codes.size(0), n_groups = scales.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0, "group_size must be a positive multiple of 8");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous() &&
              codes.size(1) * 2 == n_groups * group_size && K <= codes.size(1) * 2,
              "codes must be contiguous uint8 [N, n_groups * group_size / 2] covering x's K");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && zeros.scalar_type() == at::kFloat && scales.is_contiguous() &&
              zeros.is_contiguous() && scales.sizes() == zeros.sizes() && scales.dim() == 2 && scales.size(0) == N,
              "scales and zeros must be contiguous float32 [N, n_groups]");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == N), "bias must be float32 [N]");
  const Int4Weight w{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(), N, codes.size(1),
                     group_size, n_groups};
  // each thread dequantizes 3 blocks at a time into a panel that stays in its cache
  return linear_rows(x, N, bias, [&](const DenseGemm& g) {
    blocks_gemm(g, (N + 15) / 16, [&](int64_t b, int J, std::vector<float>& panel) {
      panel.resize(3 * g.K * 16);
      int4_panel(w, b, J, g.K, panel.data());
      return static_cast<const float*>(panel.data());
    });
  });
#else
  TORCH_CHECK(false, "int4_dense_linear needs AVX-512, which this build's CPU lacks (dense_gemm_available())");
#endif
}

// INT4 weights times int8 activations (W4A8), the integer arithmetic of ONNX Runtime's MatMulNBits
// at accuracy_level 4 and of llama.cpp's Q4 dot products: each row's activations are quantized to
// int8 per group of the weight's K (symmetric, scale = the group's largest |a| / 127), VNNI
// (vpdpbusd) multiplies the 4-bit codes by them exactly in int32 over a group, and the float32
// sums take both scales once a group: y = sum_g s_w s_a (sum q a_q - z sum a_q). Four products per
// 32-bit lane and instruction where float32 has one. compiler/kernels/w4a8_cpu.py packs the weight
// and says when the engine runs this (never without being asked: it rounds the activations).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kW4A8 = true;

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
        int32_t a0, a1;
        std::memcpy(&a0, a, 4);
        std::memcpy(&a1, a + 4, 4);
        acc[m] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[m], lo, _mm512_set1_epi32(a0)), hi, _mm512_set1_epi32(a1));
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
  const __mmask16 mask = count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
  const __m512 bias = g.bias ? _mm512_maskz_loadu_ps(mask, g.bias + n) : _mm512_setzero_ps();
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(g.y + (m0 + m) * g.N + n, mask, _mm512_add_ps(f[m], bias));
}

void w4a8_rows(const W4A8Gemm& g, int64_t b) {
  using Tile = void (*)(const W4A8Gemm&, int64_t, int64_t);
  static constexpr Tile tiles[] = {nullptr, w4a8_tile<1>, w4a8_tile<2>, w4a8_tile<3>, w4a8_tile<4>,
                                   w4a8_tile<5>, w4a8_tile<6>, w4a8_tile<7>, w4a8_tile<8>};
  for (int64_t m = 0; m < g.M; m += 8) tiles[std::min<int64_t>(8, g.M - m)](g, b, m);
}

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
  __m512i sums = _mm512_setzero_si512();
  for (; i + 16 <= len; i += 16) {
    const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(inv)));
    sums = _mm512_add_epi32(sums, c);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(c));
  }
  int32_t sum = _mm512_reduce_add_epi32(sums);
  for (; i < len; ++i) {
    const int32_t c = static_cast<int32_t>(std::nearbyint(x[i] * inv));
    q[i] = static_cast<int8_t>(c);
    sum += c;
  }
  *scale = amax / 127.f;
  *scale_sum = *scale * static_cast<float>(sum);
}
#else
constexpr bool kW4A8 = false;
#endif

bool w4a8_available() { return kW4A8; }

// x [..., K] float32 times a W4A8-packed INT4 weight (w4a8_cpu.pack_w4a8) of N outputs, plus the bias.
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& zero_scales, int64_t group_size, int64_t out_features,
                       const c10::optional<at::Tensor>& bias) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
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
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == N), "bias must be float32 [N]");
  return linear_rows(x, N, bias, [&](const DenseGemm& d) {
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
                     zero_scales.data_ptr<float>(), d.bias, d.y, N};
    at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
      for (int64_t blk = begin; blk < end; ++blk) w4a8_rows(g, blk);
    });
  });
#else
  TORCH_CHECK(false, "w4a8_linear needs AVX512-VNNI, which this build's CPU lacks (w4a8_available())");
#endif
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                        const c10::optional<at::Tensor>& bias) {
#if defined(__AVX512F__)
  const int64_t K = x.size(-1), N = out_features, n_blocks = (N + 15) / 16;
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(0) == n_blocks &&
              packed.size(1) == K && packed.size(2) == 16 && packed.is_contiguous(),
              "packed must be pack_dense_weight's float32 [ceil(N/16), K, 16] for x's K and out_features");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == N), "bias must be float32 [N]");
  const float* weights = packed.data_ptr<float>();
  return linear_rows(x, N, bias, [&](const DenseGemm& g) {
    blocks_gemm(g, n_blocks, [&](int64_t b, int, std::vector<float>&) { return weights + b * g.K * 16; });
  });
#else
  TORCH_CHECK(false, "dense_linear needs AVX-512, which this build's CPU lacks (dense_gemm_available())");
#endif
}

// a times a packed weight: pack_dense_weight's layout (dense_linear) or oneDNN's (an mkldnn tensor).
at::Tensor packed_linear(const at::Tensor& a, const at::Tensor& packed, int64_t out_features,
                         const c10::optional<at::Tensor>& bias) {
  return packed.is_mkldnn() ? onednn_linear(a, packed, bias) : dense_linear(a, packed, out_features, bias);
}

// Fp8Linear's CPU forward for a float32 model in one call: the FP8-rounded activations times the
// dequantized float32 weight [N, K], plus the bias — the same addmm / mm as the Python path, or
// with `packed` (that weight packed, dense_cpu.pack_weight) the same packed linear (so the same bits), without
// its per-call Python work, which at one token costs more than the rounding.
at::Tensor fp8_linear(const at::Tensor& x, const c10::optional<at::Tensor>& shift,
                      const c10::optional<at::Tensor>& static_scale, at::ScalarType dtype, const at::Tensor& weight,
                      const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& packed) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.size(1) == x.size(-1),
              "weight must be float32 [N, K] with K = x's last size");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == weight.size(0)), "bias must be float32 [N]");
  const at::Tensor a = std::get<0>(fp8_fake_quant_rows(x.reshape({-1, x.size(-1)}).contiguous(), shift, static_scale, dtype));
  at::Tensor y = packed ? packed_linear(a, *packed, weight.size(0), bias) : bias ? at::addmm(*bias, a, weight.t()) : at::mm(a, weight.t());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = weight.size(0);
  return y.view(shape);
}

// Rows of at least this many values are worth a thread each; fewer share one.
constexpr int64_t kRowGrain = 16384;

// fp8_linear_codes: Fp8Linear's forward on its FP8 codes, never a float copy of the weight. FP8 values
// (E4M3 and E5M2 alike) are exact in bfloat16 and the product of two is exact in float32, so
// AVX512-BF16's dot product (vdpbf16ps: pairs of bfloat16 products added into float32) multiplies
// the activation codes by the weight codes exactly and sums them in float32; the row's and the
// channel's scales are applied to the sum. The reference (dequantize both, then a float32 matmul)
// rounds each factor times its scale first, so the two differ by float32 rounding, as two GEMMs'
// summation orders do (~1e-7 relative), never by a code. Reads 1 byte per weight where the float
// copy reads 4 (and twice float32's multiply-adds per instruction). Each output depends on its own
// row only, so a token's result does not change with the batch it is in.
//
// The weight is laid out once (compiler/formats/fp8.py, pack_fp8_codes) as uint8 [N/16, K/2, 16, 2]:
// for each block of 16 output channels and each pair of input channels, the 16 channels' two codes,
// which a 128-magnitude lookup table turns into the 32 bfloat16 lanes vdpbf16ps takes.
#if defined(__AVX512BF16__)
constexpr bool kFp8CodesGemm = true;

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

// A row's FP8 codes (as fake_quant_rows rounds them, before the scale) in bfloat16, K padded with
// zeros to an even count, and the row's scale.
template <typename F8>
void quantize_rows_bf16(const float* x, const float* shift, const float* static_scale, const Fp8Spec& spec, int64_t M,
                        int64_t K, int64_t K_even, uint16_t* codes, float* scales) {
  at::parallel_for(0, M, std::max<int64_t>(1, kRowGrain / K), [&](int64_t begin, int64_t end) {
    std::vector<float> centred(shift ? K : 0);
    for (int64_t r = begin; r < end; ++r) {
      const auto [xr, s] = centred_row(x + r * K, shift, static_scale, spec, K, centred);
      scales[r] = s;
      uint16_t* q = codes + r * K_even;
      const __m512 sv = _mm512_set1_ps(s);
      int64_t i = 0;
      for (; i + 16 <= K; i += 16) {
        const __m256bh b = _mm512_cvtneps_pbh(round_trip16(_mm512_div_ps(_mm512_loadu_ps(xr + i), sv), spec));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), reinterpret_cast<const __m256i&>(b));
      }
      for (; i < K_even; ++i) {
        const float v = i < K ? round_trip<F8>(xr[i] / s, spec.max) : 0.f;
        const __m128bh b = _mm_cvtneps_pbh(_mm_set1_ps(v));
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
    const __mmask16 mask = count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
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
    std::vector<uint16_t> panel(4 * block);
    for (int64_t group = begin; group < end; ++group) {
      const int64_t b0 = group * 4, J = std::min<int64_t>(4, n_blocks - b0);
      for (int64_t i = 0; i < J * block; i += 32) _mm512_storeu_si512(panel.data() + i, codes_to_bf16(packed + b0 * block + i, table));
      rows[J](g, panel.data(), b0 * 16);
    }
  });
}
#else
constexpr bool kFp8CodesGemm = false;
#endif

bool fp8_codes_gemm_available() { return kFp8CodesGemm; }

at::Tensor fp8_linear_codes(const at::Tensor& x, const c10::optional<at::Tensor>& shift,
                            const c10::optional<at::Tensor>& static_scale, at::ScalarType activation_dtype,
                            const at::Tensor& packed, at::ScalarType weight_dtype, const at::Tensor& weight_scale,
                            int64_t out_features, const c10::optional<at::Tensor>& bias) {
#if defined(__AVX512BF16__)
  const int64_t K = x.size(-1), N = out_features, K_pairs = (K + 1) / 2, n_blocks = (N + 15) / 16;
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.size(0) == n_blocks &&
              packed.size(1) == K_pairs && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous(),
              "packed must be pack_fp8_codes' uint8 [ceil(N/16), ceil(K/2), 16, 2] for x's K and out_features");
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && (weight_scale.numel() == N || weight_scale.numel() == 1),
              "weight_scale must be float32 [N] or [1]");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == N), "bias must be float32 [N]");
  if (shift) TORCH_CHECK(shift->scalar_type() == at::kFloat && shift->is_contiguous() && shift->numel() == K, "shift must be float32 [K]");
  if (static_scale) TORCH_CHECK(static_scale->scalar_type() == at::kFloat && static_scale->numel() == 1, "static_scale must be float32 [1]");
  TORCH_CHECK(activation_dtype == at::kFloat8_e4m3fn || activation_dtype == at::kFloat8_e5m2,
              "activation_dtype must be float8_e4m3fn or float8_e5m2");
  TORCH_CHECK(weight_dtype == at::kFloat8_e4m3fn || weight_dtype == at::kFloat8_e5m2,
              "weight_dtype must be float8_e4m3fn or float8_e5m2");
  const float* sp = shift ? shift->data_ptr<float>() : nullptr;
  const float* ssp = static_scale ? static_scale->data_ptr<float>() : nullptr;
  const at::Tensor ws = weight_scale.contiguous();
  return linear_rows(x, N, bias, [&](const DenseGemm& d) {
    const int64_t M = d.M;
    at::Tensor codes = at::empty({M, 2 * K_pairs}, x.options().dtype(at::kBFloat16));
    at::Tensor x_scale = at::empty({M}, x.options());
    auto* code_ptr = reinterpret_cast<uint16_t*>(codes.data_ptr());
    if (activation_dtype == at::kFloat8_e4m3fn)
      quantize_rows_bf16<c10::Float8_e4m3fn>(d.x, sp, ssp, kE4m3Spec, M, K, 2 * K_pairs, code_ptr, x_scale.data_ptr<float>());
    else
      quantize_rows_bf16<c10::Float8_e5m2>(d.x, sp, ssp, kE5m2Spec, M, K, 2 * K_pairs, code_ptr, x_scale.data_ptr<float>());
    const CodesGemm g{code_ptr, M, K_pairs, x_scale.data_ptr<float>(), ws.data_ptr<float>(), d.bias,
                      ws.numel() == 1 && N != 1, d.y, N};
    const CodeTable table(weight_dtype == at::kFloat8_e4m3fn ? kE4m3Bf16 : kE5m2Bf16);
    codes_gemm(g, packed.data_ptr<uint8_t>(), n_blocks, table);
  });
#else
  TORCH_CHECK(false, "fp8_linear_codes needs AVX512-BF16, which this build's CPU lacks (fp8_codes_gemm_available())");
#endif
}

// The decode step's small elementwise layers, one op each instead of six to twelve torch ops (at
// a few tokens a step their dispatch, not their arithmetic, is what they cost). float32 only; the
// callers (compiler/model/layers.py) run the torch code for anything else.

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

#if defined(__AVX512F__)
// torch's own exp for 16 floats (libtorch_cpu exports it): what Vectorized<float>::exp() runs on AVX-512.
extern "C" __m512 Sleef_expf16_u10(__m512);
#endif

// SwiGLU's silu(gate) * up, [..., I] each (rows of any stride, the last axis contiguous) -> [..., I]:
// torch's vectorised silu, x / (1 + exp(-x)) with its own exp, then the product, for every element
// (the tail of a row through masked lanes), so bit for bit F.silu(gate) * up wherever torch
// vectorises the whole row (I a multiple of 32, as in every model here); the fused gate_up and the
// separate projections (compiler/model/layers.py's MLP) take this same op, so they agree exactly.
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
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (int64_t i = 0; i < I; i += 16) {
        const __mmask16 m = I - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (I - i)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(m, g + i);
        const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
        const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, Sleef_expf16_u10(neg)));
        _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(m, u + i)));
      }
#else
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
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
                       const c10::optional<at::Tensor>& bias) {
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

}  // namespace

TORCH_LIBRARY(qcompile_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor k_scale, Tensor v_scale, int window, float sm_scale) -> Tensor");
  m.def("fp8_fake_quant_rows(Tensor x, Tensor? shift, Tensor? static_scale, ScalarType dtype) -> (Tensor, Tensor)");
  m.def("fp8_linear(Tensor x, Tensor? shift, Tensor? static_scale, ScalarType dtype, Tensor weight, Tensor? bias, "
        "Tensor? packed) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float weight_offset) -> Tensor");
  m.def("rope_qk(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("fp8_codes_gemm_available() -> bool", &fp8_codes_gemm_available);
  m.def("fp8_linear_codes(Tensor x, Tensor? shift, Tensor? static_scale, ScalarType activation_dtype, Tensor packed, "
        "ScalarType weight_dtype, Tensor weight_scale, int out_features, Tensor? bias) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("dense_gemm_available() -> bool", &dense_gemm_available);
  m.def("dense_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("int4_dense_linear(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int group_size, Tensor? bias) -> Tensor");
  m.def("w4a8_available() -> bool", &w4a8_available);
  m.def("w4a8_linear(Tensor x, Tensor packed, Tensor scales, Tensor zero_scales, int group_size, int out_features, "
        "Tensor? bias) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor weight, int group_size, Tensor scales_and_zeros, int padded_in_features, "
        "Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(qcompile_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("fp8_fake_quant_rows", &fp8_fake_quant_rows);
  m.impl("fp8_linear", &fp8_linear);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_qk", &rope_qk);
  m.impl("silu_mul", &silu_mul);
  m.impl("int4_linear", &int4_linear);
  m.impl("fp8_linear_codes", &fp8_linear_codes);
  m.impl("dense_linear", &dense_linear);
  m.impl("int4_dense_linear", &int4_dense_linear);
  m.impl("w4a8_linear", &w4a8_linear);
}

// A oneDNN-packed weight is an MkldnnCPU tensor, which makes that the dispatch key of the call.
TORCH_LIBRARY_IMPL(qcompile_cpu, MkldnnCPU, m) {
  m.impl("fp8_linear", &fp8_linear);
}
