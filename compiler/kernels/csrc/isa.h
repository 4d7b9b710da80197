// The instruction-set level this copy of the library is built for, and the vector helpers its
// kernels share.
//
// compiler/kernels/cpu_build.py compiles every source once per level, each with its own flags, into
// a library of its own (torch.ops.qcompile_cpu_<level>); compiler/kernels/cpu_isa.py loads the best
// one the CPU runs, so one build serves every x86-64-v3 CPU and none is ever built for the build
// host alone (-march=native). The levels, each the one before plus:
//
//   avx2         x86-64-v3: AVX2, FMA, F16C (16 vector registers of 8 floats)
//   avx2_vnni    avx2 and AVX-VNNI: 256-bit int8 dot products (vpdpbusd, VEX-encoded)
//   avx512       x86-64-v4: AVX-512 F/BW/CD/DQ/VL (32 registers of 16 floats)
//   avx512_vnni  AVX512-VNNI: int8 dot products (vpdpbusd)
//   avx512_bf16  AVX512-BF16: bfloat16 dot products (vdpbf16ps)
//
// A kernel family keeps its variants side by side under QC_AVX512 / QC_VNNI / QC_BF16, the AVX2
// one in the #else (QC_AVX_VNNI within it). Variants agree bit for bit where they do the same float32 operations in the
// same order (the dense tiles, W4A8, the FP8 rounding); where they cannot (a bfloat16 dot product
// against float32 FMAs, another exp) the tests state the bound.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define QC_AVX512 1
#if defined(__AVX512VNNI__)
#define QC_VNNI 1
#else
#define QC_VNNI 0
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define QC_BF16 1
#else
#define QC_BF16 0
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QC_AVX512 0
#define QC_VNNI 0
#define QC_BF16 0
#if defined(__AVXVNNI__)
#define QC_AVX_VNNI 1
#endif
#else
#error "qcompile's CPU kernels need x86-64-v3 (AVX2, FMA, F16C) or above: build them with -march=x86-64-v3 or higher"
#endif
#ifndef QC_AVX_VNNI
#define QC_AVX_VNNI 0
#endif

namespace qcompile_cpu {

// The level's name, as compiler/kernels/cpu_isa.py names it.
inline const char* isa_level() {
#if QC_BF16
  return "avx512_bf16";
#elif QC_VNNI
  return "avx512_vnni";
#elif QC_AVX512
  return "avx512";
#elif QC_AVX_VNNI
  return "avx2_vnni";
#else
  return "avx2";
#endif
}

// The 16 float32 values of one block of 16 output channels (the packed weights' unit): one
// AVX-512 register, or two AVX2 ones.
#if QC_AVX512
struct Vec16 {
  __m512 v;
  static Vec16 zero() { return {_mm512_setzero_ps()}; }
  static Vec16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec16 broadcast(float x) { return {_mm512_set1_ps(x)}; }
  static __mmask16 mask(int64_t n) { return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }
  static Vec16 load_first(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(mask(n), p)}; }  // zeros past n
  void store_first(float* p, int64_t n) const { _mm512_mask_storeu_ps(p, mask(n), v); }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec16 operator+(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec16 operator-(Vec16 a, Vec16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec16 operator*(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
#else
// The lanes of an 8-float register that lie before n (all ones), for maskload / maskstore.
inline __m256i first_lanes(int64_t n) {
  const int32_t k = static_cast<int32_t>(std::clamp<int64_t>(n, 0, 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
struct Vec16 {
  __m256 lo, hi;
  static Vec16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Vec16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static Vec16 broadcast(float x) { const __m256 b = _mm256_set1_ps(x); return {b, b}; }
  static Vec16 load_first(const float* p, int64_t n) {
    if (n >= 16) return load(p);
    return {_mm256_maskload_ps(p, first_lanes(n)), _mm256_maskload_ps(p + 8, first_lanes(n - 8))};
  }
  void store_first(float* p, int64_t n) const {
    if (n >= 16) return store(p);
    _mm256_maskstore_ps(p, first_lanes(n), lo);
    _mm256_maskstore_ps(p + 8, first_lanes(n - 8), hi);
  }
  void store(float* p) const { _mm256_storeu_ps(p, lo); _mm256_storeu_ps(p + 8, hi); }
};
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline Vec16 operator+(Vec16 a, Vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec16 operator-(Vec16 a, Vec16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec16 operator*(Vec16 a, Vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }

inline float reduce_add8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline int32_t reduce_add8(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}
#endif

// One vector register of floats, and how many of them a block of 16 channels takes: the GEMM tiles
// keep their sums in arrays of these (GCC keeps a struct of two registers, Vec16's AVX2 form, on
// the stack in a loop, a store and a load in every sum's dependency chain).
#if QC_AVX512
using Reg = __m512;
constexpr int kRegsPerBlock = 1;
inline Reg reg_zero() { return _mm512_setzero_ps(); }
inline Reg reg_load(const float* p) { return _mm512_loadu_ps(p); }
inline void reg_store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
inline Reg reg_broadcast(float x) { return _mm512_set1_ps(x); }
inline Reg reg_fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
inline Reg reg_mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
inline Reg reg_div(Reg a, Reg b) { return _mm512_div_ps(a, b); }
inline Vec16 block_of(const Reg* r) { return {r[0]}; }
#else
using Reg = __m256;
constexpr int kRegsPerBlock = 2;
inline Reg reg_zero() { return _mm256_setzero_ps(); }
inline Reg reg_load(const float* p) { return _mm256_loadu_ps(p); }
inline void reg_store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
inline Reg reg_broadcast(float x) { return _mm256_set1_ps(x); }
inline Reg reg_fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
inline Reg reg_mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
inline Reg reg_div(Reg a, Reg b) { return _mm256_div_ps(a, b); }
inline Vec16 block_of(const Reg* r) { return {r[0], r[1]}; }
#endif
constexpr int kRegLanes = 16 / kRegsPerBlock;

// 16 FP8 codes as float16 bits, exactly: float16 holds both FP8 formats' values. An E5M2 code is
// float16's top byte. An E4M3 code's bits, shifted so that its exponent lands in float16's, read as
// float16 are its value times 2^-8 (kFp8FromHalf undoes it), subnormal codes too (both formats'
// subnormals scale by the same 2^8); 0x7f / 0xff (NaN) become a float16 NaN with the code's sign.
template <bool E4M3>
inline __m256i fp8_as_half(__m128i codes) {
  const __m256i c = _mm256_cvtepu8_epi16(codes);
  if constexpr (!E4M3) return _mm256_slli_epi16(c, 8);
  const __m256i magnitude = _mm256_and_si256(c, _mm256_set1_epi16(0x7f));
  const __m256i half = _mm256_or_si256(_mm256_slli_epi16(magnitude, 7),
                                       _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8));
  return _mm256_blendv_epi8(half, _mm256_or_si256(half, _mm256_set1_epi16(0x7e00)),
                            _mm256_cmpeq_epi16(magnitude, _mm256_set1_epi16(0x7f)));
}

// What fp8_as_half's values are multiplied by to be the codes' (a power of two: exact).
template <bool E4M3>
constexpr float kFp8FromHalf = E4M3 ? 256.f : 1.f;

// 16 float16 values as float32 (F16C: exact).
inline Vec16 half_to_float(__m256i half) {
#if QC_AVX512
  return {_mm512_cvtph_ps(half)};
#else
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(half)), _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1))};
#endif
}

inline void half_to_regs(__m256i half, Reg* out) {
#if QC_AVX512
  out[0] = _mm512_cvtph_ps(half);
#else
  out[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
  out[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
#endif
}

}  // namespace qcompile_cpu
