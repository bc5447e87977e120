// The native CPU kernels as the binding unit calls them: raw pointers and sizes, plain C++ types only.
//
// Why: the kernel units used to include torch/extension.h for at::Tensor, TORCH_CHECK and at::get_num_threads,
// and parsing it was most of each unit's compile time (~60 s of g++ per unit on 2 cores, 7 units, once per
// instruction-set level). Now only bindings.cpp includes torch (and only the headers it uses, ops.h): it checks each tensor's dtype, shape and
// contiguity, allocates the outputs and calls these on contiguous rows (ops.h). The kernel units include only
// c10's header-only number types (c10/util/Half.h and the like) for conversions that must equal torch's bit for bit.
// A kernel trusts its caller's checks; the numbers are those the kernels computed when they took tensors.
#pragma once

#include <cstdint>
#include <vector>

namespace lmserve {

// torch's intra-op thread count (at::get_num_threads): the pool's default width (thread_pool.h); in bindings.cpp
int torch_threads();

// paged_decode_attention.cpp
enum class KvType { kFloat, kHalf, kInt8, kFp8 };  // a KV cache's elements (kv_cache.h's formats)
constexpr int64_t kMaxGroupHeads = 16;              // query heads per kv head the attention handles
int64_t kv_row_width(KvType type, int64_t D);       // elements of one (slot, kv head) row: D, or D + D / 16
// q [B, H, D], caches [blocks, block_size, Hkv, W], block_tables [*, mb], context_lens [B], rows [B] or null (row b
// reads block_tables[rows[b]]) -> out [B, H, D]; D is 64, 128 or 256
void paged_attention(KvType type, const float* q, const void* k_cache, const void* v_cache,
                     const int64_t* block_tables, const int64_t* context_lens, const int64_t* rows, float* out,
                     int64_t B, int64_t H, int64_t D, int64_t block_size, int64_t Hkv, int64_t mb, float scale,
                     int64_t window, float softcap);
// T tokens' K and V rows (Hkv * D floats each, k_stride / v_stride apart) into slots (each < num_slots) of a
// [2, num_slots, Hkv, W] cache, in its format
void write_kv_slots(KvType type, void* cache, int64_t num_slots, const float* k, int64_t k_stride, const float* v,
                    int64_t v_stride, const int64_t* slots, int64_t T, int64_t Hkv, int64_t D);

// encoder_attention.cpp: qkv [T, 3, H, D] of B whole sequences (sequence b: tokens starts[b] .. starts[b + 1]) ->
// out [T, H, D], each query over its own sequence's keys (window >= 0: only those at most `window` positions away)
void encoder_attention(const float* qkv, const int64_t* starts, int64_t B, int64_t H, int64_t D, float scale,
                       int64_t window, float* out);

// fused_ops.cpp: T rows of D (or of 2I = [gate | up])
// out = w * rms_norm(x); with a residual: residual += x first, then out = w * rms_norm(residual)
void rms_norm_rows(const float* x, float* residual, const float* w, float* out, int64_t T, int64_t D, float eps);
// out = (x - mean) / sqrt(var + eps) * w + b, LayerNorm (w, b: null for none)
void layer_norm_rows(const float* x, const float* w, const float* b, float* out, int64_t T, int64_t D, float eps);
void silu_and_mul_rows(const float* gate_up, float* out, int64_t T, int64_t I);
void gelu_tanh_and_mul_rows(const float* gate_up, float* out, int64_t T, int64_t I);
void argmax_logprob_rows(const float* logits, int64_t B, int64_t V, int64_t* ids, float* logprobs);
// x: T rows (row_stride apart) of H contiguous heads of D, rotated in place by cos / sin [T, D]
void rotary_rows(float* x, int64_t row_stride, const float* cos, const float* sin, int64_t T, int64_t H, int64_t D);

// gemv.cpp: y [M, P * 16] = x [M, K] times panels [P, K, 16]
constexpr int64_t kPanelWidth = 16;
enum class PanelType { kFloat, kBFloat16, kHalf };
void skinny_matmul(const float* x, int64_t M, int64_t K, const void* panels, PanelType type, int64_t P, float* y);
// rows [offsets[e], offsets[e + 1]) of x [R, K] times expert e's float32 panels [E, P, K, 16] -> y [R, P * 16]
void skinny_experts_matmul(const float* x, int64_t K, const int64_t* offsets, int64_t E, const float* panels,
                           int64_t P, float* y);

// coded_half.cpp: a bfloat16 matrix in 12 bits a weight (layers/formats/half_linear.py)
constexpr int64_t kCodedGroupBytes = 96;  // bytes of codes per 4 weights of a panel's 16 columns
struct CodedHalf {
  const uint8_t* codes;    // [P, G, 96]
  const uint8_t* tables;   // [P, 16] high bytes
  const int64_t* exc_off;  // [P + 1] each panel's exceptions
  const int32_t* exc_pos;  // k * 16 + column
  const float* exc_val;
  int64_t K, G;            // G = ceil(K / 4)
};
void coded_half_matmul(const CodedHalf& w, const float* x, int64_t M, int64_t P, float* y);  // y [M, P * 16]
void coded_half_gather(const CodedHalf& w, const int64_t* ids, int64_t T, float* out);       // out [T, K]
// bfloat16 bits of panels [P, K, 16] -> codes (zeroed by the caller) and tables, and each panel's exceptions
void code_half(const uint16_t* panels, int64_t P, int64_t K, uint8_t* codes, uint8_t* tables,
               std::vector<std::vector<int32_t>>& pos, std::vector<std::vector<float>>& val);

// quant_gemm.cpp: GGUF-derived int codes (kind 0 U4, 1 U8, 2 S8, 3 NL4, 4 I4, 5 K2, 6 K3)
constexpr int64_t kQuantBlock = 32;   // activation quantization block
constexpr int64_t kQuantSuper = 256;  // K2/K3's weights per float scale
int64_t quant_packed_rows();          // output rows per group of the packed layout on this build (0: none)
int64_t quant_row_code_bytes(int64_t kind, int64_t K);
int64_t quant_row_scales(int64_t kind, int64_t K);
int64_t quant_packed_code_bytes(int64_t kind);              // per group and block of 32 inputs
int64_t quant_packed_scale_blocks(int64_t kind, int64_t K);  // per group
// x [M, K] -> xq rows of K + 8 * K / 32 bytes: codes, then per-32 scales and scale * sums as float32
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq);
// y [M, N] = x W^T (+ bias) from xq (rows xq_stride apart), W in rows [N] of codes, scales (and mins)
void quant_matmul(int64_t kind, const uint8_t* codes, const float* scales, const float* mins, const float* bias,
                  const int8_t* xq, int64_t xq_stride, int64_t M, int64_t K, int64_t N, float* y);
// the same over the packed layout, G groups of 16 rows (quant_packed_rows() != 0 only)
void quant_packed_matmul(int64_t kind, const uint8_t* codes, const float* scales, const float* mins,
                         const float* bias, const int8_t* xq, int64_t xq_stride, int64_t M, int64_t K, int64_t G,
                         float* y);
// rows [offsets[e], offsets[e + 1]) times expert e's packed matrix of G groups (kinds 0-2; packed builds only)
void quant_packed_experts(int64_t kind, const uint8_t* codes, const float* scales, const float* mins,
                          const int8_t* xq, int64_t xq_stride, const int64_t* offsets, int64_t E, int64_t K,
                          int64_t G, float* y);
// rows ids[0, n) of a packed table of kind 0-2 (an embedding lookup) as float32 [n, K]: code * scale (+ min)
void packed_table_rows(int64_t kind, const uint8_t* codes, const float* scales, const float* mins,
                       const int64_t* ids, int64_t n, int64_t K, float* out);

}  // namespace lmserve
