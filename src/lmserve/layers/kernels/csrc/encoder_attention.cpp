// An encoder step's attention: every sequence attends over all of its own tokens (bidirectional, no KV cache),
// straight from the step's packed qkv rows, float32 CPU.
//
// Why: the PyTorch path lays the step's sequences out padded (groups of near lengths), runs torch's CPU flash
// attention with a key mask and gathers the rows back. For all-MiniLM-L6-v2 (12 heads of 32) on a step of ~2,000
// tokens in sequences of 16-128 that was ~20% of a layer's CPU time, about as much as its output projection,
// for ~3% of its multiply-adds: the copies, the mask and the small head size cost more than the arithmetic.
// Here one task is one (sequence, head): its keys are copied once, transposed ([D, L]: 8 keys' scores are one
// register summed over the D dimensions), its values as rows [L, D]; each query's scores, softmax (exp by
// simd_avx2.h's polynomial) and weighted sum of values (the [D] output row in registers) follow in one pass. No
// padding, no mask, no gather. Builds without AVX2, or a head size that is not a multiple of 8, run plain loops.
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

// one query's probabilities (unnormalised, in sc[lo, hi)) and their sum: scores from q (scaled) and kt [D, L]
float scores_softmax(const float* q, const float* kt, int64_t L, int64_t D, float scale, int64_t lo, int64_t hi,
                     float* sc) {
  int64_t j = lo;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vscale = _mm256_set1_ps(scale);
  for (; j + 32 <= hi; j += 32) {  // 4 blocks of 8 keys: 4 independent multiply-add chains (their latency hidden)
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m256 qd = _mm256_set1_ps(q[d]);
      const float* k = kt + d * L + j;
      a0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k), a0);
      a1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + 8), a1);
      a2 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + 16), a2);
      a3 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + 24), a3);
    }
    _mm256_storeu_ps(sc + j, _mm256_mul_ps(a0, vscale));
    _mm256_storeu_ps(sc + j + 8, _mm256_mul_ps(a1, vscale));
    _mm256_storeu_ps(sc + j + 16, _mm256_mul_ps(a2, vscale));
    _mm256_storeu_ps(sc + j + 24, _mm256_mul_ps(a3, vscale));
  }
  for (; j + 8 <= hi; j += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) acc = _mm256_fmadd_ps(_mm256_set1_ps(q[d]), _mm256_loadu_ps(kt + d * L + j), acc);
    _mm256_storeu_ps(sc + j, _mm256_mul_ps(acc, vscale));
  }
#endif
  for (; j < hi; ++j) {
    float acc = 0.f;
    for (int64_t d = 0; d < D; ++d) acc += q[d] * kt[d * L + j];
    sc[j] = acc * scale;
  }
  float m = sc[lo];
  for (int64_t i = lo + 1; i < hi; ++i) m = sc[i] > m ? sc[i] : m;
  float sum = 0.f;
  j = lo;
#if defined(__AVX2__) && defined(__FMA__)
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

// o [D] = sum over j in [lo, hi) of p[j] * v[j] (rows of D), times inv
void weighted_values(const float* p, const float* v, int64_t D, int64_t lo, int64_t hi, float inv, float* o) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    for (int64_t d0 = 0; d0 < D; d0 += 32) {  // up to 4 registers of the output row at a time
      const int64_t n = std::min<int64_t>(4, (D - d0) / 8);
      // even and odd keys in separate accumulators: twice the independent chains, added once at the end
      __m256 acc[2][4];
      for (auto& half : acc)
        for (auto& a : half) a = _mm256_setzero_ps();
      int64_t j = lo;
      for (; j + 2 <= hi; j += 2) {
        const __m256 p0 = _mm256_set1_ps(p[j]), p1 = _mm256_set1_ps(p[j + 1]);
        const float* v0 = v + j * D + d0;
        for (int64_t r = 0; r < n; ++r) {
          acc[0][r] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * r), acc[0][r]);
          acc[1][r] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v0 + D + 8 * r), acc[1][r]);
        }
      }
      if (j < hi) {
        const __m256 p0 = _mm256_set1_ps(p[j]);
        for (int64_t r = 0; r < n; ++r) acc[0][r] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v + j * D + d0 + 8 * r), acc[0][r]);
      }
      for (int64_t r = 0; r < n; ++r)
        _mm256_storeu_ps(o + d0 + 8 * r, _mm256_mul_ps(_mm256_add_ps(acc[0][r], acc[1][r]), _mm256_set1_ps(inv)));
    }
    return;
  }
#endif
  for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
  for (int64_t j = lo; j < hi; ++j)
    for (int64_t d = 0; d < D; ++d) o[d] += p[j] * v[j * D + d];
  for (int64_t d = 0; d < D; ++d) o[d] *= inv;
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
      s.resize(L);
      const float* base = qkv + first * row + h * D;  // token 0's q of head h; its k at + H * D, v at + 2 * H * D
      for (int64_t j = 0; j < L; ++j) {
        const float* k = base + j * row + H * D;
        std::copy(k + H * D, k + H * D + D, v.data() + j * D);
        for (int64_t d = 0; d < D; ++d) kt[d * L + j] = k[d];
      }
      for (int64_t i = 0; i < L; ++i) {
        const int64_t lo = window >= 0 ? std::max<int64_t>(0, i - window) : 0;
        const int64_t hi = window >= 0 ? std::min<int64_t>(L, i + window + 1) : L;
        const float sum = scores_softmax(base + i * row, kt.data(), L, D, scale, lo, hi, s.data());
        weighted_values(s.data(), v.data(), D, lo, hi, 1.f / sum, out + (first + i) * H * D + h * D);
      }
    }
  });
}
