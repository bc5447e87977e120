// Every decoder layer of a decode step in one call: the loop over layers moves from Python to C++.
//
// Why: with the projections kept in GGUF blocks, a single-stream decode step of the embedded model spends
// ~10 ms in the matmul kernels and ~4 ms around them in Python: ~15 module calls and small torch ops per
// layer, 30 layers. This runs the same sequence of the same native kernels (add_rms_norm_, quant_linear,
// rotary_, the K/V slot writes, paged_decode_attention, silu_and_mul) for every layer from C++, so a
// layer costs a few kernel launches and no interpreter.
//
// Numerics: each step calls exactly the kernels the PyTorch module path calls, on the same values in the
// same order (the K/V writes go through the same writer, write_kv_rows, in any of kv_cache.h's formats; GeGLU is
// ATen's tanh GELU, as the module path), so its outputs are
// bit-identical to that path's (tests/test_decode_stack.py, tests/test_model_families.py), which stays the
// reference and serves every step this cannot (prefill, LoRA, float weights, other devices).
//
// Layers: plain pre-norm (Llama, Qwen) or sandwich (Gemma: norms before and after attention and MLP), optional
// RMSNorm over each q and k head (Qwen3, Gemma 3), a rotary table per layer (or none: NoPE), each layer's
// softmax scale, sliding window and soft-cap, SwiGLU or GeGLU. A projection is one or more parts in GGUF block
// layouts (a fused qkv whose parts the file keeps in different types), concatenated, then its bias.
// A mixture of experts (plain layers) replaces gate_up and down: its router (a float linear), top-k weights as
// layers/blocks/moe.route computes them, the rows sorted by expert and each projection one grouped call over every
// expert's stacked GGUF blocks (quant_linear_experts, as layers/kernels/moe_kernels.NativeExperts), then each token's
// weighted sum. Why: the MoE model left the stack and ran layer by layer in Python, at 0.53x the dense model's speed.
// Constructor layout per layer (decode_stack.py `DecodeStack.build` writes it):
//   tensors: in_norm, post_norm, pre_ff_norm?, post_ff_norm?, q_norm?, k_norm?, then per projection (qkv, o,
//            gate_up, down; qkv, o with a mixture of experts): bias?, and per part: codes, scales, mins?; then a
//            mixture of experts' tensors (Cursor::moe)
//   ints:    rope table (-1: none), window (0: none), act (0 SiLU, 1 tanh GELU), mixture of experts (0/1), then per
//            projection: number of parts, then each part's kind; then a mixture of experts' ints
//   floats:  scale, softcap (0: none)
// LoRA (set_lora, per layer and projection): a step whose rows carry adapter slots passes them to forward, and each
// such projection adds its rows' deltas after its base output, as lora/layers.LoraLinear does (base + delta, through
// the same kernel, lora_delta.cpp), so base rows and adapter rows run in one call.

// Tensor code on torch's side, like ops.h: included by bindings.cpp only (the one unit that includes torch).
#pragma once

#include "cpu_gate.h"
#include "lora_ops.h"
#include "ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace {

struct QuantPart {
  torch::Tensor codes, scales;
  c10::optional<torch::Tensor> mins;
  int64_t kind;
};

struct QuantProj {
  std::vector<QuantPart> parts;
  c10::optional<torch::Tensor> bias;

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (parts.size() == 1) {
      const QuantPart& p = parts[0];
      return quant_linear(x, p.codes, p.scales, p.mins, p.kind, bias);
    }
    std::vector<torch::Tensor> outs;  // layers/gguf_linear.FusedGGUFLinear: parts side by side, then the bias
    for (const QuantPart& p : parts) outs.push_back(quant_linear(x, p.codes, p.scales, p.mins, p.kind, c10::nullopt));
    torch::Tensor y = torch::cat(outs, 1);
    return bias.has_value() ? y.add(*bias) : y;
  }
};

// One projection's LoRA weights (lora/layers.LoraLinear's slot tensors, shared: a slot written later is seen here)
struct LoraProj {
  torch::Tensor a;               // [max_loras, max_rank, n, in]
  std::vector<torch::Tensor> bs;  // n x [max_loras, max_rank, out_i], scaling folded in
};

// One projection of every expert, stacked in the packed GGUF layout (moe_kernels.StackedGGUF): codes [E, N/16, K/32, *]
struct ExpertProj {
  torch::Tensor codes, scales;
  c10::optional<torch::Tensor> mins, bias;  // bias [E, N] (gpt-oss)
  int64_t kind = 0;

  // rows [offsets[e], offsets[e + 1]) of x times expert e, then each row's expert's bias (StackedGGUF.forward)
  torch::Tensor operator()(const torch::Tensor& x, const torch::Tensor& offsets, const torch::Tensor& row_experts) const {
    torch::Tensor y = quant_linear_experts(x, offsets, codes, scales, mins, kind);
    return bias.has_value() ? y.add(bias->index_select(0, row_experts)) : y;
  }
};

// A mixture-of-experts MLP (layers/blocks/moe.SparseMoE with NativeExperts): a float router, then the grouped experts
struct MoeMlp {
  // the router as its module holds it: a plain nn.Linear's weight [E, hidden], or a PackedLinear's oneDNN-packed
  // weight and, where it has them, its skinny-kernel panels (layers/formats/linear.py)
  torch::Tensor router;
  c10::optional<torch::Tensor> router_panels, router_bias;
  bool router_packed = false;
  int64_t num_experts = 0;
  ExpertProj gate_up, down;
  int64_t top_k = 1;
  bool renormalize = false, softmax_after_topk = false;

  // h [T, hidden] -> router logits [T, E]. Where the router has panels (PackedLinear keeps them where the skinny
  // kernel gave oneDNN's bits for the rows of a 16-row call, checked at load) the skinny kernel computes them at any
  // row count; the module path (PackedLinear.forward) takes oneDNN past 8 rows. Why: oneDNN's set-up per call (its
  // primitive, descriptors, scratch) was ~8% of the tiny MoE's step at batch 16, for a [16 x 256] x [256 x 8] product.
  // Each row's chain in the skinny kernel is the same at any row count. Without panels: oneDNN's packed linear;
  // nn.Linear: at::linear.
  torch::Tensor router_logits(const torch::Tensor& h) const {
    if (!router_packed) return at::linear(h, router, router_bias);
    if (router_panels.has_value()) return skinny_linear(h, *router_panels, num_experts, router_bias);
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    std::vector<c10::IValue> stack;
    stack.emplace_back(h);
    stack.emplace_back(router);
    stack.emplace_back(router_bias.has_value() ? c10::IValue(*router_bias) : c10::IValue());
    stack.emplace_back(std::string("none"));
    stack.emplace_back(c10::impl::GenericList(c10::OptionalType::create(c10::NumberType::get())));
    stack.emplace_back(std::string(""));
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }

  // h [T, hidden] -> [T, hidden]: blocks/moe.route, group_by_expert, NativeExperts.forward and combine, op for op (the
  // same ATen ops on the same values: the module path's bits)
  torch::Tensor operator()(const torch::Tensor& h, int64_t act) const;
};

struct Layer {
  torch::Tensor in_norm, post_norm;  // plain: input and pre-MLP norms; sandwich: input and post-attention norms
  c10::optional<torch::Tensor> pre_ff_norm, post_ff_norm, q_norm, k_norm;
  QuantProj qkv, o, gate_up, down;  // gate_up and down: unused where moe is set
  c10::optional<MoeMlp> moe;
  int64_t rope, window, act;
  double scale, softcap;
  c10::optional<LoraProj> lora[4];  // qkv, o, gate_up, down: set_lora
};

// Reads the constructor's flat lists in order.
struct Cursor {
  const std::vector<c10::optional<torch::Tensor>>& tensors;
  const std::vector<int64_t>& ints;
  const std::vector<double>& floats;
  size_t t = 0, i = 0, f = 0;

  c10::optional<torch::Tensor> tensor() {
    TORCH_CHECK(t < tensors.size(), "DecodeStack: too few tensors");
    return tensors[t++];
  }
  int64_t integer() {
    TORCH_CHECK(i < ints.size(), "DecodeStack: too few ints");
    return ints[i++];
  }
  double real() {
    TORCH_CHECK(f < floats.size(), "DecodeStack: too few floats");
    return floats[f++];
  }
  ExpertProj experts() {
    ExpertProj p;
    auto codes = tensor(), scales = tensor();
    TORCH_CHECK(codes.has_value() && scales.has_value(), "DecodeStack: experts need codes and scales");
    p.codes = *codes;
    p.scales = *scales;
    p.mins = tensor();
    p.bias = tensor();
    p.kind = integer();
    return p;
  }
  // tensors: router (weight, or oneDNN-packed weight), its panels?, its bias?, then gate_up and down: codes, scales,
  // mins?, bias?; ints: router packed, experts, top_k, renormalize, softmax_after_topk, gate_up's kind, down's kind
  MoeMlp moe() {
    MoeMlp m;
    auto router = tensor();
    TORCH_CHECK(router.has_value(), "DecodeStack: a mixture of experts needs its router");
    m.router = *router;
    m.router_panels = tensor();
    m.router_bias = tensor();
    m.router_packed = integer() != 0;
    m.num_experts = integer();
    m.top_k = integer();
    m.renormalize = integer() != 0;
    m.softmax_after_topk = integer() != 0;
    m.gate_up = experts();
    m.down = experts();
    TORCH_CHECK(m.top_k >= 1 && m.top_k <= m.num_experts && m.gate_up.codes.size(0) == m.num_experts &&
                m.down.codes.size(0) == m.num_experts, "DecodeStack: one router output per expert, top_k <= experts");
    return m;
  }
  QuantProj proj(int64_t num_parts) {
    QuantProj p;
    p.bias = tensor();
    for (int64_t j = 0; j < num_parts; ++j) {
      auto codes = tensor(), scales = tensor();
      TORCH_CHECK(codes.has_value() && scales.has_value(), "DecodeStack: a part needs codes and scales");
      p.parts.push_back(QuantPart{*codes, *scales, tensor(), 0});
    }
    return p;
  }
};

// [B, 2I] = [gate | up] -> act(gate) * up: the native SiLU- or tanh-GELU-and-mul, as the module path (layers/kernels/fused.py)
torch::Tensor act_and_mul(const torch::Tensor& gate_up, int64_t act) {
  return act == 0 ? silu_and_mul(gate_up) : gelu_tanh_and_mul(gate_up);
}

torch::Tensor MoeMlp::operator()(const torch::Tensor& h, int64_t act) const {
  // Routing and the weighted sum run as plain loops on this thread: a [16, 8] softmax or scatter in ATen opens an
  // OpenMP region, and on a loaded 2-core machine each such region waited ~15 ms for a descheduled worker (profiled:
  // softmax and index_put_ were 2/3 of the MoE step). The numbers are blocks/moe.route's and combine's up to rounding
  // (exp and the order of the sums): tokens follow the module path, logits within float error (tests/test_moe.py).
  const torch::Tensor logits = router_logits(h).contiguous();
  const int64_t T = h.size(0), k = top_k, P = T * k, E = num_experts;
  TORCH_CHECK(logits.size(1) == E, "DecodeStack: router outputs != experts");
  const float* lg = logits.data_ptr<float>();
  std::vector<float> weights(P), prob(E);
  std::vector<int64_t> ex(P);
  std::vector<char> taken(E);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = lg + t * E;
    if (softmax_after_topk) {
      std::copy(row, row + E, prob.begin());
    } else {  // softmax over every expert (float32), as F.softmax
      float mx = row[0];
      for (int64_t e = 1; e < E; ++e) mx = std::max(mx, row[e]);
      float sum = 0.f;
      for (int64_t e = 0; e < E; ++e) sum += prob[e] = std::exp(row[e] - mx);
      for (int64_t e = 0; e < E; ++e) prob[e] /= sum;
    }
    // the top k in descending order, the lower index first among equals (torch.topk's order)
    std::fill(taken.begin(), taken.end(), 0);
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || prob[e] > prob[best])) best = e;
      taken[best] = 1;
      ex[t * k + j] = best;
      weights[t * k + j] = prob[best];
    }
    float* w = weights.data() + t * k;
    if (softmax_after_topk) {  // gpt-oss: a softmax over the k chosen logits
      float sum = 0.f;
      for (int64_t j = 0; j < k; ++j) sum += w[j] = std::exp(w[j] - w[0]);
      for (int64_t j = 0; j < k; ++j) w[j] /= sum;
    } else if (renormalize) {
      float sum = 0.f;
      for (int64_t j = 0; j < k; ++j) sum += w[j];
      for (int64_t j = 0; j < k; ++j) w[j] /= sum;
    }
  }
  // group_by_expert: the T * k pairs in a stable sort by expert (a counting sort: the stable argsort's order)
  auto offsets = torch::zeros({E + 1}, torch::dtype(torch::kLong));
  auto token = torch::empty({P}, torch::dtype(torch::kLong));
  auto row_experts = torch::empty({P}, torch::dtype(torch::kLong));
  int64_t* off = offsets.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) ++off[ex[p] + 1];
  for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
  std::vector<int64_t> next(off, off + E), row_of(P);
  int64_t *pt = token.data_ptr<int64_t>(), *pe = row_experts.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) {
    const int64_t r = next[ex[p]]++;
    row_of[p] = r;
    pt[r] = p / k;
    pe[r] = ex[p];
  }
  const torch::Tensor rows = h.index_select(0, token);  // [T * k, hidden], expert-major
  const torch::Tensor out =
      down(act_and_mul(gate_up(rows, offsets, row_experts), act), offsets, row_experts).contiguous();
  // combine: each token's k outputs weighted and summed in slot order
  const int64_t H = out.size(1);
  auto result = torch::zeros({T, H}, h.options());
  const float* y = out.data_ptr<float>();
  float* res = result.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const float w = weights[t * k + j];
      const float* src = y + row_of[t * k + j] * H;
      float* dst = res + t * H;
      for (int64_t c = 0; c < H; ++c) dst[c] += w * src[c];
    }
  return result;
}

}  // namespace

class DecodeStack {
 public:
  DecodeStack(const std::vector<c10::optional<torch::Tensor>>& tensors, const std::vector<int64_t>& ints,
              const std::vector<double>& floats, int64_t num_layers, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, double eps)
      : heads_(num_heads), kv_heads_(num_kv_heads), dim_(head_dim), eps_(eps) {
    Cursor c{tensors, ints, floats};
    for (int64_t i = 0; i < num_layers; ++i) {
      Layer l;
      auto in_norm = c.tensor(), post_norm = c.tensor();
      TORCH_CHECK(in_norm.has_value() && post_norm.has_value(), "DecodeStack: every layer has two norms");
      l.in_norm = *in_norm;
      l.post_norm = *post_norm;
      l.pre_ff_norm = c.tensor();
      l.post_ff_norm = c.tensor();
      l.q_norm = c.tensor();
      l.k_norm = c.tensor();
      TORCH_CHECK(l.pre_ff_norm.has_value() == l.post_ff_norm.has_value() && l.q_norm.has_value() == l.k_norm.has_value(),
                  "DecodeStack: sandwich and QK norms come in pairs");
      l.rope = c.integer();
      l.window = c.integer();
      l.act = c.integer();
      const bool moe = c.integer() != 0;
      QuantProj* projs[] = {&l.qkv, &l.o, &l.gate_up, &l.down};
      for (QuantProj* p : projs) {
        if (moe && p == &l.gate_up) break;  // a mixture of experts in place of gate_up and down
        const int64_t n = c.integer();
        TORCH_CHECK(n >= 1, "DecodeStack: a projection has at least one part");
        *p = c.proj(n);
        for (QuantPart& part : p->parts) part.kind = c.integer();
      }
      if (moe) l.moe = c.moe();
      l.scale = c.real();
      l.softcap = c.real();
      layers_.push_back(std::move(l));
    }
    TORCH_CHECK(c.t == tensors.size() && c.i == ints.size() && c.f == floats.size(),
                "DecodeStack: the flat lists do not match ", lmserve::num(num_layers), " layers");
  }

  // projection j (0 qkv, 1 o, 2 gate_up, 3 down) of layer i adds LoRA deltas from these slot tensors
  void set_lora(int64_t i, int64_t j, torch::Tensor a, std::vector<torch::Tensor> bs) {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(layers_.size()) && j >= 0 && j < 4, "DecodeStack: no such projection");
    TORCH_CHECK(a.dim() == 4 && a.size(2) == static_cast<int64_t>(bs.size()), "DecodeStack: one LoRA b per slice");
    layers_[i].lora[j] = LoraProj{std::move(a), std::move(bs)};
  }

  // x [B, hidden] (the embeddings, after any scale; used as the residual stream and updated in place), one cos and
  // sin [B, 1, D] per rotary table, one cache per layer, slot_mappings [B] and block_tables [B, max_blocks]: one
  // of each for every layer, or one per layer (each layer's KV group's: cache/kv_groups.py), context_lens [B]
  // lora_slots [B] int64 (a row's adapter slot, -1: base) or none, lora_rank the step's widest adapter rank
  // -> (last layer's output, residual): the final norm stays with the model.
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, const std::vector<torch::Tensor>& cos,
                                                   const std::vector<torch::Tensor>& sin,
                                                   const std::vector<torch::Tensor>& kv_caches,
                                                   std::vector<torch::Tensor> slot_mappings,
                                                   const std::vector<torch::Tensor>& block_tables,
                                                   torch::Tensor context_lens,
                                                   const c10::optional<torch::Tensor>& lora_slots = c10::nullopt,
                                                   int64_t lora_rank = 0) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "DecodeStack: one KV cache per layer");
    TORCH_CHECK(cos.size() == sin.size(), "DecodeStack: one sin per cos table");
    TORCH_CHECK(slot_mappings.size() == block_tables.size() &&
                (slot_mappings.size() == 1 || slot_mappings.size() == layers_.size()),
                "DecodeStack: one slot mapping and block table for every layer, or one per layer");
    TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat, "DecodeStack: contiguous float32 x");
    for (torch::Tensor& slots : slot_mappings) {
      TORCH_CHECK(slots.scalar_type() == torch::kLong, "DecodeStack: int64 slots");
      slots = slots.contiguous();
    }
    const int64_t B = x.size(0), q_size = heads_ * dim_, kv_size = kv_heads_ * dim_;
    torch::Tensor residual = x, h;
    if (lora_slots.has_value())
      TORCH_CHECK(lora_slots->size(0) == B, "DecodeStack: one LoRA slot per row");
    // projection j of layer l on x: its base output, then the adapter rows' deltas
    auto project = [&](const Layer& l, int j, const QuantProj& p, const torch::Tensor& in) {
      torch::Tensor y = p(in);
      if (lora_slots.has_value() && l.lora[j].has_value())
        lora_delta_(y, in, *lora_slots, l.lora[j]->a, l.lora[j]->bs, lora_rank);
      return y;
    };
    for (size_t i = 0; i < layers_.size(); ++i) {
      lmserve::gate_pause();  // an encoder's short step goes first (cpu_gate.h): one load while nobody holds the gate
      const Layer& l = layers_[i];
      TORCH_CHECK(l.rope < static_cast<int64_t>(cos.size()), "DecodeStack: layer ", lmserve::num(i),
                  " reads a missing rotary table");
      h = i == 0 ? rms_norm(residual, l.in_norm, eps_) : add_rms_norm_(h, residual, l.in_norm, eps_);
      torch::Tensor qkv = project(l, 0, l.qkv, h);  // [B, q + 2 kv]
      const int64_t row = qkv.stride(0);
      const float* base = qkv.data_ptr<float>();
      torch::Tensor q, k;
      const float* k_rows = base + q_size;
      int64_t k_stride = row;
      if (!l.q_norm.has_value()) {
        if (l.rope >= 0) rotary_(qkv.narrow(1, 0, q_size + kv_size).view({B, heads_ + kv_heads_, dim_}), cos[l.rope], sin[l.rope]);
        q = qkv.narrow(1, 0, q_size).view({B, heads_, dim_});
      } else {  // each head normed first (new contiguous rows), then rotated
        q = rms_norm(qkv.narrow(1, 0, q_size).view({B, heads_, dim_}), *l.q_norm, eps_);
        k = rms_norm(qkv.narrow(1, q_size, kv_size).view({B, kv_heads_, dim_}), *l.k_norm, eps_);
        if (l.rope >= 0) {
          rotary_(q, cos[l.rope], sin[l.rope]);
          rotary_(k, cos[l.rope], sin[l.rope]);
        }
        k_rows = k.data_ptr<float>();
        k_stride = kv_size;
      }
      const torch::Tensor& cache = kv_caches[i];
      const size_t g = slot_mappings.size() == 1 ? 0 : i;  // this layer's slots and block table
      // K rows (views into the qkv output, or normed K rows) and V rows, each with its own stride, into their slots
      // in the cache's format (float32, float16 or quantized: the one writer, paged_decode_attention.cpp)
      write_kv_rows(cache, k_rows, k_stride, base + q_size + kv_size, row, slot_mappings[g].data_ptr<int64_t>(), B,
                    kv_heads_, dim_);
      torch::Tensor attn = paged_decode_attention(q, cache[0], cache[1], block_tables[g], context_lens, l.scale,
                                                  c10::nullopt, l.window, l.softcap);
      torch::Tensor o = project(l, 1, l.o, attn.view({B, q_size}));
      if (l.pre_ff_norm.has_value()) {  // sandwich: residual + post_norm(block(pre_norm(residual))), twice
        h = add_rms_norm_(rms_norm(o, l.post_norm, eps_), residual, *l.pre_ff_norm, eps_);
        h = rms_norm(project(l, 3, l.down, act_and_mul(project(l, 2, l.gate_up, h), l.act)), *l.post_ff_norm, eps_);
      } else if (l.moe.has_value()) {
        h = (*l.moe)(add_rms_norm_(o, residual, l.post_norm, eps_), l.act);
      } else {
        h = add_rms_norm_(o, residual, l.post_norm, eps_);
        h = project(l, 3, l.down, act_and_mul(project(l, 2, l.gate_up, h), l.act));
      }
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
      .def(pybind11::init<const std::vector<c10::optional<torch::Tensor>>&, const std::vector<int64_t>&,
                          const std::vector<double>&, int64_t, int64_t, int64_t, int64_t, double>())
      .def("set_lora", &DecodeStack::set_lora, "LoRA slot tensors of one projection (layer, 0..3, a, [b per slice])")
      // without the GIL: the server's event loop runs while a step computes
      .def("forward", &DecodeStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "every decoder layer of a decode-only step (see decode_stack.h)", pybind11::arg("x"), pybind11::arg("cos"),
           pybind11::arg("sin"), pybind11::arg("kv_caches"), pybind11::arg("slot_mappings"),
           pybind11::arg("block_tables"), pybind11::arg("context_lens"), pybind11::arg("lora_slots") = pybind11::none(),
           pybind11::arg("lora_rank") = 0);
}
