// The KV cache's element formats, as the paged attention reads them and the K/V write stores them.
//
// A cache is [2, blocks, block_size, kv_heads, W]: K then V, one row of W elements per (slot, kv head).
//   float         W = D, the values
//   c10::Half     W = D, the values rounded to nearest even (widened exactly on read)
//   int8_t        W = D + D / 16: D codes, then one float16 scale per 32 of them (--kv-cache-dtype int8)
//   Float8_e4m3fn the same with e4m3 codes (--kv-cache-dtype fp8_e4m3)
// Quantized rows are cut into blocks of 32 values, each with its own scale, as ggml's q8_0: d = float16(amax / 127)
// and code = round_half_even(x / d) for int8; d = float16(amax / 448) and code = e4m3(x / d) for e4m3 (1 / d taken
// once, then one multiply). A value reads back as code * d. Blocks of 32 with float16 scales cost the bytes of one
// float32 scale per 64 and gave 0.28% against 0.42-0.58% perplexity (benchmarks/results/perplexity_kv.md).
// layers/attention/kv_quant.py is the PyTorch reference of exactly these numbers.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace lmserve_kv {

using Fp8 = c10::Float8_e4m3fn;

template <typename KV>
constexpr bool kQuantized = std::is_same_v<KV, int8_t> || std::is_same_v<KV, Fp8>;

constexpr int64_t kBlock = 32;  // values per scale in a quantized row

template <typename KV>
constexpr int64_t row_width(int64_t D) {
  return kQuantized<KV> ? D + D / kBlock * 2 : D;
}

// the scale of the block holding element c of a quantized row of D codes
template <typename KV>
inline float block_scale(const KV* row, int64_t D, int64_t c) {
  c10::Half s;
  std::memcpy(&s, row + D + 2 * (c / kBlock), sizeof(s));
  return static_cast<float>(s);
}

template <typename KV>
inline float code_value(KV c) {
  return static_cast<float>(c);  // int8: exact; e4m3 and float16: exact widening (c10's conversions)
}

}  // namespace lmserve_kv

// The quantizing writer computes fixed numbers that the PyTorch reference reproduces bit for bit: no fast-math
// (it would turn amax / 127 into amax * (1 / 127)), no contraction.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")

namespace lmserve_kv {

// A quantized block's scale from its largest |x| (`top`: the largest code), and the multiplier its values take
// before rounding: one place for the vector and scalar writers below, which must give the same bytes
struct BlockScale {
  c10::Half d;  // stored; at most float16's largest, so a huge row saturates, never inf
  float inv;    // 1 / d, or 0 for an all-zero block
};

inline BlockScale block_scale_of(float amax, float top) {
  const c10::Half d(std::min(amax / top, 65504.f));
  const float df = static_cast<float>(d);
  return {d, df > 0.f ? 1.f / df : 0.f};
}

// One (token, head) row of D floats -> W elements of the cache's format.
template <typename KV>
inline void encode_row(const float* x, KV* out, int64_t D) {
  if constexpr (std::is_same_v<KV, float>) {
    std::memcpy(out, x, D * sizeof(float));
  } else if constexpr (std::is_same_v<KV, c10::Half>) {
    int64_t d = 0;
#if defined(__F16C__)
    // 8 at a time. With F16C, c10::Half's constructor is this instruction (vcvtps2ph, round to nearest even) on one
    // value, but built here as an out-of-line call per value: ~1.5% of an x86-64-v3 prefill step, ~1% of a 16-row
    // decode step. Same bits; the tail takes the same instruction one value at a time.
    for (; d + 8 <= D; d += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + d),
                       _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT));
    for (; d < D; ++d) out[d] = c10::Half(_cvtss_sh(x[d], _MM_FROUND_TO_NEAREST_INT), c10::Half::from_bits());
#else
    for (; d < D; ++d) out[d] = static_cast<c10::Half>(x[d]);
#endif
  } else {
    constexpr float top = std::is_same_v<KV, int8_t> ? 127.f : 448.f;
#if defined(__AVX2__)
    // int8 in 8 lanes, on every build with AVX2 (AVX-512's too), the same numbers as the loop below: the largest |x|
    // is exact in any order, d and 1 / d are the same scalar operations, x * inv, min/max and the conversion (round
    // half to even: MXCSR's default, as nearbyint) are exact elementwise. The scalar loop cost a 2,000-token prefill
    // ~4x float16's K/V write, and at x86-64-v3 it called std::nearbyint per value. A NaN value is left out of amax
    // (as std::max leaves it) and written as -127.
    if constexpr (std::is_same_v<KV, int8_t>) {
      const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs' lane interleave, undone
      for (int64_t b = 0; b < D / kBlock; ++b) {
        __m256 xs[4];
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          xs[i] = _mm256_loadu_ps(x + b * kBlock + 8 * i);
          m = _mm256_max_ps(_mm256_and_ps(xs[i], abs_mask), m);  // a NaN value is skipped, as std::max skips it
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
        const BlockScale scale = block_scale_of(amax, top);
        const __m256 inv = _mm256_set1_ps(scale.inv);
        const __m256 lo = _mm256_set1_ps(-top), hi = _mm256_set1_ps(top);
        __m256i q[4];
        for (int i = 0; i < 4; ++i)
          q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(xs[i], inv), lo), hi));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * kBlock), _mm256_permutevar8x32_epi32(bytes, order));
        std::memcpy(out + D + 2 * b, &scale.d, sizeof(scale.d));
      }
      return;
    }
#endif
    for (int64_t b = 0; b < D / kBlock; ++b) {
      const float* xb = x + b * kBlock;
      float amax = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const BlockScale scale = block_scale_of(amax, top);
      for (int64_t i = 0; i < kBlock; ++i) {
        const float y = std::clamp(xb[i] * scale.inv, -top, top);  // d was rounded: x / d may pass top a little
        if constexpr (std::is_same_v<KV, int8_t>) {
          out[b * kBlock + i] = static_cast<int8_t>(std::nearbyint(y));  // half to even, as torch.round
        } else {
          out[b * kBlock + i] = static_cast<Fp8>(y);  // c10's rounding, the one torch's .to(float8_e4m3fn) uses
        }
      }
      std::memcpy(out + D + 2 * b, &scale.d, sizeof(scale.d));
    }
  }
}

}  // namespace lmserve_kv
#pragma GCC pop_options
