// Host-visible parameters and launcher of the Hopper (sm_90a) quantized attention kernel:
// INT8 Q K^T and FP8 e4m3 P V with wgmma, inputs quantized by
// omni_kernels/attention/quantized/quantize.py (the math: .../quantized/reference.py).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace omni {
namespace attention {

constexpr int kSageHeadDim = 128;
constexpr int kSageBlockN = 128;  // keys a tile; also the K-scale block of the quantizer
// V^T's keys are stored permuted within each group of 16 (see sage_sm90.cu, "P as an A operand").
constexpr int kSageVKeyGroup = 16;

// Problem sizes shared by the quantization and attention kernels.
struct SageShape {
  int batch;
  int heads;
  int kv_heads;
  int seq_q;
  int seq_kv;      // true key count; keys >= seq_kv are padding
  int seq_kv_pad;  // a multiple of 128
};

struct SageSm90Params {
  // Quantized inputs, contiguous (QuantizedQKV): q_int8 [B, Hq, Sq, 128], k_int8
  // [B, Hkv, Skv_pad, 128], v_fp8 [B, Hkv, 128, Skv_pad] (keys permuted in groups of 16).
  const void* q_int8;
  const void* k_int8;
  const void* v_fp8;
  const float* q_scale;     // [B, Hq, Sq]
  const float* k_scale;     // [B, Hkv, Skv_pad / 128]
  const float* v_scale;     // [B, Hkv, Skv_pad / 128]: one scale a key block (0: V's block is 0)
  const float* q_kmean;     // [B, Hq, Sq]: q . k_mean, read for the LSE only
  const int32_t* key_lengths;  // [B] or nullptr
  void* out;                // [B, Hq, Sq, 128] through the strides below (elements), unit last
  int64_t out_stride_b;
  int64_t out_stride_h;
  int64_t out_stride_s;
  float* lse;               // [B, Hq, Sq] contiguous, or nullptr
  SageShape shape;
  float scale;              // softmax scale (natural log domain)
  float qk_scale;           // scale * log2(e)
  // The last wave's split (sage_split_plan): query blocks from `split_first` on (linear index
  // (b * Hq + h) * ceil(Sq / 128) + m) are cut into `splits` key ranges, one CTA each, merged by
  // the last to finish. partials: [(blocks - split_first) * splits, 128 rows, kSagePartialStride]
  // float32 (unnormalized P V in V's real units, running max, row sum); counters: int32
  // [blocks - split_first], zeroed. splits == 1: no split (both nullptr).
  int split_first;
  int splits;
  float* partials;
  int32_t* counters;
};

constexpr int kSagePartialStride = 132;  // 128 accumulator columns, max, sum, 2 of padding
constexpr int kSageMaxSplits = 8;
constexpr int kSageMinSplitBlocks = 4;  // key blocks a split part gets at least

struct SageSplitPlan {
  int split_first;
  int splits;
};

// Which query blocks to split, for a grid of `blocks` CTAs of 128 query rows over `kv_blocks`
// key blocks on `sms` SMs (one CTA an SM). The last wave's `tail` blocks leave the other SMs
// idle; cut into f parts, all in one wave (tail * f <= sms), they take 1/f of the wave plus each
// part's fixed cost (Q, the pipeline's start, the partial's store and merge: ~0.2 of a 36-block
// CTA). f is the most that fit, at most kSageMaxSplits and kv_blocks / kSageMinSplitBlocks;
// `requested` > 0 forces f (1: never split). A tail that fits no 2 parts per SM stays whole
// (splitting Flux 1024^2's, 72 of 132 SMs, was slower).
inline SageSplitPlan sage_split_plan(int64_t blocks, int64_t kv_blocks, int64_t sms,
                                     int64_t requested) {
  const int64_t tail = blocks % sms;
  int64_t f = requested;
  if (requested <= 0) {
    f = tail > 0 ? sms / tail : 1;
    const int64_t most = kv_blocks / kSageMinSplitBlocks;
    if (f > most) f = most;
    if (f > kSageMaxSplits) f = kSageMaxSplits;
  }
  if (f <= 1 || tail == 0) return SageSplitPlan{static_cast<int>(blocks), 1};
  return SageSplitPlan{static_cast<int>(blocks - tail), static_cast<int>(f)};
}

inline SageShape make_sage_shape(int64_t batch, int64_t heads, int64_t kv_heads, int64_t seq_q,
                                 int64_t seq_kv, int64_t seq_kv_pad) {
  // The callers check that every product of these stays below 2**31.
  return SageShape{static_cast<int>(batch), static_cast<int>(heads), static_cast<int>(kv_heads),
                   static_cast<int>(seq_q), static_cast<int>(seq_kv),
                   static_cast<int>(seq_kv_pad)};
}

enum class SageOutKind : int { kBFloat16 = 0, kFloat16 = 1 };

// Launches the kernel on `stream`; returns cudaSuccess or the first CUDA error (a build
// without sm_90a code gives cudaErrorNoKernelImageForDevice). programmatic_launch: the first
// launch is a programmatic dependent (PDL) of the stream's previous kernel (see sage_sm90.cu).
cudaError_t launch_sage_attention_sm90(const SageSm90Params& params, SageOutKind out_kind,
                                       cudaStream_t stream, bool programmatic_launch);

}  // namespace attention
}  // namespace omni
