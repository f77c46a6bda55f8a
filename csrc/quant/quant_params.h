// Host-visible parameters and launcher of the per-token quantization kernel.
#pragma once

#include <cstdint>

#include "../cuda_compat.h"

namespace omni {
namespace quant {

constexpr int kVectorElements = 8;  // 16 bytes of fp16/bf16 in, 8 bytes of fp8/int8 out
constexpr int kMaxThreads = 512;
constexpr int kMaxVectorsPerThread = 8;
// Longest row the kernel keeps in registers: 8 vectors of 8 values for each of 512 threads.
constexpr int64_t kMaxRowElements =
    static_cast<int64_t>(kMaxThreads) * kMaxVectorsPerThread * kVectorElements;
// Rows whose absolute maximum is below this are scaled as if it were this
// (omni_kernels/quant/reference.py: MIN_ABSMAX).
constexpr float kMinAbsmax = 1e-12f;

// The shared-memory-staged kernel (quant_staged_kernel.cuh, no norm): at most this many threads a
// block, and rows of at most kStagedMaxRowBytes 16-bit values' bytes (the default 48 KB of dynamic
// shared memory a block, no opt-in attribute needed). Longer rows take the register kernel.
constexpr int kStagedMaxThreads = 256;
constexpr int64_t kStagedMaxRowBytes = 48 * 1024;

enum class NormKind : int { kNone = 0, kRms = 1, kLayer = 2 };
enum class OutKind : int { kFp8E4m3 = 0, kInt8 = 1 };

struct Params {
  const void* x;            // [M, K], unit column stride
  void* q;                  // [M, K] contiguous, fp8 e4m3 or int8
  float* scale;             // [M]
  const void* norm_weight;  // [K] or nullptr
  const void* norm_bias;    // [K] or nullptr
  const void* mod_scale;    // [G, K] contiguous or nullptr: y * (1 + mod_scale[g])
  const void* mod_shift;    // [G, K] contiguous or nullptr: + mod_shift[g]
  bool norm_weight_fp32;    // each of these: float32, otherwise the dtype of x
  bool norm_bias_fp32;
  bool mod_scale_fp32;
  bool mod_shift_fp32;
  // Optional prefix [M, prefix_vectors * 8] (unit column stride) read before x: the row is then
  // cat(prefix, x), without the cat materialized (Flux's single blocks' proj_out input).
  const void* prefix;       // nullptr: none
  int64_t prefix_row_stride;  // elements
  int prefix_vectors;       // prefix columns / kVectorElements (0 without a prefix)
  // GELU (tanh approximation) applied to the row's columns >= gelu_from (columns of the row
  // cat(prefix, x)); only with NormKind::kNone and the kernel's kGelu instantiation.
  int gelu_from;
  int64_t x_row_stride;     // elements
  int64_t rows_per_group;   // M / G: row r uses modulation row r / rows_per_group
  int row_vectors;          // (prefix columns + K) / kVectorElements: the row's vectors
  int cols;                 // prefix columns + K: the row's width (q's columns)
  float eps;
  float clamp;              // <= 0: no clamp
};

// One block of `threads` threads per row; each thread owns `vectors_per_thread` (1, 2, 4 or 8)
// 16-byte vectors of the row. Defined in quant_kernel.cuh, instantiated for __half and
// __nv_bfloat16 in quant_{fp16,bf16}.cu.
template <typename T>
void launch_quantize_per_token(const Params& params, int64_t rows, NormKind norm, OutKind out,
                               int vectors_per_thread, int threads, cudaStream_t stream);

// The same kernel without a norm, with the GELU on columns >= params.gelu_from (and the optional
// prefix): per-token quantization of an activation's output, the activation fused in.
template <typename T>
void launch_quantize_activated(const Params& params, int64_t rows, OutKind out,
                               int vectors_per_thread, int threads, cudaStream_t stream);

// Per-token quantization without a norm or modulation (plain, or with the GELU on columns >=
// params.gelu_from when `gelu`), the row staged in shared memory: one block of `threads`
// threads (a multiple of the warp size, at most kStagedMaxThreads) per row. Defined in
// quant_staged_kernel.cuh, instantiated in quant_staged_{fp16,bf16}.cu.
template <typename T>
void launch_quantize_staged(const Params& params, int64_t rows, OutKind out, bool gelu,
                            int threads, cudaStream_t stream);

}  // namespace quant
}  // namespace omni
