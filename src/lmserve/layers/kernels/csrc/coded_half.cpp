// The skinny matmul over a bfloat16 matrix coded losslessly in 12 bits a weight (layers/formats/half_linear.py packs it):
// the LM head a pre-quantized checkpoint keeps unquantized, read with 0.75x the bytes of its bfloat16 panels.
//
// Why: a decode step of a W4A16 SmolLM2 reads 56.6 MB of bfloat16 head against ~50 MB for all its 4-bit layers, and
// the bfloat16 panels already stream at the machine's rate (skinny_linear: 16 GB/s on 2 threads); only fewer bytes
// make the head cheaper. A bfloat16's high byte (sign + 7 of the 8 exponent bits) takes few values in a trained
// matrix: the 16 commonest of a panel (16 output rows) cover all but ~1e-4 of its weights (random-normal weights
// too: each value covers two binades, 16 of them cover 2^16 of range). So each weight is a 4-bit index into its
// panel's table of high bytes (vpshufb looks 16 or 32 or 64 of them up at once) plus its raw low byte; a weight
// whose high byte is not in the table is coded 0 and its exact value is written over the decoded group from the
// panel's exception list (sorted by k) before the group's FMAs.
//
// Layout: the panels of skinny_linear ([N/16][K][16]), each panel in groups of 4 inputs k (64 weights, 96 bytes):
// 32 bytes of indices (the weight at position q < 32 in the low nibble of byte q, q >= 32 in the high nibble of
// byte q - 32) then 64 low bytes, position q = 16 (c / 4) + 8 (v / 2) + 2 (c % 4) + v % 2 for output column c and
// input k = 4g + v. That order is what one byte unpack (low, high) per 128-bit lane gives back as bfloat16 words,
// and a word is widened in place (even words: a 16-bit shift; odd words: the low half masked off): input v lands in
// one register, column c at float c (AVX-512: one register of 16; AVX2: positions 0-31 hold columns 0-7, 32-63
// columns 8-15). Three shuffles a group (vpshufb, two unpacks); the plain bfloat16 panels take three per 16 weights.
// K is padded to groups of 4 with weights the kernel never multiplies.
//
// Numerics: every output is gemv.cpp's chain (FMAs over k in order, restarted every 1024 inputs, block sums added
// in order), over the same widened values, so the result is bit for bit skinny_linear's over the bfloat16 panels,
// for any number of rows (batch invariant).

#include "kernels.h"
#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kGroupBytes = 96;  // 4 inputs x 16 columns: 32 bytes of indices, 64 low bytes
constexpr int64_t kBlock = 1024;     // gemv.cpp's chain length
// bytes ahead of the group read now (16 groups) asked for: the LM head alone at one row, 3.22 -> 2.83 ms
// (13.2 -> 15.1 GB/s; the plain bf16 panels 14.4) on the 2-core Xeon (benchmarks/lm_head_kernels.py)
constexpr int64_t kPrefetch = 1536;

// codes [P, G, 96], tables [P, 16] high bytes, exc_off [P + 1] (panel p's exceptions are [exc_off[p],
// exc_off[p + 1])), exc_pos [E] (k * 16 + c, ascending within a panel), exc_val [E] (the exact weights), K, G
using Coded = lmserve::CodedHalf;
static_assert(kPanel == lmserve::kPanelWidth && kGroupBytes == lmserve::kCodedGroupBytes);

// byte position in a group of the weight at input k = 4g + v, column c (the layout above; the kernel's unpack order)
inline int64_t position(int64_t v, int64_t c) { return 16 * (c >> 2) + 8 * (v >> 1) + 2 * (c & 3) + (v & 1); }

// weight (k = 4g + v, column c) of one group, widened (the scalar decode: fallback build and reference of the order)
inline float coded_weight(const uint8_t* blk, const uint8_t* table, int64_t v, int64_t c) {
  const int64_t q = position(v, c);
  const int nib = q < 32 ? blk[q] & 15 : blk[q - 32] >> 4;
  const uint32_t bits = (uint32_t(table[nib]) << 24) | (uint32_t(blk[32 + q]) << 16);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// first exception of panel p at input k0 or later
inline int64_t first_exception(const Coded& w, int64_t p, int64_t k0) {
  const int32_t* b = w.exc_pos + w.exc_off[p];
  const int32_t* e = w.exc_pos + w.exc_off[p + 1];
  return std::lower_bound(b, e, int32_t(k0 * kPanel)) - w.exc_pos;
}

// write panel exceptions that fall in group g over its decoded weights buf[4][16]; e advances past them
inline void patch(const Coded& w, int64_t& e, int64_t e1, int64_t g, float* buf) {
  for (; e < e1 && w.exc_pos[e] < (4 * g + 4) * kPanel; ++e) buf[w.exc_pos[e] - 4 * g * kPanel] = w.exc_val[e];
}

#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVX512BW__)
struct Isa {  // one register holds a panel row's 16 columns
  static constexpr int H = 1, kRows = 4;
  using V = __m512;
  using T = __m512i;
  static T table(const uint8_t* t) { return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t))); }
  static V zero() { return _mm512_setzero_ps(); }
  static V bcast(const float* x) { return _mm512_set1_ps(*x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, const V (&v)[H]) { _mm512_storeu_ps(p, v[0]); }
  static void load(const float* p, V (&v)[H]) { v[0] = _mm512_loadu_ps(p); }
  static void decode(const uint8_t* blk, T tab, V (&f)[4][H]) {
    // the 32 index bytes in both halves; the upper half's words shifted by 4: its high nibbles
    const __m512i nb = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    const __m512i idx = _mm512_and_si512(_mm512_mask_srli_epi16(nb, 0xFFFF0000u, nb, 4), _mm512_set1_epi8(0x0f));
    const __m512i hi = _mm512_shuffle_epi8(tab, idx);
    const __m512i lo = _mm512_loadu_si512(blk + 32);
    const __m512i w0 = _mm512_unpacklo_epi8(lo, hi), w1 = _mm512_unpackhi_epi8(lo, hi), m = _mm512_set1_epi32(-65536);
    f[0][0] = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16));  // even words: bf16 -> float32 is a 16-bit shift
    f[1][0] = _mm512_castsi512_ps(_mm512_and_si512(w0, m));    // odd words are already in place
    f[2][0] = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16));
    f[3][0] = _mm512_castsi512_ps(_mm512_and_si512(w1, m));
  }
};
#else
struct Isa {  // two registers: columns 0-7 and 8-15
  static constexpr int H = 2, kRows = 2;  // 2 rows: 4 chains + 8 weight registers of AVX2's 16
  using V = __m256;
  using T = __m256i;
  static T table(const uint8_t* t) { return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t))); }
  static V zero() { return _mm256_setzero_ps(); }
  static V bcast(const float* x) { return _mm256_broadcast_ss(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, const V (&v)[H]) { _mm256_storeu_ps(p, v[0]); _mm256_storeu_ps(p + 8, v[1]); }
  static void load(const float* p, V (&v)[H]) { v[0] = _mm256_loadu_ps(p); v[1] = _mm256_loadu_ps(p + 8); }
  static void decode(const uint8_t* blk, T tab, V (&f)[4][H]) {
    const __m256i nb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
    const __m256i m = _mm256_set1_epi8(0x0f), m16 = _mm256_set1_epi32(-65536);
    const __m256i idx[2] = {_mm256_and_si256(nb, m), _mm256_and_si256(_mm256_srli_epi16(nb, 4), m)};
    for (int h = 0; h < 2; ++h) {  // positions [32h, 32h + 32): columns [8h, 8h + 8)
      const __m256i hi = _mm256_shuffle_epi8(tab, idx[h]);
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 32 * h));
      const __m256i w0 = _mm256_unpacklo_epi8(lo, hi), w1 = _mm256_unpackhi_epi8(lo, hi);
      f[0][h] = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
      f[1][h] = _mm256_castsi256_ps(_mm256_and_si256(w0, m16));
      f[2][h] = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
      f[3][h] = _mm256_castsi256_ps(_mm256_and_si256(w1, m16));
    }
  }
};
#endif

// NP panels from p on, rows [0, MR) of x (ldx apart), inputs [k0, k1): acc[i][r] = each column's chain
template <int NP, int MR>
inline void chain(const Coded& w, int64_t p, const float* x, int64_t ldx, int64_t k0, int64_t k1,
                  Isa::V (&acc)[NP][MR][Isa::H]) {
  Isa::T tab[NP];
  int64_t e[NP], e1[NP];
  _Pragma("GCC unroll 2") for (int i = 0; i < NP; ++i) {
    tab[i] = Isa::table(w.tables + (p + i) * kPanel);
    e[i] = first_exception(w, p + i, k0);
    e1[i] = w.exc_off[p + i + 1];
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < Isa::H; ++h) acc[i][r][h] = Isa::zero();
  }
  for (int64_t g = k0 / 4; 4 * g < k1; ++g) {
    const int64_t nk = std::min<int64_t>(4, k1 - 4 * g);
    Isa::V f[NP][4][Isa::H];
    _Pragma("GCC unroll 2") for (int i = 0; i < NP; ++i) {
      const uint8_t* blk = w.codes + ((p + i) * w.G + g) * kGroupBytes;
      _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch + 64), _MM_HINT_T0);
      Isa::decode(blk, tab[i], f[i]);
      if (e[i] < e1[i] && w.exc_pos[e[i]] < (4 * g + 4) * kPanel) {  // rare: ~1 weight in 10^4
        alignas(64) float buf[4 * kPanel];
        for (int v = 0; v < 4; ++v) Isa::store(buf + v * kPanel, f[i][v]);
        patch(w, e[i], e1[i], g, buf);
        for (int v = 0; v < 4; ++v) Isa::load(buf + v * kPanel, f[i][v]);
      }
    }
    const float* xg = x + 4 * g;
    if (nk == 4) {
      _Pragma("GCC unroll 4") for (int v = 0; v < 4; ++v)
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; ++r) {
          const Isa::V a = Isa::bcast(xg + r * ldx + v);
          _Pragma("GCC unroll 2") for (int i = 0; i < NP; ++i)
            for (int h = 0; h < Isa::H; ++h) acc[i][r][h] = Isa::fma(a, f[i][v][h], acc[i][r][h]);
        }
    } else {
      for (int v = 0; v < nk; ++v)
        for (int r = 0; r < MR; ++r) {
          const Isa::V a = Isa::bcast(xg + r * ldx + v);
          for (int i = 0; i < NP; ++i)
            for (int h = 0; h < Isa::H; ++h) acc[i][r][h] = Isa::fma(a, f[i][v][h], acc[i][r][h]);
        }
    }
  }
}

// panels [p, p + NP) times rows [0, MR) of x [.., K] into y (ldy apart)
template <int NP, int MR>
void panels(const Coded& w, int64_t p, const float* x, float* y, int64_t ldy) {
  for (int64_t k0 = 0; k0 < w.K; k0 += kBlock) {
    Isa::V acc[NP][MR][Isa::H];
    chain<NP, MR>(w, p, x, w.K, k0, std::min(w.K, k0 + kBlock), acc);
    alignas(64) float out[kPanel];
    for (int i = 0; i < NP; ++i)
      for (int r = 0; r < MR; ++r) {
        Isa::store(out, acc[i][r]);
        float* yy = y + r * ldy + (p + i) * kPanel;
        for (int64_t c = 0; c < kPanel; ++c) yy[c] = k0 == 0 ? out[c] : yy[c] + out[c];
      }
  }
}

void one_panel(const Coded& w, int64_t p, const float* x, int64_t M, float* y, int64_t ldy) {
  for (int64_t m = 0; m < M; m += Isa::kRows) {
    const float* xm = x + m * w.K;
    float* ym = y + m * ldy;
    switch (std::min<int64_t>(Isa::kRows, M - m)) {
#if defined(__AVX512BW__)
      case 4: panels<1, 4>(w, p, xm, ym, ldy); break;
      case 3: panels<1, 3>(w, p, xm, ym, ldy); break;
#endif
      case 2: panels<1, 2>(w, p, xm, ym, ldy); break;
      default: panels<1, 1>(w, p, xm, ym, ldy); break;
    }
  }
}

void coded_panels(const Coded& w, const float* x, int64_t M, int64_t P, float* y) {
  lmserve::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    int64_t p = begin;
    for (; M == 1 && p + 1 < end; p += 2) panels<2, 1>(w, p, x, y, P * kPanel);  // two chains in flight
    for (; p < end; ++p) one_panel(w, p, x, M, y, P * kPanel);
  });
}
#else
// The scalar build: each panel decoded whole (exceptions written in), then gemv.cpp's scalar chains over it.
void coded_panels(const Coded& w, const float* x, int64_t M, int64_t P, float* y) {
  lmserve::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> dense(w.G * 4 * kPanel);  // [G * 4][16]
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t g = 0; g < w.G; ++g) {
        const uint8_t* blk = w.codes + (p * w.G + g) * kGroupBytes;
        for (int64_t v = 0; v < 4; ++v)
          for (int64_t c = 0; c < kPanel; ++c)
            dense[(4 * g + v) * kPanel + c] = coded_weight(blk, w.tables + p * kPanel, v, c);
      }
      for (int64_t e = w.exc_off[p]; e < w.exc_off[p + 1]; ++e) dense[w.exc_pos[e]] = w.exc_val[e];
      for (int64_t m = 0; m < M; ++m)
        for (int64_t c = 0; c < kPanel; ++c) {
          float* out = y + m * P * kPanel + p * kPanel + c;
          for (int64_t k0 = 0; k0 < w.K; k0 += kBlock) {
            float a = 0.f;
            for (int64_t k = k0; k < std::min(w.K, k0 + kBlock); ++k) a = std::fma(x[m * w.K + k], dense[k * kPanel + c], a);
            *out = k0 == 0 ? a : *out + a;
          }
        }
    }
  });
}
#endif

}  // namespace

void lmserve::coded_half_matmul(const CodedHalf& w, const float* x, int64_t M, int64_t P, float* y) {
  coded_panels(w, x, M, P, y);
}

// Rows `ids` of the coded matrix widened to float32 [T, K]: the tied token table's look-ups (one decode step looks one
// row up; the tensor ops of half_linear.coded_rows, its reference, take ~0.5 ms for that).
void lmserve::coded_half_gather(const CodedHalf& w, const int64_t* id, int64_t T, float* o) {
  const int64_t K = w.K, G = w.G;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t p = id[t] / kPanel, c = id[t] % kPanel;
    float* row = o + t * K;
    for (int64_t k = 0; k < K; ++k)
      row[k] = coded_weight(w.codes + (p * G + k / 4) * kGroupBytes, w.tables + p * kPanel, k % 4, c);
    for (int64_t e = w.exc_off[p]; e < w.exc_off[p + 1]; ++e)
      if (w.exc_pos[e] % kPanel == c) row[w.exc_pos[e] / kPanel] = w.exc_val[e];
  }
}

// The coding itself (half_linear.code_panels; code_panels_reference is the same in tensor ops, ~1.5 s for SmolLM2's
// 49152 x 576 head on 2 cores: ~12 passes over 28M weights widened to int32, against one pass here). Per panel: the
// high bytes counted, the 16 commonest kept (more weights first, then the smaller byte: the reference's order, so
// both give the same bytes), every weight coded in place, the ones outside the table listed as exceptions (their
// slot: index 0 and low byte 0, as the kernel expects). The caller zeroes the codes.
void lmserve::code_half(const uint16_t* src, int64_t P, int64_t K, uint8_t* out, uint8_t* table,
                        std::vector<std::vector<int32_t>>& pos, std::vector<std::vector<float>>& val) {
  const int64_t G = (K + 3) / 4;
  pos.assign(P, {});
  val.assign(P, {});
  lmserve::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint16_t* w = src + p * K * kPanel;
      int64_t count[256] = {0};
      for (int64_t i = 0; i < K * kPanel; ++i) ++count[w[i] >> 8];
      int order[256];
      for (int i = 0; i < 256; ++i) order[i] = i;
      std::partial_sort(order, order + kPanel, order + 256,
                        [&](int a, int b) { return count[a] != count[b] ? count[a] > count[b] : a < b; });
      int8_t lut[256];
      std::memset(lut, -1, sizeof lut);
      for (int j = 0; j < kPanel; ++j) {
        lut[order[j]] = static_cast<int8_t>(j);
        table[p * kPanel + j] = static_cast<uint8_t>(order[j]);
      }
      uint8_t* panel = out + p * G * kGroupBytes;
      for (int64_t k = 0; k < K; ++k) {
        uint8_t* blk = panel + (k / 4) * kGroupBytes;
        const int64_t v = k % 4;
        for (int64_t c = 0; c < kPanel; ++c) {
          const uint16_t word = w[k * kPanel + c];
          int idx = lut[word >> 8];
          uint8_t low = static_cast<uint8_t>(word & 0xFF);
          if (idx < 0) {  // outside the table: coded 0, kept exactly in the panel's list (ascending k * 16 + c)
            uint32_t bits = static_cast<uint32_t>(word) << 16;
            float f;
            std::memcpy(&f, &bits, sizeof f);
            pos[p].push_back(static_cast<int32_t>(k * kPanel + c));
            val[p].push_back(f);
            idx = 0;
            low = 0;
          }
          const int64_t q = position(v, c);
          blk[q % 32] |= static_cast<uint8_t>(q < 32 ? idx : idx << 4);
          blk[32 + q] = low;
        }
      }
    }
  });
}
