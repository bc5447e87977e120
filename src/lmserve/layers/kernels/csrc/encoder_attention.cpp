// An encoder step's attention: every sequence attends over all of its own tokens (bidirectional, no KV cache),
// straight from the step's packed qkv rows, float32 CPU.
//
// Why: the PyTorch path lays the step's sequences out padded (groups of near lengths), runs torch's CPU flash
// attention with a key mask and gathers the rows back. For all-MiniLM-L6-v2 (12 heads of 32) on a step of ~2,000
// tokens in sequences of 16-128 that was ~20% of a layer's CPU time, about as much as its output projection,
// for ~3% of its multiply-adds: the copies, the mask and the small head size cost more than the arithmetic.
// Here one task is one (sequence, head): its keys are copied once, transposed ([D, L]: 8 keys' scores are one
// register summed over the D dimensions), its values as rows [L, D]. Its queries then run in blocks (QB below):
// the block's scores, each row's softmax (exp by simd_avx2.h's polynomial) and the weighted sums of values (the
// block's output rows in registers), so every key or value vector loaded serves QB queries. No padding, no mask,
// no gather. Builds without AVX2, or a head size that is not a multiple of 8 (values), run plain loops.
// `window` >= 0: a query at i sees only keys i - window .. i + window (ModernBERT's local layers).
//
// Numerics: each output row is one fixed chain over its own sequence's keys, whatever the batch or the thread
// that computes it, so a sequence's vector never depends on what shares its step.

#include "kernels.h"
#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "simd_avx2.h"

namespace {

#if defined(__AVX2__) && defined(__FMA__)
#define LMSERVE_ENC_SIMD 1
// One multiply-add, rounded once as the vector lanes' fmadd: a score or output in a scalar tail gets the bits it
// would get in a lane.
inline float madd(float a, float b, float c) { return std::fma(a, b, c); }
#else
inline float madd(float a, float b, float c) { return a * b + c; }
#endif

// Queries run in blocks of QB: each key vector (or value row) loaded is used by QB queries' chains, where one query
// at a time loaded a vector per multiply-add and its loads, not its multiply-adds, set the pace. With AVX-512VL's
// 32 ymm registers a pass holds 4 x 4 accumulators and 4 loaded vectors. On AVX2 the scores' 4 x 3 accumulators, 3
// key vectors and the broadcast take all 16 (the scale may spill); measured on x86-64-v3 against 2 x 4 (one layer of
// MiniLM over 2,048 tokens): 5.9-6.5 against 6.9-7.7 ms.
// KS key vectors (8 keys each) per pass of the scores, NV value vectors (8 dims each) per pass of the values.
constexpr int QB = 4;
#if defined(__AVX512F__) && defined(__AVX512VL__)
constexpr int KS = 4, NV = 4;
#else
constexpr int KS = 3, NV = 2;
#endif

// Q queries' scores (times scale) over keys [lo, hi) into s + i * L: query i's row is q + i * row; kt is [D, L].
// Every score is one chain over d (fmadd, rounded once per step), whichever lane or tail computes it.
template <int Q>
void block_scores(const float* q, int64_t row, const float* kt, int64_t L, int64_t D, float scale, int64_t lo,
                  int64_t hi, float* s) {
  int64_t j = lo;
#ifdef LMSERVE_ENC_SIMD
  const __m256 vscale = _mm256_set1_ps(scale);
  for (; j + 8 * KS <= hi; j += 8 * KS) {
    __m256 acc[Q][KS];
    for (auto& a : acc)
      for (auto& r : a) r = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      __m256 k[KS];
      for (int r = 0; r < KS; ++r) k[r] = _mm256_loadu_ps(kt + d * L + j + 8 * r);
      for (int i = 0; i < Q; ++i) {
        const __m256 qd = _mm256_set1_ps(q[i * row + d]);
        for (int r = 0; r < KS; ++r) acc[i][r] = _mm256_fmadd_ps(qd, k[r], acc[i][r]);
      }
    }
    for (int i = 0; i < Q; ++i)
      for (int r = 0; r < KS; ++r) _mm256_storeu_ps(s + i * L + j + 8 * r, _mm256_mul_ps(acc[i][r], vscale));
  }
  for (; j + 8 <= hi; j += 8) {
    __m256 acc[Q];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m256 k = _mm256_loadu_ps(kt + d * L + j);
      for (int i = 0; i < Q; ++i) acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(q[i * row + d]), k, acc[i]);
    }
    for (int i = 0; i < Q; ++i) _mm256_storeu_ps(s + i * L + j, _mm256_mul_ps(acc[i], vscale));
  }
#endif
  for (; j < hi; ++j)
    for (int i = 0; i < Q; ++i) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc = madd(q[i * row + d], kt[d * L + j], acc);
      s[i * L + j] = acc * scale;
    }
}

// A score row over [lo, hi) -> its probabilities, unnormalised (e^(s - max)); returns their sum.
float softmax_row(float* sc, int64_t lo, int64_t hi) {
  float m = sc[lo];
  for (int64_t i = lo + 1; i < hi; ++i) m = sc[i] > m ? sc[i] : m;
  float sum = 0.f;
  int64_t j = lo;
#ifdef LMSERVE_ENC_SIMD
  __m256 vsum = _mm256_setzero_ps();
  for (; j + 8 <= hi; j += 8) {
    const __m256 e = lmserve_simd::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sc + j), _mm256_set1_ps(m)));
    _mm256_storeu_ps(sc + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  sum = lmserve_simd::hsum(vsum);
#endif
  for (; j < hi; ++j) {
    sc[j] = std::exp(sc[j] - m);
    sum += sc[j];
  }
  return sum;
}

#ifdef LMSERVE_ENC_SIMD
// N vectors of Q output rows from d0: o_i = inv_i * sum over j in [lo, hi) of p_i[j] * v[j] (p row i at p + i * L),
// one chain over j per output value
template <int Q, int N>
void block_values_part(const float* p, int64_t L, const float* v, int64_t D, int64_t d0, int64_t lo, int64_t hi,
                       const float* inv, float* o, int64_t o_row) {
  __m256 acc[Q][N];
  for (auto& a : acc)
    for (auto& r : a) r = _mm256_setzero_ps();
  for (int64_t j = lo; j < hi; ++j) {
    __m256 vj[N];
    for (int r = 0; r < N; ++r) vj[r] = _mm256_loadu_ps(v + j * D + d0 + 8 * r);
    for (int i = 0; i < Q; ++i) {
      const __m256 pij = _mm256_set1_ps(p[i * L + j]);
      for (int r = 0; r < N; ++r) acc[i][r] = _mm256_fmadd_ps(pij, vj[r], acc[i][r]);
    }
  }
  for (int i = 0; i < Q; ++i)
    for (int r = 0; r < N; ++r)
      _mm256_storeu_ps(o + i * o_row + d0 + 8 * r, _mm256_mul_ps(acc[i][r], _mm256_set1_ps(inv[i])));
}
#endif

// Q output rows (o + i * o_row) from their probability rows; keys outside a row's own window hold p = 0, which
// adds exactly nothing to its chains
template <int Q>
void block_values(const float* p, int64_t L, const float* v, int64_t D, int64_t lo, int64_t hi, const float* inv,
                  float* o, int64_t o_row) {
  int64_t d0 = 0;
#ifdef LMSERVE_ENC_SIMD
  if (D % 8 == 0) {
    for (; d0 + 8 * NV <= D; d0 += 8 * NV) block_values_part<Q, NV>(p, L, v, D, d0, lo, hi, inv, o, o_row);
    for (; d0 < D; d0 += 8) block_values_part<Q, 1>(p, L, v, D, d0, lo, hi, inv, o, o_row);
    return;
  }
#endif
  for (int i = 0; i < Q; ++i) {  // value rows in order, each output value's chain over j
    float* oi = o + i * o_row;
    std::fill(oi, oi + D, 0.f);
    for (int64_t j = lo; j < hi; ++j)
      for (int64_t d = 0; d < D; ++d) oi[d] = madd(p[i * L + j], v[j * D + d], oi[d]);
    for (int64_t d = 0; d < D; ++d) oi[d] *= inv[i];
  }
}

// queries [i0, i0 + Q) of one (sequence, head): scores over the block's keys, each row's softmax over its own
// window, then the weighted values
template <int Q>
void query_block(const float* q, int64_t row, const float* kt, const float* v, int64_t L, int64_t D, float scale,
                 int64_t window, int64_t i0, float* s, float* o, int64_t o_row) {
  int64_t lo[Q], hi[Q];
  for (int i = 0; i < Q; ++i) {
    lo[i] = window >= 0 ? std::max<int64_t>(0, i0 + i - window) : 0;
    hi[i] = window >= 0 ? std::min<int64_t>(L, i0 + i + window + 1) : L;
  }
  const int64_t first = lo[0], last = hi[Q - 1];  // the block's keys: windows move right with the query
  block_scores<Q>(q, row, kt, L, D, scale, first, last, s);
  float inv[Q];
  for (int i = 0; i < Q; ++i) {
    float* si = s + i * L;
    inv[i] = 1.f / softmax_row(si, lo[i], hi[i]);
    std::fill(si + first, si + lo[i], 0.f);
    std::fill(si + hi[i], si + last, 0.f);
  }
  block_values<Q>(s, L, v, D, first, last, inv, o, o_row);
}

template <int Q>
void tail_block(int n, const float* q, int64_t row, const float* kt, const float* v, int64_t L, int64_t D,
                float scale, int64_t window, int64_t i0, float* s, float* o, int64_t o_row) {
  if constexpr (Q > 0) {
    if (n == Q) return query_block<Q>(q, row, kt, v, L, D, scale, window, i0, s, o, o_row);
    tail_block<Q - 1>(n, q, row, kt, v, L, D, scale, window, i0, s, o, o_row);
  }
}

}  // namespace

void lmserve::encoder_attention(const float* qkv, const int64_t* starts, int64_t B, int64_t H, int64_t D, float scale,
                                int64_t window, float* out) {
  const int64_t row = 3 * H * D;  // floats between one token's qkv and the next's
  lmserve::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt, v, s;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H, first = starts[b], L = starts[b + 1] - first;
      kt.resize(D * L);
      v.resize(L * D);
      s.resize(QB * L);
      const float* base = qkv + first * row + h * D;  // token 0's q of head h; its k at + H * D, v at + 2 * H * D
      for (int64_t j = 0; j < L; ++j) {
        const float* k = base + j * row + H * D;
        std::copy(k + H * D, k + H * D + D, v.data() + j * D);
        for (int64_t d = 0; d < D; ++d) kt[d * L + j] = k[d];
      }
      int64_t i = 0;
      for (; i + QB <= L; i += QB)
        query_block<QB>(base + i * row, row, kt.data(), v.data(), L, D, scale, window, i, s.data(),
                        out + (first + i) * H * D + h * D, H * D);
      if (i < L)  // the last L % QB queries: the same chains in a smaller block
        tail_block<QB - 1>(static_cast<int>(L - i), base + i * row, row, kt.data(), v.data(), L, D, scale, window, i,
                           s.data(), out + (first + i) * H * D + h * D, H * D);
    }
  });
}
