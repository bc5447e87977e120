// LoRA deltas in float32 with a fixed summation order (lora_delta.h): the module path (lora/layers.py) and the
// native decode stack (decode_stack.h) both add a row's delta through this one kernel, so the two agree bit for bit.
//
// Why not BLAS: its summation order follows the call's shape (rows per adapter, the step's widest rank), so a row's
// delta changed in the last bits with the rows beside it, and a GGUF base's int8 activations can turn that into a
// different continuation. Here a row's shrink (x . A row) runs 16 fixed lanes then one fixed fold, and its expand
// adds rank by rank in order: the result depends on the row and its adapter only. The rank is small (8-64), so the
// work is ~2 * rank * (in + out) multiply-adds a row and projection, a few percent of the base matmul's.
//
// Speed: rows are grouped by slot and run in tiles of up to 4 rows of one adapter, so each load of A or B feeds
// every row of the tile (a decode step of 32 rows over 8 adapters reads each adapter's A and B once). Inside a tile
// the rows share loads only: each row keeps its own accumulators and the same chain of operations as alone, which
// is why no fast-math (GCC could then reassociate a 1-row tile's sums differently from a 4-row tile's) and explicit
// FMA where the level has it. (One [32 x 576] -> 3072 gate_up projection, 8 rank-16 adapters, 1 thread, Zen 3:
// 0.49 ms a row at a time with fast-math's own vectorisation, see benchmarks/results/lora_zen3.md for the tiles.)
//
// Slot weights: float32, or float16 / bfloat16 widened to float32 exactly as they are loaded (the sums stay float32,
// in the same order). Why 16 bits: a decode step of 32 rows over 8 rank-16 adapters reads every adapter's A and B
// once, ~149 MiB in float32 for the embedded model, more than its Q4_1 weights; that read, not the multiply-adds, was
// most of the adapters' cost (30 distinct layers' slots 10.8-12.7 ms a step against 3.5-4.7 ms in cache, Zen 4).
#include "lora_delta.h"
#include "thread_pool.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#if defined(__SSE3__)
#include <immintrin.h>
#endif

#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")

namespace {

// 16 floats, lane l of a chunk always element l: one zmm on AVX-512, two ymm on x86-64-v3, four xmm on v2 (spelled
// out: GCC lowers a vector type wider than the level's registers through memory, and the kernel ran 10x slower).
// Every lane runs the same chain of operations at every level's width, so the width changes speed, not bits.
#if defined(__AVX512F__)
struct v16 {
  __m512 v;
};
inline v16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store16(float* p, v16 a) { _mm512_storeu_ps(p, a.v); }
inline v16 splat16(float f) { return {_mm512_set1_ps(f)}; }
inline v16 add16(v16 a, v16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline v16 fma16(v16 a, v16 b, v16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // c + a * b, one rounding
// 16 slot weights as float32 (exact): float16 through F16C, bfloat16 as float32's top 16 bits
inline v16 wload16(const float* p) { return load16(p); }
inline v16 wload16(const c10::Half* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline v16 wload16(const c10::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
#else
#if defined(__AVX__)
typedef float v8 __attribute__((vector_size(32), aligned(4)));
inline v8 load8(const float* p) { return *reinterpret_cast<const v8*>(p); }
inline void store8(float* p, v8 v) { *reinterpret_cast<v8*>(p) = v; }
inline v8 splat8(float f) { return v8{f, f, f, f, f, f, f, f}; }  // not v8{} + f: 0 + f is an add without fast-math
#else
typedef float v4 __attribute__((vector_size(16), aligned(4)));
struct v8 {
  v4 lo, hi;
};
inline v8 operator+(v8 a, v8 b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline v8 operator*(v8 a, v8 b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline v8 load8(const float* p) { return {*reinterpret_cast<const v4*>(p), *reinterpret_cast<const v4*>(p + 4)}; }
inline void store8(float* p, v8 v) {
  *reinterpret_cast<v4*>(p) = v.lo;
  *reinterpret_cast<v4*>(p + 4) = v.hi;
}
inline v8 splat8(float f) { return {v4{f, f, f, f}, v4{f, f, f, f}}; }
#endif

// c + a * b, one rounding where the level has FMA (always the same instruction for a given build)
inline v8 fma8(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
  return reinterpret_cast<v8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                              reinterpret_cast<__m256>(c)));
#else
  return c + a * b;
#endif
}

// 8 slot weights as float32 (exact): F16C and AVX2 where the level has them (x86-64-v3), else one at a time
inline v8 wload8(const float* p) { return load8(p); }
template <typename W>
inline v8 wload8(const W* p) {
#if defined(__AVX2__) && defined(__F16C__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_same_v<W, c10::Half>) return reinterpret_cast<v8>(_mm256_cvtph_ps(h));
  else return reinterpret_cast<v8>(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
#else
  float f[8];
  for (int l = 0; l < 8; ++l) f[l] = static_cast<float>(p[l]);
  return load8(f);
#endif
}

struct v16 {
  v8 lo, hi;
};
inline v16 load16(const float* p) { return {load8(p), load8(p + 8)}; }
template <typename W>
inline v16 wload16(const W* p) { return {wload8(p), wload8(p + 8)}; }
inline void store16(float* p, v16 a) {
  store8(p, a.lo);
  store8(p + 8, a.hi);
}
inline v16 splat16(float f) { return {splat8(f), splat8(f)}; }
inline v16 add16(v16 a, v16 b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline v16 fma16(v16 a, v16 b, v16 c) { return {fma8(a.lo, b.lo, c.lo), fma8(a.hi, b.hi, c.hi)}; }
#endif

constexpr int64_t kLanes = 16;
constexpr int kTile = 4;  // rows of one adapter sharing each load of A and B
// B rows are read 16 columns at a time across all `rank` rows (rank streams at once, more than the hardware
// prefetcher follows): each is prefetched this many floats ahead (a few cache lines)
constexpr int64_t kAhead = 128;

// lanes (lane l summed elements l, l + 16, ... of the full chunks) plus the tail, folded pairwise: lane l + w added
// to lane l for w = 8, 4, 2, 1. The vector levels run that tree with register halves (the same adds, the same
// operands): the scalar tree stored and reloaded a lane per add, and a tile's folds (rank x slices x rows of them)
// took about as long as its shrink's multiply-adds for qkv (perf, Zen 4)
template <typename W>
inline float fold(float* acc, const float* x, const W* a, int64_t j, int64_t in) {
  for (int64_t l = 0; j + l < in; ++l) acc[l] += x[j + l] * static_cast<float>(a[j + l]);
#if defined(__AVX__)
  const __m256 s8 = _mm256_add_ps(_mm256_loadu_ps(acc), _mm256_loadu_ps(acc + 8));  // l + (l + 8)
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));  // + (l + 4)
#elif defined(__SSE3__)
  const __m128 s4 = _mm_add_ps(_mm_add_ps(_mm_loadu_ps(acc), _mm_loadu_ps(acc + 8)),
                               _mm_add_ps(_mm_loadu_ps(acc + 4), _mm_loadu_ps(acc + 12)));
#endif
#if defined(__AVX__) || defined(__SSE3__)
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));  // + (l + 2)
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));  // + (l + 1)
#else
  for (int64_t w = kLanes / 2; w >= 1; w /= 2)
    for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
#endif
}

// V's operations by overload: V is the level's 16-lane vector, or (below AVX-512) an 8-lane half of it
inline v16 vzero(v16) { return splat16(0.0f); }
inline v16 vload(v16, const float* p) { return load16(p); }
inline v16 vfma(v16 a, v16 b, v16 c) { return fma16(a, b, c); }
inline void vstore(float* p, v16 v) { store16(p, v); }
template <typename W>
inline v16 vwload(v16, const W* p) { return wload16(p); }
#if !defined(__AVX512F__)
inline v8 vzero(v8) { return splat8(0.0f); }
inline v8 vload(v8, const float* p) { return load8(p); }
inline v8 vfma(v8 a, v8 b, v8 c) { return fma8(a, b, c); }
inline void vstore(float* p, v8 v) { store8(p, v); }
template <typename W>
inline v8 vwload(v8, const W* p) { return wload8(p); }
#endif

// lanes[r][q][first + l] = lane l's chain of x_r . a_q over the chunks (lane l sums elements j + l, j = first,
// first + 16, ... < full), for the lanes one V holds
template <int R, int K, typename V, typename W>
inline void lane_chains(const float* const* xs, const W* const* ak, int64_t first, int64_t full,
                        float (*lanes)[K][kLanes]) {
  V acc[R][K];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < K; ++q) acc[r][q] = vzero(V{});
  for (int64_t j = first; j < full; j += kLanes) {
    V p[K];
    for (int q = 0; q < K; ++q) p[q] = vwload(V{}, ak[q] + j);
    for (int r = 0; r < R; ++r) {
      const V x = vload(V{}, xs[r] + j);
      for (int q = 0; q < K; ++q) acc[r][q] = vfma(x, p[q], acc[r][q]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < K; ++q) vstore(lanes[r][q] + first, acc[r][q]);
}

// h[r][kn..kn + K) = x_r . a[kn..kn + K) for R rows and K rows of A (R x K dots, 16 lanes each, sharing the loads)
template <int R, int K, typename W>
inline void dots(const float* const* xs, const W* a, int64_t kn, int64_t in, int64_t full, float* const* h) {
  const W* ak[K];
  for (int q = 0; q < K; ++q) ak[q] = a + (kn + q) * in;
  float lanes[R][K][kLanes];
#if defined(__AVX512F__)
  lane_chains<R, K, v16, W>(xs, ak, 0, full, lanes);
#else
  // Lanes 0-7 over the whole row, then lanes 8-15: each lane runs the same chain as in one 16-lane pass, with half
  // the accumulators live. On x86-64-v3, 4 x 2 sixteen-lane accumulators took all 16 ymm and were spilled to the
  // stack every chunk; half of them take 8. (x86-64-v2's 16 xmm still cannot hold all of a pass's 4 x 2 halves and
  // its loads, but spill half as much.) The second pass reads the rows again from L1 / L2. Same bits; speed with
  // splat8's plain broadcast: benchmarks/results/lora_delta_zen1.md.
  lane_chains<R, K, v8, W>(xs, ak, 0, full, lanes);
  lane_chains<R, K, v8, W>(xs, ak, 8, full, lanes);
#endif
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < K; ++q) h[r][kn + q] = fold(lanes[r][q], xs[r], ak[q], full, in);
}

// h[r][kn] = x_r . a[kn] for R rows and the m = rank * n rows of A, kA rows of A at a time (32 registers on AVX-512
// hold 4 x 4 accumulators; below it dots runs 4 x 2 in two passes of eight-lane halves)
template <int R, typename W>
void shrink(const float* const* xs, const W* a, int64_t m, int64_t in, float* const* h) {
  const int64_t full = in / kLanes * kLanes;
#if defined(__AVX512F__)
  constexpr int kA = 4;
#else
  constexpr int kA = 2;
#endif
  int64_t kn = 0;
  for (; kn + kA <= m; kn += kA) dots<R, kA, W>(xs, a, kn, in, full, h);
  for (; kn < m; ++kn) dots<R, 1, W>(xs, a, kn, in, full, h);
}

// y_r[o] += sum_k h_r[k * n + i] * b[k][o] (k in order from 0, then added to y) for R rows, 16 columns at a time
// (wider blocks, each visit to a row of B reading more lines, measured slower on Zen 5)
template <int R, typename W>
void expand(const float* const* hs, int64_t n, int64_t i, const W* b, int64_t rank, int64_t out,
            float* const* ys) {
  int64_t o = 0;
  for (; o + 16 <= out; o += 16) {
    for (int64_t k = 0; k < rank; ++k) __builtin_prefetch(b + k * out + o + kAhead * 4 / sizeof(W));
    v16 d[R];
    for (int r = 0; r < R; ++r) d[r] = splat16(0.0f);
    for (int64_t k = 0; k < rank; ++k) {
      const v16 bk = wload16(b + k * out + o);
      for (int r = 0; r < R; ++r) d[r] = fma16(splat16(hs[r][k * n + i]), bk, d[r]);
    }
    for (int r = 0; r < R; ++r) store16(ys[r] + o, add16(load16(ys[r] + o), d[r]));
  }
  for (; o < out; ++o)  // the last columns (widths not a multiple of 16), the same chain per column
    for (int r = 0; r < R; ++r) {
      float d = 0.0f;
      for (int64_t k = 0; k < rank; ++k) {
#if defined(__FMA__)
        d = __builtin_fmaf(hs[r][k * n + i], static_cast<float>(b[k * out + o]), d);
#else
        d += hs[r][k * n + i] * static_cast<float>(b[k * out + o]);
#endif
      }
      ys[r][o] += d;
    }
}

template <typename W>
struct Shapes {
  const float* x;
  int64_t x_stride;
  float* y;
  int64_t y_stride;
  const W* a;
  int64_t max_rank, n, in;
  const W* const* b;
  const int64_t* out_sizes;
  int64_t rank;
};

// one tile: R rows (token indices `rows`) of slot s
template <int R, typename W>
void tile(const Shapes<W>& p, const int64_t* rows, int64_t s, float* h_buf) {
  const float* xs[R];
  float* ys[R];
  float* hs[R];
  for (int r = 0; r < R; ++r) {
    xs[r] = p.x + rows[r] * p.x_stride;
    ys[r] = p.y + rows[r] * p.y_stride;
    hs[r] = h_buf + r * p.rank * p.n;
  }
  // [max_rank, n, in] per slot: the first `rank` ranks are contiguous, rank * n rows of A
  shrink<R, W>(xs, p.a + s * p.max_rank * p.n * p.in, p.rank * p.n, p.in, hs);
  float* yo[R];
  for (int64_t i = 0, off = 0; i < p.n; off += p.out_sizes[i], ++i) {
    for (int r = 0; r < R; ++r) yo[r] = ys[r] + off;
    expand<R, W>(hs, p.n, i, p.b[i] + s * p.max_rank * p.out_sizes[i], p.rank, p.out_sizes[i], yo);
  }
}

template <typename W>
void delta_rows(const float* x, int64_t x_stride, float* y, int64_t y_stride, const int64_t* slots, int64_t T,
                const W* a, int64_t max_rank, int64_t n, int64_t in, const W* const* b, const int64_t* out_sizes,
                int64_t rank) {
  // the adapter rows, grouped by slot, then cut into tiles of up to kTile rows of one slot
  std::vector<int64_t> rows;
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0) rows.push_back(t);
  if (rows.empty()) return;
  std::stable_sort(rows.begin(), rows.end(), [&](int64_t p, int64_t q) { return slots[p] < slots[q]; });
  std::vector<int64_t> starts;  // tile i: rows[starts[i], starts[i + 1])
  for (size_t r = 0; r < rows.size();) {
    size_t e = r + 1;
    while (e < rows.size() && e - r < kTile && slots[rows[e]] == slots[rows[r]]) ++e;
    starts.push_back(static_cast<int64_t>(r));
    r = e;
  }
  starts.push_back(static_cast<int64_t>(rows.size()));
  const int64_t tiles = static_cast<int64_t>(starts.size()) - 1;
  const Shapes<W> p{x, x_stride, y, y_stride, a, max_rank, n, in, b, out_sizes, std::min(rank, max_rank)};
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) total += out_sizes[i];
  // a tile's work in multiply-adds: tiles run in parallel, each on one thread from start to end
  const int64_t work = kTile * p.rank * (n * in + total);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(work, 1));
  lmserve::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> h(kTile * p.rank * n);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* tr = rows.data() + starts[i];
      const int64_t s = slots[tr[0]];
      switch (starts[i + 1] - starts[i]) {
        case 1: tile<1, W>(p, tr, s, h.data()); break;
        case 2: tile<2, W>(p, tr, s, h.data()); break;
        case 3: tile<3, W>(p, tr, s, h.data()); break;
        default: tile<4, W>(p, tr, s, h.data()); break;
      }
    }
  });
}

template <typename W>
void delta_rows_as(const float* x, int64_t x_stride, float* y, int64_t y_stride, const int64_t* slots, int64_t T,
                   const void* a, int64_t max_rank, int64_t n, int64_t in, const void* const* b,
                   const int64_t* out_sizes, int64_t rank) {
  std::vector<const W*> bw(n);
  for (int64_t i = 0; i < n; ++i) bw[i] = static_cast<const W*>(b[i]);
  delta_rows<W>(x, x_stride, y, y_stride, slots, T, static_cast<const W*>(a), max_rank, n, in, bw.data(), out_sizes,
                rank);
}

}  // namespace

namespace lmserve {

void lora_delta_rows(const float* x, int64_t x_stride, float* y, int64_t y_stride, const int64_t* slots, int64_t T,
                     const void* a, PanelType type, int64_t max_rank, int64_t n, int64_t in, const void* const* b,
                     const int64_t* out_sizes, int64_t rank) {
  if (type == PanelType::kHalf)
    delta_rows_as<c10::Half>(x, x_stride, y, y_stride, slots, T, a, max_rank, n, in, b, out_sizes, rank);
  else if (type == PanelType::kBFloat16)
    delta_rows_as<c10::BFloat16>(x, x_stride, y, y_stride, slots, T, a, max_rank, n, in, b, out_sizes, rank);
  else
    delta_rows_as<float>(x, x_stride, y, y_stride, slots, T, a, max_rank, n, in, b, out_sizes, rank);
}

}  // namespace lmserve

#pragma GCC pop_options
