// LoRA deltas on torch's side (checks, then lora_delta.cpp's rows): included by bindings.cpp through decode_stack.h,
// the one unit that includes torch.
#pragma once

#include "lora_delta.h"
#include "ops.h"

#include <vector>

// y [T, out] += each adapter row's delta (lora_delta.h): x [T, in] float32 rows, slots [T] int64 (-1: base row, left
// as it is), a [max_loras, max_rank, n, in], bs: n tensors [max_loras, max_rank, out_i] with sum(out_i) = out; a and
// bs in one dtype, float32, float16 or bfloat16 (--lora-dtype).
// Returns y (changed in place).
inline torch::Tensor lora_delta_(torch::Tensor y, const torch::Tensor& x, const torch::Tensor& slots,
                                 const torch::Tensor& a, const std::vector<torch::Tensor>& bs, int64_t rank) {
  lmserve::check_float_cpu(y, "lora_delta_: y");
  lmserve::check_float_cpu(x, "lora_delta_: x");
  const auto wt = a.scalar_type();
  TORCH_CHECK(a.device().is_cpu() && (wt == torch::kFloat || wt == torch::kHalf || wt == torch::kBFloat16),
              "lora_delta_: a: float32, float16 or bfloat16 CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 && y.stride(1) == 1,
              "lora_delta_: x [T, in] and y [T, out] with contiguous rows");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.dim() == 1 && slots.size(0) == x.size(0) &&
              slots.is_contiguous() && slots.device().is_cpu(), "lora_delta_: slots [T] int64 on the CPU");
  TORCH_CHECK(a.dim() == 4 && a.is_contiguous() && a.size(2) == static_cast<int64_t>(bs.size()) &&
              a.size(3) == x.size(1), "lora_delta_: a [max_loras, max_rank, n, in] (contiguous), one b per slice");
  const int64_t loras = a.size(0), max_rank = a.size(1);
  std::vector<const void*> b_rows;
  std::vector<int64_t> out_sizes;
  int64_t total = 0;
  for (const torch::Tensor& b : bs) {
    TORCH_CHECK(b.device().is_cpu() && b.scalar_type() == wt, "lora_delta_: each b on the CPU in a's dtype");
    TORCH_CHECK(b.dim() == 3 && b.is_contiguous() && b.size(0) == loras && b.size(1) == max_rank,
                "lora_delta_: each b [max_loras, max_rank, out_i] (contiguous)");
    b_rows.push_back(b.data_ptr());
    out_sizes.push_back(b.size(2));
    total += b.size(2);
  }
  TORCH_CHECK(total == y.size(1), "lora_delta_: the slices' widths add up to y's");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.size(0); ++t)
    TORCH_CHECK(s[t] < loras, "lora_delta_: slot ", lmserve::num(s[t]), " of ", lmserve::num(loras));
  lmserve::lora_delta_rows(x.data_ptr<float>(), x.stride(0), y.data_ptr<float>(), y.stride(0), s, x.size(0),
                           a.data_ptr(), lmserve::panel_type_of(wt), max_rank, a.size(2), a.size(3), b_rows.data(), out_sizes.data(), rank);
  return y;
}
