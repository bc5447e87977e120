// Every decoder layer of a decode step in one call: the loop over layers moves from Python to C++.
//
// Why: with the projections kept in GGUF blocks, a single-stream decode step of the embedded model spends
// ~10 ms in the matmul kernels and ~4 ms around them in Python: ~15 module calls and small torch ops per
// layer, 30 layers. This runs the same sequence of the same native kernels (add_rms_norm_, quant_linear,
// rotary_, the K/V slot writes, paged_decode_attention, silu_and_mul) for every layer from C++, so a
// layer costs a few kernel launches and no interpreter.
//
// Numerics: each step calls exactly the kernels the PyTorch module path calls, on the same values in the
// same order (the K/V writes are copies), so its outputs are bit-identical to that path's
// (tests/test_decode_stack.py), which stays the reference and serves every step this cannot (prefill,
// LoRA, float weights, other devices).
//
// Per layer the constructor takes 18 tensors: input norm weight, post-attention norm weight, then for
// qkv, o, gate_up, down: codes, scales, mins (None for S8), bias (or None); and one kind per projection.

#include "ops.h"

#include <type_traits>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

struct QuantProj {
  torch::Tensor codes, scales;
  c10::optional<torch::Tensor> mins, bias;
  int64_t kind;

  torch::Tensor operator()(const torch::Tensor& x) const { return quant_linear(x, codes, scales, mins, kind, bias); }
};

struct Layer {
  torch::Tensor in_norm, post_norm;
  QuantProj qkv, o, gate_up, down;
};

// Store this step's K and V rows [B, Hkv * D] (strided views into the qkv output) at their cache slots; a float16
// cache gets them rounded to nearest even, as torch's .to(float16) in layers/paged_attention.write_kv.
template <typename KV>
void write_kv_as(const torch::Tensor& cache, const float* k, const float* v, int64_t row_stride, const int64_t* slots,
                 int64_t B, int64_t width) {
  // cache [2, blocks, block_size, Hkv, D]: K then V, each a flat [slots, Hkv * D]
  KV* kc = cache.data_ptr<KV>();
  KV* vc = kc + cache.numel() / 2;
  for (int64_t b = 0; b < B; ++b) {
    if constexpr (std::is_same_v<KV, float>) {
      std::memcpy(kc + slots[b] * width, k + b * row_stride, width * sizeof(float));
      std::memcpy(vc + slots[b] * width, v + b * row_stride, width * sizeof(float));
    } else {
      for (int64_t j = 0; j < width; ++j) {
        kc[slots[b] * width + j] = static_cast<KV>(k[b * row_stride + j]);
        vc[slots[b] * width + j] = static_cast<KV>(v[b * row_stride + j]);
      }
    }
  }
}

void write_kv(const torch::Tensor& cache, const float* k, const float* v, int64_t row_stride, const int64_t* slots,
              int64_t B, int64_t width) {
  if (cache.scalar_type() == torch::kHalf) return write_kv_as<c10::Half>(cache, k, v, row_stride, slots, B, width);
  write_kv_as<float>(cache, k, v, row_stride, slots, B, width);
}

}  // namespace

class DecodeStack {
 public:
  DecodeStack(const std::vector<c10::optional<torch::Tensor>>& tensors, const std::vector<int64_t>& kinds,
              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps)
      : heads_(num_heads), kv_heads_(num_kv_heads), dim_(head_dim), eps_(eps) {
    TORCH_CHECK(tensors.size() % 18 == 0 && kinds.size() * 18 == tensors.size() * 4,
                "DecodeStack: 18 tensors and 4 kinds per layer");
    for (size_t i = 0; i < tensors.size() / 18; ++i) {
      const auto* t = tensors.data() + i * 18;
      const int64_t* k = kinds.data() + i * 4;
      auto proj = [&](int j) { return QuantProj{*t[2 + 4 * j], *t[3 + 4 * j], t[4 + 4 * j], t[5 + 4 * j], k[j]}; };
      layers_.push_back(Layer{*t[0], *t[1], proj(0), proj(1), proj(2), proj(3)});
    }
  }

  // x [B, hidden] (the embeddings; used as the residual stream and updated in place), cos/sin [B, 1, D],
  // one cache per layer, slot_mapping [B], block_tables [B, max_blocks], context_lens [B]
  // -> (last MLP output, residual): the final norm stays with the model.
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                                   const std::vector<torch::Tensor>& kv_caches,
                                                   torch::Tensor slot_mapping, torch::Tensor block_tables,
                                                   torch::Tensor context_lens) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "DecodeStack: one KV cache per layer");
    TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat && slot_mapping.scalar_type() == torch::kLong,
                "DecodeStack: contiguous float32 x, int64 slots");
    slot_mapping = slot_mapping.contiguous();
    const int64_t B = x.size(0), q_size = heads_ * dim_, kv_size = kv_heads_ * dim_;
    const double scale = std::pow(static_cast<double>(dim_), -0.5);  // as Python computes D ** -0.5
    torch::Tensor residual = x, h;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      h = i == 0 ? rms_norm(residual, l.in_norm, eps_) : add_rms_norm_(h, residual, l.in_norm, eps_);
      torch::Tensor qkv = l.qkv(h);  // [B, q + 2 kv]
      const int64_t row = qkv.stride(0);
      rotary_(qkv.narrow(1, 0, q_size + kv_size).view({B, heads_ + kv_heads_, dim_}), cos, sin);
      const float* base = qkv.data_ptr<float>();
      const torch::Tensor& cache = kv_caches[i];
      TORCH_CHECK(cache.is_contiguous() && (cache.scalar_type() == torch::kFloat || cache.scalar_type() == torch::kHalf),
                  "DecodeStack: float32 or float16 caches");
      write_kv(cache, base + q_size, base + q_size + kv_size, row, slot_mapping.data_ptr<int64_t>(), B, kv_size);
      torch::Tensor attn = paged_decode_attention(qkv.narrow(1, 0, q_size).view({B, heads_, dim_}), cache[0], cache[1],
                                                  block_tables, context_lens, scale, c10::nullopt, 0, 0.0);
      h = add_rms_norm_(l.o(attn.view({B, q_size})), residual, l.post_norm, eps_);
      h = l.down(silu_and_mul(l.gate_up(h)));
    }
    return {h, residual};
  }

 private:
  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, dim_;
  double eps_;
};

void bind_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<const std::vector<c10::optional<torch::Tensor>>&, const std::vector<int64_t>&, int64_t,
                          int64_t, int64_t, double>())
      .def("forward", &DecodeStack::forward, "every decoder layer of a decode-only step (see decode_stack.cpp)");
}
