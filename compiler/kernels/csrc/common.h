// What several kernel families share: the headers (the light per-operator ones: each family is
// compiled once per ISA level, and ATen/ATen.h triples a file's build time), the row grain of the
// elementwise ops, and a row's absolute maximum.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "isa.h"

namespace qcompile_cpu {

// Rows of at least this many values are worth a thread each; fewer share one.
constexpr int64_t kRowGrain = 16384;

// |x| of a row's largest value, or NaN when the row holds one (torch's amax propagates NaN).
inline float row_amax(const float* x, int64_t n) {
  float amax = 0.f;
  bool nan = false;
  int64_t i = 0;
#if QC_AVX512
  __m512 acc = _mm512_setzero_ps();
  __mmask16 nans = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    acc = _mm512_max_ps(acc, _mm512_abs_ps(v));
  }
  amax = _mm512_reduce_max_ps(acc);
  nan = nans != 0;
#else
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 acc = _mm256_setzero_ps(), nans = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nans = _mm256_or_ps(nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    acc = _mm256_max_ps(acc, _mm256_and_ps(v, abs_mask));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float a : lanes) amax = a > amax ? a : amax;
  nan = _mm256_movemask_ps(nans) != 0;
#endif
  for (; i < n; ++i) {
    const float a = std::fabs(x[i]);
    nan |= std::isnan(a);
    amax = a > amax ? a : amax;
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : amax;
}

}  // namespace qcompile_cpu
