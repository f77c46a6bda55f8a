// Fused QK-RMSNorm + rotary embedding: the kernel template and its launcher.
//
// One launch covers q and k. With the per-head norm one thread block per token (b, s) handles
// that token's q row [Hq, D] and k row [Hk, D]; with the norm across heads, one block per token
// and tensor. Each thread owns one 16-byte vector
// (8 half-precision values) of a row; the D/8 threads of a head sit in one warp, so a per-head
// mean square is a shuffle reduction, and the rotate-half partner (element j + D/2) is the lane
// D/16 away. Interleaved pairs (2i, 2i+1) sit inside one vector and need no exchange.
// Everything is computed in float32 and rounded once on store.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../cuda_compat.h"
#include "../vector_io.cuh"
#include "qk_norm_rope_params.h"

namespace omni {
namespace qk_norm_rope {

// The shared helpers of ../vector_io.cuh move one vector of kVectorElements values.
static_assert(kVectorElements == kHalfVectorElements, "vector width differs from vector_io.cuh");

template <typename T>
__device__ __forceinline__ void load_weight(const void* weight, bool weight_fp32, int64_t offset,
                                            float (&out)[kVectorElements]) {
  if (weight == nullptr) {
#pragma unroll
    for (int i = 0; i < kVectorElements; ++i) out[i] = 1.0f;
  } else {
    load_half_or_float_vector<T>(weight, weight_fp32, offset, out);
  }
}

template <int kThreadsPerHead>
__device__ __forceinline__ float head_sum(float value) {
  // The kThreadsPerHead lanes of a head are aligned within the warp, so xor offsets below
  // kThreadsPerHead never leave the head.
#pragma unroll
  for (int offset = kThreadsPerHead / 2; offset > 0; offset /= 2) {
    value += OMNI_SHFL_XOR(OMNI_FULL_MASK, value, offset, OMNI_WARP_SIZE);
  }
  return value;
}

// Sums `value` over the whole block; every thread gets the total.
__device__ __forceinline__ float2 block_sum(float2 value, float2* shared /* [32] */) {
#pragma unroll
  for (int offset = OMNI_WARP_SIZE / 2; offset > 0; offset /= 2) {
    value.x += OMNI_SHFL_XOR(OMNI_FULL_MASK, value.x, offset, OMNI_WARP_SIZE);
    value.y += OMNI_SHFL_XOR(OMNI_FULL_MASK, value.y, offset, OMNI_WARP_SIZE);
  }
  const int warp = threadIdx.x / OMNI_WARP_SIZE;
  const int lane = threadIdx.x % OMNI_WARP_SIZE;
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  const int num_warps = blockDim.x / OMNI_WARP_SIZE;
  float2 total = make_float2(0.0f, 0.0f);
  for (int w = 0; w < num_warps; ++w) {
    total.x += shared[w].x;
    total.y += shared[w].y;
  }
  return total;
}

// Scales by inv_rms and the weight, rotates, and stores one vector.
template <typename T, int kHeadDim, bool kInterleaved>
__device__ __forceinline__ void normalize_rotate_store(float (&x)[kVectorElements],
                                                       float inv_rms, const void* weight,
                                                       bool weight_fp32, int64_t weight_offset,
                                                       const float (&cos_v)[kVectorElements],
                                                       const float (&sin_v)[kVectorElements],
                                                       int lane_in_head, T* out) {
  constexpr int kThreadsPerHead = kHeadDim / kVectorElements;
  float w[kVectorElements];
  load_weight<T>(weight, weight_fp32, weight_offset, w);
#pragma unroll
  for (int i = 0; i < kVectorElements; ++i) x[i] = x[i] * inv_rms * w[i];

  float rotated[kVectorElements];
  if constexpr (kInterleaved) {
#pragma unroll
    for (int i = 0; i < kVectorElements; i += 2) {
      rotated[i] = -x[i + 1];
      rotated[i + 1] = x[i];
    }
  } else {
    // Lanes of the first half of the head take -(partner), the second half +(partner).
    const float sign = lane_in_head < kThreadsPerHead / 2 ? -1.0f : 1.0f;
#pragma unroll
    for (int i = 0; i < kVectorElements; ++i) {
      rotated[i] =
          sign * OMNI_SHFL_XOR(OMNI_FULL_MASK, x[i], kThreadsPerHead / 2, OMNI_WARP_SIZE);
    }
  }
  float result[kVectorElements];
#pragma unroll
  for (int i = 0; i < kVectorElements; ++i) result[i] = x[i] * cos_v[i] + rotated[i] * sin_v[i];
  store_vector(out, result);
}

// Per-head norm. Grid: one block per token (B * S blocks), covering both q and k, so their
// loads are in flight together. Block: a multiple of the warp size; loops if a row is longer.
template <typename T, int kHeadDim, bool kInterleaved>
__global__ void qk_rmsnorm_rope_per_head_kernel(const Params p) {
  constexpr int kThreadsPerHead = kHeadDim / kVectorElements;
  static_assert(kThreadsPerHead <= OMNI_WARP_SIZE && OMNI_WARP_SIZE % kThreadsPerHead == 0,
                "a head's lanes must fit in one warp");

  const int64_t token = blockIdx.x;
  const int64_t b = token / p.seq_len;
  const int64_t s = token % p.seq_len;
  const int q_vectors = p.heads_q * kThreadsPerHead;
  const int k_vectors = p.heads_k * kThreadsPerHead;
  const int row_vectors = q_vectors > k_vectors ? q_vectors : k_vectors;

  const T* q_row = static_cast<const T*>(p.q) + b * p.q_batch_stride + s * p.q_seq_stride;
  const T* k_row = static_cast<const T*>(p.k) + b * p.k_batch_stride + s * p.k_seq_stride;
  T* q_out_row = static_cast<T*>(p.q_out) + b * p.q_out_batch_stride + s * p.q_out_seq_stride;
  T* k_out_row = static_cast<T*>(p.k_out) + b * p.k_out_batch_stride + s * p.k_out_seq_stride;

  // Uniform trip count across the block: the shuffles need every lane of a warp present.
  for (int base = 0; base < row_vectors; base += blockDim.x) {
    const int v = base + threadIdx.x;
    const bool has_q = v < q_vectors;
    const bool has_k = v < k_vectors;
    const int lane_in_head = v % kThreadsPerHead;
    const int dim_offset = lane_in_head * kVectorElements;

    // Issue every global load before the first use.
    float xq[kVectorElements] = {};
    float xk[kVectorElements] = {};
    float cos_v[kVectorElements];
    float sin_v[kVectorElements];
    if (has_q) load_vector(q_row + v * kVectorElements, xq);
    if (has_k) load_vector(k_row + v * kVectorElements, xk);
    load_float_vector(p.cos + s * kHeadDim + dim_offset, cos_v);
    load_float_vector(p.sin + s * kHeadDim + dim_offset, sin_v);

    float sum_sq_q = 0.0f, sum_sq_k = 0.0f;
#pragma unroll
    for (int i = 0; i < kVectorElements; ++i) {
      sum_sq_q += xq[i] * xq[i];
      sum_sq_k += xk[i] * xk[i];
    }
    const float inv_rms_q = rsqrtf(head_sum<kThreadsPerHead>(sum_sq_q) / kHeadDim + p.eps);
    const float inv_rms_k = rsqrtf(head_sum<kThreadsPerHead>(sum_sq_k) / kHeadDim + p.eps);
    // Each head's lanes are all valid or all invalid, so the rotate-half shuffle inside
    // normalize_rotate_store always finds its partner; lanes past the row still take part.
    if constexpr (kInterleaved) {
      if (has_q)
        normalize_rotate_store<T, kHeadDim, kInterleaved>(xq, inv_rms_q, p.q_weight,
                                                          p.q_weight_fp32, dim_offset, cos_v,
                                                          sin_v, lane_in_head,
                                                          q_out_row + v * kVectorElements);
      if (has_k)
        normalize_rotate_store<T, kHeadDim, kInterleaved>(xk, inv_rms_k, p.k_weight,
                                                          p.k_weight_fp32, dim_offset, cos_v,
                                                          sin_v, lane_in_head,
                                                          k_out_row + v * kVectorElements);
    } else {
      // Every lane runs the shuffles; the out-of-row ones write to a scratch vector.
      alignas(16) T scratch[kVectorElements];
      normalize_rotate_store<T, kHeadDim, kInterleaved>(
          xq, inv_rms_q, has_q ? p.q_weight : nullptr, p.q_weight_fp32, dim_offset, cos_v,
          sin_v, lane_in_head, has_q ? q_out_row + v * kVectorElements : scratch);
      normalize_rotate_store<T, kHeadDim, kInterleaved>(
          xk, inv_rms_k, has_k ? p.k_weight : nullptr, p.k_weight_fp32, dim_offset, cos_v,
          sin_v, lane_in_head, has_k ? k_out_row + v * kVectorElements : scratch);
    }
  }
}

// Norm over all H*D values of a token (Wan). Grid: (B * S, 2); blockIdx.y picks q (0) or k (1).
// One tensor per block keeps registers low enough for two 640-thread blocks per SM, so one
// block's loads overlap the other's barrier. Block: covers the longer row in one pass
// (checked on the host), so every value stays in registers between the reduction and the store.
template <typename T, int kHeadDim, bool kInterleaved>
__global__ void qk_rmsnorm_rope_across_heads_kernel(const Params p) {
  constexpr int kThreadsPerHead = kHeadDim / kVectorElements;
  __shared__ float2 reduce_shared[kMaxThreads / OMNI_WARP_SIZE];

  const int64_t token = blockIdx.x;
  const int64_t b = token / p.seq_len;
  const int64_t s = token % p.seq_len;
  const bool is_q = blockIdx.y == 0;
  const T* row = static_cast<const T*>(is_q ? p.q : p.k) +
                 b * (is_q ? p.q_batch_stride : p.k_batch_stride) +
                 s * (is_q ? p.q_seq_stride : p.k_seq_stride);
  T* out_row = static_cast<T*>(is_q ? p.q_out : p.k_out) +
               b * (is_q ? p.q_out_batch_stride : p.k_out_batch_stride) +
               s * (is_q ? p.q_out_seq_stride : p.k_out_seq_stride);
  const void* weight = is_q ? p.q_weight : p.k_weight;
  const bool weight_fp32 = is_q ? p.q_weight_fp32 : p.k_weight_fp32;
  const int vectors = (is_q ? p.heads_q : p.heads_k) * kThreadsPerHead;

  const int v = threadIdx.x;
  const bool active = v < vectors;
  const int lane_in_head = v % kThreadsPerHead;
  const int dim_offset = lane_in_head * kVectorElements;
  float x[kVectorElements] = {};
  float cos_v[kVectorElements];
  float sin_v[kVectorElements];
  if (active) load_vector(row + v * kVectorElements, x);
  load_float_vector(p.cos + s * kHeadDim + dim_offset, cos_v);
  load_float_vector(p.sin + s * kHeadDim + dim_offset, sin_v);

  float sum_sq = 0.0f;
#pragma unroll
  for (int i = 0; i < kVectorElements; ++i) sum_sq += x[i] * x[i];
  const float total = block_sum(make_float2(sum_sq, 0.0f), reduce_shared).x;
  const float inv_rms = rsqrtf(total / static_cast<float>(vectors * kVectorElements) + p.eps);
  const int64_t weight_offset = static_cast<int64_t>(v) * kVectorElements;
  if constexpr (kInterleaved) {
    if (active)
      normalize_rotate_store<T, kHeadDim, kInterleaved>(x, inv_rms, weight, weight_fp32,
                                                        weight_offset, cos_v, sin_v,
                                                        lane_in_head, out_row + weight_offset);
  } else {
    alignas(16) T scratch[kVectorElements];
    normalize_rotate_store<T, kHeadDim, kInterleaved>(
        x, inv_rms, active ? weight : nullptr, weight_fp32, active ? weight_offset : 0, cos_v,
        sin_v, lane_in_head, active ? out_row + weight_offset : scratch);
  }
}

template <typename T, int kHeadDim>
void launch_for_head_dim(const Params& params, int64_t num_tokens, bool interleaved,
                         bool norm_across_heads, int threads, cudaStream_t stream) {
  const dim3 block(threads);
  if (norm_across_heads) {
    const dim3 grid(static_cast<unsigned>(num_tokens), 2);
    if (interleaved)
      qk_rmsnorm_rope_across_heads_kernel<T, kHeadDim, true><<<grid, block, 0, stream>>>(params);
    else
      qk_rmsnorm_rope_across_heads_kernel<T, kHeadDim, false><<<grid, block, 0, stream>>>(params);
  } else {
    const dim3 grid(static_cast<unsigned>(num_tokens));
    if (interleaved)
      qk_rmsnorm_rope_per_head_kernel<T, kHeadDim, true><<<grid, block, 0, stream>>>(params);
    else
      qk_rmsnorm_rope_per_head_kernel<T, kHeadDim, false><<<grid, block, 0, stream>>>(params);
  }
}

// Explicitly instantiated per dtype in qk_norm_rope_{bf16,fp16}.cu, so the two compile in
// parallel. head_dim is one of 64, 128, 256 (checked by the caller).
template <typename T>
void launch_qk_rmsnorm_rope(const Params& params, int64_t num_tokens, int head_dim,
                            bool interleaved, bool norm_across_heads, int threads,
                            cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      launch_for_head_dim<T, 64>(params, num_tokens, interleaved, norm_across_heads, threads,
                                 stream);
      break;
    case 128:
      launch_for_head_dim<T, 128>(params, num_tokens, interleaved, norm_across_heads, threads,
                                  stream);
      break;
    case 256:
      launch_for_head_dim<T, 256>(params, num_tokens, interleaved, norm_across_heads, threads,
                                  stream);
      break;
  }
}

}  // namespace qk_norm_rope
}  // namespace omni
