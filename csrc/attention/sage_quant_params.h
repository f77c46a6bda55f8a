// Host-visible parameters and launcher of the CUDA Q/K/V quantization for the Hopper quantized
// attention kernel (sage_quant.cu). head_dim 128, key blocks of 128.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "sage_sm90_params.h"

namespace omni {
namespace attention {

struct SageQuantParams {
  // Inputs read as [B, H, S, 128] through these strides (elements; the last dimension is
  // contiguous, every stride a multiple of 4 and the base 8-byte aligned).
  const void* q;
  const void* k;
  const void* v;
  int64_t q_sb, q_sh, q_ss;
  int64_t k_sb, k_sh, k_ss;
  int64_t v_sb, v_sh, v_ss;
  const int32_t* key_lengths;  // [B] or nullptr: keys >= key_lengths[b] are padding
  SageShape shape;
  bool permute_v;  // V^T's keys in groups of 16 permuted for sage_sm90.cu
  // Outputs (contiguous): QuantizedQKV's tensors. k_mean is written by the first launch and
  // read by the second.
  int8_t* q_int8;    // [B, Hq, Sq, 128]
  float* q_scale;    // [B, Hq, Sq]
  float* q_kmean;    // [B, Hq, Sq]
  int8_t* k_int8;    // [B, Hkv, Skv_pad, 128]
  float* k_scale;    // [B, Hkv, Skv_pad / 128]
  float* k_mean;     // [B, Hkv, 128]: mean of K's strided sample
  uint8_t* v_fp8;    // [B, Hkv, 128, Skv_pad] (float8_e4m3fn bytes)
  float* v_scale;    // [B, Hkv, Skv_pad / 128]: one per key block
};

cudaError_t launch_sage_quantize(const SageQuantParams& params, bool bfloat16, cudaStream_t stream);

}  // namespace attention
}  // namespace omni
