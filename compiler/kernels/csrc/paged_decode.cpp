// paged_decode: one query token per sequence over its paged K/V, read in place (float32, bfloat16,
// float16, FP8 E4M3 with per-KV-head scales or int8 with per-channel scales), with grouped-query
// heads and a sliding window. The contract of serving/paged_attention.py's paged_decode_reference,
// which gathers every sequence's blocks into a buffer (and dequantizes a quantized cache there)
// before torch's SDPA; this kernel reads each cached row once, where it lies, and needs no copy.
// The levels differ in their exp (AVX-512: the polynomial below; AVX2: torch's Sleef exp) and the
// order of their float32 sums.
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <type_traits>
#include <utility>

#include "common.h"
#include "ops.h"

namespace qcompile_cpu {
namespace {

// Each FP8 E4M3 code's value, so that a cached row dequantizes by table lookup, not bit twiddling.
struct E4m3Table {
  float value[256];
  E4m3Table() {
    for (int i = 0; i < 256; ++i) value[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  }
};
const E4m3Table kE4m3;

// An int8 cache has a scale per channel (D per KV head), the others one per KV head.
template <typename T>
constexpr bool kPerChannel = std::is_same_v<T, int8_t>;

// A cached row of D values in float32 times its scale (`*scale`, or scale[i] per channel for int8);
// a float32 row with no scale is read where it lies.
template <typename T>
inline const float* load_row(const T* src, const float* scale, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * *scale;
  return dst;
}

inline const float* load_row(const float* src, const float* scale, float* dst, int64_t n) {
  if (*scale == 1.f) return src;
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * *scale;
  return dst;
}

inline const float* load_row(const c10::Float8_e4m3fn* src, const float* scale, float* dst, int64_t n) {
  const uint8_t* bits = reinterpret_cast<const uint8_t*>(src);
  int64_t i = 0;
  const Vec16 scales = Vec16::broadcast(*scale * kFp8FromHalf<true>);  // exact: a power of two
  for (; i + 16 <= n; i += 16)
    (half_to_float(fp8_as_half<true>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i)))) * scales).store(dst + i);
  for (; i < n; ++i) dst[i] = kE4m3.value[bits[i]] * *scale;
  return dst;
}

// 16 int8 codes as float32 (exact).
inline Vec16 int8_to_float(__m128i codes) {
#if QC_AVX512
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes))};
#else
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(codes, 8)))};
#endif
}

// Each code times its channel's scale: one float32 product, torch's codes.float() * scale bit for bit.
inline const float* load_row(const int8_t* src, const float* scales, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const Vec16 codes = int8_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    (codes * Vec16::load(scales + i)).store(dst + i);
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scales[i];
  return dst;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

#if QC_AVX512
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

#if !QC_AVX512
// torch's own exp for 8 floats (libtorch_cpu exports it): what Vectorized<float>::exp() runs on AVX2.
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif

// s[i] = exp(s[i] - m); returns their sum.
inline float exp_shifted(float* s, int64_t n, float m) {
  float sum = 0.f;
  int64_t i = 0;
#if QC_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(m)));
    _mm512_storeu_ps(s + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#else
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(m)));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = reduce_add8(acc);
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
  // one block, one after another (`token_stride` apart), so the cache is read as a stream; the
  // next run is prefetched meanwhile.
  template <typename F>
  void each_run(const T* cache, F&& f) const {
    for (int64_t t = 0; t < n;) {
      const int64_t pos = first + t, offset = pos % block_size;
      const int64_t count = std::min(block_size - offset, n - t);
      if (t + count < n) prefetch(row_at(cache, pos + count), std::min(block_size, n - t - count));
      f(t, count, row_at(cache, pos));
      t += count;
    }
  }

  // Asks for the first run of `cache` (V's, while the softmax runs before it is read).
  void prefetch_first(const T* cache) const {
    if (n > 0) prefetch(row_at(cache, first), std::min(block_size - first % block_size, n));
  }

  // The row of position `pos`.
  const T* row_at(const T* cache, int64_t pos) const {
    return cache + (table[pos / block_size] * block_size + pos % block_size) * token_stride;
  }

  // Blocks lie anywhere, so the hardware's prefetchers cannot see the next one coming: its `count`
  // rows are asked for into L2 while this one is read (float32 K/V of 16 SmolLM2 sequences: -23%
  // per layer, int8: -28%, on the AMD EPYC Zen 4).
  void prefetch(const T* rows, int64_t count) const {
    const char* bytes = reinterpret_cast<const char*>(rows);
    for (int64_t i = 0, size = count * token_stride * static_cast<int64_t>(sizeof(T)); i < size; i += 64)
      _mm_prefetch(bytes + i, _MM_HINT_T1);
  }
};

// `count` rows of one KV head (`stride` apart in the cache) as float32 times the head's scale
// (load_row's): in place for an unscaled float32 cache, else converted into `buffer` (rows D apart).
// Returns the rows and their stride.
template <typename T>
inline std::pair<const float*, int64_t> head_rows(const T* rows, int64_t count, int64_t stride, const float* scale,
                                                  int64_t D, std::vector<float>& buffer) {
  if constexpr (std::is_same_v<T, float>) {
    if (*scale == 1.f) return {rows, stride};
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
#if QC_AVX512
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
#else
  // 16 registers: G x T sums, T keys and a query vector.
  constexpr int T = G <= 2 ? 4 : G <= 5 ? 2 : 1;
  for (; t + T <= count; t += T, k += T * k_stride) {
    __m256 acc[G][T];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < T; ++i) acc[g][i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m256 kv[T];
      for (int i = 0; i < T; ++i) kv[i] = _mm256_loadu_ps(k + i * k_stride + d);
      for (int g = 0; g < G; ++g) {
        const __m256 qv = _mm256_loadu_ps(q + g * D + d);
        for (int i = 0; i < T; ++i) acc[g][i] = _mm256_fmadd_ps(qv, kv[i], acc[g][i]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < T; ++i) scores[g * n + t0 + t + i] = reduce_add8(acc[g][i]) * sm_scale;
  }
#endif
  for (; t < count; ++t, k += k_stride) {
    float acc[G] = {};
    for (int g = 0; g < G; ++g) acc[g] = dot(q + g * D, k, D);
    for (int g = 0; g < G; ++g) scores[g * n + t0 + t] = acc[g] * sm_scale;
  }
}

// Columns of V a block_values pass keeps in registers: 4 vectors per query head.
constexpr int kValueColumns = QC_AVX512 ? 64 : 32;

// out[g] += sum_t p[g * n + t0 + t] * v_t for the G query heads of one KV head, kValueColumns
// columns at a time so that the accumulators stay in registers across the block's rows (D % 64 == 0).
template <int G>
void block_values(const float* p, int64_t n, int64_t t0, const float* v, int64_t v_stride, int64_t count, int64_t D,
                  float* out) {
  for (int64_t d0 = 0; d0 < D; d0 += kValueColumns) {
    float acc[G][kValueColumns];
    for (int g = 0; g < G; ++g)
#pragma omp simd
      for (int j = 0; j < kValueColumns; ++j) acc[g][j] = out[g * D + d0 + j];
    for (int64_t t = 0; t < count; ++t) {
      const float* row = v + t * v_stride + d0;
      for (int g = 0; g < G; ++g) {
        const float w = p[g * n + t0 + t];
#pragma omp simd
        for (int j = 0; j < kValueColumns; ++j) acc[g][j] += w * row[j];
      }
    }
    for (int g = 0; g < G; ++g)
#pragma omp simd
      for (int j = 0; j < kValueColumns; ++j) out[g * D + d0 + j] = acc[g][j];
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
// scale per KV head (D of them, one per channel, for int8). Kernels: Blocked<G> or AnyG.
template <typename Kernels, typename T>
void decode_sequence(const float* q, const SeqCache<T>& seq, const float* k_scales, const float* v_scales,
                     float sm_scale, int64_t Hkv, int64_t G, int64_t D, float* out,
                     std::vector<float>& scores, std::vector<float>& buffer) {
  const int64_t n = seq.n, Hq = Hkv * G, stride = seq.token_stride, scales_per_head = kPerChannel<T> ? D : 1;
  scores.resize(Hq * n);
  seq.each_run(seq.k, [&](int64_t t0, int64_t count, const T* rows) {
    for (int64_t h = 0; h < Hkv; ++h) {
      auto [k, k_stride] = head_rows(rows + h * D, count, stride, k_scales + h * scales_per_head, D, buffer);
      Kernels::scores(q + h * G * D, k, k_stride, count, G, D, sm_scale, scores.data() + h * G * n, n, t0);
    }
  });
  seq.prefetch_first(seq.v);
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
      auto [v, v_stride] = head_rows(rows + h * D, count, stride, v_scales + h * scales_per_head, D, buffer);
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
  // per-tensor scales are expanded to one per KV head, so the loops index them alike (int8's are per channel)
  at::Tensor ks = kPerChannel<T> ? k_scale : k_scale.expand({Hkv}).contiguous();
  at::Tensor vs = kPerChannel<T> ? v_scale : v_scale.expand({Hkv}).contiguous();
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

}  // namespace

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
  const bool per_channel = k_cache.scalar_type() == at::kChar;
  for (const at::Tensor* s : {&k_scale, &v_scale})
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous()
                && (per_channel ? s->numel() == Hkv * k_cache.size(3) : s->numel() == 1 || s->numel() == Hkv),
                "K/V scales must be contiguous float32 with 1 or Hkv values (Hkv * D for an int8 cache)");
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
    case at::kChar: decode_all<int8_t>(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, window, sm_scale, out); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported cache dtype ", k_cache.scalar_type());
  }
  return out;
}


}  // namespace qcompile_cpu
