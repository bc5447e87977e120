// lmserve's native CPU ops: declarations shared by the sources and the Python bindings (bindings.cpp).
#pragma once

#include <torch/extension.h>

#include <string>

namespace lmserve {
// A number for a TORCH_CHECK message. The message is built with std::ostringstream, and an integer streamed there
// crashed the process (SIGSEGV in the stream's number formatting, inside this extension) on a CUDA host whose
// CXX (/opt/gcc/bin/g++) is not the GCC of the libstdc++ the process loads (torch 2.11): a refusal that should
// be a RuntimeError killed the server. std::to_string formats without the stream's locale; the stream then only
// appends text.
inline std::string num(int64_t v) { return std::to_string(v); }
}  // namespace lmserve

// paged_decode_attention.cpp
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     c10::optional<torch::Tensor> table_rows, int64_t window, double softcap);
// this step's K/V rows into their cache slots, in the cache's format (kv_cache.h: float32, float16, or quantized
// with a float16 scale per 32 values); k, v: T rows of Hkv * D floats, k_stride and v_stride apart (views into a
// qkv output, or normed K rows)
void write_kv_rows(const torch::Tensor& cache, const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                   const int64_t* slots, int64_t T, int64_t Hkv, int64_t D);
void write_kv(torch::Tensor cache, torch::Tensor k, torch::Tensor v, torch::Tensor slot_mapping);

// fused_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up);
std::vector<torch::Tensor> argmax_logprob(torch::Tensor logits);
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);

// gemv.cpp
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor panels, int64_t out_features,
                            c10::optional<torch::Tensor> bias);
torch::Tensor skinny_linear_experts(torch::Tensor x, torch::Tensor offsets, torch::Tensor panels, int64_t out_features);

// coded_half.cpp: a bfloat16 matrix in 12 bits a weight (layers/half_linear.py codes it), float32 math
torch::Tensor coded_half_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor tables, torch::Tensor exc_off,
                                torch::Tensor exc_pos, torch::Tensor exc_val, int64_t out_features,
                                c10::optional<torch::Tensor> bias);
torch::Tensor coded_half_rows(torch::Tensor ids, torch::Tensor codes, torch::Tensor tables, torch::Tensor exc_off,
                              torch::Tensor exc_pos, torch::Tensor exc_val, int64_t K);
std::vector<torch::Tensor> code_half_panels(torch::Tensor panels);

// quant_gemm.cpp
torch::Tensor quantize_activations(torch::Tensor x);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> mins,
                           int64_t kind, c10::optional<torch::Tensor> bias);
int64_t quant_packed_rows();
torch::Tensor quant_linear_experts(torch::Tensor x, torch::Tensor offsets, torch::Tensor codes, torch::Tensor scales,
                                   c10::optional<torch::Tensor> mins, int64_t kind);

// decode_stack.cpp: the DecodeStack class (every decoder layer of a decode step in one call)
void bind_decode_stack(pybind11::module& m);
