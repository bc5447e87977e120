// Torch's side of fused_ops.cpp: the row-wise ops of a decoder layer (included by ops.h).
#pragma once

namespace lmserve {
// out = norm(x + residual) with the sum written into residual, or norm(x) when residual is null
inline torch::Tensor norm_rows(torch::Tensor x, torch::Tensor* residual, torch::Tensor weight, double eps,
                               const char* name) {
  check_float_cpu(x, name);
  check_float_cpu(weight, name);
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.numel() == D, name, ": weight has ", num(weight.numel()), " elements, rows have ", num(D));
  float* rp = nullptr;
  if (residual != nullptr) {
    check_float_cpu(*residual, name);
    TORCH_CHECK(x.sizes() == residual->sizes(), name, ": x and residual differ in shape");
    TORCH_CHECK(residual->is_contiguous(), name, ": the residual is updated in place and must be contiguous");
    rp = residual->data_ptr<float>();
  }
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), rp, weight.data_ptr<float>(), out.data_ptr<float>(),
                x.numel() / std::max<int64_t>(D, 1), D, static_cast<float>(eps));
  return out;
}

// [T, 2I] = [gate | up] -> [T, I] by `rows`, a gated activation's kernel
inline torch::Tensor gated(torch::Tensor gate_up, const char* name, void (*rows)(const float*, float*, int64_t,
                                                                                  int64_t)) {
  check_float_cpu(gate_up, name);
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, name, ": expected [T, 2 * I]");
  gate_up = gate_up.contiguous();
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), T, I);
  return out;
}
}  // namespace lmserve

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  return lmserve::norm_rows(x, nullptr, weight, eps, "rms_norm");
}

torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  return lmserve::norm_rows(x, &residual, weight, eps, "add_rms_norm_");
}

torch::Tensor layer_norm(torch::Tensor x, c10::optional<torch::Tensor> weight, c10::optional<torch::Tensor> bias,
                         double eps) {
  lmserve::check_float_cpu(x, "layer_norm");
  const int64_t D = x.size(-1);
  const float* affine[2] = {nullptr, nullptr};
  c10::optional<torch::Tensor>* params[2] = {&weight, &bias};
  for (int i = 0; i < 2; ++i) {
    if (!params[i]->has_value()) continue;
    torch::Tensor p = (*params[i])->contiguous();
    lmserve::check_float_cpu(p, "layer_norm");
    TORCH_CHECK(p.numel() == D, "layer_norm: ", i == 0 ? "weight" : "bias", " has ", lmserve::num(p.numel()),
                " elements, rows have ", lmserve::num(D));
    *params[i] = p;
    affine[i] = p.data_ptr<float>();
  }
  x = x.contiguous();
  auto out = torch::empty_like(x);
  lmserve::layer_norm_rows(x.data_ptr<float>(), affine[0], affine[1], out.data_ptr<float>(),
                           x.numel() / std::max<int64_t>(D, 1), D, static_cast<float>(eps));
  return out;
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  return lmserve::gated(gate_up, "silu_and_mul", lmserve::silu_and_mul_rows);
}

torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up) {
  return lmserve::gated(gate_up, "gelu_tanh_and_mul", lmserve::gelu_tanh_and_mul_rows);
}

std::vector<torch::Tensor> argmax_logprob(torch::Tensor logits) {
  lmserve::check_float_cpu(logits, "argmax_logprob");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "argmax_logprob: expected [B, V] with V > 0");
  logits = logits.contiguous();
  const int64_t B = logits.size(0), V = logits.size(1);
  auto ids = torch::empty({B}, logits.options().dtype(torch::kInt64));
  auto lp = torch::empty({B}, logits.options());
  lmserve::argmax_logprob_rows(logits.data_ptr<float>(), B, V, ids.data_ptr<int64_t>(), lp.data_ptr<float>());
  return {ids, lp};
}

void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  lmserve::check_float_cpu(x, "rotary_");
  lmserve::check_float_cpu(cos, "rotary_ cos");
  lmserve::check_float_cpu(sin, "rotary_ sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary_: expected [T, heads, D] with contiguous heads (rows may be strided)");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0 && cos.numel() == T * D && sin.numel() == T * D, "rotary_: cos/sin must be [T, 1, D]");
  cos = cos.contiguous();
  sin = sin.contiguous();
  lmserve::rotary_rows(x.data_ptr<float>(), x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), T, H, D);
}
