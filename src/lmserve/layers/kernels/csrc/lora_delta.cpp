// LoRA deltas in float32 with a fixed summation order (lora_delta.h): the module path (lora/layers.py) and the
// native decode stack (decode_stack.h) both add a row's delta through this one kernel, so the two agree bit for bit.
//
// Why not BLAS: its summation order follows the call's shape (rows per adapter, the step's widest rank), so a row's
// delta changed in the last bits with the rows beside it, and a GGUF base's int8 activations can turn that into a
// different continuation. Here a row's shrink (x . A row) runs 16 fixed lanes then one fixed fold, and its expand
// adds rank by rank in order: the result depends on the row and its adapter only. The rank is small (8-64), so the
// work is ~2 * rank * (in + out) multiply-adds a row and projection, a few percent of the base matmul's.
#include "lora_delta.h"
#include "thread_pool.h"

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;

// x . a over `in` floats: lane l sums elements l, l + 16, ... in order; the lanes then fold pairwise.
inline float dot_fixed(const float* x, const float* a, int64_t in) {
  float acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= in; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += x[j + l] * a[j + l];
  for (int64_t l = 0; j + l < in; ++l) acc[l] += x[j + l] * a[j + l];
  for (int64_t w = kLanes / 2; w >= 1; w /= 2)
    for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

}  // namespace

namespace lmserve {

void lora_delta_rows(const float* x, int64_t x_stride, float* y, int64_t y_stride, const int64_t* slots, int64_t T,
                     const float* a, int64_t max_rank, int64_t n, int64_t in, const float* const* b,
                     const int64_t* out_sizes, int64_t rank) {
  // the adapter rows, grouped by slot (rows sharing an adapter read its A and B while they are in cache)
  std::vector<int64_t> rows;
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0) rows.push_back(t);
  if (rows.empty()) return;
  std::stable_sort(rows.begin(), rows.end(), [&](int64_t p, int64_t q) { return slots[p] < slots[q]; });
  rank = std::min(rank, max_rank);
  int64_t total = 0, widest = 0;
  for (int64_t i = 0; i < n; ++i) total += out_sizes[i], widest = std::max(widest, out_sizes[i]);
  // a row's work in multiply-adds: rows run in parallel, each on one thread from start to end
  const int64_t work = rank * (n * in + total);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(work, 1));
  parallel_for(0, static_cast<int64_t>(rows.size()), grain, [&](int64_t begin, int64_t end) {
    std::vector<float> h(rank * n), d(widest);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = rows[r], s = slots[t];
      const float* xt = x + t * x_stride;
      const float* as = a + s * max_rank * n * in;  // [max_rank, n, in]: the first `rank` ranks are contiguous
      for (int64_t kn = 0; kn < rank * n; ++kn) h[kn] = dot_fixed(xt, as + kn * in, in);
      float* yt = y + t * y_stride;
      for (int64_t i = 0, off = 0; i < n; off += out_sizes[i], ++i) {
        const int64_t out = out_sizes[i];
        const float* bs = b[i] + s * max_rank * out;  // [max_rank, out_i]
        std::fill(d.begin(), d.begin() + out, 0.0f);
        for (int64_t k = 0; k < rank; ++k) {
          const float hk = h[k * n + i];
          const float* bk = bs + k * out;
          for (int64_t o = 0; o < out; ++o) d[o] += hk * bk[o];
        }
        for (int64_t o = 0; o < out; ++o) yt[off + o] += d[o];
      }
    }
  });
}

}  // namespace lmserve
