// The packed GGUF matmul alone, M = 1 and M = 16, in CPU time: compiled straight from the kernel sources (they do
// not include torch's headers), so a change to quant_gemm.cpp is measured at one level in ~20 s instead of a
// ~3-minute extension build. The outputs' hash is printed: two builds of the same kernel must print the same one.
//
//   g++ -O3 -fopenmp -ffast-math -fno-finite-math-only -march=x86-64-v3 -std=c++17 \
//       -Isrc/lmserve/layers/kernels/csrc benchmarks/quant_gemm_cpu.cpp src/lmserve/layers/kernels/csrc/quant_gemm.cpp -o /tmp/qg
//   /tmp/qg KIND N K REPS      # e.g. /tmp/qg 0 1536 576 50 (Q4_1's U4), /tmp/qg 2 8192 576 10 (Q8_0's S8)
//
// (the flags are layers/kernels/native.py's CFLAGS; -march picks the level: x86-64-v2, x86-64-v3, or x86-64-v4 -mavx512vnni)
#include "kernels.h"
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <vector>
int lmserve::torch_threads() { return 1; }  // one thread: the kernel pool runs on the caller
static double cpu_ms() { timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec * 1e3 + t.tv_nsec / 1e6; }
int main(int argc, char** argv) {
  int kind = atoi(argv[1]); int64_t N = atoll(argv[2]), K = atoll(argv[3]); int reps = atoi(argv[4]);
  const int64_t G = N / 16, nb = K / 32;
  std::mt19937 rng(1);
  std::vector<uint8_t> codes(G * nb * lmserve::quant_packed_code_bytes(kind));
  for (auto& c : codes) c = rng();
  const int64_t sb = lmserve::quant_packed_scale_blocks(kind, K);
  std::vector<float> sc(G * sb * 16), mn(G * sb * 16);
  for (auto& s : sc) s = (rng() % 1000) / 1e5f;
  for (auto& s : mn) s = (rng() % 1000) / 1e5f - 0.005f;
  double best[17] = {};
  uint64_t check = 0;
  for (int M : {1, 16}) {
    std::vector<float> x(M * K), y(M * N);
    for (auto& v : x) v = (rng() % 2001) / 1000.f - 1.f;
    const int64_t stride = K + 8 * nb;
    std::vector<int8_t> xq(M * stride);
    lmserve::quantize_rows(x.data(), M, K, xq.data());
    double b = 1e9;
    for (int r = 0; r < 7; ++r) {
      double t0 = cpu_ms();
      for (int i = 0; i < reps; ++i)
        lmserve::quant_packed_matmul(kind, codes.data(), sc.data(), kind == 2 || kind == 3 ? nullptr : mn.data(), nullptr,
                                     xq.data(), stride, M, K, G, y.data());
      b = std::min(b, (cpu_ms() - t0) / reps);
    }
    best[M] = b;
    for (float v : y) { uint32_t u; memcpy(&u, &v, 4); check = check * 1000003 + u; }
  }
  printf("kind %d %ldx%ld: M=1 %.1f us, M=16 %.1f us, ratio %.2f, GMAC/s at 16: %.1f  check %016lx\n", kind, N, K,
         best[1] * 1e3, best[16] * 1e3, best[16] / best[1], 16.0 * N * K / (best[16] * 1e6), check);
}
