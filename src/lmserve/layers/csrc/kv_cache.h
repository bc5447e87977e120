// The KV cache's element formats, as the paged attention reads them and the K/V write stores them.
//
// A cache is [2, blocks, block_size, kv_heads, W]: K then V, one row of W elements per (slot, kv head).
//   float        W = D, the values
//   c10::Half    W = D, the values rounded to nearest even (widened exactly on read)
//   int8_t       W = D + 4: D codes, then the row's float32 scale in its last 4 bytes (--kv-cache-dtype int8)
//   Float8_e4m3fn the same with e4m3 codes (--kv-cache-dtype fp8_e4m3)
// A quantized row is one quantization block (one token's D values of one head): int8 codes are
// round_half_even(x * 127 / amax) with scale amax / 127; e4m3 codes are e4m3(x * 448 / amax) with scale amax / 448;
// a value reads back as code * scale. layers/kv_quant.py is the PyTorch reference of exactly these numbers.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace lmserve_kv {

using Fp8 = c10::Float8_e4m3fn;

template <typename KV>
constexpr bool kQuantized = std::is_same_v<KV, int8_t> || std::is_same_v<KV, Fp8>;

template <typename KV>
constexpr int64_t row_width(int64_t D) {
  return kQuantized<KV> ? D + 4 : D;
}

template <typename KV>
inline float row_scale(const KV* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof(float));
  return s;
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

// One (token, head) row of D floats -> W elements of the cache's format.
template <typename KV>
inline void encode_row(const float* x, KV* out, int64_t D) {
  if constexpr (std::is_same_v<KV, float>) {
    std::memcpy(out, x, D * sizeof(float));
  } else if constexpr (std::is_same_v<KV, c10::Half>) {
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<c10::Half>(x[d]);
  } else {
    constexpr float top = std::is_same_v<KV, int8_t> ? 127.f : 448.f;
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
    const float inv = amax > 0.f ? top / amax : 0.f;
    for (int64_t d = 0; d < D; ++d) {
      const float y = x[d] * inv;
      if constexpr (std::is_same_v<KV, int8_t>) {
        out[d] = static_cast<int8_t>(std::clamp(std::nearbyint(y), -top, top));  // half to even, as torch.round
      } else {
        out[d] = static_cast<Fp8>(y);  // |y| <= 448: c10's rounding, the one torch's .to(float8_e4m3fn) uses
      }
    }
    const float scale = amax / top;
    std::memcpy(out + D, &scale, sizeof(float));
  }
}

}  // namespace lmserve_kv
#pragma GCC pop_options
