// Float32 linear layers on qcompile's packed weights (compiler/kernels/dense_cpu.py):
//
// dense_linear: y = x W^T (+ bias), the weight packed once (pack_dense_weight) as float32
//   [N/16, K, 16], through dense_tiles.h. SmolLM2's 30 layers of projections on 2 threads of the
//   AMD EPYC (Zen 4), weights cold: 1.2-1.7x oneDNN's speed at 1-64 rows, 1.04x at 512
//   (python benchmarks/dense_cpu.py).
// int4_dense_linear: an INT4 layer's many-token forward, the dequantize reference's float32 weights
//   built kPanelBlocks blocks at a time into a panel that stays in the thread's cache (never the
//   whole weight), times x by the same tiles. Within ~1e-7 of the reference (the order of the
//   float32 sums); the panels cost ~1/M of the multiply-adds, so it is for many rows.
#include "dense_tiles.h"
#include "ops.h"

namespace qcompile_cpu {
namespace {

// An INT4 layer as compiler/formats/int4.py stores it: codes [N, K_pad / 2] (two a byte, the even k
// in the low nibble), scales and zero points [N, n_groups] in float32.
struct Int4Weight {
  const uint8_t* codes;
  const float *scales, *zeros;
  int64_t N, row_bytes, group, n_groups;
};

// Four bytes (eight codes) of each of 16 channels; nibble(i) is code i of each, as float32.
#if QC_AVX512
struct Codes16 {
  __m512i v;
  explicit Codes16(const uint32_t* bytes) : v(_mm512_loadu_si512(bytes)) {}
  Vec16 nibble(int i) const {
    return {_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 4 * i), _mm512_set1_epi32(15)))};
  }
};
#else
struct Codes16 {
  __m256i lo, hi;
  explicit Codes16(const uint32_t* bytes)
      : lo(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes))),
        hi(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 8))) {}
  Vec16 nibble(int i) const {
    const __m256i low4 = _mm256_set1_epi32(15);
    return {_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(lo, 4 * i), low4)),
            _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(hi, 4 * i), low4))};
  }
};
#endif

// The float32 weights of J blocks of 16 channels for k = 0..K-1, in the panel layout: w = (q - z) * s,
// compiler/quant/int4.py's dequantize in the same float32 arithmetic, so the same values. Channels
// past N repeat the last one (their outputs are never stored).
void int4_panel(const Int4Weight& w, int64_t b0, int J, int64_t K, float* panel) {
  for (int j = 0; j < J; ++j) {
    int64_t rows[16];
    for (int c = 0; c < 16; ++c) rows[c] = std::min<int64_t>((b0 + j) * 16 + c, w.N - 1);
    float* p = panel + j * K * 16;
    for (int64_t gi = 0; gi * w.group < K; ++gi) {
      alignas(64) float s[16], z[16];
      for (int c = 0; c < 16; ++c) {
        s[c] = w.scales[rows[c] * w.n_groups + gi];
        z[c] = w.zeros[rows[c] * w.n_groups + gi];
      }
      const Vec16 sv = Vec16::load(s), zv = Vec16::load(z);
      const int64_t k_end = std::min(K, (gi + 1) * w.group);
      for (int64_t k0 = gi * w.group; k0 < k_end; k0 += 8) {  // 8 codes of each channel: 4 bytes of its row
        alignas(64) uint32_t bytes[16];
        for (int c = 0; c < 16; ++c) std::memcpy(&bytes[c], w.codes + rows[c] * w.row_bytes + k0 / 2, 4);
        const Codes16 codes(bytes);
        for (int i = 0; i < 8 && k0 + i < k_end; ++i) ((codes.nibble(i) - zv) * sv).store(p + (k0 + i) * 16);
      }
    }
  }
}

}  // namespace

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                        const c10::optional<at::Tensor>& bias) {
  const int64_t K = x.size(-1), N = out_features, n_blocks = (N + 15) / 16;
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(0) == n_blocks &&
              packed.size(1) == K && packed.size(2) == 16 && packed.is_contiguous(),
              "packed must be pack_dense_weight's float32 [ceil(N/16), K, 16] for x's K and out_features");
  at::Tensor b;
  const float* bias_ptr = bias_data(bias, N, b);
  const float* weights = packed.data_ptr<float>();
  return linear_rows(x, N, [&](const DenseGemm& g) {
    blocks_gemm(g, n_blocks, [&](int64_t blk, int, float*) { return weights + blk * g.K * 16; }, BiasOut{g, bias_ptr});
  });
}

at::Tensor int4_dense_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const at::Tensor& zeros, int64_t group_size, const c10::optional<at::Tensor>& bias) {
  const int64_t K = x.size(-1), N = codes.size(0), n_groups = scales.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0, "group_size must be a positive multiple of 8");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous() &&
              codes.size(1) * 2 == n_groups * group_size && K <= codes.size(1) * 2,
              "codes must be contiguous uint8 [N, n_groups * group_size / 2] covering x's K");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && zeros.scalar_type() == at::kFloat && scales.is_contiguous() &&
              zeros.is_contiguous() && scales.sizes() == zeros.sizes() && scales.dim() == 2 && scales.size(0) == N,
              "scales and zeros must be contiguous float32 [N, n_groups]");
  at::Tensor b;
  const float* bias_ptr = bias_data(bias, N, b);
  const Int4Weight w{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(), N, codes.size(1),
                     group_size, n_groups};
  return linear_rows(x, N, [&](const DenseGemm& g) {
    blocks_gemm(g, (N + 15) / 16, [&](int64_t blk, int J, float* panel) {
      int4_panel(w, blk, J, g.K, panel);
      return static_cast<const float*>(panel);
    }, BiasOut{g, bias_ptr});
  });
}

}  // namespace qcompile_cpu
