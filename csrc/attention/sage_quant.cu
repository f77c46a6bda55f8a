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
constexpr int kMeanThreads = 512;        // k_mean_kernel's block (one a kv head)
constexpr int kMeanBatch = 16;           // sample rows a warp loads before adding: loads in flight

// A thread's 4 values of a row: the raw 8 bytes (loaded first, so that many rows' loads are in
// flight before any math waits on one), then as floats.
template <typename T>
__device__ __forceinline__ uint2 load_raw4(const T* p) {
  return *reinterpret_cast<const uint2*>(p);
}

__device__ __forceinline__ void unpack4(uint2 raw, const __half*, float (&v)[4]) {
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
  v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
}

__device__ __forceinline__ void unpack4(uint2 raw, const __nv_bfloat16*, float (&v)[4]) {
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
}

// The largest |x| of a thread's 4 fp16/bf16 values, as the bits of one of them (sign cleared):
// for both formats the order of |x| is the order of these bits as unsigned integers (NaN bits
// rank above inf: a NaN in a block makes its maximum NaN, as torch's amax in the reference).
__device__ __forceinline__ uint32_t abs_max_bits(uint2 raw) {
  const uint32_t pair = __vmaxu2(raw.x & 0x7fff7fffu, raw.y & 0x7fff7fffu);
  return max(pair & 0xffffu, pair >> 16);
}

__device__ __forceinline__ float bits_to_float(uint32_t bits, const __half*) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

__device__ __forceinline__ float bits_to_float(uint32_t bits, const __nv_bfloat16*) {
  return __uint_as_float(bits << 16);
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
// r = max(1, kv_len / 512) | 1 (reference.k_mean_stride). Warp w sums sample rows w, w + 16, ...;
// the warps' sums are then added in warp order: the same bits on every run. One block a head
// (24 to 40 at DiT sizes): the launch takes a memory round trip a batch of 16 rows a warp and
// the attention waits on it, so 16 warps (a ~512-row sample in two batches).
template <typename T>
__global__ void __launch_bounds__(kMeanThreads, 1) k_mean_kernel(const SageQuantParams p) {
  constexpr int kMeanWarps = kMeanThreads / 32;
  __shared__ __align__(16) float ksum_shared[kMeanWarps][kD];
  const int bh = blockIdx.x;  // b * Hkv + h
  const int b = bh / p.shape.kv_heads, h = bh % p.shape.kv_heads;
  const int kv_len = kv_length(p, b);
  const int stride = max(1, kv_len / kMeanSamples) | 1;
  const int count = (kv_len + stride - 1) / stride;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* k_head = static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh + 4 * lane;
  float ksum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int first = warp; first < count; first += kMeanWarps * kMeanBatch) {
    // all of a batch's loads before its adds (as floats: with raw bytes ptxas interleaved the
    // adds and kept ~5 loads in flight)
    float x[kMeanBatch][4];
#pragma unroll
    for (int i = 0; i < kMeanBatch; ++i) {
      const int s = first + kMeanWarps * i;
      if (s < count) {
        unpack4(load_raw4(k_head + static_cast<int64_t>(s) * stride * p.k_ss), k_head, x[i]);
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
    for (int w = 0; w < kMeanWarps; ++w) s += ksum_shared[w][threadIdx.x];
    p.k_mean[static_cast<int64_t>(bh) * kD + threadIdx.x] =
        __fdiv_rn(s, static_cast<float>(max(count, 1)));
  }
}

// Q rows [blk * 64, +64) of query head bh: INT8 per token, its scale, and q . k_mean. A warp
// loads its 8 rows before quantizing any (one row in flight a warp left the launch
// latency-bound).
template <typename T>
__device__ void quantize_q_block(const SageQuantParams& p, int blk, int bh) {
  constexpr int kRowsPerWarp = kQRows / kWarps;
  const int b = bh / p.shape.heads, h = bh % p.shape.heads;
  const int kv_bh = b * p.shape.kv_heads + h / (p.shape.heads / p.shape.kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* q_head = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh + 4 * lane;
  const float* k_mean = p.k_mean + static_cast<int64_t>(kv_bh) * kD + 4 * lane;
  uint2 raw[kRowsPerWarp];
  {
    const int first_row = blk * kQRows + warp;
    const T* q_row = q_head + first_row * p.q_ss;
    const int64_t step = kWarps * p.q_ss;
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      raw[i] = first_row + kWarps * i < p.shape.seq_q ? load_raw4(q_row) : make_uint2(0u, 0u);
      q_row += step;
    }
  }
  const float4 km = *reinterpret_cast<const float4*>(k_mean);
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int row = blk * kQRows + warp + kWarps * i;
    if (row >= p.shape.seq_q) break;
    float x[4];
    unpack4(raw[i], q_head, x);
    const float amax = warp_max(fmaxf(fmaxf(fabsf(x[0]), fabsf(x[1])), fmaxf(fabsf(x[2]), fabsf(x[3]))));
    const TopScale to_top = top_scale(amax, 127.0f);
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) word |= round_half_away_byte(scale_to_top(x[j], to_top)) << (8 * j);
    const int64_t out_row = static_cast<int64_t>(bh) * p.shape.seq_q + row;
    reinterpret_cast<uint32_t*>(p.q_int8 + out_row * kD)[lane] = word;
    const float dot = warp_sum(x[0] * km.x + x[1] * km.y + x[2] * km.z + x[3] * km.w);
    if (lane == 0) {
      p.q_scale[out_row] = __fdiv_rn(amax, 127.0f);
      p.q_kmean[out_row] = dot;
    }
  }
}

// Keys [blk * 128, +128) of kv head bh: K smoothed to INT8 (one scale), V^T to FP8 (one scale).
// Every K and V row of the block is loaded (raw, 64 registers) before any math: one memory
// round trip a block instead of one for K and one for V. reduce_shared: 2 * kWarps floats.
template <typename T>
__device__ void quantize_kv_block(const SageQuantParams& p, int blk, int bh, uint8_t* v_staged,
                                  float* reduce_shared) {
  const int b = bh / p.shape.kv_heads, h = bh % p.shape.kv_heads;
  const int kv_len = kv_length(p, b);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int nblk = p.shape.seq_kv_pad / kKeys;
  const T* k_head = static_cast<const T*>(p.k) + b * p.k_sb + h * p.k_sh + 4 * lane;
  const T* v_head = static_cast<const T*>(p.v) + b * p.v_sb + h * p.v_sh + 4 * lane;
  constexpr int kRowsPerWarp = kKeys / kWarps;
  uint2 k_raw[kRowsPerWarp], v_raw[kRowsPerWarp];
  {
    // row pointers stepped, not recomputed from 64-bit products a row
    const int first_key = blk * kKeys + warp;
    const T* k_row = k_head + first_key * p.k_ss;
    const T* v_row = v_head + first_key * p.v_ss;
    const int64_t k_step = kWarps * p.k_ss, v_step = kWarps * p.v_ss;
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const bool valid = first_key + kWarps * i < kv_len;
      k_raw[i] = valid ? load_raw4(k_row) : make_uint2(0u, 0u);
      v_raw[i] = valid ? load_raw4(v_row) : make_uint2(0u, 0u);
      k_row += k_step;
      v_row += v_step;
    }
  }
  const float4 km = *reinterpret_cast<const float4*>(p.k_mean + static_cast<int64_t>(bh) * kD + 4 * lane);
  const float kmean[4] = {km.x, km.y, km.z, km.w};

  // ---- K minus its mean (padding keys stay 0): one INT8 scale for the block
  float kc[kRowsPerWarp][4];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const bool valid = blk * kKeys + warp + kWarps * i < kv_len;
    unpack4(k_raw[i], k_head, kc[i]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      kc[i][j] = valid ? kc[i][j] - kmean[j] : 0.0f;
      amax = fmaxf(amax, fabsf(kc[i][j]));
    }
  }
  amax = warp_max(amax);
  if (lane == 0) reduce_shared[warp] = amax;
  // ---- V: one FP8 scale from the block's maximum (padding keys: +0, outside it), taken on the
  // raw bits (see abs_max_bits): V's floats are made once, for the codes, and never kept
  uint32_t v_bits = 0;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) v_bits = max(v_bits, abs_max_bits(v_raw[i]));
  v_bits = __reduce_max_sync(0xffffffffu, v_bits);
  uint32_t* v_bits_shared = reinterpret_cast<uint32_t*>(reduce_shared + kWarps);
  if (lane == 0) v_bits_shared[warp] = v_bits;
  __syncthreads();
  amax = reduce_shared[0];
  v_bits = v_bits_shared[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) {
    amax = fmaxf(amax, reduce_shared[w]);
    v_bits = max(v_bits, v_bits_shared[w]);
  }
  float vmax = bits_to_float(v_bits, v_head);
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

  if (vmax > 0.0f) vmax = fmaxf(vmax, kVAmaxFloor);
  const TopScale v_to_top = top_scale(vmax, 448.0f);
  // staged as [key][d] bytes, written as [d][key]
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp + kWarps * i;
    // padding rows are +0: +0 * boost * inverse is +0, byte 0x00
    float vr[4], y[4];
    unpack4(v_raw[i], v_head, vr);
#pragma unroll
    for (int j = 0; j < 4; ++j) y[j] = fminf(fmaxf(scale_to_top(vr[j], v_to_top), -448.0f), 448.0f);
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(y[0], y[1]), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(y[2], y[3]), __NV_SATFINITE, __NV_E4M3);
    reinterpret_cast<uint32_t*>(v_staged + r * kStagedRowBytes)[lane] = lo | (hi << 16);
  }
  if (threadIdx.x == 0) p.v_scale[static_cast<int64_t>(bh) * nblk + blk] = __fdiv_rn(vmax, 448.0f);
  __syncthreads();
  // V^T: 32 quads of channels x 8 groups of 16 keys, a (quad, group) a thread. A thread reads
  // its 16 keys' words of 4 channels (one LDS.32 each), transposes them 4 x 4 bytes at a time
  // (8 byte permutes), and writes 16 keys of each of its 4 channels (16 bytes each). The two
  // lanes of a pair take adjacent groups of one quad: each channel row gets 32 contiguous bytes
  // a pair (whole sectors), and their key rows, 16 apart, fall in disjoint banks.
  uint8_t* vt_block = p.v_fp8 + static_cast<int64_t>(bh) * kD * p.shape.seq_kv_pad + blk * kKeys;
  const int quad = 16 * (warp / 4) + lane / 2;
  const int group = 2 * (warp % 4) + lane % 2;
  uint32_t column[16];  // column c of the group (key 16 group + within(c)): channels 4 quad + 0..3
#pragma unroll
  for (int c = 0; c < 16; ++c) {
    // column 4t + i of a group holds key 2t + i % 2 + 8 (i / 2) when permuted
    const int within = p.permute_v ? 2 * (c / 4) + (c % 2) + 8 * ((c % 4) / 2) : c;
    column[c] = *reinterpret_cast<const uint32_t*>(v_staged + (16 * group + within) * kStagedRowBytes + 4 * quad);
  }
  uint32_t rows[4][4];  // rows[i][w]: channel 4 quad + i, columns 4w..4w+3
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const uint32_t* c4 = column + 4 * w;
    const uint32_t lo01 = __byte_perm(c4[0], c4[1], 0x5140), lo23 = __byte_perm(c4[2], c4[3], 0x5140);
    const uint32_t hi01 = __byte_perm(c4[0], c4[1], 0x7362), hi23 = __byte_perm(c4[2], c4[3], 0x7362);
    rows[0][w] = __byte_perm(lo01, lo23, 0x5410);
    rows[1][w] = __byte_perm(lo01, lo23, 0x7632);
    rows[2][w] = __byte_perm(hi01, hi23, 0x5410);
    rows[3][w] = __byte_perm(hi01, hi23, 0x7632);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    *reinterpret_cast<uint4*>(vt_block + static_cast<int64_t>(4 * quad + i) * p.shape.seq_kv_pad + 16 * group) =
        make_uint4(rows[i][0], rows[i][1], rows[i][2], rows[i][3]);
  }
}

// Two blocks an SM (128 registers; ptxas spills ~30 bytes a thread there): without the minimum
// it took 139-215 registers, one block an SM, and the launch ran markedly slower.
template <typename T>
__global__ void __launch_bounds__(kThreads, 2) qkv_codes_kernel(const SageQuantParams p) {
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
  if (kv_bh > 0) k_mean_kernel<T><<<static_cast<unsigned>(kv_bh), kMeanThreads, 0, stream>>>(p);
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
