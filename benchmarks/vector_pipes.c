// How many of each 256-bit instruction the narrow builds' int8 kernels use (x86-64-v3: quant_gemm.cpp's parts_rows)
// this core issues per cycle, alone and paired with maddubs: which ones share maddubs's pipes. Why: the x86-64-v3
// 16-row decode step is ~76% int8 products, and their floor is set by these rates (docs/performance.md, "Per
// instruction-set level"); rerun it on each CPU family before tuning those kernels there.
//
//   gcc -O2 benchmarks/vector_pipes.c -o /tmp/vector_pipes && /tmp/vector_pipes
//
// The clock is measured first (a chain of dependent adds, one a cycle; a core that folds immediate adds at rename
// would read fast, so check it against the CPU's rated clock); each test then runs 8 independent instructions
// (4 + 4 for a pair) per loop iteration. vfmadd231ps also reads its destination: 8 chains of 4-cycle latency, so
// its row reads at most 2 a cycle whatever the pipes. x86-64 with AVX2 and FMA only.
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static const long kIters = 100000000;

#define OPS8(a, b)                                                                                                  \
  a " %%ymm8, %%ymm9, %%ymm0\n" b " %%ymm8, %%ymm9, %%ymm1\n" a " %%ymm8, %%ymm9, %%ymm2\n" b " %%ymm8, %%ymm9, %%ymm3\n" \
  a " %%ymm8, %%ymm9, %%ymm4\n" b " %%ymm8, %%ymm9, %%ymm5\n" a " %%ymm8, %%ymm9, %%ymm6\n" b " %%ymm8, %%ymm9, %%ymm7\n"

#define RATE(label, a, b)                                                                                 \
  do {                                                                                                    \
    const double t0 = now();                                                                              \
    __asm__ volatile("mov %0, %%rcx\n1:\n" OPS8(a, b) "dec %%rcx\njnz 1b\n"                               \
                     :                                                                                    \
                     : "r"(kIters)                                                                        \
                     : "rcx", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "cc");      \
    printf("| %s | %.2f |\n", label, 8.0 * kIters / ((now() - t0) * ghz * 1e9));                          \
  } while (0)

int main(void) {
  double t0 = now();
  long x = 0;
  const long n = 1000000000;
  __asm__ volatile("1: add $1, %0\nadd $1, %0\nadd $1, %0\nadd $1, %0\ncmp %1, %0\njb 1b" : "+r"(x) : "r"(n) : "cc");
  const double ghz = n / (now() - t0) / 1e9;
  printf("clock: %.2f GHz (a chain of dependent adds)\n\n| 256-bit instructions | per cycle |\n|---|---|\n", ghz);
  RATE("vpmaddubsw", "vpmaddubsw", "vpmaddubsw");
  RATE("vpmaddwd", "vpmaddwd", "vpmaddwd");
  RATE("vpsignb", "vpsignb", "vpsignb");
  RATE("vpaddw", "vpaddw", "vpaddw");
  RATE("vpand", "vpand", "vpand");
  RATE("vfmadd231ps", "vfmadd231ps", "vfmadd231ps");
  RATE("vpmaddubsw + vpmaddwd", "vpmaddubsw", "vpmaddwd");
  RATE("vpmaddubsw + vpsignb", "vpmaddubsw", "vpsignb");
  RATE("vpmaddubsw + vpaddw", "vpmaddubsw", "vpaddw");
  RATE("vpmaddubsw + vpand", "vpmaddubsw", "vpand");
  RATE("vpmaddubsw + vpxor", "vpmaddubsw", "vpxor");
  RATE("vpmaddubsw + vpsubb", "vpmaddubsw", "vpsubb");
  RATE("vpmaddubsw + vfmadd231ps", "vpmaddubsw", "vfmadd231ps");
  RATE("vpmaddubsw + vmulps", "vpmaddubsw", "vmulps");
  return 0;
}
