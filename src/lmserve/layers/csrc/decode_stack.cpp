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

#include <cmath>
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
      write_kv_rows(cache, base + q_size, base + q_size + kv_size, row, slot_mapping.data_ptr<int64_t>(), B, kv_heads_,
                    dim_);
      torch::Tensor attn = paged_decode_attention(qkv.narrow(1, 0, q_size).view({B, heads_, dim_}), cache[0], cache[1],
                                                  block_tables, context_lens, scale, c10::nullopt);
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
      // without the GIL: the server's event loop runs while a step computes
      .def("forward", &DecodeStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "every decoder layer of a decode-only step (see decode_stack.cpp)");
}
