// Skinny matmul y = x W^T (+ b) for a few rows of x (decode steps of one to a few sequences), float32 CPU.
// The weights are float32, or bfloat16 / float16 (an unquantized LM head held in its checkpoint's dtype: half the
// bytes a step reads); a half weight is widened to float32 exactly as it is loaded (bf16: a 16-bit shift; fp16:
// F16C's vcvtph2ps), so a half panel gives bit for bit what skinny_linear gives on the same panel upcast to float32.
//
// Why: at batch 1 a decode step is ~120 matrix-vector products over small matrices, and oneDNN's GEMM
// streams them at ~13 GB/s here against ~21 GB/s of memory bandwidth (per-call set-up, short streams
// per thread). This kernel reads W from a panel layout [N/16][K][16], one contiguous stream per thread.
//
// Numerics: each output is one chain of fused multiply-adds over k in order, restarted every kBlock
// inputs with the block sums added in order (then + bias) -- the order oneDNN's AVX2 GEMM uses, so
// results are bit-identical to it and a sequence's tokens do not depend on whether its step ran here or
// in oneDNN with a larger batch. layers/formats/linear.py checks that equality on every layer at load and keeps
// oneDNN alone where it does not hold (other CPUs, other oneDNN versions).
//
// Rows (up to kSlab at once) go through a panel four at a time (8 accumulators + 2 weight registers + the
// broadcast: 11 of AVX2's 16 registers; 8 independent chains cover the FMA latency, 4 cycles x 2 pipes on
// Zen 3), then the last 1-3 rows, kChunk inputs at a time: every group runs over a 4 KB chunk of the panel
// while it is in L1, the chains parked in a small buffer between chunks, so a verify step of 5-8 rows
// streams each panel from memory once, with no second pass over it from L2. A chain parked and resumed
// is the same chain: grouping and chunking never change a row's arithmetic. Measured on the embedded
// model's layers (AMD EPYC Zen 3, 2 threads), all linear layers of one forward with M rows against rows
// in pairs, each pair a pass over the whole panel: M = 5 45.6 -> 37.3 ms, M = 8 55.6 -> 41.2 ms, M = 1-2
// unchanged (30 ms); oneDNN takes 49-59 ms at M = 5-8 (benchmarks/results/skinny_rows.md).

#include "kernels.h"

#include "thread_pool.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 16;    // output columns per panel: two 8-float registers
static_assert(kPanel == lmserve::kPanelWidth);
constexpr int64_t kBlock = 1024;  // inputs per FMA chain before its sum is added to the output
constexpr int64_t kChunk = 64;    // inputs per pass of a row group: 4 KB of panel, read from L1 by the next group
constexpr int64_t kSlab = 8;      // rows whose chains share one pass over a panel (acc buffer: 512 bytes)

// rows [0, MR) of x continue their chains over k in [k0, k1) of one panel; acc [MR][16] carries them
// between chunks (fresh: start at zero). W: float, c10::BFloat16 or c10::Half (the panel's element type).
#if defined(__AVX2__) && defined(__FMA__)
// the 16 weights of one panel row (k) as two 8-float registers, widened exactly
inline void load16(const float* p, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(p);
  w1 = _mm256_loadu_ps(p + 8);
}
inline void load16(const c10::BFloat16* p, __m256& w0, __m256& w1) {  // bf16 is float32's top 16 bits
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16));
  w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16));
}
inline void load16(const c10::Half* p, __m256& w0, __m256& w1) {  // F16C: every AVX2 level has it
  w0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  w1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}

template <int MR, typename W>
inline void panel_chain(const float* x, int64_t K, const W* panel, int64_t k0, int64_t k1, float* acc,
                        bool fresh) {
  __m256 lo[MR], hi[MR];
  // fully unrolled: GCC 12 otherwise keeps a stack copy of the 4-row accumulators, stored every k
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
    lo[r] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * kPanel);
    hi[r] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * kPanel + 8);
  }
  for (int64_t k = k0; k < k1; ++k) {
    __m256 w0, w1;
    load16(panel + k * kPanel, w0, w1);
    // keep w0, w1 in registers: GCC otherwise folds the loads into every row's FMA, 12 loads per k
    // for 4 rows instead of 6 (LM head at 8 rows: 8.0 -> 7.2 ms)
    asm("" : "+x"(w0), "+x"(w1));
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * K + k);
      lo[r] = _mm256_fmadd_ps(a, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, w1, hi[r]);
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(acc + r * kPanel, lo[r]);
    _mm256_storeu_ps(acc + r * kPanel + 8, hi[r]);
  }
}
#else
// The same arithmetic one column at a time (std::fma is the fused multiply-add the vector path uses; a half weight
// is widened by c10's exact conversion).
template <int MR, typename W>
inline void panel_chain(const float* x, int64_t K, const W* panel, int64_t k0, int64_t k1, float* acc,
                        bool fresh) {
  for (int r = 0; r < MR; ++r)
    for (int64_t c = 0; c < kPanel; ++c) {
      float a = fresh ? 0.f : acc[r * kPanel + c];
      for (int64_t k = k0; k < k1; ++k) a = std::fma(x[r * K + k], static_cast<float>(panel[k * kPanel + c]), a);
      acc[r * kPanel + c] = a;
    }
}
#endif

// one group of 1-4 rows (the template argument must be a constant)
template <typename W>
inline void group_chain(int64_t rows, const float* x, int64_t K, const W* panel, int64_t k0, int64_t k1,
                        float* acc, bool fresh) {
  switch (rows) {
    case 4: panel_chain<4>(x, K, panel, k0, k1, acc, fresh); break;
    case 3: panel_chain<3>(x, K, panel, k0, k1, acc, fresh); break;
    case 2: panel_chain<2>(x, K, panel, k0, k1, acc, fresh); break;
    default: panel_chain<1>(x, K, panel, k0, k1, acc, fresh); break;
  }
}

// rows [0, rows) (at most kSlab) against one panel, K-block [k0, k1): chains chunk by chunk, then
// y = block sum (first block) or y + block sum
template <typename W>
inline void slab_block(int64_t rows, const float* x, int64_t K, const W* panel, int64_t k0, int64_t k1,
                       float* y, int64_t ldy) {
  alignas(64) float acc[kSlab * kPanel];
  for (int64_t c0 = k0; c0 < k1; c0 += kChunk) {
    const int64_t c1 = std::min(k1, c0 + kChunk);
    for (int64_t m = 0; m < rows; m += 4)
      group_chain(std::min<int64_t>(4, rows - m), x + m * K, K, panel, c0, c1, acc + m * kPanel, c0 == k0);
  }
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t c = 0; c < kPanel; ++c)
      y[m * ldy + c] = k0 == 0 ? acc[m * kPanel + c] : y[m * ldy + c] + acc[m * kPanel + c];
}

#if defined(__AVX2__) && defined(__FMA__)
// One row against two panels at once over k in [k0, k1): four FMA chains and two weight streams. A half panel's
// one row alone (two chains, the widening between load and FMA) streamed 7.3 GB/s where float32 and Q8_0 reach
// ~9.5 (benchmarks/results/prequant_decode.md). Each output's chain is panel_chain<1>'s, so are its bits.
template <typename W>
inline void pair_block(const float* x, const W* p0, const W* p1, int64_t k0, int64_t k1, float* y0, float* y1) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    __m256 w0, w1, v0, v1;
    load16(p0 + k * kPanel, w0, w1);
    load16(p1 + k * kPanel, v0, v1);
    const __m256 a = _mm256_broadcast_ss(x + k);
    a0 = _mm256_fmadd_ps(a, w0, a0);
    a1 = _mm256_fmadd_ps(a, w1, a1);
    b0 = _mm256_fmadd_ps(a, v0, b0);
    b1 = _mm256_fmadd_ps(a, v1, b1);
  }
  alignas(32) float acc[4 * 8];
  _mm256_store_ps(acc, a0);
  _mm256_store_ps(acc + 8, a1);
  _mm256_store_ps(acc + 16, b0);
  _mm256_store_ps(acc + 24, b1);
  for (int64_t c = 0; c < kPanel; ++c) {
    y0[c] = k0 == 0 ? acc[c] : y0[c] + acc[c];
    y1[c] = k0 == 0 ? acc[16 + c] : y1[c] + acc[16 + c];
  }
}
#endif

// y [M, P * 16] = x [M, K] times every panel (W: the panels' element type), one parallel_for over the panels
template <typename W>
void skinny_panels(const float* xp, int64_t M, int64_t K, const W* pp, int64_t P, float* yp) {
  const int64_t ldy = P * kPanel;
  lmserve::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    int64_t p = begin;
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (!std::is_same_v<W, float>) {  // half panels, one row: two panels a pass
      for (; M == 1 && p + 1 < end; p += 2)
        for (int64_t k0 = 0; k0 < K; k0 += kBlock)
          pair_block(xp, pp + p * K * kPanel, pp + (p + 1) * K * kPanel, k0, std::min(K, k0 + kBlock),
                     yp + p * kPanel, yp + (p + 1) * kPanel);
    }
#endif
    for (; p < end; ++p) {
      const W* panel = pp + p * K * kPanel;
      for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
        const int64_t k1 = std::min(K, k0 + kBlock);
        for (int64_t m = 0; m < M; m += kSlab)
          slab_block(std::min(kSlab, M - m), xp + m * K, K, panel, k0, k1, yp + m * ldy + p * kPanel, ldy);
      }
    }
  });
}

}  // namespace

void lmserve::skinny_matmul(const float* xp, int64_t M, int64_t K, const void* panels, PanelType type, int64_t P,
                            float* yp) {
  if (type == PanelType::kBFloat16) skinny_panels(xp, M, K, static_cast<const c10::BFloat16*>(panels), P, yp);
  else if (type == PanelType::kHalf) skinny_panels(xp, M, K, static_cast<const c10::Half*>(panels), P, yp);
  else skinny_panels(xp, M, K, static_cast<const float*>(panels), P, yp);
}

// A mixture of experts' grouped projection over panels: rows [offsets[e], offsets[e + 1]) of x times expert e's
// panels [E, N/16, K, 16], one parallel_for over every (expert, panel) pair. Each row's chains are skinny_linear's
// for its expert alone, so the bits equal one call per expert (and oneDNN's, where the load-time check passed).
void lmserve::skinny_experts_matmul(const float* xp, int64_t K, const int64_t* off, int64_t E, const float* pp,
                                    int64_t P, float* yp) {
  const int64_t ldy = P * kPanel;
  lmserve::parallel_for(0, E * P, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = i / P, p = i % P, r0 = off[e], M = off[e + 1] - r0;
      const float* panel = pp + i * K * kPanel;  // panel p of expert e: [E * P] panels in a row
      for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
        const int64_t k1 = std::min(K, k0 + kBlock);
        for (int64_t m = 0; m < M; m += kSlab)
          slab_block(std::min(kSlab, M - m), xp + (r0 + m) * K, K, panel, k0, k1, yp + (r0 + m) * ldy + p * kPanel,
                     ldy);
      }
    }
  });
}
