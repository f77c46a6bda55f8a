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
  const float* v_scale;     // [B, Hkv, 128]
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
  // float32 (unnormalized P V, running max, row sum); counters: int32 [blocks - split_first],
  // zeroed. splits == 1: no split (both nullptr).
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

// Which query blocks to split, for a grid of `blocks` CTAs of 128 query rows over
// `kv_blocks` key blocks on `sms` SMs (one CTA an SM). The last wave's `tail` blocks would
// leave the other SMs idle; cut into f parts they take ceil(tail * f / sms) / f of a wave
// instead of one. f is the smallest with the least time, each part at least
// kSageMinSplitBlocks key blocks; `requested` > 0 forces f (1: never split).
// Flux 1024^2 (864 blocks, 36 key blocks) on 132 SMs: tail 72, f = 3, 2/3 of a wave.
inline SageSplitPlan sage_split_plan(int64_t blocks, int64_t kv_blocks, int64_t sms,
                                     int64_t requested) {
  const int64_t tail = blocks % sms == 0 ? 0 : blocks % sms;
  const int64_t most = kv_blocks / kSageMinSplitBlocks;
  int64_t best = 1;
  if (requested > 0) {
    best = requested;
  } else if (tail > 0) {
    double best_time = 1.0;
    for (int64_t f = 2; f <= kSageMaxSplits && f <= most; ++f) {
      const double time = static_cast<double>((tail * f + sms - 1) / sms) / static_cast<double>(f);
      if (time < best_time - 1e-9) {
        best_time = time;
        best = f;
      }
    }
  }
  if (best <= 1 || tail == 0) return SageSplitPlan{static_cast<int>(blocks), 1};
  return SageSplitPlan{static_cast<int>(blocks - tail), static_cast<int>(best)};
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
// without sm_90a code gives cudaErrorNoKernelImageForDevice).
cudaError_t launch_sage_attention_sm90(const SageSm90Params& params, SageOutKind out_kind,
                                       cudaStream_t stream);

}  // namespace attention
}  // namespace omni
