// Torch's side of gemv.cpp, coded_half.cpp and quant_gemm.cpp: the matmuls (included by ops.h).
#pragma once

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor panels, int64_t out_features,
                            c10::optional<torch::Tensor> bias) {
  constexpr int64_t kPanel = lmserve::kPanelWidth;
  const auto wt = panels.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat &&
              (wt == torch::kFloat || wt == torch::kBFloat16 || wt == torch::kHalf),
              "skinny_linear: float32 CPU activations, float32 / bfloat16 / float16 panels only");
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == kPanel && panels.size(1) == x.size(1),
              "skinny_linear: expected x [M, K] and panels [N/16, K, 16]");
  TORCH_CHECK(panels.is_contiguous() && out_features <= panels.size(0) * kPanel, "skinny_linear: bad panels");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  auto y = torch::empty({M, P * kPanel}, x.options());  // padded to whole panels while computing
  lmserve::skinny_matmul(x.data_ptr<float>(), M, K, panels.data_ptr(), lmserve::panel_type_of(wt), P,
                         y.data_ptr<float>());
  return lmserve::narrow_add(y, out_features, bias);
}

// rows of x grouped by expert (offsets [E + 1]) times each one's panels [E, N/16, K, 16] (gemv.cpp)
torch::Tensor skinny_linear_experts(torch::Tensor x, torch::Tensor offsets, torch::Tensor panels,
                                    int64_t out_features) {
  constexpr int64_t kPanel = lmserve::kPanelWidth;
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && panels.scalar_type() == torch::kFloat,
              "skinny_linear_experts: float32 CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 4 && panels.size(3) == kPanel && panels.size(2) == x.size(1) &&
              panels.is_contiguous(), "skinny_linear_experts: expected x [R, K] and panels [E, N/16, K, 16]");
  const int64_t E = panels.size(0), P = panels.size(1), K = x.size(1), R = x.size(0), ldy = P * kPanel;
  TORCH_CHECK(out_features <= ldy, "skinny_linear_experts: out_features past the panels");
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) == E + 1 && offsets.scalar_type() == torch::kInt64 &&
              offsets.is_contiguous() && offsets.device().is_cpu(), "offsets: [E + 1] int64 on the CPU");
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[E] == R, "offsets must run from 0 to the number of rows");
  x = x.contiguous();
  auto y = torch::empty({R, ldy}, x.options());
  lmserve::skinny_experts_matmul(x.data_ptr<float>(), K, off, E, panels.data_ptr<float>(), P, y.data_ptr<float>());
  return out_features == ldy ? y : y.narrow(1, 0, out_features);
}

namespace lmserve {
inline CodedHalf coded(const torch::Tensor& codes, const torch::Tensor& tables, const torch::Tensor& exc_off,
                       const torch::Tensor& exc_pos, const torch::Tensor& exc_val, int64_t K) {
  return {codes.data_ptr<uint8_t>(), tables.data_ptr<uint8_t>(), exc_off.data_ptr<int64_t>(),
          exc_pos.data_ptr<int32_t>(), exc_val.data_ptr<float>(), K, codes.size(1)};
}
}  // namespace lmserve

torch::Tensor coded_half_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor tables, torch::Tensor exc_off,
                                torch::Tensor exc_pos, torch::Tensor exc_val, int64_t out_features,
                                c10::optional<torch::Tensor> bias) {
  constexpr int64_t kPanel = lmserve::kPanelWidth;
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2,
              "coded_half_linear: x must be [M, K] float32 on the CPU");
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.dim() == 3 && codes.size(2) == lmserve::kCodedGroupBytes &&
              codes.is_contiguous() && codes.size(1) * 4 >= x.size(1) && codes.size(1) * 4 < x.size(1) + 4,
              "coded_half_linear: codes must be [N/16, ceil(K/4), 96] uint8");
  const int64_t P = codes.size(0), M = x.size(0), ldy = P * kPanel;
  TORCH_CHECK(tables.scalar_type() == torch::kUInt8 && tables.is_contiguous() && tables.numel() == P * kPanel,
              "coded_half_linear: tables must be [N/16, 16] uint8");
  TORCH_CHECK(exc_off.scalar_type() == torch::kInt64 && exc_off.is_contiguous() && exc_off.numel() == P + 1 &&
              exc_pos.scalar_type() == torch::kInt32 && exc_pos.is_contiguous() &&
              exc_val.scalar_type() == torch::kFloat && exc_val.is_contiguous() &&
              exc_pos.numel() == exc_val.numel() && exc_off.data_ptr<int64_t>()[P] == exc_pos.numel(),
              "coded_half_linear: bad exception lists");
  TORCH_CHECK(out_features <= ldy, "coded_half_linear: out_features past the panels");
  x = x.contiguous();
  auto y = torch::empty({M, ldy}, x.options());
  lmserve::coded_half_matmul(lmserve::coded(codes, tables, exc_off, exc_pos, exc_val, x.size(1)), x.data_ptr<float>(),
                             M, P, y.data_ptr<float>());
  return lmserve::narrow_add(y, out_features, bias);
}

// Rows `ids` of the coded matrix widened to float32 [T, K] (coded_half.cpp)
torch::Tensor coded_half_rows(torch::Tensor ids, torch::Tensor codes, torch::Tensor tables, torch::Tensor exc_off,
                              torch::Tensor exc_pos, torch::Tensor exc_val, int64_t K) {
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 1 && codes.scalar_type() == torch::kUInt8 &&
              codes.dim() == 3 && codes.size(2) == lmserve::kCodedGroupBytes && codes.is_contiguous() &&
              codes.size(1) * 4 >= K && tables.is_contiguous() && exc_off.is_contiguous() && exc_pos.is_contiguous() &&
              exc_val.is_contiguous(), "coded_half_rows: expected int64 ids [T] and coded_half_linear's tensors");
  ids = ids.contiguous();
  const int64_t T = ids.size(0), P = codes.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < P * lmserve::kPanelWidth, "coded_half_rows: id out of range");
  auto out = torch::empty({T, K}, torch::dtype(torch::kFloat));
  lmserve::coded_half_gather(lmserve::coded(codes, tables, exc_off, exc_pos, exc_val, K), id, T,
                             out.data_ptr<float>());
  return out;
}

// bfloat16 panels [N/16, K, 16] -> codes, tables, exc_off, exc_pos, exc_val (coded_half.cpp)
std::vector<torch::Tensor> code_half_panels(torch::Tensor panels) {
  constexpr int64_t kPanel = lmserve::kPanelWidth;
  TORCH_CHECK(panels.scalar_type() == torch::kBFloat16 && panels.dim() == 3 && panels.size(2) == kPanel &&
              panels.is_contiguous(), "code_half_panels: panels must be contiguous bfloat16 [N/16, K, 16]");
  const int64_t P = panels.size(0), K = panels.size(1), G = (K + 3) / 4;
  auto codes = torch::zeros({P, G, lmserve::kCodedGroupBytes}, torch::dtype(torch::kUInt8));
  auto tables = torch::empty({P, kPanel}, torch::dtype(torch::kUInt8));
  std::vector<std::vector<int32_t>> pos;
  std::vector<std::vector<float>> val;
  lmserve::code_half(reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>()), P, K,
                     codes.data_ptr<uint8_t>(), tables.data_ptr<uint8_t>(), pos, val);
  auto exc_off = torch::empty({P + 1}, torch::dtype(torch::kInt64));
  int64_t* off = exc_off.data_ptr<int64_t>();
  off[0] = 0;
  for (int64_t p = 0; p < P; ++p) off[p + 1] = off[p] + static_cast<int64_t>(pos[p].size());
  auto exc_pos = torch::empty({off[P]}, torch::dtype(torch::kInt32));
  auto exc_val = torch::empty({off[P]}, torch::dtype(torch::kFloat));
  for (int64_t p = 0; p < P; ++p) {
    std::copy(pos[p].begin(), pos[p].end(), exc_pos.data_ptr<int32_t>() + off[p]);
    std::copy(val[p].begin(), val[p].end(), exc_val.data_ptr<float>() + off[p]);
  }
  return {codes, tables, exc_off, exc_pos, exc_val};
}

#include "ops_quant.h"
