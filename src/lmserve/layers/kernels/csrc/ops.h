// lmserve's native CPU ops as tensors: torch's side of each kernel (kernels.h). Included by bindings.cpp only, the
// one unit that includes torch's headers: each op checks its tensors (device, dtype, shape, contiguity), allocates
// its outputs with torch and calls the kernel on raw rows; the kernel units never see a tensor.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

// Only the torch headers the ops use, not torch/extension.h: that one brings the whole C++ frontend (torch/all.h)
// and every ATen op's declaration, and compiling this unit took 46 s of each level's build instead of 28 (2-core
// Zen 3, -O3). Tensors add with .add(): operator+ lives in ATen/TensorOperators.h, which includes ATen/Functions.h.
// torch/types.h's names for the dtypes used here:
namespace torch {
using namespace at;
constexpr auto kUInt8 = at::kByte;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kInt8 = at::kChar;
constexpr auto kFloat32 = at::kFloat;
constexpr auto kFloat16 = at::kHalf;
}  // namespace torch

#include <string>
#include <vector>

#include "kernels.h"

namespace lmserve {
// A number for a TORCH_CHECK message. The message is built with std::ostringstream, and an integer streamed there
// crashed the process (SIGSEGV in the stream's number formatting, inside this extension) on a CUDA host whose
// CXX (/opt/gcc/bin/g++) is not the GCC of the libstdc++ the process loads (torch 2.11): a refusal that should
// be a RuntimeError killed the server. std::to_string formats without the stream's locale; the stream then only
// appends text.
inline std::string num(int64_t v) { return std::to_string(v); }

inline void check_float_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat, name, ": float32 CPU tensors only");
}

inline KvType kv_type_of(c10::ScalarType type) {
  switch (type) {
    case torch::kFloat: return KvType::kFloat;
    case torch::kHalf: return KvType::kHalf;
    case torch::kChar: return KvType::kInt8;
    case torch::kFloat8_e4m3fn: return KvType::kFp8;
    default: TORCH_CHECK(false, "KV cache: float32, float16, int8 or float8_e4m3fn elements, got ", type);
  }
}

// float32 / bfloat16 / float16 weights (skinny panels, LoRA slots) as the kernels' element type; callers check the
// dtype first
inline PanelType panel_type_of(c10::ScalarType type) {
  return type == torch::kBFloat16 ? PanelType::kBFloat16 : type == torch::kHalf ? PanelType::kHalf : PanelType::kFloat;
}

// [M, ldy] computed over whole panels -> the caller's [M, out_features], then + bias
inline torch::Tensor narrow_add(torch::Tensor y, int64_t out_features, const c10::optional<torch::Tensor>& bias) {
  auto out = out_features == y.size(1) ? y : y.narrow(1, 0, out_features);
  return bias.has_value() ? out.add(*bias) : out;
}
}  // namespace lmserve

#include "ops_attention.h"
#include "ops_matmul.h"
#include "ops_rows.h"
