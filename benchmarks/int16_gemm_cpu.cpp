// Would int16 linears lift an encoder past float32's ceiling (issue 44's 2x sentence-transformers row)? The rate of
// an int16 x int16 -> int32 GEMM (vpmaddwd + vpaddd, AVX2 encodings) against a float32 FMA GEMM of the same tiling,
// on all-MiniLM-L6-v2's linear shapes, in one binary, so both see the same host minute. Not a kernel lmserve ships:
// the precision half of the question is benchmarks/encoder_int_linears.py, and the answer is in
// benchmarks/results/encoder_int16_zen4.md.
//
//   g++ -O3 -fopenmp -std=c++17 -march=x86-64-v4 benchmarks/int16_gemm_cpu.cpp -o /tmp/i16 && /tmp/i16
//   g++ -O3 -fopenmp -std=c++17 -march=x86-64-v3 -DROWS=4 -DVECS=2 benchmarks/int16_gemm_cpu.cpp -o /tmp/i16
//
// -march=x86-64-v4 lets the compiler keep the tile in AVX-512's 32 vector registers (still 256-bit instructions);
// x86-64-v3 has 16, hence its smaller tile. Threads: OMP_NUM_THREADS (default 2). -DBITS=b sets the codes' width
// (default 13). Each int32 sum is flushed to a float32 one every kFlush pairs, the most that cannot overflow:
// kFlush x 2 x (2^(b-1) - 1)^2 <= 2^31 - 1, so 64 pairs at 13 bits, 16 at 14, 4 at 15 and 1 at 16.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#ifndef ROWS
#define ROWS 4  // input rows a tile
#endif
#ifndef VECS
#define VECS 4  // 8-wide output vectors a tile
#endif
#ifndef BITS
#define BITS 13
#endif
constexpr int MR = ROWS, NV = VECS, NR = 8 * NV, kBits = BITS, kChunkTiles = 64;
constexpr int64_t kMaxCode = (int64_t{1} << (kBits - 1)) - 1;
constexpr int64_t kFlush = ((int64_t{1} << 31) - 1) / (2 * kMaxCode * kMaxCode);
static_assert(kBits >= 2 && kBits <= 16 && kFlush >= 1, "codes of 2 to 16 bits");

// out[MR, NR] for MR rows of x (codes in pairs, as int32) against one panel of w ([K/2][NR] pairs)
void tile_i16(const int32_t* x, int64_t ldx, const int32_t* w, int64_t Kp, float* out, int64_t ldo, const float* sx,
              const float* sw) {
  __m256 f[MR][NV];
  for (auto& r : f)
    for (auto& v : r) v = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < Kp; k0 += kFlush) {
    __m256i a[MR][NV];
    for (auto& r : a)
      for (auto& v : r) v = _mm256_setzero_si256();
    for (int64_t k = k0; k < std::min<int64_t>(Kp, k0 + kFlush); ++k) {
      __m256i wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * NR + 8 * v));
      for (int m = 0; m < MR; ++m) {
        const __m256i xv = _mm256_set1_epi32(x[m * ldx + k]);
        for (int v = 0; v < NV; ++v) a[m][v] = _mm256_add_epi32(a[m][v], _mm256_madd_epi16(xv, wv[v]));
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) f[m][v] = _mm256_add_ps(f[m][v], _mm256_cvtepi32_ps(a[m][v]));
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v)
      _mm256_storeu_ps(out + m * ldo + 8 * v,
                       _mm256_mul_ps(_mm256_mul_ps(f[m][v], _mm256_set1_ps(sx[m])), _mm256_loadu_ps(sw + 8 * v)));
}

// the float32 twin: the same tile and loop order, one FMA per 8 products
void tile_f32(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo) {
  __m256 f[MR][NV];
  for (auto& r : f)
    for (auto& v : r) v = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = _mm256_loadu_ps(w + k * NR + 8 * v);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_set1_ps(x[m * ldx + k]);
      for (int v = 0; v < NV; ++v) f[m][v] = _mm256_fmadd_ps(xv, wv[v], f[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + m * ldo + 8 * v, f[m][v]);
}

// symmetric per-row codes of kBits bits; returns the scale
float quantize(const float* r, int64_t n, int16_t* q) {
  float a = 0.f;
  for (int64_t i = 0; i < n; ++i) a = std::max(a, std::fabs(r[i]));
  const float s = a / static_cast<float>(kMaxCode);
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int16_t>(std::nearbyint(r[i] / s));
  return s;
}

template <typename F>
double best_seconds(int reps, F f) {
  double best = 1e9;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

void run(int64_t M, int64_t N, int64_t K, int reps) {
  M -= M % MR;
  if (N % NR != 0 || K % 2 != 0) {
    std::fprintf(stderr, "N must be a multiple of %d and K even\n", NR);
    std::exit(1);
  }
  const int64_t Kp = K / 2, panels = N / NR, tiles = M / MR, chunks = (tiles + kChunkTiles - 1) / kChunkTiles;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> xf(M * K), wf(N * K), sx(M), sw(N), out(M * N), ref(M * N);
  for (auto& v : xf) v = normal(rng);
  for (auto& v : wf) v = 0.05f * normal(rng);
  std::vector<int16_t> xq(M * K), wq(N * K);
  for (int64_t m = 0; m < M; ++m) sx[m] = quantize(&xf[m * K], K, &xq[m * K]);
  for (int64_t n = 0; n < N; ++n) sw[n] = quantize(&wf[n * K], K, &wq[n * K]);
  std::vector<int32_t> xp(M * Kp);  // each row's codes in pairs, as the int32 the tile broadcasts
  std::memcpy(xp.data(), xq.data(), xp.size() * sizeof(int32_t));
  std::vector<int32_t> wp(N * Kp);  // [panel][k pair][NR]: each output's two codes of a pair in one int32
  std::vector<float> wpf(N * K);    // [panel][k][NR]
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int j = 0; j < NR; ++j) {
        const int64_t n = p * NR + j;
        wpf[(p * K + k) * NR + j] = wf[n * K + k];
        if (k % 2 == 0) {
          const int16_t pair[2] = {wq[n * K + k], wq[n * K + k + 1]};
          std::memcpy(&wp[(p * Kp + k / 2) * NR + j], pair, 4);
        }
      }
  // rows in chunks of kChunkTiles tiles (their codes stay in L2 while every panel passes), chunk x panel in parallel;
  // the best of `reps` sweeps of tile(t, p) over every (row tile t, panel p)
  auto sweep = [&](auto tile) {
    return best_seconds(reps, [&] {
#pragma omp parallel for collapse(2) schedule(static)
      for (int64_t c = 0; c < chunks; ++c)
        for (int64_t p = 0; p < panels; ++p)
          for (int64_t t = c * kChunkTiles; t < std::min(tiles, (c + 1) * kChunkTiles); ++t) tile(t, p);
    });
  };
  const double ti = sweep([&](int64_t t, int64_t p) {
    tile_i16(&xp[t * MR * Kp], Kp, &wp[p * Kp * NR], Kp, &out[t * MR * N + p * NR], N, &sx[t * MR], &sw[p * NR]);
  });
  const double tf = sweep([&](int64_t t, int64_t p) {
    tile_f32(&xf[t * MR * K], K, &wpf[p * K * NR], K, &ref[t * MR * N + p * NR], N);
  });
  double err = 0, norm = 0;
  for (int64_t i = 0; i < M * N; ++i) err += (out[i] - ref[i]) * (out[i] - ref[i]), norm += ref[i] * ref[i];
  const double flop = 2.0 * M * N * K;
  std::printf("| %ld x %ld x %ld | %.1f | %.1f | %.2fx | %.1e |\n", static_cast<long>(M), static_cast<long>(N),
              static_cast<long>(K), flop / tf / 1e9, flop / ti / 1e9, tf / ti, std::sqrt(err / norm));
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  std::printf("tile %d rows x %d outputs, %d-bit codes, flush every %ld pairs\n\n", MR, NR, kBits,
              static_cast<long>(kFlush));
  std::printf("| M x N x K | float32 GFLOP/s | int16 GFLOP/s (equivalent) | int16 / float32 | relative error |\n");
  std::printf("|---|---|---|---|---|\n");
  // MiniLM: a 2,048-token step through q/k/v/o (384 x 384), the MLP's up (1,536 x 384) and down (384 x 1,536)
  run(2048, 384, 384, reps);
  run(2048, 1536, 384, reps);
  run(2048, 384, 1536, reps);
}
