// Decode attention over the paged KV cache, reading K/V where they lie (CPU, float32).
//
// Why: PyTorch has no paged attention on CPU, so the portable path gathers every sequence's blocks into
// a padded copy and runs SDPA on it; at batch 64 x 256 keys that costs 3.5 ms per layer, 30% of an
// offline decode step. This loop reads each key and value row once, straight from its block, and is
// 3-5x faster (measured in tests/test_native_attention.py's benchmark notes and benchmarks/). Each
// (sequence, kv head) is computed alone in a fixed order, so results do not depend on the batch.
//
// q [B, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] int64;
// context_lens [B] int64 (>= 1). Query head h uses kv head h / (H / Hkv), as HF's repeat_kv does.

#include "ops.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int kMaxGroup = 16;  // query heads per kv head handled in registers-sized scratch

template <int D>
void decode_attention(const float* q, const float* k_cache, const float* v_cache, const int64_t* block_tables,
                      const int64_t* context_lens, const int64_t* table_rows, float* out, int64_t B, int64_t H,
                      int64_t block_size, int64_t Hkv, int64_t max_blocks, float scale) {
  const int64_t G = H / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, kv_head = item % Hkv, L = context_lens[b];
      const int64_t* table = block_tables + (table_rows ? table_rows[b] : b) * max_blocks;
      const float* q_rows = q + (b * H + kv_head * G) * D;
      scores.resize(G * L);
      // scores[g, t] = q_g . k_t * scale
      for (int64_t t = 0; t < L; ++t) {
        const float* __restrict__ k = k_cache + ((table[t / block_size] * block_size + t % block_size) * Hkv + kv_head) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* __restrict__ qg = q_rows + g * D;
          float acc = 0.f;
          for (int d = 0; d < D; ++d) acc += qg[d] * k[d];
          scores[g * L + t] = acc * scale;
        }
      }
      // softmax over t, per query head
      for (int64_t g = 0; g < G; ++g) {
        float* __restrict__ s = scores.data() + g * L;
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
      // out[g] = sum_t p[g, t] * v_t
      float acc[kMaxGroup][D];
      for (int64_t g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
      for (int64_t t = 0; t < L; ++t) {
        const float* __restrict__ v = v_cache + ((table[t / block_size] * block_size + t % block_size) * Hkv + kv_head) * D;
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

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     c10::optional<torch::Tensor> table_rows) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kFloat &&
              v_cache.scalar_type() == torch::kFloat, "float32 CPU tensors only");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong);
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes());
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the cache must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0 && H / Hkv <= kMaxGroup, "unsupported head layout");
  TORCH_CHECK(context_lens.size(0) == B);
  const int64_t* rows = nullptr;  // row b reads block_tables[table_rows[b]] (prefill tokens share their request's)
  if (table_rows.has_value()) {
    TORCH_CHECK(table_rows->scalar_type() == torch::kLong && table_rows->is_contiguous() && table_rows->size(0) == B,
                "table_rows: [B] int64");
    rows = table_rows->data_ptr<int64_t>();
  } else {
    TORCH_CHECK(block_tables.size(0) == B);
  }
  auto out = torch::empty_like(q);
  const auto args = std::make_tuple(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                                    block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                                    out.data_ptr<float>());
  const float s = static_cast<float>(scale);
  const int64_t mb = block_tables.size(1);
  if (D == 64) {
    decode_attention<64>(std::get<0>(args), std::get<1>(args), std::get<2>(args), std::get<3>(args),
                         std::get<4>(args), rows, std::get<5>(args), B, H, block_size, Hkv, mb, s);
  } else if (D == 128) {
    decode_attention<128>(std::get<0>(args), std::get<1>(args), std::get<2>(args), std::get<3>(args),
                          std::get<4>(args), rows, std::get<5>(args), B, H, block_size, Hkv, mb, s);
  } else {
    TORCH_CHECK(false, "head_dim 64 or 128 only");
  }
  return out;
}
