// Torch's side of paged_decode_attention.cpp: paged decode attention and the K/V writer (included by ops.h).
#pragma once

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     c10::optional<torch::Tensor> table_rows, int64_t window, double softcap) {
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == torch::kFloat && v_cache.scalar_type() == kv_type,
              "CPU tensors only: float32 queries over a float32, float16, int8 or float8_e4m3fn cache");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong);
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes());
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the cache must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256 only");
  const lmserve::KvType type = lmserve::kv_type_of(kv_type);
  TORCH_CHECK(k_cache.size(3) == lmserve::kv_row_width(type, D) && H % Hkv == 0 && H / Hkv <= lmserve::kMaxGroupHeads,
              "unsupported head layout");
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
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: off)");
  lmserve::paged_attention(type, q.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(),
                           block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), rows,
                           out.data_ptr<float>(), B, H, D, block_size, Hkv, block_tables.size(1),
                           static_cast<float>(scale), window, static_cast<float>(softcap));
  return out;
}

// this step's K/V rows into their cache slots, in the cache's format (kv_cache.h: float32, float16, or quantized
// with a float16 scale per 32 values); k, v: T rows of Hkv * D floats, k_stride and v_stride apart (views into a
// qkv output, or normed K rows)
void write_kv_rows(const torch::Tensor& cache, const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                   const int64_t* slots, int64_t T, int64_t Hkv, int64_t D) {
  const lmserve::KvType type = lmserve::kv_type_of(cache.scalar_type());
  const int64_t W = lmserve::kv_row_width(type, D);
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 5 && cache.size(0) == 2 && cache.size(3) == Hkv &&
              cache.size(4) == W, "KV cache: contiguous [2, blocks, block_size, ", lmserve::num(Hkv), ", ",
              lmserve::num(W), "]");
  const int64_t num_slots = cache.size(1) * cache.size(2);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", lmserve::num(slots[t]), " outside the cache's ",
                lmserve::num(num_slots));
  lmserve::write_kv_slots(type, cache.data_ptr(), num_slots, k, k_stride, v, v_stride, slots, T, Hkv, D);
}

void write_kv(torch::Tensor cache, torch::Tensor k, torch::Tensor v, torch::Tensor slot_mapping) {
  TORCH_CHECK(k.device().is_cpu() && k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat &&
              k.dim() == 3 && v.sizes() == k.sizes(), "write_kv: float32 CPU k, v [T, kv_heads, head_dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.numel() == k.size(0),
              "write_kv: [T] int64 slots");
  k = k.contiguous();
  v = v.contiguous();
  slot_mapping = slot_mapping.contiguous();
  const int64_t T = k.size(0), Hkv = k.size(1), D = k.size(2);
  write_kv_rows(cache, k.data_ptr<float>(), Hkv * D, v.data_ptr<float>(), Hkv * D, slot_mapping.data_ptr<int64_t>(),
                T, Hkv, D);
}

// an encoder step's bidirectional attention (encoder_attention.cpp): qkv [T, 3, H, D] float32, starts [B + 1] int64
// (0, each sequence's end, ..., T) -> [T, H * D]
torch::Tensor encoder_attention(torch::Tensor qkv, torch::Tensor starts, double scale, int64_t window) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == torch::kFloat && qkv.dim() == 4 && qkv.size(1) == 3,
              "encoder_attention: float32 CPU qkv [T, 3, heads, head_dim]");
  TORCH_CHECK(starts.scalar_type() == torch::kLong && starts.dim() == 1 && starts.size(0) >= 2,
              "encoder_attention: starts [B + 1] int64");
  qkv = qkv.contiguous();
  starts = starts.contiguous();
  const int64_t T = qkv.size(0), H = qkv.size(2), D = qkv.size(3), B = starts.size(0) - 1;
  const int64_t* st = starts.data_ptr<int64_t>();
  TORCH_CHECK(st[0] == 0 && st[B] == T, "encoder_attention: starts must run from 0 to the ", lmserve::num(T), " tokens");
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(st[b + 1] > st[b], "encoder_attention: an empty sequence");
  auto out = torch::empty({T, H * D}, qkv.options());
  lmserve::encoder_attention(qkv.data_ptr<float>(), st, B, H, D, static_cast<float>(scale), window,
                             out.data_ptr<float>());
  return out;
}
