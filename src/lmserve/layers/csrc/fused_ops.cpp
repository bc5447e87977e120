// Row-wise elementwise ops of a decoder layer, fused into one pass each (CPU, float32).
//
// Why: at batch 1 a decode step is ~600 small PyTorch ops, and each tiny op costs 5-50 us of dispatch
// and temporaries (F.rms_norm alone is six ops, ~100 us per call on a [1, 576] row here): ~30% of the
// step. Each op below is one call that reads its rows once. Every row is computed alone in a fixed
// order, so a row's result does not depend on what else is in the batch. The PyTorch reference path
// (layers/fused.py) stays, and tests/test_native_ops.py compares the two.

#include "ops.h"

#include "thread_pool.h"

#include <cmath>

namespace {

// Rows per parallel chunk: about 16K floats, so small batches stay on one thread (no wake-up cost).
int64_t grain(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_len, 1)); }

void check_float_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat, name, ": float32 CPU tensors only");
}

// out[d] = w[d] * (x[d] * r) with r = 1 / sqrt(mean(x^2) + eps): the order of HF's LlamaRMSNorm.
inline void norm_row(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out, int64_t D,
                     float eps) {
  float ss = 0.f;
  for (int64_t d = 0; d < D; ++d) ss += x[d] * x[d];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (int64_t d = 0; d < D; ++d) out[d] = w[d] * (x[d] * r);
}

}  // namespace

namespace {

// out = norm(x + residual) with the sum written into residual, or norm(x) when residual is null
torch::Tensor norm_rows(torch::Tensor x, torch::Tensor* residual, torch::Tensor weight, double eps,
                        const char* name) {
  check_float_cpu(x, name);
  check_float_cpu(weight, name);
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.numel() == D, name, ": weight has ", weight.numel(), " elements, rows have ", D);
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
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  lmserve::parallel_for(0, x.numel() / std::max<int64_t>(D, 1), grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * D;
      if (rp != nullptr) {
        float* __restrict__ r = rp + t * D;
        for (int64_t d = 0; d < D; ++d) r[d] += row[d];
        row = r;
      }
      norm_row(row, wp, op + t * D, D, e);
    }
  });
  return out;
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  return norm_rows(x, nullptr, weight, eps, "rms_norm");
}

torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  return norm_rows(x, &residual, weight, eps, "add_rms_norm_");
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_float_cpu(gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul: expected [T, 2 * I]");
  gate_up = gate_up.contiguous();
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  lmserve::parallel_for(0, T, grain(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict__ g = gp + t * 2 * I;
      const float* __restrict__ u = g + I;
      float* __restrict__ o = op + t * I;
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_float_cpu(x, "rotary_");
  check_float_cpu(cos, "rotary_ cos");
  check_float_cpu(sin, "rotary_ sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary_: expected [T, heads, D] with contiguous heads (rows may be strided)");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.numel() == T * D && sin.numel() == T * D, "rotary_: cos/sin must be [T, 1, D]");
  cos = cos.contiguous();
  sin = sin.contiguous();
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t row_stride = x.stride(0);
  lmserve::parallel_for(0, T, grain(H * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict__ c = cp + t * D;
      const float* __restrict__ s = sp + t * D;
      for (int64_t h = 0; h < H; ++h) {
        float* __restrict__ v = xp + t * row_stride + h * D;
        // HF's x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
        for (int64_t d = 0; d < half; ++d) {
          const float a = v[d], b = v[d + half];
          v[d] = a * c[d] - b * s[d];
          v[d + half] = b * c[d + half] + a * s[d + half];
        }
      }
    }
  });
}
