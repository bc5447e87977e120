// Decode attention over the paged KV cache, reading K/V where they lie (CPU, float32 queries).
//
// Why: PyTorch has no paged attention on CPU, so the portable path gathers every sequence's blocks into
// a padded copy and runs SDPA on it; at batch 64 x 256 keys that costs 3.5 ms per layer, 30% of an
// offline decode step. This loop reads each key and value row once, straight from its block, and is
// 3-5x faster (measured in tests/test_native_attention.py's benchmark notes and benchmarks/). Each
// (sequence, kv head) is computed alone in a fixed order, so results do not depend on the batch.
//
// q [B, H, D] float32 (D = 64, 128 or 256); k_cache, v_cache [num_blocks, block_size, Hkv, W] in one of kv_cache.h's
// formats (float32, float16, or int8 / e4m3 codes with a scale per 32), each row read as its float32 values
// (code * scale) with no dequantized copy of the cache; block_tables [B, max_blocks] int64; context_lens [B] int64
// (>= 1). Query head h uses kv head h / (H / Hkv), as HF's repeat_kv does. write_kv_slots (below) is the one writer
// of those formats.
// window > 0: row b attends only to its last `window` keys (sliding-window layers); softcap > 0: each score s
// becomes softcap * tanh(s / softcap) after the scale (Gemma 2), as transformers computes them.

#include "kernels.h"
#include "kv_cache.h"
#include "thread_pool.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int kMaxGroup = 16;  // query heads per kv head handled in registers-sized scratch
static_assert(kMaxGroup == lmserve::kMaxGroupHeads, "kernels.h tells the binding unit this limit");

using lmserve_kv::kQuantized;
using lmserve_kv::row_width;

// one cached row as float32 values (float16 -> float32 is exact; quantized rows: code * scale)
template <int D, typename KV>
inline const float* as_float(const KV* row, float* buf) {
  if constexpr (std::is_same_v<KV, float>) {
    return row;
#if defined(__AVX2__)
  } else if constexpr (std::is_same_v<KV, int8_t>) {  // 8 at a time: int8 -> float32 is exact, then the same one
    // multiply by the block's scale as the scalar loop below (the scalar loop was 3.6x float16's prefill attention)
    for (int d = 0; d < D; d += lmserve_kv::kBlock) {
      const __m256 scale = _mm256_set1_ps(lmserve_kv::block_scale(row, D, d));
      for (int j = d; j < d + lmserve_kv::kBlock; j += 8) {
        const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + j));
        _mm256_storeu_ps(buf + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), scale));
      }
    }
    return buf;
#endif
  } else if constexpr (kQuantized<KV>) {
    for (int d = 0; d < D; ++d) buf[d] = lmserve_kv::code_value(row[d]) * lmserve_kv::block_scale(row, D, d);
    return buf;
#if defined(__F16C__)
  } else if constexpr (std::is_same_v<KV, c10::Half>) {  // 8 at a time (c10::Half's conversion is scalar bit work:
    // ~70% of a 16-row decode step's attention on x86-64-v3, whose float16 cache is the GGUF default)
    for (int d = 0; d < D; d += 8)
      _mm256_storeu_ps(buf + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d))));
    return buf;
#endif
  } else {
    for (int d = 0; d < D; ++d) buf[d] = static_cast<float>(row[d]);
    return buf;
  }
}

// How far ahead the decode kernels fetch a row's scattered K/V rows: into L2 (locality 2: prefetcht1 on x86), the
// first ones before the loop that reads them. At c=16 a step's attention reads more K/V than the last-level cache
// holds (~110 MB at ~300 keys, SmolLM2-135M); fetching the next 8-16 rows into L1 read it at ~11 GB/s on a 2-core
// Zen 4 whose two threads stream ~34, at any L1 distance tried; 4 KB ahead into L2 reads ~17-21
// (benchmarks/decode_attention.py). On Zen 1 neutral: its kernel reads 4-5 GB/s of the 14.7 its threads stream, bound
// by arithmetic (decode_attention_zen1.md); Zen 2-3 unmeasured
constexpr int64_t kBytesAhead = 4096;
template <int64_t RowBytes>
constexpr int64_t kRowsAhead = std::max<int64_t>(8, kBytesAhead / RowBytes);  // 32 float16 rows of 64

// every cache line of rows [from, to): a row need not start on a line (an int8 row of 64 is 68 bytes)
template <typename KV>
inline void fetch_rows(const KV* const* rows, int64_t from, int64_t to, int64_t row_bytes) {
  for (int64_t j = from; j < to; ++j) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(rows[j]);
    for (uintptr_t line = start & ~uintptr_t{63}; line < start + row_bytes; line += 64)
      __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
  }
}

// rows[t] = the cached row of key position t0 + t (t < L) of one KV head: one division per block instead of one per
// key (a 16-row SmolLM2 step at ~300 keys locates ~430k rows; the step's time moved by less than this host's noise).
// Every kernel here locates its rows with it (a value row is the same slot in v_cache), so one place computes them.
template <typename KV>
inline void locate_rows(const KV** rows, const KV* cache, const int64_t* table, int64_t t0, int64_t L,
                        int64_t block_size, int64_t Hkv, int64_t kv_head, int64_t W) {
  for (int64_t t = 0, p = t0; t < L;) {
    const int64_t off = p % block_size, n = std::min(block_size - off, L - t);
    const KV* slot = cache + ((table[p / block_size] * block_size + off) * Hkv + kv_head) * W;
    for (int64_t i = 0; i < n; ++i) rows[t + i] = slot + i * Hkv * W;
    t += n;
    p += n;
  }
}

// the first key a row of context length L sees: L - window for a sliding-window layer, else 0
inline int64_t first_key(int64_t L, int64_t window) { return window > 0 && L > window ? L - window : 0; }

// A prefill call's tiles (first row, rows): runs of up to `tile_rows` consecutive rows of one request (the same
// table row), which each level's prefill kernel attends together
std::vector<std::pair<int64_t, int64_t>> prefill_tiles(const int64_t* table_rows, int64_t B, int64_t tile_rows) {
  std::vector<std::pair<int64_t, int64_t>> tiles;
  for (int64_t b = 0; b < B;) {
    int64_t e = b + 1;
    while (e < B && e - b < tile_rows && table_rows[e] == table_rows[b]) ++e;
    tiles.emplace_back(b, e - b);
    b = e;
  }
  return tiles;
}

// One tile's rows: row i sees keys [t0[i], t1[i]) and its G heads' scores sit at off[i] ([G, t1 - t0]); every row
// sees keys within [lo, hi); the tile's scores take `total` floats
struct TileRows {
  std::vector<int64_t> t0, t1, off;
  int64_t lo = 0, hi = 0, total = 0;
  explicit TileRows(int64_t rows) : t0(rows), t1(rows), off(rows) {}
  void set(const int64_t* context_lens, int64_t b0, int64_t rows, int64_t window, int64_t G) {
    lo = INT64_MAX, hi = 0, total = 0;
    for (int64_t i = 0; i < rows; ++i) {
      t0[i] = first_key(context_lens[b0 + i], window);
      t1[i] = context_lens[b0 + i];
      off[i] = total;
      total += G * (t1[i] - t0[i]);
      lo = std::min(lo, t0[i]);
      hi = std::max(hi, t1[i]);
    }
  }
};

// s <- softcap * tanh(s / softcap) for n scores (no-op when softcap <= 0)
inline void soft_cap(float* s, int64_t n, float softcap) {
  if (softcap <= 0.f) return;
  for (int64_t t = 0; t < n; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
}

// q . k, the loop GCC vectorises (fast-math): one function, so decode rows and prefill tiles compile it alike
template <int D>
inline float dot(const float* __restrict__ q, const float* __restrict__ k) {
  float acc = 0.f;
  for (int d = 0; d < D; ++d) acc += q[d] * k[d];
  return acc;
}

// s[0..L) <- softmax(soft_cap(s))
inline void softmax_scalar(float* __restrict__ s, int64_t L, float softcap) {
  soft_cap(s, L, softcap);
  float top = s[0];
  for (int64_t t = 1; t < L; ++t) top = std::max(top, s[t]);
  float sum = 0.f;
  for (int64_t t = 0; t < L; ++t) {
    s[t] = std::exp(s[t] - top);
    sum += s[t];
  }
  const float inv = 1.f / sum;
  for (int64_t t = 0; t < L; ++t) s[t] *= inv;
}

template <int D, typename KV>
void decode_attention(const float* q, const KV* k_cache, const KV* v_cache, const int64_t* block_tables,
                      const int64_t* context_lens, const int64_t* table_rows, float* out, int64_t B, int64_t H,
                      int64_t block_size, int64_t Hkv, int64_t max_blocks, float scale, int64_t window,
                      float softcap) {
  const int64_t G = H / Hkv, n = B * Hkv, W = row_width<KV>(D);
  lmserve::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const KV*> rows;  // the item's key rows (a value row: the same slot in v_cache)
    for (int64_t k = begin; k < end; ++k) {
      // Items in zigzag order (first, last, second, second last, ...): a prefill's rows grow in length, and the
      // contiguous chunks parallel_for hands out would otherwise leave the longest ones for last (with 2 threads
      // and static halves, 3/4 of a causal prefill's work went to one thread).
      const int64_t item = k % 2 == 0 ? k / 2 : n - 1 - k / 2;
      const int64_t b = item / Hkv, kv_head = item % Hkv, t0 = first_key(context_lens[b], window);
      const int64_t L = context_lens[b] - t0;  // keys seen, from position t0
      const int64_t* table = block_tables + (table_rows ? table_rows[b] : b) * max_blocks;
      const float* q_rows = q + (b * H + kv_head * G) * D;
      scores.resize(G * L);
      rows.resize(L);
      locate_rows(rows.data(), k_cache, table, t0, L, block_size, Hkv, kv_head, W);
      // scores[g, t] = q_g . k_(t0 + t) * scale
      float row_buf[D];
      for (int64_t t = 0; t < L; ++t) {
        const float* __restrict__ k = as_float<D>(rows[t], row_buf);
        for (int64_t g = 0; g < G; ++g) scores[g * L + t] = dot<D>(q_rows + g * D, k) * scale;
      }
      for (int64_t g = 0; g < G; ++g) softmax_scalar(scores.data() + g * L, L, softcap);  // over t, per query head
      // out[g] = sum_t p[g, t] * v_t
      float acc[kMaxGroup][D];
      for (int64_t g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
      for (int64_t t = 0; t < L; ++t) {
        const float* __restrict__ v = as_float<D>(v_cache + (rows[t] - k_cache), row_buf);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          for (int d = 0; d < D; ++d) acc[g][d] += p * v[d];
        }
      }
      float* o = out + (b * H + kv_head * G) * D;
      for (int64_t g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) o[g * D + d] = acc[g][d];
    }
  });
}

// Prefill rows (table_rows given) in tiles where no vector version is compiled (x86-64-v2, other architectures): up
// to kTileHeadsGeneric / G consecutive rows of one request share each key and value row, located and widened once
// per tile (an int8 row's widening is most of a row's cost here). Each row's numbers are decode_attention's: the
// same dot() per key, the same softmax_scalar, and p * v accumulated per element over its keys in ascending order
// from zero, so a token gets a decode row's bits (tests/test_native_attention.py, run on every level).
constexpr int64_t kTileHeadsGeneric = 48;

template <int D, typename KV>
void prefill_attention_generic(const float* q, const KV* k_cache, const KV* v_cache, const int64_t* block_tables,
                               const int64_t* context_lens, const int64_t* table_rows, float* out, int64_t B,
                               int64_t H, int64_t block_size, int64_t Hkv, int64_t max_blocks, float scale,
                               int64_t window, float softcap) {
  const int64_t G = H / Hkv, W = row_width<KV>(D), tile_rows = std::max<int64_t>(1, kTileHeadsGeneric / G);
  const auto tiles = prefill_tiles(table_rows, B, tile_rows);
  const int64_t n = static_cast<int64_t>(tiles.size()) * Hkv;
  lmserve::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    std::vector<const KV*> at;  // the tile's key rows [lo, hi), located once (a value row: the same slot in v_cache)
    TileRows span(tile_rows);
    float row_buf[D];
    for (int64_t k = begin; k < end; ++k) {
      const int64_t item = k % 2 == 0 ? k / 2 : n - 1 - k / 2;  // zigzag, as decode_attention
      const auto [b0, rows] = tiles[item / Hkv];
      const int64_t kv_head = item % Hkv;
      const int64_t* table = block_tables + table_rows[b0] * max_blocks;
      span.set(context_lens, b0, rows, window, G);
      const std::vector<int64_t>&t0 = span.t0, &t1 = span.t1, &off = span.off;
      const int64_t lo = span.lo, hi = span.hi, total = span.total;
      scores.resize(total);
      at.resize(hi - lo);
      locate_rows(at.data(), k_cache, table, lo, hi - lo, block_size, Hkv, kv_head, W);
      for (int64_t p = lo; p < hi; ++p) {
        const float* k_row = as_float<D>(at[p - lo], row_buf);
        for (int64_t i = 0; i < rows; ++i) {
          if (p < t0[i] || p >= t1[i]) continue;
          const int64_t L = t1[i] - t0[i];
          for (int64_t g = 0; g < G; ++g)
            scores[off[i] + g * L + (p - t0[i])] = dot<D>(q + ((b0 + i) * H + kv_head * G + g) * D, k_row) * scale;
        }
      }
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t g = 0; g < G; ++g)
          softmax_scalar(scores.data() + off[i] + g * (t1[i] - t0[i]), t1[i] - t0[i], softcap);
      acc.assign(rows * G * D, 0.f);
      for (int64_t p = lo; p < hi; ++p) {
        const float* __restrict__ v = as_float<D>(v_cache + (at[p - lo] - k_cache), row_buf);
        for (int64_t i = 0; i < rows; ++i) {
          if (p < t0[i] || p >= t1[i]) continue;
          const int64_t L = t1[i] - t0[i];
          for (int64_t g = 0; g < G; ++g) {
            const float pr = scores[off[i] + g * L + (p - t0[i])];
            float* __restrict__ a = acc.data() + (i * G + g) * D;
            for (int d = 0; d < D; ++d) a[d] += pr * v[d];
          }
        }
      }
      for (int64_t i = 0; i < rows; ++i)
        std::copy(acc.data() + i * G * D, acc.data() + (i + 1) * G * D, out + ((b0 + i) * H + kv_head * G) * D);
    }
  });
}

}  // namespace

#if defined(__AVX512F__)
// The AVX-512 version of the loop above, ~2x faster: 16 keys' dot products reduced at once by a fixed tree, a
// vector exp, and up to 4 query heads' outputs accumulated in registers while each value row is read once. It
// opts out of fast-math and FMA contraction, and every number is a fixed chain of operations (simd_avx512.h),
// so a row's result does not depend on which rows share the call (prefill rows and decode rows alike).
#define LMSERVE_ATTENTION_AVX512 1
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#include "simd_avx512.h"

namespace {

using lmserve_simd::exp_nonpositive;
using lmserve_simd::reduce4;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// 16 e4m3 codes as floats, exactly: (8 + m) * 2^(e - 10) for a normal code, m * 2^-9 for a subnormal one (no float
// denormals involved), then the sign. The all-ones NaN code is never written (kv_cache.h saturates at 448).
inline __m512 load16(const lmserve_kv::Fp8* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i e = _mm512_and_si512(_mm512_srli_epi32(b, 3), _mm512_set1_epi32(15));
  const __m512i m = _mm512_and_si512(b, _mm512_set1_epi32(7));
  const __mmask16 normal = _mm512_test_epi32_mask(e, e);
  const __m512i mant = _mm512_mask_or_epi32(m, normal, m, _mm512_set1_epi32(8));
  const __m512i pow = _mm512_mask_sub_epi32(_mm512_set1_epi32(-9), normal, e, _mm512_set1_epi32(10));
  const __m512 mag = _mm512_scalef_ps(_mm512_cvtepi32_ps(mant), _mm512_cvtepi32_ps(pow));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign));
}

// 16 values of a cached row from element c on: quantized rows are scaled by their block's scale (code * d, as
// as_float)
template <int D, typename KV>
inline __m512 values16(const KV* row, int c) {
  if constexpr (kQuantized<KV>) return _mm512_mul_ps(load16(row + c), _mm512_set1_ps(lmserve_kv::block_scale(row, D, c)));
  return load16(row + c);
}

// q . k for keys[0..nk) (lane j: keys[j]; lanes from nk on: 0): one fma chain per key, then one tree of adds
template <int D, bool FULL, typename KV>
inline __m512 dots16(const float* q, const KV* const* keys, int nk) {
  __m512 p[16];
  for (int j = 0; j < 16; ++j) {
    if (!FULL && j >= nk) {
      p[j] = _mm512_setzero_ps();
      continue;
    }
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), load16(keys[j]));
    for (int c = 16; c < D; c += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), load16(keys[j] + c), acc);
    p[j] = acc;
  }
  const __m512 lo = _mm512_insertf32x4(_mm512_castps128_ps512(reduce4(p[0], p[1], p[2], p[3])),
                                       reduce4(p[4], p[5], p[6], p[7]), 1);
  const __m512 hi = _mm512_insertf32x4(_mm512_insertf32x4(lo, reduce4(p[8], p[9], p[10], p[11]), 2),
                                       reduce4(p[12], p[13], p[14], p[15]), 3);
  return hi;
}

inline __mmask16 lanes(int64_t n) { return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }

// s[0..L) <- softmax(s): max, exp of the differences, their sum lane by lane in order then one tree, a multiply
void softmax_row(float* s, int64_t L) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < L; t += 16) mx = _mm512_mask_max_ps(mx, lanes(L - t), mx, _mm512_maskz_loadu_ps(lanes(L - t), s + t));
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; t += 16) {
    const __mmask16 m = lanes(L - t);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), top));
    _mm512_mask_storeu_ps(s + t, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  const __m512 zero = _mm512_setzero_ps();
  const __m512 inv = _mm512_set1_ps(1.f / _mm_cvtss_f32(reduce4(sum, zero, zero, zero)));
  for (int64_t t = 0; t < L; t += 16)
    _mm512_mask_storeu_ps(s + t, lanes(L - t), _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes(L - t), s + t), inv));
}

// out[g] = sum_t p[g, t] v_t for GB query heads, their accumulators in registers, each value row loaded once
template <int D, int GB, typename KV>
void weighted_values(const float* p, int64_t L, const KV* const* vrows, float* out) {
  __m512 acc[GB][D / 16];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < D / 16; ++c) acc[g][c] = _mm512_setzero_ps();
  constexpr int64_t kRowBytes = row_width<KV>(D) * static_cast<int64_t>(sizeof(KV)), kAhead = kRowsAhead<kRowBytes>;
  for (int64_t t = 0; t < L; ++t) {
    if (t + kAhead < L) fetch_rows(vrows, t + kAhead, t + kAhead + 1, kRowBytes);  // scattered across blocks and heads
    if constexpr (std::is_same_v<KV, lmserve_kv::Fp8>) {  // its widening's constants take registers: the row first
      __m512 v[D / 16];
      for (int c = 0; c < D / 16; ++c) v[c] = values16<D>(vrows[t], 16 * c);
      for (int g = 0; g < GB; ++g) {
        const __m512 pg = _mm512_set1_ps(p[g * L + t]);
        for (int c = 0; c < D / 16; ++c) acc[g][c] = _mm512_fmadd_ps(pg, v[c], acc[g][c]);
      }
    } else {
      __m512 pg[GB];
      for (int g = 0; g < GB; ++g) pg[g] = _mm512_set1_ps(p[g * L + t]);
      for (int c = 0; c < D / 16; ++c) {  // a column at a time, as accumulate8 (below) and why
        const __m512 v = values16<D>(vrows[t], 16 * c);
        for (int g = 0; g < GB; ++g) acc[g][c] = _mm512_fmadd_ps(pg[g], v, acc[g][c]);
      }
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(out + g * D + 16 * c, acc[g][c]);
}

template <int D, typename KV>
void weighted_values_any(const float* p, int64_t L, const KV* const* vrows, float* out, int64_t G) {
  constexpr int kMax = D == 64 ? 4 : D == 128 ? 2 : 1;  // 16 accumulators (D = 256: one head's 16 already)
  for (int64_t g = 0; g < G; g += kMax) {
    const float* pg = p + g * L;
    float* og = out + g * D;
    switch (std::min<int64_t>(kMax, G - g)) {
      case 1: weighted_values<D, 1>(pg, L, vrows, og); break;
      case 2: weighted_values<D, 2>(pg, L, vrows, og); break;
      case 3: weighted_values<D, (kMax >= 3 ? 3 : 1)>(pg, L, vrows, og); break;
      default: weighted_values<D, kMax>(pg, L, vrows, og); break;
    }
  }
}

template <int D, typename KV>
void attention_avx512(const float* q, const KV* k_cache, const KV* v_cache, const int64_t* block_tables,
                      const int64_t* context_lens, const int64_t* table_rows, float* out, int64_t B, int64_t H,
                      int64_t block_size, int64_t Hkv, int64_t max_blocks, float scale, int64_t window,
                      float softcap) {
  const int64_t G = H / Hkv, n = B * Hkv, W = row_width<KV>(D);
  constexpr int64_t kRowBytes = row_width<KV>(D) * static_cast<int64_t>(sizeof(KV));
  lmserve::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const KV*> rows;
    for (int64_t k = begin; k < end; ++k) {
      const int64_t item = k % 2 == 0 ? k / 2 : n - 1 - k / 2;  // zigzag, as decode_attention
      const int64_t b = item / Hkv, kv_head = item % Hkv, t0 = first_key(context_lens[b], window);
      const int64_t L = context_lens[b] - t0;  // keys seen, from position t0
      const int64_t* table = block_tables + (table_rows ? table_rows[b] : b) * max_blocks;
      const float* q_rows = q + (b * H + kv_head * G) * D;
      scores.resize(G * L);
      rows.resize(L);
      locate_rows(rows.data(), k_cache, table, t0, L, block_size, Hkv, kv_head, W);
      fetch_rows(rows.data(), 0, std::min(L, kRowsAhead<kRowBytes>), kRowBytes);
      const __m512 sc = _mm512_set1_ps(scale);
      alignas(64) float widened[16 * D];  // a chunk's keys as float32 values, widened once for all G query heads
      const float* keys[16];
      for (int64_t t = 0; t < L; t += 16) {
        const int nk = static_cast<int>(std::min<int64_t>(16, L - t));
        const int64_t ahead = t + kRowsAhead<kRowBytes>;  // a later chunk's keys
        fetch_rows(rows.data(), std::min(L, ahead), std::min(L, ahead + 16), kRowBytes);
        for (int j = 0; j < nk; ++j) {
          if constexpr (std::is_same_v<KV, float>) {
            keys[j] = rows[t + j];
          } else {
            for (int c = 0; c < D; c += 16) _mm512_store_ps(widened + j * D + c, values16<D>(rows[t + j], c));
            keys[j] = widened + j * D;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          const __m512 d = nk == 16 ? dots16<D, true, float>(q_rows + g * D, keys, 16)
                                    : dots16<D, false, float>(q_rows + g * D, keys, nk);
          _mm512_mask_storeu_ps(scores.data() + g * L + t, lanes(nk), _mm512_mul_ps(d, sc));
        }
      }
      for (int64_t t = 0; t < L; ++t) rows[t] = v_cache + (rows[t] - k_cache);  // the same slot's value row
      fetch_rows(rows.data(), 0, std::min(L, kRowsAhead<kRowBytes>), kRowBytes);  // behind the softmax
      for (int64_t g = 0; g < G; ++g) {
        soft_cap(scores.data() + g * L, L, softcap);
        softmax_row(scores.data() + g * L, L);
      }
      weighted_values_any<D, KV>(scores.data(), L, rows.data(), out + (b * H + kv_head * G) * D, G);
    }
  });
}

// Prefill rows (table_rows given) in tiles: a chunk's tokens are rows of one request side by side in the batch, and
// each is a decode row over nearly the same keys. attention_avx512 reads and widens every key and value row once per
// query row: 2,000 times for a 2,000-token chunk, which over an int8 cache (codes widened and scaled) cost prefill 1.4x
// float16's time (benchmarks/results/kv_dtype_throughput.md). Here up to kTileHeads / G consecutive rows of one
// request form a tile, and each key (value) row is widened once per tile into an L1-sized buffer that all its query
// heads use. The arithmetic of each row is attention_avx512's, operation for operation: a key's dot product is its
// own fma chain and reduce4 tree (whichever 16 keys share the vector), its row's scores get the same soft-cap and
// softmax_row, and its output accumulates p * v over the keys in ascending order from zero (held in `out` between
// 16-row chunks instead of registers, which stores the same float32 numbers). So a token's output is the same bits
// as decode rows give it, whatever the cache type (tests/test_native_attention.py checks tiles against rows).
constexpr int64_t kTileHeads = 48;  // query heads per tile: G = 3 gives 16 rows; the scores stay ~G * 16 rows * L floats

// out[g] += sum_t p[g * stride + t] * vals[t] (t < n) for G heads, GB at a time in registers, loaded from and
// stored back to `out` once per call
template <int D, int GB>
void accumulate_values(const float* p, int64_t stride, const float* const* vals, int64_t n, float* out) {
  __m512 acc[GB][D / 16];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < D / 16; ++c) acc[g][c] = _mm512_loadu_ps(out + g * D + 16 * c);
  for (int64_t t = 0; t < n; ++t) {
    __m512 pg[GB];
    for (int g = 0; g < GB; ++g) pg[g] = _mm512_set1_ps(p[g * stride + t]);
    for (int c = 0; c < D / 16; ++c) {  // a column at a time, as accumulate8 (below) and why
      const __m512 v = _mm512_load_ps(vals[t] + 16 * c);
      for (int g = 0; g < GB; ++g) acc[g][c] = _mm512_fmadd_ps(pg[g], v, acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(out + g * D + 16 * c, acc[g][c]);
}

template <int D>
void accumulate_values_any(const float* p, int64_t stride, const float* const* vals, int64_t n, float* out, int64_t G) {
  constexpr int kMax = D == 64 ? 4 : D == 128 ? 2 : 1;  // as weighted_values_any
  for (int64_t g = 0; g < G; g += kMax) {
    const float* pg = p + g * stride;
    float* og = out + g * D;
    switch (std::min<int64_t>(kMax, G - g)) {
      case 1: accumulate_values<D, 1>(pg, stride, vals, n, og); break;
      case 2: accumulate_values<D, 2>(pg, stride, vals, n, og); break;
      case 3: accumulate_values<D, (kMax >= 3 ? 3 : 1)>(pg, stride, vals, n, og); break;
      default: accumulate_values<D, kMax>(pg, stride, vals, n, og); break;
    }
  }
}

// 16 cached rows [c, c + n) of one kv head as float32 values: pointers into the cache (float32) or into `buf`,
// widened there once (values16, as attention_avx512 widens them); the rows after these are prefetched
template <int D, typename KV, typename RowAt>
inline void widen16(const RowAt& row_at, int64_t c, int64_t n, int64_t next, float* buf, const float** vals) {
  constexpr int64_t kRowBytes = row_width<KV>(D) * static_cast<int64_t>(sizeof(KV));
  for (int64_t j = c + 16; j < std::min(next, c + 32); ++j)
    for (int64_t b = 0; b < kRowBytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(row_at(j)) + b, _MM_HINT_T0);
  for (int64_t j = 0; j < n; ++j) {
    const KV* row = row_at(c + j);
    if constexpr (std::is_same_v<KV, float>) {
      vals[j] = row;
    } else {
      for (int d = 0; d < D; d += 16) _mm512_store_ps(buf + j * D + d, values16<D>(row, d));
      vals[j] = buf + j * D;
    }
  }
}

template <int D, typename KV>
void prefill_attention_avx512(const float* q, const KV* k_cache, const KV* v_cache, const int64_t* block_tables,
                              const int64_t* context_lens, const int64_t* table_rows, float* out, int64_t B,
                              int64_t H, int64_t block_size, int64_t Hkv, int64_t max_blocks, float scale,
                              int64_t window, float softcap) {
  const int64_t G = H / Hkv, W = row_width<KV>(D), tile_rows = std::max<int64_t>(1, kTileHeads / G);
  const auto tiles = prefill_tiles(table_rows, B, tile_rows);
  const int64_t n = static_cast<int64_t>(tiles.size()) * Hkv;
  lmserve::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    TileRows span(tile_rows);
    std::vector<const KV*> at;  // the tile's key rows [lo, hi), located once (a value row: the same slot in v_cache)
    alignas(64) float widened[16 * D];
    alignas(64) float part[16];
    const float* vals[16];
    for (int64_t k = begin; k < end; ++k) {
      const int64_t item = k % 2 == 0 ? k / 2 : n - 1 - k / 2;  // zigzag, as decode_attention: tiles grow in length
      const auto [b0, rows] = tiles[item / Hkv];
      const int64_t kv_head = item % Hkv;
      const int64_t* table = block_tables + table_rows[b0] * max_blocks;
      span.set(context_lens, b0, rows, window, G);
      const std::vector<int64_t>&t0 = span.t0, &t1 = span.t1, &off = span.off;
      const int64_t lo = span.lo, hi = span.hi, total = span.total;
      scores.resize(total);
      at.resize(hi - lo);
      locate_rows(at.data(), k_cache, table, lo, hi - lo, block_size, Hkv, kv_head, W);
      auto key_at = [&](int64_t p) { return at[p - lo]; };
      auto value_at = [&](int64_t p) { return v_cache + (at[p - lo] - k_cache); };
      const __m512 sc = _mm512_set1_ps(scale);
      for (int64_t c = lo; c < hi; c += 16) {  // scores: each 16 keys widened once for every row and head of the tile
        const int64_t nk = std::min<int64_t>(16, hi - c);
        widen16<D, KV>(key_at, c, nk, hi, widened, vals);
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t a = std::max(c, t0[i]), e = std::min(c + nk, t1[i]);
          if (a >= e) continue;
          const int64_t L = t1[i] - t0[i];
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = q + ((b0 + i) * H + kv_head * G + g) * D;
            const __m512 d = e - c == 16 ? dots16<D, true, float>(qg, vals, 16)
                                         : dots16<D, false, float>(qg, vals, static_cast<int>(e - c));
            _mm512_store_ps(part, _mm512_mul_ps(d, sc));
            std::copy(part + (a - c), part + (e - c), scores.data() + off[i] + g * L + (a - t0[i]));
          }
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t L = t1[i] - t0[i];
        for (int64_t g = 0; g < G; ++g) {
          soft_cap(scores.data() + off[i] + g * L, L, softcap);
          softmax_row(scores.data() + off[i] + g * L, L);
        }
        std::fill_n(out + ((b0 + i) * H + kv_head * G) * D, G * D, 0.f);
      }
      for (int64_t c = lo; c < hi; c += 16) {  // outputs: each 16 value rows widened once for the tile
        const int64_t nv = std::min<int64_t>(16, hi - c);
        widen16<D, KV>(value_at, c, nv, hi, widened, vals);
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t a = std::max(c, t0[i]), e = std::min(c + nv, t1[i]);
          if (a >= e) continue;
          accumulate_values_any<D>(scores.data() + off[i] + (a - t0[i]), t1[i] - t0[i], vals + (a - c), e - a,
                                   out + ((b0 + i) * H + kv_head * G) * D, G);
        }
      }
    }
  });
}

}  // namespace
#pragma GCC pop_options
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The x86-64-v3 version (AVX2 + FMA + F16C), 1.2-1.5x faster than the loop above (16 rows over 80-500 float16
// keys, CPU time under load): attention_avx512's structure 8 lanes wide. 8 keys' dot products (each its own fma
// chain, score_tile) reduced at once by reduce8's fixed tree, a vector exp, and the outputs accumulated kOutRows8
// value rows at a time with up to 3 query heads x 32 columns in registers, held in `out` between those chunks
// (which stores the same float32 numbers). No fast-math or FMA contraction (simd_avx2.h), and each (row, kv head)
// is computed alone: a row's result never depends on the batch; prefill rows (table_rows given) run in tiles with
// the same bits (prefill_attention_avx2 below).
#define LMSERVE_ATTENTION_AVX2 1
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#include "simd_avx2.h"

namespace {

// lanes [0, n) of s (n <= 8), the others -inf
inline __m256 load_or_ninf(const float* s, int64_t n) {
  if (n >= 8) return _mm256_loadu_ps(s);
  const __m256i m = lmserve_simd::tail_mask(n);
  return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_maskload_ps(s, m), _mm256_castsi256_ps(m));
}

inline void store_n(float* s, int64_t n, __m256 v) {
  if (n >= 8) _mm256_storeu_ps(s, v);
  else _mm256_maskstore_ps(s, lmserve_simd::tail_mask(n), v);
}

// s[0..L) <- softmax(s): max, exp of the differences, their sum lane by lane in order then one tree, a multiply
void softmax_row8(float* s, int64_t L) {
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < L; t += 8) mx = _mm256_max_ps(mx, load_or_ninf(s + t, L - t));
  const __m256 top = _mm256_set1_ps(lmserve_simd::hmax(mx));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < L; t += 8) {
    const __m256 e = lmserve_simd::exp_nonpositive(_mm256_sub_ps(load_or_ninf(s + t, L - t), top));  // 0 past L
    store_n(s + t, L - t, e);
    sum = _mm256_add_ps(sum, e);
  }
  const __m256 inv = _mm256_set1_ps(1.f / lmserve_simd::hsum(sum));
  for (int64_t t = 0; t < L; t += 8) store_n(s + t, L - t, _mm256_mul_ps(load_or_ninf(s + t, L - t), inv));
}

// Scores, (row, head) pairs x keys: chains[(p * 8 + j) * 8 ..] <- the 8 lanes of q[p] . k[j]'s fma chain (q * k over
// the first 8 values, then fma over the next in order; reduce8 sums the lanes), NP pairs x NK keys in registers for
// the whole row (D / 8 steps; 12 accumulators, 3 key vectors and a query vector fill AVX2's 16 registers). Decode rows
// (attention_avx2: a row's G heads) and prefill tiles (its rows' heads) both run it, so their chains are the same.
// Each step loads NP + NK vectors for NP * NK fmas, 7 for 12. Before it, decode loaded a query and a key vector per
// fma (dots8) and prefill a query vector per fma with each chain parked in memory every 64 values: Zen 1 splits a
// 256-bit load in two, so both loops issued more load halves than fma halves. Measured on Zen 1 (one thread,
// before/after alternating): prefill (benchmarks/prefill_attention.py, 2,000 tokens) SmolLM2's shape -3..-12%, Gemma
// 3's -13..-19%, where 4 x 3 and 3 x 4 measured alike, 3 x 3 and 2 x 4 slower; decode (benchmarks/decode_attention.py,
// 16 rows at 300 keys, 2 threads) Gemma 3 -23..-28%, SmolLM2 unchanged (dots8 held its 8 query vectors in registers).
constexpr int64_t kPairs = 4, kKeys = 3;

// 8 values of a cached row as float32: a widened row, or float16 straight from the cache (exact either way)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int D, int NP, int NK, typename KT = float>
inline void score_tile(const float* const* q, const KT* const* k, float* chains) {
  __m256 acc[NP][NK];
  {
    __m256 kv[NK];
    for (int j = 0; j < NK; ++j) kv[j] = load8(k[j]);
    for (int p = 0; p < NP; ++p) {
      const __m256 qv = _mm256_loadu_ps(q[p]);
      for (int j = 0; j < NK; ++j) acc[p][j] = _mm256_mul_ps(qv, kv[j]);
    }
  }
  for (int c = 8; c < D; c += 8) {
    __m256 kv[NK];
    for (int j = 0; j < NK; ++j) kv[j] = load8(k[j] + c);
    for (int p = 0; p < NP; ++p) {
      const __m256 qv = _mm256_loadu_ps(q[p] + c);
      for (int j = 0; j < NK; ++j) acc[p][j] = _mm256_fmadd_ps(qv, kv[j], acc[p][j]);
    }
  }
  for (int p = 0; p < NP; ++p)
    for (int j = 0; j < NK; ++j) _mm256_store_ps(chains + (p * 8 + j) * 8, acc[p][j]);
}

// score_tile<D, np, nk> for 1 <= np <= NP, 1 <= nk <= NK: a tile's last pairs and keys take the smaller shapes
template <int D, int NP, int NK, typename KT>
inline void score_block(int64_t np, int64_t nk, const float* const* q, const KT* const* k, float* chains) {
  if constexpr (NP > 1)
    if (np < NP) return score_block<D, NP - 1, NK>(np, nk, q, k, chains);
  if constexpr (NK > 1)
    if (nk < NK) return score_block<D, NP, NK - 1>(np, nk, q, k, chains);
  score_tile<D, NP, NK, KT>(q, k, chains);
}

// every pair's chains against keys k[0, nk) (nk <= 8), kPairs x kKeys at a time
template <int D, typename KT = float>
inline void score_pairs(int64_t pairs, int64_t nk, const float* const* q, const KT* const* k, float* chains) {
  for (int64_t p0 = 0; p0 < pairs; p0 += kPairs)
    for (int64_t j0 = 0; j0 < nk; j0 += kKeys)
      score_block<D, kPairs, kKeys>(std::min(kPairs, pairs - p0), std::min(kKeys, nk - j0), q + p0, k + j0,
                                    chains + (p0 * 8 + j0) * 8);
}

// one pair's scores for keys [0, n) from its 8 chains (lanes from n on: 0)
inline __m256 pair_scores(const float* chains, int64_t n) {
  __m256 p[8];
  for (int64_t j = 0; j < 8; ++j) p[j] = j < n ? _mm256_load_ps(chains + j * 8) : _mm256_setzero_ps();
  return lmserve_simd::reduce8(p);
}

// value rows the x86-64-v3 loops widen at a time for the outputs (8 for the scores): accumulate8 loads and stores its
// accumulators once per call, and at 8 rows a call those loads and stores were a fifth of its instructions
template <int D>
constexpr int64_t kOutRows8 = std::max<int64_t>(8, 2048 / D);

// out[g][c0, c0 + 32) += sum_t p[g * L + t] * vals[t][c0, ...) for GB heads (t < n), in registers for the call.
// A key's GB broadcasts first, then one value vector at a time: 12 sums + 3 broadcasts + 1 value fill the 16
// registers. Loading the row's 4 value vectors first took 17, and GCC kept one sum on the stack, a store and a
// load-fma every key in that sum's chain (71% of this loop's samples, perf, Zen 4). The same fmas in the same order
// per sum, so the same bits; x86-64-v3 on Zen 4: prefill attention (benchmarks/prefill_attention.py, SmolLM2's
// shape) -25..-35%, decode attention (decode_attention.py, 16 rows) -11..-15%.
template <int GB, typename VT = float>
void accumulate8(const float* p, int64_t L, const VT* const* vals, int64_t n, int64_t c0, int64_t D, float* out) {
  __m256 acc[GB][4];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm256_loadu_ps(out + g * D + c0 + 8 * c);
  for (int64_t t = 0; t < n; ++t) {
    __m256 pg[GB];
    for (int g = 0; g < GB; ++g) pg[g] = _mm256_set1_ps(p[g * L + t]);
    for (int c = 0; c < 4; ++c) {
      const __m256 v = load8(vals[t] + c0 + 8 * c);
      for (int g = 0; g < GB; ++g) acc[g][c] = _mm256_fmadd_ps(pg[g], v, acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + g * D + c0 + 8 * c, acc[g][c]);
}

template <int D, typename KV>
void attention_avx2(const float* q, const KV* k_cache, const KV* v_cache, const int64_t* block_tables,
                    const int64_t* context_lens, const int64_t* table_rows, float* out, int64_t B, int64_t H,
                    int64_t block_size, int64_t Hkv, int64_t max_blocks, float scale, int64_t window, float softcap) {
  const int64_t G = H / Hkv, n = B * Hkv, W = row_width<KV>(D);
  constexpr int64_t kRowBytes = row_width<KV>(D) * static_cast<int64_t>(sizeof(KV));
  lmserve::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const KV*> rows;
    // cached rows as float32 values (as_float), widened once for all G heads: 8 keys for the scores, kOutRows8 value
    // rows for the outputs. A float16 cache's rows are read where they lie, each vector converted as it is loaded
    // (load8): a decode row converts a key once per 4 heads (score_pairs' tile) and a value once per 3 (accumulate8),
    // once in all for SmolLM2's 3, so widening into `widened` first only added a store and a load per vector (same
    // float32 values: the conversion is exact).
    using VT = std::conditional_t<std::is_same_v<KV, c10::Half>, c10::Half, float>;
    alignas(32) float widened[kOutRows8<D> * D];
    const VT* vals[kOutRows8<D>];
    alignas(32) float chains[kMaxGroup * 64];  // [head, key] x 8 lanes
    const float* qs[kMaxGroup];
    auto widen = [&](int64_t t, int64_t nk, int64_t L) {  // rows t.. t + nk, 8 at a time, each 8 fetching 8 more
      for (int64_t j0 = 0; j0 < nk; j0 += 8) {
        const int64_t ahead = t + j0 + kRowsAhead<kRowBytes>;  // scattered blocks
        fetch_rows(rows.data(), std::min(L, ahead), std::min(L, ahead + 8), kRowBytes);
        for (int64_t j = j0; j < std::min(nk, j0 + 8); ++j) {
          if constexpr (std::is_same_v<VT, c10::Half>) vals[j] = rows[t + j];
          else vals[j] = as_float<D>(rows[t + j], widened + j * D);
        }
      }
    };
    for (int64_t k = begin; k < end; ++k) {
      const int64_t item = k % 2 == 0 ? k / 2 : n - 1 - k / 2;  // zigzag, as decode_attention
      const int64_t b = item / Hkv, kv_head = item % Hkv, t0 = first_key(context_lens[b], window);
      const int64_t L = context_lens[b] - t0;  // keys seen, from position t0
      const int64_t* table = block_tables + (table_rows ? table_rows[b] : b) * max_blocks;
      const float* q_rows = q + (b * H + kv_head * G) * D;
      scores.resize(G * L);
      rows.resize(L);
      locate_rows(rows.data(), k_cache, table, t0, L, block_size, Hkv, kv_head, W);
      fetch_rows(rows.data(), 0, std::min(L, kRowsAhead<kRowBytes>), kRowBytes);
      const __m256 sc = _mm256_set1_ps(scale);
      for (int64_t g = 0; g < G; ++g) qs[g] = q_rows + g * D;
      for (int64_t t = 0; t < L; t += 8) {
        const int64_t nk = std::min<int64_t>(8, L - t);
        widen(t, nk, L);
        score_pairs<D, VT>(G, nk, qs, vals, chains);
        for (int64_t g = 0; g < G; ++g)
          store_n(scores.data() + g * L + t, nk, _mm256_mul_ps(pair_scores(chains + g * 64, nk), sc));
      }
      for (int64_t t = 0; t < L; ++t) rows[t] = v_cache + (rows[t] - k_cache);  // the same slot's value row
      fetch_rows(rows.data(), 0, std::min(L, kRowsAhead<kRowBytes>), kRowBytes);  // behind the softmax
      for (int64_t g = 0; g < G; ++g) {
        soft_cap(scores.data() + g * L, L, softcap);
        softmax_row8(scores.data() + g * L, L);
      }
      float* o = out + (b * H + kv_head * G) * D;
      std::fill_n(o, G * D, 0.f);
      for (int64_t t = 0; t < L; t += kOutRows8<D>) {
        const int64_t nv = std::min<int64_t>(kOutRows8<D>, L - t);
        widen(t, nv, L);
        for (int64_t g = 0; g < G; g += 3)
          for (int64_t c0 = 0; c0 < D; c0 += 32) {
            const float* pg = scores.data() + g * L + t;
            switch (std::min<int64_t>(3, G - g)) {
              case 1: accumulate8<1, VT>(pg, L, vals, nv, c0, D, o + g * D); break;
              case 2: accumulate8<2, VT>(pg, L, vals, nv, c0, D, o + g * D); break;
              default: accumulate8<3, VT>(pg, L, vals, nv, c0, D, o + g * D); break;
            }
          }
      }
    }
  });
}

// Prefill rows (table_rows given) in tiles, as prefill_attention_avx512 does on AVX-512: up to kTileHeads2 / G
// consecutive rows of one request share each 8 key (value) rows, located and widened once per tile instead of once
// per row. Each row's numbers are attention_avx2's, operation for operation: a key's score is its own fma chain and
// reduce8 lane (whichever 8 keys share the vector), times the scale; its row's soft-cap and softmax_row8; its output
// p * v accumulated over its keys in ascending order from zero, held in `out` between 8-row chunks. So a token gets
// the bits a decode row gets (tests/test_native_attention.py), and a long prompt's attention stops re-reading,
// re-widening and re-locating (a division per key) its whole context for every one of its rows.
constexpr int64_t kTileHeads2 = 48;  // query heads per tile, as kTileHeads: G = 3 (SmolLM2) gives 16 rows

template <int D, typename KV>
void prefill_attention_avx2(const float* q, const KV* k_cache, const KV* v_cache, const int64_t* block_tables,
                            const int64_t* context_lens, const int64_t* table_rows, float* out, int64_t B, int64_t H,
                            int64_t block_size, int64_t Hkv, int64_t max_blocks, float scale, int64_t window,
                            float softcap) {
  const int64_t G = H / Hkv, W = row_width<KV>(D), tile_rows = std::max<int64_t>(1, kTileHeads2 / G);
  constexpr int64_t kRowBytes = row_width<KV>(D) * static_cast<int64_t>(sizeof(KV));
  const auto tiles = prefill_tiles(table_rows, B, tile_rows);
  const int64_t n = static_cast<int64_t>(tiles.size()) * Hkv;
  lmserve::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    TileRows span(tile_rows);
    std::vector<const KV*> at;  // the tile's key rows [lo, hi), located once
    std::vector<int64_t> live(tile_rows);
    alignas(32) float widened[kOutRows8<D> * D];  // 8 key rows for the scores, kOutRows8 value rows for the outputs
    alignas(32) float part[8];
    alignas(32) float chains[std::max<int64_t>(kTileHeads2, kMaxGroup) * 64];  // [row, head, key] x 8 lanes
    const float* qs[std::max<int64_t>(kTileHeads2, kMaxGroup)];  // the live (row, head) pairs' query rows
    const float* vals[kOutRows8<D>];
    for (int64_t k = begin; k < end; ++k) {
      const int64_t item = k % 2 == 0 ? k / 2 : n - 1 - k / 2;  // zigzag, as decode_attention: tiles grow in length
      const auto [b0, rows] = tiles[item / Hkv];
      const int64_t kv_head = item % Hkv;
      const int64_t* table = block_tables + table_rows[b0] * max_blocks;
      span.set(context_lens, b0, rows, window, G);
      const std::vector<int64_t>&t0 = span.t0, &t1 = span.t1, &off = span.off;
      const int64_t lo = span.lo, hi = span.hi, total = span.total;
      scores.resize(total);
      at.resize(hi - lo);
      locate_rows(at.data(), k_cache, table, lo, hi - lo, block_size, Hkv, kv_head, W);
      // nr rows from position c (key rows, or with `shift` the same slots' value rows) as float32 values in `vals`,
      // 8 at a time, each 8 prefetching the next
      auto widen = [&](int64_t c, int64_t nr, int64_t shift) {
        for (int64_t j0 = 0; j0 < nr; j0 += 8) {
          for (int64_t j = c + j0 + 8; j < std::min(hi, c + j0 + 16); ++j)  // the next 8 rows: scattered across blocks
            for (int64_t b = 0; b < kRowBytes; b += 64)
              _mm_prefetch(reinterpret_cast<const char*>(at[j - lo] + shift) + b, _MM_HINT_T0);
          for (int64_t j = j0; j < std::min(nr, j0 + 8); ++j)
            vals[j] = as_float<D>(at[c + j - lo] + shift, widened + j * D);
        }
      };
      const __m256 sc = _mm256_set1_ps(scale);
      for (int64_t c = lo; c < hi; c += 8) {  // scores: each 8 keys widened once for every row and head of the tile
        const int64_t nk = std::min<int64_t>(8, hi - c);
        widen(c, nk, 0);
        int64_t m = 0;  // the tile's rows that see some of these keys
        for (int64_t i = 0; i < rows; ++i)
          if (std::max(c, t0[i]) < std::min(c + nk, t1[i])) live[m++] = i;
        // Each (row, head, key)'s fma chain as attention_avx2 runs it (score_pairs)
        for (int64_t r = 0; r < m; ++r)
          for (int64_t g = 0; g < G; ++g) qs[r * G + g] = q + ((b0 + live[r]) * H + kv_head * G + g) * D;
        score_pairs<D>(m * G, nk, qs, vals, chains);
        for (int64_t r = 0; r < m; ++r) {
          const int64_t i = live[r];
          const int64_t a = std::max(c, t0[i]), e = std::min(c + nk, t1[i]);
          const int64_t L = t1[i] - t0[i];
          for (int64_t g = 0; g < G; ++g) {
            const __m256 d = _mm256_mul_ps(pair_scores(chains + (r * G + g) * 64, e - c), sc);
            if (a == c) {  // the row sees the chunk from its first key (always, without a window)
              store_n(scores.data() + off[i] + g * L + (c - t0[i]), e - c, d);
            } else {
              _mm256_store_ps(part, d);
              std::copy(part + (a - c), part + (e - c), scores.data() + off[i] + g * L + (a - t0[i]));
            }
          }
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t L = t1[i] - t0[i];
        for (int64_t g = 0; g < G; ++g) {
          soft_cap(scores.data() + off[i] + g * L, L, softcap);
          softmax_row8(scores.data() + off[i] + g * L, L);
        }
        std::fill_n(out + ((b0 + i) * H + kv_head * G) * D, G * D, 0.f);
      }
      const int64_t shift = v_cache - k_cache;  // a slot's value row sits this far from its key row
      for (int64_t c = lo; c < hi; c += kOutRows8<D>) {  // outputs: each kOutRows8 value rows widened once for the tile
        const int64_t nv = std::min<int64_t>(kOutRows8<D>, hi - c);
        widen(c, nv, shift);
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t a = std::max(c, t0[i]), e = std::min(c + nv, t1[i]);
          if (a >= e) continue;
          const int64_t L = t1[i] - t0[i];
          float* o = out + ((b0 + i) * H + kv_head * G) * D;
          for (int64_t g = 0; g < G; g += 3)
            for (int64_t c0 = 0; c0 < D; c0 += 32) {
              const float* pg = scores.data() + off[i] + g * L + (a - t0[i]);
              switch (std::min<int64_t>(3, G - g)) {
                case 1: accumulate8<1>(pg, L, vals + (a - c), e - a, c0, D, o + g * D); break;
                case 2: accumulate8<2>(pg, L, vals + (a - c), e - a, c0, D, o + g * D); break;
                default: accumulate8<3>(pg, L, vals + (a - c), e - a, c0, D, o + g * D); break;
              }
            }
        }
      }
    }
  });
}

}  // namespace
#pragma GCC pop_options
#endif

namespace {

// f(KV*{}) with the element type of a cache of `type` (kv_cache.h's formats)
template <typename F>
void with_kv_type(lmserve::KvType type, const F& f) {
  switch (type) {
    case lmserve::KvType::kFloat: return f(static_cast<float*>(nullptr));
    case lmserve::KvType::kHalf: return f(static_cast<c10::Half*>(nullptr));
    case lmserve::KvType::kInt8: return f(static_cast<int8_t*>(nullptr));
    case lmserve::KvType::kFp8: return f(static_cast<lmserve_kv::Fp8*>(nullptr));
  }
}

}  // namespace

int64_t lmserve::kv_row_width(KvType type, int64_t D) {
  int64_t w = 0;
  with_kv_type(type, [&](auto* tag) { w = row_width<std::remove_pointer_t<decltype(tag)>>(D); });
  return w;
}

// the kernel for this build (AVX-512 or AVX2 where compiled for it) and head size
void lmserve::paged_attention(KvType type, const float* q, const void* k_cache, const void* v_cache,
                              const int64_t* block_tables, const int64_t* context_lens, const int64_t* rows,
                              float* out, int64_t B, int64_t H, int64_t D, int64_t block_size, int64_t Hkv,
                              int64_t mb, float scale, int64_t window, float softcap) {
  with_kv_type(type, [&](auto* tag) {
    using KV = std::remove_pointer_t<decltype(tag)>;
#if defined(LMSERVE_ATTENTION_AVX512)
    auto run = D == 64 ? attention_avx512<64, KV> : D == 128 ? attention_avx512<128, KV> : attention_avx512<256, KV>;
    if (rows != nullptr)  // prefill rows: tiles of a request's consecutive rows, the same numbers (see above)
      run = D == 64 ? prefill_attention_avx512<64, KV> : D == 128 ? prefill_attention_avx512<128, KV>
                                                                  : prefill_attention_avx512<256, KV>;
#elif defined(LMSERVE_ATTENTION_AVX2)
    auto run = D == 64 ? attention_avx2<64, KV> : D == 128 ? attention_avx2<128, KV> : attention_avx2<256, KV>;
    if (rows != nullptr)  // prefill rows: tiles of a request's consecutive rows, the same numbers (see above)
      run = D == 64 ? prefill_attention_avx2<64, KV> : D == 128 ? prefill_attention_avx2<128, KV>
                                                                : prefill_attention_avx2<256, KV>;
#else
    auto run = D == 64 ? decode_attention<64, KV> : D == 128 ? decode_attention<128, KV> : decode_attention<256, KV>;
    if (rows != nullptr)  // prefill rows: tiles of a request's consecutive rows, the same numbers (see above)
      run = D == 64 ? prefill_attention_generic<64, KV> : D == 128 ? prefill_attention_generic<128, KV>
                                                                   : prefill_attention_generic<256, KV>;
#endif
    run(q, static_cast<const KV*>(k_cache), static_cast<const KV*>(v_cache), block_tables, context_lens, rows, out,
        B, H, block_size, Hkv, mb, scale, window, softcap);
  });
}

void lmserve::write_kv_slots(KvType type, void* cache, int64_t num_slots, const float* k, int64_t k_stride,
                             const float* v, int64_t v_stride, const int64_t* slots, int64_t T, int64_t Hkv,
                             int64_t D) {
  with_kv_type(type, [&](auto* tag) {
    using KV = std::remove_pointer_t<decltype(tag)>;
    const int64_t W = row_width<KV>(D);
    KV* kc = static_cast<KV*>(cache);
    KV* vc = kc + num_slots * Hkv * W;
    // tokens in parallel only for a prefill's many rows: a decode step's few are cheaper than a wake-up
    lmserve::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t h = 0; h < Hkv; ++h) {
          lmserve_kv::encode_row(k + t * k_stride + h * D, kc + (slots[t] * Hkv + h) * W, D);
          lmserve_kv::encode_row(v + t * v_stride + h * D, vc + (slots[t] * Hkv + h) * W, D);
        }
    });
  });
}
