// The float32 GEMM tiles that dense_linear, int4_dense_linear and (below AVX512-BF16)
// fp8_linear_codes share: y = x W^T on a weight laid out in panels of blocks of 16 output channels,
// float32 [blocks, K, 16] (for each block, the 16 channels' weights of each input channel in one
// vector). A tile of J blocks and MB rows keeps its MB x J sums in registers over the whole of K,
// and each thread takes a run of blocks, so the weight is read from memory once, as one stream per
// block, whatever the number of rows. Each output is the float32 multiply-add chain over k = 0..K-1
// of its own row, so a row's result does not change with the batch it is in (oneDNN's and MKL's
// choose their blocking, and so the order of the sums, by the batch), nor with the ISA level: AVX2's
// FMA is AVX-512's, one rounding each, in the same order.
#pragma once

#include <utility>

#include "common.h"

namespace qcompile_cpu {

struct DenseGemm {
  const float* x;  // [M, K]
  int64_t M, K;
  float* y;  // [M, N]
  int64_t N;
};

// A tile's shape: its sums fill most of the vector registers (a block's 16 sums take one AVX-512
// register, two AVX2 ones) and leave room for the J weight vectors and a row's broadcast.
#if QC_AVX512
constexpr int kTileBlocks = 3, kTileRows = 8;  // 24 of 32 registers
#else
constexpr int kTileBlocks = 1, kTileRows = 6;  // 12 of 16 registers
#endif
// Blocks a thread's panel holds at a time (a panel built for them stays in its cache).
constexpr int kPanelBlocks = 3;

// Rows [m0, m0 + MB) of a tile of J blocks from channel n0: the sums over K, then out(row, n, count,
// sums) writes channels n..n+count-1 of a row (the bias, scales: the caller's epilogue).
template <int J, int MB, typename Out>
void dense_tile(const DenseGemm& g, const float* panel, int64_t m0, int64_t n0, const Out& out) {
  constexpr int R = J * kRegsPerBlock;  // the registers a row's sums take
  Reg acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = reg_zero();
  const float* x = g.x + m0 * g.K;
  for (int64_t k = 0; k < g.K; ++k) {
    Reg w[R];
    for (int r = 0; r < R; ++r) w[r] = reg_load(panel + ((r / kRegsPerBlock) * g.K + k) * 16 + (r % kRegsPerBlock) * kRegLanes);
    for (int m = 0; m < MB; ++m) {
      const Reg xb = reg_broadcast(x[m * g.K + k]);
      for (int r = 0; r < R; ++r) acc[m][r] = reg_fmadd(xb, w[r], acc[m][r]);
    }
  }
  for (int j = 0; j < J; ++j) {
    const int64_t n = n0 + 16 * j, count = std::min<int64_t>(16, g.N - n);
    for (int m = 0; m < MB; ++m) out(m0 + m, n, count, block_of(&acc[m][j * kRegsPerBlock]));
  }
}

template <int J, typename Out, int... MB>
void dense_rows_of(const DenseGemm& g, const float* panel, int64_t n0, const Out& out, std::integer_sequence<int, MB...>) {
  using Tile = void (*)(const DenseGemm&, const float*, int64_t, int64_t, const Out&);
  static constexpr Tile tiles[] = {nullptr, dense_tile<J, MB + 1, Out>...};
  for (int64_t m = 0; m < g.M; m += kTileRows) tiles[std::min<int64_t>(kTileRows, g.M - m)](g, panel, m, n0, out);
}

// Every row against J (<= kTileBlocks) blocks: in tiles of kTileRows rows and the rest; the
// panel stays in the core's cache from the first tile on.
template <int J, typename Out>
void dense_rows(const DenseGemm& g, const float* panel, int64_t n0, const Out& out) {
  dense_rows_of<J>(g, panel, n0, out, std::make_integer_sequence<int, kTileRows>());
}

template <typename Out, int... J>
void panel_rows_of(const DenseGemm& g, const float* panel, int blocks, int64_t n0, const Out& out,
                   std::integer_sequence<int, J...>) {
  if (g.M == 1) {  // one row: the panel's blocks in one tile, their sums independent chains (FMA's latency)
    using Tile = void (*)(const DenseGemm&, const float*, int64_t, int64_t, const Out&);
    static constexpr Tile one_row[] = {nullptr, dense_tile<1, 1, Out>, dense_tile<2, 1, Out>, dense_tile<3, 1, Out>};
    static_assert(kPanelBlocks == 3);
    return one_row[blocks](g, panel, 0, n0, out);
  }
  using Rows = void (*)(const DenseGemm&, const float*, int64_t, const Out&);
  static constexpr Rows rows[] = {nullptr, dense_rows<J + 1, Out>...};
  for (int j = 0; j < blocks; j += kTileBlocks)
    rows[std::min(kTileBlocks, blocks - j)](g, panel + j * g.K * 16, n0 + 16 * j, out);
}

// A thread's scratch, kept from call to call: a buffer made per call (hundreds of KB a layer) would
// be mapped and zeroed by the OS every time, which cost a decode step more than its arithmetic.
template <typename T>
std::vector<T>& thread_scratch(size_t size) {
  static thread_local std::vector<T> scratch;
  if (scratch.size() < size) scratch.resize(size);
  return scratch;
}

// Each thread takes a run of the n_blocks blocks, kPanelBlocks at a time: panel(b, J, buffer)
// gives blocks b..b+J-1's float32 weights in the panel layout (in place, or built in buffer, a
// thread's scratch of kPanelBlocks * K * 16 floats).
template <typename Panel, typename Out>
void blocks_gemm(const DenseGemm& g, int64_t n_blocks, Panel&& panel, const Out& out) {
  at::parallel_for(0, n_blocks, 1, [&](int64_t begin, int64_t end) {
    float* buffer = thread_scratch<float>(kPanelBlocks * g.K * 16).data();
    for (int64_t b = begin; b < end; b += kPanelBlocks) {
      const int J = static_cast<int>(std::min<int64_t>(kPanelBlocks, end - b));
      panel_rows_of(g, panel(b, J, buffer), J, b * 16, out, std::make_integer_sequence<int, kTileBlocks>());
    }
  });
}

// The plain epilogue: y = the sums plus the bias.
struct BiasOut {
  const DenseGemm& g;
  const float* bias;  // [N] or null
  void operator()(int64_t m, int64_t n, int64_t count, Vec16 sums) const {
    if (bias) sums = sums + Vec16::load_first(bias + n, count);
    sums.store_first(g.y + m * g.N + n, count);
  }
};

// x [..., K] float32 times a weight of N outputs: run(g) fills g.y [M, N] for the rows of x.
template <typename Run>
at::Tensor linear_rows(const at::Tensor& x, int64_t N, Run&& run) {
  const int64_t K = x.size(-1);
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  at::Tensor y = at::empty({x2.size(0), N}, x.options());
  const DenseGemm g{x2.data_ptr<float>(), x2.size(0), K, y.data_ptr<float>(), N};
  if (g.M > 0 && N > 0) run(g);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return y.view(shape);
}

inline const float* bias_data(const c10::optional<at::Tensor>& bias, int64_t N, at::Tensor& keep) {
  if (!bias) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "bias must be float32 [N]");
  keep = bias->contiguous();
  return keep.data_ptr<float>();
}

}  // namespace qcompile_cpu
