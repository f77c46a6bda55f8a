// Quantization of Q, K and V for the Hopper quantized attention kernel (sage_sm90.cu), in CUDA:
// the bytes of omni_kernels/attention/quantized/reference.py's quantize_qkv_reference (but for
// k_mean's summation order), head_dim 128, key blocks of 128, from fp16/bf16 inputs read through
// [B, H, S, D] strides. Two launches behind one host call (no Python between them):
//
// 1. k_mean_kernel, one block a kv head: the mean of K's strided sample (reference.k_mean_stride:
//    every key below 1024 keys, else 342 to 1023 of them, ~512), summed in a fixed order
//    (deterministic). It reads no V.
// 2. qkv_codes_kernel, one 1-D grid: Q blocks of 64 rows (INT8 per token, and q . k_mean from the
//    unquantized q), then K/V blocks of 128 keys (K minus its mean to INT8 with one scale a
//    block; V to FP8 e4m3 with one scale a block, transposed to [D, Skv_pad] through shared
//    memory, keys optionally permuted in groups of 16 as sage_sm90.cu's P fragments need).
//    Every Q, K and V element is read once, here (K's sample also in 1.): a block's scales
//    need only that block.
//
// Every rounding matches the reference: correctly rounded divisions (127 / amax, 448 / amax,
// the scales, the mean), round half away from zero for INT8 (floor-based, immune to fma
// contraction), round to nearest even with saturation for FP8.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "sage_quant_params.h"

namespace omni {
namespace attention {
namespace {

constexpr int kD = 128;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kQRows = 64;       // query rows a Q block
constexpr int kKeys = 128;       // keys a K/V block (= the attention kernel's tile)
constexpr int kStagedRowBytes = kD + 4;  // V tile rows in shared memory, padded: no bank conflicts
constexpr int kMeanSamples = 512;        // reference.K_MEAN_SAMPLES
// reference.V_AMAX_FLOOR: a nonzero V block maximum is at least this (every V scale >= 2^-30)
constexpr float kVAmaxFloor = 448.0f * 0x1p-30f;
constexpr int kMeanBatch = 16;           // sample rows a warp loads before adding: loads in flight

__device__ __forceinline__ void load4(const __half* p, float (&v)[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
  v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
}

__device__ __forceinline__ void load4(const __nv_bfloat16* p, float (&v)[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// top / amax correctly rounded, 0 where amax is 0 (an all-zero group stays 0).
__device__ __forceinline__ float inverse_scale(float amax, float top) {
  return amax > 0.0f ? __fdiv_rn(top, amax) : 0.0f;
}

// x * (top / amax) for a group, as reference.scale_to_top: a group with amax < 2^-100 (where
// top / amax can overflow to inf) is first multiplied by 2^100, x and amax alike (exact).
struct TopScale {
  float boost;
  float inverse;
};
__device__ __forceinline__ TopScale top_scale(float amax, float top) {
  const float boost = amax < 0x1p-100f ? 0x1p100f : 1.0f;
  return TopScale{boost, inverse_scale(amax * boost, top)};
}
__device__ __forceinline__ float scale_to_top(float x, TopScale s) {
  return __fmul_rn(__fmul_rn(x, s.boost), s.inverse);
}

// x (|x| <= 127.5) to int8, nearest, ties away from zero; exact (floor and a subtraction).
__device__ __forceinline__ uint32_t round_half_away_byte(float x) {
  const float ax = fabsf(x);
  float n = floorf(ax);
  if (ax - n >= 0.5f) n += 1.0f;
  const int code = static_cast<int>(x < 0.0f ? -n : n);
  return static_cast<uint8_t>(static_cast<int8_t>(code));
}

__device__ __forceinline__ int kv_length(const SageQuantParams& p, int b) {
  return p.key_lengths == nullptr ? p.shape.seq_kv : min(max(p.key_lengths[b], 0), p.shape.seq_kv);
}

// k_mean of kv head blockIdx.x: the mean of keys 0, r, 2r, ... below kv_len with
// r = max(1, kv_len / 512) | 1 (reference.k_mean_stride). Warp w sums sample rows w, w + 8, ...;
// the warps' sums are then added in warp order: the same bits on every run.
template <typename T>
__global__ void __launch_bounds__(kThreads) k_mean_kernel(const SageQuantParams p) {
  __shared__ __align__(16) float ksum_shared[kWarps][kD];
  const int bh = blockIdx.x;  // b * Hkv + h
  const int b = bh / p.shape.kv_heads, h = bh % p.shape.kv_heads;
  const int kv_len = kv_length(p, b);
  const int stride = max(1, kv_len / kMeanSamples) | 1;
  const int count = (kv_len + stride - 1) / stride;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* k_head = static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh + 4 * lane;
  float ksum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int first = warp; first < count; first += kWarps * kMeanBatch) {
    // all of a batch's loads before its adds: ~1000 rows over 8 warps is latency-bound otherwise
    float x[kMeanBatch][4];
#pragma unroll
    for (int i = 0; i < kMeanBatch; ++i) {
      const int s = first + kWarps * i;
      if (s < count) {
        load4(k_head + static_cast<int64_t>(s) * stride * p.k_ss, x[i]);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) x[i][j] = 0.0f;
      }
    }
#pragma unroll
    for (int i = 0; i < kMeanBatch; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) ksum[j] += x[i][j];
    }
  }
  *reinterpret_cast<float4*>(&ksum_shared[warp][4 * lane]) =
      make_float4(ksum[0], ksum[1], ksum[2], ksum[3]);
  __syncthreads();
  if (threadIdx.x < kD) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += ksum_shared[w][threadIdx.x];
    p.k_mean[static_cast<int64_t>(bh) * kD + threadIdx.x] =
        __fdiv_rn(s, static_cast<float>(max(count, 1)));
  }
}

// Q rows [blk * 64, +64) of query head bh: INT8 per token, its scale, and q . k_mean.
template <typename T>
__device__ void quantize_q_block(const SageQuantParams& p, int blk, int bh) {
  const int b = bh / p.shape.heads, h = bh % p.shape.heads;
  const int kv_bh = b * p.shape.kv_heads + h / (p.shape.heads / p.shape.kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* q_head = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh + 4 * lane;
  const float* k_mean = p.k_mean + static_cast<int64_t>(kv_bh) * kD + 4 * lane;
  const float4 km = *reinterpret_cast<const float4*>(k_mean);
  for (int r = warp; r < kQRows; r += kWarps) {
    const int row = blk * kQRows + r;
    if (row >= p.shape.seq_q) break;
    float x[4];
    load4(q_head + row * p.q_ss, x);
    const float amax = warp_max(fmaxf(fmaxf(fabsf(x[0]), fabsf(x[1])), fmaxf(fabsf(x[2]), fabsf(x[3]))));
    const TopScale to_top = top_scale(amax, 127.0f);
    uint32_t word = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) word |= round_half_away_byte(scale_to_top(x[i], to_top)) << (8 * i);
    const int64_t out_row = static_cast<int64_t>(bh) * p.shape.seq_q + row;
    reinterpret_cast<uint32_t*>(p.q_int8 + out_row * kD)[lane] = word;
    const float dot = warp_sum(x[0] * km.x + x[1] * km.y + x[2] * km.z + x[3] * km.w);
    if (lane == 0) {
      p.q_scale[out_row] = __fdiv_rn(amax, 127.0f);
      p.q_kmean[out_row] = dot;
    }
  }
}

// Keys [blk * 128, +128) of kv head bh: K smoothed to INT8 (one scale), V^T to FP8 (one scale);
// each K and V row is loaded once. reduce_shared: 2 * kWarps floats.
template <typename T>
__device__ void quantize_kv_block(const SageQuantParams& p, int blk, int bh, uint8_t* v_staged,
                                  float* reduce_shared) {
  const int b = bh / p.shape.kv_heads, h = bh % p.shape.kv_heads;
  const int kv_len = kv_length(p, b);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int nblk = p.shape.seq_kv_pad / kKeys;
  const float4 km = *reinterpret_cast<const float4*>(p.k_mean + static_cast<int64_t>(bh) * kD + 4 * lane);
  const float kmean[4] = {km.x, km.y, km.z, km.w};
  const T* k_head = static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh + 4 * lane;
  const T* v_head = static_cast<const T*>(p.v) + b * p.v_sb + h * p.v_sh + 4 * lane;
  constexpr int kRowsPerWarp = kKeys / kWarps;

  // ---- K: subtract the mean (padding keys stay 0), one INT8 scale for the block
  float kc[kRowsPerWarp][4];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int key = blk * kKeys + warp + kWarps * i;
    if (key < kv_len) {
      float x[4];
      load4(k_head + key * p.k_ss, x);
#pragma unroll
      for (int j = 0; j < 4; ++j) kc[i][j] = x[j] - kmean[j];
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) kc[i][j] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) amax = fmaxf(amax, fabsf(kc[i][j]));
  }
  amax = warp_max(amax);
  if (lane == 0) reduce_shared[warp] = amax;
  __syncthreads();
  amax = reduce_shared[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) amax = fmaxf(amax, reduce_shared[w]);
  const TopScale to_top = top_scale(amax, 127.0f);
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int key = blk * kKeys + warp + kWarps * i;
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) word |= round_half_away_byte(scale_to_top(kc[i][j], to_top)) << (8 * j);
    reinterpret_cast<uint32_t*>(p.k_int8 + (static_cast<int64_t>(bh) * p.shape.seq_kv_pad + key) * kD)[lane] = word;
  }
  if (threadIdx.x == 0) p.k_scale[static_cast<int64_t>(bh) * nblk + blk] = __fdiv_rn(amax, 127.0f);

  // ---- V: the block's rows in registers (K's are dead by now), one FP8 scale from their
  // maximum (padding keys: +0, outside it), staged as [key][d] bytes, written as [d][key]
  float vr[kRowsPerWarp][4];
  float vmax = 0.0f;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int key = blk * kKeys + warp + kWarps * i;
    if (key < kv_len) {
      load4(v_head + key * p.v_ss, vr[i]);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) vr[i][j] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) vmax = fmaxf(vmax, fabsf(vr[i][j]));
  }
  vmax = warp_max(vmax);
  // K's slots may still be read by a slower warp: V takes the next kWarps
  if (lane == 0) reduce_shared[kWarps + warp] = vmax;
  __syncthreads();
  vmax = reduce_shared[kWarps];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) vmax = fmaxf(vmax, reduce_shared[kWarps + w]);
  if (vmax > 0.0f) vmax = fmaxf(vmax, kVAmaxFloor);
  const TopScale v_to_top = top_scale(vmax, 448.0f);
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp + kWarps * i;
    // padding rows are +0: +0 * boost * inverse is +0, byte 0x00
    float y[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) y[j] = fminf(fmaxf(scale_to_top(vr[i][j], v_to_top), -448.0f), 448.0f);
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(y[0], y[1]), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(y[2], y[3]), __NV_SATFINITE, __NV_E4M3);
    reinterpret_cast<uint32_t*>(v_staged + r * kStagedRowBytes)[lane] = lo | (hi << 16);
  }
  if (threadIdx.x == 0) p.v_scale[static_cast<int64_t>(bh) * nblk + blk] = __fdiv_rn(vmax, 448.0f);
  __syncthreads();
  // 128 rows of V^T (channel d) x 8 groups of 16 keys; consecutive threads take consecutive d
  // (the staged bytes of one key then sit in distinct banks).
  uint8_t* vt_block = p.v_fp8 + static_cast<int64_t>(bh) * kD * p.shape.seq_kv_pad + blk * kKeys;
  for (int task = threadIdx.x; task < kD * (kKeys / 16); task += kThreads) {
    const int d = task % kD, group = task / kD;
    uint32_t words[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      // column 4t + i of a group holds key 2t + i % 2 + 8 (i / 2) when permuted
      const int within = p.permute_v ? 2 * (c / 4) + (c % 2) + 8 * ((c % 4) / 2) : c;
      const uint32_t byte = v_staged[(16 * group + within) * kStagedRowBytes + d];
      words[c / 4] |= byte << (8 * (c % 4));
    }
    *reinterpret_cast<uint4*>(vt_block + static_cast<int64_t>(d) * p.shape.seq_kv_pad + 16 * group) =
        make_uint4(words[0], words[1], words[2], words[3]);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) qkv_codes_kernel(const SageQuantParams p) {
  __shared__ __align__(16) uint8_t v_staged[kKeys * kStagedRowBytes];
  __shared__ float reduce_shared[2 * kWarps];
  const int64_t pid = blockIdx.x;
  const int q_blocks = (p.shape.seq_q + kQRows - 1) / kQRows;
  const int64_t q_programs = static_cast<int64_t>(q_blocks) * p.shape.batch * p.shape.heads;
  if (pid < q_programs) {
    quantize_q_block<T>(p, static_cast<int>(pid % q_blocks), static_cast<int>(pid / q_blocks));
  } else {
    const int k_blocks = p.shape.seq_kv_pad / kKeys;
    const int64_t kv_pid = pid - q_programs;
    quantize_kv_block<T>(p, static_cast<int>(kv_pid % k_blocks), static_cast<int>(kv_pid / k_blocks),
                         v_staged, reduce_shared);
  }
}

template <typename T>
cudaError_t launch_typed(const SageQuantParams& p, cudaStream_t stream) {
  const int64_t kv_bh = static_cast<int64_t>(p.shape.batch) * p.shape.kv_heads;
  if (kv_bh > 0) k_mean_kernel<T><<<static_cast<unsigned>(kv_bh), kThreads, 0, stream>>>(p);
  const int64_t q_blocks = (p.shape.seq_q + kQRows - 1) / kQRows;
  const int64_t programs = q_blocks * p.shape.batch * p.shape.heads +
                           static_cast<int64_t>(p.shape.seq_kv_pad / kKeys) * p.shape.batch * p.shape.kv_heads;
  if (programs > 0) {
    qkv_codes_kernel<T><<<static_cast<unsigned>(programs), kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_sage_quantize(const SageQuantParams& params, bool bfloat16, cudaStream_t stream) {
  return bfloat16 ? launch_typed<__nv_bfloat16>(params, stream) : launch_typed<__half>(params, stream);
}

}  // namespace attention
}  // namespace omni
