// Skinny matmul y = x W^T (+ b) for a few rows of x (decode steps of one to a few sequences), float32 CPU.
//
// Why: at batch 1 a decode step is ~120 matrix-vector products over small matrices, and oneDNN's GEMM
// streams them at ~13 GB/s here against ~21 GB/s of memory bandwidth (per-call set-up, short streams
// per thread). This kernel reads W from a panel layout [N/16][K][16], one contiguous stream per thread.
//
// Numerics: each output is one chain of fused multiply-adds over k in order, restarted every kBlock
// inputs with the block sums added in order (then + bias) -- the order oneDNN's AVX2 GEMM uses, so
// results are bit-identical to it and a sequence's tokens do not depend on whether its step ran here or
// in oneDNN with a larger batch. layers/linear.py checks that equality on every layer at load and keeps
// oneDNN alone where it does not hold (other CPUs, other oneDNN versions).
//
// Rows go four at a time through each weight block (8 accumulators + 2 weight registers + the broadcast:
// 11 of AVX2's 16 registers), then the last 1-3 rows in one more pass, so a verify step of 5-8 rows makes
// two passes over each block where pairs made three or four; the 8 independent FMA chains of a 4-row pass
// also cover the FMA latency (4 cycles x 2 pipes on Zen 3) that 4 chains of a pair leave half idle.
// Grouping never changes a row's arithmetic: its chain is the same in every group size.

#include "ops.h"

#include <ATen/Parallel.h>

#include <cmath>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 16;   // output columns per panel: two 8-float registers
constexpr int64_t kBlock = 1024;  // inputs per FMA chain before its sum is added to the output

// rows [m0, m0 + MR) of x against one panel, K-block [k0, k1): acc = chain, then y = first ? acc : y + acc
#if defined(__AVX2__) && defined(__FMA__)
template <int MR>
inline void panel_block(const float* x, int64_t K, const float* panel, int64_t k0, int64_t k1, float* y,
                        int64_t ldy, bool first) {
  __m256 lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel), w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * K + k);
      lo[r] = _mm256_fmadd_ps(a, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, w1, hi[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    float* out = y + r * ldy;
    if (!first) {
      lo[r] = _mm256_add_ps(_mm256_loadu_ps(out), lo[r]);
      hi[r] = _mm256_add_ps(_mm256_loadu_ps(out + 8), hi[r]);
    }
    _mm256_storeu_ps(out, lo[r]);
    _mm256_storeu_ps(out + 8, hi[r]);
  }
}
#else
// The same arithmetic one column at a time (std::fma is the fused multiply-add the vector path uses).
template <int MR>
inline void panel_block(const float* x, int64_t K, const float* panel, int64_t k0, int64_t k1, float* y,
                        int64_t ldy, bool first) {
  for (int r = 0; r < MR; ++r)
    for (int64_t c = 0; c < kPanel; ++c) {
      float acc = 0.f;
      for (int64_t k = k0; k < k1; ++k) acc = std::fma(x[r * K + k], panel[k * kPanel + c], acc);
      y[r * ldy + c] = first ? acc : y[r * ldy + c] + acc;
    }
}
#endif

// the last 0-3 rows in one pass over the block
inline void rows_block(int64_t rows, const float* x, int64_t K, const float* panel, int64_t k0, int64_t k1, float* y,
                       int64_t ldy, bool first) {
  switch (rows) {
    case 3: panel_block<3>(x, K, panel, k0, k1, y, ldy, first); break;
    case 2: panel_block<2>(x, K, panel, k0, k1, y, ldy, first); break;
    case 1: panel_block<1>(x, K, panel, k0, k1, y, ldy, first); break;
    default: break;
  }
}

}  // namespace

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor panels, int64_t out_features,
                            c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && panels.scalar_type() == torch::kFloat,
              "skinny_linear: float32 CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == kPanel && panels.size(1) == x.size(1),
              "skinny_linear: expected x [M, K] and panels [N/16, K, 16]");
  TORCH_CHECK(panels.is_contiguous() && out_features <= panels.size(0) * kPanel, "skinny_linear: bad panels");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  // padded to whole panels while computing; the caller sees [M, out_features]
  auto y = torch::empty({M, P * kPanel}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldy = P * kPanel;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = pp + p * K * kPanel;
      for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
        const int64_t k1 = std::min(K, k0 + kBlock);
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) panel_block<4>(xp + m * K, K, panel, k0, k1, yp + m * ldy + p * kPanel, ldy, k0 == 0);
        rows_block(M - m, xp + m * K, K, panel, k0, k1, yp + m * ldy + p * kPanel, ldy, k0 == 0);
      }
    }
  });
  auto out = out_features == ldy ? y : y.narrow(1, 0, out_features);
  if (bias.has_value()) out = out + *bias;
  return out;
}
