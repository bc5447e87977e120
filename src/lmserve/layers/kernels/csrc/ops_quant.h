// Torch's side of quant_gemm.cpp: matmuls over a GGUF file's int codes (included by ops_matmul.h).
#pragma once

namespace lmserve {
// mins: U4 and U8 need them, kind 4 may have them (Q2_K), S8 and kind 3 have none; `shape` is the scales'
inline void check_mins(int64_t kind, const c10::optional<torch::Tensor>& mins, c10::IntArrayRef shape) {
  if (kind < 2 || kind == 5 || (kind == 4 && mins.has_value())) {
    TORCH_CHECK(mins.has_value() && mins->sizes() == shape && mins->is_contiguous() &&
                mins->scalar_type() == torch::kFloat32, "mins: float32 like scales (kinds 0, 1, 5; 4 where present)");
  } else {
    TORCH_CHECK(!mins.has_value(), "mins: none for kinds 2, 3 and 6");
  }
}

inline const float* data_or_null(const c10::optional<torch::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

// the packed layout (gguf_linear.pack): codes [N/16, K/32, *], scales [N/16, blocks, 16]
inline torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                                   const c10::optional<torch::Tensor>& mins, int64_t kind,
                                   const c10::optional<torch::Tensor>& bias);
}  // namespace lmserve

torch::Tensor quantize_activations(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % lmserve::kQuantBlock == 0, "K must be a multiple of 32");
  // [M, K] int8 codes, then [M, K/32] scales and [M, K/32] scale * sums, in one byte buffer per row
  auto out = torch::empty({M, K + 8 * (K / lmserve::kQuantBlock)}, x.options().dtype(torch::kInt8));
  lmserve::quantize_rows(x.data_ptr<float>(), M, K, out.data_ptr<int8_t>());
  return out;
}

int64_t quant_packed_rows() { return lmserve::quant_packed_rows(); }

// rows `ids` [n] of a packed table (codes [G, K/32, *], scales and mins [G, blocks, 16]) of kind 0 (U4), 1 (U8) or
// 2 (S8) as float32 [n, K]: an embedding lookup (layers/formats/gguf_embedding.py), dequantized as its reference
torch::Tensor packed_table_rows(torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> mins,
                                torch::Tensor ids, int64_t kind) {
  TORCH_CHECK(kind >= 0 && kind <= 2, "kind: 0 (U4), 1 (U8) or 2 (S8)");
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && codes.scalar_type() == torch::kUInt8 &&
              codes.size(2) == lmserve::quant_packed_code_bytes(kind),
              "codes: [G, K/32, ", lmserve::num(lmserve::quant_packed_code_bytes(kind)), "] contiguous uint8");
  TORCH_CHECK(codes.size(0) > 0 && codes.size(1) > 0, "codes: an empty table");
  TORCH_CHECK(codes.device().is_cpu() && scales.device().is_cpu() && (!mins.has_value() || mins->device().is_cpu()),
              "codes, scales and mins: CPU tensors");
  const int64_t G = codes.size(0), K = codes.size(1) * lmserve::kQuantBlock;
  const int64_t blocks = lmserve::quant_packed_scale_blocks(kind, K);
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 && scales.dim() == 3 &&
              scales.size(0) == G && scales.size(1) == blocks && scales.size(2) == 16,
              "scales: [G, ", lmserve::num(blocks), ", 16] float32");
  lmserve::check_mins(kind, mins, scales.sizes());
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong && ids.device().is_cpu(), "ids: [n] int64 (CPU)");
  ids = ids.contiguous();
  const int64_t n = ids.size(0);
  const int64_t* pi = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(pi[i] >= 0 && pi[i] < G * 16, "id ", lmserve::num(pi[i]), " is outside the table's ",
                lmserve::num(G * 16), " rows");
  auto out = torch::empty({n, K}, scales.options());
  lmserve::packed_table_rows(kind, static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr<float>(),
                             lmserve::data_or_null(mins), pi, n, K, out.data_ptr<float>());
  return out;
}

inline torch::Tensor lmserve::packed_linear(const torch::Tensor& x, const torch::Tensor& codes,
                                            const torch::Tensor& scales, const c10::optional<torch::Tensor>& mins,
                                            int64_t kind, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(quant_packed_rows() != 0,
              "the packed weight layout needs a build with SSSE3/SSE4.1 or more (quant_packed_rows() == 0)");
  const int64_t M = x.size(0), K = x.size(1), G = codes.size(0), nb = K / kQuantBlock;
  const int64_t code_bytes = quant_packed_code_bytes(kind), scale_blocks = quant_packed_scale_blocks(kind, K);
  TORCH_CHECK(codes.is_contiguous() && codes.size(1) == nb && codes.size(2) == code_bytes,
              "packed codes: [N/16, K/32, ", num(code_bytes), "] contiguous");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 && scales.dim() == 3 &&
              scales.size(0) == G && scales.size(1) == scale_blocks && scales.size(2) == 16,
              "packed scales: [N/16, ", num(scale_blocks), ", 16] float32");
  check_mins(kind, mins, scales.sizes());
  auto xq = quantize_activations(x);
  auto y = torch::empty({M, G * 16}, x.options());
  quant_packed_matmul(kind, static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr<float>(),
                      data_or_null(mins), data_or_null(bias), xq.data_ptr<int8_t>(), xq.size(1), M, K, G,
                      y.data_ptr<float>());
  return y;
}

// rows [offsets[e], offsets[e + 1]) of x times expert e's packed codes (quant_gemm.cpp)
torch::Tensor quant_linear_experts(torch::Tensor x, torch::Tensor offsets, torch::Tensor codes, torch::Tensor scales,
                                   c10::optional<torch::Tensor> mins, int64_t kind) {
  TORCH_CHECK(quant_packed_rows() != 0, "quant_linear_experts needs the packed layout (quant_packed_rows() == 0)");
  TORCH_CHECK(kind >= 0 && kind <= 2, "kind: 0 (U4), 1 (U8) or 2 (S8)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: [R, K] float32");
  x = x.contiguous();
  const int64_t R = x.size(0), K = x.size(1), E = codes.size(0), nb = K / lmserve::kQuantBlock;
  TORCH_CHECK(K % lmserve::kQuantBlock == 0, "K must be a multiple of 32, got ", lmserve::num(K));
  TORCH_CHECK(codes.dim() == 4 && codes.is_contiguous() && codes.size(2) == nb &&
              codes.size(3) == (kind == 0 ? 256 : 512), "codes: [E, N/16, K/32, ",
              lmserve::num(kind == 0 ? 256 : 512), "] contiguous");
  const int64_t G = codes.size(1);
  TORCH_CHECK(scales.dim() == 4 && scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 &&
              scales.size(0) == E && scales.size(1) == G && scales.size(2) == (kind == 2 ? 2 * nb : nb),
              "scales: [E, N/16, ", lmserve::num(kind == 2 ? 2 * nb : nb), ", 16] float32");
  TORCH_CHECK(kind == 2 || (mins.has_value() && mins->sizes() == scales.sizes() && mins->is_contiguous()),
              "mins: like scales (kinds 0 and 1)");
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) == E + 1 && offsets.scalar_type() == torch::kInt64 &&
              offsets.is_contiguous() && offsets.device().is_cpu(), "offsets: [E + 1] int64 on the CPU");
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[E] == R, "offsets must run from 0 to the number of rows");
  auto xq = quantize_activations(x);
  auto y = torch::empty({R, G * 16}, x.options());
  lmserve::quant_packed_experts(kind, static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr<float>(),
                                kind == 2 ? nullptr : mins->data_ptr<float>(), xq.data_ptr<int8_t>(), xq.size(1), off,
                                E, K, G, y.data_ptr<float>());
  return y;
}

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                           c10::optional<torch::Tensor> mins, int64_t kind, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(kind >= 0 && kind <= 6, "kind: 0 (U4), 1 (U8), 2 (S8), 3 (NL4), 4 (I4), 5 (K2) or 6 (K3)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: [M, K] float32");
  x = x.contiguous();
  TORCH_CHECK(kind < 5 || x.size(1) % lmserve::kQuantSuper == 0, "K must be a multiple of 256 for kinds 5 and 6");
  if (codes.dim() == 3) {  // the packed layout (gguf_linear.pack)
    TORCH_CHECK(x.size(1) % lmserve::kQuantBlock == 0, "K must be a multiple of 32, got ", lmserve::num(x.size(1)));
    return lmserve::packed_linear(x, codes, scales, mins, kind, bias);
  }
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % lmserve::kQuantBlock == 0, "K must be a multiple of 32, got ", lmserve::num(K));
  const int64_t code_bytes = lmserve::quant_row_code_bytes(kind, K), scale_count = lmserve::quant_row_scales(kind, K);
  TORCH_CHECK(codes.is_contiguous() && codes.size(1) == code_bytes, "codes: [N, ", lmserve::num(code_bytes),
              "] contiguous");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 && scales.size(0) == N &&
              scales.size(1) == scale_count, "scales: [N, ", lmserve::num(scale_count), "] float32");
  lmserve::check_mins(kind, mins, scales.sizes());
  auto xq = quantize_activations(x);
  auto y = torch::empty({M, N}, x.options());
  lmserve::quant_matmul(kind, static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr<float>(),
                        lmserve::data_or_null(mins), lmserve::data_or_null(bias), xq.data_ptr<int8_t>(), xq.size(1), M,
                        K, N, y.data_ptr<float>());
  return y;
}
