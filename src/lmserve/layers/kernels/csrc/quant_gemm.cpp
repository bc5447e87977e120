// y = x W^T (+ b) with W kept in a GGUF file's quantized codes, float32 CPU, any number of rows.
//
// Why: a decode step reads every weight once, so its time is the bytes read. The embedded model's
// Q4_1 weights are 0.75 bytes per weight in the layout below against 4 for float32 (5.3x less to
// stream). As llama.cpp does, the activations are quantized to int8 per block of 32 (one scale per
// block), the block dot products are integer (AVX2 maddubs, or VNNI dpbusd where the CPU has it; with
// AVX-512 VNNI two blocks per instruction) and they are accumulated in float32. Which loop is compiled
// follows the CPU (-march=native; the build cache is keyed by the CPU's flags, layers/kernels/native.py).
//
// Layouts (layers/formats/gguf_linear.py repacks each GGUF type into one of three, exactly):
//   kind 0, U4: codes uint8 [N, K/2], two 4-bit codes a byte (ggml's order: in block b, byte j holds
//               element 32b+j in its low and 32b+j+16 in its high nibble); scales, mins float [N, K/32]:
//               w = scale * code + min                                   (Q4_0, Q4_1, Q4_K)
//   kind 1, U8: codes uint8 [N, K], one code 0..31 a byte; scales, mins [N, K/32] as above (Q5_0, Q5_1, Q5_K)
//   kind 2, S8: codes int8 [N, K]; scales float [N, K/16] (one per 16 weights), no mins:
//               w = scale * code                                         (Q8_0, Q6_K)
//   kinds 3, 4: codes as U4 (nibbles), each an index into a table of 16 signed bytes (kTables); scales as S8,
//               and mins [N, K/16] where the file has them (Q2_K):
//               w = scale * table[code] (+ min)        (3, NL4: IQ4_NL, IQ4_XS; 4, I4: code - 8, Q2_K, Q3_K)
//               The kernels look the values up with a byte shuffle and go on as for S8.
//   kinds 5, 6: the low-bit K-quants near their file size (K2: Q2_K, K3: Q3_K), per block of 32 weights of a row:
//               8 bytes of 2-bit codes (byte j holds elements j, 8 + j, 16 + j, 24 + j in its bit pairs), for K3 4
//               bytes of high bits (little-endian bit e: element e), then one byte per 16 weights as the file has
//               it (K2: scale | min << 4, both 4-bit; K3: the signed 6-bit scale); codes uint8 [N, K/32 * (10 | 14)].
//               scales float [N, K/256] (d), and for K2 mins [N, K/256] (-dmin):
//               w = (d * sc) * q (+ (-dmin) * m)     (K2: q = code; K3: q = code + 4 * high - 4)
//               The kernels expand the planes to bytes in registers, form d * sc as ggml does, and go on as for S8.
// With x ~ xd * xq per block (xq int8, xs = xd * sum(xq)), a block contributes
//   scale * xd * dot(code, xq) + min * xs    (per half block for kind 4's mins: min * xd * sum(xq of the half)).
//
// Where the CPU has AVX-512 VNNI, layers/formats/gguf_linear.py hands the kernel its weights in a fourth, packed layout
// (gguf_linear.pack regroups them at load): 16 output rows interleaved per block, so that one dpbusd multiplies
// 4 codes of each of the 16 rows by the same 4 activations (broadcast) and its 16 int32 lanes add up to 16
// outputs. A block then costs 8 dpbusd (4 for S8's halves) and one float multiply-add per 16 outputs, where the
// row layout above needs a convert, a multiply and a multiply-add per 2 blocks of 1 output plus a final
// horizontal sum: ~3x fewer vector instructions per multiply-add, which is what bounds this kernel on AVX-512
// cores (4x4 tiles ran at ~45 GMAC/s a core against ~150 here).
//
// Numerics: every output is the same chain of per-block terms in the same order whatever the number of
// rows or threads, so a row's result never depends on its batch (batch invariance).

#include "kernels.h"
#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__SSE4_1__)
#include <immintrin.h>
#endif

// The extension is built with -ffast-math (for the other kernels' reductions); here it would let GCC reassociate
// the float chain differently in each tile shape, and a row's result would depend on its batch.
#pragma GCC optimize("no-fast-math", "fp-contract=off")

#include "simd_avx2.h"
#include "simd_avx512.h"

namespace {

constexpr int64_t kQBlock = 32;  // activation quantization block (and U4/U8 weight block)
constexpr int64_t kNTile = 16;   // weight rows kept hot while every input row passes over them

// kinds 3 and 4: the signed value of each 4-bit code (layers/gguf_linear.TABLES); |value| <= 127, so the
// maddubs of the sign trick below never saturates
alignas(16) constexpr int8_t kTables[2][16] = {
    {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113},  // IQ4_NL's non-linear values
    {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7}};                 // code - 8

constexpr bool nibble_kind(int64_t kind) { return kind == 0 || kind == 3 || kind == 4; }  // two codes a byte
constexpr bool per16_kind(int64_t kind) { return kind >= 2 && kind <= 4; }  // a float scale per 16 weights
constexpr bool super_kind(int64_t kind) { return kind >= 5; }  // K2, K3: an int scale per 16 under a float per 256
constexpr int64_t kSuper = 256;                                 // K2/K3's weights per float scale
// K2/K3: row-layout bytes per block of 32, and the offset of its two scale bytes
constexpr int64_t super_block_bytes(int64_t kind) { return kind == 5 ? 10 : 14; }
constexpr int64_t super_scale_at(int64_t kind) { return kind == 5 ? 8 : 12; }

// K2/K3's scale of a half block from its byte (d * sc, as ggml forms it), and K2's min ((-dmin) * m)
inline float super_scale(int64_t kind, float d, uint8_t s) {
  return d * static_cast<float>(kind == 5 ? (s & 0x0F) : static_cast<int8_t>(s));
}
inline float super_min(float nd, uint8_t s) { return nd * static_cast<float>(s >> 4); }

// code j of block b in the nibble layout (byte j: element j low, element 16 + j high)
inline int nibble(const uint8_t* codes, int64_t b, int j) {
  return (j < 16 ? codes[b * 16 + j] : codes[b * 16 + j - 16] >> 4) & 0x0F;
}

#if defined(__SSE4_1__)
// the sum of 4 int32 lanes (exact)
inline int32_t hsum4(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1))));
}
#endif

// One row of x -> int8 codes, per-block scale, per-block scale * sum(codes). The vector loops compute the same
// numbers as the scalar one (max of |x|, one float multiply, round half to even, an exact integer sum): the
// scalar std::nearbyint is a libm call, which made quantizing ~20-50% of a many-row matmul's time.
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < K / kQBlock; ++b) {
    const float* xb = x + b * kQBlock;
    int8_t* qb = q + b * kQBlock;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb));
    for (int j = 8; j < kQBlock; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + j)));
    const float amax = lmserve_simd::hmax(m);
#elif defined(__SSE4_1__)
    const __m128 sign = _mm_set1_ps(-0.f);
    __m128 h = _mm_andnot_ps(sign, _mm_loadu_ps(xb));
    for (int j = 4; j < kQBlock; j += 4) h = _mm_max_ps(h, _mm_andnot_ps(sign, _mm_loadu_ps(xb + j)));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
    float amax = 0.f;
    for (int j = 0; j < kQBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
#endif
    const float scale = amax / 127.f;
    const float inv = amax > 0.f ? 1.f / scale : 0.f;
    int sum = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512 vi = _mm512_set1_ps(inv);
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v0, vi), kRound));
    const __m512i i1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v1, vi), kRound));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(i0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(i1));
    sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#elif defined(__AVX2__) && defined(__FMA__)
    // a finite block's codes are within [-127, 127], so the saturating packs are plain narrowings (a block with inf
    // or NaN, or a subnormal scale, gets -128 where cvtps gives INT_MIN, as the AVX-512 path; its numbers are
    // garbage either way); packs work within 128-bit lanes, and the permute puts the 4-code groups back in element
    // order. Why vector: the scalar narrowing and sum took ~2.5% of a 16-row x86-64-v3 decode step's samples, on one
    // thread (a 16-row call runs inline); 16 x 576 rows, one thread: 2.82 -> 2.34 us (x86-64-v2 4.63 -> 3.28)
    const __m256 vi = _mm256_set1_ps(inv);
    __m256i iv[4];
    for (int j = 0; j < 4; ++j)
      iv[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * j), vi),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
    sum = hsum4(_mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1)));
#elif defined(__SSE4_1__)  // x86-64-v2: the same rounding (to nearest even) without the libm call, packed as above
    const __m128 vi = _mm_set1_ps(inv);
    __m128i iv[8];
    for (int j = 0; j < 8; ++j)
      iv[j] = _mm_cvtps_epi32(_mm_round_ps(_mm_mul_ps(_mm_loadu_ps(xb + 4 * j), vi),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (int j = 0; j < 2; ++j)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16 * j),
                       _mm_packs_epi16(_mm_packs_epi32(iv[4 * j], iv[4 * j + 1]), _mm_packs_epi32(iv[4 * j + 2], iv[4 * j + 3])));
    sum = hsum4(_mm_add_epi32(_mm_add_epi32(_mm_add_epi32(iv[0], iv[1]), _mm_add_epi32(iv[2], iv[3])),
                              _mm_add_epi32(_mm_add_epi32(iv[4], iv[5]), _mm_add_epi32(iv[6], iv[7]))));
#else
    for (int j = 0; j < kQBlock; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * inv));  // round half to even, as torch.round
      qb[j] = static_cast<int8_t>(v);
      sum += v;
    }
#endif
    d[b] = scale;
    s[b] = scale * static_cast<float>(sum);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// unsigned x signed bytes, 4 adjacent products summed into each of 8 int32 lanes
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  // maddubs cannot saturate here: |code| <= 127 and 2 * 127 * 127 < 32767 (U4/U8 codes are smaller still)
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

using lmserve_simd::hsum;

inline __m256i load_codes(int kind, const uint8_t* codes, int64_t b) {
  if (kind == 0) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + b * 16));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
  }
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b * kQBlock));
}

// block b of a per-16 kind as 32 signed bytes: S8's codes, or the table's values of kinds 3 and 4
inline __m256i load_signed(int kind, const uint8_t* codes, int64_t b) {
  if (kind == 2) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b * kQBlock));
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kTables[kind - 3])));
  return _mm256_shuffle_epi8(table, load_codes(0, codes, b));
}

// scale * xd * dot(w, x) of a per-16 block, and (mins: kind 4 from Q2_K) min * xd * sum(x) per half: lanes
// 0-3 hold the first 16 weights, lanes 4-7 the second 16
inline __m256 per16_block(int kind, const uint8_t* codes, const float* sc, const float* mn, __m256i x, float xd,
                          int64_t b, __m256 acc) {
  const __m256i w = load_signed(kind, codes, b);
  // |w| x (x with w's sign): the unsigned-by-signed product that maddubs/dpbusd take
  const __m256i p = dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set_m128(_mm_set1_ps(sc[2 * b + 1] * xd),
                                                               _mm_set1_ps(sc[2 * b] * xd)), acc);
  if (mn) {
    const __m256i sums = dot_u8s8(_mm256_set1_epi8(1), x);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set_m128(_mm_set1_ps(mn[2 * b + 1] * xd),
                                                                    _mm_set1_ps(mn[2 * b] * xd)), acc);
  }
  return acc;
}

// a K2/K3 block (row layout) as 32 signed values in element order
inline __m256i load_super(int kind, const uint8_t* blk) {
  int64_t low;
  std::memcpy(&low, blk, 8);
  // 64-bit lane s: the 8 bytes shifted by 2s, so that byte j of lane s (element 8s + j) has its code in bits 0-1
  const __m256i v = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(low), _mm256_set_epi64x(6, 4, 2, 0)),
                                     _mm256_set1_epi8(3));
  if (kind == 5) return v;
  int32_t high;
  std::memcpy(&high, blk + 8, 4);
  // byte e <- byte e / 8 of the high bits (each 128-bit lane holds all four), then tested at bit e % 8
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(high), _mm256_set_epi64x(
      0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
  return _mm256_sub_epi8(_mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(4))), _mm256_set1_epi8(4));
}

// (v[0] * f) * xd in lanes 0-3 and (v[1] * f) * xd in lanes 4-7: a half block's factor, as per16_block's
inline __m256 halves(__m128i v, float f, float xd) {
  const __m128 h = _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(v), _mm_set1_ps(f)), _mm_set1_ps(xd));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(h), _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
}

// per16_block's terms for a K2/K3 block: its scales d * sc (and K2's mins (-dmin) * m) formed from the block's two
// scale bytes in vector lanes (the scalar conversions cost more than the block's dot product)
inline __m256 super_block(int kind, const uint8_t* blk, float d, float nd, __m256i x, float xd, __m256 acc) {
  const __m256i w = load_super(kind, blk);
  const uint8_t* sb = blk + super_scale_at(kind);
  const __m128i bytes = _mm_cvtsi32_si128(sb[0] | (sb[1] << 8));
  const __m256i p = dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  if (kind == 6) return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), halves(_mm_cvtepi8_epi32(bytes), d, xd), acc);
  const __m128i q = _mm_cvtepu8_epi32(bytes);
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), halves(_mm_and_si128(q, _mm_set1_epi32(0x0F)), d, xd), acc);
  const __m256i sums = dot_u8s8(_mm256_set1_epi8(1), x);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), halves(_mm_srli_epi32(q, 4), nd, xd), acc);
}
#endif

struct QRows {  // where the quantized input rows live: codes, then per-block scales and scale * sums
  const int8_t* q;
  int64_t stride, K;
  const int8_t* codes(int64_t m) const { return q + m * stride; }
  const float* d(int64_t m) const { return reinterpret_cast<const float*>(q + m * stride + K); }
  const float* s(int64_t m) const { return d(m) + K / kQBlock; }
};

constexpr int64_t kGroup = 16;  // output rows per group of the packed layout (described below)

struct PackedW {  // one group's codes, scales and mins in the packed layout
  const uint8_t* codes;
  const float *sc, *mn;
  int64_t nb;
  // the next group's codes and scales (or none), prefetched block by block while this one is computed: the weights
  // stream from DRAM once a step, and the hardware prefetcher alone left a 1-row matmul at ~7 GB/s
  const uint8_t* next_codes = nullptr;
  const float* next_sc = nullptr;
};
constexpr int kGroupsAtOnce = 4;  // a mixture of experts' item on AVX-512: adjacent groups of one expert (groups_all_rows)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LMSERVE_QGEMM_AVX512 1
// Two blocks (64 weights) per step in 512-bit registers, over a tile of up to 4 weight rows x 4 input rows
// held in 16 accumulators: each weight pair is unpacked once for up to 4 input rows, each input pair loaded
// once for up to 4 weight rows. The dpbusd lanes of a step hold, four bytes each: lanes 0-7 block b, 8-15
// block b + 1. Every (row, input) output is the same chain whatever the tile's size, so the tiling (which
// depends on the batch) never changes a result: one fma per step into its own accumulator, then the lone last
// block (odd block counts) and the offset term added lane-wise, then a fixed tree of adds over the 16 lanes.

// lanes 0-7 <- element 0, 8-15 <- element 1 (a pair's per-block values); and per 4 lanes (S8's per-16 scales)
inline __m512i pair_idx() { return _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0); }
inline __m512i quad_idx() { return _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0); }

// kinds 3, 4: each table value + 128 as an unsigned byte, in all four 128-bit lanes (for a byte shuffle)
template <int KIND>
inline __m512i table_u8() {
  const __m128i t = _mm_load_si128(reinterpret_cast<const __m128i*>(kTables[KIND - 3]));
  return _mm512_broadcast_i32x4(_mm_xor_si128(t, _mm_set1_epi8(static_cast<char>(0x80))));
}

// a pair of weight blocks as unsigned bytes in the activations' order (S8, kinds 3 and 4: w + 128, corrected
// below)
template <int KIND>
inline __m512i load_w(const uint8_t* codes, int64_t b) {
  if (nibble_kind(KIND)) {  // 32 bytes of nibbles -> [lo b, hi b, lo b+1, hi b+1]
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b * 16));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1);
    const __m512i idx =
        _mm512_and_si512(_mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0)), _mm512_set1_epi8(0x0F));
    return KIND == 0 ? idx : _mm512_shuffle_epi8(table_u8<KIND>(), idx);  // kinds 3, 4: value + 128, as S8
  }
  const __m512i w = _mm512_loadu_si512(codes + b * kQBlock);
  return KIND == 2 ? _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80))) : w;
}

// the weight scales of a pair, one per dpbusd lane (U4/U8: one per block; S8: one per 16 weights)
template <int KIND>
inline __m512 w_scale(const float* sc, int64_t b) {
  if (per16_kind(KIND)) return _mm512_permutexvar_ps(quad_idx(), _mm512_castps128_ps512(_mm_loadu_ps(sc + 2 * b)));
  return _mm512_permutexvar_ps(pair_idx(), _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(
      reinterpret_cast<const double*>(sc + b)))));
}

inline __m512 x_scale(const float* xd, int64_t b) {
  return _mm512_permutexvar_ps(pair_idx(), _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(
      reinterpret_cast<const double*>(xd + b)))));
}

// acc + mins[b] * xs[b] lane-wise over the blocks (the U4/U8 offset term), 16 blocks at a time
inline __m512 add_offset_term(__m512 acc, const float* mn, const float* xs, int64_t nb) {
  int64_t b = 0;
  for (; b + 16 <= nb; b += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(mn + b), _mm512_loadu_ps(xs + b), acc);
  if (b < nb) {
    const __mmask16 m = static_cast<__mmask16>((1u << (nb - b)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, mn + b), _mm512_maskz_loadu_ps(m, xs + b), acc);
  }
  return acc;
}

// acc + the last block of an odd block count in lanes 0-7 (256 bits wide)
template <int KIND>
inline __m512 add_last_block(__m512 acc, const uint8_t* codes, const float* sc, const float* mn, const int8_t* xq,
                             const float* xd, int64_t b) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kQBlock));
  __m256 p;
  if (per16_kind(KIND)) {
    p = per16_block(KIND, codes, sc, mn, x, xd[b], b, _mm256_setzero_ps());
  } else {
    p = _mm256_mul_ps(_mm256_cvtepi32_ps(dot_u8s8(load_codes(KIND, codes, b), x)), _mm256_set1_ps(sc[b] * xd[b]));
  }
  return _mm512_add_ps(acc, _mm512_zextps256_ps512(p));
}

struct WRows {  // the weight rows: codes, scales and mins per row
  const uint8_t* codes;
  const float *sc, *mn;
  int64_t cb, sr;
};

// out[m * ldo + n] for n in [n0, n0 + R), m in [m0, m0 + C)
template <int KIND, int R, int C>
void tile(const WRows& w, const QRows& x, int64_t n0, int64_t m0, float* out, int64_t ldo) {
  const int64_t nb = x.K / kQBlock;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b + 1 < nb; b += 2) {
    __m512i xv[C], corr[C];
    __m512 xs[C];
    for (int c = 0; c < C; ++c) {
      xv[c] = _mm512_loadu_si512(x.codes(m0 + c) + b * kQBlock);
      xs[c] = x_scale(x.d(m0 + c), b);
      // S8 weights (and table values) go in as w + 128: take 128 * (each lane's four activations) back out
      if (per16_kind(KIND)) corr[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(static_cast<char>(0x80)), xv[c]);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i wv = load_w<KIND>(w.codes + (n0 + r) * w.cb, b);
      const __m512 ws = w_scale<KIND>(w.sc + (n0 + r) * w.sr, b);
      // kind 4's mins (Q2_K), per 16: min * xd * sum(x), the sum being corr / 128
      const bool mins = KIND == 4 && w.mn;
      const __m512 wm = mins ? _mm512_mul_ps(w_scale<KIND>(w.mn + (n0 + r) * w.sr, b), _mm512_set1_ps(1.f / 128))
                             : _mm512_setzero_ps();
      for (int c = 0; c < C; ++c) {
        __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv[c]);
        if (per16_kind(KIND)) d = _mm512_sub_epi32(d, corr[c]);
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(ws, xs[c]), acc[r][c]);
        if (mins) acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(corr[c]), _mm512_mul_ps(wm, xs[c]), acc[r][c]);
      }
    }
  }
  // the lone last block and the offset term go into the lanes, then one reduction per output
  for (int r = 0; r < R; ++r) {
    const int64_t n = n0 + r;
    __m512 sums[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int c = 0; c < C; ++c) {
      const int64_t m = m0 + c;
      __m512 a = acc[r][c];
      if (nb & 1)
        a = add_last_block<KIND>(a, w.codes + n * w.cb, w.sc + n * w.sr, w.mn ? w.mn + n * w.sr : nullptr,
                                 x.codes(m), x.d(m), nb - 1);
      if (!per16_kind(KIND)) a = add_offset_term(a, w.mn + n * w.sr, x.s(m), nb);
      sums[c] = a;
    }
    alignas(16) float v[4];
    _mm_store_ps(v, lmserve_simd::reduce4(sums[0], sums[1], sums[2], sums[3]));
    for (int c = 0; c < C; ++c) out[(m0 + c) * ldo + n] = v[c];
  }
}

template <int KIND, int R>
void tile_rows(const WRows& w, const QRows& x, int64_t n0, int64_t m0, int64_t C, float* out, int64_t ldo) {
  switch (C) {
    case 1: return tile<KIND, R, 1>(w, x, n0, m0, out, ldo);
    case 2: return tile<KIND, R, 2>(w, x, n0, m0, out, ldo);
    case 3: return tile<KIND, R, 3>(w, x, n0, m0, out, ldo);
    default: return tile<KIND, R, 4>(w, x, n0, m0, out, ldo);
  }
}

template <int KIND>
void tile_any(const WRows& w, const QRows& x, int64_t n0, int64_t R, int64_t m0, int64_t C, float* out,
              int64_t ldo) {
  switch (R) {
    case 1: return tile_rows<KIND, 1>(w, x, n0, m0, C, out, ldo);
    case 2: return tile_rows<KIND, 2>(w, x, n0, m0, C, out, ldo);
    case 3: return tile_rows<KIND, 3>(w, x, n0, m0, C, out, ldo);
    default: return tile_rows<KIND, 4>(w, x, n0, m0, C, out, ldo);
  }
}

// rows [n0, n1) of the output for every input row, in tiles of 4 x 4
void rows_avx512(int kind, const WRows& w, const QRows& x, int64_t M, int64_t n0, int64_t n1, float* out,
                 int64_t ldo) {
  for (int64_t m = 0; m < M; m += 4) {
    const int64_t C = std::min<int64_t>(4, M - m);
    for (int64_t n = n0; n < n1; n += 4) {
      const int64_t R = std::min<int64_t>(4, n1 - n);
      switch (kind) {
        case 0: tile_any<0>(w, x, n, R, m, C, out, ldo); break;
        case 1: tile_any<1>(w, x, n, R, m, C, out, ldo); break;
        case 2: tile_any<2>(w, x, n, R, m, C, out, ldo); break;
        case 3: tile_any<3>(w, x, n, R, m, C, out, ldo); break;
        default: tile_any<4>(w, x, n, R, m, C, out, ldo);
      }
    }
  }
}

// ---- the packed layout: 16 output rows per group ----
//   codes  U4: [G, nb, 4, 64]: byte 4i + q of chunk t is row i's nibble byte 4t + q (low nibble element 4t + q,
//              high nibble element 16 + 4t + q: the row layout's own bytes, regrouped)
//          U8: [G, nb, 8, 64]: byte 4i + q of chunk j is row i's code 4j + q
//          S8: like U8, each code + 128 as an unsigned byte (dpbusd multiplies unsigned by signed bytes; the
//              128 * sum(activations) this adds is taken back out per half block)
//          kinds 3, 4: like U4; the kernel looks each code's table value + 128 up, then goes on as for S8
//   scales [G, nb, 16] (per-16 kinds: [G, 2 nb, 16]), mins likewise: row i's value in lane i
// Each output's chain: for every block b in order, acc += float(dot_b) * (scale_b * xd_b), then (U4/U8)
// acc += min_b * xs_b (S8: the two halves' terms in order). The same chain for any number of input rows.
inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// K2/K3 (kinds 5, 6): block b of a group as S8's 8 vectors (value + 128, elements as the nibble kinds' wv), and
// half[h] the 16 rows' scales d * sc of half h (K2: half[2 + h] their mins (-dmin) * m), formed from the bytes
template <int KIND>
inline void load_super_group(const PackedW& w, int64_t b, __m512i* wv, __m512* half) {
  const uint8_t* p = w.codes + b * (KIND == 5 ? 160 : 224);
  const __m512i three = _mm512_set1_epi8(3), v0 = _mm512_loadu_si512(p), v1 = _mm512_loadu_si512(p + 64);
  for (int s = 0; s < 4; ++s) {
    wv[s] = _mm512_and_si512(_mm512_srli_epi16(v0, 2 * s), three);      // elements 4s .. 4s + 3
    wv[4 + s] = _mm512_and_si512(_mm512_srli_epi16(v1, 2 * s), three);  // elements 16 + 4s ..
  }
  if (KIND == 6) {  // code + 4 * high - 4, + 128
    const __m512i h = _mm512_loadu_si512(p + 128), one = _mm512_set1_epi8(1), bias = _mm512_set1_epi8(124);
    for (int t = 0; t < 8; ++t) {
      const __m512i high = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, t), one), 2);
      wv[t] = _mm512_add_epi8(_mm512_or_si512(wv[t], high), bias);
    }
  } else {
    for (int t = 0; t < 8; ++t) wv[t] = _mm512_or_si512(wv[t], _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  const uint8_t* sb = p + (KIND == 5 ? 128 : 192);
  const __m512 d = _mm512_loadu_ps(w.sc + kGroup * (b / 8));
  for (int k = 0; k < 2; ++k) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16 * k));
    if (KIND == 6) {
      half[k] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
      continue;
    }
    const __m512i q = _mm512_cvtepu8_epi32(bytes);
    half[k] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0x0F))));
    half[2 + k] = _mm512_mul_ps(_mm512_loadu_ps(w.mn + kGroup * (b / 8)), _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)));
  }
}

// 16 outputs of C input rows [m0, m0 + C) over NG groups (groups[q]: its outputs at out + 16 q), stored at
// out[m * ldo + 16 q + 0..15]. Each output's chain is the same for any C and NG; several groups give a tile of 1-3
// rows (a mixture of experts' few rows per expert) independent chains to overlap: one row's chain alone waits on its
// dependent FMAs block after block (group_rows<2, 1..3> took ~3x a 4-row tile's time per row).
template <int KIND, int C, int NG = 1>
void group_rows(const PackedW* groups, const QRows& x, const int32_t* xsum16, int64_t m0, float* out, int64_t ldo) {
  const int64_t nb = groups[0].nb;
  __m512 accs[NG][C];
  for (int q = 0; q < NG; ++q)
    for (int c = 0; c < C; ++c) accs[q][c] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // the next group's codes and scales (after the last of the NG), block by block during the first tile's pass
  // (quant_packed_matmul sets them for U4 and S8 only; parts_rows below does the same on the narrow builds)
  const PackedW& last = groups[NG - 1];
  const bool prefetch = (KIND == 0 || KIND == 2) && last.next_codes != nullptr && m0 == 0;
  for (int64_t b = 0; b < nb; ++b) {
    if (prefetch) {
      constexpr int64_t kBlockBytes = KIND == 0 ? 256 : 512, kScales = KIND == 0 ? 1 : 2;  // per block: scale lines
      for (int64_t i = 0; i < kBlockBytes; i += 64)
        _mm_prefetch(reinterpret_cast<const char*>(last.next_codes + b * kBlockBytes + i), _MM_HINT_T0);
      for (int64_t i = 0; i < kScales; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(last.next_sc + kGroup * kScales * b + 16 * i), _MM_HINT_T0);
        if (KIND == 0)
          _mm_prefetch(reinterpret_cast<const char*>(last.mn + (last.next_sc - last.sc) + kGroup * b), _MM_HINT_T0);
      }
    }
   for (int q = 0; q < NG; ++q) {  // group by group: each keeps its own accumulators
    const PackedW& w = groups[q];
    __m512* acc = accs[q];
    __m512i wv[8];
    if (nibble_kind(KIND)) {
      const uint8_t* p = w.codes + b * 256;
      for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_loadu_si512(p + 64 * t);
        wv[t] = _mm512_and_si512(v, low4);                           // elements 4t .. 4t + 3
        wv[4 + t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);  // elements 16 + 4t ..
      }
      if (KIND >= 3)
        for (int j = 0; j < 8; ++j) wv[j] = _mm512_shuffle_epi8(table_u8<KIND>(), wv[j]);  // value + 128
    } else if (!super_kind(KIND)) {
      for (int j = 0; j < 8; ++j) wv[j] = _mm512_loadu_si512(w.codes + b * 512 + 64 * j);
    }
    if (per16_kind(KIND) || super_kind(KIND)) {
      __m512 half[4];  // the two halves' scales, then their mins where the kind has them (Q2_K: I4, K2)
      const bool mins = KIND == 5 || (KIND == 4 && w.mn);
      if (super_kind(KIND)) {
        load_super_group<KIND>(w, b, wv, half);
      } else {
        half[0] = _mm512_loadu_ps(w.sc + 32 * b), half[1] = _mm512_loadu_ps(w.sc + 32 * b + 16);
        if (mins) half[2] = _mm512_loadu_ps(w.mn + 32 * b), half[3] = _mm512_loadu_ps(w.mn + 32 * b + 16);
      }
      const __m512 s0 = half[0], s1 = half[1];
      for (int c = 0; c < C; ++c) {
        const int8_t* xq = x.codes(m0 + c) + b * kQBlock;
        const int32_t* corr = xsum16 + (m0 + c) * 2 * nb + 2 * b;
        __m512i lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0], bcast4(xq));
        __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[4], bcast4(xq + 16));
        for (int j = 1; j < 4; ++j) {
          lo = _mm512_dpbusd_epi32(lo, wv[j], bcast4(xq + 4 * j));
          hi = _mm512_dpbusd_epi32(hi, wv[4 + j], bcast4(xq + 16 + 4 * j));
        }
        lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(corr[0]));
        hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(corr[1]));
        const float xdb = x.d(m0 + c)[b];
        const __m512 xd = _mm512_set1_ps(xdb);
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(s0, xd), acc[c]);
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(s1, xd), acc[c]);
        if (mins) {  // min * xd * sum(x) per half, the sums being corr / 128
          acc[c] = _mm512_fmadd_ps(half[2], _mm512_set1_ps(xdb * (corr[0] * (1.f / 128))), acc[c]);
          acc[c] = _mm512_fmadd_ps(half[3], _mm512_set1_ps(xdb * (corr[1] * (1.f / 128))), acc[c]);
        }
      }
      continue;
    }
    const __m512 ws = _mm512_loadu_ps(w.sc + 16 * b), wm = _mm512_loadu_ps(w.mn + 16 * b);
    for (int c = 0; c < C; ++c) {
      const int8_t* xq = x.codes(m0 + c) + b * kQBlock;
      // two chains of four (elements 0-15, 16-31) halve the dependent dpbusd latency; integer sums are exact
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0], bcast4(xq));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[4], bcast4(xq + 16));
      for (int j = 1; j < 4; ++j) {
        // U4's chunk j holds elements 4j.. and 16 + 4j..; U8's chunk j elements 4j.., chunk 4 + j 16 + 4j..
        s0 = _mm512_dpbusd_epi32(s0, wv[j], bcast4(xq + 4 * j));
        s1 = _mm512_dpbusd_epi32(s1, wv[4 + j], bcast4(xq + 16 + 4 * j));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      acc[c] = _mm512_fmadd_ps(dot, _mm512_mul_ps(ws, _mm512_set1_ps(x.d(m0 + c)[b])), acc[c]);
      acc[c] = _mm512_fmadd_ps(wm, _mm512_set1_ps(x.s(m0 + c)[b]), acc[c]);
    }
   }
  }
  for (int q = 0; q < NG; ++q)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (m0 + c) * ldo + q * kGroup, accs[q][c]);
}

// every input row against one group, 4 input rows at a time (the group's codes stay in L1 meanwhile). S8 (Q8_0, Q6_K:
// an LM head's usual types) takes 16 rows a tile where there are that many, so each block's 512 bytes of codes and 32
// scales are loaded once for 16 rows instead of once per 4 (benchmarks/quant_gemm_cpu.cpp, a 49152 x 576 S8 matmul,
// 1 thread, Zen 4, M = 16: 20.7 -> 27.4 MAC/cycle; M = 64: 27.7 -> 32.2; the same bits). U4 gained 1-6% so, 8-row
// S8 tiles nothing: both keep 4.
template <int KIND>
void group_all_rows(const PackedW& w, const QRows& x, const int32_t* xsum16, int64_t M, float* out, int64_t ldo) {
  int64_t m = 0;
  if constexpr (KIND == 2)
    for (; m + 16 <= M; m += 16) group_rows<KIND, 16>(&w, x, xsum16, m, out, ldo);
  for (; m + 4 <= M; m += 4) group_rows<KIND, 4>(&w, x, xsum16, m, out, ldo);
  switch (M - m) {
    case 3: return group_rows<KIND, 3>(&w, x, xsum16, m, out, ldo);
    case 2: return group_rows<KIND, 2>(&w, x, xsum16, m, out, ldo);
    case 1: return group_rows<KIND, 1>(&w, x, xsum16, m, out, ldo);
    default: return;
  }
}

// every input row against kGroupsAtOnce adjacent groups (outputs side by side from out): whole tiles group by group,
// then the last 1-3 rows against all of them in one tile (the same chains as group_all_rows, group by group)
template <int KIND>
void groups_all_rows(const PackedW* ws, const QRows& x, const int32_t* xsum16, int64_t M, float* out, int64_t ldo) {
  const int64_t whole = M / 4 * 4;
  for (int q = 0; q < kGroupsAtOnce; ++q)
    for (int64_t m = 0; m < whole; m += 4) group_rows<KIND, 4>(ws + q, x, xsum16, m, out + q * kGroup, ldo);
  switch (M - whole) {
    case 3: return group_rows<KIND, 3, kGroupsAtOnce>(ws, x, xsum16, whole, out, ldo);
    case 2: return group_rows<KIND, 2, kGroupsAtOnce>(ws, x, xsum16, whole, out, ldo);
    case 1: return group_rows<KIND, 1, kGroupsAtOnce>(ws, x, xsum16, whole, out, ldo);
    default: return;
  }
}
#endif

#if !defined(LMSERVE_QGEMM_AVX512) && defined(__SSSE3__) && defined(__SSE4_1__)
#define LMSERVE_QGEMM_NARROW 1
// The packed layout on builds without AVX-512 VNNI (x86-64-v3: AVX2 + FMA; x86-64-v2: SSSE3/SSE4.1): a group's
// 16 rows are read as 2 parts of 8 rows in 256-bit registers (or 4 parts of 4 in 128-bit ones): bytes
// [4 R p, 4 R (p + 1)) of each 64-byte chunk are rows [R p, R (p + 1)). Why the same layout: one repacking at
// load for every level, and a 16-row step reuses each unpacked weight vector for 4 input rows, where the row
// layout's dot_row unpacked every weight again for every input row (a 16-row step cost ~8x a 1-row step on
// x86-64-v3 against ~4x on AVX-512 VNNI).
// Without dpbusd the byte products come from maddubs (unsigned x signed, pairs summed into int16, saturating):
//   U4, U8, and kinds 4-6 whose values are (unsigned code - offset): codes go in unsigned; the int16 pairs are
//     summed over up to 4 chunks before one madd to int32 (15 * 127 * 2 * 8 and 31 * 127 * 2 * 4 stay < 32767),
//     and offset * sum(x) of each half block is taken back out in int32;
//   S8 and IQ4_NL (signed values up to 127 in magnitude): |w| x (x with w's sign), one madd per chunk.
// Every dot is then the exact integer the AVX-512 kernel forms, and each output's float chain is the one its
// comment above describes, the same for any number of input rows (batch invariance within a build).

#if defined(__AVX2__) && defined(__FMA__)
struct Lanes {  // 8 rows a part
  using I = __m256i;
  using F = __m256;
  static constexpr int kRows = 8;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static I set1_8(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  static I set1_32(int32_t v) { return _mm256_set1_epi32(v); }
  static I zero() { return _mm256_setzero_si256(); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static I srli16(I a, int n) { return _mm256_srli_epi16(a, n); }
  static I slli16(I a, int n) { return _mm256_slli_epi16(a, n); }
  static I maddubs(I u, I s) { return _mm256_maddubs_epi16(u, s); }
  static I madd1(I a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I sign8(I a, I b) { return _mm256_sign_epi8(a, b); }
  static I shuffle8(const int8_t* table, I idx) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(table))), idx);
  }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static F set1f(float v) { return _mm256_set1_ps(v); }
  static F zerof() { return _mm256_setzero_ps(); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static void storei(int32_t* p, I v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }
  static I loadi(const int32_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
  static I srli32(I a, int n) { return _mm256_srli_epi32(a, n); }
  // kRows bytes (a part's scale bytes), unsigned or signed, as int32 lanes
  static I widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I widen_s8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
};
#else
struct Lanes {  // 4 rows a part (no FMA at this level: multiply, then add, in the same order everywhere)
  using I = __m128i;
  using F = __m128;
  static constexpr int kRows = 4;
  static I load(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  static I bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm_set1_epi32(v);
  }
  static I set1_8(int v) { return _mm_set1_epi8(static_cast<char>(v)); }
  static I set1_32(int32_t v) { return _mm_set1_epi32(v); }
  static I zero() { return _mm_setzero_si128(); }
  static I and_(I a, I b) { return _mm_and_si128(a, b); }
  static I or_(I a, I b) { return _mm_or_si128(a, b); }
  static I xor_(I a, I b) { return _mm_xor_si128(a, b); }
  static I srli16(I a, int n) { return _mm_srli_epi16(a, n); }
  static I slli16(I a, int n) { return _mm_slli_epi16(a, n); }
  static I maddubs(I u, I s) { return _mm_maddubs_epi16(u, s); }
  static I madd1(I a) { return _mm_madd_epi16(a, _mm_set1_epi16(1)); }
  static I add16(I a, I b) { return _mm_add_epi16(a, b); }
  static I add32(I a, I b) { return _mm_add_epi32(a, b); }
  static I sub32(I a, I b) { return _mm_sub_epi32(a, b); }
  static I sign8(I a, I b) { return _mm_sign_epi8(a, b); }
  static I shuffle8(const int8_t* table, I idx) {
    return _mm_shuffle_epi8(_mm_load_si128(reinterpret_cast<const __m128i*>(table)), idx);
  }
  static F loadf(const float* p) { return _mm_loadu_ps(p); }
  static F set1f(float v) { return _mm_set1_ps(v); }
  static F zerof() { return _mm_setzero_ps(); }
  static F cvt(I a) { return _mm_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm_add_ps(_mm_mul_ps(a, b), c); }
  static void store(float* p, F v) { _mm_storeu_ps(p, v); }
  static void storei(int32_t* p, I v) { _mm_store_si128(reinterpret_cast<__m128i*>(p), v); }
  static I loadi(const int32_t* p) { return _mm_load_si128(reinterpret_cast<const __m128i*>(p)); }
  static I srli32(I a, int n) { return _mm_srli_epi32(a, n); }
  static I widen_u8(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm_cvtepu8_epi32(_mm_cvtsi32_si128(v));
  }
  static I widen_s8(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm_cvtepi8_epi32(_mm_cvtsi32_si128(v));
  }
};
#endif

using VI = Lanes::I;
using VF = Lanes::F;
constexpr int kRowsV = Lanes::kRows;

// the signed-value kinds (S8, IQ4_NL): one chunk's products for one input row, as int32 lanes
inline VI signed_dot(VI w, VI x) { return Lanes::madd1(Lanes::maddubs(Lanes::sign8(w, w), Lanes::sign8(x, w))); }

// chunk t (0..3) of half h (0: elements 0-15, 1: 16-31) of block b for this part, as bytes the kernel multiplies:
// unsigned codes (offset kinds) or signed values (S8, IQ4_NL)
template <int KIND>
inline VI weight_chunk(const uint8_t* blk, int64_t off, int h, int t) {
  if (nibble_kind(KIND)) {
    const VI v = Lanes::load(blk + 64 * t + off);
    const VI code = Lanes::and_(h ? Lanes::srli16(v, 4) : v, Lanes::set1_8(0x0F));
    return KIND == 3 ? Lanes::shuffle8(kTables[0], code) : code;
  }
  if (super_kind(KIND)) {  // crumbs of elements 16h + 4t .., then K3's high bit t of the half's chunk
    const VI c = Lanes::and_(Lanes::srli16(Lanes::load(blk + 64 * h + off), 2 * t), Lanes::set1_8(3));
    if (KIND == 5) return c;
    // high bit 4h + t moved to bit 2 in one shift (bytes' bits shifted across within 16-bit lanes are masked off)
    const VI hv = Lanes::load(blk + 128 + off);
    const int at = 4 * h + t;
    const VI high = Lanes::and_(at >= 2 ? Lanes::srli16(hv, at - 2) : Lanes::slli16(hv, 2 - at), Lanes::set1_8(4));
    return Lanes::or_(c, high);
  }
  const VI v = Lanes::load(blk + 64 * (4 * h + t) + off);
  return KIND == 2 ? Lanes::xor_(v, Lanes::set1_8(0x80)) : v;  // S8 is stored + 128
}

// what each kind's unsigned codes are offset by (value = code - offset), taken back out as offset * sum(x)
constexpr int code_offset(int kind) { return kind == 4 ? 8 : kind == 6 ? 4 : 0; }
constexpr bool signed_kind(int kind) { return kind == 2 || kind == 3; }

// Lanes::kRows outputs (part p of the group) of C input rows [m0, m0 + C), stored at out[m * ldo + R p ..]
template <int KIND, int C>
void part_rows(const PackedW& w, const QRows& x, const int32_t* xsum16, int64_t m0, int p, float* out,
               int64_t ldo) {
  constexpr int64_t kBlockBytes = nibble_kind(KIND) ? 256 : KIND == 5 ? 160 : KIND == 6 ? 224 : 512;
  const int64_t nb = w.nb, off = 4 * kRowsV * p, lane = kRowsV * p;
  VF acc[C];
  for (int c = 0; c < C; ++c) acc[c] = Lanes::zerof();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w.codes + b * kBlockBytes;
    if (KIND == 0) {  // one dot per block: int16 sums over all 8 chunks (<= 30480), one madd
      VI dot[C];
      for (int c = 0; c < C; ++c) dot[c] = Lanes::zero();
      // Not unrolled: unrolled, GCC issued every chunk's maddubs first and spilled them to the stack (~25% of a
      // 16-row Q4_1 matmul on x86-64-v3, ~15% on x86-64-v2); S8's loop below likewise on x86-64-v3 only (~8%;
      // x86-64-v2's ran slower so). The other kinds measured no better so.
#pragma GCC unroll 1
      for (int t = 0; t < 4; ++t) {
        const VI v = Lanes::load(blk + 64 * t + off), low4 = Lanes::set1_8(0x0F);
        const VI lo = Lanes::and_(v, low4), hi = Lanes::and_(Lanes::srli16(v, 4), low4);
        for (int c = 0; c < C; ++c) {
          const int8_t* xb = x.codes(m0 + c) + b * kQBlock + 4 * t;
          dot[c] = Lanes::add16(dot[c], Lanes::add16(Lanes::maddubs(lo, Lanes::bcast4(xb)),
                                                     Lanes::maddubs(hi, Lanes::bcast4(xb + 16))));
        }
      }
      for (int c = 0; c < C; ++c) dot[c] = Lanes::madd1(dot[c]);
      const VF ws = Lanes::loadf(w.sc + kGroup * b + lane), wm = Lanes::loadf(w.mn + kGroup * b + lane);
      for (int c = 0; c < C; ++c) {
        acc[c] = Lanes::fma(Lanes::cvt(dot[c]), Lanes::mul(ws, Lanes::set1f(x.d(m0 + c)[b])), acc[c]);
        acc[c] = Lanes::fma(wm, Lanes::set1f(x.s(m0 + c)[b]), acc[c]);
      }
      continue;
    }
    if (KIND == 1) {  // one dot per block: int16 sums over each half's 4 chunks (<= 31496), then madd
      VI dot[C];
      for (int h = 0; h < 2; ++h) {
        VI s16[C];
        for (int c = 0; c < C; ++c) s16[c] = Lanes::zero();
        for (int t = 0; t < 4; ++t) {
          const VI wv = weight_chunk<KIND>(blk, off, h, t);
          for (int c = 0; c < C; ++c)
            s16[c] = Lanes::add16(s16[c], Lanes::maddubs(wv, Lanes::bcast4(x.codes(m0 + c) + b * kQBlock + 16 * h + 4 * t)));
        }
        for (int c = 0; c < C; ++c) {
          const VI s32 = Lanes::madd1(s16[c]);
          dot[c] = h ? Lanes::add32(dot[c], s32) : s32;
        }
      }
      const VF ws = Lanes::loadf(w.sc + kGroup * b + lane), wm = Lanes::loadf(w.mn + kGroup * b + lane);
      for (int c = 0; c < C; ++c) {
        acc[c] = Lanes::fma(Lanes::cvt(dot[c]), Lanes::mul(ws, Lanes::set1f(x.d(m0 + c)[b])), acc[c]);
        acc[c] = Lanes::fma(wm, Lanes::set1f(x.s(m0 + c)[b]), acc[c]);
      }
      continue;
    }
    // per-16 and super kinds: each half's dot, scale and (where the kind has them) min
    VF half[4];
    const bool mins = KIND == 5 || (KIND == 4 && w.mn);
    if (super_kind(KIND)) {
      const uint8_t* sb = blk + (KIND == 5 ? 128 : 192) + lane;
      const VF d = Lanes::loadf(w.sc + kGroup * (b / 8) + lane);
      for (int k = 0; k < 2; ++k) {
        if (KIND == 6) {
          half[k] = Lanes::mul(d, Lanes::cvt(Lanes::widen_s8(sb + 16 * k)));
          continue;
        }
        const VI q = Lanes::widen_u8(sb + 16 * k);  // scale | min << 4
        half[k] = Lanes::mul(d, Lanes::cvt(Lanes::and_(q, Lanes::set1_32(0x0F))));
        half[2 + k] = Lanes::mul(Lanes::loadf(w.mn + kGroup * (b / 8) + lane), Lanes::cvt(Lanes::srli32(q, 4)));
      }
    } else {
      half[0] = Lanes::loadf(w.sc + 32 * b + lane), half[1] = Lanes::loadf(w.sc + 32 * b + 16 + lane);
      if (mins) half[2] = Lanes::loadf(w.mn + 32 * b + lane), half[3] = Lanes::loadf(w.mn + 32 * b + 16 + lane);
    }
    for (int h = 0; h < 2; ++h) {
      VI dot[C];
      if (signed_kind(KIND)) {
        for (int c = 0; c < C; ++c) dot[c] = Lanes::zero();
#if defined(__AVX2__)
#pragma GCC unroll 1
#endif
        for (int t = 0; t < 4; ++t) {
          const VI wv = weight_chunk<KIND>(blk, off, h, t);
          for (int c = 0; c < C; ++c)
            dot[c] = Lanes::add32(dot[c], signed_dot(wv, Lanes::bcast4(x.codes(m0 + c) + b * kQBlock + 16 * h + 4 * t)));
        }
      } else {
        VI s16[C];
        for (int c = 0; c < C; ++c) s16[c] = Lanes::zero();
        for (int t = 0; t < 4; ++t) {
          const VI wv = weight_chunk<KIND>(blk, off, h, t);
          for (int c = 0; c < C; ++c)
            s16[c] = Lanes::add16(s16[c], Lanes::maddubs(wv, Lanes::bcast4(x.codes(m0 + c) + b * kQBlock + 16 * h + 4 * t)));
        }
        for (int c = 0; c < C; ++c) {
          dot[c] = Lanes::madd1(s16[c]);
          if (code_offset(KIND))
            dot[c] = Lanes::sub32(dot[c], Lanes::set1_32(code_offset(KIND) * xsum16[(m0 + c) * 2 * nb + 2 * b + h]));
        }
      }
      for (int c = 0; c < C; ++c)
        acc[c] = Lanes::fma(Lanes::cvt(dot[c]), Lanes::mul(half[h], Lanes::set1f(x.d(m0 + c)[b])), acc[c]);
    }
    if (mins)  // min * xd * sum(x) per half, after both halves' dots (the AVX-512 kernel's order)
      for (int c = 0; c < C; ++c) {
        const float xdb = x.d(m0 + c)[b];
        const int32_t* s = xsum16 + (m0 + c) * 2 * nb + 2 * b;
        acc[c] = Lanes::fma(half[2], Lanes::set1f(xdb * static_cast<float>(s[0])), acc[c]);
        acc[c] = Lanes::fma(half[3], Lanes::set1f(xdb * static_cast<float>(s[1])), acc[c]);
      }
  }
  for (int c = 0; c < C; ++c) Lanes::store(out + (m0 + c) * ldo + lane, acc[c]);
}

// Half h of block b for parts_shared_rows's unsigned-code kinds (U8, K2, K3): each row's int16 sums over the half's
// 4 chunks, each chunk of every part against the row's one broadcast of 4 activation bytes
template <int KIND, int C, int P>
inline void half_sums(const uint8_t* blk, int64_t off, const QRows& x, int64_t m0, int64_t b, int h, VI (&s16)[C][P]) {
  for (int c = 0; c < C; ++c)
    for (int p = 0; p < P; ++p) s16[c][p] = Lanes::zero();
  for (int t = 0; t < 4; ++t) {
    VI wv[P];
    for (int p = 0; p < P; ++p) wv[p] = weight_chunk<KIND>(blk, off + 4 * kRowsV * p, h, t);
    for (int c = 0; c < C; ++c) {
      const VI xv = Lanes::bcast4(x.codes(m0 + c) + b * kQBlock + 16 * h + 4 * t);
      for (int p = 0; p < P; ++p) s16[c][p] = Lanes::add16(s16[c][p], Lanes::maddubs(wv[p], xv));
    }
  }
}

// part_rows over P adjacent parts [p0, p0 + P) at once, for U8, NL4, K2 and K3 at 1 or 2 input rows (a decode step):
// each broadcast of 4 activation bytes and each block's activation terms (xd, xs, the offset's sum) serve P parts'
// products, and every output's integer dot and float chain are part_rows's (so the same bits at any M). Apart from
// part_rows, not a P = 1 case of it: written with P, GCC compiled part_rows's own tiles ~3-10% slower (one thread,
// quant_gemm_cpu.cpp, NL4 and I4 at M = 16).
template <int KIND, int C, int P>
void parts_shared_rows(const PackedW& w, const QRows& x, const int32_t* xsum16, int64_t m0, int p0, float* out,
                       int64_t ldo) {
  constexpr int64_t kBlockBytes = nibble_kind(KIND) ? 256 : KIND == 5 ? 160 : KIND == 6 ? 224 : 512;
  static_assert(KIND == 1 || KIND == 3 || super_kind(KIND),
                "U4 and S8 take parts_rows (U8 too at 4 rows on x86-64-v3), I4 part_rows");
  const int64_t nb = w.nb, off = 4 * kRowsV * p0, lane = kRowsV * p0;
  VF acc[C][P];
  for (int c = 0; c < C; ++c)
    for (int p = 0; p < P; ++p) acc[c][p] = Lanes::zerof();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w.codes + b * kBlockBytes;
    if (KIND == 1) {  // one dot per block: int16 sums over each half's 4 chunks (<= 31496), then madd
      VI dot[C][P];
      for (int h = 0; h < 2; ++h) {
        VI s16[C][P];
        half_sums<KIND, C, P>(blk, off, x, m0, b, h, s16);
        for (int c = 0; c < C; ++c)
          for (int p = 0; p < P; ++p) {
            const VI s32 = Lanes::madd1(s16[c][p]);
            dot[c][p] = h ? Lanes::add32(dot[c][p], s32) : s32;
          }
      }
      VF ws[P], wm[P];
      for (int p = 0; p < P; ++p)
        ws[p] = Lanes::loadf(w.sc + kGroup * b + lane + kRowsV * p), wm[p] = Lanes::loadf(w.mn + kGroup * b + lane + kRowsV * p);
      for (int c = 0; c < C; ++c) {
        const VF xd = Lanes::set1f(x.d(m0 + c)[b]), xs = Lanes::set1f(x.s(m0 + c)[b]);
        for (int p = 0; p < P; ++p) {
          acc[c][p] = Lanes::fma(Lanes::cvt(dot[c][p]), Lanes::mul(ws[p], xd), acc[c][p]);
          acc[c][p] = Lanes::fma(wm[p], xs, acc[c][p]);
        }
      }
      continue;
    }
    // NL4, K2, K3: each half's dot and scale (and K2's min), part by part
    VF half[P][4];
    constexpr bool mins = KIND == 5;
    for (int p = 0; p < P; ++p) {
      const int64_t lp = lane + kRowsV * p;
      if (super_kind(KIND)) {
        const uint8_t* sb = blk + (KIND == 5 ? 128 : 192) + lp;
        const VF d = Lanes::loadf(w.sc + kGroup * (b / 8) + lp);
        for (int k = 0; k < 2; ++k) {
          if (KIND == 6) {
            half[p][k] = Lanes::mul(d, Lanes::cvt(Lanes::widen_s8(sb + 16 * k)));
            continue;
          }
          const VI q = Lanes::widen_u8(sb + 16 * k);  // scale | min << 4
          half[p][k] = Lanes::mul(d, Lanes::cvt(Lanes::and_(q, Lanes::set1_32(0x0F))));
          half[p][2 + k] = Lanes::mul(Lanes::loadf(w.mn + kGroup * (b / 8) + lp), Lanes::cvt(Lanes::srli32(q, 4)));
        }
      } else {  // NL4: a float scale per 16, no mins
        half[p][0] = Lanes::loadf(w.sc + 32 * b + lp), half[p][1] = Lanes::loadf(w.sc + 32 * b + 16 + lp);
      }
    }
    for (int h = 0; h < 2; ++h) {
      VI dot[C][P];
      if (signed_kind(KIND)) {
        for (int c = 0; c < C; ++c)
          for (int p = 0; p < P; ++p) dot[c][p] = Lanes::zero();
#if defined(__AVX2__)
#pragma GCC unroll 1
#endif
        for (int t = 0; t < 4; ++t) {
          VI wv[P];
          for (int p = 0; p < P; ++p) wv[p] = weight_chunk<KIND>(blk, off + 4 * kRowsV * p, h, t);
          for (int c = 0; c < C; ++c) {
            const VI xv = Lanes::bcast4(x.codes(m0 + c) + b * kQBlock + 16 * h + 4 * t);
            for (int p = 0; p < P; ++p) dot[c][p] = Lanes::add32(dot[c][p], signed_dot(wv[p], xv));
          }
        }
      } else {
        VI s16[C][P];
        half_sums<KIND, C, P>(blk, off, x, m0, b, h, s16);
        for (int c = 0; c < C; ++c) {
          const VI offset = code_offset(KIND) ? Lanes::set1_32(code_offset(KIND) * xsum16[(m0 + c) * 2 * nb + 2 * b + h])
                                              : Lanes::zero();
          for (int p = 0; p < P; ++p) {
            dot[c][p] = Lanes::madd1(s16[c][p]);
            if (code_offset(KIND)) dot[c][p] = Lanes::sub32(dot[c][p], offset);
          }
        }
      }
      for (int c = 0; c < C; ++c) {
        const VF xd = Lanes::set1f(x.d(m0 + c)[b]);
        for (int p = 0; p < P; ++p)
          acc[c][p] = Lanes::fma(Lanes::cvt(dot[c][p]), Lanes::mul(half[p][h], xd), acc[c][p]);
      }
    }
    if (mins)  // min * xd * sum(x) per half, after both halves' dots (the AVX-512 kernel's order)
      for (int c = 0; c < C; ++c) {
        const float xdb = x.d(m0 + c)[b];
        const int32_t* s = xsum16 + (m0 + c) * 2 * nb + 2 * b;
        const VF s0 = Lanes::set1f(xdb * static_cast<float>(s[0])), s1 = Lanes::set1f(xdb * static_cast<float>(s[1]));
        for (int p = 0; p < P; ++p) {
          acc[c][p] = Lanes::fma(half[p][2], s0, acc[c][p]);
          acc[c][p] = Lanes::fma(half[p][3], s1, acc[c][p]);
        }
      }
  }
  for (int c = 0; c < C; ++c)
    for (int p = 0; p < P; ++p) Lanes::store(out + (m0 + c) * ldo + lane + kRowsV * p, acc[c][p]);
}

// Q4_1 (U4) and Q8_0 (S8), the embedded model's types, over P adjacent parts at once (and U8, Q5_*, at 4 rows x 2
// parts on x86-64-v3, its integer pass in assembly: u8_block_4x2): part_rows's integer dots
// and float chains exactly, but each broadcast of 4 activation bytes (and of a block's xd and xs) serves P parts'
// maddubs instead of one. Why: part by part, a 16-row step spent as many instructions on those broadcasts and the
// per-block epilogue as on the products (x86-64-v3: 8 rows a part, 2 parts; x86-64-v2: 4 rows a part, 4 parts).
// Two passes over each run of up to kRun blocks: the integer dots of every block (U4, U8) or half block (S8) into a
// small buffer, then their float chain. Why: a tile's C x P dots and C x P float accumulators do not fit the 16
// vector registers together, and GCC spilled both inside the product loop, storing each accumulator twice a
// block; apart, the float pass holds no dots and the product loop no accumulators (one thread,
// benchmarks/quant_gemm_cpu.cpp at M = 16: x86-64-v3 U4 1536 x 576 +6%, S8 8192 x 576 +3.5%; x86-64-v2 U4 -2.4%,
// S8 +5%; M = 1 unchanged; benchmarks/results/step_levels_zen4_twopass.md).
#if defined(__AVX2__) && defined(__x86_64__) && !defined(LMSERVE_NO_ASM)
#define LMSERVE_U4_ASM 1
constexpr bool kIntPassAsm = true;  // u4_block_4x2 and u8_block_4x2 below
// U4's integer pass for one block of the 4-row, 2-part tile (x86-64-v3), in assembly: dots[c][p][8] <- madd1 of the
// block's int16 sums, each product and sum as parts_rows's loop below forms them. Why: GCC allots that loop's 8
// int16 sums, 4 unpacked weight vectors, the nibble mask and 2 broadcasts to the 16 registers with 6 register moves,
// 5 stack stores and 3 stack loads a chunk (60 instructions around its 16 maddubs); written here, a chunk is its 48:
// 2 loads, 6 to unpack, 8 broadcasts, 16 maddubs and 16 adds, the sums in ymm0-7. int16 adds wrap (and no sum passes
// 30480), so adding each product into its sum rather than both products first gives the same integers:
// the bits of every other tile shape (tests/test_gguf_linear.py checks 1-row calls against 4-row tiles).
// Measured (benchmarks/quant_gemm_cpu.cpp, one thread, 1536 x 576; the hashes equal with -DLMSERVE_NO_ASM): see
// benchmarks/results/u4_asm_zen4.md.
#define U4_WEIGHTS(t)                                                                              \
  "vmovdqu " #t "*64(%[w]), %%ymm9\n\t" "vpsrlw $4, %%ymm9, %%ymm10\n\t"                           \
  "vpand %%ymm8, %%ymm9, %%ymm9\n\t" "vpand %%ymm8, %%ymm10, %%ymm10\n\t"                          \
  "vmovdqu " #t "*64+32(%[w]), %%ymm11\n\t" "vpsrlw $4, %%ymm11, %%ymm12\n\t"                      \
  "vpand %%ymm8, %%ymm11, %%ymm11\n\t" "vpand %%ymm8, %%ymm12, %%ymm12\n\t"
// row X's 4 codes of chunk t against the low nibbles (ymm13) and 16 further on against the high ones (ymm14)
#define U4_ROW(t, X) "vpbroadcastd " #t "*4(%[" #X "]), %%ymm13\n\t" "vpbroadcastd 16+" #t "*4(%[" #X "]), %%ymm14\n\t"
// chunk 0 sets the row's sums a (part 0) and b (part 1); the later chunks add into them
#define U4_SET(a, b)                                                                               \
  "vpmaddubsw %%ymm13, %%ymm9, %%ymm" #a "\n\t" "vpmaddubsw %%ymm14, %%ymm10, %%ymm15\n\t"          \
  "vpaddw %%ymm15, %%ymm" #a ", %%ymm" #a "\n\t"                                                   \
  "vpmaddubsw %%ymm13, %%ymm11, %%ymm" #b "\n\t" "vpmaddubsw %%ymm14, %%ymm12, %%ymm15\n\t"         \
  "vpaddw %%ymm15, %%ymm" #b ", %%ymm" #b "\n\t"
#define U4_ADD(a, b)                                                                               \
  "vpmaddubsw %%ymm13, %%ymm9, %%ymm15\n\t" "vpaddw %%ymm15, %%ymm" #a ", %%ymm" #a "\n\t"         \
  "vpmaddubsw %%ymm14, %%ymm10, %%ymm15\n\t" "vpaddw %%ymm15, %%ymm" #a ", %%ymm" #a "\n\t"        \
  "vpmaddubsw %%ymm13, %%ymm11, %%ymm15\n\t" "vpaddw %%ymm15, %%ymm" #b ", %%ymm" #b "\n\t"        \
  "vpmaddubsw %%ymm14, %%ymm12, %%ymm15\n\t" "vpaddw %%ymm15, %%ymm" #b ", %%ymm" #b "\n\t"
#define U4_CHUNK(t, SUM) \
  U4_WEIGHTS(t) U4_ROW(t, x0) SUM(0, 1) U4_ROW(t, x1) SUM(2, 3) U4_ROW(t, x2) SUM(4, 5) U4_ROW(t, x3) SUM(6, 7)
#define U4_STORE(r, at) "vpmaddwd %%ymm8, %%ymm" #r ", %%ymm" #r "\n\t" "vmovdqa %%ymm" #r ", " #at "(%[d])\n\t"
alignas(32) constexpr uint8_t kLow4x32[32] = {15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15,
                                              15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15};
alignas(32) constexpr int16_t kOnes16x16[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

// blk: the block's 256 code bytes (both parts); x0..x3: the 4 rows' 32 codes of the block; dots: 32-byte aligned
inline void u4_block_4x2(const uint8_t* blk, const int8_t* x0, const int8_t* x1, const int8_t* x2, const int8_t* x3,
                         int32_t* dots) {
  __asm__ volatile(
      "vmovdqa %[low4], %%ymm8\n\t"
      U4_CHUNK(0, U4_SET) U4_CHUNK(1, U4_ADD) U4_CHUNK(2, U4_ADD) U4_CHUNK(3, U4_ADD)
      "vmovdqa %[ones], %%ymm8\n\t"
      U4_STORE(0, 0) U4_STORE(1, 32) U4_STORE(2, 64) U4_STORE(3, 96)
      U4_STORE(4, 128) U4_STORE(5, 160) U4_STORE(6, 192) U4_STORE(7, 224)
      :
      : [w] "r"(blk), [x0] "r"(x0), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3), [d] "r"(dots),
        [low4] "m"(kLow4x32), [ones] "m"(kOnes16x16)
      : "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "xmm14", "xmm15");
}
// U8's integer pass for one block of a 4-row, 2-part tile (x86-64-v3: Q5_0, Q5_1, Q5_K; parts_rows<1, 4, 2>):
// dots[c][p][8] <- each half's int16 sums over its 4 chunks (<= 31496), madd1'd, the two halves added: the integers
// of part_rows<1, C>, which took one part at a time, so two parts a pass share each broadcast (and GCC's code for that
// loop held its sums on the stack: 75 stack accesses around 32 maddubs). Sums in ymm0-7 (row c, part p: 2c + p), the
// parts' codes ymm9-10, a broadcast ymm11; half 0's dots wait in `dots` for half 1's. One thread, 1536 x 576:
// 88-89 -> 108-110 GMAC/s at M = 16-256 (benchmarks/results/u4_asm_zen4.md).
#define U8_SET(a, b)                                                                               \
  "vpmaddubsw %%ymm11, %%ymm9, %%ymm" #a "\n\t" "vpmaddubsw %%ymm11, %%ymm10, %%ymm" #b "\n\t"
#define U8_ADD(a, b)                                                                               \
  "vpmaddubsw %%ymm11, %%ymm9, %%ymm12\n\t" "vpaddw %%ymm12, %%ymm" #a ", %%ymm" #a "\n\t"         \
  "vpmaddubsw %%ymm11, %%ymm10, %%ymm12\n\t" "vpaddw %%ymm12, %%ymm" #b ", %%ymm" #b "\n\t"
#define U8_ROW(o, X, a, b, SUM) "vpbroadcastd " #o "(%[" #X "]), %%ymm11\n\t" SUM(a, b)
#define U8_CHUNK(wo, xo, SUM)                                                                      \
  "vmovdqu " #wo "(%[w]), %%ymm9\n\t" "vmovdqu " #wo "+32(%[w]), %%ymm10\n\t"                      \
  U8_ROW(xo, x0, 0, 1, SUM) U8_ROW(xo, x1, 2, 3, SUM) U8_ROW(xo, x2, 4, 5, SUM) U8_ROW(xo, x3, 6, 7, SUM)
#define U8_MADD(r) "vpmaddwd %%ymm8, %%ymm" #r ", %%ymm" #r "\n\t"
#define U8_FIRST(r, at) U8_MADD(r) "vmovdqa %%ymm" #r ", " #at "(%[d])\n\t"
#define U8_SECOND(r, at) \
  U8_MADD(r) "vpaddd " #at "(%[d]), %%ymm" #r ", %%ymm" #r "\n\t" "vmovdqa %%ymm" #r ", " #at "(%[d])\n\t"
inline void u8_block_4x2(const uint8_t* blk, const int8_t* x0, const int8_t* x1, const int8_t* x2, const int8_t* x3,
                         int32_t* dots) {
  __asm__ volatile(
      "vmovdqa %[ones], %%ymm8\n\t"
      U8_CHUNK(0, 0, U8_SET) U8_CHUNK(64, 4, U8_ADD) U8_CHUNK(128, 8, U8_ADD) U8_CHUNK(192, 12, U8_ADD)
      U8_FIRST(0, 0) U8_FIRST(1, 32) U8_FIRST(2, 64) U8_FIRST(3, 96)
      U8_FIRST(4, 128) U8_FIRST(5, 160) U8_FIRST(6, 192) U8_FIRST(7, 224)
      U8_CHUNK(256, 16, U8_SET) U8_CHUNK(320, 20, U8_ADD) U8_CHUNK(384, 24, U8_ADD) U8_CHUNK(448, 28, U8_ADD)
      U8_SECOND(0, 0) U8_SECOND(1, 32) U8_SECOND(2, 64) U8_SECOND(3, 96)
      U8_SECOND(4, 128) U8_SECOND(5, 160) U8_SECOND(6, 192) U8_SECOND(7, 224)
      :
      : [w] "r"(blk), [x0] "r"(x0), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3), [d] "r"(dots), [ones] "m"(kOnes16x16)
      : "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12");
}
#undef U8_SET
#undef U8_ADD
#undef U8_ROW
#undef U8_CHUNK
#undef U8_MADD
#undef U8_FIRST
#undef U8_SECOND
#undef U4_WEIGHTS
#undef U4_ROW
#undef U4_SET
#undef U4_ADD
#undef U4_CHUNK
#undef U4_STORE
#endif

#if !defined(LMSERVE_U4_ASM)
constexpr bool kIntPassAsm = false;
#endif

template <int KIND, int C, int P>
void parts_rows(const PackedW& w, const QRows& x, int64_t m0, int p0, float* out, int64_t ldo) {
  static_assert(KIND == 0 || KIND == 1 || KIND == 2, "U4, U8 and S8 only");
  static_assert(KIND != 1 || (kIntPassAsm && C == 4 && P == 2 && kRowsV == 8),
                "U8 takes parts_rows only as u8_block_4x2's tile (x86-64-v3, 4 rows, both parts: p0 = 0)");
  constexpr int kRun = 8, kHalves = KIND == 2 ? 2 : 1;  // U4, U8: one dot a block; S8: one a half (its scales)
  constexpr int64_t kBlockBytes = KIND == 0 ? 256 : 512;
  constexpr int64_t kPartBytes = 4 * kRowsV;  // a part's bytes in each 64-byte chunk
  const int64_t nb = w.nb, off = kPartBytes * p0, lane = kRowsV * p0;
  const int8_t* xc[C];
  const float *xd[C], *xs[C];
  for (int c = 0; c < C; ++c) xc[c] = x.codes(m0 + c), xd[c] = x.d(m0 + c), xs[c] = x.s(m0 + c);
  alignas(32) int32_t dots[kRun][kHalves][C][P][kRowsV];
  VF acc[C][P];
  for (int c = 0; c < C; ++c)
    for (int p = 0; p < P; ++p) acc[c][p] = Lanes::zerof();
  const bool prefetch = w.next_codes != nullptr && m0 == 0 && p0 == 0;  // once per group: its first tile's pass
  for (int64_t b0 = 0; b0 < nb; b0 += kRun) {
    const int run = static_cast<int>(std::min<int64_t>(kRun, nb - b0));
    for (int r = 0; r < run; ++r) {  // the integer pass
      const int64_t b = b0 + r;
      const uint8_t* blk = w.codes + b * kBlockBytes + off;
      // The next group's weights go to L2 (T1), not L1: at 16 rows a group's tiles keep ~16 KB of L1 busy with its
      // own weights and the rows' codes (16 x 576 = 9 KB of inputs, 4.6 KB of Q4_1 codes, 2.3 KB of scales and
      // mins; more at K = 1,536), and the next group's lines pulled into L1 pushed those out. Measured (Zen 4,
      // x86-64-v3, quant_gemm_cpu.cpp, one thread, weights past L3 as a decode step streams them, alternating
      // builds): U4 65536 x 576 at M = 16 87-91 -> 98-101 GMAC/s, 24576 x 1536 even; S8 49152 x 576 (the LM
      // head's shape) 46-47 -> 48-52; M = 1 even. AVX-512's group_rows keeps T0 (T1 measured 1-3% slower there).
      if (prefetch) {
        for (int64_t i = 0; i < kBlockBytes; i += 64)
          _mm_prefetch(reinterpret_cast<const char*>(w.next_codes + b * kBlockBytes + i), _MM_HINT_T1);
        // scales (and U4's mins): 16 floats a block (S8: 32), one or two lines
        for (int64_t i = 0; i < kHalves; ++i) {
          _mm_prefetch(reinterpret_cast<const char*>(w.next_sc + kGroup * kHalves * b + 16 * i), _MM_HINT_T1);
          if (KIND == 0)
            _mm_prefetch(reinterpret_cast<const char*>(w.mn + (w.next_sc - w.sc) + kGroup * b), _MM_HINT_T1);
        }
      }
#if defined(LMSERVE_U4_ASM)
      if constexpr (KIND == 0 && C == 4 && P == 2 && kRowsV == 8) {  // the whole tile (p0 = 0): u4_block_4x2
        static_assert(kGroup / kRowsV == P, "one pass covers the group's parts, so p0 is 0");
        const int64_t at = b * kQBlock;
        u4_block_4x2(blk, xc[0] + at, xc[1] + at, xc[2] + at, xc[3] + at, dots[r][0][0][0]);
        continue;
      }
      if constexpr (KIND == 1) {  // U8 takes parts_rows only here: 4 rows x 2 parts (group_all_rows)
        const int64_t at = b * kQBlock;
        u8_block_4x2(blk, xc[0] + at, xc[1] + at, xc[2] + at, xc[3] + at, dots[r][0][0][0]);
        continue;
      }
#endif
      if constexpr (KIND != 1)
      for (int h = 0; h < kHalves; ++h) {
        VI dot[C][P];  // set by chunk 0
        // Not unrolled: unrolled, GCC issued every chunk's maddubs first and spilled them to the stack (~25% of a
        // 16-row Q4_1 matmul on x86-64-v3, ~15% on x86-64-v2); S8's loop likewise on x86-64-v3 only (~8%;
        // x86-64-v2's ran slower so)
        if constexpr (KIND == 0) {  // int16 sums over the 8 chunks (<= 30480), one madd
          // chunk t's two products per (row, part); chunk 0's become the dot itself (no add to a zero: exact either
          // way, one vpaddw in eight fewer, which Zen 1 issues at ~1 256-bit instruction a cycle beside vpmaddubsw)
          auto chunk = [&](int t, bool first) {
            VI lo[P], hi[P];
            for (int p = 0; p < P; ++p) {
              const VI v = Lanes::load(blk + 64 * t + kPartBytes * p), low4 = Lanes::set1_8(0x0F);
              lo[p] = Lanes::and_(v, low4), hi[p] = Lanes::and_(Lanes::srli16(v, 4), low4);
            }
            for (int c = 0; c < C; ++c) {
              const int8_t* xb = xc[c] + b * kQBlock + 4 * t;
              const VI x0 = Lanes::bcast4(xb), x1 = Lanes::bcast4(xb + 16);
              for (int p = 0; p < P; ++p) {
                const VI two = Lanes::add16(Lanes::maddubs(lo[p], x0), Lanes::maddubs(hi[p], x1));
                dot[c][p] = first ? two : Lanes::add16(dot[c][p], two);
              }
            }
          };
          chunk(0, true);
#pragma GCC unroll 1
          for (int t = 1; t < 4; ++t) chunk(t, false);
        } else {  // the sign trick, one madd a chunk
          auto chunk = [&](int t, bool first) {  // as U4's: chunk 0's products become the dot
            VI wv[P], aw[P];
            for (int p = 0; p < P; ++p) {
              wv[p] = Lanes::xor_(Lanes::load(blk + 64 * (4 * h + t) + kPartBytes * p), Lanes::set1_8(0x80));
              aw[p] = Lanes::sign8(wv[p], wv[p]);
            }
            for (int c = 0; c < C; ++c) {
              const VI xv = Lanes::bcast4(xc[c] + b * kQBlock + 16 * h + 4 * t);
              for (int p = 0; p < P; ++p) {
                const VI prod = Lanes::madd1(Lanes::maddubs(aw[p], Lanes::sign8(xv, wv[p])));
                dot[c][p] = first ? prod : Lanes::add32(dot[c][p], prod);
              }
            }
          };
          chunk(0, true);
#if defined(__AVX2__)
#pragma GCC unroll 1
#endif
          for (int t = 1; t < 4; ++t) chunk(t, false);
        }
        for (int c = 0; c < C; ++c)
          for (int p = 0; p < P; ++p) Lanes::storei(dots[r][h][c][p], KIND == 0 ? Lanes::madd1(dot[c][p]) : dot[c][p]);
      }
    }
    for (int r = 0; r < run; ++r) {  // the float pass: each output's chain, block by block
      const int64_t b = b0 + r;
      for (int h = 0; h < kHalves; ++h) {
        VF ws[P], wm[P];
        for (int p = 0; p < P; ++p) {
          const int64_t at = (KIND != 2 ? kGroup * b : 32 * b + 16 * h) + lane + kRowsV * p;
          ws[p] = Lanes::loadf(w.sc + at);
          if (KIND != 2) wm[p] = Lanes::loadf(w.mn + at);
        }
        for (int c = 0; c < C; ++c) {
          const VF d = Lanes::set1f(xd[c][b]);
          for (int p = 0; p < P; ++p) {
            acc[c][p] = Lanes::fma(Lanes::cvt(Lanes::loadi(dots[r][h][c][p])), Lanes::mul(ws[p], d), acc[c][p]);
            if (KIND != 2) acc[c][p] = Lanes::fma(wm[p], Lanes::set1f(xs[c][b]), acc[c][p]);
          }
        }
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int p = 0; p < P; ++p) Lanes::store(out + (m0 + c) * ldo + lane + kRowsV * p, acc[c][p]);
}

// Input rows per tile and parts per pass, by instruction counts (valgrind) of a 1536 x 576 Q4_1 and a 1024 x 576 Q8_0
// call at M = 1..16: x86-64-v3 (2 parts of 8 rows) both types 4 rows x both parts (-17% and -21%); x86-64-v2 (4
// parts of 4 rows) Q4_1 2 rows x 4 parts (-22%), Q8_0 4 rows x 1 part (-6%: more parts spilled its registers).
constexpr int parts_tile_rows(int kind) { return kind == 0 && kRowsV == 4 ? 2 : 4; }
constexpr int parts_per_pass(int kind) { return kRowsV == 8 ? 2 : kind == 0 ? 4 : 1; }

// rows [m0, m0 + rem) for rem < C, by the tile of exactly rem rows
template <int KIND, int C, int P>
void parts_tail(const PackedW& w, const QRows& x, int64_t m0, int64_t rem, int p, float* out, int64_t ldo) {
  if constexpr (C > 0) {
    if (rem == C) return parts_rows<KIND, C, P>(w, x, m0, p, out, ldo);
    parts_tail<KIND, C - 1, P>(w, x, m0, rem, p, out, ldo);
  }
}

template <int KIND>
void parts_all_rows(const PackedW& w, const QRows& x, int64_t M, float* out, int64_t ldo) {
  constexpr int C = parts_tile_rows(KIND), P = parts_per_pass(KIND);
  for (int p = 0; p < kGroup / kRowsV; p += P) {
    int64_t m = 0;
    for (; m + C <= M; m += C) parts_rows<KIND, C, P>(w, x, m, p, out, ldo);
    parts_tail<KIND, C - 1, P>(w, x, m, M - m, p, out, ldo);
  }
}

// every input row against one group: part by part (a part's codes stay in L1), 4 input rows at a time
template <int KIND>
void group_all_rows(const PackedW& w, const QRows& x, const int32_t* xsum16, int64_t M, float* out, int64_t ldo) {
  if (KIND == 0 || KIND == 2) return parts_all_rows<KIND == 0 ? 0 : 2>(w, x, M, out, ldo);
  // At 1 or 2 input rows (decode) U8, NL4, K2 and K3 take 2 parts a pass: on Zen 1 a 1-row step is bound by the
  // vector-integer instructions issued, so each broadcast and block term shared by two parts is time (K2/K3's crumbs
  // and high bits cost more to unpack than a 4-bit chunk). One thread, benchmarks/quant_gemm_cpu.cpp, 2048 x 2048,
  // x86-64-v3 on Zen 1, M = 1: U8 -10..-42%, NL4 -14..-25%, K2 -8%, K3 even (-4..-11% in lowbit_layer.py's
  // two-thread layer, its weights from memory); x86-64-v2: U8 -15..-48%, the others even; M = 16 unchanged.
  // I4 stays part by part: lowbit_layer.py's baseline, as Q2_K and Q3_K ran before their own layouts
  if constexpr (KIND == 1 || KIND == 3 || super_kind(KIND)) {
    if (M == 1 || M == 2) {  // (M = 0: nothing to compute, as below)
      for (int p = 0; p < kGroup / kRowsV; p += 2) {
        if (M == 2) parts_shared_rows<KIND, 2, 2>(w, x, xsum16, 0, p, out, ldo);
        else parts_shared_rows<KIND, 1, 2>(w, x, xsum16, 0, p, out, ldo);
      }
      return;
    }
  }
  int64_t m4 = 0;  // rows before m4 are done: on x86-64-v3 U8's 4-row tiles take both parts a pass (u8_block_4x2)
#if defined(LMSERVE_U4_ASM)
  if constexpr (KIND == 1 && kRowsV == 8)
    for (; m4 + 4 <= M; m4 += 4) parts_rows<1, 4, 2>(w, x, m4, 0, out, ldo);
#endif
  for (int p = 0; p < kGroup / kRowsV; ++p) {
    int64_t m = m4;
    for (; m + 4 <= M; m += 4) part_rows<KIND, 4>(w, x, xsum16, m, p, out, ldo);
    switch (M - m) {
      case 3: part_rows<KIND, 3>(w, x, xsum16, m, p, out, ldo); break;
      case 2: part_rows<KIND, 2>(w, x, xsum16, m, p, out, ldo); break;
      case 1: part_rows<KIND, 1>(w, x, xsum16, m, p, out, ldo); break;
      default: break;
    }
  }
}
#endif

// One output: weight row n (its codes/scales/mins) against one quantized input row.
float dot_row(int kind, const uint8_t* codes, const float* sc, const float* mn, const int8_t* xq,
              const float* xd, const float* xs, int64_t K) {
  const int64_t nb = K / kQBlock;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  float acc_min = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kQBlock));
    if (super_kind(kind)) {
      const int64_t s = b / (kSuper / kQBlock);
      acc = super_block(kind, codes + b * super_block_bytes(kind), sc[s], mn ? mn[s] : 0.f, x, xd[b], acc);
    } else if (per16_kind(kind)) {
      acc = per16_block(kind, codes, sc, mn, x, xd[b], b, acc);
    } else {
      const __m256i p = dot_u8s8(load_codes(kind, codes, b), x);
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sc[b] * xd[b]), acc);
      acc_min += mn[b] * xs[b];
    }
  }
  return hsum(acc) + acc_min;
#else
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* xb = xq + b * kQBlock;
    if (super_kind(kind)) {
      const uint8_t* blk = codes + b * super_block_bytes(kind);
      const uint8_t* sb = blk + super_scale_at(kind);
      int dot[2] = {0, 0}, sum[2] = {0, 0};
      for (int j = 0; j < kQBlock; ++j) {
        int w = (blk[j % 8] >> (2 * (j / 8))) & 3;
        if (kind == 6) w += 4 * ((blk[8 + j / 8] >> (j % 8)) & 1) - 4;
        dot[j / 16] += w * xb[j];
        sum[j / 16] += xb[j];
      }
      const int64_t s = b / (kSuper / kQBlock);
      acc += super_scale(kind, sc[s], sb[0]) * xd[b] * dot[0] + super_scale(kind, sc[s], sb[1]) * xd[b] * dot[1];
      if (kind == 5) acc += super_min(mn[s], sb[0]) * xd[b] * sum[0] + super_min(mn[s], sb[1]) * xd[b] * sum[1];
      continue;
    }
    if (per16_kind(kind)) {
      int dot[2] = {0, 0}, sum[2] = {0, 0};
      for (int j = 0; j < kQBlock; ++j) {
        const int w = kind == 2 ? reinterpret_cast<const int8_t*>(codes)[b * kQBlock + j]
                                : kTables[kind - 3][nibble(codes, b, j)];
        dot[j / 16] += w * xb[j];
        sum[j / 16] += xb[j];
      }
      acc += sc[2 * b] * xd[b] * dot[0] + sc[2 * b + 1] * xd[b] * dot[1];
      if (mn) acc += mn[2 * b] * xd[b] * sum[0] + mn[2 * b + 1] * xd[b] * sum[1];
      continue;
    }
    int dot = 0;
    for (int j = 0; j < kQBlock; ++j) {
      const int c = kind == 0 ? nibble(codes, b, j) : codes[b * kQBlock + j];
      dot += c * xb[j];
    }
    acc += sc[b] * xd[b] * dot + mn[b] * xs[b];
  }
  return acc;
#endif
}

int64_t code_bytes_per_row(int kind, int64_t K) {
  return super_kind(kind) ? K / kQBlock * super_block_bytes(kind) : nibble_kind(kind) ? K / 2 : K;
}
int64_t scales_per_row(int kind, int64_t K) {
  return super_kind(kind) ? K / kSuper : per16_kind(kind) ? K / 16 : K / kQBlock;
}

}  // namespace

static_assert(kQBlock == lmserve::kQuantBlock && kSuper == lmserve::kQuantSuper);

int64_t lmserve::quant_row_code_bytes(int64_t kind, int64_t K) { return code_bytes_per_row(static_cast<int>(kind), K); }
int64_t lmserve::quant_row_scales(int64_t kind, int64_t K) { return scales_per_row(static_cast<int>(kind), K); }
int64_t lmserve::quant_packed_code_bytes(int64_t kind) {
  return super_kind(kind) ? 16 * super_block_bytes(kind) : nibble_kind(kind) ? 256 : 512;
}
int64_t lmserve::quant_packed_scale_blocks(int64_t kind, int64_t K) {
  return super_kind(kind) ? K / kSuper : per16_kind(kind) ? 2 * (K / kQBlock) : K / kQBlock;
}

// An embedding table a tied head reads packed: each looked-up row's bytes gathered out of its group (block b's bytes of
// lane l are the 4-byte words at b * code_bytes + 64 j + 4 l) and dequantized as layers/formats/gguf_embedding.py's
// reference (dequantize_rows) does: code * scale, then + min, two roundings (this unit has no FMA contraction). Why
// native: a row's words sit 64 bytes apart, one cache line each (144 lines a row of SmolLM2's Q8_0 table, which a
// decode step's weights have pushed out of cache), and torch's advanced indexing took 0.29 ms for 16 rows and 0.18
// for 1 in an engine's steps (~1% of a 16-row x86-64-v3 decode step, 3% of a 1-row one) on one thread; here every
// line of a row is requested before any is read, so the misses overlap: 0.10 and 0.06 ms
// (benchmarks/results/step_host_zen4_stop75.md).
void lmserve::packed_table_rows(int64_t kind, const uint8_t* codes, const float* scales, const float* mins,
                                const int64_t* ids, int64_t n, int64_t K, float* out) {
  const int64_t nb = K / kQBlock, cb = quant_packed_code_bytes(kind), words = cb / 64;
  const int64_t sblocks = quant_packed_scale_blocks(kind, K), per_scale = K / sblocks;
  lmserve::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t g = ids[r] / kGroup, lane = ids[r] % kGroup;
      const uint8_t* gc = codes + g * nb * cb + 4 * lane;
      const float* gs = scales + g * sblocks * kGroup + lane;
      const float* gm = mins != nullptr ? mins + g * sblocks * kGroup + lane : nullptr;
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t j = 0; j < words; ++j) __builtin_prefetch(gc + b * cb + 64 * j);
      float* o = out + r * K;
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t bytes[kQBlock];
        for (int64_t j = 0; j < words; ++j) std::memcpy(bytes + 4 * j, gc + b * cb + 64 * j, 4);
        for (int64_t i = 0; i < kQBlock; ++i) {
          const int64_t at = b * kQBlock + i, sb = at / per_scale;
          if (kind == 2) {  // stored + 128, a scale per 16
            o[at] = static_cast<float>(static_cast<int8_t>(bytes[i] ^ 0x80)) * gs[sb * kGroup];
            continue;
          }
          // U4: low nibbles are the block's weights 0-15, high nibbles 16-31 (ggml's order); U8: a code a byte
          const int code = kind == 0 ? (i < 16 ? bytes[i] & 0x0F : bytes[i - 16] >> 4) : bytes[i];
          const float scaled = static_cast<float>(code) * gs[sb * kGroup];
          o[at] = scaled + gm[sb * kGroup];
        }
      }
    }
  });
}

// [M, K] int8 codes, then [M, K/32] scales and [M, K/32] scale * sums, in one byte buffer per row
void lmserve::quantize_rows(const float* px, int64_t M, int64_t K, int8_t* po) {
  const int64_t stride = K + 8 * (K / kQBlock);
  lmserve::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      int8_t* row = po + m * stride;
      float* d = reinterpret_cast<float*>(row + K);
      quantize_row(px + m * K, K, row, d, d + K / kQBlock);
    }
  });
}

#if defined(LMSERVE_QGEMM_AVX512) || defined(LMSERVE_QGEMM_NARROW)
#define LMSERVE_QGEMM_PACKED 1
#endif

int64_t lmserve::quant_packed_rows() {
#if defined(LMSERVE_QGEMM_PACKED)
  return kGroup;
#else
  return 0;
#endif
}

#if defined(LMSERVE_QGEMM_PACKED)
namespace {

// The sum of each 16 activation codes per row [M, K/16], times 128 on AVX-512 (what S8's unsigned codes add to
// each half block there) and times 1 on the narrow builds (what their offset codes and mins take)
std::vector<int32_t> half_block_sums(const int8_t* pq, int64_t stride, int64_t M, int64_t K) {
  std::vector<int32_t> out(M * (K / 16));
  int32_t* po = out.data();
  lmserve::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t h = 0; h < K / 16; ++h) {
#if defined(LMSERVE_QGEMM_AVX512)
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(pq + m * stride + 16 * h));
        po[m * (K / 16) + h] = 128 * _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(v));
#else
        int32_t sum = 0;
        for (int j = 0; j < 16; ++j) sum += pq[m * stride + 16 * h + j];
        po[m * (K / 16) + h] = sum;
#endif
      }
  });
  return out;
}

constexpr int64_t kRowChunk = 128;  // rows a pass of quant_packed_matmul (see there)

// quant_packed_matmul's group g (outputs [16 g, 16 g + 16)) for rows [0, M) of x
void packed_group(int64_t kind, const uint8_t* pc, const float* ps, const float* pm, const float* pb, const QRows& xr,
                  const int32_t* px16, int64_t M, int64_t K, int64_t G, int64_t g, float* py, int64_t group_bytes,
                  int64_t scale_count) {
  const int64_t nb = K / kQBlock, N = G * kGroup;
  PackedW w{pc + g * group_bytes, ps + g * scale_count, pm ? pm + g * scale_count : nullptr, nb};
  // prefetch the next group, U4 and S8 at any M. Measured on Zen 5 (benchmarks/quant_gemm_cpu.cpp, one thread, a
  // 24576 x 576 U4 and a 49152 x 576 S8 matmul, CPU time): AVX-512, where group_rows had none, M = 16 -10..-25%
  // (U4) and -23% (S8); x86-64-v3 U4 at M = 16 -3% to -15% (two runs), x86-64-v2 -4% (an earlier measurement,
  // elsewhere, had U4 at M = 16 ~5% slower so and left it to M < 4); on the narrow builds S8 -4% at M = 16, -15%
  // at M = 1, and U4 -15% at M = 1
  if (g + 1 < G && (kind == 2 || kind == 0))
    w.next_codes = w.codes + group_bytes, w.next_sc = w.sc + scale_count;
  float* out = py + g * kGroup;
  switch (kind) {
    case 0: group_all_rows<0>(w, xr, px16, M, out, N); break;
    case 1: group_all_rows<1>(w, xr, px16, M, out, N); break;
    case 2: group_all_rows<2>(w, xr, px16, M, out, N); break;
    case 3: group_all_rows<3>(w, xr, px16, M, out, N); break;
    case 4: group_all_rows<4>(w, xr, px16, M, out, N); break;
    case 5: group_all_rows<5>(w, xr, px16, M, out, N); break;
    default: group_all_rows<6>(w, xr, px16, M, out, N);
  }
  if (pb)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t i = 0; i < kGroup; ++i) out[m * N + i] += pb[g * kGroup + i];
}

}  // namespace

void lmserve::quant_packed_matmul(int64_t kind, const uint8_t* pc, const float* ps, const float* pm, const float* pb,
                                  const int8_t* xq, int64_t xs, int64_t M, int64_t K, int64_t G, float* py) {
  const int64_t nb = K / kQBlock, N = G * kGroup;
  const int64_t code_bytes = quant_packed_code_bytes(kind), scale_blocks = quant_packed_scale_blocks(kind, K);
  const bool halves = per16_kind(kind) || super_kind(kind);  // terms per 16 weights: the half blocks' sums
  const std::vector<int32_t> xsum16 = halves ? half_block_sums(xq, xs, M, K) : std::vector<int32_t>();
  const int32_t* px16 = halves ? xsum16.data() : nullptr;
  const int64_t group_bytes = nb * code_bytes, scale_count = scale_blocks * kGroup;
  // A prefill's rows in passes of kRowChunk, every group in each. Why: a group reads all the call's rows, and 1,024
  // rows of 576 (1,536) int8 inputs and their scales are ~0.7 (2) MB, past a Zen 3 (512 KB) or Zen 4 (1 MB) L2, so
  // every group streamed them from L3; 128 rows stay in L2 beside the group's weights. A row's chain does not depend
  // on which rows share the call (group_all_rows), so the bits are the same. Measured (Zen 4, one thread, the
  // quant_gemm_cpu.cpp kernel alone at M = 1024 / 2048, 576 x 1536 and 1536 x 576 U4): x86-64-v3 110 -> 115-118
  // and 95-110 -> 112-119 GMAC/s, against 116-118 at M = 256; AVX-512 +2..+10%
  // (benchmarks/results/quant_gemm_passes_zen4.md). One parallel region over (pass, group) items, pass-major: the
  // pool hands out runs of items in order, so each thread works through one pass's groups at a time while the
  // pass's rows sit in its L2 (a region per pass cost a prefill more in waits than the passes saved).
  const int64_t passes = (M + kRowChunk - 1) / kRowChunk;
  lmserve::parallel_for(0, passes * G, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r0 = i / G * kRowChunk, g = i % G;
      packed_group(kind, pc, ps, pm, pb, QRows{xq + r0 * xs, xs, K}, px16 ? px16 + r0 * (K / 16) : nullptr,
                   std::min(kRowChunk, M - r0), K, G, g, py + r0 * N, group_bytes, scale_count);
    }
  });
}

// A mixture of experts' grouped projection (what ggml_mul_mat_id does): rows [offsets[e], offsets[e + 1]) of x are
// the tokens routed to expert e, sorted by expert; each is multiplied by its expert's packed matrix. The activations
// are quantized once for all rows, and one parallel_for runs every (expert, group of 16 outputs) pair, so a layer
// costs one call per projection instead of one per expert. A row's chain is packed_linear's for its expert alone
// (group_all_rows takes the same steps for any number of rows), so the bits equal one GGUFLinear per expert.
void lmserve::quant_packed_experts(int64_t kind, const uint8_t* pc, const float* ps, const float* pm,
                                   const int8_t* xq, int64_t stride, const int64_t* off, int64_t E, int64_t K,
                                   int64_t G, float* py) {
  const int64_t R = off[E], nb = K / kQBlock, N = G * kGroup;
  const std::vector<int32_t> xsum16 = kind == 2 ? half_block_sums(xq, stride, R, K) : std::vector<int32_t>();
  const int32_t* px16 = kind == 2 ? xsum16.data() : nullptr;
  const int64_t group_bytes = nb * (kind == 0 ? 256 : 512), group_scales = (kind == 2 ? 2 * nb : nb) * kGroup;
  // an item: kGroupsAtOnce adjacent groups of one expert where G allows (its last 1-3 rows in one tile), else one
#if defined(LMSERVE_QGEMM_AVX512)
  const int64_t span = G % kGroupsAtOnce == 0 ? kGroupsAtOnce : 1, spans = G / span;
#else
  const int64_t span = 1, spans = G;  // the narrow kernels' parts already give a tile several chains
#endif
  lmserve::parallel_for(0, E * spans, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = i / spans, g = i % spans * span, r0 = off[e], M = off[e + 1] - r0;
      if (M <= 0) continue;
      PackedW ws[kGroupsAtOnce];
      for (int64_t q = 0; q < span; ++q) {
        const int64_t wg = e * G + g + q;  // the group's index in the stacked [E * G] groups
        ws[q] = PackedW{pc + wg * group_bytes, ps + wg * group_scales, pm ? pm + wg * group_scales : nullptr, nb};
      }
      const QRows xr{xq + r0 * stride, stride, K};
      const int32_t* s16 = px16 ? px16 + r0 * 2 * nb : nullptr;
      float* out = py + r0 * N + g * kGroup;
#if defined(LMSERVE_QGEMM_AVX512)
      if (span == kGroupsAtOnce) {
        if (kind == 0) groups_all_rows<0>(ws, xr, s16, M, out, N);
        else if (kind == 1) groups_all_rows<1>(ws, xr, s16, M, out, N);
        else groups_all_rows<2>(ws, xr, s16, M, out, N);
        continue;
      }
#endif
      if (kind == 0) group_all_rows<0>(ws[0], xr, s16, M, out, N);
      else if (kind == 1) group_all_rows<1>(ws[0], xr, s16, M, out, N);
      else group_all_rows<2>(ws[0], xr, s16, M, out, N);
    }
  });
}
#else
// never called: the binding unit refuses the packed layout where quant_packed_rows() == 0 (no SSSE3/SSE4.1)
void lmserve::quant_packed_matmul(int64_t, const uint8_t*, const float*, const float*, const float*, const int8_t*,
                                  int64_t, int64_t, int64_t, int64_t, float*) {}
void lmserve::quant_packed_experts(int64_t, const uint8_t*, const float*, const float*, const int8_t*, int64_t,
                                   const int64_t*, int64_t, int64_t, int64_t, float*) {}
#endif

void lmserve::quant_matmul(int64_t kind, const uint8_t* pc, const float* ps, const float* pm, const float* pb,
                           const int8_t* pq, int64_t xs, int64_t M, int64_t K, int64_t N, float* py) {
  const int64_t cb = code_bytes_per_row(kind, K), sr = scales_per_row(kind, K), nb = K / kQBlock;
  lmserve::parallel_for(0, (N + kNTile - 1) / kNTile, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kNTile, n1 = std::min(N, n0 + kNTile);
#if defined(LMSERVE_QGEMM_AVX512)
      if (!super_kind(kind)) {  // K2/K3 rows take dot_row's AVX2 loop (their packed layout is the fast one)
        rows_avx512(static_cast<int>(kind), WRows{pc, ps, pm, cb, sr}, QRows{pq, xs, K}, M, n0, n1, py, N);
        if (pb)
          for (int64_t m = 0; m < M; ++m)
            for (int64_t n = n0; n < n1; ++n) py[m * N + n] += pb[n];
        continue;
      }
#endif
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xr = pq + m * xs;
        const float* xd = reinterpret_cast<const float*>(xr + K);
        for (int64_t n = n0; n < n1; ++n) {
          const float v = dot_row(static_cast<int>(kind), pc + n * cb, ps + n * sr, pm ? pm + n * sr : nullptr, xr,
                                  xd, xd + nb, K);
          py[m * N + n] = pb ? v + pb[n] : v;
        }
      }
    }
  });
}
