// LoRA deltas for rows that carry an adapter slot (lora_delta.cpp), as the binding unit and decode_stack.h call them.
#pragma once

#include <cstdint>

#include "kernels.h"  // PanelType: the slot weights' element type

namespace lmserve {

// y[t, off_i + o] += sum_k (x[t] . A[s, k, i]) * B_i[s, k, o] for every row t with slot s = slots[t] >= 0, every
// slice i (offsets: the slices stacked in y's columns, in order), k < rank. A: [*, max_rank, n, in];
// B_i: [*, max_rank, out_i]; rows of x / y are x_stride / y_stride apart. Each row is summed in a fixed order that
// depends only on the shapes of A and B, never on the other rows (batch invariance). A and every B_i hold `type`'s
// elements (float32, float16 or bfloat16), widened exactly to float32 where they are read; x, y and the sums are float32.
void lora_delta_rows(const float* x, int64_t x_stride, float* y, int64_t y_stride, const int64_t* slots, int64_t T,
                     const void* a, PanelType type, int64_t max_rank, int64_t n, int64_t in, const void* const* b,
                     const int64_t* out_sizes, int64_t rank);

}  // namespace lmserve
