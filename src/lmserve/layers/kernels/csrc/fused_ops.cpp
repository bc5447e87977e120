// Row-wise elementwise ops of a decoder layer, fused into one pass each (CPU, float32).
//
// Why: at batch 1 a decode step is ~600 small PyTorch ops, and each tiny op costs 5-50 us of dispatch
// and temporaries (F.rms_norm alone is six ops, ~100 us per call on a [1, 576] row here): ~30% of the
// step. Each op below is one call that reads its rows once. Every row is computed alone in a fixed
// order, so a row's result does not depend on what else is in the batch. The PyTorch reference path
// (layers/kernels/fused.py) stays, and tests/test_native_ops.py compares the two.

#include "kernels.h"
#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

// Rows per parallel chunk: about 16K floats, so small batches stay on one thread (no wake-up cost).
int64_t grain(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_len, 1)); }

// out[d] = w[d] * (x[d] * r) with r = 1 / sqrt(mean(x^2) + eps): the order of HF's LlamaRMSNorm.
inline void norm_row(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out, int64_t D,
                     float eps) {
  float ss = 0.f;
  for (int64_t d = 0; d < D; ++d) ss += x[d] * x[d];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (int64_t d = 0; d < D; ++d) out[d] = w[d] * (x[d] * r);
}

// the sum of f(x[d]) over d in [0, D): eight running lanes (d mod 8, one vector register), then the tail, then the
// lanes pairwise. Under the build's fast-math GCC may reorder it, but the same build runs every row by the same code
// whatever the row's batch, so a row's bits never depend on what else is in the call.
template <typename F>
inline float lane_sum(const float* __restrict__ x, int64_t D, F f) {
  float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    for (int j = 0; j < 8; ++j) s[j] += f(x[d + j]);
  float tail = 0.f;
  for (; d < D; ++d) tail += f(x[d]);
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])) + tail;
}

}  // namespace

// LayerNorm: out = (x - mean) / sqrt(var + eps) * w + b per row (w, b: null for none), the variance over the
// deviations from the row's mean (two passes: no cancellation when the mean is large against the spread)
void lmserve::layer_norm_rows(const float* xp, const float* wp, const float* bp, float* op, int64_t T, int64_t D,
                              float e) {
  lmserve::parallel_for(0, T, grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict__ x = xp + t * D;
      float* __restrict__ out = op + t * D;
      const float mean = lane_sum(x, D, [](float v) { return v; }) / static_cast<float>(D);
      const float var = lane_sum(x, D, [mean](float v) { return (v - mean) * (v - mean); }) / static_cast<float>(D);
      const float rstd = 1.f / std::sqrt(var + e);
      for (int64_t d = 0; d < D; ++d) {
        const float y = (x[d] - mean) * rstd;
        out[d] = (wp != nullptr ? y * wp[d] : y) + (bp != nullptr ? bp[d] : 0.f);
      }
    }
  });
}

// out = norm(x + residual) with the sum written into residual, or norm(x) when residual is null
void lmserve::rms_norm_rows(const float* xp, float* rp, const float* wp, float* op, int64_t T, int64_t D, float e) {
  lmserve::parallel_for(0, T, grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * D;
      if (rp != nullptr) {
        float* __restrict__ r = rp + t * D;
        for (int64_t d = 0; d < D; ++d) r[d] += row[d];
        row = r;
      }
      norm_row(row, wp, op + t * D, D, e);
    }
  });
}

// The gated activations share their row split; `row(g, u, o, I)` writes one row of act(g) * u.
template <typename Row>
static void gated_rows(const float* gp, float* op, int64_t T, int64_t I, Row row) {
  lmserve::parallel_for(0, T, grain(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) row(gp + t * 2 * I, gp + t * 2 * I + I, op + t * I, I);
  });
}

// the GELU below: no fast-math or contraction, so its numbers are fixed whatever inlines them (simd_avx512.h)
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#include "simd_avx2.h"
#include "simd_avx512.h"

namespace {

// GeGLU's tanh GELU in the form 0.5 * (1 + tanh(u)) = sigmoid(2u), u = sqrt(2/pi) * (x + 0.044715 x^3), with
// e = exp(-|2u|) <= 1 so neither branch overflows: sigmoid(2u) = 1 / (1 + e) for u >= 0, e / (1 + e) below.
// Within a few ulp of ATen's gelu(approximate="tanh") (Sleef's tanh), which stays the reference (layers/kernels/fused.py).
constexpr float kGelu2U1 = 1.5957691216057308f;           // 2 * sqrt(2 / pi)
constexpr float kGelu2U3 = 1.5957691216057308f * 0.044715f;  // 2 * sqrt(2 / pi) * 0.044715

void gelu_tanh_mul_row(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ o, int64_t I) {
#if defined(__AVX512F__)
  // every element through the same vector code (masked tail): a value's result never depends on its column
  for (int64_t i = 0; i < I; i += 16) {
    const __mmask16 m = I - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (I - i)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(m, g + i), up = _mm512_maskz_loadu_ps(m, u + i);
    const __m512 z = _mm512_mul_ps(x, _mm512_fmadd_ps(_mm512_mul_ps(x, x), _mm512_set1_ps(kGelu2U3),
                                                      _mm512_set1_ps(kGelu2U1)));  // 2u
    const __m512 neg_abs = _mm512_min_ps(z, _mm512_sub_ps(_mm512_setzero_ps(), z));
    const __m512 e = lmserve_simd::exp_nonpositive(neg_abs);
    const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_GE_OQ), e,
                                            _mm512_set1_ps(1.f));
    const __m512 s = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.f), e));
    _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(_mm512_mul_ps(x, s), up));
  }
#else
  for (int64_t i = 0; i < I; ++i) {
    const float x = g[i], z = x * (x * x * kGelu2U3 + kGelu2U1), e = std::exp(-std::fabs(z));
    o[i] = x * ((z >= 0.f ? 1.f : e) / (1.f + e)) * u[i];
  }
#endif
}

#if defined(__SSE4_1__) && !defined(__AVX2__)
// simd_avx2.h's exp_nonpositive in 4 lanes for x86-64-v2 (no FMA: each step a multiply, then an add)
inline __m128 exp_nonpositive4(__m128 x) {
  const __m128 floor = _mm_set1_ps(-87.3f);
  const __m128 under = _mm_cmplt_ps(x, floor);
  x = _mm_max_ps(x, floor);
  const __m128 n = _mm_round_ps(_mm_mul_ps(x, _mm_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m128 r = _mm_sub_ps(x, _mm_mul_ps(n, _mm_set1_ps(0.693359375f)));
  r = _mm_sub_ps(r, _mm_mul_ps(n, _mm_set1_ps(-2.12194440e-4f)));
  __m128 p = _mm_set1_ps(1.9875691500e-4f);
  p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(1.3981999507e-3f));
  p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(8.3334519073e-3f));
  p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(4.1665795894e-2f));
  p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(1.6666665459e-1f));
  p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(5.0000001201e-1f));
  p = _mm_add_ps(_mm_mul_ps(p, _mm_mul_ps(r, r)), _mm_add_ps(r, _mm_set1_ps(1.f)));
  const __m128i pow2n = _mm_slli_epi32(_mm_add_epi32(_mm_cvtps_epi32(n), _mm_set1_epi32(127)), 23);
  return _mm_andnot_ps(under, _mm_mul_ps(p, _mm_castsi128_ps(pow2n)));
}
#endif

// SwiGLU's silu(x) * up = x * sigmoid(x) * up, sigmoid from e = exp(-|x|) <= 1 as the GELU above (1 / (1 + e) for
// x >= 0, e / (1 + e) below), with the vector exp: the scalar expf was ~6 ms of a 16-row step of the embedded model.
// Within a few ulp of F.silu, which stays the reference (layers/kernels/fused.py, tests/test_native_ops.py). Every
// element goes through the same vector code (a masked or zero-padded tail), so a value's result never depends on its
// column or row.
void silu_mul_row(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ o, int64_t I) {
#if defined(__AVX512F__)
  for (int64_t i = 0; i < I; i += 16) {
    const __mmask16 m = I - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (I - i)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(m, g + i), up = _mm512_maskz_loadu_ps(m, u + i);
    const __m512 e = lmserve_simd::exp_nonpositive(_mm512_min_ps(x, _mm512_sub_ps(_mm512_setzero_ps(), x)));
    const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), e,
                                            _mm512_set1_ps(1.f));
    const __m512 s = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.f), e));
    _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(_mm512_mul_ps(x, s), up));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (int64_t i = 0; i < I; i += 8) {
    const bool full = I - i >= 8;
    const __m256i m = lmserve_simd::tail_mask(full ? 8 : I - i);
    const __m256 x = full ? _mm256_loadu_ps(g + i) : _mm256_maskload_ps(g + i, m);
    const __m256 up = full ? _mm256_loadu_ps(u + i) : _mm256_maskload_ps(u + i, m);
    const __m256 e = lmserve_simd::exp_nonpositive(_mm256_min_ps(x, _mm256_sub_ps(_mm256_setzero_ps(), x)));
    const __m256 num = _mm256_blendv_ps(e, _mm256_set1_ps(1.f), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
    const __m256 y = _mm256_mul_ps(_mm256_mul_ps(x, _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.f), e))), up);
    if (full) _mm256_storeu_ps(o + i, y);
    else _mm256_maskstore_ps(o + i, m, y);
  }
#elif defined(__SSE4_1__)
  auto lanes = [](__m128 x, __m128 up) {
    const __m128 e = exp_nonpositive4(_mm_min_ps(x, _mm_sub_ps(_mm_setzero_ps(), x)));
    const __m128 num = _mm_blendv_ps(e, _mm_set1_ps(1.f), _mm_cmpge_ps(x, _mm_setzero_ps()));
    return _mm_mul_ps(_mm_mul_ps(x, _mm_div_ps(num, _mm_add_ps(_mm_set1_ps(1.f), e))), up);
  };
  int64_t i = 0;
  for (; i + 4 <= I; i += 4) _mm_storeu_ps(o + i, lanes(_mm_loadu_ps(g + i), _mm_loadu_ps(u + i)));
  if (i < I) {  // the tail, zero-padded
    alignas(16) float gx[4] = {0.f, 0.f, 0.f, 0.f}, ux[4] = {0.f, 0.f, 0.f, 0.f}, y[4];
    for (int64_t j = 0; i + j < I; ++j) gx[j] = g[i + j], ux[j] = u[i + j];
    _mm_store_ps(y, lanes(_mm_load_ps(gx), _mm_load_ps(ux)));
    for (int64_t j = 0; i + j < I; ++j) o[i + j] = y[j];
  }
#else
  for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
#endif
}

// Row `x` [V] -> (first index of its maximum, the log-softmax at it = -log(sum(exp(x - max)))): argmax and
// logsumexp in two passes instead of torch's three over [B, V] (max, exp-sum, argmax; ~14 ms a step at 16 rows
// of Gemma 3's 262,144-token vocabulary). A NaN anywhere gives torch's answer (its first index, a NaN logprob),
// as does a max of +-inf (a NaN logprob).
std::pair<int64_t, float> argmax_logprob_row(const float* x, int64_t V) {
#if defined(__AVX512F__)
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i where = _mm512_setzero_si512();
  __mmask16 nan = 0;
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 m = V - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (V - i)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strictly greater: each lane keeps its first
    best = _mm512_mask_mov_ps(best, gt, v);
    where = _mm512_mask_mov_epi32(where, gt, _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(i))));
  }
  if (nan) {
    int64_t i = 0;
    while (!std::isnan(x[i])) ++i;
    return {i, NAN};
  }
  const float top = _mm512_reduce_max_ps(best);
  // the first index among the lanes that hold the maximum (an all -inf row: index 0, as torch)
  const __mmask16 at = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  const int64_t idx = _mm512_mask_reduce_min_epi32(at, where);
  if (!std::isfinite(top)) return {idx, NAN};
  __m512 sum = _mm512_setzero_ps();
  const __m512 t = _mm512_set1_ps(top);
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 m = V - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (V - i)) - 1);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, lmserve_simd::exp_nonpositive(
                                                        _mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), t))));
  }
  return {idx, -std::log(_mm512_reduce_add_ps(sum))};
#elif defined(__AVX2__) && defined(__FMA__)
  // the same two passes, 8 lanes wide (the scalar loop below cost ~0.3 ms a row of SmolLM2's 49,152 logits)
  __m256 best = _mm256_set1_ps(-INFINITY);
  __m256i where = _mm256_setzero_si256();
  int nan = 0;
  const __m256i lanes = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  auto load = [&](int64_t i) {  // 8 logits from i, -inf past the row's end
    if (V - i >= 8) return _mm256_loadu_ps(x + i);
    const __m256i m = lmserve_simd::tail_mask(V - i);
    return _mm256_blendv_ps(ninf, _mm256_maskload_ps(x + i, m), _mm256_castsi256_ps(m));
  };
  for (int64_t i = 0; i < V; i += 8) {
    const __m256 v = load(i);
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);  // strictly greater: each lane keeps its first
    best = _mm256_blendv_ps(best, v, gt);
    where = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(where), _mm256_castsi256_ps(
        _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int32_t>(i)))), gt));
  }
  if (nan) {
    int64_t i = 0;
    while (!std::isnan(x[i])) ++i;
    return {i, NAN};
  }
  const float top = lmserve_simd::hmax(best);
  alignas(32) float bl[8];
  alignas(32) int32_t wl[8];
  _mm256_store_ps(bl, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(wl), where);
  // the first index among the lanes that hold the maximum (top is one lane's value, so one matches; an all -inf
  // row: every lane, index 0, as torch)
  int64_t idx = V;
  for (int j = 0; j < 8; ++j)
    if (bl[j] == top) idx = std::min<int64_t>(idx, wl[j]);
  if (!std::isfinite(top)) return {idx, NAN};
  __m256 sum = _mm256_setzero_ps();
  const __m256 t = _mm256_set1_ps(top);
  for (int64_t i = 0; i < V; i += 8) sum = _mm256_add_ps(sum, lmserve_simd::exp_nonpositive(_mm256_sub_ps(load(i), t)));
  return {idx, -std::log(lmserve_simd::hsum(sum))};
#else
  int64_t idx = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (std::isnan(x[i])) return {i, NAN};
    if (x[i] > x[idx]) idx = i;
  }
  const float top = x[idx];
  if (!std::isfinite(top)) return {idx, NAN};
  float sum = 0.f;
  for (int64_t i = 0; i < V; ++i) sum += std::exp(x[i] - top);
  return {idx, -std::log(sum)};
#endif
}

}  // namespace

#pragma GCC pop_options

void lmserve::argmax_logprob_rows(const float* px, int64_t B, int64_t V, int64_t* pi, float* pl) {
  lmserve::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) std::tie(pi[b], pl[b]) = argmax_logprob_row(px + b * V, V);
  });
}

void lmserve::silu_and_mul_rows(const float* gate_up, float* out, int64_t T, int64_t I) {
  gated_rows(gate_up, out, T, I, silu_mul_row);
}

void lmserve::gelu_tanh_and_mul_rows(const float* gate_up, float* out, int64_t T, int64_t I) {
  gated_rows(gate_up, out, T, I, gelu_tanh_mul_row);
}

void lmserve::rotary_rows(float* xp, int64_t row_stride, const float* cp, const float* sp, int64_t T, int64_t H,
                          int64_t D) {
  const int64_t half = D / 2;
  lmserve::parallel_for(0, T, grain(H * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict__ c = cp + t * D;
      const float* __restrict__ s = sp + t * D;
      for (int64_t h = 0; h < H; ++h) {
        float* __restrict__ v = xp + t * row_stride + h * D;
        // HF's x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
        for (int64_t d = 0; d < half; ++d) {
          const float a = v[d], b = v[d + half];
          v[d] = a * c[d] - b * s[d];
          v[d + half] = b * c[d + half] + a * s[d + half];
        }
      }
    }
  });
}
