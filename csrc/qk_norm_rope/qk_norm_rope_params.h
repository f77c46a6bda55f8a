// Host-visible parameters and launcher of the fused QK-RMSNorm + RoPE kernel.
#pragma once

#include <cstdint>

#include "../cuda_compat.h"

namespace omni {
namespace qk_norm_rope {

constexpr int kVectorElements = 8;  // 16 bytes of fp16/bf16
constexpr int kMaxThreads = 1024;

struct Params {
  const void* q;
  const void* k;
  void* q_out;
  void* k_out;
  const void* q_weight;  // nullptr: no affine weight
  const void* k_weight;
  bool q_weight_fp32;  // otherwise the weight has the activations' dtype
  bool k_weight_fp32;
  const float* cos;  // [S, D] contiguous
  const float* sin;
  // Strides in elements; the heads of a token are packed (head stride == D, unit last stride).
  int64_t q_batch_stride, q_seq_stride;
  int64_t k_batch_stride, k_seq_stride;
  int64_t q_out_batch_stride, q_out_seq_stride;
  int64_t k_out_batch_stride, k_out_seq_stride;
  int seq_len;
  int heads_q;
  int heads_k;
  float eps;
};

// Launches one block per token; defined in qk_norm_rope_kernel.cuh and instantiated for
// __half and __nv_bfloat16. head_dim is 64, 128 or 256; `threads` is a multiple of the warp
// size, and with norm_across_heads it covers the longer row in one pass.
template <typename T>
void launch_qk_rmsnorm_rope(const Params& params, int64_t num_tokens, int head_dim,
                            bool interleaved, bool norm_across_heads, int threads,
                            cudaStream_t stream);

}  // namespace qk_norm_rope
}  // namespace omni
